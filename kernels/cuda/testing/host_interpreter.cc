#include "kernels/cuda/testing/host_interpreter.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace dmuon::kernels::cuda::plan {
std::vector<Coefficients> ClassicCoefficients(int steps) {
  return std::vector<Coefficients>(steps, {3.4445, -4.7750, 2.0315});
}
std::vector<Coefficients> YouCoefficients() {
  return {{4.0848, -6.8946, 2.9270},
          {3.9505, -6.3029, 2.6377},
          {3.7418, -5.5913, 2.3037},
          {2.8769, -3.1427, 1.2046},
          {2.8366, -3.0525, 1.2012}};
}

double RoundTo(double v, Format f) {
  if (f == Format::kF64 || !std::isfinite(v) || v == 0) return v;
  if (f == Format::kF32) return static_cast<double>(static_cast<float>(v));
  // Significant bits (with the implicit one), the exponent of the smallest
  // normal number, the largest finite value.
  const bool bf16 = f == Format::kBF16;
  const int digits = bf16 ? 8 : 11;
  const int min_exp = bf16 ? -126 : -14;
  const double max = bf16 ? std::ldexp(2.0 - std::ldexp(1.0, -7), 127) : 65504;
  int e = 0;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  // Spacing of the representable numbers around v; below the smallest
  // normal it stays that of the subnormals.
  const double quantum = std::ldexp(1.0, std::max(e - 1, min_exp) - digits + 1);
  const double r = std::nearbyint(v / quantum) * quantum;  // ties to even
  return std::fabs(r) > max
             ? std::copysign(std::numeric_limits<double>::infinity(), v)
             : r;
}

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double F32(double v) { return RoundTo(v, Format::kF32); }

Matrix MatMul(const Matrix& a, const Matrix& b, int64_t r, int64_t k,
              int64_t c) {
  Matrix out(r * c, 0.0);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t l = 0; l < k; ++l)
      for (int64_t j = 0; j < c; ++j)
        out[i * c + j] += a[i * k + l] * b[l * c + j];
  return out;
}
Matrix Transpose(const Matrix& a, int64_t r, int64_t c) {
  Matrix t(r * c);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  return t;
}

}  // namespace

Matrix ReferenceNs(const Matrix& g, int64_t rows, int64_t cols,
                   const PlanSpec& spec) {
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols;
  Matrix x = tall ? Transpose(g, rows, cols) : g;
  double norm = 0;
  for (double v : x) norm += v * v;
  norm = std::sqrt(norm);
  const double denom = std::max(norm * spec.norm_safety, spec.eps);
  for (double& v : x) v /= denom;
  for (const Coefficients& s : spec.steps) {
    Matrix a = MatMul(x, Transpose(x, m, n), m, n, m);
    Matrix aa = MatMul(a, a, m, m, m);
    Matrix b(m * m);
    for (int64_t i = 0; i < m * m; ++i) b[i] = s.b * a[i] + s.c * aa[i];
    Matrix bx = MatMul(b, x, m, m, n);
    for (int64_t i = 0; i < m * n; ++i) x[i] = s.a * x[i] + bx[i];
  }
  return tall ? Transpose(x, m, n) : x;
}

HostExecutor::HostExecutor(const PlanSpec& spec, const Matrix& input,
                           Precision precision)
    : spec_(spec), precision_(precision) {
  for (int b = 0; b < static_cast<int>(Buf::kCount); ++b) {
    bufs_[b].assign(spec.batch * BufferElements(spec, static_cast<Buf>(b)),
                    kNaN);
  }
  Matrix& in = bufs_[static_cast<int>(Buf::kIn)];
  in = input;
  for (double& v : in) v = RoundTo(v, precision.in);
}

void HostExecutor::Run(const OpList& list) {
  for (const Op& op : list.ops) {
    SCOPED_TRACE(op.label);
    switch (op.kind) {
      case OpKind::kNorm:
        Norm(op);
        break;
      case OpKind::kNormalize:
        Convert(op.src, op.dst, true, op.value, op.value2);
        break;
      case OpKind::kOutput:
        Convert(op.src, op.dst, false, 0, 0);
        break;
      case OpKind::kGemm:
        RunGemm(op.gemm);
        break;
      case OpKind::kMirror:
        Mirror(op.dst);
        break;
      case OpKind::kAddDiag:
        AddDiag(op.src, op.dst, op.value);
        break;
    }
  }
}

