// Internal to kernels: the Newton–Schulz iterate's start and end
// (kernels/ns_cpu.cc): the input's norm, the normalized copy the iteration
// starts from, and the result's check and (scaled) copy out. Built with
// -ftree-vectorize (kernels/BUILD).
//
// Why their own file: written as plain loops these and the transposes of
// tall matrices (which the iteration no longer needs: ns_cpu.cc, Iterate)
// were about 6 % of the CPU Newton–Schulz of a 4-layer d=384 GPT's
// matrices (perf, 2026-12-07, AMD EPYC): the norm a single running double
// sum, one add's latency an element. It now keeps several partial sums.

#ifndef DMUON_KERNELS_ITERATE_H_
#define DMUON_KERNELS_ITERATE_H_

#include <cstdint>

namespace dmuon::kernels::internal {

// The sum of x[i]^2 over [0, n), accumulated in double in interleaved
// partial sums added at the end. It differs from a single running sum only
// by double rounding (relative 1e-15 at these sizes). Finite floats never
// overflow it (a float's square is below 1.2e77), so for float input it is
// finite exactly when every x[i] is; doubles above about 1.3e154 overflow
// it (the caller then checks the elements themselves).
double SumSquares(const float* x, int64_t n);
double SumSquares(const double* x, int64_t n);

// dst[i] <- src[i] / d over [0, n), each an IEEE division (the bits of a
// plain loop). src and dst do not overlap.
void DivideInto(const float* src, int64_t n, float d, float* dst);
void DivideInto(const double* src, int64_t n, double d, double* dst);

// out[i] <- x[i] * s over [0, n) (s == 1: a copy, the same bits), and
// whether every out[i] is finite (the result's check, in the same pass).
// x and out do not overlap.
bool ScaleInto(const float* x, int64_t n, float s, float* out);
bool ScaleInto(const double* x, int64_t n, double s, double* out);

}  // namespace dmuon::kernels::internal

#endif  // DMUON_KERNELS_ITERATE_H_
