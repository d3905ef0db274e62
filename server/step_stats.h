// Step latency and error counts for Status: a ring of the last step
// latencies (their quantiles) and a count of errors by status code.

#ifndef DMUON_SERVER_STEP_STATS_H_
#define DMUON_SERVER_STEP_STATS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/dmuon.pb.h"

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
  // Fills `out`'s step_latency (count of every step recorded; p50, p90,
  // p99 and max of the window, absent before the first) and errors.
  void Fill(v1::StatusResponse* out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t window_;
  mutable absl::Mutex mu_;
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);  // ring
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // the ring's slot written next
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> errors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_STATS_H_
