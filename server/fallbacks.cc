#include "server/fallbacks.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::server {

const std::vector<std::string>& DaemonFallbackKinds() {
  static const auto* kinds = new std::vector<std::string>{
      std::string(kFallbackGraphEager), std::string(kFallbackUnhealthyExecutor),
      std::string(kFallbackRewind)};
  return *kinds;
}

absl::Status StrictRefusal(std::string_view kind, const std::string& reason,
                           const std::string& remedy) {
  return absl::FailedPreconditionError(
      absl::StrCat("dmuond --strict refuses the fallback '", std::string(kind),
                   "': ", reason, "; ", remedy,
                   " (or run dmuond without --strict to take it, counted in "
                   "Status and dmuon_fallbacks_total)"));
}

FallbackCounter::FallbackCounter(bool strict, Log log)
    : strict_(strict), log_(std::move(log)) {}

absl::Status FallbackCounter::Take(std::string_view kind,
                                   const std::string& reason,
                                   const std::string& remedy) {
  if (strict_) return StrictRefusal(kind, reason, remedy);
  Add(kind, reason);
  return absl::OkStatus();
}

void FallbackCounter::Add(std::string_view kind, const std::string& reason) {
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    ++counts_[std::string(kind)];
    first = logged_.insert(std::string(kind)).second;
  }
  if (first && log_) log_(kind, reason);
}

std::map<std::string, uint64_t> FallbackCounter::Counts() const {
  std::map<std::string, uint64_t> out;
  for (const std::string& k : DaemonFallbackKinds()) out[k] = 0;
  absl::MutexLock lock(&mu_);
  for (const auto& [k, n] : counts_) out[k] += n;
  return out;
}

}  // namespace dmuon::server