void HostExecutor::Norm(const Op& op) {
  const int64_t e = BufferElements(spec_, op.src);
  norms_.assign(spec_.batch, 0.0);
  for (int64_t t = 0; t < spec_.batch; ++t) {
    double s = 0;
    for (int64_t i = 0; i < e; ++i)
      s += B(op.src)[t * e + i] * B(op.src)[t * e + i];
    // The device sums squares in fp64 and stores the norm in fp32.
    norms_[t] = precision_.exact() ? std::sqrt(s) : F32(std::sqrt(s));
  }
}

// Normalize (kIn rows x cols -> X m x n) or output (X -> kOut).
void HostExecutor::Convert(Buf src, Buf dst, bool normalize, double safety,
                           double eps) {
  ASSERT_EQ(normalize ? src : dst, normalize ? Buf::kIn : Buf::kOut);
  const int64_t rows = spec_.rows, cols = spec_.cols, e = rows * cols;
  for (int64_t t = 0; t < spec_.batch; ++t) {
    double scale = 1;
    if (normalize) {
      ASSERT_EQ(norms_.size(), static_cast<size_t>(spec_.batch))
          << "normalize before norm";
      scale = std::max(norms_[t] * safety, eps);
      if (!precision_.exact()) scale = F32(scale);  // an fp32 divisor
    }
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        // (i, j) of the rows x cols matrix is (j, i) of the m x n iterate
        // when the input is tall.
        const int64_t io = i * cols + j, xo = spec_.tall() ? j * rows + i : io;
        if (normalize) {
          const double v = B(src)[t * e + io] / scale;
          B(dst)
          [t * e + xo] =
              precision_.exact() ? v : RoundTo(F32(v), precision_.compute);
        } else {
          B(dst)[t * e + io] = RoundTo(B(src)[t * e + xo], precision_.out);
        }
      }
    }
  }
}

void HostExecutor::CheckOperand(const Operand& o, const char* name) {
  SCOPED_TRACE(name);
  ASSERT_NE(o.buf, Buf::kIn) << "GEMMs read the compute-dtype iterate only";
  ASSERT_NE(o.buf, Buf::kOut);
  const int64_t e = BufferElements(spec_, o.buf);
  ASSERT_EQ(o.stride, e) << "batch stride must be the buffer's matrix size";
  ASSERT_GE(o.offset, 0);
  ASSERT_GE(o.ld, o.rows);
  ASSERT_LE(o.offset + (o.rows - 1) + (o.cols - 1) * o.ld, e - 1)
      << "operand reaches past its batch matrix";
}

void HostExecutor::RunGemm(const Gemm& g) {
  ASSERT_EQ(CheckGemm(g), "");
  ASSERT_EQ(g.batch, spec_.batch);
  CheckOperand(g.a, "A");
  CheckOperand(g.b, "B");
  CheckOperand(g.c, "C");
  CheckOperand(g.d, "D");
  ASSERT_NE(g.d.buf, g.a.buf) << "D overlaps A";
  ASSERT_NE(g.d.buf, g.b.buf) << "D overlaps B";
  if (g.c.buf == g.d.buf) {
    ASSERT_EQ(g.c.offset, g.d.offset);
  }
  if (!precision_.exact()) {
    EmulatedGemm(g);
    return;
  }
  const Matrix& a = B(g.a.buf);
  const Matrix& b = B(g.b.buf);
  const Matrix& c = B(g.c.buf);
  Matrix& d = B(g.d.buf);
  for (int64_t t = 0; t < g.batch; ++t) {
    // op(A)(i, l) and op(B)(l, j), column-major with leading dimensions.
    auto A = [&](int64_t i, int64_t l) {
      const int64_t r = g.trans_a ? l : i, col = g.trans_a ? i : l;
      return a[t * g.a.stride + g.a.offset + r + col * g.a.ld];
    };
    auto Bm = [&](int64_t l, int64_t j) {
      const int64_t r = g.trans_b ? j : l, col = g.trans_b ? l : j;
      return b[t * g.b.stride + g.b.offset + r + col * g.b.ld];
    };
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.m; ++i) {
        double s = 0;
        for (int64_t l = 0; l < g.k; ++l) s += A(i, l) * Bm(l, j);
        double v = g.alpha * s;
        // cuBLASLt does not read C when beta == 0 (NaN there is harmless).
        if (g.beta != 0) {
          v += g.beta * c[t * g.c.stride + g.c.offset + i + j * g.c.ld];
        }
        d[t * g.d.stride + g.d.offset + i + j * g.d.ld] = v;
      }
    }
  }
}

