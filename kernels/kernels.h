// dmuon kernels: the compute library behind the optimizer daemon.
//
// Pure compute, no I/O: Newton–Schulz orthogonalization (direct and Gram),
// the Muon momentum update, and the learning-rate scale functions, with the
// exact semantics of torch.optim.Muon (docs/design.md, "The math of a Muon
// step").
//
// This header is the CPU implementation (fp32 through OpenBLAS, plus an fp64
// path used as the oracle in tests). The CUDA implementation lives in
// kernels/cuda/cuda_kernels.h and takes the same NsOptions. The types,
// schedules and options are in kernels/types.h, the cost model and the
// autotuner in kernels/cost_model.h and kernels/autotune.h.
//
// Every function returns absl::Status; none throws, none aborts on bad input.
// Matrices are row-major and dense (leading dimension == cols).

#ifndef DMUON_KERNELS_KERNELS_H_
#define DMUON_KERNELS_KERNELS_H_

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/types.h"  // Shape, Method, Schedule, NsOptions, MatrixRef

namespace dmuon::kernels {

// out <- NS(in): the approximate polar factor of `in`, same shape. A tall
// input is orthogonalized as its transpose (torch's semantics; iterated in
// its own layout, as X^T, without copies). `out` may alias `in`. Errors:
// INVALID_ARGUMENT for empty dimensions, out.shape != in.shape, a buffer
// smaller than its shape, non-finite input (the message names the element), or
// invalid options; INTERNAL for a non-finite result (a finite input cannot give
// one), with `out` zeroed.
absl::Status Orthogonalize(ConstMatrixF in, MatrixF out,
                           const NsOptions& options = {});
// fp64 path: the same algorithm in double precision (test oracle).
absl::Status Orthogonalize(ConstMatrixD in, MatrixD out,
                           const NsOptions& options = {});

// A batch of same-shape matrices; each out[i] <- NS(in[i]). Results equal
// the unbatched ones. Errors as above, plus mismatched shapes within the
// batch (named by index) and in.size() != out.size(). Nothing is written
// unless every matrix passed validation. out[i] may alias in[i], and
// overlaps no other in[j] or out[j].
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixF> in,
                                absl::Span<const MatrixF> out,
                                const NsOptions& options = {});
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixD> in,
                                absl::Span<const MatrixD> out,
                                const NsOptions& options = {});
// The same, each out[i] <- scale[i] * NS(in[i]) (an update's learning-rate
// scale: each element rounded once, the bits of ScaleInPlace after the
// call, without its pass over the result). scale: one finite value per
// matrix (INVALID_ARGUMENT otherwise, naming it), or empty for all 1.
absl::Status OrthogonalizeBatch(absl::Span<const ConstMatrixF> in,
                                absl::Span<const MatrixF> out,
                                const NsOptions& options,
                                absl::Span<const float> scale);

// The Muon momentum step fused with the Nesterov blend, torch's convention:
//   momentum.lerp_(grad, 1 - mu)                 (M <- mu M + (1 - mu) G)
//   update = nesterov ? grad.lerp(momentum, mu) : momentum
// using torch's two-sided lerp formula (weights rounded to float, as torch
// does), so results match torch to the last bit or within one rounding where
// torch's vectorized path fuses the multiply-add.
// All three spans must have the same size; `update` may be `grad` itself
// (in place) and otherwise overlaps neither it nor `momentum`.
absl::Status MomentumUpdate(absl::Span<const float> grad,
                            absl::Span<float> momentum,
                            absl::Span<float> update, double mu, bool nesterov);
// The same step with the old momentum read from `momentum_in` and the new
// one written to `momentum_out`: either the same buffer (the call above) or
// disjoint ones, so that a caller keeping the step's starting momentum (for
// a rollback) keeps it where it was instead of copying it first. Neither
// overlaps `grad` or `update`.
absl::Status MomentumUpdate(absl::Span<const float> grad,
                            absl::Span<const float> momentum_in,
                            absl::Span<float> momentum_out,
                            absl::Span<float> update, double mu, bool nesterov);

// x <- s * x, each element rounded once (an update's learning-rate scale).
void ScaleInPlace(absl::Span<float> x, float s);

// torch.optim.Muon's adjust_lr_fn for an A x B parameter:
//   kOriginal:      sqrt(max(1, A / B))
//   kMatchRmsAdamW: 0.2 * sqrt(max(A, B))   (Moonlight)
//   kSpectralUnclamped: sqrt(A / B)          (Bernstein; torch 2.15)
enum class LrAdjust { kOriginal, kMatchRmsAdamW, kSpectralUnclamped };
double LrScale(LrAdjust fn, Shape shape);
absl::StatusOr<LrAdjust> ParseLrAdjust(std::string_view name);

// Threads OpenBLAS may use for one product (process-wide). <= 0: all cores.
void SetCpuThreads(int threads);
// The threads OpenBLAS uses now (what SetCpuThreads set, else its start-up
// choice: OPENBLAS_NUM_THREADS or the cores).
int CpuThreads();

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_KERNELS_H_
