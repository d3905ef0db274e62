// dmuond end to end: the real daemon binary on loopback, driven by real
// rank processes through the client library; every update of every step
// compared (in the rank processes) with the fp64 Muon reference.

#include <dirent.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
#include "kernels/blas_core.h"
#include "proto/dmuon.grpc.pb.h"
#include "proto/reflection.grpc.pb.h"
#include "server/testing/temp_dir.h"
#include "tests/muon_job.h"
#include "tests/process.h"
#include "transport/doorbell.h"
#include "transport/transport.h"

namespace dmuon::testing {
namespace {

std::unique_ptr<Process> Rank(const Daemon& d, const std::string& job, int rank,
                              int world, const std::string& transport,
                              int steps, uint64_t seed,
                              std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {Runfile("tests/rank_main"),
                                   "--server=" + d.address(),
                                   "--job=" + job,
                                   "--rank=" + std::to_string(rank),
                                   "--world=" + std::to_string(world),
                                   "--transport=" + transport,
                                   "--steps=" + std::to_string(steps),
                                   "--seed=" + std::to_string(seed)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return std::make_unique<Process>(argv);
}

uint64_t Seed() { return std::random_device{}(); }

int ShmSegments() {
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      n += std::string(e->d_name).rfind("dmuon-", 0) == 0;
    closedir(d);
  }
  return n;
}

TEST(Daemon, FourRanksShmAndFourRanksInlineTenSteps) {
  Daemon d({"--cpu-executors=2", "--metrics-port=0"});
  ASSERT_NE(d.port(), 0) << d.log();
  const uint64_t seed = Seed();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.push_back(Rank(d, "shm-job", r, 4, "shm", 10, seed));
  for (int r = 0; r < 4; ++r)
    ranks.push_back(Rank(d, "inline-job", r, 4, "inline", 10, seed + 1));
  for (auto& p : ranks)
    EXPECT_EQ(p->Wait(240), 0) << "seed " << seed << "\n" << d.log();
  int code;
  const std::string status = Ctl(d.address(), {"status", "--json"}, &code);
  EXPECT_EQ(code, 0) << status;
  EXPECT_NE(status.find("\"jobId\": \"shm-job\""), std::string::npos) << status;
  EXPECT_NE(status.find("\"completedSteps\": \"10\""), std::string::npos)
      << status;
  // Per-step load: each job's plan and its last step's compute time per
  // executor (the executors' sums are 0 again: every rank has closed).
  v1::StatusResponse s;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(status, &s).ok())
      << status;
  ASSERT_EQ(s.executors_size(), 2);
  for (const auto& e : s.executors()) {
    EXPECT_EQ(e.predicted_step_seconds(), 0) << status;
    EXPECT_EQ(e.measured_step_seconds(), 0) << status;
  }
  ASSERT_EQ(s.jobs_size(), 2);
  for (const auto& j : s.jobs()) {
    ASSERT_EQ(j.executor_loads_size(), 2) << status;
    double predicted = 0;
    for (const auto& l : j.executor_loads()) {
      const double p = l.predicted_step_seconds();
      const double m = l.measured_step_seconds();
      EXPECT_TRUE(std::isfinite(p) && p >= 0 && p < 60) << status;
      EXPECT_TRUE(std::isfinite(m) && m >= 0 && m < 60) << status;
      EXPECT_EQ(p > 0, m > 0) << "measured where planned\n" << status;
      predicted += p;
    }
    EXPECT_GT(predicted, 0) << status;
  }
}

// The same job with updates announced on the Step stream (UpdatesReady)
// instead of the update doorbell (ClientOptions::doorbell = false):
// both announcement paths stay exact, and each session has the one asked for
// (rank_main checks).
TEST(Daemon, ShmUpdatesOnTheStreamWhenTheDoorbellIsOff) {
  Daemon d({"--cpu-executors=2"});
  ASSERT_NE(d.port(), 0) << d.log();
  const uint64_t seed = Seed();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(
        Rank(d, "stream-job", r, 2, "shm", 6, seed, {"--doorbell=false"}));
  }
  for (int r = 0; r < 2; ++r)
    ranks.push_back(Rank(d, "doorbell-job", r, 2, "shm", 6, seed));
  for (auto& p : ranks)
    EXPECT_EQ(p->Wait(240), 0) << "seed " << seed << "\n" << d.log();
}

