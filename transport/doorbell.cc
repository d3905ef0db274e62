#include "transport/doorbell.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/sigbus_guard.h"
#include "transport/transport.h"

namespace dmuon::transport {
namespace {

// Words in shared memory are reached as std::atomic (no std::atomic_ref in
// C++17): lock-free atomics of the plain type's size and alignment, whose
// operations are the processor's plain atomic instructions.
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
              sizeof(std::atomic<uint64_t>) == sizeof(uint64_t));
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
              sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

constexpr uint64_t kUpdateWordsOffset = 192;

uint64_t Align(uint64_t x) {
  return (x + kAlignment - 1) / kAlignment * kAlignment;
}
uint64_t Words(int n) {
  return Align(8 * static_cast<uint64_t>(n < 0 ? 0 : n));
}
uint64_t MarkBit(int param) { return uint64_t{1} << (param % 64); }
uint64_t MarkOffset(uint64_t marks, int param) {
  return marks + 8 * static_cast<uint64_t>(param / 64);
}

// The parameters (< n) whose bits are set in `marks`, ascending, appended.
void MarkedParams(const std::vector<uint64_t>& marks, int n,
                  std::vector<int>* out) {
  for (size_t k = 0; k < marks.size(); ++k) {
    for (uint64_t bits = marks[k]; bits != 0; bits &= bits - 1) {
      const int p = static_cast<int>(64 * k) + __builtin_ctzll(bits);
      if (p >= n) break;
      out->push_back(p);
    }
  }
}

}  // namespace

int MarkWords(int num_params) {
  return num_params <= 0 ? 0 : (num_params + 63) / 64;
}
uint64_t UpdateMarksOffset(int num_params) {
  return kUpdateWordsOffset + 3 * Words(num_params);
}
uint64_t DeclareMarksOffset(int num_params) {
  return UpdateMarksOffset(num_params) + Align(8 * MarkWords(num_params));
}
uint64_t DoorbellBytes(int num_params) {
  return DeclareMarksOffset(num_params) + Align(8 * MarkWords(num_params));
}
uint64_t UpdateWordOffset(int param) {
  return kUpdateWordsOffset + 8 * static_cast<uint64_t>(param);
}
uint64_t DeclareWordOffset(int num_params, int param) {
  return kUpdateWordsOffset + Words(num_params) +
         8 * static_cast<uint64_t>(param);
}
uint64_t MomentumOffset(int num_params, int param) {
  return kUpdateWordsOffset + 2 * Words(num_params) +
         8 * static_cast<uint64_t>(param);
}

uint64_t EncodeWord(const DoorbellWord& w) {
  const uint64_t serial = w.serial & ((uint64_t{1} << kDoorbellSerialBits) - 1);
  const uint64_t step = static_cast<uint64_t>(w.step) & kMaxDoorbellStep;
  return serial << 42 | step << 2 | uint64_t{w.flag_b} << 1 |
         uint64_t{w.flag_a};
}

