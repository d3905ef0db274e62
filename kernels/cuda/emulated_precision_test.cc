// The accuracy bounds of the CUDA tests (testing/accuracy.h), checked on the
// CPU before a GPU runs them: every call the GPU tests make (cuda_kernels_test,
// autotune_cuda_test), on their own inputs and on fresh seeds, runs through
// the host interpreter emulating the device's arithmetic
// (testing/host_interpreter.h: bf16/fp16 stores rounded to nearest even, fp32
// accumulation, the plan's exact operation list) and is compared with the CPU
// fp32 path as the GPU tests compare it. Each emulated error must stay below
// bound / kMargin. The table printed on stdout lists every case's worst error,
// bound and margin.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/plan_logic.h"
#include "kernels/cuda/resolve_logic.h"
#include "kernels/cuda/testing/accuracy.h"
#include "kernels/cuda/testing/host_interpreter.h"
#include "kernels/kernels.h"

namespace dmuon::kernels::cuda {
namespace {

using accuracy::Describe;
using accuracy::ErrorBound;

// The emulation must leave this factor between its worst error and a bound:
// room for what it does not model (the device's accumulation order, seeds
// it did not draw).
constexpr double kMargin = 2.0;

plan::Format FormatOf(DType t) {
  switch (t) {
    case DType::kF32:
      return plan::Format::kF32;
    case DType::kBF16:
      return plan::Format::kBF16;
    case DType::kF16:
      return plan::Format::kF16;
  }
  return plan::Format::kF64;
}

// What the device holds after uploading `v` as `t`.
std::vector<float> Rounded(const std::vector<float>& v, DType t) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    r[i] = static_cast<float>(plan::RoundTo(v[i], FormatOf(t)));
  return r;
}

// Context::Orthogonalize of `batch` matrices `host` uploaded as `in`, the
// output downloaded from `out`, emulated.
std::vector<float> Emulate(const std::vector<float>& host, Shape shape,
                           int64_t batch, DType in, DType out,
                           const CudaNsOptions& o) {
  const ResolvedNs r = ResolveNs(shape, o);
  const plan::PlanSpec spec = MakePlanSpec(shape, batch, o);
  const plan::Precision p{FormatOf(in), FormatOf(r.compute), FormatOf(out)};
  const plan::Matrix res = plan::RunEmulated(
      spec, plan::BuildOps(spec), plan::Matrix(host.begin(), host.end()), p);
  return std::vector<float>(res.begin(), res.end());
}

// Worst error over the batch.
double WorstError(const std::vector<float>& got, const std::vector<float>& want,
                  Shape shape, int64_t batch) {
  const int64_t e = shape.elements();
  double worst = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const double err =
        accuracy::RelError(got.data() + b * e, want.data() + b * e, e);
    if (!std::isfinite(err)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, err);
  }
  return worst;
}

// Worst errors of one case over its seeds, checked and printed.
class Case {
 public:
  Case(std::string name, double bound)
      : name_(std::move(name)), bound_(bound) {}
  void Add(double error) {
    worst_ = std::max(worst_, error);
    ++runs_;
  }
  ~Case() {
    std::printf("%-44s runs %2d  worst %.3e  bound %.3e  margin %5.2f\n",
                name_.c_str(), runs_, worst_, bound_, bound_ / worst_);
    EXPECT_LE(worst_ * kMargin, bound_)
        << name_ << ": emulated " << worst_ << " over " << runs_
        << " runs is not " << kMargin << "x below the bound " << bound_;
  }

 private:
  std::string name_;
  double bound_;
  double worst_ = 0;
  int runs_ = 0;
};

