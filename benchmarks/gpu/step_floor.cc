#include "benchmarks/gpu/step_floor.h"

#include <cstdint>

#include "kernels/cost_model.h"
#include "kernels/cuda/plan_logic.h"
#include "kernels/cuda/resolve_logic.h"

namespace dmuon::bench {

namespace cu = kernels::cuda;

StepWork MatrixStepWork(kernels::Shape shape, kernels::Method method,
                        const kernels::NsOptions& ns, double lr_scale) {
  cu::CudaNsOptions o;  // the executor's: bf16 (Gram: fp16), symmetric
  o.ns = ns;
  o.ns.method = method == kernels::Method::kAuto
                    ? kernels::CheapestMethod(shape, ns)
                    : method;
  const cu::plan::PlanSpec spec = cu::MakePlanSpec(shape, 1, o);
  const cu::plan::OpList ops = cu::plan::BuildOps(spec);
  const double n = static_cast<double>(shape.elements());
  const double m = static_cast<double>(spec.m());
  const double f32 = 4, c = 2;  // fp32 in/out; bf16 or fp16 compute
  StepWork w;
  w.gemm_flops = cu::plan::GemmFlops(ops);
  // The executor's passes (fp32 momentum, fp32 staging slot):
  w.bytes = 2 * f32 * n     // step-start copy of the momentum
            + 2 * f32 * n   // gradient gathered into the slot
            + f32 * n       // non-finite scan
            + 4 * f32 * n   // momentum: g, m read; m, u written
            + 2 * f32 * n;  // update scattered to the trainer's memory
  if (lr_scale != 1.0) w.bytes += 2 * f32 * n;  // in-place scale
  for (const cu::plan::Op& op : ops.ops) {
    switch (op.kind) {
      case cu::plan::OpKind::kNorm:
        w.bytes += f32 * n;
        break;
      case cu::plan::OpKind::kNormalize:
      case cu::plan::OpKind::kOutput:
        w.bytes += (f32 + c) * n;
        break;
      case cu::plan::OpKind::kMirror:  // the upper half read, the lower written
        w.bytes += c * m * (m - 1);
        break;
      case cu::plan::OpKind::kAddDiag:
        w.bytes += op.src == op.dst ? 2 * c * m : 2 * c * m * m;
        break;
      case cu::plan::OpKind::kGemm:
        break;  // in the flops term: the GEMM rate includes its operands
    }
  }
  return w;
}

double FloorSeconds(const StepWork& work, double gemm_flops_per_second,
                    double copy_bytes_per_second) {
  return work.gemm_flops / gemm_flops_per_second +
         work.bytes / copy_bytes_per_second;
}

}  // namespace dmuon::bench