// Session::HandOff (one call copies a gradient in and declares it; the
// Python client's hand-off of CPU float32 gradients) on shm, with and
// without the doorbell, and inline: every update matches the fp64
// reference, and its refusals (a short gradient, two momentum values)
// declare nothing (rank_main --hand_off checks them every step).
TEST(Daemon, HandOffCopiesAndDeclaresInOneCall) {
  Daemon d({"--cpu-executors=2"});
  ASSERT_NE(d.port(), 0) << d.log();
  struct Job {
    const char* name;
    const char* transport;
    std::vector<std::string> flags;
  };
  const Job jobs[] = {{"doorbell-job", "shm", {"--hand_off"}},
                      {"stream-job", "shm", {"--hand_off", "--doorbell=false"}},
                      {"inline-job", "inline", {"--hand_off"}}};
  const uint64_t seed = Seed();
  std::vector<std::unique_ptr<Process>> ranks;
  for (const Job& j : jobs) {
    for (int r = 0; r < 2; ++r)
      ranks.push_back(Rank(d, j.name, r, 2, j.transport, 4, seed, j.flags));
  }
  for (auto& p : ranks)
    EXPECT_EQ(p->Wait(240), 0) << "seed " << seed << "\n" << d.log();
}

// A doorbell session's WaitUpdate sleeps on the doorbell (dmuond wakes
// the client only while one of its threads waits: docs/protocol.md "Who is
// woken") and returns as soon as its stream ends: the client's stream
// reader wakes it, not the wait's 2 s defensive cap.
TEST(Daemon, AWaitOnTheDoorbellEndsWhenTheStreamDoes) {
  Daemon d({"--cpu-executors=1"});
  ASSERT_NE(d.port(), 0) << d.log();
  auto client = Client::Connect(d.address(), ClientOptions{});
  ASSERT_TRUE(client.ok()) << client.status();
  SessionSpec spec;
  spec.job_id = "waits";
  spec.params = TestTable(0, 1);
  spec.transport = TransportChoice::kShm;
  auto session = (*client)->OpenSession(spec);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->doorbell());
  using Clock = std::chrono::steady_clock;
  Clock::time_point returned;
  absl::Status waited;
  // Nothing declared: no update comes, the wait sleeps until the stream
  // ends.
  std::thread waiter([&] {
    waited = (*session)->WaitUpdate(0);
    returned = Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const Clock::time_point closing = Clock::now();
  (void)(*session)->Close();
  waiter.join();
  EXPECT_FALSE(waited.ok());
  EXPECT_GT(returned, closing) << "the wait ended before the stream did";
  EXPECT_LT(returned - closing, std::chrono::milliseconds(1000))
      << "woken by the cap, not by the stream's end: " << waited;
}

TEST(Daemon, InlineTensorsLargerThanTheMessageLimitTravelInChunks) {
  // 16 KiB messages; the job's tensors are up to 32 KiB (128x64 fp32), so
  // both gradients and updates must be split to pass at all.
  Daemon d({"--max-message-bytes=16384"});
  const uint64_t seed = Seed();
  auto a = Rank(d, "chunks", 0, 2, "inline", 3, seed);
  auto b = Rank(d, "chunks", 1, 2, "inline", 3, seed);
  EXPECT_EQ(a->Wait(60), 0) << d.log();
  EXPECT_EQ(b->Wait(60), 0) << d.log();
}

TEST(Daemon, HealthStatusMetricsAndDrain) {
  Daemon d({"--metrics-port=0"});
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
  EXPECT_EQ(code, 0);
  auto p = Rank(d, "j", 0, 1, "shm", 2, Seed());
  EXPECT_EQ(p->Wait(60), 0);
  const std::string table = Ctl(d.address(), {"status"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(table.find("cpu:0"), std::string::npos) << table;
  for (const char* column :
       {"STEP_PRED_MS", "STEP_MEAS_MS", "MEAS/PRED", "DROP_IN_S", "WEIGHT",
        "SHARE", "WAIT_MS(AVG/MAX)", "EXPOSED_P99_MS", "MARKS"})
    EXPECT_NE(table.find(column), std::string::npos) << column << "\n" << table;
  Ctl(d.address(), {"drain"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "NOT_SERVING\n");
  EXPECT_EQ(code, 1);
  auto refused = Rank(d, "k", 0, 1, "shm", 1, Seed(), {"--expect=draining"});
  EXPECT_EQ(refused->Wait(30), 3);
}

// What dmuond `d` logged up to its "serving on" line (5 s at most).
std::string StartLog(const Daemon& d) {
  std::string log;
  for (int i = 0; i < 500 && log.find("serving on") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    log = d.log();
  }
  return log;
}

// --cpu-threads=0 means the cores dmuond may use, not the machine's: pinned
// to one core (taskset, a cpuset), it runs one OpenBLAS thread instead of
// one per core of the node fighting over that core.
TEST(Daemon, DefaultThreadsFollowTheAffinityMask) {
  cpu_set_t saved, one;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  Daemon d;  // inherits the one-core mask
  ASSERT_EQ(sched_setaffinity(0, sizeof(saved), &saved), 0);
  const std::string log = StartLog(d);
  EXPECT_NE(log.find(", 1 OpenBLAS threads on "), std::string::npos) << log;
}

// OpenBLAS falls back to generic kernels on a CPU model its table does not
// know (this project's VMs: "Intel(R) Xeon(R) Processor" with AVX-512 gets
// Prescott's, 5-6x slower); dmuond starts again on the kernels the CPU
// supports, unless OPENBLAS_CORETYPE says otherwise.
TEST(Daemon, RunsTheBestOpenBlasKernelsTheCpuSupports) {
  std::string log;
  {
    Daemon d;
    log = StartLog(d);
  }
  const size_t at = log.find(" OpenBLAS threads on ");
  ASSERT_NE(at, std::string::npos) << log;
  const size_t start = at + std::string(" OpenBLAS threads on ").size();
  const std::string core = log.substr(start, log.find(' ', start) - start);
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    EXPECT_EQ(kernels::BetterBlasCore(core, kernels::HostCpuFeatures()),
              std::nullopt)
        << core << "\n"
        << log;
  } else {
    EXPECT_TRUE(absl::EqualsIgnoreCase(core, std::getenv("OPENBLAS_CORETYPE")))
        << log;
  }
}

// DMUON_NO_BLAS_REEXEC=1 keeps OpenBLAS's own choice, and a choice weaker
// than the CPU allows is then said at start.
TEST(Daemon, KeepsOpenBlasChoiceWhenToldAndSaysItIsSlower) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) GTEST_SKIP();
  setenv("DMUON_NO_BLAS_REEXEC", "1", 1);
  std::string log;
  {
    Daemon d;
    unsetenv("DMUON_NO_BLAS_REEXEC");
    log = StartLog(d);
  }
  const std::string mine = kernels::BlasCoreName();  // this test's choice
  EXPECT_NE(log.find(" OpenBLAS threads on " + mine + " kernels"),
            std::string::npos)
      << log;
  const bool weaker =
      kernels::BetterBlasCore(mine, kernels::HostCpuFeatures()).has_value();
  EXPECT_EQ(log.find("though this CPU supports") != std::string::npos, weaker)
      << log;
  EXPECT_EQ(log.find("started again"), std::string::npos) << log;
}

TEST(Daemon, PrometheusMetrics) {
  // A fixed port risks a clash; try a few from a random base.
  std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = 20000 + rng() % 20000;
    Daemon d({"--metrics-port=" + std::to_string(port)});
    if (d.port() == 0) continue;
    auto p = Rank(d, "m", 0, 1, "inline", 3, Seed());
    ASSERT_EQ(p->Wait(60), 0);
    const std::string m = HttpGet(port, "/metrics");
    if (m.empty()) continue;
    for (const char* name :
         {"dmuon_steps_total 3", "dmuon_step_latency_seconds_bucket",
          "dmuon_executor_busy_seconds_total{device=\"cpu:0\"}",
          "dmuon_executor_predicted_step_seconds{device=\"cpu:0\"} 0",
          "dmuon_executor_measured_step_seconds{device=\"cpu:0\"} 0",
          "dmuon_bytes_received_total", "dmuon_sessions 0"}) {
      EXPECT_NE(m.find(name), std::string::npos) << name << "\n" << m;
    }
    return;
  }
  FAIL() << "could not start dmuond with a free metrics port";
}

