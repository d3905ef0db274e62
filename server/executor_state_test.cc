// The service with executors that hold state and read device memory — the
// CUDA executor's contract (executor.h) — on the CPU (fake_device.h). Every
// update, state and snapshot must equal, bit for bit, those of the plain CPU
// service on the same gradients.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "server/testing/fake_daemon.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server::testing {
namespace {

// Jobs in the daemon's memory (Status also lists jobs that are only a
// snapshot file, on_disk).
int JobsInMemory(const v1::StatusResponse& s) {
  return static_cast<int>(
      std::count_if(s.jobs().begin(), s.jobs().end(),
                    [](const v1::JobStatus& j) { return !j.on_disk(); }));
}

TEST(ExecutorState, DeviceResidentStateAndDeviceIoMatchTheCpuService) {
  const int world = 2;
  Daemon cpu(false), dev(true);
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true).ok());
  EXPECT_EQ(dev.open[0].transport(), v1::TRANSPORT_CUDA_IPC);
  for (int64_t step = 1; step <= 3; ++step) {
    const auto g = Grads(world, 1000 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g)) << "step " << step;
  }
  // GetState reads the executors' copies.
  const auto state = cpu.State();
  EXPECT_EQ(dev.State(), state);
  EXPECT_GT(dev.fakes[0]->states() + dev.fakes[1]->states(), 0u);
  // SetState of another state: both continue alike from it.
  auto chunks = GetState(*cpu.svc, cpu.open[0].session_id());
  ASSERT_TRUE(chunks.ok());
  for (auto& c : *chunks) {
    if (c.has_momentum()) {
      std::string& d = *c.mutable_momentum()->mutable_data();
      for (size_t k = 0; k + 4 <= d.size(); k += 4) d[k + 3] ^= 0x01;
    }
  }
  (*chunks)[0].set_session_id(dev.open[0].session_id());
  ASSERT_TRUE(SetState(*dev.svc, *chunks).ok());
  (*chunks)[0].set_session_id(cpu.open[0].session_id());
  ASSERT_TRUE(SetState(*cpu.svc, *chunks).ok());
  const auto g = Grads(world, 77);
  EXPECT_EQ(cpu.Step(4, g), dev.Step(4, g));
  EXPECT_EQ(dev.State(), cpu.State());
}

// GetState of device-resident state reads one parameter at a time into
// host memory (the reader holds at most the largest parameter, never the
// whole state) and streams it in chunks, bit-identical to the CPU service.
TEST(ExecutorState, GetStateOfDeviceStateHoldsOneParameterAtATime) {
  ServiceOptions o;
  o.max_message_bytes = 4096;  // several chunks per parameter
  Daemon cpu(false, o), dev(true, o);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  ASSERT_TRUE(dev.Open(1, true).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Grads(1, 300 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g));
  }
  const auto want = cpu.State();
  uint64_t largest = 0, total = 0;
  for (const auto& m : want) {
    largest = std::max<uint64_t>(largest, m.size() * sizeof(float));
    total += m.size() * sizeof(float);
  }
  ASSERT_LT(largest, total);
  auto reader = dev.svc->ReadState(dev.open[0].session_id());
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<std::vector<float>> got(want.size());
  uint64_t peak = 0;
  for (;;) {
    auto c = (*reader)->Next();
    ASSERT_TRUE(c.ok()) << c.status();
    if (!c->has_value()) break;
    peak = std::max(peak, (*reader)->buffered_bytes());
    if (!(*c)->has_momentum()) continue;
    const std::string& d = (*c)->momentum().data();
    EXPECT_LE(d.size(), transport::MaxChunkPayload(o.max_message_bytes));
    auto& v = got[(*c)->momentum().param_id()];
    v.resize(v.size() + d.size() / 4);
    std::memcpy(v.data() + v.size() - d.size() / 4, d.data(), d.size());
  }
  EXPECT_EQ(got, want);
  EXPECT_GT(peak, 0u);
  EXPECT_LE(peak, largest);
}

