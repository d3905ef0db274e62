// The Context implementation (kernels/cuda/cuda_kernels.h), internal to
// //kernels/cuda: one device, one non-blocking stream, one cuBLASLt handle
// and workspace, a pinned non-finite flag, a staging buffer and caches of
// plans (plan.h, capped in bytes by plan_cache.h's policy) and Gemm
// configurations. context.cc holds creation,
// Orthogonalize, MomentumUpdate and Synchronize; device_memory.cc the memory
// helpers and Gemm.

#ifndef DMUON_KERNELS_CUDA_CONTEXT_IMPL_H_
#define DMUON_KERNELS_CUDA_CONTEXT_IMPL_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/lt_matmul.h"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/plan_cache.h"
#include "kernels/cuda/plan_logic.h"

namespace dmuon::kernels::cuda {

inline constexpr size_t kWorkspaceBytes = size_t{32} << 20;
inline constexpr size_t kMaxGemmConfigs = 256;

inline bool ValidDType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

class ContextImpl final : public Context {
 public:
  ContextImpl(int device, const ContextOptions& options)
      : device_(device), options_(options) {}
  ~ContextImpl() override;

  absl::Status Init();

  absl::Status Orthogonalize(const DeviceBatch& in, const DeviceBatch& out,
                             const CudaNsOptions& options) override;
  absl::Status MomentumUpdate(const float* grad, float* momentum, void* update,
                              DType update_dtype, int64_t n, double mu,
                              bool nesterov) override;
  absl::Status Synchronize() override;
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  absl::Status Free(void* ptr) override;
  absl::Status Upload(const float* host, int64_t n, void* device,
                      DType dtype) override;
  absl::Status Download(const void* device, DType dtype, int64_t n,
                        float* host) override;
  std::string DeviceDescription() const override { return description_; }
  void* stream() const override { return stream_; }
  uint64_t MemoryBytes() const override;
  absl::Status Gemm(const void* a, const void* b, void* c, DType dtype,
                    int64_t m, int64_t n, int64_t k, int64_t batch) override;
  absl::Status ReleasePlans(uint64_t owner) override;
  PlanCacheStats PlanStats() const override;

 private:
  absl::Status Staging(size_t bytes);
  // The cached plan, or a new one (evicting others as plan_cache.h says),
  // now referenced by `owners`.
  absl::StatusOr<Plan*> GetPlan(const plan::PlanSpec& spec, DType in, DType out,
                                DType compute,
                                const std::vector<uint64_t>& owners);
  // Waits for the stream, then frees the plans of `keys` (already out of
  // cache_); the stream's status.
  absl::Status FreePlans(const std::vector<std::string>& keys);

  const int device_;
  const ContextOptions options_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  int* nonfinite_ = nullptr;       // device flag
  int* nonfinite_host_ = nullptr;  // pinned copy, written at each call's end
  float* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::string description_;
  // Plans by PlanKey; cache_ holds their bookkeeping (created in Init, once
  // the device's memory is known).
  std::unordered_map<std::string, std::unique_ptr<Plan>> plans_;
  std::unique_ptr<PlanCache> cache_;
  std::unordered_map<std::string, std::unique_ptr<LtMatmul>> gemms_;
};

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_CONTEXT_IMPL_H_