DoorbellWord DecodeWord(uint64_t word) {
  DoorbellWord w;
  w.flag_a = word & 1;
  w.flag_b = (word >> 1) & 1;
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

// --- dmuond's side ---------------------------------------------------------

Doorbell::Doorbell(void* base, uint64_t offset, int num_params,
                   bool client_counts_waiters)
    : area_(static_cast<std::byte*>(base)),
      offset_(offset),
      num_params_(num_params),
      client_counts_waiters_(client_counts_waiters),
      guard_(std::make_unique<GuardedMapping>(base, bytes())) {}

Doorbell::~Doorbell() {
  guard_.reset();
  ::munmap(area_, bytes());
}

absl::Status Doorbell::Lost() const {
  return absl::DataLossError(
      absl::StrCat("the doorbell of the shm segment (offset ", offset_,
                   ") was cut off: the client shrank the segment"));
}

absl::Status Doorbell::Announce(int param, uint64_t word) {
  if (param < 0 || param >= num_params_) {
    return absl::OutOfRangeError(absl::StrCat("parameter ", param,
                                              " has no doorbell word (",
                                              num_params_, " parameters)"));
  }
  if (!guard_->Store64(UpdateWordOffset(param), word) ||
      !guard_->Or64(MarkOffset(UpdateMarksOffset(num_params_), param),
                    MarkBit(param)) ||
      !guard_->Increment32(kUpdateCounterOffset)) {
    return Lost();
  }
  if (client_counts_waiters_) {
    // Dekker's pattern with the client's WaitUpdates: the counter moved,
    // a full fence, then the waiters count; it counts itself, a full fence,
    // then checks the counter. One of the two sees the other's write.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    uint32_t waiters = 0;
    if (!guard_->Load32(kUpdateWaitersOffset, &waiters)) return Lost();
    // Any value but 0 (a hostile client's too) only costs this wake.
    if (waiters == 0) return absl::OkStatus();
  }
  // A cut-off page makes the wake fail with EFAULT, never a signal.
  FutexWakeAll(
      reinterpret_cast<std::atomic<uint32_t>*>(area_ + kUpdateCounterOffset));
  return absl::OkStatus();
}

absl::Status Doorbell::Take(Declarations* out) {
  std::vector<uint64_t> marks(static_cast<size_t>(MarkWords(num_params_)));
  if (!guard_->Take64s(DeclareMarksOffset(num_params_), marks.data(),
                       marks.size())) {
    return Lost();
  }
  out->params.clear();
  MarkedParams(marks, num_params_, &out->params);
  const size_t m = out->params.size();
  out->words.resize(m);
  out->momentum.resize(m);
  // Two guarded passes (the words, then their momenta), not one per word.
  std::vector<uint64_t> bits(m);
  if (!guard_->Gather64s(DeclareWordOffset(num_params_, 0), out->params.data(),
                         m, out->words.data()) ||
      !guard_->Gather64s(MomentumOffset(num_params_, 0), out->params.data(), m,
                         bits.data())) {
    return Lost();
  }
  for (size_t k = 0; k < m; ++k)
    std::memcpy(&out->momentum[k], &bits[k], sizeof(double));
  if (!guard_->Load64s(kRewindWordOffset, &out->rewind, 1)) return Lost();
  return absl::OkStatus();
}

uint32_t Doorbell::declare_counter() {
  uint32_t v = 0;
  return guard_->Load32(kDeclareCounterOffset, &v) ? v : 0;
}

void Doorbell::WaitDeclared(uint32_t seen, std::chrono::milliseconds timeout) {
  FutexWait(
      reinterpret_cast<std::atomic<uint32_t>*>(area_ + kDeclareCounterOffset),
      seen, timeout);
}

void Doorbell::WakeDeclared() {
  // The counter moved (the client never reads it): a waiter that has not
  // reached its wait yet does not sleep through this.
  (void)guard_->Increment32(kDeclareCounterOffset);
  FutexWakeAll(
      reinterpret_cast<std::atomic<uint32_t>*>(area_ + kDeclareCounterOffset));
}

// --- the client's side -----------------------------------------------------

DoorbellView::DoorbellView(std::byte* area, int num_params)
    : area_(area), num_params_(num_params) {}

uint32_t DoorbellView::update_counter() const {
  return at<uint32_t>(kUpdateCounterOffset)->load(std::memory_order_acquire);
}

uint64_t DoorbellView::update_word(int param) const {
  return at<uint64_t>(UpdateWordOffset(param))->load(std::memory_order_acquire);
}

void DoorbellView::TakeUpdated(std::vector<int>* params) const {
  params->clear();
  std::vector<uint64_t> marks(static_cast<size_t>(MarkWords(num_params_)));
  const uint64_t at_marks = UpdateMarksOffset(num_params_);
  for (size_t k = 0; k < marks.size(); ++k) {
    marks[k] =
        at<uint64_t>(at_marks + 8 * k)->exchange(0, std::memory_order_acq_rel);
  }
  MarkedParams(marks, num_params_, params);
}

void DoorbellView::WaitUpdates(uint32_t seen,
                               std::chrono::milliseconds timeout) const {
  std::atomic<uint32_t>* waiters = at<uint32_t>(kUpdateWaitersOffset);
  waiters->fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // FUTEX_WAIT compares the counter with `seen` itself, atomically with
  // going to sleep.
  FutexWait(at<uint32_t>(kUpdateCounterOffset), seen, timeout);
  waiters->fetch_sub(1, std::memory_order_relaxed);
}

void DoorbellView::PokeUpdates() const {
  at<uint32_t>(kUpdateCounterOffset)->fetch_add(1, std::memory_order_seq_cst);
  // As Announce with a counting client: no syscall while nobody waits.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (at<uint32_t>(kUpdateWaitersOffset)->load(std::memory_order_seq_cst) == 0)
    return;
  FutexWakeAll(at<uint32_t>(kUpdateCounterOffset));
}

void DoorbellView::SetMomentum(int param, double momentum) const {
  uint64_t bits;
  std::memcpy(&bits, &momentum, sizeof(bits));
  at<uint64_t>(MomentumOffset(num_params_, param))
      ->store(bits, std::memory_order_relaxed);
}

void DoorbellView::Declare(int param, uint64_t word) const {
  at<uint64_t>(DeclareWordOffset(num_params_, param))
      ->store(word, std::memory_order_release);
  at<uint64_t>(MarkOffset(DeclareMarksOffset(num_params_), param))
      ->fetch_or(MarkBit(param), std::memory_order_release);
}

void DoorbellView::Rewind(uint64_t word) const {
  at<uint64_t>(kRewindWordOffset)->store(word, std::memory_order_release);
}

void DoorbellView::Ring() const {
  at<uint32_t>(kDeclareCounterOffset)->fetch_add(1, std::memory_order_release);
  FutexWakeAll(at<uint32_t>(kDeclareCounterOffset));
}

}  // namespace dmuon::transport
