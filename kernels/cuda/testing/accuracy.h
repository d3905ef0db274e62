// What the CUDA accuracy tests hold Newton–Schulz to, shared by the GPU tests
// (cuda_kernels_test.cc, autotune_cuda_test.cc) and by the CPU test that
// checks every bound on the same calls with the device's roundings emulated
// (emulated_precision_test.cc), so a bound is verified before a GPU runs it.
//
// The bound (ErrorBound) on ||device - cpu||_F / ||cpu||_F, the device's
// output against the CPU fp32 path (kernels.h) on the same input:
//
//   F * N * u  +  2 N sqrt(n) u32  +  u_out  +  u_in
//
// u: unit roundoff of the compute dtype the call resolves to (ResolveNs):
//   bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4, fp32 u32 = 2^-24 = 6.0e-8.
// N: roundings to the compute dtype on the path, counted from the plan's
//   operation list (Roundings): the normalized input, every product (a
//   triangle-only product's panels are one rounding) and every P = Z + a I.
//   Classic 5 steps: direct 1 + 3 x 5 = 16 (A, B, X per step); Gram 24
//   (R, then Z, P, Q = Q P, T = P R, R = T P per step where needed, and
//   X = Q X, R = X X^T at the restart and X = Q X at the end).
// F * N * u: each rounding perturbs the matrix it is stored into by at most
//   u relative (per element, hence in Frobenius norm); to first order the
//   output error is the sum of these as the remaining steps carry them.
//   F = 1 for direct. F = 2 for Gram: its m x m iterates are functions of
//   R = X X^T, whose condition number is X's squared, so a rounding relative
//   to ||R|| is larger still relative to the small singular values; the
//   second N covers that loss.
// 2 N sqrt(n) u32: fp32 accumulation of up to n terms per product element
//   (n = the longer side), on the device and again in the CPU reference
//   (typical growth sqrt(n)); negligible beside 16-bit roundings, the whole
//   bound for the fp32 compute path.
// u_out: the output stored in a dtype coarser than the compute dtype (fp16
//   Gram downloaded as bf16) is rounded once more.
// u_in: the device rounded an input the reference saw in fp32
//   (input_rounding), a perturbation of up to u_in relative.
//
// Emulated on the CPU (emulated_precision_test, fresh seeds and the GPU
// tests' own inputs) the errors stay at or below half of the bound on every
// call the GPU tests make: roundings are random and mostly add in
// quadrature (~3u for m >= 48 for both methods on well-conditioned inputs);
// the tightest are a 1 x n row (A is a single number, so its roundings do not
// average: direct up to 7u of 16u) and Gram on a square input (~21u of 48u;
// in bf16 it is 16-22 bf16 u, 6-9e-2, which is why Gram runs in fp16).

#ifndef DMUON_KERNELS_CUDA_TESTING_ACCURACY_H_
#define DMUON_KERNELS_CUDA_TESTING_ACCURACY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/plan_logic.h"
#include "kernels/kernels.h"

namespace dmuon::kernels::cuda::accuracy {

// A call's label in test messages: the dtype and method asked for, what
// they resolve to under `o` (ResolveNs), and the shape, e.g.
// "bf16 auto->gram/f16 [64,64]".
std::string Describe(DType asked, Method method, Shape shape,
                     const CudaNsOptions& o);

// Unit roundoff of a dtype.
double UnitRoundoff(DType t);

// Roundings to the compute dtype on the path of `ops` (N above).
int Roundings(const plan::OpList& ops);

// The bound above for `shape` under `options` (the method and compute dtype
// resolved as Context::Orthogonalize resolves them), the output stored as
// `out`; input_rounding: the dtype the device rounded an input to that the
// reference saw unrounded (kF32: both saw the same values).
double ErrorBound(Shape shape, const CudaNsOptions& options, DType out,
                  DType input_rounding = DType::kF32);

// The GPU tests' inputs: n standard normal floats from mt19937(seed).
std::vector<float> Random(int64_t n, uint32_t seed);

// ||got - want||_F / ||want||_F over n elements (over every element of
// equal-size vectors).
double RelError(const float* got, const float* want, int64_t n);
double RelError(const std::vector<float>& got, const std::vector<float>& want);

// The calls of cuda_kernels_test's MatchesCpu: for every compute dtype
// asked for, method and shape in this order, the i-th call's input is
// Random(elements, kMatchesCpuSeed + i) rounded to the asked compute dtype,
// uploaded and downloaded in that dtype.
const std::vector<Shape>& MatchesCpuShapes();
inline constexpr uint32_t kMatchesCpuSeed = 1;
inline constexpr DType kMatchesCpuComputes[] = {DType::kBF16, DType::kF16};
inline constexpr Method kMatchesCpuMethods[] = {Method::kDirect, Method::kGram,
                                                Method::kAuto};

// OptionsAndDTypes: one fp32 input Random(elements, kOptionsSeed) of
// kOptionsShape, fp32 in and out, every schedule, symmetric or dense
// products, every method; compute bf16 (Gram resolves to fp16); and once
// the fp32 compute path with the default options.
inline constexpr Shape kOptionsShape{200, 520};
inline constexpr uint32_t kOptionsSeed = 42;
inline constexpr const char* kOptionsSchedules[] = {"classic", "polar_express",
                                                    "you"};
// Those calls (the fp32 path aside) in order: each schedule, symmetric then
// dense, direct, Gram, auto; `label` names the call in test messages.
struct OptionsCall {
  CudaNsOptions options;
  std::string label;
};
std::vector<OptionsCall> OptionsCalls();

// BatchEqualsOneByOne: a batch of kBatch matrices Random(kBatch * elements,
// kBatchSeed) rounded to fp16, fp16 in, out and compute, both methods.
inline constexpr Shape kBatchShapes[] = {{48, 160}, {160, 48}};
inline constexpr int64_t kBatch = 4;
inline constexpr uint32_t kBatchSeed = 9;

// The CUDA executor's calls (server/cuda/cuda_executor_test.cc against the
// CPU executor): fp32 gradients through the momentum step (a fresh normal
// matrix, as far as NS can tell), NS with the default MuonParams (direct,
// classic schedule) in bf16 as ExecutorNsOptions asks, fp32 in and out;
// held to ErrorBound(shape, options, DType::kF32).
inline constexpr Shape kExecutorShapes[] = {{96, 64}, {40, 56}, {64, 64}};

// The CPU fp32 path on `batch` matrices of `shape` stored one after another
// in `host`: the reference every GPU result is held to. A failing call is a
// test failure (the output is then left zero for that matrix).
std::vector<float> CpuReference(const std::vector<float>& host, Shape shape,
                                int64_t batch, const NsOptions& o);

}  // namespace dmuon::kernels::cuda::accuracy

#endif  // DMUON_KERNELS_CUDA_TESTING_ACCURACY_H_
