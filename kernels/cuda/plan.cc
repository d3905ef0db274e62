#include "kernels/cuda/plan.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "kernels/cuda/ns_kernels.h"

namespace dmuon::kernels::cuda {

using plan::Buf;
using plan::OpKind;

device::Elem ElemOf(DType t) {
  static_assert(
      static_cast<int>(device::Elem::kF32) == static_cast<int>(DType::kF32) &&
          static_cast<int>(device::Elem::kBF16) ==
              static_cast<int>(DType::kBF16) &&
          static_cast<int>(device::Elem::kF16) == static_cast<int>(DType::kF16),
      "device::Elem mirrors DType");
  return static_cast<device::Elem>(static_cast<int>(t));
}

cudaDataType_t CudaDataType(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

absl::Status Plan::Allocate(size_t bytes, void** ptr) {
  DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(ptr, std::max<size_t>(bytes, 1)));
  owned_.push_back(*ptr);
  bytes_ += bytes;
  return absl::OkStatus();
}

std::vector<size_t> Plan::BufferBytes(const plan::PlanSpec& spec,
                                      const plan::OpList& ops, DType compute) {
  std::vector<size_t> bytes;
  const size_t elem = DTypeBytes(compute);
  for (Buf b : ops.work_buffers) {
    bytes.push_back(static_cast<size_t>(plan::BufferElements(spec, b)) *
                    static_cast<size_t>(spec.batch) * elem);
  }
  const int64_t blocks = device::NormBlocks(spec.rows * spec.cols);
  bytes.push_back(sizeof(float) * spec.batch);            // norms
  bytes.push_back(sizeof(double) * blocks * spec.batch);  // partials
  return bytes;
}

size_t Plan::Bytes(const plan::PlanSpec& spec, DType compute) {
  size_t total = 0;
  for (size_t b : BufferBytes(spec, plan::BuildOps(spec), compute)) total += b;
  return total;
}

absl::StatusOr<std::unique_ptr<Plan>> Plan::Create(const plan::PlanSpec& spec,
                                                   DType in, DType out,
                                                   DType compute,
                                                   const PlanEnv& env) {
  std::unique_ptr<Plan> p(new Plan());
  p->spec_ = spec;
  p->in_ = in;
  p->out_ = out;
  p->compute_ = compute;
  p->env_ = env;
  p->ops_ = plan::BuildOps(spec);
  const size_t elem = DTypeBytes(compute);
  // The work buffers in ops_.work_buffers' order, then norms and partials.
  const std::vector<size_t> sizes = BufferBytes(spec, p->ops_, compute);
  std::vector<void*> ptrs(sizes.size(), nullptr);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (auto st = p->Allocate(sizes[i], &ptrs[i]); !st.ok()) return st;
  }
  for (size_t i = 0; i < p->ops_.work_buffers.size(); ++i) {
    p->bufs_[static_cast<int>(p->ops_.work_buffers[i])] = ptrs[i];
  }
  p->norms_ = static_cast<float*>(ptrs[sizes.size() - 2]);
  p->partials_ = static_cast<double*>(ptrs[sizes.size() - 1]);

  // One LtMatmul per distinct descriptor; the work buffers are 256-byte
  // aligned (cudaMalloc), so alignment follows from offsets and strides.
  const int64_t eb = static_cast<int64_t>(elem);
  p->gemm_of_op_.assign(p->ops_.ops.size(), nullptr);
  for (size_t i = 0; i < p->ops_.ops.size(); ++i) {
    const plan::Op& op = p->ops_.ops[i];
    if (op.kind != OpKind::kGemm) continue;
    const plan::Gemm& g = op.gemm;
    const std::string key = plan::GemmDescriptorKey(g, eb);
    auto it = p->matmuls_.find(key);
    if (it == p->matmuls_.end()) {
      const std::array<int64_t, 4> align = {
          plan::AlignmentBytes(g.a.offset, g.a.stride, g.batch, eb),
          plan::AlignmentBytes(g.b.offset, g.b.stride, g.batch, eb),
          plan::AlignmentBytes(g.c.offset, g.c.stride, g.batch, eb),
          plan::AlignmentBytes(g.d.offset, g.d.stride, g.batch, eb)};
      auto mm = LtMatmul::Create(env.lt, g, CudaDataType(compute), align,
                                 env.workspace_bytes);
      if (!mm.ok()) {
        return absl::Status(
            mm.status().code(),
            absl::StrCat(op.label, ": ", mm.status().message()));
      }
      it = p->matmuls_.emplace(key, *std::move(mm)).first;
    }
    p->gemm_of_op_[i] = it->second.get();
  }
  return p;
}

Plan::~Plan() {
  // Nothing can be reported from here; release what was acquired. cudaFree
  // waits for the device, so in-flight work on the buffers completes first.
  for (auto& [key, g] : graphs_) {
    if (g.exec != nullptr) (void)cudaGraphExecDestroy(g.exec);
  }
  for (void* ptr : owned_) (void)cudaFree(ptr);
}

