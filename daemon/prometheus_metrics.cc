#include "daemon/prometheus_metrics.h"

#include <mutex>

#include "prometheus/text_serializer.h"
#include "server/fallbacks.h"

namespace dmuon::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

class ExecutorCollectable : public prometheus::Collectable {
 public:
  void Set(std::function<std::vector<ExecutorStats>()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    source_ = std::move(f);
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<ExecutorStats> stats;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (source_) stats = source_();
    }
    const auto family = MetricFamilyOf;
    auto busy = family("dmuon_executor_busy_seconds_total",
                       "Seconds each executor spent computing",
                       prometheus::MetricType::Counter);
    auto depth =
        family("dmuon_executor_queue_depth", "Matrices waiting per executor",
               prometheus::MetricType::Gauge);
    auto matrices =
        family("dmuon_executor_matrices_total", "Matrices orthogonalized",
               prometheus::MetricType::Counter);
    auto flops = family("dmuon_executor_flops_total",
                        "Floating-point operations executed",
                        prometheus::MetricType::Counter);
    auto memory = family(
        "dmuon_device_memory_bytes",
        "Device memory held per executor (momentum, staging, kernel plans)",
        prometheus::MetricType::Gauge);
    auto healthy = family("dmuon_executor_healthy",
                          "1 while the executor serves; 0 after a device fault",
                          prometheus::MetricType::Gauge);
    auto predicted = family(
        "dmuon_executor_predicted_step_seconds",
        "Planner's per-step cost of the open jobs' matrices on each executor "
        "(autotuned seconds, or cost-model flops at 1e11 flop/s)",
        prometheus::MetricType::Gauge);
    auto fallbacks = family(
        "dmuon_executor_graph_fallbacks_total",
        "Kernel plans whose CUDA graph failed and that run eagerly instead",
        prometheus::MetricType::Counter);
    auto measured = family(
        "dmuon_executor_measured_step_seconds",
        "Compute seconds each executor spent on the open jobs' matrices in "
        "each job's last completed step",
        prometheus::MetricType::Gauge);
    for (const ExecutorStats& s : stats) {
      prometheus::ClientMetric m;
      m.label = {{"device", s.device}};
      m.counter.value = s.busy_seconds;
      busy.metric.push_back(m);
      m.counter.value = static_cast<double>(s.matrices);
      matrices.metric.push_back(m);
      m.counter.value = s.flops;
      flops.metric.push_back(m);
      m.counter.value = static_cast<double>(s.graph_fallbacks);
      fallbacks.metric.push_back(m);
      prometheus::ClientMetric g;
      g.label = m.label;
      g.gauge.value = s.queue_depth;
      depth.metric.push_back(g);
      g.gauge.value = static_cast<double>(s.memory_bytes);
      memory.metric.push_back(g);
      g.gauge.value = s.healthy ? 1 : 0;
      healthy.metric.push_back(g);
      g.gauge.value = s.predicted_step_seconds;
      predicted.metric.push_back(g);
      g.gauge.value = s.measured_step_seconds;
      measured.metric.push_back(g);
    }
    return {busy,    depth,     matrices, flops,    memory,
            healthy, predicted, measured, fallbacks};
  }

 private:
  mutable std::mutex mu_;
  std::function<std::vector<ExecutorStats>()> source_;
};

// dmuon_fallbacks_total{kind}: every kind (fallbacks.h) from the start, at
// 0, so that alerts see the series; read at scrape time.
class FallbackCollectable : public prometheus::Collectable {
 public:
  void Set(std::function<std::map<std::string, uint64_t>()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    source_ = std::move(f);
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::map<std::string, uint64_t> counts;
    for (const std::string& k : DaemonFallbackKinds()) counts[k] = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (source_)
        for (const auto& [k, n] : source_()) counts[k] = n;
    }
    prometheus::MetricFamily f;
    f.name = "dmuon_fallbacks_total";
    f.help =
        "Paths slower than, or other than, the one asked for, by kind: "
        "graph_eager (a CUDA graph failed, its plan runs eagerly), "
        "unhealthy_executor (a new job planned around executors that lost "
        "their device), rewind (a completed step undone and computed again)";
    f.type = prometheus::MetricType::Counter;
    for (const auto& [kind, n] : counts) {
      prometheus::ClientMetric m;
      m.label = {{"kind", kind}};
      m.counter.value = static_cast<double>(n);
      f.metric.push_back(m);
    }
    return {f};
  }

 private:
  mutable std::mutex mu_;
  std::function<std::map<std::string, uint64_t>()> source_;
};

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
          0.25,   0.5,   1,      2.5,   5,    10,    30};
}

}  // namespace

