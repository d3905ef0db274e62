// Cost model of Newton–Schulz: flops and bytes per method and shape.
//
// Used to compare methods before anything is measured (Method::kAuto), to
// count benchmark rates, and by the daemon's planner to balance devices.
// Products whose result is symmetric are scaled by `symmetric_fraction`: 0.5
// for an ideal triangle-only product, 1.0 for dense products.

#ifndef DMUON_KERNELS_COST_MODEL_H_
#define DMUON_KERNELS_COST_MODEL_H_

#include "kernels/types.h"

namespace dmuon::kernels {

struct NsCost {
  double flops = 0;  // executed by the method (symmetric savings applied)
  // The direct method with dense products: 5 steps of an m x n matrix cost
  // 5 (4 m^2 n + 2 m^3). Benchmarks report every method's rate in these
  // units so that methods compare on one scale.
  double dense_equivalent_flops = 0;
  double bytes = 0;  // approximate memory traffic of the products
};

// Cost of one matrix of `shape` under `options` (steps, restart) for a
// method other than kAuto, elements of `element_bytes`.
NsCost EstimateCost(Method method, Shape shape, const NsOptions& options,
                    double symmetric_fraction = 0.5, int element_bytes = 4);

// The cheaper of direct and Gram by flops. Gram is chosen only when it saves
// at least 15% (it squares the condition number, so a tie goes to direct);
// an Autotuner replaces this guess with measurements.
Method CheapestMethod(Shape shape, const NsOptions& options,
                      double symmetric_fraction = 0.5);

// Roofline time: max(flops / flops_per_second, bytes / bytes_per_second).
double PredictSeconds(const NsCost& cost, double flops_per_second,
                      double bytes_per_second);

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_COST_MODEL_H_
