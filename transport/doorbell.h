// The doorbell of the shm transport (docs/protocol.md "Doorbell"): the
// trainer declares its gradients, and dmuond announces its updates, by words
// in the session's segment and a futex wake, instead of gradients_ready and
// UpdatesReady messages on the Step stream. Each gRPC message costs the
// trainer's core 110-175 µs (2026-12-07, AMD EPYC VM: the client's stream
// writer and reader and gRPC's own threads); a word and a wake cost a few.
//
// The area (offsets from its start, which is a multiple of kAlignment at or
// after the layout's total_bytes; n parameters; DoorbellBytes(n) bytes):
//   [0, 4)      update counter (uint32): dmuond adds 1 after each
//               announcement and wakes its waiters (FUTEX_WAKE, shared):
//               at every announcement, or, for a client that keeps the
//               waiters count (OpenSessionRequest.doorbell_waiters), only
//               when that count is not 0.
//   [32, 36)    update waiters (uint32, client): how many of its threads
//               wait, or are about to wait, on the update counter.
//   [64, 68)    declare counter (uint32): the client adds 1 after each
//               declaration (or rewind) and wakes its waiters.
//   [128, 136)  the rewind word (client): EncodeWord of {serial, step}.
//   update words, n uint64 (dmuond): UpdateWordOffset(p).
//   declare words, n uint64 (client): DeclareWordOffset(n, p).
//   momenta, n double (client): MomentumOffset(n, p), read by dmuond when
//               the declare word says so.
//   update marks, MarkWords(n) uint64 (dmuond sets, the client takes):
//               bit p % 64 of word p / 64 set after update word p is
//               stored; UpdateMarksOffset(n).
//   declare marks, likewise (the client sets, dmuond takes) for the
//               declare words; DeclareMarksOffset(n).
// A word is EncodeWord(serial, step, two flags): the serial (its writer's
// count of words written, truncated) makes every write a new value, so the
// reader tells a step written twice (a Rewind and the step again) from one
// it has seen. A reader takes a word as new when it differs from the last
// value it saw. Writers store a word after what it covers (the update, the
// gradient, the momentum) with release; readers load it with acquire.
//
// Marks: a writer sets a word's mark after storing it (release); a reader
// swaps the mark words with 0 (acquire) and loads only the words marked.
// So a reader's pass costs the words that changed, plus n / 64 mark words,
// not n words: a trainer of 10,000 matrices rings about 10,000 times a step,
// and scanning every word at each ring would be 10^8 loads a step on each
// side. A mark taken before its word's newest store is set again by it, so
// no store goes unseen.
//
// Trust: the client trusts dmuond's words as it trusts its updates. dmuond
// trusts nothing the client writes: it loads the declare side through the
// SIGBUS guard (a client may shrink the segment at any time) and hands what
// it read to the same checks as a gradients_ready message.

#ifndef DMUON_TRANSPORT_DOORBELL_H_
#define DMUON_TRANSPORT_DOORBELL_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace dmuon::transport {

class GuardedMapping;

// The area's size for `num_params` parameters (>= 0), a multiple of
// kAlignment (transport.h).
uint64_t DoorbellBytes(int num_params);

inline constexpr uint64_t kUpdateCounterOffset = 0;
inline constexpr uint64_t kUpdateWaitersOffset = 32;
inline constexpr uint64_t kDeclareCounterOffset = 64;
inline constexpr uint64_t kRewindWordOffset = 128;
uint64_t UpdateWordOffset(int param);
uint64_t DeclareWordOffset(int num_params, int param);
uint64_t MomentumOffset(int num_params, int param);
// Mark words: one bit per parameter, parameter p at bit p % 64 of word
// p / 64 (bits past the last parameter mean nothing).
int MarkWords(int num_params);
uint64_t UpdateMarksOffset(int num_params);
uint64_t DeclareMarksOffset(int num_params);

// One word. Update words: `flag_a` = skipped (the step left the parameter
// unchanged: not to apply), `flag_b` = absent (declared absent: nothing to
// apply). Declare words: `flag_a` = the momentum slot holds this step's
// momentum, `flag_b` = absent (no gradient this step). Rewind word: no
// flags. `step` must satisfy DoorbellStepFits; beyond it both sides use
// the Step stream.
struct DoorbellWord {
  uint32_t serial = 0;  // kDoorbellSerialBits bits
  int64_t step = 0;     // 0: never written
  bool flag_a = false;
  bool flag_b = false;
};
inline constexpr int kDoorbellSerialBits = 22;
inline constexpr int64_t kMaxDoorbellStep = (int64_t{1} << 40) - 1;
inline bool DoorbellStepFits(int64_t step) {
  return step >= 1 && step <= kMaxDoorbellStep;
}

// Bits 0 flag_a, 1 flag_b, 2..41 step, 42..63 serial (mod 2^22).
uint64_t EncodeWord(const DoorbellWord& w);
DoorbellWord DecodeWord(uint64_t word);

