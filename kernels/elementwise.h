// Internal to kernels: the loops over every element of a matrix that sit on
// the daemon's critical path each step (the momentum step, the update's
// learning-rate scale), built with -ftree-vectorize (kernels/BUILD).
//
// Why their own file: GCC's -O2 does not vectorize them (a two-sided lerp
// whose branch it does not hoist, an update that may alias the gradient),
// and the momentum step alone took about 15 ms a step for the 16 matrices
// of a 4-layer d=384 GPT on one core, 2 ns an element (issue 25). The forms
// below vectorize and give the same bits.

#ifndef DMUON_KERNELS_ELEMENTWISE_H_
#define DMUON_KERNELS_ELEMENTWISE_H_

#include <cstdint>

namespace dmuon::kernels::internal {

// momentum_out <- lerp(momentum_in, grad, w_grad);
// update       <- nesterov ? lerp(grad, momentum_out, w_mom) : momentum_out
// with at::native's two-sided lerp (lerp(a, b, w) = |w| < 0.5 ? a + w (b - a)
// : b - (b - a)(1 - w), the weights floats), bit for bit. `update` is either
// `grad` itself or disjoint from it; `momentum_out` is either `momentum_in`
// itself or disjoint from it; the momentum buffers are disjoint from the
// gradient and update.
void MomentumSteps(const float* grad, const float* momentum_in,
                   float* momentum_out, float* update, int64_t n, float w_grad,
                   float w_mom, bool nesterov);

// x[i] *= s for i in [0, n).
void Scale(float* x, int64_t n, float s);

}  // namespace dmuon::kernels::internal

#endif  // DMUON_KERNELS_ELEMENTWISE_H_
