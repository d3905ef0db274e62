// Muon momentum step and learning-rate scales, in torch.optim.Muon's exact
// convention.

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/elementwise.h"
#include "kernels/kernels.h"

namespace dmuon::kernels {

absl::Status MomentumUpdate(absl::Span<const float> grad,
                            absl::Span<float> momentum,
                            absl::Span<float> update, double mu,
                            bool nesterov) {
  return MomentumUpdate(grad, momentum, momentum, update, mu, nesterov);
}

absl::Status MomentumUpdate(absl::Span<const float> grad,
                            absl::Span<const float> momentum_in,
                            absl::Span<float> momentum_out,
                            absl::Span<float> update, double mu,
                            bool nesterov) {
  if (momentum_in.size() != grad.size() || momentum_out.size() != grad.size() ||
      update.size() != grad.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MomentumUpdate sizes differ: grad ", grad.size(),
                     ", momentum ", momentum_in.size(),
                     momentum_out.data() == momentum_in.data()
                         ? ""
                         : absl::StrCat(" in, ", momentum_out.size(), " out"),
                     ", update ", update.size()));
  }
  if (!(mu >= 0 && mu < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum must be in [0, 1), got ", mu));
  }
  // torch computes 1 - momentum in Python (double), then uses it as float.
  internal::MomentumSteps(grad.data(), momentum_in.data(), momentum_out.data(),
                          update.data(), static_cast<int64_t>(grad.size()),
                          static_cast<float>(1.0 - mu), static_cast<float>(mu),
                          nesterov);
  return absl::OkStatus();
}

void ScaleInPlace(absl::Span<float> x, float s) {
  internal::Scale(x.data(), static_cast<int64_t>(x.size()), s);
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
