// What the service observes for monitoring, as an interface: the service
// (server/) reports through it and never sees how it is exported. dmuond
// implements it with Prometheus (daemon/prometheus_metrics.h); tests record
// it (server/testing/recording_metrics.h); NoServiceMetrics observes
// nothing (what the service reports to when given none).

#ifndef DMUON_SERVER_SERVICE_METRICS_H_
#define DMUON_SERVER_SERVICE_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "server/latency_window.h"
#include "server/scheduler.h"

namespace dmuon::server {

// One job in memory, as /metrics shows it (labels: job, principal): its
// use of the executors (JobStatus' fields of the same names) and its
// exposed latency (Job::exposed_latency).
struct JobMetrics {
  std::string job_id;
  std::string principal;  // its owner; empty: anonymous
  double weight = 1;
  double max_device_share = 1;
  double device_seconds = 0;
  double device_share = 0;
  double queue_wait_mean_seconds = 0;
  double queue_wait_max_seconds = 0;
  double device_batch_max_seconds = 0;  // Status only, not exported
  LatencySnapshot exposed;
};

class ServiceMetrics {
 public:
  virtual ~ServiceMetrics() = default;

  // Open sessions and jobs with state in memory, after each change.
  virtual void SetSessions(int n) = 0;
  virtual void SetJobs(int n) = 0;
  // Gradient bytes received and update bytes delivered (inline and shm).
  virtual void BytesReceived(uint64_t n) = 0;
  virtual void BytesSent(uint64_t n) = 0;
  // A session step completed, `seconds` from its first gradient to its last
  // update.
  virtual void StepCompleted(double seconds) = 0;
  // A gradient with NaN/Inf (skipped or failed by policy).
  virtual void NonFiniteGradient() = 0;
  // A failed call, by its status code's name.
  virtual void Error(const std::string& code) = 0;
  // One job's snapshot written in `seconds`.
  virtual void Snapshot(double seconds) = 0;
  // A snapshot failure by kind (server/snapshot_store.h): "write" (an I/O
  // error), "stale" (refused: older than the file), "corrupt" (a file that
  // cannot be used, moved aside).
  virtual void SnapshotFailure(const std::string& /*kind*/) {}
  // Executor statistics (with the per-step load fields filled in by the
  // service), to be read when the metrics are exported, so the hot path
  // never touches them; null detaches the source. Thread-safe.
  virtual void SetExecutorSource(
      std::function<std::vector<ExecutorStats>()> stats) = 0;
  // Every fallback kind's count (fallbacks.h, OptimizerService::Fallbacks),
  // read when the metrics are exported; null detaches the source.
  // Thread-safe.
  virtual void SetFallbackSource(
      std::function<std::map<std::string, uint64_t>()> /*counts*/) {}
  // Every job in memory (OptimizerService::JobMetricsNow), read when the
  // metrics are exported: a dropped job is gone from the next export, so
  // the series are bounded by the jobs in memory. Null detaches the
  // source. Thread-safe.
  virtual void SetJobSource(std::function<std::vector<JobMetrics>()> /*jobs*/) {
  }
};

// Observes nothing (a test double may override what it watches).
class NoServiceMetrics : public ServiceMetrics {
 public:
  void SetSessions(int) override {}
  void SetJobs(int) override {}
  void BytesReceived(uint64_t) override {}
  void BytesSent(uint64_t) override {}
  void StepCompleted(double) override {}
  void NonFiniteGradient() override {}
  void Error(const std::string&) override {}
  void Snapshot(double) override {}
  void SetExecutorSource(std::function<std::vector<ExecutorStats>()>) override {
  }
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SERVICE_METRICS_H_
