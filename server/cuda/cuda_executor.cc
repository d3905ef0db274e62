// The CUDA executor (cuda_executor.h).

#include "server/cuda/cuda_executor.h"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/cuda_status.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/elementwise_kernels.h"
#include "kernels/cuda/ns_kernels.h"
#include "server/cuda/cuda_executor_io.h"
#include "server/cuda/cuda_executor_logic.h"
#include "server/gpu_logic.h"

namespace dmuon::server {
namespace {

namespace cu = kernels::cuda;
namespace dev = kernels::cuda::device;

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(int device, std::unique_ptr<cu::Context> ctx,
               const CudaExecutorOptions& options)
      : device_(device),
        name_(absl::StrCat("cuda:", device)),
        options_(options),
        graphs_(options.use_graphs, options.strict),
        ctx_(std::move(ctx)),
        stream_(static_cast<cudaStream_t>(ctx_->stream())) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device_) == cudaSuccess)
      capacity_ = prop.totalGlobalMem;
    UpdateMemory();
  }

  ~CudaExecutor() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    for (auto& [key, s] : pool_) {
      (void)cudaFree(s.ptr);
      (void)cudaFree(s.start);
    }
    if (flags_ != nullptr) (void)cudaFree(flags_);
    if (flags_host_ != nullptr) (void)cudaFreeHost(flags_host_);
  }

  std::string device() const override { return name_; }
  bool holds_state() const override { return true; }
  // Every state has a second buffer of its size: the step-start copy.
  bool keeps_step_start() const override { return true; }
  bool reads_device_memory() const override { return true; }
  bool healthy() const override { return health_.healthy(); }
  std::string last_error() const override { return health_.last_error(); }
  uint64_t memory_bytes() const override { return memory_.load(); }
  uint64_t device_memory_capacity() const override { return capacity_; }
  uint64_t graph_fallbacks() const override { return graphs_.fallbacks(); }

  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    if (batch.empty()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    if (health_.out_of_service()) {
      return absl::UnavailableError(
          absl::StrCat(name_, " is out of service after a device error (",
                       health_.last_error(),
                       "); jobs planned on it cannot step: restart dmuond"));
    }
    absl::Status st = ComputeLocked(batch);
    if (!st.ok()) {
      base::ClearLastCudaError();  // clear a non-sticky error (out of memory)
      // The batch's copies and kernels enqueued before the failure may still
      // read or write the tasks' buffers: wait for them first.
      st = gpu::FinishOnError(std::move(st), [&] {
        mu_.AssertHeld();  // called back here, under the lock
        return SyncStream();
      });
      base::ClearLastCudaError();
      st = absl::Status(st.code(),
                        absl::StrCat(name_, ": batch of ", batch.size(), " x ",
                                     kernels::ShapeString(batch[0].shape), ": ",
                                     st.message()));
    }
    health_.Record(st);
    UpdateMemory();
    return st;
  }

  absl::Status ReadState(const StateKey& key, absl::Span<float> host) override {
    absl::MutexLock lock(&mu_);
    auto state = StateForCopy(key, host.size(), "read into");
    if (!state.ok() || *state == nullptr) return state.status();
    return Read((*state)->ptr, (*state)->n, host);
  }

  absl::Status ReadStepStart(const StateKey& key,
                             absl::Span<float> host) override {
    absl::MutexLock lock(&mu_);
    auto state = StateForCopy(key, host.size(), "read into");
    if (!state.ok() || *state == nullptr) return state.status();
    return Read((*state)->start, (*state)->n, host);
  }

  absl::Status RestoreStepStart(const StateKey& key) override {
    absl::MutexLock lock(&mu_);
    auto it = pool_.find(key);
    if (it == pool_.end()) return absl::OkStatus();
    const State& s = it->second;
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        s.ptr, s.start, s.bytes, cudaMemcpyDeviceToDevice, stream_));
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status WriteState(const StateKey& key,
                          absl::Span<const float> host) override {
    absl::MutexLock lock(&mu_);
    auto state = StateForCopy(key, host.size(), "written from");
    if (!state.ok() || *state == nullptr) return state.status();
    if (auto st = Load(host.data(), **state); !st.ok()) {
      // A copy from `host` may be in flight.
      return gpu::FinishOnError(std::move(st), [&] {
        mu_.AssertHeld();
        return SyncStream();
      });
    }
    return SyncStream();
  }

  void DropJob(uint64_t job) override {
    absl::MutexLock lock(&mu_);
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    for (auto it = pool_.lower_bound({job, -1});
         it != pool_.end() && it->first.job == job;) {
      (void)cudaFree(it->second.ptr);
      (void)cudaFree(it->second.start);
      pool_bytes_ -= 2 * it->second.bytes;
      it = pool_.erase(it);
    }
    // The job's NS plans, unless another open job uses them too.
    if (absl::Status st = ctx_->ReleasePlans(job); !st.ok()) {
      spdlog::warn("{}: releasing the plans of job {}: {}", name_, job,
                   st.ToString());
    }
    UpdateMemory();
  }

 private:
  // A momentum buffer and its step-start copy (keeps_step_start): `bytes`
  // each, fp32 or bf16 (options_.bf16_momentum).
  struct State {
    void* ptr = nullptr;
    void* start = nullptr;
    int64_t n = 0;
    size_t bytes = 0;
  };

  // host <- fp32 of `src` (a State's ptr or start, n elements).
  absl::Status Read(const void* src, int64_t n, absl::Span<float> host)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.bf16_momentum) {
      if (auto st = EnsureScratch(n); !st.ok()) return st;
      DMUON_CUDA_RETURN_IF_ERROR(dev::LaunchCast(
          src, dev::Elem::kBF16, scratch_.data(), dev::Elem::kF32, n, stream_));
      src = scratch_.data();
    }
    DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        host.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status ComputeLocked(absl::Span<const ComputeTask> batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const kernels::Shape shape = batch[0].shape;
    const int64_t n = shape.elements();
    const int64_t count = static_cast<int64_t>(batch.size());
    if (auto st = EnsureScratch(n * count); !st.ok()) return st;
    if (auto st = EnsureFlags(count); !st.ok()) return st;
    const gpu::IoContext io{device_, stream_, &peer_temp_};

    // Momentum buffers (new ones initialized from the host momentum).
    std::vector<State*> states;
    for (const ComputeTask& t : batch) {
      auto s = StateFor(t);
      if (!s.ok()) return s.status();
      states.push_back(*s);
    }
    // Step-start copies, before anything can change the momentum (skipped
    // tasks included): what a rollback restores (executor.h).
    for (const State* s : states) {
      DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          s->start, s->ptr, s->bytes, cudaMemcpyDeviceToDevice, stream_));
    }

    // Gradients into the staging slots; device gradients checked there.
    bool any_device = false;
    for (const ComputeTask& t : batch) any_device |= t.device_io != nullptr;
    if (any_device) {
      DMUON_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(flags_, 0, count * sizeof(int), stream_));
      std::set<void*> waited;
      for (const ComputeTask& t : batch) {
        if (t.device_io == nullptr) continue;
        for (const DevicePart& p : t.device_io->parts) {
          if (p.ready_event != nullptr && waited.insert(p.ready_event).second) {
            DMUON_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(
                stream_, static_cast<cudaEvent_t>(p.ready_event), 0));
          }
        }
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const ComputeTask& t = batch[i];
      float* slot = scratch_.floats() + i * n;
      if (t.device_io == nullptr) {
        DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            slot, t.grad, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      } else {
        if (auto st = gpu::GatherGradient(t, slot, io); !st.ok()) return st;
        DMUON_CUDA_RETURN_IF_ERROR(
            dev::LaunchFlagNonFinite(slot, n, flags_ + i, stream_));
      }
    }
    std::vector<bool> skip(count, false);
    if (any_device) {
      DMUON_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(flags_host_, flags_, count * sizeof(int),
                          cudaMemcpyDeviceToHost, stream_));
      DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      for (int64_t i = 0; i < count; ++i) {
        skip[i] = flags_host_[i] != 0;
        if (batch[i].nonfinite != nullptr) *batch[i].nonfinite = skip[i];
      }
    }

    // U = momentum step (in place over the gradient); a skipped task's slot
    // becomes zeros (NS maps zero to zero), so its update is zeros.
    for (int64_t i = 0; i < count; ++i) {
      const ComputeTask& t = batch[i];
      float* slot = scratch_.floats() + i * n;
      if (skip[i]) {
        DMUON_CUDA_RETURN_IF_ERROR(
            cudaMemsetAsync(slot, 0, n * sizeof(float), stream_));
        continue;
      }
      if (options_.bf16_momentum) {
        DMUON_CUDA_RETURN_IF_ERROR(dev::LaunchMomentum(
            slot, states[i]->ptr, dev::Elem::kBF16, slot, dev::Elem::kF32, n,
            static_cast<float>(1.0 - t.muon->momentum),
            static_cast<float>(t.muon->momentum), t.muon->nesterov, stream_));
      } else if (auto st = ctx_->MomentumUpdate(
                     slot, static_cast<float*>(states[i]->ptr), slot,
                     cu::DType::kF32, n, t.muon->momentum, t.muon->nesterov);
                 !st.ok()) {
        return st;
      }
    }

    // NS in place, in launches of power-of-two sizes; a plan whose CUDA
    // graph fails runs eagerly (GraphFallback) instead of failing the batch.
    // A failed capture or graph launch executes nothing and NS reads its
    // input before writing its output in place, so the eager retry sees the
    // same input.
    // The batch's jobs reference the plans its launches use (DropJob
    // releases them).
    cu::CudaNsOptions ns = ExecutorNsOptions(batch[0].muon->ns, options_);
    std::set<uint64_t> jobs;
    for (const ComputeTask& t : batch) jobs.insert(t.state.job);
    ns.plan_owners.assign(jobs.begin(), jobs.end());
    int64_t first = 0;
    for (int64_t size : SplitBatch(count, options_.max_launch)) {
      cu::DeviceBatch b;
      b.data = scratch_.floats() + first * n;
      b.dtype = cu::DType::kF32;
      b.shape = shape;
      b.batch = size;
      b.bytes = size * n * sizeof(float);
      const std::string key =
          GraphKey(shape.rows, shape.cols, size,
                   absl::StrCat(std::string(kernels::MethodName(ns.ns.method)),
                                ", ", std::string(cu::DTypeName(ns.compute))));
      absl::Status st = graphs_.Run(
          name_, key,
          [&](bool use_graphs) {
            cu::CudaNsOptions o = ns;
            o.use_graphs = use_graphs;
            return ctx_->Orthogonalize(b, b, o);
          },
          [&] {
            mu_.AssertHeld();  // Run calls back on this thread, in Compute
            return RecoverFromGraphFailure();
          },
          [](const std::string& warning) { spdlog::warn("{}", warning); });
      if (!st.ok()) return st;
      first += size;
    }
    WarnIfPlansOverCap();

    // Scale, then deliver.
    for (int64_t i = 0; i < count; ++i) {
      const ComputeTask& t = batch[i];
      float* slot = scratch_.floats() + i * n;
      const float scale = static_cast<float>(t.lr_scale);
      if (!skip[i] && scale != 1.0f) {
        DMUON_CUDA_RETURN_IF_ERROR(
            dev::LaunchScale(slot, slot, n, scale, stream_));
      }
      if (t.device_io == nullptr) {
        DMUON_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(t.update, slot, n * sizeof(float),
                            cudaMemcpyDeviceToHost, stream_));
      } else if (auto st = gpu::ScatterUpdate(t, slot, io); !st.ok()) {
        return st;
      }
    }
    return ctx_->Synchronize();
  }

  absl::Status SyncStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  // After a failed graph capture or launch: clears the thread's last
  // (non-sticky) error and ends a capture the failure left open on the
  // stream, so the eager retry starts clean. A sticky error shows up in the
  // retry itself.
  absl::Status RecoverFromGraphFailure() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    base::ClearLastCudaError();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream_, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) {
      cudaGraph_t graph = nullptr;
      (void)cudaStreamEndCapture(stream_, &graph);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      base::ClearLastCudaError();
    }
    return absl::OkStatus();
  }

  // Once per executor: the plans of open jobs exceed the plan cache's cap
  // (they are never evicted, so the cap gives way).
  void WarnIfPlansOverCap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (plan_cap_warned_) return;
    const cu::PlanCacheStats p = ctx_->PlanStats();
    if (p.over_cap == 0) return;
    plan_cap_warned_ = true;
    spdlog::warn(
        "{}: the NS plans of open jobs need {} bytes, over the plan cache's "
        "cap of {} bytes; plans in use are never evicted, so the cap gives "
        "way (raise the cap, or lower max_launch for smaller plans)",
        name_, p.bytes, p.cap);
  }

  // For ReadState and WriteState: key's pool entry (nullptr: none, nothing
  // to copy) once its size matches the host buffer's, with the executor's
  // device current. `what`: "read into" or "written from".
  absl::StatusOr<const State*> StateForCopy(const StateKey& key,
                                            size_t host_size, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = pool_.find(key);
    if (it == pool_.end()) return nullptr;
    const State& s = it->second;
    if (static_cast<int64_t>(host_size) != s.n) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": state of ", s.n, " elements ", what, " ", host_size));
    }
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return &s;
  }

  // The pool entry of t.state, created (and loaded from t.momentum, or
  // zeroed) on first use.
  absl::StatusOr<State*> StateFor(const ComputeTask& t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = pool_.find(t.state);
    if (it != pool_.end()) return &it->second;
    State s;
    s.n = t.shape.elements();
    s.bytes = s.n * (options_.bf16_momentum ? 2 : 4);
    cudaError_t e = cudaMalloc(&s.ptr, s.bytes);
    if (e == cudaSuccess) {
      e = cudaMalloc(&s.start, s.bytes);
      if (e != cudaSuccess) (void)cudaFree(s.ptr);
    }
    if (e != cudaSuccess) {
      base::ClearLastCudaError();
      return absl::Status(
          e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                         : absl::StatusCode::kInternal,
          absl::StrCat("cannot allocate the momentum of a ",
                       kernels::ShapeString(t.shape), " matrix (2 x ", s.bytes,
                       " bytes with its step-start copy; the pool holds ",
                       pool_bytes_, " bytes for ", pool_.size(),
                       " matrices): ", cudaGetErrorString(e)));
    }
    absl::Status st;
    if (t.momentum != nullptr) {
      st = Load(t.momentum, s);
    } else if (const cudaError_t z =
                   cudaMemsetAsync(s.ptr, 0, s.bytes, stream_);
               z != cudaSuccess) {
      st = base::CudaErrorStatus(z, "cudaMemsetAsync(momentum)", __FILE__,
                                 __LINE__);
    }
    if (!st.ok()) {
      (void)cudaFree(s.ptr);
      (void)cudaFree(s.start);
      return st;
    }
    pool_bytes_ += 2 * s.bytes;
    return &pool_.emplace(t.state, s).first->second;
  }

  // s <- host fp32 (through the staging buffer's head for bf16). Callers
  // must not need the staging buffer's head at this point.
  absl::Status Load(const float* host, const State& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options_.bf16_momentum) {
      DMUON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          s.ptr, host, s.n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      return absl::OkStatus();
    }
    if (auto st = EnsureScratch(s.n); !st.ok()) return st;
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(scratch_.data(), host, s.n * sizeof(float),
                        cudaMemcpyHostToDevice, stream_));
    DMUON_CUDA_RETURN_IF_ERROR(dev::LaunchCast(scratch_.data(), dev::Elem::kF32,
                                               s.ptr, dev::Elem::kBF16, s.n,
                                               stream_));
    return absl::OkStatus();
  }

  absl::Status EnsureScratch(int64_t floats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return scratch_.Ensure(static_cast<size_t>(floats) * sizeof(float),
                           stream_);
  }

  absl::Status EnsureFlags(int64_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (count <= flags_count_) return absl::OkStatus();
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (flags_ != nullptr) DMUON_CUDA_RETURN_IF_ERROR(cudaFree(flags_));
    if (flags_host_ != nullptr)
      DMUON_CUDA_RETURN_IF_ERROR(cudaFreeHost(flags_host_));
    flags_ = nullptr;
    flags_host_ = nullptr;
    flags_count_ = 0;
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&flags_), count * sizeof(int)));
    DMUON_CUDA_RETURN_IF_ERROR(cudaMallocHost(
        reinterpret_cast<void**>(&flags_host_), count * sizeof(int)));
    flags_count_ = count;
    return absl::OkStatus();
  }

  void UpdateMemory() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    memory_.store(pool_bytes_ + scratch_.bytes() + peer_temp_.bytes() +
                  flags_count_ * sizeof(int) + ctx_->MemoryBytes());
  }

  const int device_;
  const std::string name_;
  const CudaExecutorOptions options_;
  GraphFallback graphs_;
  const std::unique_ptr<cu::Context> ctx_;
  const cudaStream_t stream_;
  Health health_;
  std::atomic<uint64_t> memory_{0};
  uint64_t capacity_ = 0;  // the device's total memory; set in the constructor

  // Guards everything below, and every use of ctx_ and stream_ (one
  // batch or state copy at a time on the device).
  absl::Mutex mu_;
  std::map<StateKey, State> pool_ ABSL_GUARDED_BY(mu_);
  uint64_t pool_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The batch's staging slots.
  gpu::DeviceBuffer scratch_ ABSL_GUARDED_BY(mu_);
  // One matrix from another GPU (kMean).
  gpu::DeviceBuffer peer_temp_ ABSL_GUARDED_BY(mu_);
  // Per task: its gradient has a NaN/Inf.
  int* flags_ ABSL_GUARDED_BY(mu_) = nullptr;
  int* flags_host_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t flags_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool plan_cap_warned_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

