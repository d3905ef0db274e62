// Host-side logic of the CUDA Newton–Schulz plans, in plain C++ (no CUDA
// types) so it is built and tested in the default configuration.
//
// A plan is a list of operations on named buffers: the input, the output and
// the compute-dtype work buffers. Every product is expressed as the
// column-major GEMM cuBLASLt executes (D = alpha op(A) op(B) + beta C), with
// explicit stored dimensions, leading dimensions and element offsets, so a
// host interpreter (plan_logic_test.cc) runs exactly what the device runs.
//
// Row-major / column-major translation. Matrices are row-major; the memory of
// a row-major r x c matrix S (leading dimension ld) is the column-major c x r
// matrix S^T with the same ld. A row-major product D = op(P) op(Q) (r x k
// times k x c) is therefore, in column-major terms, D^T = op(Q)^T op(P)^T:
// cuBLASLt's A is Q's memory, B is P's memory, M = c, N = r, K = k, and the
// row-major transpose flag of each operand becomes the same cuBLAS op:
//   Q not transposed: Q's memory is column-major Q^T (c x k)  -> op N;
//   Q transposed (op(Q) = S^T, S row-major c x k): the memory is column-major
//     S^T = op(Q) (k x c)                                    -> op T;
// and likewise for P (stored k x r with op N, r x k with op T).
// X X^T for a row-major m x n X is thus M = N = m, K = n, A = X with op T,
// B = X with op N ("TN", lda = ldb = n). Symmetric m x m matrices are
// layout-agnostic; their products use the transposed form (TN) too.

