// Coefficient schedules and option validation.

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/types.h"

namespace dmuon::kernels {
namespace {

// Polar Express, raw per-step coefficients (Amsel, Persson, Musco, Gower,
// "The Polar Express", arXiv 2505.16932; NoahAmsel/PolarExpress,
// polar_express/basic.py). Steps past the 7th repeat the last.
constexpr StepCoefficients kPolarExpressRaw[] = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
};

// The "You" 5-step set, as used by microsoft/dion.
constexpr StepCoefficients kYou[] = {
    {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377},
    {3.7418, -5.5913, 2.3037}, {2.8769, -3.1427, 1.2046},
    {2.8366, -3.0525, 1.2012},
};

bool Finite(const StepCoefficients& s) {
  return std::isfinite(s.a) && std::isfinite(s.b) && std::isfinite(s.c);
}

}  // namespace

std::string ShapeString(Shape s) {
  return absl::StrCat("[", s.rows, ",", s.cols, "]");
}

std::string_view MethodName(Method m) {
  switch (m) {
    case Method::kAuto:
      return "auto";
    case Method::kDirect:
      return "direct";
    case Method::kGram:
      return "gram";
  }
  return "unknown";
}

absl::StatusOr<Method> ParseMethod(std::string_view name) {
  for (Method m : {Method::kAuto, Method::kDirect, Method::kGram}) {
    if (name == MethodName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("method '", std::string(name),
                   "' is not one of 'auto', 'direct', 'gram'"));
}

Schedule ClassicSchedule(int steps) {
  Schedule s;
  s.name = "classic";
  s.steps.assign(steps > 0 ? steps : 0, {3.4445, -4.7750, 2.0315});
  return s;
}

Schedule PolarExpressSchedule(int steps, double safety) {
  constexpr int kRaw = sizeof(kPolarExpressRaw) / sizeof(kPolarExpressRaw[0]);
  Schedule s;
  s.name = "polar_express";
  s.norm_safety = safety;
  for (int k = 0; k < steps; ++k) {
    StepCoefficients c = kPolarExpressRaw[k < kRaw ? k : kRaw - 1];
    if (k < kRaw - 1) {  // the last set keeps its raw values
      c.a /= safety;
      c.b /= std::pow(safety, 3);
      c.c /= std::pow(safety, 5);
    }
    s.steps.push_back(c);
  }
  return s;
}

Schedule YouSchedule(int steps) {
  constexpr int kSets = sizeof(kYou) / sizeof(kYou[0]);
  Schedule s;
  s.name = "you";
  for (int k = 0; k < steps; ++k)
    s.steps.push_back(kYou[k < kSets ? k : kSets - 1]);
  return s;
}

absl::StatusOr<Schedule> CustomSchedule(std::vector<StepCoefficients> steps,
                                        double norm_safety) {
  Schedule s;
  s.name = "custom";
  s.steps = std::move(steps);
  s.norm_safety = norm_safety;
  NsOptions o;
  o.schedule = s;
  if (absl::Status st = ValidateOptions(o); !st.ok()) return st;
  return s;
}

absl::StatusOr<Schedule> ScheduleByName(std::string_view name, int steps) {
  if (steps < 1 || steps > kMaxNsSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ns_steps must be in [1, ", kMaxNsSteps, "], got ", steps));
  }
  if (name == "classic") return ClassicSchedule(steps);
  if (name == "polar_express") return PolarExpressSchedule(steps);
  if (name == "you") return YouSchedule(steps);
  return absl::InvalidArgumentError(
      absl::StrCat("schedule '", std::string(name),
                   "' is not one of 'classic', 'polar_express', 'you'"));
}

absl::Status ValidateOptions(const NsOptions& o) {
  if (o.schedule.steps.empty()) {
    return absl::InvalidArgumentError("schedule has no steps");
  }
  if (o.schedule.steps.size() > static_cast<size_t>(kMaxNsSteps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule has ", o.schedule.steps.size(),
                     " steps; at most ", kMaxNsSteps, " are taken"));
  }
  for (size_t k = 0; k < o.schedule.steps.size(); ++k) {
    if (!Finite(o.schedule.steps[k])) {
      return absl::InvalidArgumentError(
          absl::StrCat("schedule step ", k, " has a non-finite coefficient"));
    }
  }
  if (!(o.schedule.norm_safety > 0) || !std::isfinite(o.schedule.norm_safety)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "norm_safety must be finite and > 0, got ", o.schedule.norm_safety));
  }
  if (!(o.eps > 0) || !std::isfinite(o.eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("eps must be finite and > 0, got ", o.eps));
  }
  if (o.gram_restart_after < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gram_restart_after must be >= 0, got ", o.gram_restart_after));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::kernels
