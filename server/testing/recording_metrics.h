// Records what the service reports through ServiceMetrics, for tests to
// read back: the latest gauges, the counters, and the executor source as
// an exporter would read it. Thread-safe, like the service's calls.

#ifndef DMUON_SERVER_TESTING_RECORDING_METRICS_H_
#define DMUON_SERVER_TESTING_RECORDING_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/service_metrics.h"

namespace dmuon::server::testing {

class RecordingMetrics : public ServiceMetrics {
 public:
  void SetSessions(int n) override {
    absl::MutexLock lock(&mu_);
    sessions_ = n;
  }
  void SetJobs(int n) override {
    absl::MutexLock lock(&mu_);
    jobs_ = n;
  }
  void BytesReceived(uint64_t n) override {
    absl::MutexLock lock(&mu_);
    bytes_received_ += n;
  }
  void BytesSent(uint64_t n) override {
    absl::MutexLock lock(&mu_);
    bytes_sent_ += n;
  }
  void StepCompleted(double seconds) override {
    absl::MutexLock lock(&mu_);
    step_seconds_.push_back(seconds);
  }
  void NonFiniteGradient() override {
    absl::MutexLock lock(&mu_);
    ++nonfinite_;
  }
  void Error(const std::string& code) override {
    absl::MutexLock lock(&mu_);
    ++errors_[code];
  }
  void Snapshot(double seconds) override {
    absl::MutexLock lock(&mu_);
    snapshot_seconds_.push_back(seconds);
  }
  void SnapshotFailure(const std::string& kind) override {
    absl::MutexLock lock(&mu_);
    ++snapshot_failures_[kind];
  }
  void SetExecutorSource(
      std::function<std::vector<ExecutorStats>()> stats) override {
    absl::MutexLock lock(&source_mu_);
    source_ = std::move(stats);
  }

  void SetFallbackSource(
      std::function<std::map<std::string, uint64_t>()> counts) override {
    absl::MutexLock lock(&source_mu_);
    fallback_source_ = std::move(counts);
  }
  // The fallback counts an exporter would read now; empty when no source
  // is attached.
  std::map<std::string, uint64_t> Fallbacks() const {
    absl::MutexLock lock(&source_mu_);
    return fallback_source_ ? fallback_source_()
                            : std::map<std::string, uint64_t>{};
  }

  void SetJobSource(std::function<std::vector<JobMetrics>()> jobs) override {
    absl::MutexLock lock(&source_mu_);
    job_source_ = std::move(jobs);
  }
  // The per-job metrics an exporter would read now; empty when no source
  // is attached.
  std::vector<JobMetrics> Jobs() const {
    absl::MutexLock lock(&source_mu_);
    return job_source_ ? job_source_() : std::vector<JobMetrics>{};
  }

  // The executor statistics an exporter would read now; empty when no
  // source is attached.
  std::vector<ExecutorStats> Executors() const {
    absl::MutexLock lock(&source_mu_);
    return source_ ? source_() : std::vector<ExecutorStats>{};
  }
  // -1 until first set.
  int sessions() const {
    absl::MutexLock lock(&mu_);
    return sessions_;
  }
  int jobs() const {
    absl::MutexLock lock(&mu_);
    return jobs_;
  }
  uint64_t bytes_received() const {
    absl::MutexLock lock(&mu_);
    return bytes_received_;
  }
  uint64_t bytes_sent() const {
    absl::MutexLock lock(&mu_);
    return bytes_sent_;
  }
  std::vector<double> step_seconds() const {
    absl::MutexLock lock(&mu_);
    return step_seconds_;
  }
  uint64_t nonfinite() const {
    absl::MutexLock lock(&mu_);
    return nonfinite_;
  }
  std::map<std::string, uint64_t> errors() const {
    absl::MutexLock lock(&mu_);
    return errors_;
  }
  std::vector<double> snapshot_seconds() const {
    absl::MutexLock lock(&mu_);
    return snapshot_seconds_;
  }
  std::map<std::string, uint64_t> snapshot_failures() const {
    absl::MutexLock lock(&mu_);
    return snapshot_failures_;
  }

 private:
  mutable absl::Mutex mu_;
  int sessions_ ABSL_GUARDED_BY(mu_) = -1;
  int jobs_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<double> step_seconds_ ABSL_GUARDED_BY(mu_);
  uint64_t nonfinite_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> errors_ ABSL_GUARDED_BY(mu_);
  std::vector<double> snapshot_seconds_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> snapshot_failures_ ABSL_GUARDED_BY(mu_);
  // Separate from mu_: the source takes the service's locks, and the
  // service reports gauges while holding them.
  mutable absl::Mutex source_mu_;
  std::function<std::vector<ExecutorStats>()> source_
      ABSL_GUARDED_BY(source_mu_);
  std::function<std::map<std::string, uint64_t>()> fallback_source_
      ABSL_GUARDED_BY(source_mu_);
  std::function<std::vector<JobMetrics>()> job_source_
      ABSL_GUARDED_BY(source_mu_);
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_RECORDING_METRICS_H_