PrometheusMetrics::PrometheusMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      executors_(std::make_shared<ExecutorCollectable>()),
      fallbacks_(std::make_shared<FallbackCollectable>()),
      jobs_source_(std::make_shared<JobCollectable>()),
      sessions_(BuildGauge()
                    .Name("dmuon_sessions")
                    .Help("Open sessions")
                    .Register(*registry_)
                    .Add({})),
      jobs_(BuildGauge()
                .Name("dmuon_jobs")
                .Help("Jobs with state in memory")
                .Register(*registry_)
                .Add({})),
      bytes_received_(BuildCounter()
                          .Name("dmuon_bytes_received_total")
                          .Help("Gradient bytes received (inline and shm)")
                          .Register(*registry_)
                          .Add({})),
      bytes_sent_(BuildCounter()
                      .Name("dmuon_bytes_sent_total")
                      .Help("Update bytes delivered (inline and shm)")
                      .Register(*registry_)
                      .Add({})),
      steps_(BuildCounter()
                 .Name("dmuon_steps_total")
                 .Help("Session steps completed")
                 .Register(*registry_)
                 .Add({})),
      step_latency_(
          BuildHistogram()
              .Name("dmuon_step_latency_seconds")
              .Help("First gradient of a step to its last update, per session")
              .Register(*registry_)
              .Add({}, LatencyBuckets())),
      nonfinite_(
          BuildCounter()
              .Name("dmuon_nonfinite_gradients_total")
              .Help("Gradients with NaN/Inf (skipped or failed by policy)")
              .Register(*registry_)
              .Add({})),
      errors_(BuildCounter()
                  .Name("dmuon_errors_total")
                  .Help("Failed calls by gRPC code")
                  .Register(*registry_)),
      snapshots_(BuildCounter()
                     .Name("dmuon_snapshots_total")
                     .Help("State snapshots written")
                     .Register(*registry_)
                     .Add({})),
      snapshot_seconds_(BuildHistogram()
                            .Name("dmuon_snapshot_seconds")
                            .Help("Time to write one job's snapshot")
                            .Register(*registry_)
                            .Add({}, LatencyBuckets())),
      snapshot_failures_(
          BuildCounter()
              .Name("dmuon_snapshot_failures_total")
              .Help("Snapshot failures by kind: write (an I/O error), stale "
                    "(an older state not written over a newer file), corrupt "
                    "(a file that cannot be used, moved aside)")
              .Register(*registry_)) {
  // Every kind from the start, at 0, so that alerts see the series.
  for (const char* kind : {"write", "stale", "corrupt"})
    snapshot_failures_.Add({{"kind", kind}});
}

void PrometheusMetrics::StepCompleted(double seconds) {
  steps_.Increment();
  step_latency_.Observe(seconds);
}

void PrometheusMetrics::Error(const std::string& code) {
  errors_.Add({{"code", code}}).Increment();
}

void PrometheusMetrics::Snapshot(double seconds) {
  snapshots_.Increment();
  snapshot_seconds_.Observe(seconds);
}

void PrometheusMetrics::SnapshotFailure(const std::string& kind) {
  snapshot_failures_.Add({{"kind", kind}}).Increment();
}

void PrometheusMetrics::SetExecutorSource(
    std::function<std::vector<ExecutorStats>()> stats) {
  static_cast<ExecutorCollectable*>(executors_.get())->Set(std::move(stats));
}

void PrometheusMetrics::SetFallbackSource(
    std::function<std::map<std::string, uint64_t>()> counts) {
  static_cast<FallbackCollectable*>(fallbacks_.get())->Set(std::move(counts));
}

void PrometheusMetrics::SetJobSource(
    std::function<std::vector<JobMetrics>()> jobs) {
  jobs_source_->Set(std::move(jobs));
}

std::string PrometheusMetrics::Render() const {
  std::vector<prometheus::MetricFamily> all = registry_->Collect();
  for (auto& f : executors_->Collect()) all.push_back(f);
  for (auto& f : fallbacks_->Collect()) all.push_back(f);
  for (auto& f : jobs_source_->Collect()) all.push_back(f);
  return prometheus::TextSerializer().Serialize(all);
}

}  // namespace dmuon::server
