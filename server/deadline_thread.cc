// DeadlineThread (deadline_thread.h).

#include "server/deadline_thread.h"

#include <utility>

namespace dmuon::server {

absl::Time DeadlineOf(std::chrono::steady_clock::time_point t) {
  using Clock = std::chrono::steady_clock;
  if (t == Clock::time_point::max()) return absl::InfiniteFuture();
  const Clock::time_point now = Clock::now();
  // Subtracting first would overflow for min().
  if (t <= now) return absl::InfinitePast();
  return absl::Now() + absl::FromChrono(t - now);
}

void DeadlineThread::Start(Pass pass) {
  thread_ = std::thread([this, pass = std::move(pass)] { Loop(pass); });
}

void DeadlineThread::Kick() {
  absl::MutexLock lock(&mu_);
  kicked_ = true;
}

void DeadlineThread::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void DeadlineThread::Loop(const Pass& pass) {
  auto woken = [this] {
    mu_.AssertHeld();
    return stop_ || kicked_;
  };
  mu_.Lock();
  while (!stop_) {
    // Cleared before the pass: a kick during it runs another.
    kicked_ = false;
    mu_.Unlock();
    const std::chrono::steady_clock::time_point next = pass();
    mu_.Lock();
    mu_.AwaitWithDeadline(absl::Condition(&woken), DeadlineOf(next));
  }
  mu_.Unlock();
}

}  // namespace dmuon::server
