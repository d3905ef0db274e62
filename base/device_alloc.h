// Zeroed device memory, the zeroing finished before anyone can use it.
//
// cudaMemset runs on the legacy default stream, which does not order
// itself with non-blocking streams (torch's side streams, NCCL's, the
// executors'): a transfer or kernel on one of them could read or write the
// memory before the zeroing reaches it. MallocZeroed zeroes on the calling
// thread's per-thread stream and waits for it, so the memory is zero when
// it returns, whatever stream touches it next, and no other stream's work
// is waited for.

#ifndef DMUON_BASE_DEVICE_ALLOC_H_
#define DMUON_BASE_DEVICE_ALLOC_H_

#include <cstddef>

#include "absl/status/statusor.h"

namespace dmuon::base {

// `bytes` of device memory on the current device, all zero (freed again on
// failure). RESOURCE_EXHAUSTED when the device is out of memory.
absl::StatusOr<void*> MallocZeroed(size_t bytes);

}  // namespace dmuon::base

#endif  // DMUON_BASE_DEVICE_ALLOC_H_
