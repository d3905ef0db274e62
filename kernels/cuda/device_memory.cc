// Context's device-memory helpers (Allocate, Free, Upload, Download) and
// the dense Gemm (see context_impl.h).

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/context_impl.h"
#include "kernels/cuda/ns_kernels.h"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/plan_logic.h"

namespace dmuon::kernels::cuda {
namespace {

// Byte alignment (power of two <= 256) of p + i * stride_bytes for all i.
int64_t PointerAlignment(const void* p, int64_t stride_bytes, int64_t batch) {
  return plan::AlignmentBytes(
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 256), stride_bytes,
      batch, 1);
}

// The arguments of Upload and Download (n == 0 needs no pointers).
absl::Status CheckCopy(const void* host, const void* device, int64_t n,
                       DType dtype) {
  if (n < 0) return absl::InvalidArgumentError("n must be >= 0");
  if (!ValidDType(dtype)) return absl::InvalidArgumentError("invalid dtype");
  if (n > 0 && (host == nullptr || device == nullptr)) {
    return absl::InvalidArgumentError(host == nullptr ? "host is null"
                                                      : "device is null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<void*> ContextImpl::Allocate(size_t bytes) {
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* p = nullptr;
  DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
  return p;
}

absl::Status ContextImpl::Free(void* ptr) {
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DMUON_CUDA_RETURN_IF_ERROR(cudaFree(ptr));
  return absl::OkStatus();
}

uint64_t ContextImpl::MemoryBytes() const {
  uint64_t bytes = kWorkspaceBytes + staging_bytes_ + sizeof(int);
  for (const auto& [key, plan] : plans_) bytes += plan->bytes();
  return bytes;
}

absl::Status ContextImpl::Staging(size_t bytes) {
  if (bytes <= staging_bytes_) return absl::OkStatus();
  if (staging_ != nullptr) {
    DMUON_CUDA_RETURN_IF_ERROR(cudaFree(staging_));
    staging_ = nullptr;
    staging_bytes_ = 0;
  }
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&staging_), bytes));
  staging_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status ContextImpl::Upload(const float* host, int64_t n, void* device,
                                 DType dtype) {
  if (auto st = CheckCopy(host, device, n, dtype); !st.ok() || n == 0)
    return st;
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (dtype == DType::kF32) {
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  } else {
    if (auto st = Staging(bytes); !st.ok()) return st;
    DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        staging_, host, bytes, cudaMemcpyHostToDevice, stream_));
    DMUON_CUDA_RETURN_IF_ERROR(device::LaunchCast(
        staging_, device::Elem::kF32, device, ElemOf(dtype), n, stream_));
  }
  DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status ContextImpl::Download(const void* device, DType dtype, int64_t n,
                                   float* host) {
  if (auto st = CheckCopy(host, device, n, dtype); !st.ok() || n == 0)
    return st;
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  const void* src = device;
  if (dtype != DType::kF32) {
    if (auto st = Staging(bytes); !st.ok()) return st;
    DMUON_CUDA_RETURN_IF_ERROR(device::LaunchCast(
        device, ElemOf(dtype), staging_, device::Elem::kF32, n, stream_));
    src = staging_;
  }
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status ContextImpl::Gemm(const void* a, const void* b, void* c,
                               DType dtype, int64_t m, int64_t n, int64_t k,
                               int64_t batch) {
  if (!ValidDType(dtype)) return absl::InvalidArgumentError("invalid dtype");
  if (m <= 0 || n <= 0 || k <= 0 || batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm dimensions must be positive: m=", m, " n=", n,
                     " k=", k, " batch=", batch));
  }
  if (a == nullptr || b == nullptr || c == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(a == nullptr   ? "a"
                                                   : b == nullptr ? "b"
                                                                  : "c",
                                                   " is null"));
  }
  // Row-major C (m x n) = A (m x k) B^T, B stored n x k: see plan_logic.h.
  using plan::Buf;
  const plan::Gemm g =
      plan::RowMajorGemm(plan::Whole(Buf::kA, m, k, m * k),
                         plan::Transposed(plan::Whole(Buf::kB, n, k, n * k)),
                         plan::Whole(Buf::kT, m, n, m * n),
                         plan::Whole(Buf::kT, m, n, m * n), 1, 0, batch);
  const int64_t eb = static_cast<int64_t>(DTypeBytes(dtype));
  // cuBLASLt's A is the row-major B, its B the row-major A.
  const std::array<int64_t, 4> align = {PointerAlignment(b, n * k * eb, batch),
                                        PointerAlignment(a, m * k * eb, batch),
                                        PointerAlignment(c, m * n * eb, batch),
                                        PointerAlignment(c, m * n * eb, batch)};
  const std::string key = absl::StrCat(plan::GemmDescriptorKey(g, eb), " dt",
                                       static_cast<int>(dtype), " al", align[0],
                                       "/", align[1], "/", align[2]);
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  auto it = gemms_.find(key);
  if (it == gemms_.end()) {
    if (gemms_.size() >= kMaxGemmConfigs) gemms_.clear();  // a benchmark aid
    auto mm =
        LtMatmul::Create(lt_, g, CudaDataType(dtype), align, kWorkspaceBytes);
    if (!mm.ok()) return mm.status();
    it = gemms_.emplace(key, *std::move(mm)).first;
  }
  return it->second->Run(lt_, 1.0f, b, a, 0.0f, c, c, workspace_,
                         kWorkspaceBytes, stream_);
}

}  // namespace dmuon::kernels::cuda
