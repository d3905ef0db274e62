// Internal to kernels: the Newton–Schulz iterate in and out of the caller's
// layout (kernels/ns_cpu.cc): the input's norm, the normalized (for a tall
// matrix, transposed) copy the iteration starts from, and the (transposed)
// copy of the result. Built with -ftree-vectorize (kernels/BUILD).
//
// Why their own file: written as plain loops these were about 6 % of the
// CPU Newton–Schulz of a 4-layer d=384 GPT's matrices (perf, 2026-12-07,
// AMD EPYC): the norm a single running double sum, one add's latency an
// element; the transposes column by column, a cache line per element. The
// forms below keep several partial sums and go through the matrix in tiles.

#ifndef DMUON_KERNELS_ITERATE_H_
#define DMUON_KERNELS_ITERATE_H_

#include <cstdint>

namespace dmuon::kernels::internal {

// The sum of x[i]^2 over [0, n), accumulated in double in interleaved
// partial sums added at the end. It differs from a single running sum only
// by double rounding (relative 1e-15 at these sizes); finite inputs never
// overflow it (a float's square is below 1.2e77), so it is finite exactly
// when every x[i] is.
double SumSquares(const float* x, int64_t n);
double SumSquares(const double* x, int64_t n);

// dst <- src / d (each element an IEEE division: the bits of a plain loop),
// src rows x cols row-major; transpose: dst is cols x rows, dst[j][i] =
// src[i][j] / d. src and dst do not overlap.
void DivideInto(const float* src, int64_t rows, int64_t cols, float d,
                bool transpose, float* dst);
void DivideInto(const double* src, int64_t rows, int64_t cols, double d,
                bool transpose, double* dst);

// dst <- src, or its transpose as above. src and dst do not overlap.
void CopyInto(const float* src, int64_t rows, int64_t cols, bool transpose,
              float* dst);
void CopyInto(const double* src, int64_t rows, int64_t cols, bool transpose,
              double* dst);

}  // namespace dmuon::kernels::internal

#endif  // DMUON_KERNELS_ITERATE_H_
