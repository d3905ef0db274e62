// Prometheus metrics of dmuond (prometheus-cpp): the ServiceMetrics of the
// process, served at /metrics (metrics_http.h, with Render()). Names are
// prefixed dmuon_ and carry their unit. Executor and per-job metrics are read
// from the service at scrape time (Collectables), so the hot path never
// touches them.

#ifndef DMUON_DAEMON_PROMETHEUS_METRICS_H_
#define DMUON_DAEMON_PROMETHEUS_METRICS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/prometheus_jobs.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/scheduler.h"
#include "server/service_metrics.h"

namespace dmuon::server {

class PrometheusMetrics : public ServiceMetrics {
 public:
  PrometheusMetrics();

  void SetSessions(int n) override { sessions_.Set(n); }
  void SetJobs(int n) override { jobs_.Set(n); }
  void BytesReceived(uint64_t n) override {
    bytes_received_.Increment(static_cast<double>(n));
  }
  void BytesSent(uint64_t n) override {
    bytes_sent_.Increment(static_cast<double>(n));
  }
  void StepCompleted(double seconds) override;
  void NonFiniteGradient() override { nonfinite_.Increment(); }
  void Error(const std::string& code) override;
  void Snapshot(double seconds) override;
  void SnapshotFailure(const std::string& kind) override;

  // Serves executor metrics from `stats` at scrape time (including the
  // per-step load fields, which the service fills in).
  void SetExecutorSource(
      std::function<std::vector<ExecutorStats>()> stats) override;
  // Serves dmuon_fallbacks_total{kind} from `counts` at scrape time.
  void SetFallbackSource(
      std::function<std::map<std::string, uint64_t>()> counts) override;
  // Serves the dmuon_job_* series (prometheus_jobs.h) from `jobs` at
  // scrape time.
  void SetJobSource(std::function<std::vector<JobMetrics>()> jobs) override;

  // The text exposition format: what /metrics serves (MetricsHttp), once
  // per scrape.
  std::string Render() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> executors_;
  std::shared_ptr<prometheus::Collectable> fallbacks_;
  std::shared_ptr<JobCollectable> jobs_source_;
  prometheus::Gauge& sessions_;
  prometheus::Gauge& jobs_;
  prometheus::Counter& bytes_received_;
  prometheus::Counter& bytes_sent_;
  prometheus::Counter& steps_;
  prometheus::Histogram& step_latency_;
  prometheus::Counter& nonfinite_;
  prometheus::Family<prometheus::Counter>& errors_;
  prometheus::Counter& snapshots_;
  prometheus::Histogram& snapshot_seconds_;
  prometheus::Family<prometheus::Counter>& snapshot_failures_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_PROMETHEUS_METRICS_H_
