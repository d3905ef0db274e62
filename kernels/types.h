// dmuon kernels, the API part: shapes, methods, coefficient schedules,
// options and matrix views. No compute and no BLAS: what a caller needs to
// describe a Newton–Schulz call (and, with kernels/cost_model.h, to cost
// one) without linking an implementation. Bazel: //kernels:api.
//
// The CPU implementation is kernels/kernels.h (//kernels, OpenBLAS); the CUDA
// one is kernels/cuda/cuda_kernels.h. Both take these NsOptions.

#ifndef DMUON_KERNELS_TYPES_H_
#define DMUON_KERNELS_TYPES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dmuon::kernels {

struct Shape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t elements() const { return rows * cols; }
  // The shape NS iterates on: rows <= cols (tall matrices are transposed).
  int64_t m() const { return rows <= cols ? rows : cols; }
  int64_t n() const { return rows <= cols ? cols : rows; }
  bool operator==(const Shape& o) const {
    return rows == o.rows && cols == o.cols;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
};
std::string ShapeString(Shape s);  // "[rows,cols]"

// How the polar factor is approximated.
//   kDirect: X <- a X + (b A + c A^2) X with A = X X^T, per step.
//   kGram:   iterate on the m x m Gram matrix R = X X^T with an accumulated
//            left factor Q, applying X <- Q X only at restarts and at the end
//            (cheaper when cols >> rows; squares the condition number, hence
//            the restart).
//   kAuto:   the cost model picks (CostModel::Cheapest); an Autotuner, when
//            the caller has one, replaces this with a measured choice.
enum class Method { kAuto, kDirect, kGram };
std::string_view MethodName(Method m);
absl::StatusOr<Method> ParseMethod(std::string_view name);

// One Newton–Schulz step maps X -> a X + b (X X^T) X + c (X X^T)^2 X, i.e.
// applies p(s) = a s + b s^3 + c s^5 to every singular value.
struct StepCoefficients {
  double a = 0, b = 0, c = 0;
};

// A coefficient schedule: the coefficients of each step and the safety
// factor of the initial normalization X0 = U / max(||U||_F * norm_safety, eps).
struct Schedule {
  std::string name;
  std::vector<StepCoefficients> steps;
  double norm_safety = 1.0;
};

// The classic quintic (3.4445, -4.7750, 2.0315) for every step: Keller
// Jordan's Muon and torch.optim.Muon's default (which uses 5 steps).
Schedule ClassicSchedule(int steps = 5);
// Polar Express (Amsel et al., arXiv 2505.16932, polar_express/basic.py):
// 7 per-step sets, steps past the 7th repeat the last; every set but the last
// is divided by (s, s^3, s^5) with safety factor `safety`, and the input is
// normalized by ||U||_F * safety. The coefficient values are in schedule.cc.
Schedule PolarExpressSchedule(int steps = 5, double safety = 1.01);
// The "You" 5-step set (as used by microsoft/dion); more than 5 steps repeat
// the last set, fewer use the first ones.
Schedule YouSchedule(int steps = 5);
// The longest schedule the kernels take, named or custom: one rule for
// every schedule (a daemon's --max-ns-steps may only lower it).
inline constexpr int kMaxNsSteps = 10000;
// Any per-step list; every coefficient must be finite and the list non-empty,
// of at most kMaxNsSteps steps.
absl::StatusOr<Schedule> CustomSchedule(std::vector<StepCoefficients> steps,
                                        double norm_safety = 1.0);
// "classic", "polar_express" or "you", with `steps` in [1, kMaxNsSteps].
absl::StatusOr<Schedule> ScheduleByName(std::string_view name, int steps);

struct NsOptions {
  Schedule schedule = ClassicSchedule();
  double eps = 1e-7;  // normalization floor: a zero matrix maps to zero
  Method method = Method::kDirect;
  // Gram: restart from X (X <- Q X, R <- X X^T, Q <- I) before this step
  // (0-based), i.e. after `gram_restart_after` steps; 0 disables restarts.
  int gram_restart_after = 2;
};
// Checks what does not depend on the input: schedule non-empty and finite,
// eps > 0, restart step >= 0.
absl::Status ValidateOptions(const NsOptions& options);

// A matrix of T viewed over caller memory. `data.size()` is the capacity and
// must be >= shape.elements().
template <typename T>
struct MatrixRef {
  Shape shape;
  absl::Span<T> data;
};
using ConstMatrixF = MatrixRef<const float>;
using MatrixF = MatrixRef<float>;
using ConstMatrixD = MatrixRef<const double>;
using MatrixD = MatrixRef<double>;

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_TYPES_H_
