// CPU reference of the device momentum step (kernels/cuda/ns_kernels.h
// LaunchMomentum) for its tests (test-only): torch's Muon momentum step, one
// element at a time, with the new momentum rounded to the dtype that stores
// it before the Nesterov blend reads it, as torch does with a bf16 momentum
// buffer. With no rounding it is kernels::MomentumUpdate (checked in
// momentum_test.cc).

#ifndef DMUON_KERNELS_TESTING_MOMENTUM_REFERENCE_H_
#define DMUON_KERNELS_TESTING_MOMENTUM_REFERENCE_H_

#include <functional>

#include "absl/types/span.h"

namespace dmuon::kernels::testing {

// torch's at::native lerp in fp32: two-sided, so weight 1 returns `end`.
float TorchLerp(float start, float end, float weight);

// For every i, with w_grad = float(1 - mu), w_mom = float(mu):
//   momentum[i] = round(lerp(momentum[i], grad[i], w_grad));
//   update[i] = nesterov ? lerp(grad[i], momentum[i], w_mom) : momentum[i].
// `momentum` holds the stored values (already representable in the storage
// dtype); `round` maps an fp32 value to the storage dtype's (identity: fp32).
// All spans have the same size; `update` may alias `grad`.
void MomentumReference(absl::Span<const float> grad, absl::Span<float> momentum,
                       absl::Span<float> update, double mu, bool nesterov,
                       const std::function<float(float)>& round);

}  // namespace dmuon::kernels::testing

#endif  // DMUON_KERNELS_TESTING_MOMENTUM_REFERENCE_H_
