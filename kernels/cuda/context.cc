// Context creation, Orthogonalize, MomentumUpdate and Synchronize (see
// context_impl.h), plus the free functions of cuda_kernels.h.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/cuda_status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/context_impl.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/ns_kernels.h"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/plan_logic.h"
#include "kernels/cuda/resolve_logic.h"

namespace dmuon::kernels::cuda {

absl::StatusOr<int> DeviceCount() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    base::ClearLastCudaError();  // not a device fault: clear it
    return absl::FailedPreconditionError(
        absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorString(e)));
  }
  return count;
}

namespace {

// a * b * c without overflow, or -1.
int64_t CheckedProduct(int64_t a, int64_t b, int64_t c) {
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  if (a < 0 || b < 0 || c < 0) return -1;
  if (a != 0 && b > kMax / a) return -1;
  if (a * b != 0 && c > kMax / (a * b)) return -1;
  return a * b * c;
}

absl::Status CheckBatch(const DeviceBatch& b, std::string_view name) {
  const std::string n(name);
  if (!ValidDType(b.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(n, ".dtype is invalid"));
  }
  if (b.shape.rows <= 0 || b.shape.cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, ".shape ", ShapeString(b.shape), " has an empty dimension"));
  }
  if (b.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(n, ".batch must be >= 1, got ", b.batch));
  }
  if (b.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(n, ".data is null"));
  }
  const int64_t need = CheckedProduct(
      b.batch, b.shape.elements(), static_cast<int64_t>(DTypeBytes(b.dtype)));
  if (need < 0 || b.bytes < static_cast<uint64_t>(need)) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, ".bytes ", b.bytes, " is below the ", b.batch, " x ",
        ShapeString(b.shape), " ", std::string(DTypeName(b.dtype)),
        " it holds (", need < 0 ? std::string("overflow") : absl::StrCat(need),
        " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ContextImpl::Init() {
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  DMUON_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  description_ = absl::StrFormat(
      "%s (sm_%d%d, %d SMs, %.1f GiB)", prop.name, prop.major, prop.minor,
      prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30));
  cache_ = std::make_unique<PlanCache>(
      options_.plan_cache_bytes != 0
          ? options_.plan_cache_bytes
          : static_cast<uint64_t>(prop.totalGlobalMem) /
                kDefaultPlanCacheDivisor);
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DMUON_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&lt_));
  DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, kWorkspaceBytes));
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&nonfinite_), sizeof(int)));
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&nonfinite_host_), sizeof(int)));
  *nonfinite_host_ = 0;
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(nonfinite_, 0, sizeof(int), stream_));
  DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

