// Host interpreter of the CUDA plans' operation lists (plan_logic.h), for
// tests: every GEMM runs as naive fp64 loops that read the column-major
// descriptors exactly as cuBLASLt does (op(A) with lda, offsets, strided
// batches, C read only when beta != 0), every other op as its kernel in
// kernels/cuda/ns_kernels.h defines it. Work buffers start as NaN, so an
// element a panel forgot, a mirror in the wrong direction or a read out of
// place shows up as NaN; every operand is checked to stay inside its batch
// matrix. Also a naive fp64 Newton–Schulz (the reference) and helpers comparing
// the two.
//
// With a Precision other than all-fp64 it emulates the device's arithmetic
// instead: the input is held in its dtype; the norm is an fp64 sum of
// squares rounded to fp32; normalize, add-diagonal and every GEMM compute in
// fp32 (GEMMs through OpenBLAS's sgemm on the same column-major descriptors:
// fp32 products and accumulation, fp32 alpha and beta, as cuBLASLt with
// CUBLAS_COMPUTE_32F) and round each stored element to the compute dtype
// (round to nearest even, with fp16's subnormals and overflow); the output
// is rounded to the output dtype. Accumulation order differs from the
// device's, which changes results by a few fp32 ulps, far below the 16-bit
// roundings this models.

#ifndef DMUON_KERNELS_CUDA_TESTING_HOST_INTERPRETER_H_
#define DMUON_KERNELS_CUDA_TESTING_HOST_INTERPRETER_H_

#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/plan_logic.h"

namespace dmuon::kernels::cuda::plan {

using Matrix = std::vector<double>;  // row-major

// The number formats a value may be held in.
enum class Format { kF64, kF32, kBF16, kF16 };
// `v` rounded to nearest (ties to even) in `f`, with subnormals and overflow
// to infinity; NaN stays NaN. kF64 returns v.
double RoundTo(double v, Format f);

// Formats of the caller's input, the plan's work buffers and the output.
// All kF64: the exact interpreter. Otherwise the device emulation described
// above (compute must then be kF32, kBF16 or kF16).
struct Precision {
  Format in = Format::kF64;
  Format compute = Format::kF64;
  Format out = Format::kF64;
  bool exact() const {
    return in == Format::kF64 && compute == Format::kF64 && out == Format::kF64;
  }
};

std::vector<Coefficients> ClassicCoefficients(int steps);
std::vector<Coefficients> YouCoefficients();

// Naive fp64 NS of one rows x cols matrix with spec's steps, safety, eps.
Matrix ReferenceNs(const Matrix& g, int64_t rows, int64_t cols,
                   const PlanSpec& spec);

class HostExecutor {
 public:
  // `input`: spec.batch matrices of spec.rows x spec.cols (rounded to
  // precision.in).
  HostExecutor(const PlanSpec& spec, const Matrix& input,
               Precision precision = {});
  // Runs the ops; a failed check is a gtest failure (ADD_FAILURE/ASSERT).
  void Run(const OpList& list);
  const Matrix& buffer(Buf b) const { return bufs_[static_cast<int>(b)]; }

 private:
  Matrix& B(Buf b) { return bufs_[static_cast<int>(b)]; }
  void Norm(const Op& op);
  void Convert(Buf src, Buf dst, bool normalize, double safety, double eps);
  void CheckOperand(const Operand& o, const char* name);
  void RunGemm(const Gemm& g);
  void EmulatedGemm(const Gemm& g);
  void Mirror(Buf buf);
  void AddDiag(Buf src, Buf dst, double value);

  const PlanSpec& spec_;
  const Precision precision_;
  std::array<Matrix, static_cast<int>(Buf::kCount)> bufs_;
  std::vector<double> norms_;
};

Matrix RandomBatch(const PlanSpec& spec, std::mt19937& rng);
// Max over the batch of ||out - ref||_F / ||ref||_F; NaN if out has a NaN.
double BatchError(const PlanSpec& spec, const Matrix& input, const Matrix& out);
// Interprets `ops` on `input` and returns BatchError against ReferenceNs.
double RunPlan(const PlanSpec& spec, const OpList& ops, const Matrix& input);
// Interprets `ops` on `input` with `precision` and returns the output.
Matrix RunEmulated(const PlanSpec& spec, const OpList& ops, const Matrix& input,
                   Precision precision);

}  // namespace dmuon::kernels::cuda::plan

#endif  // DMUON_KERNELS_CUDA_TESTING_HOST_INTERPRETER_H_
