// dmuon kernels, CUDA implementation (the Context is built only with
// --config=cuda; this header's dtypes and options build everywhere, with
// resolve_logic.h, which decides what a call runs).
//
// Newton–Schulz on device buffers in bf16, fp16 or fp32, with the semantics
// of the CPU implementation (kernels/kernels.h), which is its oracle:
//   - products through cuBLASLt in the compute dtype (bf16 or fp16; Gram in
//     fp16, see CudaNsOptions::compute) with fp32 accumulation; the
//     normalization (Frobenius norm) in fp32;
//   - symmetric products (X X^T, A A, and every m x m product in Gram mode)
//     compute only the row panels of the upper triangle (kernels/tiling.h)
//     and a mirror kernel fills the lower one;
//   - a X + B X is one product with beta = a writing a second buffer;
//   - a batch of same-shape matrices runs as strided-batched products;
//   - the whole sequence for one (shape, batch, dtypes, method, buffers) is
//     captured once as a CUDA graph and replayed.
// Every CUDA and cuBLAS call is checked by one macro per library that turns a
// failure into an absl::Status with file, line and the library's message.
//
// No CUDA type appears here, so hosts without the toolkit can include it.

#ifndef DMUON_KERNELS_CUDA_CUDA_KERNELS_H_
#define DMUON_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernels.h"

namespace dmuon::kernels::cuda {

enum class DType { kF32, kBF16, kF16 };
std::string_view DTypeName(DType t);
size_t DTypeBytes(DType t);

// Number of usable CUDA devices. Any error from the runtime (no driver, a
// driver older than the runtime) is returned as FAILED_PRECONDITION with its
// message; callers treat it as "no GPU".
absl::StatusOr<int> DeviceCount();

// `batch` same-shape row-major matrices, contiguous (matrix i starts at
// element i * shape.elements()), in device memory of `bytes` capacity.
struct DeviceBatch {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  Shape shape;
  int64_t batch = 1;
  size_t bytes = 0;
};

struct CudaNsOptions {
  NsOptions ns;
  // Dtype of the iterates and of every product's inputs and outputs
  // (accumulation is always fp32). kF32 runs fp32 products (a slow
  // reference path). Whenever the method resolves to Gram (kGram, or kAuto
  // choosing it) bf16 is replaced by fp16: Gram squares the condition
  // number and needs fp16's 3 more mantissa bits (kernels/cuda/
  // resolve_logic.h, ResolveNs).
  DType compute = DType::kBF16;
  bool symmetric = true;   // triangle-only products where results are symmetric
  bool use_graphs = true;  // capture and replay a CUDA graph per plan
  // The jobs (any ids the caller chooses; the CUDA executor passes
  // the job serials of its batch) the call runs for: each references the
  // plan the call uses until Context::ReleasePlans(job). Empty: none (the
  // plan is cached but in no job's use). See Context on the plan cache.
  std::vector<uint64_t> plan_owners;
};

struct ContextOptions {
  // Device bytes of plans the plan cache keeps at most (see Context), 0:
  // kDefaultPlanCacheDivisor-th of the device's memory.
  uint64_t plan_cache_bytes = 0;
};
// The default plan cache cap: a quarter of the device's memory. A plan's
// buffers are a few matrices of its batch (2 x 4096 x 14336 plus 2 x 4096 x
// 4096 bf16 elements per matrix: 4.8 GB for a batch of 16), so a quarter
// of an 80-141 GB GPU keeps a large job's plans cached and leaves the rest
// to momentum and staging.
inline constexpr uint64_t kDefaultPlanCacheDivisor = 4;

// The plan cache's state (Context::PlanStats).
struct PlanCacheStats {
  uint64_t bytes = 0;     // device bytes of the cached plans
  uint64_t cap = 0;       // ContextOptions::plan_cache_bytes, resolved
  uint64_t plans = 0;     // cached plans
  uint64_t freed = 0;     // plans evicted or released so far
  uint64_t over_cap = 0;  // plans created while the cache exceeded the cap
};

// One device, one stream, one cuBLASLt handle, a workspace pool and a cache of
// plans (descriptors, chosen algorithms, buffers, graphs). Not thread-safe:
// one executor thread owns one Context.
//
// The plan cache (kernels/cuda/plan_cache.h) is capped in device bytes
// (ContextOptions::plan_cache_bytes). A plan is in use while a job named in
// a call's plan_owners has not released it. Creating a plan first evicts
// plans in no job's use, least recently used first, until the new one fits
// under the cap; plans in use are never evicted, so the cache exceeds the
// cap when the plans in use need more (PlanStats counts it). ReleasePlans
// frees at once the plans no other job uses. Freeing a plan first waits for
// the stream (queued work may still use its buffers).
class Context {
 public:
  static absl::StatusOr<std::unique_ptr<Context>> Create(
      int device, const ContextOptions& options = {});
  virtual ~Context() = default;

  // out[i] <- NS(in[i]) for every matrix of the batch. in and out must have
  // the same shape and batch; dtypes may differ. Asynchronous on the
  // context's stream; errors found on the host (shapes, capacities, options)
  // return at once, device errors at the latest at Synchronize(). A
  // non-finite input makes the call fail (INVALID_ARGUMENT, found at
  // Synchronize()) and leaves `out` unspecified.
  virtual absl::Status Orthogonalize(const DeviceBatch& in,
                                     const DeviceBatch& out,
                                     const CudaNsOptions& options) = 0;

  // The Muon momentum step on `n` fp32 elements (see kernels.h
  // MomentumUpdate), writing the update in `update_dtype`.
  virtual absl::Status MomentumUpdate(const float* grad, float* momentum,
                                      void* update, DType update_dtype,
                                      int64_t n, double mu, bool nesterov) = 0;

  // Waits for the stream; reports deferred errors (non-finite input, device
  // faults).
  virtual absl::Status Synchronize() = 0;

  // Device memory helpers for tests, benchmarks and tools.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual absl::Status Free(void* ptr) = 0;
  // Host fp32 <-> device `dtype` with conversion (round to nearest even).
  virtual absl::Status Upload(const float* host, int64_t n, void* device,
                              DType dtype) = 0;
  virtual absl::Status Download(const void* device, DType dtype, int64_t n,
                                float* host) = 0;

  // "NVIDIA H200 (sm_90, 132 SMs)" etc.
  virtual std::string DeviceDescription() const = 0;
  // The raw cudaStream_t the context issues work on.
  virtual void* stream() const = 0;
  // Device memory the context holds: workspace, staging, plans' buffers.
  virtual uint64_t MemoryBytes() const { return 0; }

  // Drops job `owner`'s references to its plans (CudaNsOptions::plan_owners)
  // and frees the plans no other job references, after waiting for the
  // stream. An owner without plans is not an error.
  virtual absl::Status ReleasePlans(uint64_t owner) = 0;
  virtual PlanCacheStats PlanStats() const = 0;

  // Plain dense GEMM C = A B^T (m x n x k, row-major, compute dtype in, fp32
  // accumulate) through the same cuBLASLt path: the benchmark's peak.
  virtual absl::Status Gemm(const void* a, const void* b, void* c, DType dtype,
                            int64_t m, int64_t n, int64_t k, int64_t batch) = 0;
};

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_CUDA_KERNELS_H_
