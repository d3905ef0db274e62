#include "kernels/testing/momentum_reference.h"

#include <cmath>
#include <cstddef>

namespace dmuon::kernels::testing {

float TorchLerp(float start, float end, float weight) {
  const float diff = end - start;
  return std::abs(weight) < 0.5f ? start + weight * diff
                                 : end - diff * (1.0f - weight);
}

void MomentumReference(absl::Span<const float> grad, absl::Span<float> momentum,
                       absl::Span<float> update, double mu, bool nesterov,
                       const std::function<float(float)>& round) {
  const float w_grad = static_cast<float>(1.0 - mu);
  const float w_mom = static_cast<float>(mu);
  for (size_t i = 0; i < grad.size(); ++i) {
    const float g = grad[i];
    const float m = round(TorchLerp(momentum[i], g, w_grad));
    momentum[i] = m;
    update[i] = nesterov ? TorchLerp(g, m, w_mom) : m;
  }
}

}  // namespace dmuon::kernels::testing
