#include "server/read_budget.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dmuon::server {

ReadBudget::Lease& ReadBudget::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Release();
    budget_ = std::exchange(o.budget_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void ReadBudget::Lease::Release() {
  if (budget_ != nullptr) budget_->Give(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<ReadBudget::Lease> ReadBudget::Acquire(uint64_t min,
                                                      uint64_t want,
                                                      absl::Duration wait) {
  want = std::max(want, min);
  absl::MutexLock lock(&mu_);
  auto grantable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return leases_ == 0 || capacity_ - std::min(leased_, capacity_) >= min;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&grantable), wait)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GetState streams hold ", leased_,
        " of --max-state-read-bytes=", capacity_, " bytes (", leases_,
        " reading) and ", min, " more were not free within ",
        absl::FormatDuration(wait), ": read the state again later"));
  }
  const uint64_t free = capacity_ - std::min(leased_, capacity_);
  const uint64_t bytes =
      leases_ == 0 ? std::max(min, std::min(want, free)) : std::min(want, free);
  leased_ += bytes;
  ++leases_;
  return Lease(this, bytes);
}

void ReadBudget::Give(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  leased_ -= bytes;
  --leases_;
}

uint64_t ReadBudget::leased() const {
  absl::MutexLock lock(&mu_);
  return leased_;
}

int ReadBudget::leases() const {
  absl::MutexLock lock(&mu_);
  return leases_;
}

}  // namespace dmuon::server