TEST(EmulatedPrecision, RoundingIsIeeeRoundToNearestEven) {
  using plan::Format;
  using plan::RoundTo;
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(RoundTo(1 + std::ldexp(1, -8), Format::kBF16), 1.0);  // tie: even
  EXPECT_EQ(RoundTo(1 + 3 * std::ldexp(1, -8), Format::kBF16),
            1 + std::ldexp(1, -6));
  EXPECT_EQ(RoundTo(1 + std::ldexp(1, -11), Format::kF16), 1.0);
  EXPECT_EQ(RoundTo(1 + 3 * std::ldexp(1, -11), Format::kF16),
            1 + std::ldexp(1, -9));
  EXPECT_EQ(RoundTo(65504, Format::kF16), 65504);
  EXPECT_EQ(RoundTo(65519, Format::kF16), 65504);
  EXPECT_EQ(RoundTo(65520, Format::kF16), inf);
  EXPECT_EQ(RoundTo(-65520, Format::kF16), -inf);
  EXPECT_EQ(RoundTo(std::ldexp(1, -24), Format::kF16), std::ldexp(1, -24));
  EXPECT_EQ(RoundTo(std::ldexp(1, -25), Format::kF16), 0.0);  // tie: even
  EXPECT_EQ(RoundTo(3 * std::ldexp(1, -25), Format::kF16), std::ldexp(1, -23));
  EXPECT_EQ(RoundTo(std::ldexp(1, -133), Format::kBF16), std::ldexp(1, -133));
  EXPECT_TRUE(std::isnan(RoundTo(std::nan(""), Format::kF16)));

  // Against bit-level conversions on random floats of every magnitude.
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, 4);
    if (!std::isfinite(f)) continue;
    // bf16: round the fp32 bit pattern to its upper 16 bits, ties to even.
    uint32_t r = b + 0x7FFFu + ((b >> 16) & 1u);
    r &= 0xFFFF0000u;
    float want;
    std::memcpy(&want, &r, 4);
    ASSERT_EQ(RoundTo(f, Format::kBF16), static_cast<double>(want)) << f;
#ifdef __FLT16_MAX__
    ASSERT_EQ(RoundTo(f, Format::kF16),
              static_cast<double>(static_cast<_Float16>(f)))
        << f;
#endif
  }
}

// The emulation with fp32 everywhere is the exact interpreter up to fp32.
TEST(EmulatedPrecision, Fp32EmulationMatchesTheExactInterpreter) {
  for (plan::Algo algo : {plan::Algo::kDirect, plan::Algo::kGram}) {
    plan::PlanSpec spec;
    spec.rows = 24;
    spec.cols = 40;
    spec.batch = 2;
    spec.algo = algo;
    spec.steps = plan::ClassicCoefficients(5);
    spec.gram_restart_after = 2;
    spec.panel_rows = 8;
    std::mt19937 rng(17);
    const plan::Matrix input = plan::RandomBatch(spec, rng);
    const plan::OpList ops = plan::BuildOps(spec);
    const plan::Precision f32{plan::Format::kF32, plan::Format::kF32,
                              plan::Format::kF32};
    const plan::Matrix got = plan::RunEmulated(spec, ops, input, f32);
    const double err = plan::BatchError(spec, input, got);
    EXPECT_LT(err, 1e-5) << plan::AlgoName(algo);
    EXPECT_GT(err, 0) << "fp32 emulation rounded nothing";
  }
}

TEST(EmulatedPrecision, GramComputesInFp16) {
  std::vector<Shape> shapes = accuracy::MatchesCpuShapes();
  shapes.push_back(accuracy::kOptionsShape);
  for (Shape s : accuracy::kBatchShapes) shapes.push_back(s);
  for (Shape s : shapes) {
    for (DType asked : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (Method m : {Method::kDirect, Method::kGram, Method::kAuto}) {
        CudaNsOptions o;
        o.compute = asked;
        o.ns.method = m;
        const ResolvedNs r = ResolveNs(s, o);
        SCOPED_TRACE(Describe(asked, m, s, o));
        EXPECT_NE(r.method, Method::kAuto);
        if (m != Method::kAuto) {
          EXPECT_EQ(r.method, m);
        }
        if (r.method == Method::kGram && asked != DType::kF32) {
          EXPECT_EQ(r.compute, DType::kF16);
        } else {
          EXPECT_EQ(r.compute, asked);
        }
      }
    }
  }
  // kAuto takes Gram where it saves flops (wide or tall), direct on squares.
  CudaNsOptions o;
  o.ns.method = Method::kAuto;
  EXPECT_EQ(ResolveNs({96, 256}, o).method, Method::kGram);
  EXPECT_EQ(ResolveNs({256, 96}, o).compute, DType::kF16);
  EXPECT_EQ(ResolveNs({64, 64}, o).method, Method::kDirect);
}