cu::CudaNsOptions ExecutorNsOptions(const kernels::NsOptions& ns,
                                    const CudaExecutorOptions& options) {
  cu::CudaNsOptions o;
  o.ns = ns;
  o.compute =
      ns.method == kernels::Method::kGram ? cu::DType::kF16 : cu::DType::kBF16;
  o.use_graphs = options.use_graphs;
  return o;
}

absl::StatusOr<std::unique_ptr<Executor>> NewCudaExecutor(
    int device, const CudaExecutorOptions& options) {
  cu::ContextOptions context_options;
  context_options.plan_cache_bytes = options.plan_cache_bytes;
  auto ctx = cu::Context::Create(device, context_options);
  if (!ctx.ok()) {
    return absl::Status(
        ctx.status().code(),
        absl::StrCat("cuda:", device, ": ", ctx.status().message()));
  }
  return std::unique_ptr<Executor>(
      new CudaExecutor(device, *std::move(ctx), options));
}

absl::StatusOr<std::vector<std::unique_ptr<Executor>>> NewCudaExecutors(
    const std::string& devices, const CudaExecutorOptions& options,
    std::string* why) {
  auto spec = ParseDeviceSpec(devices);
  if (!spec.ok()) return spec.status();
  auto count = cu::DeviceCount();
  const std::string reason =
      count.ok() ? (*count == 0 ? "the CUDA runtime reports 0 devices" : "")
                 : std::string(count.status().message());
  auto ordinals = ResolveCudaDevices(*spec, count.ok() ? *count : -1, reason);
  if (!ordinals.ok()) return ordinals.status();
  if (why != nullptr) *why = reason;
  std::vector<std::unique_ptr<Executor>> out;
  for (int d : *ordinals) {
    auto e = NewCudaExecutor(d, options);
    if (!e.ok()) return e.status();
    out.push_back(*std::move(e));
  }
  return out;
}

}  // namespace dmuon::server
