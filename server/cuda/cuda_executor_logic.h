// Host-side rules of the CUDA executor (cuda_executor.h) in plain C++ (no
// CUDA types), built and tested in the default configuration.

#ifndef DMUON_SERVER_CUDA_CUDA_EXECUTOR_LOGIC_H_
#define DMUON_SERVER_CUDA_CUDA_EXECUTOR_LOGIC_H_

#include <functional>

#include "absl/status/status.h"

namespace dmuon::server::gpu {

// A call that failed with `status` (not OK) after it may have enqueued work
// on the executor's stream waits for that stream before it returns: `sync`
// (cudaStreamSynchronize on it) runs once. Until then a copy or kernel of
// the call may still read or write the callers' memory: the tasks' host
// buffers, or a trainer's CUDA IPC mappings that a session closed right
// after the failure unmaps.
//
// Returns `status` when the sync succeeds. When it fails too, the message
// says both (the call's failure first) and the code is that of the more
// serious fault (gpu_logic.h ClassifyFault: a device error over out of
// memory over an input error), so a device fault the wait uncovers is not
// reported as, say, an out-of-memory the next batch would clear.
absl::Status FinishOnError(absl::Status status,
                           const std::function<absl::Status()>& sync);

}  // namespace dmuon::server::gpu

#endif  // DMUON_SERVER_CUDA_CUDA_EXECUTOR_LOGIC_H_
