// A trainer rank as a process, for tests/fault_test.cc: steps a varied job
// (tests/varied_job.h) on a real dmuond, every update checked against the
// fp64 reference, and logs its progress to --progress with write(2) (so the
// lines survive a SIGKILL of this process):
//   open <shm segment>|inline <next step>   session opened
//   begin N                                 step N: first gradient coming
//   last N                                  the last gradient of N is being
//                                           declared (N may complete now)
//   done N                                  FinishStep(N) returned
//   mismatch N <what>                       an update off the reference
//   error <status>                          the session failed
// Modes:
//   victim     steps until killed; after an error (its peer rank was
//              killed) it waits to be killed.
//   bystander  steps for --seconds (or --steps steps), closes; exit 0 if
//              every update matched, 1 on a mismatch, 2 on an error.
//   no_attach  only OpenSession (raw gRPC, shm), logs "shm <name>" and waits
//              to be killed: its session never attaches.

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "client/client.h"
#include "proto/dmuon.grpc.pb.h"
#include "tests/proc_stats.h"
#include "tests/varied_job.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "");
ABSL_FLAG(std::string, mode, "victim", "victim | bystander | no_attach");
ABSL_FLAG(std::string, job, "job", "");
ABSL_FLAG(int, rank, 0, "");
ABSL_FLAG(int, world, 1, "");
ABSL_FLAG(int, params, 12, "parameters of the varied job");
ABSL_FLAG(uint64_t, seed, 1, "the job's seed (shapes and gradients)");
ABSL_FLAG(std::string, transport, "shm", "shm | inline");
ABSL_FLAG(std::string, progress, "", "file the progress lines go to");
ABSL_FLAG(double, seconds, 10, "bystander: how long to step");
ABSL_FLAG(int, steps, 0,
          "bystander: step exactly this many steps instead (> 0; the ranks "
          "of a job must agree on when to close)");
ABSL_FLAG(int, pause_us, 2000,
          "victim: up to this many microseconds (random) before each "
          "GradientReady, so that a kill lands mid-step");

namespace {

int progress_fd = -1;

void Log(const std::string& line) {
  const std::string l = line + "\n";
  if (progress_fd >= 0) (void)!write(progress_fd, l.data(), l.size());
}

[[noreturn]] void WaitToBeKilled() {
  for (;;) pause();
}

int NoAttach() {
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_server),
                                     grpc::InsecureChannelCredentials());
  auto stub = dmuon::v1::Optimizer::NewStub(channel);
  dmuon::v1::OpenSessionRequest req;
  req.set_protocol_version(dmuon::v1::PROTOCOL_VERSION_1);
  req.set_job_id(absl::GetFlag(FLAGS_job));
  req.set_world_size(1);
  req.set_transport(dmuon::v1::TRANSPORT_SHM);
  auto* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(16);
  p->add_shape(32);
  dmuon::v1::OpenSessionResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const grpc::Status st = stub->OpenSession(&ctx, req, &resp);
  if (!st.ok()) {
    Log("error " + st.error_message());
    return 2;
  }
  std::string name = resp.shm_name();
  if (!name.empty() && name[0] == '/') name.erase(0, 1);
  Log("shm " + name);
  WaitToBeKilled();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_progress).empty()) {
    progress_fd = open(absl::GetFlag(FLAGS_progress).c_str(),
                       O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "no_attach") return NoAttach();
  const bool victim = mode == "victim";
  const int rank = absl::GetFlag(FLAGS_rank);
  const dmuon::testing::VariedJob job = dmuon::testing::MakeVariedJob(
      absl::GetFlag(FLAGS_job), absl::GetFlag(FLAGS_seed),
      absl::GetFlag(FLAGS_params), absl::GetFlag(FLAGS_world));
  const auto fail = [&](const absl::Status& st) {
    Log("error " + st.ToString());
    std::fprintf(stderr, "%s rank %d: %s\n", job.id.c_str(), rank,
                 st.ToString().c_str());
    if (victim) WaitToBeKilled();
    return 2;
  };
  dmuon::ClientOptions o;
  o.deadline = std::chrono::seconds(120);
  auto client = dmuon::Client::Connect(absl::GetFlag(FLAGS_server), o);
  if (!client.ok()) return fail(client.status());
  const dmuon::SessionSpec spec =
      dmuon::testing::VariedSpec(job, rank,
                                 absl::GetFlag(FLAGS_transport) == "inline"
                                     ? dmuon::TransportChoice::kInline
                                     : dmuon::TransportChoice::kShm);
  auto session = (*client)->OpenSession(spec);
  if (!session.ok()) return fail(session.status());
  dmuon::Session& s = **session;
  const std::string segment = dmuon::testing::MappedShmSegment();
  Log("open " + (segment.empty() ? std::string("inline") : segment) + " " +
      std::to_string(s.step()));
  dmuon::testing::Reference ref = dmuon::testing::VariedReference(job);
  while (ref.completed() + 1 < s.step()) ref.Advance(ref.completed() + 1);
  std::mt19937_64 rng(std::random_device{}());
  const int pause_us = absl::GetFlag(FLAGS_pause_us);
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds));
  const int steps = absl::GetFlag(FLAGS_steps);
  int64_t mismatches = 0;
  while (victim || (steps > 0 ? ref.completed() < steps
                              : std::chrono::steady_clock::now() < end)) {
    const int64_t step = s.step();
    Log("begin " + std::to_string(step));
    auto r = dmuon::testing::RunVariedStep(
        s, job, spec, [&] { return ref.Step(step); },
        [&](int p) {
          if (victim && pause_us > 0)
            std::this_thread::sleep_for(
                std::chrono::microseconds(rng() % pause_us));
          if (p == 0) Log("last " + std::to_string(step));
        });
    if (!r.ok()) return fail(r.status());
    if (r->mismatches > 0) {
      mismatches += r->mismatches;
      Log("mismatch " + std::to_string(step) + " " + r->first);
      std::fprintf(stderr, "%s\n", r->first.c_str());
    }
    Log("done " + std::to_string(step));
  }
  if (auto st = s.Close(); !st.ok()) return fail(st);
  std::printf("%s rank %d: %lld steps, %lld mismatches\n", job.id.c_str(), rank,
              static_cast<long long>(ref.completed()),
              static_cast<long long>(mismatches));
  return mismatches == 0 ? 0 : 1;
}