#ifndef DMUON_KERNELS_CUDA_PLAN_LOGIC_H_
#define DMUON_KERNELS_CUDA_PLAN_LOGIC_H_

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon::kernels::cuda::plan {

// Buffers of a plan. kIn and kOut are the caller's (rows x cols, their
// dtypes); the rest are owned by the plan, in the compute dtype: kX0/kX1 the
// m x n iterate (double-buffered), the others m x m.
enum class Buf : int {
  kIn = 0,
  kOut,
  kX0,
  kX1,
  kA,
  kB,
  kR,
  kZ,
  kP,
  kQ0,
  kQ1,
  kT,
  kCount
};
const char* BufName(Buf b);

enum class Algo { kDirect, kGram };
const char* AlgoName(Algo a);

struct Coefficients {
  double a = 0, b = 0, c = 0;
};

// What a plan computes. Validated by the caller (positive dimensions, batch
// >= 1, non-empty finite steps, eps > 0, restart >= 0).
struct PlanSpec {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t batch = 1;
  Algo algo = Algo::kDirect;
  std::vector<Coefficients> steps;
  double norm_safety = 1.0;
  double eps = 1e-7;
  int gram_restart_after = 0;  // see NsOptions; 0 disables restarts
  bool symmetric = true;       // triangle panels + mirror for symmetric results
  int64_t panel_rows = 0;      // <= 0: SymmetricPanelRows(m)

  bool tall() const { return rows > cols; }
  int64_t m() const { return tall() ? cols : rows; }
  int64_t n() const { return tall() ? rows : cols; }
};

// Elements of one batch matrix of `b` (the batch stride of that buffer).
int64_t BufferElements(const PlanSpec& spec, Buf b);

// Panel height of triangle-only m x m products: kernels/tiling.h's choice
// for a 256-row minimum GEMM edge, rounded up to a multiple of 64 so panel
// offsets keep the buffers' alignment (m itself when one panel results).
int64_t SymmetricPanelRows(int64_t m);

// A column-major matrix as cuBLASLt sees it: element (i, j) of batch matrix
// t is at buffer element t * stride + offset + i + j * ld.
struct Operand {
  Buf buf = Buf::kIn;
  int64_t offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  int64_t stride = 0;
};

// D = alpha op(A) op(B) + beta C, column-major, M x N x K, strided-batched.
// C and D always have the same dimensions and ld (cuBLASLt's requirement);
// when beta == 0, C is D.
struct Gemm {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;
  Operand a, b, c, d;
  double alpha = 1, beta = 0;
};
// Empty when `g` is self-consistent (op dimensions match M, N, K; ld >=
// stored rows; C and D alike); else what is wrong.
std::string CheckGemm(const Gemm& g);
std::string DescribeGemm(const Gemm& g);

// A row-major operand: the matrix stored row-major as rows x cols (leading
// dimension ld) at `offset`, used as op(S) = trans ? S^T : S.
struct RowMajor {
  Buf buf = Buf::kIn;
  int64_t offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  int64_t stride = 0;
  bool trans = false;
  int64_t eff_rows() const { return trans ? cols : rows; }
  int64_t eff_cols() const { return trans ? rows : cols; }
};
// A whole dense rows x cols matrix of buffer `b` (ld = cols).
RowMajor Whole(Buf b, int64_t rows, int64_t cols, int64_t stride);
RowMajor Transposed(RowMajor v);
// Rows [r0, r0 + h) / columns [c0, c0 + w) of op(S).
RowMajor SubRows(RowMajor v, int64_t r0, int64_t h);
RowMajor SubCols(RowMajor v, int64_t c0, int64_t w);
// d = alpha op(P) op(Q) + beta c (c, d not transposed; beta == 0 ignores c)
// as the column-major GEMM described at the top of this file.
Gemm RowMajorGemm(const RowMajor& p, const RowMajor& q, const RowMajor& c,
                  const RowMajor& d, double alpha, double beta, int64_t batch);

enum class OpKind {
  kNorm,       // per-matrix Frobenius norm of src (kIn) into the plan's norms
  kNormalize,  // dst = op(src) / max(norm * value, value2); op transposes
               // when the input is tall (dst is m x n)
  kGemm,       // gemm
  kMirror,     // dst (m x m, row-major): lower triangle <- upper triangle
  kAddDiag,    // dst = src + value * I (m x m); dst may be src
  kOutput,     // dst (kOut, rows x cols) = op(src), transposed back if tall
};
const char* OpKindName(OpKind k);

struct Op {
  OpKind kind = OpKind::kNorm;
  Buf src = Buf::kIn;
  Buf dst = Buf::kIn;
  double value = 0;
  double value2 = 0;
  Gemm gemm;
  std::string label;  // e.g. "step 1: A = X X^T panel 2/4"
};

struct OpList {
  std::vector<Op> ops;
  std::vector<Buf> work_buffers;  // plan-owned buffers the ops use, sorted
};

// The operation sequence of `spec` (docs/design.md "The math of a Muon
// step", kernels/kernels.h):
// Direct, per step k: A = X X^T; B = b A + c A A; X' = a X + B X.
// Gram (Dao-AILab gram-newton-schulz): R = X X^T, Q = I; per step k: at a
// restart (k == gram_restart_after > 0) X = Q X, R = X X^T, Q = I; then
// Z = b R + c R R; P = Z + a I; Q = (Q == I) ? P : Q P; and, when R is used
// again, T = P R, R = T P; at the end X = Q X.
// Symmetric results use triangle panels and a mirror when spec.symmetric.
OpList BuildOps(const PlanSpec& spec);

// Largest power of two <= 256 dividing the byte address of every batch
// matrix of an operand at `offset` elements in a 256-byte-aligned buffer.
int64_t AlignmentBytes(int64_t offset, int64_t stride, int64_t batch,
                       int64_t elem_bytes);

// Identity of the cuBLASLt descriptors and algorithm of a GEMM: everything
// but the buffers, offsets (beyond their alignment), alpha and beta.
std::string GemmDescriptorKey(const Gemm& g, int64_t elem_bytes);

// Plan cache key: everything BuildOps depends on plus the dtypes (their
// numeric values), not the caller's pointers.
std::string PlanKey(const PlanSpec& spec, int in_dtype, int out_dtype,
                    int compute_dtype);

// Flops the GEMMs of `ops` execute (2 M N K per batch matrix).
double GemmFlops(const OpList& ops);

}  // namespace dmuon::kernels::cuda::plan

#endif  // DMUON_KERNELS_CUDA_PLAN_LOGIC_H_
