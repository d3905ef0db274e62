#include "daemon/log_limiter.h"

#include <algorithm>

#include "absl/strings/str_replace.h"

namespace dmuon {

std::string PeerHost(absl::string_view raw) {
  // gRPC >= 1.48 percent-encodes the IPv6 brackets ("ipv6:%5B::1%5D:80").
  const std::string decoded = absl::StrReplaceAll(
      raw, {{"%5B", "["}, {"%5b", "["}, {"%5D", "]"}, {"%5d", "]"}});
  const absl::string_view peer = decoded;
  const size_t scheme = peer.find(':');
  if (scheme == absl::string_view::npos) return std::string(peer);
  const absl::string_view kind = peer.substr(0, scheme);
  if (kind != "ipv4" && kind != "ipv6") return std::string(peer);
  const size_t port = peer.rfind(':');
  if (port == scheme) return std::string(peer);
  // ipv6 hosts are bracketed: the port's colon follows the ']'.
  if (kind == "ipv6" && (port == 0 || peer[port - 1] != ']'))
    return std::string(peer);
  return std::string(peer.substr(0, port));
}

bool LogLimiter::Allow(absl::string_view peer, absl::Time now,
                       int64_t* suppressed) {
  const std::string host = PeerHost(peer);
  absl::MutexLock lock(&mu_);
  auto it = buckets_.find(host);
  if (it == buckets_.end()) {
    if (buckets_.size() >= max_peers_) ForgetOldestLocked();
    it = buckets_.emplace(host, Bucket{static_cast<double>(burst_), now, 0})
             .first;
  }
  Bucket& b = it->second;
  const double elapsed = std::max(0.0, absl::ToDoubleSeconds(now - b.refilled));
  b.tokens = std::min<double>(burst_, b.tokens + elapsed * per_second_);
  b.refilled = now;
  if (b.tokens < 1) {
    ++b.suppressed;
    return false;
  }
  b.tokens -= 1;
  *suppressed = b.suppressed;
  b.suppressed = 0;
  return true;
}

void LogLimiter::ForgetOldestLocked() {
  auto oldest = buckets_.begin();
  for (auto it = buckets_.begin(); it != buckets_.end(); ++it)
    if (it->second.refilled < oldest->second.refilled) oldest = it;
  if (oldest != buckets_.end()) buckets_.erase(oldest);
}

size_t LogLimiter::peers() const {
  absl::MutexLock lock(&mu_);
  return buckets_.size();
}

}  // namespace dmuon
