// Copies to and from a MAP_SHARED mapping of a file that another process
// may shrink at any moment (a client's shm segment), at memcpy speed and
// without dying of the SIGBUS that touching a page past the file's new end
// raises.
//
// Why not pread/pwrite: through the descriptor a shrink shows as a short
// read and never as a signal, but tmpfs copies page by page there, about
// 1.3 GB/s against 10 GB/s for a copy from the mapping (2026-12-07, AMD
// EPYC VM, 2.4 MB slots): 20 ms a step of the daemon's core for the 4-layer
// d=384 GPT's 29 MB of gradients.
//
// How: the first copy installs a process-wide SIGBUS handler (SA_SIGINFO,
// kept for the life of the process; a process that never copies, such as a
// client that writes its tensors in place, never gets one). While a thread
// copies through Copy{Out,In}, a SIGBUS on that thread at an address inside
// that mapping marks the mapping broken and maps anonymous zero pages over the
// whole of it (MAP_FIXED), so the interrupted copy resumes and finishes on
// zeros; the copy then reports failure, and so does every later one. A
// SIGBUS anywhere else goes to the disposition that was there before the
// handler (the default: the process dies, as it would have without it). The
// technique libwayland-server uses for its clients' shm pools.
//
// After a fault the mapping no longer shows the file: the region is lost,
// which the caller reports (DATA_LOSS) and the session ends on.

#ifndef DMUON_TRANSPORT_SIGBUS_GUARD_H_
#define DMUON_TRANSPORT_SIGBUS_GUARD_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dmuon::transport {

class GuardedMapping {
 public:
  // [base, base + size): a MAP_SHARED, PROT_READ | PROT_WRITE mapping the
  // caller owns and unmaps (after this object is gone). size may be 0.
  GuardedMapping(void* base, size_t size);
  GuardedMapping(const GuardedMapping&) = delete;
  GuardedMapping& operator=(const GuardedMapping&) = delete;

  // Copies n bytes at `offset` of the mapping out to `out` / in from `in`;
  // the caller keeps [offset, offset + n) inside the mapping. False when
  // the mapping faulted, in this copy or before (out's bytes are then
  // unspecified; in's may have landed on the zero pages). Thread-safe:
  // copies may run on several threads at once.
  bool CopyOut(size_t offset, void* out, size_t n);
  bool CopyIn(size_t offset, const void* in, size_t n);

  // Atomic stores into and loads from the mapping under the same guard
  // (the doorbell, doorbell.h): `offset` aligned to the word's size and
  // inside the mapping. Store64 is a release store (what the thread wrote
  // before, through the mapping or not, is visible to a reader that acquires
  // the word); Increment32 adds 1 (release). False as for the copies.
  bool Store64(size_t offset, uint64_t value);
  bool Increment32(size_t offset);
  // Or64 sets `bits` in the word at `offset` (fetch_or, release); Take64s
  // swaps each of `count` consecutive uint64 from `offset` with 0 (acquire
  // and release), its old value into `out`. False as for the copies.
  bool Or64(size_t offset, uint64_t bits);
  bool Take64s(size_t offset, uint64_t* out, size_t count);
  // Acquire loads of `count` consecutive uint64 from `offset`, in order, and
  // of one uint32. False as for the copies (`out` then unspecified).
  bool Load64s(size_t offset, uint64_t* out, size_t count);
  bool Load32(size_t offset, uint32_t* out);
  // Acquire loads, in order, of the uint64 at offset + 8 * index[k] for
  // each of `count` indices (>= 0, each word inside the mapping): a
  // reader of a few words of an array in one guarded pass. False as for the
  // copies.
  bool Gather64s(size_t offset, const int* index, size_t count, uint64_t* out);

  // True once a copy faulted: the mapping shows zero pages, not the file.
  bool broken() const { return broken_.load(); }

 private:
  // memcpy(to, from, n) with this mapping's fault guard; one side lies in
  // the mapping.
  bool Copy(void* to, const void* from, size_t n);
  // f() with this mapping's fault guard.
  template <typename F>
  bool Run(F f);

  std::byte* const base_;
  const size_t size_;
  std::atomic<bool> broken_{false};
};

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_SIGBUS_GUARD_H_