TEST(EmulatedPrecision, RoundingCounts) {
  CudaNsOptions o;
  o.ns.method = Method::kDirect;
  EXPECT_EQ(
      accuracy::Roundings(plan::BuildOps(MakePlanSpec({640, 1280}, 1, o))), 16);
  o.symmetric = false;
  EXPECT_EQ(
      accuracy::Roundings(plan::BuildOps(MakePlanSpec({640, 1280}, 1, o))), 16);
  o.ns.method = Method::kGram;
  EXPECT_EQ(
      accuracy::Roundings(plan::BuildOps(MakePlanSpec({640, 1280}, 1, o))), 24);
  o.symmetric = true;
  EXPECT_EQ(
      accuracy::Roundings(plan::BuildOps(MakePlanSpec({640, 1280}, 1, o))), 24);
}

// cuda_kernels_test MatchesCpu: its own inputs, then kExtraSeeds more each.
TEST(EmulatedPrecision, MatchesCpuCalls) {
  uint32_t seed = accuracy::kMatchesCpuSeed;
  for (DType compute : accuracy::kMatchesCpuComputes) {
    for (Method method : accuracy::kMatchesCpuMethods) {
      for (Shape shape : accuracy::MatchesCpuShapes()) {
        CudaNsOptions o;
        o.compute = compute;
        o.ns.method = method;
        Case c("MatchesCpu " + Describe(compute, method, shape, o),
               ErrorBound(shape, o, compute));
        // Large shapes get fewer fresh seeds (the test's time).
        const int extra = shape.elements() > 500000 ? 2 : 9;
        for (int k = 0; k <= extra; ++k) {
          const uint32_t s = k == 0 ? seed : 1000 * k + seed;
          const std::vector<float> host =
              Rounded(accuracy::Random(shape.elements(), s), compute);
          c.Add(WorstError(Emulate(host, shape, 1, compute, compute, o),
                           accuracy::CpuReference(host, shape, 1, o.ns), shape,
                           1));
        }
        ++seed;
      }
    }
  }
}

// cuda_kernels_test OptionsAndDTypes.
TEST(EmulatedPrecision, OptionsAndDTypesCalls) {
  const Shape shape = accuracy::kOptionsShape;
  for (const accuracy::OptionsCall& call : accuracy::OptionsCalls()) {
    const CudaNsOptions& o = call.options;
    Case c("Options " + call.label, ErrorBound(shape, o, DType::kF32));
    for (uint32_t s : {accuracy::kOptionsSeed, 7001u, 7002u, 7003u}) {
      const std::vector<float> host = accuracy::Random(shape.elements(), s);
      c.Add(WorstError(Emulate(host, shape, 1, DType::kF32, DType::kF32, o),
                       accuracy::CpuReference(host, shape, 1, o.ns), shape, 1));
    }
  }
  CudaNsOptions o;
  o.compute = DType::kF32;
  Case c("Options fp32 path " + ShapeString(shape),
         ErrorBound(shape, o, DType::kF32));
  for (uint32_t s : {accuracy::kOptionsSeed, 7001u, 7002u, 7003u}) {
    const std::vector<float> host = accuracy::Random(shape.elements(), s);
    c.Add(WorstError(Emulate(host, shape, 1, DType::kF32, DType::kF32, o),
                     accuracy::CpuReference(host, shape, 1, o.ns), shape, 1));
  }
}

// cuda_kernels_test BatchEqualsOneByOne (against the CPU).
TEST(EmulatedPrecision, BatchCalls) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    for (Shape shape : accuracy::kBatchShapes) {
      CudaNsOptions o;
      o.compute = DType::kF16;
      o.ns.method = method;
      Case c("Batch " + Describe(DType::kF16, method, shape, o),
             ErrorBound(shape, o, DType::kF16));
      const int64_t b = accuracy::kBatch;
      for (uint32_t s : {accuracy::kBatchSeed, 9001u, 9002u}) {
        const std::vector<float> host =
            Rounded(accuracy::Random(b * shape.elements(), s), DType::kF16);
        c.Add(WorstError(Emulate(host, shape, b, DType::kF16, DType::kF16, o),
                         accuracy::CpuReference(host, shape, b, o.ns), shape,
                         b));
      }
    }
  }
}

