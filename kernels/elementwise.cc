// The vectorized element loops (elementwise.h).

#include "kernels/elementwise.h"

#include <cmath>

namespace dmuon::kernels::internal {
namespace {

// lerp(start, end, w) for a w fixed over a loop, in one form: base + coef *
// (end - start), base `start` with coef w when |w| < 0.5, else base `end`
// with coef -(1 - w). The second is torch's end - (end - start)(1 - w) to
// the bit: negating a product and adding is subtracting it, exactly.
struct LerpForm {
  bool from_end;
  float coef;
};

LerpForm FormOf(float w) {
  if (std::abs(w) < 0.5f) return {false, w};
  return {true, -(1.0f - w)};
}

// One loop per form, so that each has no branch. In place (`gu`: the
// gradient in, the update out) or out of place; __restrict states what
// MomentumSteps' contract says, which is what lets GCC vectorize.
template <bool kMomFromEnd, bool kNesterov, bool kUpdFromEnd>
void InPlace(float* __restrict gu, float* __restrict m, int64_t n,
             float mom_coef, float upd_coef) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gu[i], old = m[i];
    const float next = (kMomFromEnd ? g : old) + mom_coef * (g - old);
    m[i] = next;
    gu[i] = kNesterov ? (kUpdFromEnd ? next : g) + upd_coef * (next - g) : next;
  }
}

template <bool kMomFromEnd, bool kNesterov, bool kUpdFromEnd>
void OutOfPlace(const float* __restrict grad, float* __restrict m,
                float* __restrict update, int64_t n, float mom_coef,
                float upd_coef) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i], old = m[i];
    const float next = (kMomFromEnd ? g : old) + mom_coef * (g - old);
    m[i] = next;
    update[i] =
        kNesterov ? (kUpdFromEnd ? next : g) + upd_coef * (next - g) : next;
  }
}

template <bool kMomFromEnd, bool kNesterov, bool kUpdFromEnd>
void Run(const float* grad, float* m, float* update, int64_t n, float mom_coef,
         float upd_coef) {
  if (update == grad) {
    InPlace<kMomFromEnd, kNesterov, kUpdFromEnd>(update, m, n, mom_coef,
                                                 upd_coef);
  } else {
    OutOfPlace<kMomFromEnd, kNesterov, kUpdFromEnd>(grad, m, update, n,
                                                    mom_coef, upd_coef);
  }
}

}  // namespace

void MomentumSteps(const float* grad, float* momentum, float* update, int64_t n,
                   float w_grad, float w_mom, bool nesterov) {
  const LerpForm mom = FormOf(w_grad), upd = FormOf(w_mom);
  using Fn = void (*)(const float*, float*, float*, int64_t, float, float);
  // [momentum from end][nesterov][update from end]
  static constexpr Fn kLoops[2][2][2] = {
      {{Run<false, false, false>, Run<false, false, false>},
       {Run<false, true, false>, Run<false, true, true>}},
      {{Run<true, false, false>, Run<true, false, false>},
       {Run<true, true, false>, Run<true, true, true>}}};
  kLoops[mom.from_end][nesterov][upd.from_end](grad, momentum, update, n,
                                               mom.coef, upd.coef);
}

void Scale(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace dmuon::kernels::internal
