// The update doorbell of the shm transport (docs/protocol.md "Update
// doorbell"): dmuond announces a parameter's update by a word in the
// session's segment and a futex wake, instead of an UpdatesReady message on
// the Step stream. A gRPC message costs the trainer's core about 175 µs to
// receive (2026-12-07, AMD EPYC VM: the client's stream reader and gRPC's
// own threads); a wake of the client's doorbell thread costs a few µs.
//
// Where it lives: after the layout's tensors (offset = the layout's
// total_bytes, a multiple of kAlignment), DoorbellBytes(n) bytes:
//   [0, 4)        counter: a uint32 dmuond increments after each
//                 announcement and wakes (FUTEX_WAKE, shared) every waiter
//                 on; the client waits on it.
//   [64, 64+8n)   one uint64 word per parameter: its last announcement.
// A word is EncodeWord(serial, step, flags): the serial (dmuond's count of
// the session's announcements, truncated) makes every announcement a new
// value, so the client can tell a step announced twice (a Rewind and the
// step again) from one it has seen. The client reads a word as new when it
// differs from the last it saw and its step is the one the client is at.
//
// Trust: the client trusts the daemon's words (it trusts its updates). The
// daemon never reads this area: it only stores into it, through the SIGBUS
// guard (a client may shrink the segment at any time).

#ifndef DMUON_TRANSPORT_DOORBELL_H_
#define DMUON_TRANSPORT_DOORBELL_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace dmuon::transport {

// The bytes of the doorbell area for `num_params` parameters, a multiple of
// kAlignment (transport.h). num_params >= 0.
uint64_t DoorbellBytes(int num_params);

// Offsets inside the area.
inline constexpr uint64_t kDoorbellCounterOffset = 0;
inline constexpr uint64_t kDoorbellWordsOffset = 64;
inline uint64_t DoorbellWordOffset(int param) {
  return kDoorbellWordsOffset + 8 * static_cast<uint64_t>(param);
}

// One announcement. `step` must lie in [1, kMaxDoorbellStep]; beyond it the
// daemon announces through the Step stream instead (DoorbellStepFits).
struct DoorbellWord {
  uint32_t serial = 0;   // kDoorbellSerialBits bits
  int64_t step = 0;      // 0: never announced
  bool skipped = false;  // the step left the parameter unchanged (an error
                         // with skipped = true; the update is not to apply)
  bool absent = false;   // the client declared it absent: nothing to apply
};
inline constexpr int kDoorbellSerialBits = 22;
inline constexpr int64_t kMaxDoorbellStep = (int64_t{1} << 40) - 1;
inline bool DoorbellStepFits(int64_t step) {
  return step >= 1 && step <= kMaxDoorbellStep;
}

// Bits 0 skipped, 1 absent, 2..41 step, 42..63 serial (mod 2^22).
uint64_t EncodeWord(const DoorbellWord& w);
DoorbellWord DecodeWord(uint64_t word);

// futex(2) on a uint32 in shared memory (not FUTEX_PRIVATE: the waiter and
// the waker are different processes). Wait returns when *word != expected,
// after a wake, after `timeout`, or spuriously: callers re-check. Both are
// safe on an address whose page is gone (EFAULT, no signal).
void FutexWakeAll(std::atomic<uint32_t>* word);
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::milliseconds timeout);

// The client's view of a doorbell area it has mapped (its own mapping; the
// daemon cannot shrink it under the client, and the client trusts it).
class DoorbellView {
 public:
  // `area`: the first byte of the area, 8-byte aligned; `num_params` words.
  DoorbellView(std::byte* area, int num_params);

  uint32_t counter() const;
  uint64_t word(int param) const;  // acquire: the update is in place
  // Waits for the counter to move from `seen` (or a wake, or `timeout`).
  void Wait(uint32_t seen, std::chrono::milliseconds timeout) const;
  // Moves the counter and wakes its waiters: a client thread stopping its
  // own doorbell thread.
  void Poke() const;
  int num_params() const { return num_params_; }

 private:
  std::atomic<uint32_t>* counter_word() const;
  std::byte* const area_;
  const int num_params_;
};

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_DOORBELL_H_
