// Transports: how tensor bytes move between a trainer and dmuond.
//
// Both sides see a session's tensors as one memory Region laid out by
// ComputeLayout (a gradient slot and an update slot per parameter, this
// rank's view). A transport decides where that region lives:
//   shm    — a POSIX shared-memory segment created by the daemon (mode 0600,
//            unguessable name), mapped by both sides: tensors are written in
//            place, nothing is copied through gRPC. The daemon unlinks the
//            name as soon as the client has attached (the mappings keep the
//            memory alive), and at session end or client death at the latest.
//            A segment may also hold a doorbell (doorbell.h).
//   inline — a heap region on each side; tensor bytes travel inside Step
//            messages as chunks no larger than the message limit allows.
//   cuda_ipc, nccl — GPU regions (transport/cuda_ipc.h, transport/nccl.h):
//            device memory, seen by the daemon through Region::device();
//            their bytes() is empty.
// The daemon's service logic only ever sees Region; nothing outside this
// package knows a transport's internals.

#ifndef DMUON_TRANSPORT_TRANSPORT_H_
#define DMUON_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dmuon::transport {

class Doorbell;  // doorbell.h

// Where one parameter's two tensors sit in a region. Offsets are multiples
// of kAlignment.
struct Slot {
  int64_t rows = 0;  // this rank's view
  int64_t cols = 0;
  size_t element_bytes = 4;
  uint64_t gradient_offset = 0;
  uint64_t update_offset = 0;
  uint64_t bytes = 0;  // of each tensor: rows * cols * element_bytes
};

struct Layout {
  std::vector<Slot> slots;   // by parameter id
  uint64_t total_bytes = 0;  // end of the last tensor, rounded to kAlignment
};

inline constexpr uint64_t kAlignment = 64;

// Slots in parameter order: all gradients first, then all updates, each
// aligned. `views[i]` = {rows, cols, element_bytes} of parameter i as this
// rank holds it. INVALID_ARGUMENT on a non-positive dimension (or zero
// element_bytes) or on an overflow (total_bytes must fit int64), naming the
// parameter index and its shape.
struct TensorView {
  int64_t rows = 0;
  int64_t cols = 0;
  size_t element_bytes = 4;
};
absl::StatusOr<Layout> ComputeLayout(const std::vector<TensorView>& views);

// A GPU region's memory in this process's CUDA address space.
struct DeviceView {
  int device = -1;            // CUDA ordinal in this process
  std::byte* base = nullptr;  // device address of region byte 0
  uint64_t bytes = 0;         // >= the layout's total_bytes
  // A cudaEvent_t the client records after writing gradients; null: none.
  void* ready_event = nullptr;
};

// A session's tensor memory. Thread-compatible: callers synchronize.
class Region {
 public:
  virtual ~Region() = default;
  // GPU regions: the device memory (bytes() is then empty). Host regions:
  // null.
  virtual const DeviceView* device() const { return nullptr; }
  virtual absl::Span<std::byte> bytes() = 0;
  // OK while the memory can be touched safely. For shm, fails (DATA_LOSS,
  // naming the segment and both sizes) when the segment has been shrunk
  // below the declared size — touching it would raise SIGBUS — or once a
  // copy met such a shrink (the region is lost).
  virtual absl::Status Check() const = 0;
  // Copies `n` bytes at `offset` of the region out to `out` / in from `in`,
  // safely against a peer that changes the memory's size meanwhile: shm
  // copies through its mapping under a SIGBUS guard (sigbus_guard.h), so a
  // segment the client shrank (even between a Check and the copy) makes
  // them fail with DATA_LOSS naming the segment, never kills the process
  // (after a shrink during a copy the region is lost: every later call
  // fails too). OUT_OF_RANGE when [offset, offset + n) is not inside bytes().
  // The defaults copy through bytes() (memory that cannot shrink: heap).
  // Not for GPU regions (bytes() is empty).
  virtual absl::Status Read(uint64_t offset, void* out, uint64_t n);
  virtual absl::Status Write(uint64_t offset, const void* in, uint64_t n);
  // shm: the segment name; inline: empty.
  virtual const std::string& name() const = 0;

