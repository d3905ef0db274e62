// Internal to the CUDA executor (cuda_executor.cc): grow-only device
// buffers, and the gather and scatter of tasks whose gradient and update
// live in device memory (executor.h DeviceIo), with peer copies for parts on
// another GPU. Everything is enqueued on the given stream.

#ifndef DMUON_SERVER_CUDA_CUDA_EXECUTOR_IO_H_
#define DMUON_SERVER_CUDA_CUDA_EXECUTOR_IO_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "server/executor.h"

namespace dmuon::server::gpu {

// cudaMalloc'ed memory that only grows (the old contents are dropped).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // At least `bytes`; synchronizes `stream` before replacing the memory.
  absl::Status Ensure(size_t bytes, cudaStream_t stream);
  float* floats() const { return static_cast<float*>(data_); }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

struct IoContext {
  int device = 0;  // the executor's GPU
  cudaStream_t stream = nullptr;
  DeviceBuffer* peer_temp = nullptr;  // one matrix from another GPU (kMean)
};

// slot <- the task's gradient, gathered from its parts (Gather modes, the
// host's order and rounding for kMean).
absl::Status GatherGradient(const ComputeTask& t, float* slot,
                            const IoContext& c);
// Every part's update rows <- slot.
absl::Status ScatterUpdate(const ComputeTask& t, const float* slot,
                           const IoContext& c);

}  // namespace dmuon::server::gpu

#endif  // DMUON_SERVER_CUDA_CUDA_EXECUTOR_IO_H_
