// CPU Newton–Schulz: fp32 (the product path) and fp64 (the test oracle), one
// templated implementation over kernels/blas_ops.h.

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/blas_ops.h"
#include "kernels/cost_model.h"
#include "kernels/finite.h"
#include "kernels/iterate.h"
#include "kernels/kernels.h"

namespace dmuon::kernels {
namespace {

template <typename T>
absl::Status CheckMatrix(const MatrixRef<T>& m, std::string_view what) {
  if (m.shape.rows <= 0 || m.shape.cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), " shape ",
                                                   ShapeString(m.shape),
                                                   " has an empty dimension"));
  }
  if (m.data.size() < static_cast<size_t>(m.shape.elements())) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), " buffer holds ", m.data.size(), " elements, shape ",
        ShapeString(m.shape), " needs ", m.shape.elements()));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CheckFinite(const T* x, Shape s, std::string_view what) {
  const int64_t i = FirstNonFinite(x, s.elements());
  if (i < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      NonFiniteMessage(what, x[i], i, s.cols), " of shape ", ShapeString(s)));
}

// The m x n iterate X (m <= n) as it is stored: row-major for a wide or
// square input, and for a tall one (rows > cols) in the input's own layout,
// X^T row-major (n x m), so that nothing is transposed in or out (torch
// transposes a tall matrix, iterates, and transposes back: the same
// products). Both products Newton–Schulz takes of X have a form for either
// layout, B being symmetric: X X^T = (X^T)^T X^T, and B X = (X^T B)^T.
template <typename T>
struct Iterate {
  int64_t m, n;
  bool transposed;

  explicit Iterate(Shape s) : m(s.m()), n(s.n()), transposed(s.rows > s.cols) {}

  // r (m x m) <- X X^T.
  void Square(const T* x, T* r) const {
    if (transposed) {
      blas::SymRankKTransposed<T>(x, m, n, T(1), T(0), r);
    } else {
      blas::SymRankK<T>(x, m, n, T(1), T(0), r);
    }
  }
  // y <- alpha B X + beta y (in X's layout), B m x m symmetric.
  void LeftMultiply(const T* b, const T* x, T alpha, T beta, T* y) const {
    if (transposed) {
      blas::GemmRight<T>(x, b, n, m, alpha, beta, y);
    } else {
      blas::Gemm<T>(b, x, m, n, alpha, beta, y);
    }
  }
};

// ||x||_F, which the normalization divides by, and the input's finiteness
// check in the same pass: the sum of squares (iterate.h) is finite when
// every element is, and the scan that names a bad element runs only when
// it is not. Doubles above about 1.3e154 have squares that overflow; such
// a matrix's norm is taken over its elements divided by the largest
// magnitude instead (never needed for float input).
template <typename T>
absl::StatusOr<double> InputNorm(const T* x, Shape s, std::string_view what) {
  const int64_t n = s.elements();
  const double sum = internal::SumSquares(x, n);
  if (std::isfinite(sum)) return std::sqrt(sum);
  if (absl::Status st = CheckFinite(x, s, what); !st.ok()) return st;
  double big = 0;
  for (int64_t i = 0; i < n; ++i)
    big = std::max(big, std::abs(static_cast<double>(x[i])));
  double scaled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]) / big;
    scaled += v * v;
  }
  return big * std::sqrt(scaled);
}

// x <- `in` scaled by 1 / max(norm * safety, eps), in the iterate's layout
// (the input's: Iterate), norm being InputNorm(in).
template <typename T>
void Normalize(const T* in, Shape s, const NsOptions& o, double norm, T* x) {
  const T div = static_cast<T>(std::max(norm * o.schedule.norm_safety, o.eps));
  internal::DivideInto(in, s.elements(), div, x);
}

// The working matrices of one call, kept by the calling thread between
// calls (an executor's worker runs every matrix of its queue). A fresh
// std::vector per call was fresh pages: above malloc's mmap threshold each
// was mapped, zero-filled and unmapped again, about 2,000 page faults for a
// 1536x384 matrix (19,000 per step of a 4-layer d=384 GPT in dmuond, and
// its Newton-Schulz up to 1.5x slower than the same kernels in a loop).
// Slot k holds one role's matrix; every element is written before it is
// read (beta = 0 products, which never read their output, and copies), so
// the old contents never matter. At most kKeepScratchBytes stay with a
// thread between calls (TrimScratch): the working set of a large matrix
// (about 470 MB for 4096x4096) would otherwise stay with every thread that
// ever ran one, and its page faults cost little beside its products.
constexpr size_t kKeepScratchBytes = size_t{64} << 20;