ContextImpl::~ContextImpl() {
  // Errors cannot be reported from a destructor; release everything anyway.
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  plans_.clear();
  gemms_.clear();
  if (staging_ != nullptr) (void)cudaFree(staging_);
  if (nonfinite_host_ != nullptr) (void)cudaFreeHost(nonfinite_host_);
  if (nonfinite_ != nullptr) (void)cudaFree(nonfinite_);
  if (workspace_ != nullptr) (void)cudaFree(workspace_);
  if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::StatusOr<Plan*> ContextImpl::GetPlan(
    const plan::PlanSpec& spec, DType in, DType out, DType compute,
    const std::vector<uint64_t>& owners) {
  const std::string key =
      plan::PlanKey(spec, static_cast<int>(in), static_cast<int>(out),
                    static_cast<int>(compute));
  if (cache_->Use(key, owners)) return plans_.at(key).get();
  const size_t bytes = Plan::Bytes(spec, compute);
  if (auto st = FreePlans(cache_->MakeRoom(bytes)); !st.ok()) return st;
  PlanEnv env{lt_, workspace_, kWorkspaceBytes, nonfinite_};
  auto plan = Plan::Create(spec, in, out, compute, env);
  if (!plan.ok()) return plan.status();
  cache_->Insert(key, bytes, owners);
  return plans_.emplace(key, *std::move(plan)).first->second.get();
}

absl::Status ContextImpl::FreePlans(const std::vector<std::string>& keys) {
  if (keys.empty()) return absl::OkStatus();
  // Their buffers may still be in use by queued work.
  const cudaError_t sync = cudaStreamSynchronize(stream_);
  for (const std::string& key : keys) plans_.erase(key);
  DMUON_CUDA_RETURN_IF_ERROR(sync);
  return absl::OkStatus();
}

absl::Status ContextImpl::ReleasePlans(uint64_t owner) {
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return FreePlans(cache_->Release(owner));
}

PlanCacheStats ContextImpl::PlanStats() const {
  PlanCacheStats s;
  s.bytes = cache_->bytes();
  s.cap = cache_->cap();
  s.plans = cache_->size();
  s.freed = cache_->freed();
  s.over_cap = cache_->over_cap();
  return s;
}

absl::Status ContextImpl::Orthogonalize(const DeviceBatch& in,
                                        const DeviceBatch& out,
                                        const CudaNsOptions& options) {
  if (auto st = ValidateOptions(options.ns); !st.ok()) return st;
  if (!ValidDType(options.compute)) {
    return absl::InvalidArgumentError("options.compute is not a valid dtype");
  }
  if (auto st = CheckBatch(in, "in"); !st.ok()) return st;
  if (auto st = CheckBatch(out, "out"); !st.ok()) return st;
  if (out.shape != in.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("out.shape ", ShapeString(out.shape),
                     " differs from in.shape ", ShapeString(in.shape)));
  }
  if (out.batch != in.batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "out.batch ", out.batch, " differs from in.batch ", in.batch));
  }
  // kAuto resolved by the cost model; Gram computes in fp16 where bf16 was
  // asked for (resolve_logic.h says why).
  const ResolvedNs resolved = ResolveNs(in.shape, options);
  const plan::PlanSpec spec = MakePlanSpec(in.shape, in.batch, options);

  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  auto plan =
      GetPlan(spec, in.dtype, out.dtype, resolved.compute, options.plan_owners);
  if (!plan.ok()) return plan.status();
  // `in` is read only by the first two operations and `out` written only by
  // the last, so in and out may overlap.
  if (auto st = (*plan)->Run(in.data, out.data, stream_, options.use_graphs);
      !st.ok()) {
    return st;
  }
  DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(nonfinite_host_, nonfinite_,
                                             sizeof(int),
                                             cudaMemcpyDeviceToHost, stream_));
  return absl::OkStatus();
}

absl::Status ContextImpl::MomentumUpdate(const float* grad, float* momentum,
                                         void* update, DType update_dtype,
                                         int64_t n, double mu, bool nesterov) {
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("n must be >= 0, got ", n));
  }
  if (!ValidDType(update_dtype)) {
    return absl::InvalidArgumentError("update_dtype is not a valid dtype");
  }
  if (!(mu >= 0 && mu < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum must be in [0, 1), got ", mu));
  }
  if (n == 0) return absl::OkStatus();
  if (grad == nullptr || momentum == nullptr || update == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(grad == nullptr ? "grad"
                                                   : momentum == nullptr
                                                       ? "momentum"
                                                       : "update",
                                                   " is null"));
  }
  // The update may alias grad element for element (fp32) only.
  const auto overlaps = [n](const void* p, size_t p_elem, const void* q) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t b = reinterpret_cast<uintptr_t>(q);
    return a < b + n * sizeof(float) && b < a + n * p_elem;
  };
  const size_t ub = DTypeBytes(update_dtype);
  if (overlaps(update, ub, momentum) ||
      (overlaps(update, ub, grad) &&
       !(update == grad && update_dtype == DType::kF32))) {
    return absl::InvalidArgumentError(
        "update overlaps momentum, or overlaps grad other than as the same "
        "fp32 buffer");
  }
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DMUON_CUDA_RETURN_IF_ERROR(device::LaunchMomentum(
      grad, momentum, device::Elem::kF32, update, ElemOf(update_dtype), n,
      static_cast<float>(1.0 - mu), static_cast<float>(mu), nesterov, stream_));
  return absl::OkStatus();
}

absl::Status ContextImpl::Synchronize() {
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (*nonfinite_host_ != 0) {
    *nonfinite_host_ = 0;
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(nonfinite_, 0, sizeof(int), stream_));
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::InvalidArgumentError(
        "an Orthogonalize input since the last Synchronize() has a "
        "non-finite value (NaN or Inf); its output is unspecified");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(
    int device, const ContextOptions& options) {
  auto count = DeviceCount();
  if (!count.ok()) return count.status();
  if (device < 0 || device >= *count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " does not exist (", *count, " CUDA devices)"));
  }
  auto ctx = std::make_unique<ContextImpl>(device, options);
  if (auto st = ctx->Init(); !st.ok()) return st;
  return std::unique_ptr<Context>(std::move(ctx));
}

}  // namespace dmuon::kernels::cuda
