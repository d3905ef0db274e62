#include "transport/doorbell.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "transport/transport.h"

namespace dmuon::transport {

// Words in shared memory are reached as std::atomic (no std::atomic_ref in
// C++17): lock-free atomics of the plain type's size and alignment, whose
// operations are the processor's plain atomic instructions.
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
              sizeof(std::atomic<uint64_t>) == sizeof(uint64_t));
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
              sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

uint64_t DoorbellBytes(int num_params) {
  const uint64_t end = DoorbellWordOffset(num_params < 0 ? 0 : num_params);
  return (end + kAlignment - 1) / kAlignment * kAlignment;
}

uint64_t EncodeWord(const DoorbellWord& w) {
  const uint64_t serial = w.serial & ((uint64_t{1} << kDoorbellSerialBits) - 1);
  const uint64_t step = static_cast<uint64_t>(w.step) & kMaxDoorbellStep;
  return serial << 42 | step << 2 | uint64_t{w.absent} << 1 |
         uint64_t{w.skipped};
}

DoorbellWord DecodeWord(uint64_t word) {
  DoorbellWord w;
  w.skipped = word & 1;
  w.absent = (word >> 1) & 1;
  w.step = static_cast<int64_t>((word >> 2) & kMaxDoorbellStep);
  w.serial = static_cast<uint32_t>(word >> 42);
  return w;
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX,
            nullptr, nullptr, 0);
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::milliseconds timeout) {
  const auto ms = timeout.count() < 0 ? 0 : timeout.count();
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(ms / 1000);
  ts.tv_nsec = static_cast<long>(ms % 1000) * 1000000;  // NOLINT(runtime/int)
  // EAGAIN (the value moved), EINTR, ETIMEDOUT, EFAULT: all return to the
  // caller, who re-checks.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
            &ts, nullptr, 0);
}

DoorbellView::DoorbellView(std::byte* area, int num_params)
    : area_(area), num_params_(num_params) {}

std::atomic<uint32_t>* DoorbellView::counter_word() const {
  return reinterpret_cast<std::atomic<uint32_t>*>(area_ +
                                                  kDoorbellCounterOffset);
}

uint32_t DoorbellView::counter() const {
  return counter_word()->load(std::memory_order_acquire);
}

uint64_t DoorbellView::word(int param) const {
  return reinterpret_cast<const std::atomic<uint64_t>*>(
             area_ + DoorbellWordOffset(param))
      ->load(std::memory_order_acquire);
}

void DoorbellView::Wait(uint32_t seen,
                        std::chrono::milliseconds timeout) const {
  FutexWait(counter_word(), seen, timeout);
}

void DoorbellView::Poke() const {
  counter_word()->fetch_add(1, std::memory_order_release);
  FutexWakeAll(counter_word());
}

}  // namespace dmuon::transport