// cuBLASLt with CUBLAS_COMPUTE_32F: fp32 products, sums, alpha and beta;
// every element of D rounded once to the compute dtype. The operands hold
// compute-dtype values, which fp32 represents exactly.
void HostExecutor::EmulatedGemm(const Gemm& g) {
  auto to_float = [](const Matrix& m, int64_t begin, int64_t n) {
    std::vector<float> f(n);
    for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(m[begin + i]);
    return f;
  };
  const int64_t ea = BufferElements(spec_, g.a.buf);
  const int64_t eb = BufferElements(spec_, g.b.buf);
  const int64_t ed = BufferElements(spec_, g.d.buf);
  Matrix& d = B(g.d.buf);
  for (int64_t t = 0; t < g.batch; ++t) {
    const std::vector<float> fa = to_float(B(g.a.buf), t * ea, ea);
    const std::vector<float> fb = to_float(B(g.b.buf), t * eb, eb);
    std::vector<float> fd(ed, 0.0f);  // D's region is zero when beta == 0
    if (g.beta != 0) {
      const Matrix& c = B(g.c.buf);
      for (int64_t j = 0; j < g.n; ++j)
        for (int64_t i = 0; i < g.m; ++i)
          fd[g.d.offset + i + j * g.d.ld] = static_cast<float>(
              c[t * g.c.stride + g.c.offset + i + j * g.c.ld]);
    }
    cblas_sgemm(CblasColMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m),
                static_cast<int>(g.n), static_cast<int>(g.k),
                static_cast<float>(g.alpha), fa.data() + g.a.offset,
                static_cast<int>(g.a.ld), fb.data() + g.b.offset,
                static_cast<int>(g.b.ld), static_cast<float>(g.beta),
                fd.data() + g.d.offset, static_cast<int>(g.d.ld));
    for (int64_t j = 0; j < g.n; ++j)
      for (int64_t i = 0; i < g.m; ++i) {
        const int64_t o = g.d.offset + i + j * g.d.ld;
        d[t * ed + o] = RoundTo(fd[o], precision_.compute);
      }
  }
}

void HostExecutor::Mirror(Buf buf) {
  const int64_t m = spec_.m();
  for (int64_t t = 0; t < spec_.batch; ++t) {
    double* s = B(buf).data() + t * m * m;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < i; ++j) s[i * m + j] = s[j * m + i];
  }
}

void HostExecutor::AddDiag(Buf src, Buf dst, double value) {
  const int64_t m = spec_.m();
  for (int64_t t = 0; t < spec_.batch; ++t) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        const int64_t o = t * m * m + i * m + j;
        if (precision_.exact()) {
          B(dst)[o] = B(src)[o] + (i == j ? value : 0.0);
        } else {  // fp32 sum with an fp32 value, stored in the compute dtype
          B(dst)
          [o] = RoundTo(F32(B(src)[o] + (i == j ? F32(value) : 0.0)),
                        precision_.compute);
        }
      }
    }
  }
}

Matrix RandomBatch(const PlanSpec& spec, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  Matrix m(spec.batch * spec.rows * spec.cols);
  for (double& v : m) v = dist(rng);
  return m;
}

double BatchError(const PlanSpec& spec, const Matrix& input,
                  const Matrix& out) {
  const int64_t e = spec.rows * spec.cols;
  double worst = 0;
  for (int64_t t = 0; t < spec.batch; ++t) {
    Matrix g(input.begin() + t * e, input.begin() + (t + 1) * e);
    Matrix ref = ReferenceNs(g, spec.rows, spec.cols, spec);
    double num = 0, den = 0;
    for (int64_t i = 0; i < e; ++i) {
      const double d = out[t * e + i] - ref[i];
      if (std::isnan(out[t * e + i])) return kNaN;
      num += d * d;
      den += ref[i] * ref[i];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-300)));
  }
  return worst;
}

double RunPlan(const PlanSpec& spec, const OpList& ops, const Matrix& input) {
  HostExecutor ex(spec, input);
  ex.Run(ops);
  return BatchError(spec, input, ex.buffer(Buf::kOut));
}

Matrix RunEmulated(const PlanSpec& spec, const OpList& ops, const Matrix& input,
                   Precision precision) {
  HostExecutor ex(spec, input, precision);
  ex.Run(ops);
  return ex.buffer(Buf::kOut);
}

}  // namespace dmuon::kernels::cuda::plan
