// A window of the last latencies (a ring) with their quantiles, and the
// count and sum of every latency added: the machinery of the daemon's step
// latency (step_stats.h) and of each job's exposed latency (job.h).
// Not thread-safe: its owner's lock guards it.

#ifndef DMUON_SERVER_LATENCY_WINDOW_H_
#define DMUON_SERVER_LATENCY_WINDOW_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "proto/dmuon.pb.h"

namespace dmuon::server {

// What a LatencyWindow holds now.
struct LatencySnapshot {
  uint64_t count = 0;  // every latency added
  double sum = 0;      // their seconds summed
  // Over the window (0 when it is empty).
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};

class LatencyWindow {
 public:
  // Quantiles are over the last `window` (>= 1) latencies.
  explicit LatencyWindow(size_t window);

  void Add(double seconds);
  LatencySnapshot Snapshot() const;
  // `out`: count, and the window's mean, p50, p90, p99 and max (absent
  // before the first).
  void Fill(v1::LatencySummary* out) const;

 private:
  size_t window_;
  std::vector<double> ring_;
  size_t next_ = 0;  // the ring's slot written next
  uint64_t count_ = 0;
  double sum_ = 0;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_LATENCY_WINDOW_H_
