#include "server/step_stats.h"

namespace dmuon::server {

StepStats::StepStats(size_t window) : latencies_(window) {}

void StepStats::RecordLatency(double seconds) {
  absl::MutexLock lock(&mu_);
  latencies_.Add(seconds);
}

void StepStats::CountError(const std::string& code) {
  absl::MutexLock lock(&mu_);
  ++errors_[code];
}

void StepStats::Fill(v1::StatusResponse* out) const {
  absl::MutexLock lock(&mu_);
  latencies_.Fill(out->mutable_step_latency());
  for (const auto& [code, n] : errors_) (*out->mutable_errors())[code] = n;
}

}  // namespace dmuon::server