TEST(Daemon, ClientKilledMidStepIsReclaimedOthersContinue) {
  Daemon d;
  const int before = ShmSegments();
  const uint64_t seed = Seed();
  auto victim = Rank(d, "dies", 1, 2, "shm", 5, seed, {"--die_at_step=3"});
  auto peer = Rank(d, "dies", 0, 2, "shm", 5, seed, {"--expect=left mid-step"});
  auto bystander = Rank(d, "lives", 0, 1, "shm", 8, seed + 7);
  EXPECT_EQ(victim->Wait(60), 128 + SIGKILL);
  EXPECT_EQ(peer->Wait(60), 3) << d.log();
  EXPECT_EQ(bystander->Wait(120), 0) << d.log();
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
  const std::string sessions = Ctl(d.address(), {"sessions"}, &code);
  EXPECT_EQ(sessions.find("dies"), std::string::npos) << sessions;
  EXPECT_EQ(ShmSegments(), before) << "segments left behind";
}

// Rank 0 of `job` (`world` ranks, inline) with one 8x8 matrix "w".
v1::OpenSessionRequest OneMatrixRequest(const std::string& job, int world) {
  v1::OpenSessionRequest req;
  req.set_protocol_version(v1::PROTOCOL_VERSION_1);
  req.set_job_id(job);
  req.set_world_size(world);
  req.set_transport(v1::TRANSPORT_INLINE);
  auto* p = req.add_parameters();
  p->set_name("w");
  p->add_shape(8);
  p->add_shape(8);
  return req;
}

