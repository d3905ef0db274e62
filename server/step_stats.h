// Step latency and error counts for Status: a window of the last step
// latencies (latency_window.h) and a count of errors by status code.

#ifndef DMUON_SERVER_STEP_STATS_H_
#define DMUON_SERVER_STEP_STATS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/dmuon.pb.h"
#include "server/latency_window.h"

namespace dmuon::server {

// Thread-safe. Its lock is a leaf: taken under the service's and the jobs'
// locks, it never takes another.
class StepStats {
 public:
  static constexpr size_t kDefaultWindow = 4096;

  // Quantiles are over the last `window` (>= 1) latencies.
  explicit StepStats(size_t window = kDefaultWindow);

  // A session's step completed `seconds` after its first gradient came in.
  void RecordLatency(double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  // An error, by absl::StatusCodeToString of its code.
  void CountError(const std::string& code) ABSL_LOCKS_EXCLUDED(mu_);
  // Fills `out`'s step_latency (count of every step recorded; mean, p50,
  // p90, p99 and max of the window, absent before the first) and errors.
  void Fill(v1::StatusResponse* out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  LatencyWindow latencies_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> errors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_STATS_H_
