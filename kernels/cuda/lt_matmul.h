// One cuBLASLt matmul configuration: the operation and layout descriptors of
// a column-major strided-batched GEMM (plan_logic.h's Gemm) and the
// algorithms cuBLASLt's heuristic proposes for it: up to
// algo::kHeuristicResults, those reporting an error or needing more than the
// workspace dropped at creation; Run uses the best that works and falls back
// to the next on CUBLAS_STATUS_NOT_SUPPORTED, remembering the one that ran
// (algo_fallback.h).
// Compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F (alpha and beta are
// host floats), A, B, C and D all of one data type.

#ifndef DMUON_KERNELS_CUDA_LT_MATMUL_H_
#define DMUON_KERNELS_CUDA_LT_MATMUL_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/algo_fallback.h"
#include "kernels/cuda/plan_logic.h"

namespace dmuon::kernels::cuda {

class LtMatmul {
 public:
  // `alignment` holds the guaranteed byte alignment of the A, B, C and D
  // pointers of every batch matrix (powers of two <= 256); the heuristic
  // only considers algorithms that accept them.
  static absl::StatusOr<std::unique_ptr<LtMatmul>> Create(
      cublasLtHandle_t handle, const plan::Gemm& gemm, cudaDataType_t type,
      const std::array<int64_t, 4>& alignment, size_t workspace_bytes);
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  // D = alpha op(A) op(B) + beta C on `stream`. C may equal D (in place).
  // Tries the candidates as algo::AlgoFallback::Run does (UNIMPLEMENTED
  // naming the GEMM when every one is refused). Not thread-safe.
  absl::Status Run(cublasLtHandle_t handle, float alpha, const void* a,
                   const void* b, float beta, const void* c, void* d,
                   void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

  // The candidate Run uses first (index into the usable heuristic results).
  int current_algorithm() const { return fallback_->current(); }
  int algorithm_count() const { return fallback_->count(); }

  const std::string& description() const { return description_; }

 private:
  LtMatmul() = default;

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  cublasLtMatrixLayout_t b_ = nullptr;
  cublasLtMatrixLayout_t cd_ = nullptr;  // C and D share one layout
  struct Candidate {
    cublasLtMatmulAlgo_t algo{};
    size_t workspace = 0;
  };
  std::vector<Candidate> candidates_;  // usable heuristic results, best first
  std::unique_ptr<algo::AlgoFallback> fallback_;
  std::string description_;
};

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_LT_MATMUL_H_