void* Plan::Pointer(Buf b, int64_t offset, const void* in, void* out) const {
  void* base = b == Buf::kIn    ? const_cast<void*>(in)
               : b == Buf::kOut ? out
                                : bufs_[static_cast<int>(b)];
  const DType t = b == Buf::kIn ? in_ : b == Buf::kOut ? out_ : compute_;
  return static_cast<char*>(base) +
         offset * static_cast<int64_t>(DTypeBytes(t));
}

absl::Status Plan::Enqueue(const void* in, void* out, cudaStream_t stream) {
  const int64_t m = spec_.m(), batch = spec_.batch;
  const device::Elem ce = ElemOf(compute_);
  for (size_t i = 0; i < ops_.ops.size(); ++i) {
    const plan::Op& op = ops_.ops[i];
    cudaError_t err = cudaSuccess;
    switch (op.kind) {
      case OpKind::kNorm:
        err = device::LaunchSumSquares(in, ElemOf(in_), spec_.rows * spec_.cols,
                                       batch, partials_, stream);
        if (err == cudaSuccess) {
          err = device::LaunchFinishNorm(partials_, spec_.rows * spec_.cols,
                                         batch, norms_, env_.nonfinite, stream);
        }
        break;
      case OpKind::kNormalize:
        // in (rows x cols) -> X (m x n), transposed when tall.
        err = device::LaunchConvert(in, ElemOf(in_),
                                    Pointer(op.dst, 0, in, out), ce, spec_.rows,
                                    spec_.cols, batch, spec_.tall(), norms_,
                                    op.value, op.value2, stream);
        break;
      case OpKind::kOutput:
        // X (m x n) -> out (rows x cols), transposed back when tall.
        err = device::LaunchConvert(Pointer(op.src, 0, in, out), ce, out,
                                    ElemOf(out_), m, spec_.n(), batch,
                                    spec_.tall(), nullptr, 1.0, 0.0, stream);
        break;
      case OpKind::kMirror:
        err = device::LaunchMirrorUpper(Pointer(op.dst, 0, in, out), ce, m,
                                        batch, stream);
        break;
      case OpKind::kAddDiag:
        err = device::LaunchAddDiagonal(
            Pointer(op.src, 0, in, out), Pointer(op.dst, 0, in, out), ce, m,
            batch, static_cast<float>(op.value), stream);
        break;
      case OpKind::kGemm: {
        const plan::Gemm& g = op.gemm;
        absl::Status st = gemm_of_op_[i]->Run(
            env_.lt, static_cast<float>(g.alpha),
            Pointer(g.a.buf, g.a.offset, in, out),
            Pointer(g.b.buf, g.b.offset, in, out), static_cast<float>(g.beta),
            Pointer(g.c.buf, g.c.offset, in, out),
            Pointer(g.d.buf, g.d.offset, in, out), env_.workspace,
            env_.workspace_bytes, stream);
        if (!st.ok()) {
          return absl::Status(st.code(),
                              absl::StrCat(op.label, ": ", st.message()));
        }
        break;
      }
    }
    if (err != cudaSuccess) {
      return base::CudaErrorStatus(err, op.label.c_str(), __FILE__, __LINE__);
    }
  }
  return absl::OkStatus();
}

absl::Status Plan::Capture(const void* in, void* out, cudaStream_t stream,
                           cudaGraphExec_t* exec) {
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  absl::Status st = Enqueue(in, out, stream);
  cudaGraph_t graph = nullptr;
  // Always end the capture, so the stream is usable whatever happened.
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (st.ok() && end != cudaSuccess) {
    st = base::CudaErrorStatus(end, "cudaStreamEndCapture", __FILE__, __LINE__);
  }
  if (st.ok()) {
    const cudaError_t inst = cudaGraphInstantiate(exec, graph, 0);
    if (inst != cudaSuccess) {
      st = base::CudaErrorStatus(inst, "cudaGraphInstantiate", __FILE__,
                                 __LINE__);
    }
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  return st;
}

absl::Status Plan::Run(const void* in, void* out, cudaStream_t stream,
                       bool use_graph) {
  if (!use_graph) return Enqueue(in, out, stream);
  const auto key = std::make_pair(in, out);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxGraphs) {
      auto oldest = graphs_.find(graph_order_.front());
      if (oldest->second.exec != nullptr) {
        DMUON_CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(oldest->second.exec));
      }
      graphs_.erase(oldest);
      graph_order_.erase(graph_order_.begin());
    }
    it = graphs_.emplace(key, Graph{}).first;
    graph_order_.push_back(key);
  }
  Graph& g = it->second;
  if (g.exec == nullptr) {
    if (g.runs == 0) {
      ++g.runs;
      return Enqueue(in, out, stream);
    }
    if (auto st = Capture(in, out, stream, &g.exec); !st.ok()) return st;
  }
  DMUON_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(g.exec, stream));
  return absl::OkStatus();
}

}  // namespace dmuon::kernels::cuda