// --max-state-read-bytes with executors that hold state: a reader's lease
// covers the whole parameter it holds (buffered_bytes) until that
// parameter is read, not only the chunk in flight. A second reader waiting
// for the budget is not let in between the first one's chunks (the review
// of the first version: it was, so N readers held N parameters).
TEST(ExecutorState, AReaderKeepsItsParametersLeaseBetweenChunks) {
  ServiceOptions o;
  o.max_message_bytes = 2048;  // 3 or more chunks per parameter
  Daemon cpu(false, o);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  const auto g = Grads(1, 301);
  (void)cpu.Step(1, g);
  const auto want = cpu.State();
  const uint64_t chunk = transport::MaxChunkPayload(o.max_message_bytes);
  const uint64_t first = want[0].size() * sizeof(float);
  ASSERT_GE(first, 3 * chunk) << "the first parameter needs 3 chunks";
  o.max_state_read_bytes = first + 2 * chunk;  // one reader's worth
  o.state_read_wait = absl::Seconds(1);
  Daemon dev(true, o);
  ASSERT_TRUE(dev.Open(1, true).ok());
  (void)dev.Step(1, g);
  auto a = dev.svc->ReadState(dev.open[0].session_id());
  auto b = dev.svc->ReadState(dev.open[0].session_id());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Next().ok() && (*b)->Next().ok());  // headers
  ASSERT_TRUE((*a)->Next().ok());                       // a: chunk 1
  EXPECT_EQ((*a)->buffered_bytes(), first);
  absl::StatusOr<std::optional<v1::StateChunk>> got_b =
      absl::UnknownError("not run");
  std::thread waiting([&] { got_b = (*b)->Next(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto a2 = (*a)->Next();  // chunk 2: a keeps its lease, b stays out
  ASSERT_TRUE(a2.ok()) << a2.status();
  ASSERT_TRUE(a2->has_value());
  EXPECT_EQ((*a2)->momentum().offset(), chunk);
  waiting.join();
  EXPECT_EQ(got_b.status().code(), absl::StatusCode::kResourceExhausted)
      << got_b.status();
  EXPECT_EQ((*b)->buffered_bytes(), 0u);
  a->reset();  // its bytes back: b reads everything, bit-identical
  std::vector<std::vector<float>> read(want.size());
  for (;;) {
    auto c = (*b)->Next();
    ASSERT_TRUE(c.ok()) << c.status();
    if (!c->has_value()) break;
    const std::string& d = (*c)->momentum().data();
    auto& v = read[(*c)->momentum().param_id()];
    v.resize(v.size() + d.size() / 4);
    std::memcpy(v.data() + v.size() - d.size() / 4, d.data(), d.size());
  }
  EXPECT_EQ(read, want);
}

TEST(ExecutorState, NonFiniteDeviceGradientIsSkippedStateUntouched) {
  Daemon cpu(false), dev(true);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  ASSERT_TRUE(dev.Open(1, true).ok());
  const auto g = Grads(1, 5);
  EXPECT_EQ(cpu.Step(1, g), dev.Step(1, g));
  std::vector<std::vector<v1::StepResponse>> msgs;
  const auto bad = dev.Step(2, Grads(1, 6, /*nan=*/true), &msgs);
  bool reported = false;
  for (const auto& m : msgs[0]) {
    if (m.has_error() && m.error().param_id() == 3) {
      reported = m.error().skipped();
      EXPECT_NE(m.error().message().find("non-finite"), std::string::npos);
    }
  }
  EXPECT_TRUE(reported);
  for (float x : bad[0][3]) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(dev.State()[3], cpu.State()[3]) << "skipped: momentum untouched";
}

TEST(ExecutorState, SnapshotOfDeviceStateResumesAfterRestart) {
  const std::string dir = NewTempDir("devstate");
  ServiceOptions o;
  o.state_dir = dir;
  o.snapshot_every = 1;
  Daemon cpu(false);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  std::vector<std::vector<std::vector<float>>> before;
  {
    Daemon dev(true, o);
    ASSERT_TRUE(dev.Open(1, true).ok());
    for (int64_t step = 1; step <= 2; ++step) {
      const auto g = Grads(1, 50 + step);
      EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g));
    }
  }
  Daemon again(true, o);
  ASSERT_TRUE(again.svc->LoadSnapshots().ok());
  ASSERT_TRUE(again.Open(1, true).ok());
  EXPECT_EQ(again.open[0].next_step(), 3);
  const auto g = Grads(1, 53);
  EXPECT_EQ(cpu.Step(3, g), again.Step(3, g));
}

// Every rank of `d` declares `ids` of `step` (their gradients copied in).
void SendSome(Daemon& d, int64_t step,
              const std::vector<std::vector<std::vector<float>>>& grads,
              const std::vector<int>& ids) {
  for (size_t r = 0; r < d.open.size(); ++r) {
    v1::StepRequest ready;
    ready.mutable_gradients_ready()->set_step(step);
    for (int i : ids) {
      const auto& slot = d.open[r].layout().slots(i);
      std::memcpy(d.Base(static_cast<int>(r)) + slot.gradient_offset(),
                  grads[r][i].data(), slot.bytes());
      ready.mutable_gradients_ready()->add_param_ids(i);
    }
    EXPECT_TRUE(d.svc->OnStepRequest(d.open[r].session_id(), ready).ok());
  }
}