template <typename T>
std::array<std::vector<T>, 7>& ScratchSlots() {
  thread_local std::array<std::vector<T>, 7> slots;
  return slots;
}

template <typename T>
std::vector<T>& Scratch(int slot, int64_t size) {
  std::vector<T>& v = ScratchSlots<T>()[static_cast<size_t>(slot)];
  v.resize(static_cast<size_t>(size));
  return v;
}

template <typename T>
void ReleaseScratch() {
  for (std::vector<T>& v : ScratchSlots<T>()) std::vector<T>().swap(v);
}

template <typename T>
void TrimScratch() {
  size_t bytes = 0;
  for (const std::vector<T>& v : ScratchSlots<T>())
    bytes += v.capacity() * sizeof(T);
  if (bytes > kKeepScratchBytes) ReleaseScratch<T>();
}

// Direct: per step A = X X^T, B = b A + c A A, X <- a X + B X.
template <typename T>
void Direct(const NsOptions& o, const Iterate<T>& it, std::vector<T>& x) {
  const int64_t m = it.m, n = it.n;
  std::vector<T>& y = Scratch<T>(1, m * n);
  std::vector<T>& a = Scratch<T>(2, m * m);
  std::vector<T>& b = Scratch<T>(3, m * m);
  for (const StepCoefficients& k : o.schedule.steps) {
    it.Square(x.data(), a.data());
    b = a;
    blas::SymRankK<T>(a.data(), m, m, T(k.c), T(k.b), b.data());
    y = x;
    it.LeftMultiply(b.data(), x.data(), T(1), T(k.a), y.data());
    std::swap(x, y);
  }
}

// Gram (Dao-AILab gram-newton-schulz): R = X X^T, Q = I; per step
// Z = b R + c R^2, P = Z + a I, Q <- Q P, R <- P^2 R (all polynomials of R,
// so they commute and every product is symmetric); X <- Q X at a restart and
// at the end.
template <typename T>
void Gram(const NsOptions& o, const Iterate<T>& it, std::vector<T>& x) {
  const int64_t m = it.m, n = it.n;
  const int steps = static_cast<int>(o.schedule.steps.size());
  const int restart = o.gram_restart_after;
  std::vector<T>& y = Scratch<T>(1, m * n);
  std::vector<T>& r = Scratch<T>(2, m * m);
  std::vector<T>& z = Scratch<T>(3, m * m);
  std::vector<T>& q = Scratch<T>(4, m * m);
  std::vector<T>& t = Scratch<T>(5, m * m);
  std::vector<T>& p2 = Scratch<T>(6, m * m);
  bool have_q = false;  // false: Q is the identity
  auto apply_q = [&] {
    it.LeftMultiply(q.data(), x.data(), T(1), T(0), y.data());
    std::swap(x, y);
    have_q = false;
  };
  it.Square(x.data(), r.data());
  for (int k = 0; k < steps; ++k) {
    const StepCoefficients& c = o.schedule.steps[k];
    if (restart > 0 && k == restart && have_q) {
      apply_q();
      it.Square(x.data(), r.data());
    }
    z = r;
    blas::SymRankK<T>(r.data(), m, m, T(c.c), T(c.b), z.data());
    for (int64_t i = 0; i < m; ++i) z[i * m + i] += T(c.a);  // z is now P
    if (!have_q) {
      q = z;
      have_q = true;
    } else {
      blas::SymProduct<T>(q.data(), z.data(), m, T(0), t.data());
      std::swap(q, t);
    }
    const bool need_r = k + 1 < steps && !(restart > 0 && k + 1 == restart);
    if (need_r) {
      blas::SymRankK<T>(z.data(), m, m, T(1), T(0), p2.data());
      blas::SymProduct<T>(p2.data(), r.data(), m, T(0), t.data());
      std::swap(r, t);
    }
  }
  if (have_q) apply_q();
}

