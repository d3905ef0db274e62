#include "kernels/cuda/plan_logic.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <utility>

#include "kernels/tiling.h"

namespace dmuon::kernels::cuda::plan {

const char* BufName(Buf b) {
  static const char* const kNames[] = {"in", "out", "X0", "X1", "A",  "B",
                                       "R",  "Z",   "P",  "Q0", "Q1", "T"};
  int i = static_cast<int>(b);
  return i >= 0 && i < static_cast<int>(Buf::kCount) ? kNames[i] : "?";
}

const char* AlgoName(Algo a) { return a == Algo::kGram ? "gram" : "direct"; }

const char* OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kNorm:
      return "norm";
    case OpKind::kNormalize:
      return "normalize";
    case OpKind::kGemm:
      return "gemm";
    case OpKind::kMirror:
      return "mirror";
    case OpKind::kAddDiag:
      return "add_diag";
    case OpKind::kOutput:
      return "output";
  }
  return "?";
}

int64_t BufferElements(const PlanSpec& spec, Buf b) {
  switch (b) {
    case Buf::kIn:
    case Buf::kOut:
    case Buf::kX0:
    case Buf::kX1:
      return spec.rows * spec.cols;
    default:
      return spec.m() * spec.m();
  }
}

int64_t SymmetricPanelRows(int64_t m) {
  int64_t rows = ChoosePanelRows(m, 256);
  if (rows >= m) return m;
  rows = (rows + 63) / 64 * 64;
  return rows >= m ? m : rows;
}

namespace {

std::string Fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* format, ...) {
  char buf[512];
  va_list args;
  va_start(args, format);
  vsnprintf(buf, sizeof(buf), format, args);
  va_end(args);
  return buf;
}

std::string DescribeOperand(const Operand& o) {
  return Fmt("%s+%lld[%lldx%lld ld %lld]", BufName(o.buf),
             static_cast<long long>(o.offset), static_cast<long long>(o.rows),
             static_cast<long long>(o.cols), static_cast<long long>(o.ld));
}

Operand ColumnMajor(const RowMajor& v) {
  // Row-major rows x cols memory is column-major cols x rows, same ld.
  Operand o;
  o.buf = v.buf;
  o.offset = v.offset;
  o.rows = v.cols;
  o.cols = v.rows;
  o.ld = v.ld;
  o.stride = v.stride;
  return o;
}

}  // namespace

std::string CheckGemm(const Gemm& g) {
  std::string err;
  auto expect = [&err](bool ok, const std::string& what) {
    if (!ok && err.empty()) err = what;
  };
  expect(g.m > 0 && g.n > 0 && g.k > 0 && g.batch > 0,
         "non-positive dimension");
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  expect(g.a.rows == a_rows && g.a.cols == a_cols, "A dimensions");
  expect(g.b.rows == b_rows && g.b.cols == b_cols, "B dimensions");
  expect(g.d.rows == g.m && g.d.cols == g.n, "D dimensions");
  expect(g.c.rows == g.d.rows && g.c.cols == g.d.cols && g.c.ld == g.d.ld &&
             g.c.stride == g.d.stride,
         "C layout differs from D");
  for (const Operand* o : {&g.a, &g.b, &g.c, &g.d}) {
    expect(o->ld >= std::max<int64_t>(1, o->rows), "ld < rows");
    expect(o->offset >= 0, "negative offset");
  }
  if (!err.empty()) err += " in " + DescribeGemm(g);
  return err;
}

std::string DescribeGemm(const Gemm& g) {
  return Fmt("gemm %s%s M=%lld N=%lld K=%lld batch=%lld A=%s B=%s C=%s D=%s",
             g.trans_a ? "T" : "N", g.trans_b ? "T" : "N",
             static_cast<long long>(g.m), static_cast<long long>(g.n),
             static_cast<long long>(g.k), static_cast<long long>(g.batch),
             DescribeOperand(g.a).c_str(), DescribeOperand(g.b).c_str(),
             DescribeOperand(g.c).c_str(), DescribeOperand(g.d).c_str());
}

RowMajor Whole(Buf b, int64_t rows, int64_t cols, int64_t stride) {
  RowMajor v;
  v.buf = b;
  v.rows = rows;
  v.cols = cols;
  v.ld = cols;
  v.stride = stride;
  return v;
}

RowMajor Transposed(RowMajor v) {
  v.trans = !v.trans;
  return v;
}

RowMajor SubRows(RowMajor v, int64_t r0, int64_t h) {
  // Row i of op(S) is row i of S, or column i of S when transposed.
  if (v.trans) {
    v.offset += r0;
    v.cols = h;
  } else {
    v.offset += r0 * v.ld;
    v.rows = h;
  }
  return v;
}

RowMajor SubCols(RowMajor v, int64_t c0, int64_t w) {
  if (v.trans) {
    v.offset += c0 * v.ld;
    v.rows = w;
  } else {
    v.offset += c0;
    v.cols = w;
  }
  return v;
}