int Restores(const Daemon& d) {
  int n = 0;
  for (const auto* f : d.fakes) n += f->restores_;
  return n;
}

TEST(ExecutorState, RankLeavingMidStepRollsDeviceStateBackToLastComplete) {
  // Executors that keep a step-start copy (the CUDA executor's contract): a
  // rank dying after some parameters computed in place voids the step; the
  // executors' momentum goes back to the last completed step (that of the
  // CPU service stopped there), the job is kept, and reopened it continues
  // bit for bit like the CPU service.
  const int world = 2;
  Daemon cpu(false), dev(true);
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Grads(world, 700 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g)) << "step " << step;
  }
  const auto at2 = cpu.State();
  // Step 3: parameters 0 and 2 compute (one per executor at least), 1 and 3
  // never arrive.
  SendSome(dev, 3, Grads(world, 713), {0, 2});
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(dev.sinks[r]->WaitUpdatesReady(3, 0));
    ASSERT_TRUE(dev.sinks[r]->WaitUpdatesReady(3, 2));
  }
  dev.svc->Detach(dev.open[1].session_id(), absl::CancelledError("died"));
  absl::Status st;
  ASSERT_TRUE(dev.sinks[0]->WaitAbort(&st));
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_NE(st.message().find("back at its last completed step 2"),
            std::string::npos)
      << st;
  EXPECT_EQ(Restores(dev), 2) << "parameters 0 and 2 restored";
  ASSERT_EQ(dev.svc->Status().jobs_size(), 1) << "kept, not broken";
  dev.open.clear();
  dev.sinks.clear();
  ASSERT_TRUE(dev.Open(world, true).ok());
  EXPECT_EQ(dev.open[0].next_step(), 3);
  EXPECT_EQ(dev.State(), at2) << "the last complete step's momentum";
  const auto g = Grads(world, 733);
  EXPECT_EQ(cpu.Step(3, g), dev.Step(3, g));
  EXPECT_EQ(dev.State(), cpu.State());
}

TEST(ExecutorState, SnapshotMidStepOfDeviceStateHoldsTheLastCompleteStep) {
  // A snapshot taken while a step is in flight (parameters 0 and 2 computed
  // in place, 1 and 3 not arrived) holds the executors' step-start copies:
  // the last completed step, as the CPU service has it. The step then
  // completes as if nothing happened.
  const std::string dir = NewTempDir("devmid");
  ServiceOptions o;
  o.state_dir = dir;
  Daemon cpu(false), dev(true, o);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  ASSERT_TRUE(dev.Open(1, true).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Grads(1, 800 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g));
  }
  const auto g3 = Grads(1, 803);
  SendSome(dev, 3, g3, {0, 2});
  ASSERT_TRUE(dev.sinks[0]->WaitUpdatesReady(3, 0));
  ASSERT_TRUE(dev.sinks[0]->WaitUpdatesReady(3, 2));
  ASSERT_TRUE(dev.svc->SnapshotAll().ok());
  {
    Daemon again(true, o);
    ASSERT_TRUE(again.svc->LoadSnapshots().ok());
    ASSERT_TRUE(again.Open(1, true).ok());
    EXPECT_EQ(again.open[0].next_step(), 3);
    // Step 3 from it gives the CPU service's updates and momentum.
    Daemon ref(false);
    ASSERT_TRUE(ref.Open(1, false).ok());
    for (int64_t step = 1; step <= 2; ++step)
      ref.Step(step, Grads(1, 800 + step));
    // Read before its first step (no executor holds a copy yet): the
    // snapshot's momentum, not zeros.
    EXPECT_EQ(again.State(), ref.State());
    EXPECT_EQ(again.Step(3, g3), ref.Step(3, g3));
    EXPECT_EQ(again.State(), ref.State());
  }
  EXPECT_EQ(Restores(dev), 0);
  // The step goes on: parameters 1 and 3 arrive, the step completes.
  SendSome(dev, 3, g3, {1, 3});
  auto m = dev.sinks[0]->WaitStep(3);
  EXPECT_TRUE(!m.empty() && m.back().has_step_complete());
  cpu.Step(3, g3);
  EXPECT_EQ(dev.State(), cpu.State());
}

