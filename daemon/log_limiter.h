// Failure logging per peer, rate-limited (issue 27: an unauthenticated peer
// made dmuond write about 45 MB of log a minute, one line per refused
// call). Each peer host (the address without its port: a new connection
// is the same peer) may log `burst` lines at once, then `per_second` more
// each second; what it is refused is counted and reported on its next line
// that is logged ("N more from this peer suppressed"). At most `max_peers`
// hosts are remembered (the least recently seen is forgotten first), so
// the limiter's memory is bounded whatever the number of peers. Plain
// C++, tested on the CPU (log_limiter_test.cc); thread-safe.

#ifndef DMUON_DAEMON_LOG_LIMITER_H_
#define DMUON_DAEMON_LOG_LIMITER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dmuon {

// gRPC's peer string without its port ("ipv4:10.0.0.1:5432" ->
// "ipv4:10.0.0.1", "ipv6:[::1]:80" or gRPC 1.51's "ipv6:%5B::1%5D:80" ->
// "ipv6:[::1]"); others as they are.
std::string PeerHost(absl::string_view peer);

class LogLimiter {
 public:
  LogLimiter(double per_second, int burst, size_t max_peers)
      : per_second_(per_second), burst_(burst), max_peers_(max_peers) {}

  // Whether a line from `peer` (gRPC's peer string) may be logged at `now`;
  // when it may, `*suppressed` is how many of its lines were refused since
  // its last logged one (then reset).
  bool Allow(absl::string_view peer, absl::Time now, int64_t* suppressed)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t peers() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time refilled;
    int64_t suppressed = 0;
  };
  void ForgetOldestLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const double per_second_;
  const int burst_;
  const size_t max_peers_;
  mutable absl::Mutex mu_;
  std::map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon

#endif  // DMUON_DAEMON_LOG_LIMITER_H_