Gemm RowMajorGemm(const RowMajor& p, const RowMajor& q, const RowMajor& c,
                  const RowMajor& d, double alpha, double beta, int64_t batch) {
  // D^T = op(Q)^T op(P)^T in column-major terms (see the header).
  Gemm g;
  g.m = q.eff_cols();
  g.n = p.eff_rows();
  g.k = p.eff_cols();
  g.batch = batch;
  g.trans_a = q.trans;
  g.a = ColumnMajor(q);
  g.trans_b = p.trans;
  g.b = ColumnMajor(p);
  g.d = ColumnMajor(d);
  g.c = beta != 0 ? ColumnMajor(c) : g.d;
  g.alpha = alpha;
  g.beta = beta;
  return g;
}

namespace {

class Builder {
 public:
  explicit Builder(const PlanSpec& spec)
      : spec_(spec),
        m_(spec.m()),
        n_(spec.n()),
        panels_(UpperTrianglePanels(m_, spec.panel_rows > 0
                                            ? spec.panel_rows
                                            : SymmetricPanelRows(m_))) {}

  RowMajor X(Buf b) const { return Whole(b, m_, n_, m_ * n_); }
  RowMajor Sq(Buf b) const { return Whole(b, m_, m_, m_ * m_); }
  // The right operand of a product with a symmetric result: S^T (TN GEMMs)
  // when S is exactly symmetric (mirrored), else S itself.
  RowMajor SymRight(Buf b) const {
    return spec_.symmetric ? Transposed(Sq(b)) : Sq(b);
  }

  void Simple(OpKind kind, Buf src, Buf dst, double value,
              const std::string& label, double value2 = 0) {
    Op op;
    op.kind = kind;
    op.src = src;
    op.dst = dst;
    op.value = value;
    op.value2 = value2;
    op.label = label;
    Use(src);
    Use(dst);
    out_.ops.push_back(std::move(op));
  }

  void AddGemm(const Gemm& g, const std::string& label) {
    Op op;
    op.kind = OpKind::kGemm;
    op.gemm = g;
    op.label = label;
    Use(g.a.buf);
    Use(g.b.buf);
    Use(g.c.buf);
    Use(g.d.buf);
    out_.ops.push_back(std::move(op));
  }

  // d = alpha p q + beta c for an m x m result d known to be symmetric: one
  // GEMM per upper-triangle row panel, then a mirror; or one full GEMM.
  void SymProduct(const RowMajor& p, const RowMajor& q, Buf c, Buf d,
                  double alpha, double beta, const std::string& label) {
    const RowMajor cv = Sq(c), dv = Sq(d);
    if (!spec_.symmetric) {
      AddGemm(RowMajorGemm(p, q, cv, dv, alpha, beta, spec_.batch), label);
      return;
    }
    for (size_t i = 0; i < panels_.size(); ++i) {
      const Panel& pn = panels_[i];
      auto block = [&pn](const RowMajor& v) {
        return SubCols(SubRows(v, pn.row0, pn.rows), pn.col0, pn.cols);
      };
      AddGemm(RowMajorGemm(SubRows(p, pn.row0, pn.rows),
                           SubCols(q, pn.col0, pn.cols), block(cv), block(dv),
                           alpha, beta, spec_.batch),
              label + Fmt(" panel %zu/%zu", i + 1, panels_.size()));
    }
    Simple(OpKind::kMirror, d, d, 0, label + " mirror");
  }

  // d = alpha p q + beta c, dense m x n result.
  void Product(const RowMajor& p, const RowMajor& q, Buf c, Buf d, double alpha,
               double beta, const std::string& label) {
    AddGemm(RowMajorGemm(p, q, X(c), X(d), alpha, beta, spec_.batch), label);
  }

  OpList Build() {
    Simple(OpKind::kNorm, Buf::kIn, Buf::kIn, 0, "norm");
    Simple(OpKind::kNormalize, Buf::kIn, Buf::kX0, spec_.norm_safety,
           "normalize", spec_.eps);
    x_ = Buf::kX0;
    if (spec_.algo == Algo::kDirect) {
      Direct();
    } else {
      Gram();
    }
    Simple(OpKind::kOutput, x_, Buf::kOut, 0, "output");
    std::sort(out_.work_buffers.begin(), out_.work_buffers.end());
    return std::move(out_);
  }

 private:
  void Use(Buf b) {
    if (b == Buf::kIn || b == Buf::kOut) return;
    auto& w = out_.work_buffers;
    if (std::find(w.begin(), w.end(), b) == w.end()) w.push_back(b);
  }
  Buf OtherX() const { return x_ == Buf::kX0 ? Buf::kX1 : Buf::kX0; }

  void Direct() {
    for (size_t k = 0; k < spec_.steps.size(); ++k) {
      const Coefficients& s = spec_.steps[k];
      const std::string step = Fmt("step %zu: ", k);
      SymProduct(X(x_), Transposed(X(x_)), Buf::kA, Buf::kA, 1, 0,
                 step + "A = X X^T");
      SymProduct(Sq(Buf::kA), SymRight(Buf::kA), Buf::kA, Buf::kB, s.c, s.b,
                 step + "B = b A + c A A");
      Product(Sq(Buf::kB), X(x_), x_, OtherX(), 1, s.a, step + "X = a X + B X");
      x_ = OtherX();
    }
  }