TEST(ExecutorState, AJobBrokenMidStepIsSucceededFromItsSnapshotNotZero) {
  // Executors that hold state without a step-start copy: a rank leaving
  // after a parameter computed breaks the job (no rollback). The next job
  // of the id resumes from the snapshot on disk (step 2) instead of
  // starting at step 1 and overwriting it.
  const std::string dir = NewTempDir("devbreak");
  ServiceOptions o;
  o.state_dir = dir;
  o.snapshot_every = 1;
  Daemon cpu(false);
  ASSERT_TRUE(cpu.Open(1, false).ok());
  Daemon dev(true, o, 2, nullptr, /*keeps_step_start=*/false);
  ASSERT_TRUE(dev.Open(1, true).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Grads(1, 90 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g));
  }
  v1::StepRequest one;
  one.mutable_gradients_ready()->set_step(3);
  one.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(dev.svc->OnStepRequest(dev.open[0].session_id(), one).ok());
  ASSERT_TRUE(dev.sinks[0]->WaitUpdatesReady(3, 0));
  dev.svc->Detach(dev.open[0].session_id(), absl::CancelledError("died"));
  EXPECT_EQ(JobsInMemory(dev.svc->Status()), 0);  // broken, dropped
  dev.open.clear();
  dev.sinks.clear();
  ASSERT_TRUE(dev.Open(1, true).ok());
  EXPECT_EQ(dev.open[0].next_step(), 3);
  const auto g = Grads(1, 93);
  EXPECT_EQ(cpu.Step(3, g), dev.Step(3, g));
}

TEST(ExecutorState, IdleJobDropReleasesDeviceStateAndResumesFromSnapshot) {
  const std::string dir = NewTempDir("devidle");
  ServiceOptions o;
  o.state_dir = dir;
  o.job_retention_seconds = 60;
  const int world = 2;
  Daemon cpu(false), dev(true, o);
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    const auto g = Grads(world, 300 + step);
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g)) << "step " << step;
  }
  for (const auto& open : dev.open)
    ASSERT_TRUE(dev.svc->CloseSession(open.session_id()).ok());
  const size_t held = dev.fakes[0]->states() + dev.fakes[1]->states();
  EXPECT_EQ(held, kTable.size()) << "kept while within the retention";
  EXPECT_TRUE(dev.svc
                  ->ReapIdleJobs(std::chrono::steady_clock::now() +
                                 std::chrono::seconds(59))
                  .dropped.empty());
  const ReapResult reap = dev.svc->ReapIdleJobs(
      std::chrono::steady_clock::now() + std::chrono::seconds(61));
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_TRUE(reap.dropped[0].second);
  // The executors' and the GPU transports' state of the job is released.
  EXPECT_EQ(dev.fakes[0]->states() + dev.fakes[1]->states(), 0u);
  EXPECT_EQ(dev.transports->dropped, 1);
  EXPECT_EQ(JobsInMemory(dev.svc->Status()), 0);  // listed as on disk only
  // Reopened: continues from the snapshot exactly like the job that never
  // stopped.
  dev.sinks.clear();
  ASSERT_TRUE(dev.Open(world, true).ok());
  EXPECT_EQ(dev.open[0].next_step(), 3);
  const auto g = Grads(world, 303);
  EXPECT_EQ(cpu.Step(3, g), dev.Step(3, g));
  EXPECT_EQ(dev.State(), cpu.State());
}

TEST(ExecutorState, NewJobsAvoidUnhealthyExecutorsAndStatusSaysSo) {
  Daemon dev(true, {}, 3);
  dev.fakes[1]->healthy_ = false;
  ASSERT_TRUE(dev.Open(1, true).ok());
  dev.Step(1, Grads(1, 9));
  EXPECT_EQ(dev.fakes[1]->tasks_, 0);
  EXPECT_EQ(dev.fakes[0]->tasks_ + dev.fakes[2]->tasks_,
            static_cast<int>(kTable.size()));
  const v1::StatusResponse s = dev.svc->Status();
  ASSERT_EQ(s.executors_size(), 3);
  EXPECT_TRUE(s.executors(0).healthy());
  EXPECT_FALSE(s.executors(1).healthy());
  EXPECT_EQ(s.executors(2).memory_bytes(), 4096u);
}

