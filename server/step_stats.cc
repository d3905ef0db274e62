#include "server/step_stats.h"

#include <algorithm>

namespace dmuon::server {

StepStats::StepStats(size_t window) : window_(std::max<size_t>(1, window)) {}

void StepStats::RecordLatency(double seconds) {
  absl::MutexLock lock(&mu_);
  if (latencies_.size() < window_) {
    latencies_.push_back(seconds);
  } else {
    latencies_[next_] = seconds;
  }
  next_ = (next_ + 1) % window_;
  ++count_;
}

void StepStats::CountError(const std::string& code) {
  absl::MutexLock lock(&mu_);
  ++errors_[code];
}

void StepStats::Fill(v1::StatusResponse* out) const {
  absl::MutexLock lock(&mu_);
  auto* l = out->mutable_step_latency();
  l->set_count(count_);
  if (!latencies_.empty()) {
    std::vector<double> v = latencies_;
    std::sort(v.begin(), v.end());
    auto q = [&](double f) {
      return v[std::min(v.size() - 1, static_cast<size_t>(f * v.size()))];
    };
    l->set_p50_seconds(q(0.5));
    l->set_p90_seconds(q(0.9));
    l->set_p99_seconds(q(0.99));
    l->set_max_seconds(v.back());
  }
  for (const auto& [code, n] : errors_) (*out->mutable_errors())[code] = n;
}

}  // namespace dmuon::server
