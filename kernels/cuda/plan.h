// A Newton–Schulz plan on one device: the operation list of a PlanSpec
// (plan_logic.h) bound to device buffers and cuBLASLt configurations, run
// directly or through CUDA graphs.
//
// A plan owns its work buffers, the per-matrix norms and norm partials, and
// one LtMatmul per distinct GEMM descriptor. Graphs are per (input, output)
// pointer pair: the first run for a pair executes the operations directly
// (so module loading and cuBLASLt's first-use initialization stay outside any
// capture), the second captures the sequence into a graph (thread-local
// capture mode) and launches it, later runs only launch it. At most
// kMaxGraphs graphs are kept per plan; the oldest is dropped first.

#ifndef DMUON_KERNELS_CUDA_PLAN_H_
#define DMUON_KERNELS_CUDA_PLAN_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/lt_matmul.h"
#include "kernels/cuda/ns_kernels.h"
#include "kernels/cuda/plan_logic.h"

namespace dmuon::kernels::cuda {

// What a plan borrows from its Context (which outlives it).
struct PlanEnv {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace, shared by all plans
  size_t workspace_bytes = 0;
  int* nonfinite = nullptr;  // device flag set when an input is not finite
};

class Plan {
 public:
  static constexpr size_t kMaxGraphs = 8;

  static absl::StatusOr<std::unique_ptr<Plan>> Create(
      const plan::PlanSpec& spec, DType in, DType out, DType compute,
      const PlanEnv& env);
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  // Enqueues out = NS(in) for the whole batch on `stream`.
  absl::Status Run(const void* in, void* out, cudaStream_t stream,
                   bool use_graph);

  // Device bytes the plan owns (its buffers; not the Context's workspace).
  size_t bytes() const { return bytes_; }
  // What Create allocates for `spec` in `compute`: the bytes() of that plan,
  // known before it is created.
  static size_t Bytes(const plan::PlanSpec& spec, DType compute);
  const plan::OpList& ops() const { return ops_; }

 private:
  struct Graph {
    int runs = 0;  // direct runs before capture
    cudaGraphExec_t exec = nullptr;
  };

  Plan() = default;
  // Sizes of the buffers Create allocates: the work buffers in
  // ops.work_buffers' order, then the norms and the norm partials.
  static std::vector<size_t> BufferBytes(const plan::PlanSpec& spec,
                                         const plan::OpList& ops,
                                         DType compute);
  absl::Status Allocate(size_t bytes, void** ptr);
  void* Pointer(plan::Buf b, int64_t offset, const void* in, void* out) const;
  absl::Status Enqueue(const void* in, void* out, cudaStream_t stream);
  absl::Status Capture(const void* in, void* out, cudaStream_t stream,
                       cudaGraphExec_t* exec);

  plan::PlanSpec spec_;
  plan::OpList ops_;
  DType in_ = DType::kF32, out_ = DType::kF32, compute_ = DType::kBF16;
  PlanEnv env_;
  std::array<void*, static_cast<int>(plan::Buf::kCount)> bufs_{};
  float* norms_ = nullptr;
  double* partials_ = nullptr;
  std::vector<void*> owned_;
  size_t bytes_ = 0;
  // LtMatmul per descriptor key; gemm_of_op_[i] points into it for GEMM ops.
  std::map<std::string, std::unique_ptr<LtMatmul>> matmuls_;
  std::vector<LtMatmul*> gemm_of_op_;
  // Graphs by (in, out), and their insertion order for eviction.
  std::map<std::pair<const void*, void*>, Graph> graphs_;
  std::vector<std::pair<const void*, void*>> graph_order_;
};

// The cuBLASLt data type and the kernels' element type of a DType.
cudaDataType_t CudaDataType(DType t);
device::Elem ElemOf(DType t);

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_PLAN_H_