// futex(2) on a uint32 in shared memory (not FUTEX_PRIVATE: waiter and
// waker are different processes). Wait returns when *word != expected,
// after a wake, after `timeout`, or spuriously: callers re-check. Both are
// safe on an address whose page is gone (EFAULT, no signal).
void FutexWakeAll(std::atomic<uint32_t>* word);
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::milliseconds timeout);

// dmuond's side: its own mapping of the area (so that a reader of the
// declarations may outlive the session's Region), written and read through
// the SIGBUS guard. Thread-safe. Made by CreateShmRegion.
class Doorbell {
 public:
  // Takes `base`, a MAP_SHARED mapping of the area (DoorbellBytes(
  // num_params) bytes), unmapped by the destructor. `offset`: the area's
  // offset in the segment, for the response. `client_counts_waiters`: the
  // client keeps the update-waiters count (OpenSessionRequest.
  // doorbell_waiters), so Announce wakes it only when the count is not 0.
  Doorbell(void* base, uint64_t offset, int num_params,
           bool client_counts_waiters = false);
  ~Doorbell();
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;

  uint64_t offset() const { return offset_; }
  int num_params() const { return num_params_; }
  uint64_t bytes() const { return DoorbellBytes(num_params_); }
  bool client_counts_waiters() const { return client_counts_waiters_; }

  // Stores `word` as parameter `param`'s update word (release: what this
  // thread wrote before, the update in the tensor mapping included, is
  // visible first), sets its mark, moves the update counter and wakes the
  // client (one that counts its waiters: only when one waits; the count is
  // loaded after the counter moved, with a full fence between, so a client
  // that counted itself before its last look at the counter is woken).
  // DATA_LOSS once the client shrank the segment; OUT_OF_RANGE for a
  // parameter outside the area.
  absl::Status Announce(int param, uint64_t word);

  // What the client declared since the last Take: the declare marks taken
  // (set to 0), then the marked parameters' words, their momentum slots,
  // and the rewind word, in the reverse of the order the client stores
  // them (so a declaration seen implies the rewind before it is seen too).
  // Marks past the last parameter are ignored. DATA_LOSS once the client
  // shrank the segment. Not for two threads at once (one reader takes).
  struct Declarations {
    std::vector<int> params;       // marked, ascending
    std::vector<uint64_t> words;   // params[k]'s declare word
    std::vector<double> momentum;  // params[k]'s momentum slot
    uint64_t rewind = 0;
  };
  absl::Status Take(Declarations* out);
  // The declare counter (0 once the mapping faulted); waits for it to move
  // from `seen`, a wake or `timeout`.
  uint32_t declare_counter();
  void WaitDeclared(uint32_t seen, std::chrono::milliseconds timeout);
  // Wakes a thread in WaitDeclared, or about to enter it (to see its stop
  // flag): moves the declare counter too.
  void WakeDeclared();

 private:
  absl::Status Lost() const;

  std::byte* const area_;
  const uint64_t offset_;
  const int num_params_;
  const bool client_counts_waiters_;
  std::unique_ptr<GuardedMapping> guard_;
};

// The client's side, on its own mapping of the segment (dmuond cannot
// shrink it under the client, and the client trusts it).
class DoorbellView {
 public:
  // `area`: the area's first byte (8-byte aligned); `num_params` words.
  DoorbellView(std::byte* area, int num_params);

  // Updates: the counter, a word (acquire: its update is in place), a wait
  // for the counter to move from `seen` (or a wake, or `timeout`).
  uint32_t update_counter() const;
  uint64_t update_word(int param) const;
  // The parameters whose update words dmuond stored since the last call,
  // ascending: their marks taken (set to 0), with acquire, so each marked
  // word then loads its newest store or a later one. Not for two threads
  // at once.
  void TakeUpdated(std::vector<int>* params) const;
  // Counts this thread in the update waiters (a full fence after), then
  // sleeps unless the counter moved from `seen`, until a wake or `timeout`
  // (or spuriously), and counts it out. A caller reads `seen` before it
  // looks at the words, and looks again after: what dmuond announced after
  // that read either moved the counter before the sleep or wakes it.
  void WaitUpdates(uint32_t seen, std::chrono::milliseconds timeout) const;
  // Moves the update counter and wakes its waiters, if WaitUpdates counts
  // one: the client's own threads, for news that came another way (each
  // Step stream message, its end).
  void PokeUpdates() const;

  // Declarations: each stores a word (release: the gradient written before
  // it, and the momentum slot, are visible first) and sets its mark; Ring
  // then moves the declare counter and wakes dmuond once for all of them.
  void SetMomentum(int param, double momentum) const;
  void Declare(int param, uint64_t word) const;
  void Rewind(uint64_t word) const;
  void Ring() const;

  int num_params() const { return num_params_; }

 private:
  template <typename T>
  std::atomic<T>* at(uint64_t offset) const {
    return reinterpret_cast<std::atomic<T>*>(area_ + offset);
  }
  std::byte* const area_;
  const int num_params_;
};

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_DOORBELL_H_