template <typename T>
absl::Status RunOne(const MatrixRef<const T>& in, const MatrixRef<T>& out,
                    const NsOptions& o, Method method, double norm, T scale) {
  const Shape s = in.shape;
  const Iterate<T> it(s);
  // rows x cols row-major whichever way the matrix is (Iterate).
  std::vector<T>& x = Scratch<T>(0, s.elements());
  Normalize(in.data.data(), s, o, norm, x.data());
  if (method == Method::kGram) {
    Gram(o, it, x);
  } else {
    Direct(o, it, x);
  }
  // Finite input and a normalized start cannot produce a non-finite
  // result (nor can a finite scale make one); checked anyway, in the pass
  // that writes it out, so that a NaN never leaves the library.
  if (!internal::ScaleInto(x.data(), s.elements(), scale, out.data.data())) {
    // Named in what was written: a product can overflow where x did not.
    const absl::Status st = CheckFinite(out.data.data(), s, "result");
    std::fill(out.data.begin(), out.data.begin() + s.elements(), T(0));
    ReleaseScratch<T>();  // no NaN kept for the next call
    return absl::InternalError(st.message());
  }
  TrimScratch<T>();
  return absl::OkStatus();
}

// scale: empty (1 for every matrix) or one per matrix.
template <typename T>
absl::Status BatchImpl(absl::Span<const MatrixRef<const T>> in,
                       absl::Span<const MatrixRef<T>> out, const NsOptions& o,
                       absl::Span<const T> scale = {}) {
  if (absl::Status st = ValidateOptions(o); !st.ok()) return st;
  if (in.size() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch has ", in.size(), " inputs but ", out.size(), " outputs"));
  }
  if (!scale.empty() && scale.size() != in.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch has ", in.size(), " inputs but ", scale.size(), " scales"));
  }
  for (size_t i = 0; i < scale.size(); ++i) {
    if (!std::isfinite(scale[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("scale ", i, " is ", scale[i], "; it must be finite"));
    }
  }
  if (in.empty()) return absl::OkStatus();
  std::vector<double> norms(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string tag = in.size() == 1 ? "" : absl::StrCat(" ", i);
    if (auto st = CheckMatrix(in[i], "input" + tag); !st.ok()) return st;
    if (auto st = CheckMatrix(out[i], "output" + tag); !st.ok()) return st;
    if (in[i].shape != in[0].shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch input ", i, " has shape ", ShapeString(in[i].shape),
          ", input 0 has ", ShapeString(in[0].shape)));
    }
    if (out[i].shape != in[i].shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("output", tag, " shape ", ShapeString(out[i].shape),
                       " differs from input shape ", ShapeString(in[i].shape)));
    }
    absl::StatusOr<double> norm =
        InputNorm(in[i].data.data(), in[i].shape, "input" + tag);
    if (!norm.ok()) return norm.status();
    norms[i] = *norm;
  }
  Method method = o.method;
  if (method == Method::kAuto) {
    method = CheapestMethod(in[0].shape, o);
  }
  for (size_t i = 0; i < in.size(); ++i) {
    if (auto st = RunOne<T>(in[i], out[i], o, method, norms[i],
                            scale.empty() ? T(1) : scale[i]);
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Orthogonalize(ConstMatrixF in, MatrixF out, const NsOptions& o) {
  return BatchImpl<float>({in}, {out}, o);
}
absl::Status Orthogonalize(ConstMatrixD in, MatrixD out, const NsOptions& o) {
  return BatchImpl<double>({in}, {out}, o);
}
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixF> in,
                                absl::Span<const MatrixF> out,
                                const NsOptions& o) {
  return BatchImpl<float>(in, out, o);
}
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixD> in,
                                absl::Span<const MatrixD> out,
                                const NsOptions& o) {
  return BatchImpl<double>(in, out, o);
}
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixF> in,
                                absl::Span<const MatrixF> out,
                                const NsOptions& o,
                                absl::Span<const float> scale) {
  return BatchImpl<float>(in, out, o, scale);
}

}  // namespace dmuon::kernels

extern "C" void openblas_set_num_threads(int num_threads);
extern "C" int openblas_get_num_threads(void);

namespace dmuon::kernels {

void SetCpuThreads(int threads) {
  openblas_set_num_threads(threads > 0 ? threads : 0);
}

int CpuThreads() { return openblas_get_num_threads(); }

}  // namespace dmuon::kernels