  // The doorbell (doorbell.h) of a shm region created with one; null
  // otherwise. Shared: a reader of its declarations may outlive the region
  // (it has its own mapping).
  virtual std::shared_ptr<Doorbell> doorbell() const { return nullptr; }

  // Transports that move data on request (nccl); the others share memory
  // with the client and have nothing to move. Pull: the client declared the
  // gradients of `params` for `step` ready; `done` runs once they are in the
  // region, or with the error. Push: the updates of `params` are in the
  // region; send them to the client, then `done`. Both return at once and
  // run `done` on the transport's own thread, never inside the call. (The
  // defaults, for transports that share memory, are never called by the
  // daemon and fail at once.)
  virtual bool moves_data() const { return false; }
  virtual void Pull(int64_t step, std::vector<int> params,
                    std::function<void(absl::Status)> done) {
    done(absl::UnimplementedError("this transport shares memory"));
  }
  virtual void Push(int64_t step, std::vector<int> params,
                    std::function<void(absl::Status)> done) {
    done(absl::UnimplementedError("this transport shares memory"));
  }
  // The client declared `count` parameters of `step` absent (no gradient:
  // GradientsReady.absent_param_ids). Nothing moves for them, but they count
  // among the step's gradients as Pull's do: nccl holds a step's update
  // sends until every one of its gradients was posted or declared absent
  // (nccl.h ExchangeOrder). An absent parameter's answer is a Push with no
  // params, which keeps its place among the other pushes. Memory-sharing
  // transports: nothing to do.
  virtual void Absent(int64_t step, int count) {}
};

// Heap memory of `bytes`, zero-filled (the inline transport). Allocation
// failure throws std::bad_alloc, like operator new.
std::unique_ptr<Region> NewHeapRegion(uint64_t bytes);

// Daemon side: creates and maps a new segment of `bytes` with mode 0600 and
// a name of the form "/dmuon-<32 random hex digits>" from a CSPRNG. The
// pages are reserved up front, so a full /dev/shm fails here
// (RESOURCE_EXHAUSTED) rather than with SIGBUS later. The Region never
// unlinks the name itself: call UnlinkShm.
// With `doorbell_params` >= 0 the segment also holds a doorbell for that
// many parameters (doorbell.h): DoorbellBytes(doorbell_params) bytes at the
// first page boundary at or after `bytes`, zero-filled, mapped on their own
// (Region::doorbell()); bytes() covers the tensors only.
// `doorbell_waiters`: the client keeps the doorbell's update-waiters count
// (OpenSessionRequest.doorbell_waiters; Doorbell's constructor).
absl::StatusOr<std::unique_ptr<Region>> CreateShmRegion(
    uint64_t bytes, int doorbell_params = -1, bool doorbell_waiters = false);

// Client side: maps an existing segment, failing with FAILED_PRECONDITION if
// it is smaller than `expected_bytes` or missing (NOT_FOUND). Maps exactly
// `expected_bytes`. INVALID_ARGUMENT for a name shm_open(3) cannot take.
absl::StatusOr<std::unique_ptr<Region>> OpenShmRegion(const std::string& name,
                                                      uint64_t expected_bytes);

// Removes a segment's name (idempotent: a missing name is OK). Mappings stay
// valid until unmapped.
absl::Status UnlinkShm(const std::string& name);

// Inline transport: splits [0, bytes) into chunks of at most `max_chunk`
// bytes, in order; none for bytes == 0. max_chunk must be > 0 (0 yields no
// chunks).
struct Chunk {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
std::vector<Chunk> SplitChunks(uint64_t bytes, uint64_t max_chunk);

// The largest chunk payload that keeps a Step message under
// `max_message_bytes`: 1 KiB is left for the message's other fields (tags,
// ids, offsets, length prefixes, a parameter name). Never below 1, so a limit
// of 1 KiB or less yields 1-byte chunks in messages over the limit.
uint64_t MaxChunkPayload(uint64_t max_message_bytes);

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_TRANSPORT_H_
