// The CUDA plans' operation lists, run by the host interpreter
// (testing/host_interpreter.h: fp64 loops reading the column-major descriptors
// as cuBLASLt does, NaN-initialized work buffers, bounds checks), against a
// naive fp64 Newton–Schulz, on square, wide, tall and batched inputs, both
// methods, every restart position, dense and triangle-panel products.

#include "kernels/cuda/plan_logic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/testing/host_interpreter.h"

namespace dmuon::kernels::cuda::plan {
namespace {

std::string SpecString(const PlanSpec& s) { return PlanKey(s, 0, 0, 0); }

TEST(PlanLogic, RowMajorGemmMatchesRowMajorProduct) {
  // Random operands, transposes and sub-blocks: d = alpha op(P) op(Q) + beta c
  // executed through the column-major descriptor equals the row-major math,
  // and lands where the row-major d lives.
  std::mt19937 rng(7);
  std::normal_distribution<double> dist;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t r = 1 + rng() % 6, k = 1 + rng() % 6, c = 1 + rng() % 6;
    const int64_t pad = rng() % 3;  // sub-block offset inside a larger matrix
    const bool tp = rng() % 2, tq = rng() % 2;
    const int64_t big = 8 + pad, e = big * big, batch = 1 + rng() % 2;
    auto view = [&](Buf b, int64_t er, int64_t ec, bool t) {
      RowMajor v = Whole(b, big, big, e);
      if (t) v = Transposed(v);
      return SubCols(SubRows(v, pad, er), pad, ec);
    };
    const RowMajor p = view(Buf::kA, r, k, tp), q = view(Buf::kB, k, c, tq);
    const RowMajor cv = view(Buf::kR, r, c, false);
    const RowMajor dv = view(Buf::kZ, r, c, false);
    const double alpha = 1.5, beta = (trial % 3 == 0) ? 0.0 : -0.75;
    const Gemm g = RowMajorGemm(p, q, cv, dv, alpha, beta, batch);
    ASSERT_EQ(CheckGemm(g), "");
    EXPECT_EQ(g.m, c);
    EXPECT_EQ(g.n, r);
    EXPECT_EQ(g.k, k);

    Matrix a_buf(batch * e), b_buf(batch * e), c_buf(batch * e);
    for (Matrix* x : {&a_buf, &b_buf, &c_buf})
      for (double& v : *x) v = dist(rng);
    auto buf_of = [&](Buf b) -> const Matrix& {
      return b == Buf::kA ? a_buf : b == Buf::kB ? b_buf : c_buf;
    };
    for (int64_t t = 0; t < batch; ++t) {
      // Row-major element (i, j) of op(S).
      auto at = [&](const RowMajor& v, int64_t i, int64_t j) {
        const int64_t si = v.trans ? j : i, sj = v.trans ? i : j;
        return buf_of(v.buf)[t * v.stride + v.offset + si * v.ld + sj];
      };
      for (int64_t i = 0; i < r; ++i) {
        for (int64_t j = 0; j < c; ++j) {
          double s = 0;
          for (int64_t l = 0; l < k; ++l) s += at(p, i, l) * at(q, l, j);
          const double expect =
              alpha * s + (beta != 0 ? beta * at(cv, i, j) : 0.0);
          // Row-major D(i, j) is column-major D(j, i); cuBLASLt's view.
          const int64_t ci = j, cj = i;
          double cs = 0;
          for (int64_t l = 0; l < g.k; ++l) {
            const int64_t ar = g.trans_a ? l : ci, ac = g.trans_a ? ci : l;
            const int64_t br = g.trans_b ? cj : l, bc = g.trans_b ? l : cj;
            cs +=
                buf_of(
                    g.a.buf)[t * g.a.stride + g.a.offset + ar + ac * g.a.ld] *
                buf_of(g.b.buf)[t * g.b.stride + g.b.offset + br + bc * g.b.ld];
          }
          double got = g.alpha * cs;
          if (g.beta != 0) {
            got +=
                g.beta *
                buf_of(g.c.buf)[t * g.c.stride + g.c.offset + ci + cj * g.c.ld];
          }
          ASSERT_NEAR(got, expect, 1e-12)
              << "trial " << trial << " " << DescribeGemm(g);
          ASSERT_EQ(g.d.offset + ci + cj * g.d.ld, dv.offset + i * dv.ld + j);
        }
      }
    }
  }
}

TEST(PlanLogic, XXtIsTnGemm) {
  PlanSpec spec;
  spec.rows = 4;
  spec.cols = 10;
  spec.steps = ClassicCoefficients(1);
  spec.symmetric = false;
  OpList ops = BuildOps(spec);
  const Op* first = nullptr;
  for (const Op& op : ops.ops)
    if (op.kind == OpKind::kGemm) {
      first = &op;
      break;
    }
  ASSERT_NE(first, nullptr);
  const Gemm& g = first->gemm;
  EXPECT_TRUE(g.trans_a);
  EXPECT_FALSE(g.trans_b);
  EXPECT_EQ(g.m, 4);
  EXPECT_EQ(g.n, 4);
  EXPECT_EQ(g.k, 10);
  EXPECT_EQ(g.a.ld, 10);
  EXPECT_EQ(g.b.ld, 10);
  EXPECT_EQ(g.d.ld, 4);
}

struct Case {
  int64_t rows, cols, batch;
};

TEST(PlanLogic, OpListsMatchNaiveNewtonSchulz) {
  const std::vector<Case> cases = {
      {1, 1, 1},   {1, 9, 1},   {9, 1, 2},   {5, 5, 1},  {6, 6, 3},
      {7, 13, 1},  {13, 7, 1},  {8, 24, 2},  {24, 8, 2}, {11, 12, 1},
      {12, 11, 3}, {16, 40, 1}, {40, 16, 1}, {17, 17, 2}};
  std::mt19937 rng(12345);
  int runs = 0;
  for (const Case& c : cases) {
    for (Algo algo : {Algo::kDirect, Algo::kGram}) {
      for (bool symmetric : {true, false}) {
        for (int64_t panel : {0, 1, 2, 3, 5}) {
          if (!symmetric && panel != 0) continue;
          PlanSpec spec;
          spec.rows = c.rows;
          spec.cols = c.cols;
          spec.batch = c.batch;
          spec.algo = algo;
          spec.symmetric = symmetric;
          spec.panel_rows = panel;
          const int pick = static_cast<int>(rng() % 3);
          spec.steps = pick == 0 ? ClassicCoefficients(1 + rng() % 6)
                                 : YouCoefficients();
          spec.norm_safety = pick == 2 ? 1.05 : 1.0;
          spec.gram_restart_after = static_cast<int>(rng() % 4);
          const Matrix input = RandomBatch(spec, rng);
          const OpList ops = BuildOps(spec);
          SCOPED_TRACE(SpecString(spec));
          const double err = RunPlan(spec, ops, input);
          ASSERT_FALSE(std::isnan(err)) << "NaN reached the output";
          EXPECT_LT(err, 1e-9);
          ++runs;
        }
      }
    }
  }
  EXPECT_EQ(runs, 168);
}

TEST(PlanLogic, EveryRestartPositionAndStepCount) {
  std::mt19937 rng(99);
  for (int steps = 1; steps <= 7; ++steps) {
    for (int restart = 0; restart <= steps + 1; ++restart) {
      for (const Case& c : std::vector<Case>{{6, 15, 2}, {15, 6, 1}}) {
        PlanSpec spec;
        spec.rows = c.rows;
        spec.cols = c.cols;
        spec.batch = c.batch;
        spec.algo = Algo::kGram;
        spec.steps = ClassicCoefficients(steps);
        spec.gram_restart_after = restart;
        spec.panel_rows = 2;
        const Matrix input = RandomBatch(spec, rng);
        SCOPED_TRACE(SpecString(spec));
        const double err = RunPlan(spec, BuildOps(spec), input);
        ASSERT_FALSE(std::isnan(err));
        EXPECT_LT(err, 1e-9);
      }
    }
  }
}

TEST(PlanLogic, ZeroInputGivesZeros) {
  for (Algo algo : {Algo::kDirect, Algo::kGram}) {
    PlanSpec spec;
    spec.rows = 5;
    spec.cols = 8;
    spec.batch = 2;
    spec.algo = algo;
    spec.steps = ClassicCoefficients(5);
    spec.gram_restart_after = 2;
    HostExecutor ex(spec, Matrix(2 * 40, 0.0));
    ex.Run(BuildOps(spec));
    for (double v : ex.buffer(Buf::kOut)) EXPECT_EQ(v, 0.0);
  }
}

// The interpreter is sensitive: a wrong transpose or a missing mirror fails.
TEST(PlanLogic, InterpreterCatchesLayoutBugs) {
  PlanSpec spec;
  spec.rows = 6;
  spec.cols = 6;
  spec.steps = ClassicCoefficients(2);
  spec.panel_rows = 2;
  std::mt19937 rng(3);
  const Matrix input = RandomBatch(spec, rng);
  const OpList good = BuildOps(spec);
  ASSERT_LT(RunPlan(spec, good, input), 1e-9);

  OpList no_mirror = good;
  for (auto it = no_mirror.ops.begin(); it != no_mirror.ops.end(); ++it)
    if (it->kind == OpKind::kMirror) {
      no_mirror.ops.erase(it);
      break;
    }
  EXPECT_TRUE(std::isnan(RunPlan(spec, no_mirror, input)));

  OpList flipped = good;  // X' = a X + B X with op(A) transposed: X^T B
  for (Op& op : flipped.ops)
    if (op.kind == OpKind::kGemm && op.gemm.k == 6 && op.gemm.n == 6 &&
        op.label.find("X = a X") != std::string::npos) {
      op.gemm.trans_a = true;
    }
  EXPECT_GT(RunPlan(spec, flipped, input), 1e-3);
}

TEST(PlanLogic, PanelsSaveWorkAndShareDescriptors) {
  PlanSpec spec;
  spec.rows = 1024;
  spec.cols = 4096;
  spec.steps = ClassicCoefficients(5);
  const OpList sym = BuildOps(spec);
  spec.symmetric = false;
  const OpList full = BuildOps(spec);
  const double m = 1024, n = 4096;
  EXPECT_DOUBLE_EQ(GemmFlops(full), 5 * (4 * m * m * n + 2 * m * m * m));
  EXPECT_LT(GemmFlops(sym), 0.8 * GemmFlops(full));
  std::set<std::string> keys;
  int gemms = 0;
  for (const Op& op : sym.ops) {
    if (op.kind != OpKind::kGemm) continue;
    ++gemms;
    keys.insert(GemmDescriptorKey(op.gemm, 2));
    EXPECT_EQ(CheckGemm(op.gemm), "");
  }
  EXPECT_LT(keys.size(), static_cast<size_t>(gemms) / 4);
  EXPECT_EQ(SymmetricPanelRows(1024), 256);
  EXPECT_EQ(SymmetricPanelRows(4096), 512);
  EXPECT_EQ(SymmetricPanelRows(300), 300);  // one panel
  EXPECT_EQ(SymmetricPanelRows(600), 320);
  EXPECT_EQ(SymmetricPanelRows(100), 100);
}

TEST(PlanLogic, WorkBuffers) {
  PlanSpec spec;
  spec.rows = 8;
  spec.cols = 16;
  spec.steps = ClassicCoefficients(3);
  EXPECT_EQ(BuildOps(spec).work_buffers,
            (std::vector<Buf>{Buf::kX0, Buf::kX1, Buf::kA, Buf::kB}));
  spec.algo = Algo::kGram;
  spec.gram_restart_after = 0;
  std::vector<Buf> w = BuildOps(spec).work_buffers;
  EXPECT_EQ(std::count(w.begin(), w.end(), Buf::kA), 0);
  EXPECT_EQ(std::count(w.begin(), w.end(), Buf::kR), 1);
  EXPECT_EQ(BufferElements(spec, Buf::kX1), 128);
  EXPECT_EQ(BufferElements(spec, Buf::kR), 64);
}

TEST(PlanLogic, AlignmentAndKeys) {
  EXPECT_EQ(AlignmentBytes(0, 0, 1, 2), 256);
  EXPECT_EQ(AlignmentBytes(64, 0, 1, 2), 128);
  EXPECT_EQ(AlignmentBytes(1, 0, 1, 2), 2);
  EXPECT_EQ(AlignmentBytes(0, 127 * 127, 2, 2), 2);
  EXPECT_EQ(AlignmentBytes(0, 127 * 127, 1, 2), 256);  // stride unused
  EXPECT_EQ(AlignmentBytes(3, 8, 2, 4), 4);

  PlanSpec a;
  a.rows = 8;
  a.cols = 16;
  a.steps = ClassicCoefficients(5);
  PlanSpec b = a;
  EXPECT_EQ(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
  b.steps[4].c += 1e-12;
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(a, 1, 2, 1));
  b = a;
  b.batch = 2;
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
  b = a;
  b.algo = Algo::kGram;
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
  b = a;
  b.symmetric = false;
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
  b = a;
  b.rows = 16;
  b.cols = 8;
  EXPECT_NE(PlanKey(a, 1, 1, 1), PlanKey(b, 1, 1, 1));
}

}  // namespace
}  // namespace dmuon::kernels::cuda::plan