TEST(Daemon, BadRequestsOverGrpcAndTheDaemonKeepsServing) {
  Daemon d({"--max-sessions=2", "--max-message-bytes=65536"});
  auto ch =
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Optimizer::NewStub(ch);
  auto open = [&](const v1::OpenSessionRequest& r,
                  v1::OpenSessionResponse* resp) {
    grpc::ClientContext ctx;
    return stub->OpenSession(&ctx, r, resp);
  };
  v1::OpenSessionRequest req = OneMatrixRequest("bad", 1);
  v1::OpenSessionResponse resp;
  auto v = req;
  v.set_protocol_version(static_cast<v1::ProtocolVersion>(9));
  EXPECT_EQ(open(v, &resp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  auto big = req;  // a message over --max-message-bytes
  big.mutable_parameters(0)->set_name(std::string(70000, 'x'));
  EXPECT_EQ(open(big, &resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  auto tall = req;
  tall.mutable_parameters(0)->add_shape(3);
  grpc::Status st = open(tall, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("parameter 'w' shape [8,8,3]"),
            std::string::npos)
      << st.error_message();
  // Ranks that disagree.
  auto r0 = req;
  r0.set_job_id("two");
  r0.set_world_size(2);
  ASSERT_TRUE(open(r0, &resp).ok());
  auto r1 = r0;
  r1.set_rank(1);
  r1.mutable_parameters(0)->set_shape(1, 9);
  st = open(r1, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(
      st.error_message().find("shape [8,9] does not match rank 0's [8,8]"),
      std::string::npos)
      << st.error_message();
  // Too many sessions.
  auto other = req;
  other.set_job_id("third");
  ASSERT_TRUE(open(other, &resp).ok());
  other.set_job_id("fourth");
  EXPECT_EQ(open(other, &resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // A Step stream that does not start with attach.
  {
    grpc::ClientContext ctx;
    auto stream = stub->Step(&ctx);
    v1::StepRequest m;
    m.mutable_gradients_ready()->set_step(1);
    stream->Write(m);
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
  EXPECT_EQ(d.process().Wait(0), -1) << "dmuond exited";
}

// A client that writes garbage into its shm doorbell (random declare words,
// momenta and rewind words; docs/protocol.md "Doorbell") loses its own
// stream, with the error the service's checks give a gradients_ready or
// rewind that says the same, and nothing else: dmuond keeps serving and a
// real job beside it is exact.
TEST(Daemon, GarbageInTheDoorbellEndsOnlyThatStream) {
  Daemon d({"--cpu-executors=1"});
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  std::mt19937_64 rng(Seed());
  constexpr int kParams = 3;
  for (int trial = 0; trial < 8; ++trial) {
    v1::OpenSessionRequest req =
        OneMatrixRequest("garbage" + std::to_string(trial), 1);
    req.set_transport(v1::TRANSPORT_SHM);
    req.set_doorbell(true);
    for (int i = 1; i < kParams; ++i) *req.add_parameters() = req.parameters(0);
    for (int i = 0; i < kParams; ++i)
      req.mutable_parameters(i)->set_name("w" + std::to_string(i));
    v1::OpenSessionResponse resp;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(stub->OpenSession(&ctx, req, &resp).ok());
    }
    ASSERT_TRUE(resp.has_doorbell());
    auto shm = transport::OpenShmRegion(
        resp.shm_name(), resp.doorbell().offset() + resp.doorbell().bytes());
    ASSERT_TRUE(shm.ok()) << shm.status();
    transport::DoorbellView bell(
        (*shm)->bytes().data() + resp.doorbell().offset(), kParams);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    auto stream = stub->Step(&ctx);
    v1::StepRequest attach;
    attach.mutable_attach()->set_session_id(resp.session_id());
    ASSERT_TRUE(stream->Write(attach));
    if (trial % 2) bell.Rewind(rng());
    for (int i = 0; i < kParams; ++i) {
      bell.SetMomentum(i, trial % 3 ? std::nan("") : double(rng()));
      bell.Declare(i, rng());
    }
    bell.Ring();
    v1::StepResponse r;
    while (stream->Read(&r)) {
    }
    const grpc::Status st = stream->Finish();
    EXPECT_TRUE(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                st.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << st.error_code() << ": " << st.error_message();
    EXPECT_FALSE(st.error_message().empty());
  }
  const uint64_t seed = Seed();
  auto rank = Rank(d, "beside", 0, 1, "shm", 3, seed);
  EXPECT_EQ(rank->Wait(120), 0) << "seed " << seed << "\n" << d.log();
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
  EXPECT_EQ(d.process().Wait(0), -1) << "dmuond exited";
}

// Opens ranks 0 and 1 of `req`'s job (rank 1 then never declares).
bool OpenBothRanks(v1::Optimizer::Stub& stub, v1::OpenSessionRequest req,
                   v1::OpenSessionResponse* r0, v1::OpenSessionResponse* r1) {
  for (auto* r : {r0, r1}) {
    grpc::ClientContext ctx;
    req.set_rank(r == r0 ? 0 : 1);
    if (!stub.OpenSession(&ctx, req, r).ok()) return false;
  }
  return true;
}

// Reads `stream` to its end: no step_complete, and ABORTED saying that
// step 1 was not taken.
void ExpectStepOneNotTaken(
    grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>& stream) {
  v1::StepResponse resp;
  bool completed = false;
  while (stream.Read(&resp)) completed |= resp.has_step_complete();
  const grpc::Status st = stream.Finish();
  EXPECT_FALSE(completed);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_NE(st.error_message().find("step 1 was not taken"), std::string::npos)
      << st.error_message();
}

// Issue 27, defect 7: a Step stream half-closed right after its last
// gradients_ready voided the step and ended with OK. Rank 1 of the job
// never declares, so rank 0's step cannot complete before its half-close:
// the stream must end with an error saying the step was not taken.
TEST(Daemon, AHalfCloseMidStepEndsWithAnErrorNotOk) {
  Daemon d;
  auto ch =
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Optimizer::NewStub(ch);
  v1::OpenSessionRequest req = OneMatrixRequest("half", 2);
  v1::OpenSessionResponse r0, r1;
  ASSERT_TRUE(OpenBothRanks(*stub, req, &r0, &r1));
  grpc::ClientContext ctx;
  auto stream = stub->Step(&ctx);
  v1::StepRequest m;
  m.mutable_attach()->set_session_id(r0.session_id());
  ASSERT_TRUE(stream->Write(m));
  m.Clear();
  auto* g = m.mutable_gradient();
  g->set_step(1);
  g->set_param_id(0);
  g->set_data(std::string(8 * 8 * 4, '\0'));
  ASSERT_TRUE(stream->Write(m));
  m.Clear();
  m.mutable_gradients_ready()->set_step(1);
  m.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(stream->Write(m));
  stream->WritesDone();
  ExpectStepOneNotTaken(*stream);
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
}

// The same over the shm doorbell: rank 0 declares through its segment's
// words and half-closes at once, before dmuond has looked at them. They
// are still taken first, so the stream says the step was not taken,
// never OK as if nothing had been declared.
TEST(Daemon, AHalfCloseRightAfterADoorbellDeclarationEndsWithAnError) {
  Daemon d;
  auto stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
  v1::OpenSessionRequest req = OneMatrixRequest("half-doorbell", 2);
  req.set_transport(v1::TRANSPORT_SHM);
  req.set_doorbell(true);
  v1::OpenSessionResponse r0, r1;
  ASSERT_TRUE(OpenBothRanks(*stub, req, &r0, &r1));
  ASSERT_TRUE(r0.has_doorbell());
  auto shm = transport::OpenShmRegion(
      r0.shm_name(), r0.doorbell().offset() + r0.doorbell().bytes());
  ASSERT_TRUE(shm.ok()) << shm.status();
  transport::DoorbellView bell((*shm)->bytes().data() + r0.doorbell().offset(),
                               1);
  grpc::ClientContext ctx;
  auto stream = stub->Step(&ctx);
  v1::StepRequest m;
  m.mutable_attach()->set_session_id(r0.session_id());
  ASSERT_TRUE(stream->Write(m));
  bell.Declare(0, transport::EncodeWord(transport::DoorbellWord{1, 1}));
  // Half-closed before the ring: unless the pump's periodic look came
  // first, only the flush at the half-close sees the declaration.
  stream->WritesDone();
  bell.Ring();
  ExpectStepOneNotTaken(*stream);
}

// The other side of defect 7: a step that completed but whose step_complete
// waits for its --snapshot-every snapshot. The client half-closes as soon
// as it sees the step's last updates_ready, while the daemon writes the
// snapshot (64 MiB of momentum: long enough that the half-close comes
// first). Its stream ended OK without the step_complete, though the step
// was taken (the soak's half-close attacker found it); it must deliver it.
TEST(Daemon, AHalfCloseWhileTheSnapshotIsWrittenStillGetsTheStepComplete) {
  const std::string dir = server::testing::NewTempDir("halfdurable");
  Daemon d({std::string("--state-dir=") + dir, "--snapshot-every=1"});
  auto ch =
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Optimizer::NewStub(ch);
  v1::OpenSessionRequest req = OneMatrixRequest("half-durable", 1);
  req.set_transport(v1::TRANSPORT_SHM);
  // 2 matrices of 2 x 4M: 64 MiB of momentum, cheap Newton-Schulz.
  req.mutable_parameters(0)->set_shape(0, 2);
  req.mutable_parameters(0)->set_shape(1, 4 << 20);
  *req.add_parameters() = req.parameters(0);
  req.mutable_parameters(1)->set_name("v");
  for (int step = 1; step <= 3; ++step) {
    v1::OpenSessionResponse open;
    {
      grpc::ClientContext ctx;
      const grpc::Status st = stub->OpenSession(&ctx, req, &open);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
    ASSERT_EQ(open.next_step(), step);
    grpc::ClientContext ctx;
    auto stream = stub->Step(&ctx);
    v1::StepRequest m;
    m.mutable_attach()->set_session_id(open.session_id());
    ASSERT_TRUE(stream->Write(m));
    m.Clear();
    m.mutable_gradients_ready()->set_step(step);
    for (int p = 0; p < req.parameters_size(); ++p)
      m.mutable_gradients_ready()->add_param_ids(p);
    ASSERT_TRUE(stream->Write(m));  // zero gradients: the shm region's
    v1::StepResponse resp;
    int ready = 0;
    bool completed = false;
    while (ready < req.parameters_size() && stream->Read(&resp)) {
      if (resp.has_updates_ready())
        ready += resp.updates_ready().param_ids_size();
      completed |= resp.has_step_complete();
    }
    stream->WritesDone();
    while (stream->Read(&resp)) completed |= resp.has_step_complete();
    const grpc::Status st = stream->Finish();
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(completed) << "step " << step
                           << " taken, its stream ended OK without it";
  }
  int code;
  EXPECT_EQ(Ctl(d.address(), {"health"}, &code), "SERVING\n");
}

TEST(Daemon, ReflectionListsAndDescribesTheService) {
  // What grpcurl does: list services, then fetch the file defining one.
  Daemon d;
  auto ch =
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(ch);
  grpc::ClientContext ctx;
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  ASSERT_TRUE(stream->Write(req));
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::vector<std::string> names;
  for (const auto& s : resp.list_services_response().service())
    names.push_back(s.name());
  EXPECT_NE(std::find(names.begin(), names.end(), "dmuon.v1.Optimizer"),
            names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"),
            names.end());
  req.set_file_containing_symbol("dmuon.v1.Optimizer");
  ASSERT_TRUE(stream->Write(req));
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_GT(resp.file_descriptor_response().file_descriptor_proto_size(), 0);
  EXPECT_NE(resp.file_descriptor_response().file_descriptor_proto(0).find(
                "OpenSessionRequest"),
            std::string::npos);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(Daemon, ClientErrorsNameTheAddress) {
  ClientOptions o;
  o.deadline = std::chrono::milliseconds(300);
  auto c = Client::Connect("127.0.0.1:1", o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("127.0.0.1:1"), std::string::npos)
      << c.status();
  // Not an address: refused at once, naming it (gRPC would try port 443).
  for (const auto& [address, why] :
       std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1", "no port"},
           {"localhost:", "no port"},
           {"http://127.0.0.1:50051", "a URL"},
           {"127.0.0.1:70000", "port in [1, 65535]"},
           {"127.0.0.1:0", "port in [1, 65535]"},
       }) {
    auto bad = Client::Connect(address, o);
    ASSERT_FALSE(bad.ok()) << address;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("'" + address + "'"),
              std::string::npos)
        << bad.status();
    EXPECT_NE(bad.status().message().find(why), std::string::npos)
        << bad.status();
  }
  for (const char* good :
       {"[::1]:5", "unix:/tmp/s", "dns:///localhost:5", "ipv4:127.0.0.1:5"}) {
    EXPECT_TRUE(Client::CheckAddress(good).ok()) << good;
  }
  // A short connect deadline fails in its time, not the call deadline's.
  o.deadline = std::chrono::seconds(60);
  o.connect_deadline = std::chrono::milliseconds(300);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(Client::Connect("127.0.0.1:1", o).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Daemon, SigtermSnapshotsAndARestartResumes) {
  const std::string dir = TempDir("state");
  const uint64_t seed = Seed();
  {
    Daemon d({"--state-dir=" + dir, "--exit-timeout-secs=20"});
    auto first = Rank(d, "resume", 0, 1, "shm", 3, seed);
    ASSERT_EQ(first->Wait(60), 0) << d.log();
    d.process().Signal(SIGTERM);
    EXPECT_EQ(d.process().Wait(20), 0) << d.log();
    EXPECT_NE(d.log().find("state snapshotted"), std::string::npos) << d.log();
  }
  Daemon d({"--state-dir=" + dir});
  // The rank continues at step 4 and compares steps 4..6 with the
  // uninterrupted reference.
  auto second = Rank(d, "resume", 0, 1, "inline", 6, seed);
  EXPECT_EQ(second->Wait(60), 0) << d.log();
}

TEST(Daemon, IdleJobIsDroppedAfterItsRetentionAndResumesFromItsSnapshot) {
  const std::string dir = TempDir("retention");
  const uint64_t seed = Seed();
  Daemon d({"--state-dir=" + dir, "--job-retention-seconds=1"});
  auto first = Rank(d, "idle", 0, 1, "shm", 3, seed);
  ASSERT_EQ(first->Wait(60), 0) << d.log();
  // Listed with its drop time, then dropped from memory (about a second
  // later) and listed from its snapshot file (on disk) until reopened.
  int code;
  std::string status;
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    status = Ctl(d.address(), {"status", "--json"}, &code);
    ASSERT_EQ(code, 0) << status;
  } while (status.find("\"onDisk\": true") == std::string::npos &&
           std::chrono::steady_clock::now() < until);
  EXPECT_NE(status.find("\"jobId\": \"idle\""), std::string::npos) << status;
  EXPECT_NE(status.find("\"onDisk\": true"), std::string::npos) << status;
  EXPECT_NE(d.log().find("job 'idle' dropped"), std::string::npos) << d.log();
  // The trainer comes back: steps 4..6 continue from the snapshot and are
  // compared with the uninterrupted reference.
  auto second = Rank(d, "idle", 0, 1, "inline", 6, seed);
  EXPECT_EQ(second->Wait(60), 0) << d.log();
  // 3 + 3 steps ran here, not 3 + 6 (a restart from zero).
  status = Ctl(d.address(), {"status", "--json"}, &code);
  v1::StatusResponse s;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(status, &s).ok())
      << status;
  EXPECT_EQ(s.step_latency().count(), 6u) << status;
}

}  // namespace
}  // namespace dmuon::testing
