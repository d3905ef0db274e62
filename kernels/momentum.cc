// Muon momentum step and learning-rate scales, in torch.optim.Muon's exact
// convention.

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/kernels.h"

namespace dmuon::kernels {
namespace {

// at::native lerp: two-sided so that weight 1 returns `end` exactly; the
// weight is a float scalar (torch's opmath type for float tensors).
inline float Lerp(float start, float end, float weight) {
  return std::abs(weight) < 0.5f ? start + weight * (end - start)
                                 : end - (end - start) * (1.0f - weight);
}

}  // namespace

absl::Status MomentumUpdate(absl::Span<const float> grad,
                            absl::Span<float> momentum,
                            absl::Span<float> update, double mu,
                            bool nesterov) {
  if (momentum.size() != grad.size() || update.size() != grad.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MomentumUpdate sizes differ: grad ", grad.size(), ", momentum ",
        momentum.size(), ", update ", update.size()));
  }
  if (!(mu >= 0 && mu < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum must be in [0, 1), got ", mu));
  }
  // torch computes 1 - momentum in Python (double), then uses it as float.
  const float w_grad = static_cast<float>(1.0 - mu);
  const float w_mom = static_cast<float>(mu);
  const size_t n = grad.size();
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float m = Lerp(momentum[i], g, w_grad);
    momentum[i] = m;
    update[i] = nesterov ? Lerp(g, m, w_mom) : m;
  }
  return absl::OkStatus();
}

double LrScale(LrAdjust fn, Shape s) {
  const double a = static_cast<double>(s.rows), b = static_cast<double>(s.cols);
  if (fn == LrAdjust::kMatchRmsAdamW) return 0.2 * std::sqrt(std::max(a, b));
  if (fn == LrAdjust::kSpectralUnclamped) return std::sqrt(a / b);
  return std::sqrt(std::max(1.0, a / b));
}

absl::StatusOr<LrAdjust> ParseLrAdjust(std::string_view name) {
  if (name == "original") return LrAdjust::kOriginal;
  if (name == "match_rms_adamw") return LrAdjust::kMatchRmsAdamW;
  if (name == "spectral_unclamped") return LrAdjust::kSpectralUnclamped;
  return absl::InvalidArgumentError(absl::StrCat(
      "adjust_lr_fn '", std::string(name),
      "' is not one of 'original', 'match_rms_adamw', 'spectral_unclamped'"));
}

}  // namespace dmuon::kernels
