// The daemon's fallbacks (fallbacks.h) through the service with fake device
// executors (fake_device.h): each kind provoked, counted in Status and in
// the metrics' source (what /metrics renders), logged once with its reason,
// and refused under strict mode without breaking the executors. (CUDA
// graph captures fail by injection; a real capture failure needs a GPU.)

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/testing/fake_daemon.h"
#include "server/testing/recording_metrics.h"

namespace dmuon::server::testing {
namespace {

// What ServiceOptions::fallback_logged was called with.
struct LogRecorder {
  absl::Mutex mu;
  std::vector<std::pair<std::string, std::string>> lines ABSL_GUARDED_BY(mu);
  FallbackCounter::Log Hook() {
    return [this](std::string_view kind, const std::string& why) {
      absl::MutexLock l(&mu);
      lines.emplace_back(std::string(kind), why);
    };
  }
  std::vector<std::pair<std::string, std::string>> Lines() {
    absl::MutexLock l(&mu);
    return lines;
  }
};

ServiceOptions Options(bool strict, LogRecorder* log) {
  ServiceOptions o;
  o.strict = strict;
  o.fallback_logged = log->Hook();
  return o;
}

std::map<std::string, uint64_t> StatusCounts(const OptimizerService& svc) {
  const v1::StatusResponse s = svc.Status();
  return {s.fallbacks().begin(), s.fallbacks().end()};
}

uint64_t Seed() { return std::random_device{}(); }

TEST(Fallbacks, EveryKindListedAtZeroOnAFreshDaemon) {
  LogRecorder log;
  RecordingMetrics metrics;
  Daemon dev(true, Options(false, &log), 2, &metrics);
  const auto counts = StatusCounts(*dev.svc);
  EXPECT_EQ(counts.size(), DaemonFallbackKinds().size());
  for (const std::string& k : DaemonFallbackKinds())
    EXPECT_EQ(counts.at(k), 0u);
  EXPECT_EQ(metrics.Fallbacks(), counts);
  EXPECT_TRUE(log.Lines().empty());
}

TEST(Fallbacks, GraphEagerCountedAsTheExecutorsCountAndWarnedOncePerCause) {
  LogRecorder log;
  RecordingMetrics metrics;
  Daemon cpu(false), dev(true, Options(false, &log), 2, &metrics);
  for (auto* f : dev.fakes) f->fail_graph_captures = true;
  ASSERT_TRUE(cpu.Open(1, false).ok());
  ASSERT_TRUE(dev.Open(1, true).ok());
  const auto g = Grads(1, Seed());
  EXPECT_EQ(cpu.Step(1, g), dev.Step(1, g));  // eager: the same numbers
  uint64_t plans = 0;
  for (auto* f : dev.fakes) {
    plans += f->graph_fallbacks();
    EXPECT_EQ(f->warnings().size(), f->graph_fallbacks() > 0 ? 1u : 0u);
  }
  EXPECT_GE(plans, 1u);
  const auto counts = StatusCounts(*dev.svc);
  EXPECT_EQ(counts.at("graph_eager"), plans);
  EXPECT_EQ(metrics.Fallbacks(), counts);
}

TEST(Fallbacks, StrictGraphFailureFailsTheBatchAndKeepsExecutorsHealthy) {
  LogRecorder log;
  Daemon dev(true, Options(true, &log), 2);
  for (auto* f : dev.fakes) f->fail_graph_captures = true;
  ASSERT_TRUE(dev.Open(1, true).ok());
  const auto g = Grads(1, Seed());
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(1);
  for (size_t i = 0; i < dev.table.size(); ++i) {
    const auto& slot = dev.open[0].layout().slots(i);
    std::memcpy(dev.Base(0) + slot.gradient_offset(), g[0][i].data(),
                slot.bytes());
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  ASSERT_TRUE(dev.svc->OnStepRequest(dev.open[0].session_id(), ready).ok());
  dev.sinks[0]->WaitStep(1);  // ends with the job's failure
  const absl::Status st = dev.sinks[0]->abort_status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("'graph_eager'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("--strict"), std::string::npos) << st;
  for (auto* f : dev.fakes) {
    EXPECT_TRUE(f->healthy()) << f->last_error();
    EXPECT_EQ(f->graph_fallbacks(), 0u);
  }
  EXPECT_EQ(StatusCounts(*dev.svc).at("graph_eager"), 0u);
}

TEST(Fallbacks, UnhealthyExecutorCountedLoggedOnceAndRefusedWhenStrict) {
  for (const bool strict : {false, true}) {
    SCOPED_TRACE(strict ? "strict" : "default");
    LogRecorder log;
    RecordingMetrics metrics;
    Daemon dev(true, Options(strict, &log), 3, &metrics);
    dev.fakes[1]->healthy_ = false;
    const absl::Status opened = dev.Open(1, true);
    const auto counts = StatusCounts(*dev.svc);
    EXPECT_EQ(metrics.Fallbacks(), counts);
    if (strict) {
      EXPECT_EQ(opened.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(opened.message().find("'unhealthy_executor'"),
                std::string::npos)
          << opened;
      EXPECT_NE(opened.message().find("fake:1"), std::string::npos) << opened;
      EXPECT_EQ(counts.at("unhealthy_executor"), 0u);
      EXPECT_TRUE(log.Lines().empty());
      // No job was made, and the daemon serves on: a healthy daemon's open
      // of the same job succeeds.
      EXPECT_EQ(dev.svc->Status().jobs_size(), 0);
      dev.fakes[1]->healthy_ = true;
      dev.sinks.clear();
      dev.open.clear();
      dev.shm.clear();
      dev.client_mem.clear();
      ASSERT_TRUE(dev.Open(1, true).ok());
      continue;
    }
    ASSERT_TRUE(opened.ok()) << opened;
    EXPECT_EQ(counts.at("unhealthy_executor"), 1u);
    // A second new job counts again; the log line stays one.
    Daemon* d = &dev;
    auto req = d->Request(0, 1, v1::TRANSPORT_SHM);
    req.set_job_id("job2");
    ASSERT_TRUE(d->svc->OpenSession(req).ok());
    EXPECT_EQ(StatusCounts(*dev.svc).at("unhealthy_executor"), 2u);
    const auto lines = log.Lines();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0].first, "unhealthy_executor");
    EXPECT_NE(lines[0].second.find("fake:1"), std::string::npos)
        << lines[0].second;
    EXPECT_NE(lines[0].second.find("2 of 3"), std::string::npos)
        << lines[0].second;
  }
}

v1::StepRequest RewindOf(int64_t step) {
  v1::StepRequest m;
  m.mutable_rewind()->set_step(step);
  return m;
}

// A rewind is the client's request: counted once per step rewound (not per
// rank), logged once, and never refused, strict or not.
TEST(Fallbacks, RewindCountedPerStepAndNotRefusedByStrict) {
  for (const bool strict : {false, true}) {
    SCOPED_TRACE(strict ? "strict" : "default");
    LogRecorder log;
    Daemon cpu(false, Options(strict, &log), 2);
    ASSERT_TRUE(cpu.Open(1, false).ok());
    const int n = 1 + static_cast<int>(Seed() % 3);
    for (int k = 0; k < n; ++k) {
      cpu.Step(1, Grads(1, Seed()));
      ASSERT_TRUE(
          cpu.svc->OnStepRequest(cpu.open[0].session_id(), RewindOf(1)).ok());
    }
    EXPECT_EQ(StatusCounts(*cpu.svc).at("rewind"), static_cast<uint64_t>(n));
    const auto lines = log.Lines();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0].first, "rewind");
    EXPECT_NE(lines[0].second.find("job 'job'"), std::string::npos);
  }
}

}  // namespace
}  // namespace dmuon::server::testing
