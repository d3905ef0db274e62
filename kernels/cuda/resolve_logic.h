// What Context::Orthogonalize runs for a call, decided on the host in plain
// C++ (no CUDA types) so that the default configuration builds and tests it:
// the method kAuto resolves to, the dtype that method computes in, and the
// plan spec (plan_logic.h) of the call.

#ifndef DMUON_KERNELS_CUDA_RESOLVE_LOGIC_H_
#define DMUON_KERNELS_CUDA_RESOLVE_LOGIC_H_

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/plan_logic.h"
#include "kernels/kernels.h"

namespace dmuon::kernels::cuda {

struct ResolvedNs {
  Method method = Method::kDirect;  // never kAuto
  DType compute = DType::kBF16;     // the dtype of the iterates and products
};

// method: options.ns.method, or for kAuto the cost model's choice
// (CheapestMethod). compute: options.compute, except that Gram computes in
// fp16 when options.compute is bf16. Gram iterates on R = X X^T, whose
// condition number is X's squared: bf16 keeps 8 significant bits, fp16 11,
// and fp16's range is enough for Gram's values (the iterates' eigenvalues
// stay below the product of the a coefficients between restarts, ~41 for
// the classic schedule; small entries fall into fp16's subnormals, which
// the emulated check includes). Emulated (testing/accuracy.h, docs/kernels.md):
// Gram on a 64 x 64 input is 6-9e-2 off in bf16 and about 1e-2 in fp16.
ResolvedNs ResolveNs(Shape shape, const CudaNsOptions& options);

// The plan spec of `batch` matrices of `shape` under `options`, with the
// method resolved as ResolveNs does. Options must be valid
// (ValidateOptions).
plan::PlanSpec MakePlanSpec(Shape shape, int64_t batch,
                            const CudaNsOptions& options);

}  // namespace dmuon::kernels::cuda

#endif  // DMUON_KERNELS_CUDA_RESOLVE_LOGIC_H_