  void Gram() {
    const int steps = static_cast<int>(spec_.steps.size());
    const int restart = spec_.gram_restart_after;
    auto is_restart = [restart](int k) { return restart > 0 && k == restart; };
    Buf q = Buf::kQ0, q_other = Buf::kQ1;
    SymProduct(X(x_), Transposed(X(x_)), Buf::kR, Buf::kR, 1, 0, "R = X X^T");
    bool q_identity = true;
    for (int k = 0; k < steps; ++k) {
      const Coefficients& s = spec_.steps[k];
      const std::string step = Fmt("step %d: ", k);
      if (is_restart(k)) {
        Product(Sq(q), X(x_), x_, OtherX(), 1, 0, step + "restart X = Q X");
        x_ = OtherX();
        SymProduct(X(x_), Transposed(X(x_)), Buf::kR, Buf::kR, 1, 0,
                   step + "restart R = X X^T");
        q_identity = true;
      }
      SymProduct(Sq(Buf::kR), SymRight(Buf::kR), Buf::kR, Buf::kZ, s.c, s.b,
                 step + "Z = b R + c R R");
      // P = Z + a I; while Q is the identity, Q P = P is written straight
      // into Q's buffer and used as P.
      const Buf p = q_identity ? q : Buf::kP;
      Simple(OpKind::kAddDiag, Buf::kZ, p, s.a, step + "P = Z + a I");
      if (!q_identity) {
        SymProduct(Sq(q), SymRight(p), q_other, q_other, 1, 0,
                   step + "Q = Q P");
        std::swap(q, q_other);
      }
      q_identity = false;
      const bool r_needed = k + 1 < steps && !is_restart(k + 1);
      if (r_needed) {
        SymProduct(Sq(p), SymRight(Buf::kR), Buf::kT, Buf::kT, 1, 0,
                   step + "T = P R");
        SymProduct(Sq(Buf::kT), SymRight(p), Buf::kR, Buf::kR, 1, 0,
                   step + "R = T P");
      }
    }
    Product(Sq(q), X(x_), x_, OtherX(), 1, 0, "X = Q X");
    x_ = OtherX();
  }

  const PlanSpec& spec_;
  const int64_t m_, n_;
  const std::vector<Panel> panels_;
  Buf x_ = Buf::kX0;
  OpList out_;
};

}  // namespace

OpList BuildOps(const PlanSpec& spec) { return Builder(spec).Build(); }

int64_t AlignmentBytes(int64_t offset, int64_t stride, int64_t batch,
                       int64_t elem_bytes) {
  int64_t align = 256;
  auto limit = [&align](int64_t bytes) {
    while (align > 1 && bytes % align != 0) align /= 2;
  };
  limit(offset * elem_bytes);
  if (batch > 1) limit(stride * elem_bytes);
  return align;
}

std::string GemmDescriptorKey(const Gemm& g, int64_t elem_bytes) {
  std::string key =
      Fmt("%c%c %lld %lld %lld b%lld e%lld", g.trans_a ? 'T' : 'N',
          g.trans_b ? 'T' : 'N', static_cast<long long>(g.m),
          static_cast<long long>(g.n), static_cast<long long>(g.k),
          static_cast<long long>(g.batch), static_cast<long long>(elem_bytes));
  for (const Operand* o : {&g.a, &g.b, &g.c, &g.d}) {
    key += Fmt(" [%lld %lld %lld %lld a%lld]", static_cast<long long>(o->rows),
               static_cast<long long>(o->cols), static_cast<long long>(o->ld),
               static_cast<long long>(o->stride),
               static_cast<long long>(
                   AlignmentBytes(o->offset, o->stride, g.batch, elem_bytes)));
  }
  return key;
}

std::string PlanKey(const PlanSpec& spec, int in_dtype, int out_dtype,
                    int compute_dtype) {
  std::string key =
      Fmt("%lldx%lld b%lld %s in%d out%d c%d sym%d panel%lld safety%.17g "
          "eps%.17g restart%d",
          static_cast<long long>(spec.rows), static_cast<long long>(spec.cols),
          static_cast<long long>(spec.batch), AlgoName(spec.algo), in_dtype,
          out_dtype, compute_dtype, spec.symmetric ? 1 : 0,
          static_cast<long long>(spec.panel_rows), spec.norm_safety, spec.eps,
          spec.gram_restart_after);
  for (const Coefficients& s : spec.steps) {
    key += Fmt(" (%.17g,%.17g,%.17g)", s.a, s.b, s.c);
  }
  return key;
}

double GemmFlops(const OpList& ops) {
  double flops = 0;
  for (const Op& op : ops.ops) {
    if (op.kind != OpKind::kGemm) continue;
    const Gemm& g = op.gemm;
    flops += 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n) *
             static_cast<double>(g.k) * static_cast<double>(g.batch);
  }
  return flops;
}

}  // namespace dmuon::kernels::cuda::plan