// A CUDA graph capture that fails (injected through the fake) falls back to
// eager launches: every step completes with the CPU service's results, the
// executors stay healthy, the fallback is warned once per cause and counted
// in Status and /metrics.
TEST(ExecutorState, FailedGraphCaptureRunsEagerlyAndKeepsTheExecutorHealthy) {
  const int world = 2;
  RecordingMetrics metrics;
  Daemon cpu(false), dev(true, {}, 2, &metrics);
  const std::vector<FakeDeviceExecutor*> fakes = dev.fakes;
  for (auto* f : fakes) f->fail_graph_captures = true;
  ASSERT_TRUE(cpu.Open(world, false).ok());
  ASSERT_TRUE(dev.Open(world, true).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    const auto g = Grads(world, 500 + step);
    std::vector<std::vector<v1::StepResponse>> msgs;
    EXPECT_EQ(cpu.Step(step, g), dev.Step(step, g, &msgs)) << "step " << step;
    for (const auto& rank : msgs)
      for (const auto& m : rank) EXPECT_FALSE(m.has_error()) << m.DebugString();
  }
  EXPECT_EQ(dev.State(), cpu.State());
  const v1::StatusResponse s = dev.svc->Status();
  uint64_t fallbacks = 0;
  for (int i = 0; i < 2; ++i) {
    const v1::ExecutorStatus& e = s.executors(i);
    EXPECT_TRUE(e.healthy()) << e.device() << ": " << e.last_error();
    EXPECT_TRUE(e.last_error().empty()) << e.last_error();
    EXPECT_EQ(e.graph_fallbacks(), fakes[i]->graph_fallbacks());
    fallbacks += e.graph_fallbacks();
    // Once per cause: one warning however many plans fell back.
    const auto w = fakes[i]->warnings();
    EXPECT_EQ(w.size(), e.graph_fallbacks() > 0 ? 1u : 0u) << e.device();
    if (!w.empty()) {
      EXPECT_NE(w[0].find("cudaErrorStreamCaptureUnsupported"),
                std::string::npos)
          << w[0];
      EXPECT_NE(w[0].find(e.device()), std::string::npos) << w[0];
    }
  }
  // Every matrix of the table ran on one of them (the four shapes or launch
  // sizes are plans of their own, each counted once).
  EXPECT_GE(fallbacks, 2u);
  // The metrics' executor source counts them too (/metrics renders it as
  // dmuon_executor_graph_fallbacks_total: daemon/prometheus_metrics_test.cc).
  const std::vector<ExecutorStats> exported = metrics.Executors();
  ASSERT_EQ(exported.size(), 2u);
  EXPECT_EQ(exported[0].device, "fake:0");
  EXPECT_EQ(exported[0].graph_fallbacks, s.executors(0).graph_fallbacks());
  // Captures that work again change nothing: the fallen-back plans stay
  // eager, the results stay the CPU's.
  for (auto* f : fakes) f->fail_graph_captures = false;
  const auto g = Grads(world, 599);
  EXPECT_EQ(cpu.Step(4, g), dev.Step(4, g));
  EXPECT_EQ(dev.svc->Status().executors(0).graph_fallbacks(),
            s.executors(0).graph_fallbacks());
}

TEST(ExecutorState, GpuTransportRulesAtOpenSession) {
  // A CPU daemon keeps answering UNIMPLEMENTED, even with transports given.
  Daemon cpu(false);
  auto st = cpu.svc->OpenSession(cpu.Request(0, 1, v1::TRANSPORT_CUDA_IPC));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(st.status().message().find("CPU executors"), std::string::npos);
  // A GPU daemon: nccl not offered by these transports; ranks cannot mix
  // GPU and host transports; a too-small export is refused.
  Daemon dev(true);
  EXPECT_EQ(dev.svc->OpenSession(dev.Request(0, 2, v1::TRANSPORT_NCCL))
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
  ASSERT_TRUE(dev.svc->OpenSession(dev.Request(0, 2, v1::TRANSPORT_SHM)).ok());
  auto mixed = dev.Request(1, 2, v1::TRANSPORT_CUDA_IPC);
  mixed.mutable_cuda_ipc()->set_bytes(1 << 20);
  auto m = dev.svc->OpenSession(mixed);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("GPU transports"), std::string::npos)
      << m.status();
  auto small = dev.Request(0, 1, v1::TRANSPORT_CUDA_IPC);
  small.set_job_id("other");
  small.mutable_cuda_ipc()->set_bytes(16);
  EXPECT_EQ(dev.svc->OpenSession(small).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.transports->dropped, 1) << "a failed first open drops the job";
  auto caps = dev.svc->OpenSession(dev.Request(1, 2, v1::TRANSPORT_SHM));
  ASSERT_TRUE(caps.ok());
  bool ipc = false;
  for (int t : caps->capabilities().transports())
    ipc |= t == v1::TRANSPORT_CUDA_IPC;
  EXPECT_TRUE(ipc);
}

}  // namespace
}  // namespace dmuon::server::testing
