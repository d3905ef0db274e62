// The CUDA-free part of cuda_kernels.h (dtype names and sizes) and the call
// resolution of resolve_logic.h.

#include "kernels/cuda/resolve_logic.h"

#include "kernels/cost_model.h"

namespace dmuon::kernels::cuda {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "invalid";
}

size_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

ResolvedNs ResolveNs(Shape shape, const CudaNsOptions& options) {
  ResolvedNs r;
  r.method = options.ns.method == Method::kAuto
                 ? CheapestMethod(shape, options.ns)
                 : options.ns.method;
  r.compute = options.compute;
  if (r.method == Method::kGram && r.compute == DType::kBF16) {
    r.compute = DType::kF16;
  }
  return r;
}

plan::PlanSpec MakePlanSpec(Shape shape, int64_t batch,
                            const CudaNsOptions& options) {
  plan::PlanSpec spec;
  spec.rows = shape.rows;
  spec.cols = shape.cols;
  spec.batch = batch;
  spec.algo = ResolveNs(shape, options).method == Method::kGram
                  ? plan::Algo::kGram
                  : plan::Algo::kDirect;
  for (const StepCoefficients& s : options.ns.schedule.steps) {
    spec.steps.push_back({s.a, s.b, s.c});
  }
  spec.norm_safety = options.ns.schedule.norm_safety;
  spec.eps = options.ns.eps;
  spec.gram_restart_after = options.ns.gram_restart_after;
  spec.symmetric = options.symmetric;
  return spec;
}

}  // namespace dmuon::kernels::cuda
