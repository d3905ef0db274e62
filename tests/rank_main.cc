// One trainer rank, as a separate process, for the integration tests: opens
// a session of the test job on a real dmuond, sends the job's gradients step
// by step (from the session's first step, so a resumed job continues), and
// checks every update against the fp64 reference.
// Exit: 0 all updates matched; 1 a mismatch; 2 an error (printed); 3 the
// error that --expect names happened.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "tests/muon_job.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "address, or a comma-separated pool");
ABSL_FLAG(std::string, job, "job", "");
ABSL_FLAG(int, rank, 0, "");
ABSL_FLAG(int, world, 1, "");
ABSL_FLAG(std::string, transport, "shm", "shm|inline");
ABSL_FLAG(int, steps, 10, "run until this step (inclusive)");
ABSL_FLAG(uint64_t, seed, 1, "");
ABSL_FLAG(int, die_at_step, 0, "SIGKILL this process mid-step at this step");
ABSL_FLAG(std::string, expect, "",
          "an error message substring that is expected");
ABSL_FLAG(double, tolerance, 1e-4, "relative error per parameter and step");
ABSL_FLAG(int, deadline_ms, 60000, "");
ABSL_FLAG(bool, doorbell, true,
          "shm: ask for the doorbell (ClientOptions::doorbell) "
          "and check that the session has it exactly when asked");
ABSL_FLAG(bool, hand_off, false,
          "hand each gradient off with Session::HandOff (copy and declare in "
          "one call), after checking that it refuses a wrong size or two "
          "momentum values without declaring anything");

namespace {

// Parameter p's gradient handed off by Session::HandOff, after two calls it
// must refuse with INVALID_ARGUMENT naming the parameter, before writing or
// declaring anything (the update check after would see a lost or a
// corrupted gradient).
absl::Status HandOff(dmuon::Session& s, int p, const std::vector<float>& g) {
  const std::string name = absl::StrCat("parameter ", p);
  const absl::Span<float> buf = s.gradient(p);
  std::fill(buf.begin(), buf.end(), -7.0f);  // what the refusals must leave
  const auto untouched = [&] {
    return std::all_of(buf.begin(), buf.end(),
                       [](float x) { return x == -7.0f; });
  };
  if (!g.empty()) {  // (a rank may hold no rows of it)
    const std::vector<float> shorter(g.begin(), g.end() - 1);
    absl::Status st = s.HandOff(p, shorter);
    if (!absl::IsInvalidArgument(st) ||
        !absl::StrContains(st.message(), name)) {
      return absl::InternalError(
          absl::StrCat("HandOff of a short gradient: ", st.ToString()));
    }
  }
  const double two[] = {0.9, 0.9};
  absl::Status st = s.HandOff(p, g, two);
  if (!absl::IsInvalidArgument(st) || !absl::StrContains(st.message(), name)) {
    return absl::InternalError(
        absl::StrCat("HandOff with two momenta: ", st.ToString()));
  }
  if (!untouched()) {
    return absl::InternalError(absl::StrCat(
        "a refused HandOff wrote into parameter ", p, "'s buffer"));
  }
  return s.HandOff(p, g);
}

int Error(const absl::Status& st) {
  const std::string expect = absl::GetFlag(FLAGS_expect);
  if (!expect.empty() &&
      std::string(st.message()).find(expect) != std::string::npos) {
    std::printf("rank %d: expected error: %s\n", absl::GetFlag(FLAGS_rank),
                st.ToString().c_str());
    return 3;
  }
  std::fprintf(stderr, "rank %d: %s\n", absl::GetFlag(FLAGS_rank),
               st.ToString().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int rank = absl::GetFlag(FLAGS_rank),
            world = absl::GetFlag(FLAGS_world);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  dmuon::ClientOptions o;
  o.deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  o.doorbell = absl::GetFlag(FLAGS_doorbell);
  // Several comma-separated addresses: a pool of daemons.
  const std::vector<std::string> servers =
      absl::StrSplit(absl::GetFlag(FLAGS_server), ',');
  auto client = servers.size() > 1 ? dmuon::Client::ConnectPool(servers, o)
                                   : dmuon::Client::Connect(servers[0], o);
  if (!client.ok()) return Error(client.status());
  dmuon::SessionSpec spec;
  spec.job_id = absl::GetFlag(FLAGS_job);
  spec.rank = rank;
  spec.world_size = world;
  spec.params = dmuon::testing::TestTable(rank, world);
  spec.transport = absl::GetFlag(FLAGS_transport) == "inline"
                       ? dmuon::TransportChoice::kInline
                       : dmuon::TransportChoice::kShm;
  auto session = (*client)->OpenSession(spec);
  if (!session.ok()) return Error(session.status());
  dmuon::Session& s = **session;
  if (s.doorbell() !=
      (o.doorbell && spec.transport == dmuon::TransportChoice::kShm)) {
    std::fprintf(stderr, "rank %d: doorbell %s, asked %s\n", rank,
                 s.doorbell() ? "granted" : "absent",
                 o.doorbell ? "yes" : "no");
    return 1;
  }
  dmuon::testing::Reference ref(seed, world);
  int mismatches = 0;
  for (int64_t step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    auto want = ref.Step(step);
    if (step < s.step()) continue;  // a resumed job: already done before
    // Hand gradients over in reverse forward order, as backward produces them.
    for (int p = static_cast<int>(spec.params.size()) - 1; p >= 0; --p) {
      auto g = dmuon::testing::View(
          dmuon::testing::Gradient(seed, step, p, rank, world), spec.params[p]);
      if (absl::GetFlag(FLAGS_hand_off)) {
        if (auto st = HandOff(s, p, g); !st.ok()) return Error(st);
      } else {
        auto dst = s.gradient(p);
        std::copy(g.begin(), g.end(), dst.begin());
        if (auto st = s.GradientReady(p); !st.ok()) return Error(st);
      }
      if (step == absl::GetFlag(FLAGS_die_at_step) && p == 2) {
        std::fflush(stdout);
        kill(getpid(), SIGKILL);
      }
    }
    for (int p = 0; p < static_cast<int>(spec.params.size()); ++p) {
      if (auto st = s.WaitUpdate(p); !st.ok()) return Error(st);
      auto u = s.update(p);
      const double err = dmuon::testing::RelativeError(
          std::vector<float>(u.begin(), u.end()),
          dmuon::testing::View(want[p], spec.params[p]));
      if (!(err <= absl::GetFlag(FLAGS_tolerance))) {
        std::fprintf(stderr, "rank %d step %lld %s: relative error %.3g\n",
                     rank, static_cast<long long>(step),
                     spec.params[p].name.c_str(), err);
        ++mismatches;
      }
    }
    if (auto st = s.FinishStep(); !st.ok()) return Error(st);
  }
  if (auto st = s.Close(); !st.ok()) return Error(st);
  std::printf("rank %d of job %s: %d steps on %s%s, %d mismatches\n", rank,
              spec.job_id.c_str(), absl::GetFlag(FLAGS_steps),
              s.transport().c_str(), s.doorbell() ? " (doorbell)" : "",
              mismatches);
  return mismatches == 0 ? 0 : 1;
}
