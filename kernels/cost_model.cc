#include "kernels/cost_model.h"

#include <algorithm>

namespace dmuon::kernels {

NsCost EstimateCost(Method method, Shape shape, const NsOptions& o, double f,
                    int e) {
  const double m = static_cast<double>(shape.m());
  const double n = static_cast<double>(shape.n());
  const int steps = static_cast<int>(o.schedule.steps.size());
  NsCost c;
  c.dense_equivalent_flops = steps * (4 * m * m * n + 2 * m * m * m);
  // Normalization and write-back read and write the matrix once each.
  c.bytes = 4.0 * m * n * e;
  if (method != Method::kGram) {
    // X X^T (sym), A A (sym), B X (dense).
    c.flops = steps * (2 * m * m * n * f + 2 * m * m * m * f + 2 * m * m * n);
    c.bytes += steps * (4 * m * n + 4 * m * m) * e;
    return c;
  }
  const int restart = o.gram_restart_after;
  c.flops = 2 * m * m * n * f;  // R = X X^T
  c.bytes += (m * n + m * m) * e;
  bool have_q = false;
  for (int k = 0; k < steps; ++k) {
    if (restart > 0 && k == restart && have_q) {
      c.flops += 2 * m * m * n + 2 * m * m * n * f;  // X <- Q X, R <- X X^T
      c.bytes += (3 * m * n + 2 * m * m) * e;
      have_q = false;
    }
    c.flops += 2 * m * m * m * f;  // Z = b R + c R^2
    c.bytes += 3 * m * m * e;
    if (have_q) {
      c.flops += 2 * m * m * m * f;  // Q <- Q P
      c.bytes += 3 * m * m * e;
    }
    have_q = true;
    if (k + 1 < steps && !(restart > 0 && k + 1 == restart)) {
      c.flops += 4 * m * m * m * f;  // P^2, then P^2 R
      c.bytes += 6 * m * m * e;
    }
  }
  c.flops += 2 * m * m * n;  // X <- Q X
  c.bytes += (3 * m * n + m * m) * e;
  return c;
}

Method CheapestMethod(Shape shape, const NsOptions& o, double f) {
  const double direct = EstimateCost(Method::kDirect, shape, o, f).flops;
  const double gram = EstimateCost(Method::kGram, shape, o, f).flops;
  return gram < 0.85 * direct ? Method::kGram : Method::kDirect;
}

double PredictSeconds(const NsCost& cost, double flops_per_second,
                      double bytes_per_second) {
  return std::max(cost.flops / flops_per_second, cost.bytes / bytes_per_second);
}

}  // namespace dmuon::kernels