// server/cuda/cuda_executor_test: the executor's NS (default options: direct
// in bf16, fp32 in and out) on fresh normal inputs.
TEST(EmulatedPrecision, ExecutorCalls) {
  for (Shape shape : accuracy::kExecutorShapes) {
    CudaNsOptions o;
    o.compute = DType::kBF16;
    Case c("Executor " + Describe(DType::kBF16, o.ns.method, shape, o),
           ErrorBound(shape, o, DType::kF32));
    for (uint32_t s = 11; s <= 20; ++s) {
      const std::vector<float> host = accuracy::Random(shape.elements(), s);
      c.Add(WorstError(Emulate(host, shape, 1, DType::kF32, DType::kF32, o),
                       accuracy::CpuReference(host, shape, 1, o.ns), shape, 1));
    }
  }
}

// autotune_cuda_test: CudaMeasure's own input (mt19937_64(12345), uploaded
// as the compute dtype) against the CPU fp32 direct method on the unrounded
// input, matrix 0 of a batch of 4.
TEST(EmulatedPrecision, AutotuneCalls) {
  const Shape shape{256, 1024};
  const int64_t batch = 4, e = shape.elements();
  std::vector<float> host(e * batch);
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> d;
  for (float& x : host) x = d(rng);
  for (Method method : {Method::kDirect, Method::kGram}) {
    CudaNsOptions o;
    o.compute = DType::kF16;
    o.ns.method = method;
    Case c("Autotune " + Describe(DType::kF16, method, shape, o),
           ErrorBound(shape, o, DType::kF16, DType::kF16));
    const std::vector<float> got =
        Emulate(host, shape, batch, DType::kF16, DType::kF16, o);
    NsOptions ref = o.ns;
    ref.method = Method::kDirect;
    const std::vector<float> first(host.begin(), host.begin() + e);
    c.Add(accuracy::RelError(
        got.data(), accuracy::CpuReference(first, shape, 1, ref).data(), e));
  }
}

// Larger than the GPU tests' shapes, one seed: a 1024 x 4096 matrix (Llama's
// smaller projections have this aspect) in the configurations the daemon runs
// (direct in bf16, Gram in fp16) with bf16 in and out.
// DMUON_EMULATE_LARGE=2048x7168,4096x14336 adds shapes (2048 x 7168 takes
// about a minute per call on two cores, 4096 x 14336 several and ~4 GB).
TEST(EmulatedPrecision, LargerShapes) {
  std::vector<Shape> shapes = {{1024, 4096}};
  if (const char* e = std::getenv("DMUON_EMULATE_LARGE")) {
    for (const char* p = e; *p != '\0';) {
      char* end = nullptr;
      const long long rows = std::strtoll(p, &end, 10);
      ASSERT_TRUE(end != p && *end == 'x') << "DMUON_EMULATE_LARGE: " << e;
      p = end + 1;
      const long long cols = std::strtoll(p, &end, 10);
      ASSERT_TRUE(end != p && rows > 0 && cols > 0)
          << "DMUON_EMULATE_LARGE: " << e;
      shapes.push_back({rows, cols});
      p = *end == ',' ? end + 1 : end;
      ASSERT_TRUE(*end == ',' || *end == '\0') << "DMUON_EMULATE_LARGE: " << e;
    }
  }
  for (Shape shape : shapes) {
    for (Method method : {Method::kDirect, Method::kGram}) {
      CudaNsOptions o;
      o.ns.method = method;
      Case c("Larger " + Describe(DType::kBF16, method, shape, o),
             ErrorBound(shape, o, DType::kBF16));
      const std::vector<float> host =
          Rounded(accuracy::Random(shape.elements(), 77), DType::kBF16);
      c.Add(WorstError(Emulate(host, shape, 1, DType::kBF16, DType::kBF16, o),
                       accuracy::CpuReference(host, shape, 1, o.ns), shape, 1));
    }
  }
}

}  // namespace
}  // namespace dmuon::kernels::cuda
