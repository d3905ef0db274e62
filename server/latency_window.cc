#include "server/latency_window.h"

#include <algorithm>
#include <numeric>

namespace dmuon::server {

LatencyWindow::LatencyWindow(size_t window)
    : window_(std::max<size_t>(1, window)) {}

void LatencyWindow::Add(double seconds) {
  if (ring_.size() < window_) {
    ring_.push_back(seconds);
  } else {
    ring_[next_] = seconds;
  }
  next_ = (next_ + 1) % window_;
  ++count_;
  sum_ += seconds;
}

LatencySnapshot LatencyWindow::Snapshot() const {
  LatencySnapshot s;
  s.count = count_;
  s.sum = sum_;
  if (ring_.empty()) return s;
  std::vector<double> v = ring_;
  std::sort(v.begin(), v.end());
  auto q = [&](double f) {
    return v[std::min(v.size() - 1, static_cast<size_t>(f * v.size()))];
  };
  s.mean =
      std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  s.p50 = q(0.5);
  s.p90 = q(0.9);
  s.p99 = q(0.99);
  s.max = v.back();
  return s;
}

void LatencyWindow::Fill(v1::LatencySummary* out) const {
  out->set_count(count_);
  if (ring_.empty()) return;
  const LatencySnapshot s = Snapshot();
  out->set_mean_seconds(s.mean);
  out->set_p50_seconds(s.p50);
  out->set_p90_seconds(s.p90);
  out->set_p99_seconds(s.p99);
  out->set_max_seconds(s.max);
}

}  // namespace dmuon::server
