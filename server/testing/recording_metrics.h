// Records what the service reports through ServiceMetrics, for tests to
// read back: the latest gauges, the counters, and the executor source as
// an exporter would read it. Thread-safe, like the service's calls.

#ifndef DMUON_SERVER_TESTING_RECORDING_METRICS_H_
#define DMUON_SERVER_TESTING_RECORDING_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "server/service_metrics.h"

namespace dmuon::server::testing {

class RecordingMetrics : public ServiceMetrics {
 public:
  void SetSessions(int n) override {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_ = n;
  }
  void SetJobs(int n) override {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_ = n;
  }
  void BytesReceived(uint64_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_received_ += n;
  }
  void BytesSent(uint64_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_sent_ += n;
  }
  void StepCompleted(double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    step_seconds_.push_back(seconds);
  }
  void NonFiniteGradient() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++nonfinite_;
  }
  void Error(const std::string& code) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_[code];
  }
  void Snapshot(double seconds) override {
    std::lock_guard<std::mutex> lock(mu_);
    snapshot_seconds_.push_back(seconds);
  }
  void SetExecutorSource(
      std::function<std::vector<ExecutorStats>()> stats) override {
    std::lock_guard<std::mutex> lock(source_mu_);
    source_ = std::move(stats);
  }

  // The executor statistics an exporter would read now; empty when no
  // source is attached.
  std::vector<ExecutorStats> Executors() const {
    std::lock_guard<std::mutex> lock(source_mu_);
    return source_ ? source_() : std::vector<ExecutorStats>{};
  }
  // -1 until first set.
  int sessions() const {
    std::lock_guard<std::mutex> lock(mu_);
    return sessions_;
  }
  int jobs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs_;
  }
  uint64_t bytes_received() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_received_;
  }
  uint64_t bytes_sent() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_sent_;
  }
  std::vector<double> step_seconds() const {
    std::lock_guard<std::mutex> lock(mu_);
    return step_seconds_;
  }
  uint64_t nonfinite() const {
    std::lock_guard<std::mutex> lock(mu_);
    return nonfinite_;
  }
  std::map<std::string, uint64_t> errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }
  std::vector<double> snapshot_seconds() const {
    std::lock_guard<std::mutex> lock(mu_);
    return snapshot_seconds_;
  }

 private:
  mutable std::mutex mu_;
  int sessions_ = -1;
  int jobs_ = -1;
  uint64_t bytes_received_ = 0;
  uint64_t bytes_sent_ = 0;
  std::vector<double> step_seconds_;
  uint64_t nonfinite_ = 0;
  std::map<std::string, uint64_t> errors_;
  std::vector<double> snapshot_seconds_;
  // Separate from mu_: the source takes the service's locks, and the
  // service reports gauges while holding them.
  mutable std::mutex source_mu_;
  std::function<std::vector<ExecutorStats>()> source_;
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_RECORDING_METRICS_H_
