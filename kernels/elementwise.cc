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

// One element: the new momentum and the update from gradient g and the
// old momentum, in one lerp form each (no branch: the forms are template
// arguments).
template <bool kMomFromEnd, bool kNesterov, bool kUpdFromEnd>
inline void Element(float g, float old, float mom_coef, float upd_coef,
                    float& next, float& update) {
  next = (kMomFromEnd ? g : old) + mom_coef * (g - old);
  update = kNesterov ? (kUpdFromEnd ? next : g) + upd_coef * (next - g) : next;
}

// One loop per aliasing case, every pointer __restrict, which is what lets
// GCC vectorize: where the update is written over the gradient the loop
// reads the gradient through `update` and never touches `grad`, and where
// the new momentum is written over the old it reads through `m_out` and
// never touches `m_in`, so no object is reached through two of them.
template <bool kMomFromEnd, bool kNesterov, bool kUpdFromEnd>
struct Loops {
  template <bool kUpdateOverGrad, bool kMomInPlace>
  static void Loop(const float* __restrict grad, const float* __restrict m_in,
                   float* __restrict m_out, float* __restrict update, int64_t n,
                   float cm, float cu) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = kUpdateOverGrad ? update[i] : grad[i];
      const float old = kMomInPlace ? m_out[i] : m_in[i];
      float next, u;
      Element<kMomFromEnd, kNesterov, kUpdFromEnd>(g, old, cm, cu, next, u);
      m_out[i] = next;
      update[i] = u;
    }
  }
  static void Run(const float* grad, const float* m_in, float* m_out,
                  float* update, int64_t n, float cm, float cu) {
    const bool over = update == grad, in_place = m_out == m_in;
    if (over && in_place)
      return Loop<true, true>(grad, m_in, m_out, update, n, cm, cu);
    if (over) return Loop<true, false>(grad, m_in, m_out, update, n, cm, cu);
    if (in_place)
      return Loop<false, true>(grad, m_in, m_out, update, n, cm, cu);
    Loop<false, false>(grad, m_in, m_out, update, n, cm, cu);
  }
};

}  // namespace

void MomentumSteps(const float* grad, const float* momentum_in,
                   float* momentum_out, float* update, int64_t n, float w_grad,
                   float w_mom, bool nesterov) {
  const LerpForm mom = FormOf(w_grad), upd = FormOf(w_mom);
  using Fn = void (*)(const float*, const float*, float*, float*, int64_t,
                      float, float);
  // [momentum from end][nesterov][update from end]
  static constexpr Fn kLoops[2][2][2] = {
      {{Loops<false, false, false>::Run, Loops<false, false, false>::Run},
       {Loops<false, true, false>::Run, Loops<false, true, true>::Run}},
      {{Loops<true, false, false>::Run, Loops<true, false, false>::Run},
       {Loops<true, true, false>::Run, Loops<true, true, true>::Run}}};
  kLoops[mom.from_end][nesterov][upd.from_end](grad, momentum_in, momentum_out,
                                               update, n, mom.coef, upd.coef);
}

void Scale(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace dmuon::kernels::internal
