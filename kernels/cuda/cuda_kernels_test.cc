// The CUDA kernels against the CPU implementation (kernels/kernels.h), which
// is their oracle. Every test skips, saying why, when no CUDA device exists.
//
// Accuracy: each call is held to accuracy::ErrorBound for the method and
// compute dtype it resolves to (Gram computes in fp16) and its output dtype:
// N roundings of unit roundoff u each on the path (16 for direct in 5 steps,
// 24 for Gram, whose squared condition number counts them twice), fp32
// accumulation, and the output's own rounding; accuracy.h derives it.
// Direct bf16: 16 x 2^-8 = 6.3e-2; direct fp16: 7.8e-3; Gram fp16: 2.3e-2
// (2.7e-2 when its output is stored in bf16). emulated_precision_test checks
// every one of these calls (same inputs, plus fresh seeds) on the CPU with
// the device's roundings emulated: the worst emulated error is at least 2.3x
// below its bound (1 x 300 direct fp16, 3.4e-3; square Gram fp16, 9.8e-3).

#include "kernels/cuda/cuda_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/resolve_logic.h"
#include "kernels/cuda/testing/accuracy.h"
#include "kernels/cuda/testing/gpu.h"
#include "kernels/kernels.h"

namespace dmuon::kernels::cuda {
namespace {

using accuracy::Describe;
using accuracy::ErrorBound;
using accuracy::Random;
using accuracy::RelError;

bool AllFinite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DMUON_SKIP_WITHOUT_GPU();
    auto ctx = Context::Create(0);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *std::move(ctx);
  }
  void TearDown() override {
    for (void* p : owned_) EXPECT_TRUE(ctx_->Free(p).ok());
  }

  void* Alloc(size_t bytes) {
    auto p = ctx_->Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    owned_.push_back(*p);
    return *p;
  }

  // What the device holds after uploading `host` as `dtype` (rounded).
  std::vector<float> RoundTrip(const std::vector<float>& host, DType dtype) {
    void* d = Alloc(host.size() * DTypeBytes(dtype));
    EXPECT_TRUE(ctx_->Upload(host.data(), host.size(), d, dtype).ok());
    std::vector<float> back(host.size());
    EXPECT_TRUE(ctx_->Download(d, dtype, host.size(), back.data()).ok());
    return back;
  }

  // NS of `batch` matrices of `shape` on the device; in/out in `io`.
  absl::StatusOr<std::vector<float>> Gpu(const std::vector<float>& host,
                                         Shape shape, int64_t batch, DType io,
                                         const CudaNsOptions& o) {
    const size_t bytes = host.size() * DTypeBytes(io);
    void* in = Alloc(bytes);
    void* out = Alloc(bytes);
    if (auto st = ctx_->Upload(host.data(), host.size(), in, io); !st.ok())
      return st;
    if (auto st = ctx_->Orthogonalize({in, io, shape, batch, bytes},
                                      {out, io, shape, batch, bytes}, o);
        !st.ok())
      return st;
    if (auto st = ctx_->Synchronize(); !st.ok()) return st;
    std::vector<float> result(host.size());
    if (auto st = ctx_->Download(out, io, host.size(), result.data()); !st.ok())
      return st;
    return result;
  }

  std::unique_ptr<Context> ctx_;
  std::vector<void*> owned_;
};

// bf16 and fp16 asked for, direct, Gram and auto, against the CPU fp32 path
// on the same (rounded) input, in and out in the asked dtype: within
// ErrorBound (header comment), everything finite. Gram asked in bf16 runs
// in fp16 (its bf16 error on 64 x 64 would be 6-9e-2).
TEST_F(CudaKernelsTest, MatchesCpu) {
  uint32_t seed = accuracy::kMatchesCpuSeed;
  for (DType compute : accuracy::kMatchesCpuComputes) {
    for (Method method : accuracy::kMatchesCpuMethods) {
      for (const Shape shape : accuracy::MatchesCpuShapes()) {
        CudaNsOptions o;
        o.compute = compute;
        o.ns.method = method;
        SCOPED_TRACE(Describe(compute, method, shape, o));
        const std::vector<float> host =
            RoundTrip(Random(shape.elements(), seed++), compute);
        auto got = Gpu(host, shape, 1, compute, o);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(AllFinite(*got));
        const std::vector<float> want =
            accuracy::CpuReference(host, shape, 1, o.ns);
        EXPECT_LE(RelError(got->data(), want.data(), want.size()),
                  ErrorBound(shape, o, compute));
      }
    }
  }
}

// fp32 in/out around 16-bit products (bf16 asked: Gram resolves to fp16),
// other schedules, dense products, auto; bounds as in MatchesCpu (fp32
// output adds no rounding).
TEST_F(CudaKernelsTest, OptionsAndDTypes) {
  const Shape shape = accuracy::kOptionsShape;
  const std::vector<float> host =
      Random(shape.elements(), accuracy::kOptionsSeed);
  for (const accuracy::OptionsCall& call : accuracy::OptionsCalls()) {
    SCOPED_TRACE(call.label);
    const CudaNsOptions& o = call.options;
    auto got = Gpu(host, shape, 1, DType::kF32, o);
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> want =
        accuracy::CpuReference(host, shape, 1, o.ns);
    EXPECT_LE(RelError(got->data(), want.data(), want.size()),
              ErrorBound(shape, o, DType::kF32));
  }
  // The fp32 reference path: its bound is the fp32 accumulation on both
  // sides, 2 N sqrt(n) 2^-24 = 4.4e-5 (emulated: 1.4e-6).
  CudaNsOptions o;
  o.compute = DType::kF32;
  auto got = Gpu(host, shape, 1, DType::kF32, o);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<float> want = accuracy::CpuReference(host, shape, 1, o.ns);
  EXPECT_LE(RelError(got->data(), want.data(), want.size()),
            ErrorBound(shape, o, DType::kF32));
}

// A batch against its matrices one by one and against the CPU. Each result
// is within ErrorBound of the CPU's, so the two device results are within
// twice that of each other (equal when cuBLASLt picks the same algorithm).
TEST_F(CudaKernelsTest, BatchEqualsOneByOne) {
  const int64_t batch = accuracy::kBatch;
  for (Method method : {Method::kDirect, Method::kGram}) {
    for (const Shape shape : accuracy::kBatchShapes) {
      const int64_t e = shape.elements();
      const std::vector<float> host =
          RoundTrip(Random(batch * e, accuracy::kBatchSeed), DType::kF16);
      CudaNsOptions o;
      o.compute = DType::kF16;
      o.ns.method = method;
      const double bound = ErrorBound(shape, o, DType::kF16);
      SCOPED_TRACE(Describe(o.compute, method, shape, o));
      auto batched = Gpu(host, shape, batch, DType::kF16, o);
      ASSERT_TRUE(batched.ok()) << batched.status();
      const std::vector<float> want =
          accuracy::CpuReference(host, shape, batch, o.ns);
      for (int64_t b = 0; b < batch; ++b) {
        std::vector<float> one(host.begin() + b * e,
                               host.begin() + (b + 1) * e);
        auto single = Gpu(one, shape, 1, DType::kF16, o);
        ASSERT_TRUE(single.ok()) << single.status();
        EXPECT_LE(RelError(batched->data() + b * e, single->data(), e),
                  2 * bound)
            << "matrix " << b;
        EXPECT_LE(RelError(batched->data() + b * e, want.data() + b * e, e),
                  bound);
      }
    }
  }
}

TEST_F(CudaKernelsTest, ZeroMatrixGivesZeros) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    CudaNsOptions o;
    o.ns.method = method;
    auto got = Gpu(std::vector<float>(2 * 30 * 70, 0.0f), Shape{30, 70}, 2,
                   DType::kBF16, o);
    ASSERT_TRUE(got.ok()) << got.status();
    for (float v : *got) ASSERT_EQ(v, 0.0f);
  }
}

TEST_F(CudaKernelsTest, NonFiniteInputFailsAtSynchronize) {
  const Shape shape{16, 40};
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    std::vector<float> host = Random(shape.elements(), 5);
    host[123] = bad;
    auto got = Gpu(host, shape, 1, DType::kF32, CudaNsOptions{});
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
        << got.status();
  }
  // The flag is cleared: a finite input succeeds afterwards.
  auto ok = Gpu(Random(shape.elements(), 6), shape, 1, DType::kF32, {});
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(CudaKernelsTest, HostSideValidation) {
  const Shape shape{8, 16};
  const size_t bytes = 2 * shape.elements() * 2;  // batch 2, bf16
  void* in = Alloc(bytes);
  void* out = Alloc(bytes);
  const std::vector<float> zeros(2 * shape.elements(), 0.0f);
  ASSERT_TRUE(ctx_->Upload(zeros.data(), zeros.size(), in, DType::kBF16).ok());
  const CudaNsOptions o;
  auto code = [&](DeviceBatch a, DeviceBatch b, CudaNsOptions opt) {
    return ctx_->Orthogonalize(a, b, opt).code();
  };
  const DeviceBatch good_in{in, DType::kBF16, shape, 2, bytes};
  const DeviceBatch good_out{out, DType::kBF16, shape, 2, bytes};
  EXPECT_EQ(code(good_in, good_out, o), absl::StatusCode::kOk);
  DeviceBatch small = good_out;
  small.bytes = bytes - 1;
  EXPECT_EQ(code(good_in, small, o), absl::StatusCode::kInvalidArgument);
  DeviceBatch f32 = good_in;
  f32.dtype = DType::kF32;  // 4-byte elements: capacity too small
  EXPECT_EQ(code(f32, good_out, o), absl::StatusCode::kInvalidArgument);
  DeviceBatch other = good_out;
  other.shape = Shape{16, 8};
  EXPECT_EQ(code(good_in, other, o), absl::StatusCode::kInvalidArgument);
  other = good_out;
  other.batch = 1;
  EXPECT_EQ(code(good_in, other, o), absl::StatusCode::kInvalidArgument);
  other = good_out;
  other.data = nullptr;
  EXPECT_EQ(code(good_in, other, o), absl::StatusCode::kInvalidArgument);
  other = good_out;
  other.shape = Shape{0, 16};
  EXPECT_EQ(code(good_in, other, o), absl::StatusCode::kInvalidArgument);
  CudaNsOptions bad = o;
  bad.ns.schedule.steps.clear();
  EXPECT_EQ(code(good_in, good_out, bad), absl::StatusCode::kInvalidArgument);
  bad = o;
  bad.ns.eps = 0;
  EXPECT_EQ(code(good_in, good_out, bad), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ctx_->Synchronize().ok());
}

TEST_F(CudaKernelsTest, GraphReplayEqualsFirstRun) {
  const Shape shape{128, 384};
  const std::vector<float> host = Random(shape.elements(), 11);
  const size_t bytes = shape.elements() * 2;
  void* in = Alloc(bytes);
  void* out = Alloc(bytes);
  ASSERT_TRUE(ctx_->Upload(host.data(), host.size(), in, DType::kBF16).ok());
  for (Method method : {Method::kDirect, Method::kGram}) {
    std::vector<std::vector<float>> runs;
    for (bool graphs : {false, true, true, true}) {  // eager, capture, replay
      CudaNsOptions o;
      o.ns.method = method;
      o.use_graphs = graphs;
      ASSERT_TRUE(ctx_->Orthogonalize({in, DType::kBF16, shape, 1, bytes},
                                      {out, DType::kBF16, shape, 1, bytes}, o)
                      .ok());
      ASSERT_TRUE(ctx_->Synchronize().ok());
      std::vector<float> r(host.size());
      ASSERT_TRUE(ctx_->Download(out, DType::kBF16, r.size(), r.data()).ok());
      runs.push_back(std::move(r));
    }
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_EQ(runs[i], runs[0])
          << "run " << i << " differs, rel error "
          << RelError(runs[i].data(), runs[0].data(), runs[0].size());
    }
  }
}

TEST_F(CudaKernelsTest, MomentumMatchesCpuExactly) {
  const int64_t n = 10007;
  const std::vector<float> grad = Random(n, 21), mom0 = Random(n, 22);
  float* d_grad = static_cast<float*>(Alloc(n * 4));
  float* d_mom = static_cast<float*>(Alloc(n * 4));
  void* d_upd = Alloc(n * 4);
  for (bool nesterov : {true, false}) {
    for (DType ut : {DType::kF32, DType::kBF16}) {
      for (double mu : {0.95, 0.5, 0.0}) {
        std::vector<float> mom = mom0, upd(n);
        ASSERT_TRUE(MomentumUpdate(grad, absl::MakeSpan(mom),
                                   absl::MakeSpan(upd), mu, nesterov)
                        .ok());
        ASSERT_TRUE(ctx_->Upload(grad.data(), n, d_grad, DType::kF32).ok());
        ASSERT_TRUE(ctx_->Upload(mom0.data(), n, d_mom, DType::kF32).ok());
        ASSERT_TRUE(
            ctx_->MomentumUpdate(d_grad, d_mom, d_upd, ut, n, mu, nesterov)
                .ok());
        ASSERT_TRUE(ctx_->Synchronize().ok());
        std::vector<float> got_mom(n), got_upd(n);
        ASSERT_TRUE(ctx_->Download(d_mom, DType::kF32, n, got_mom.data()).ok());
        ASSERT_TRUE(ctx_->Download(d_upd, ut, n, got_upd.data()).ok());
        EXPECT_EQ(got_mom, mom) << "nesterov=" << nesterov << " mu=" << mu;
        const std::vector<float> want =
            ut == DType::kF32 ? upd : RoundTrip(upd, ut);
        EXPECT_EQ(got_upd, want) << "nesterov=" << nesterov << " mu=" << mu;
      }
    }
  }
  EXPECT_EQ(
      ctx_->MomentumUpdate(d_grad, d_mom, d_upd, DType::kF32, n, 1.0, true)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ctx_->MomentumUpdate(d_grad, d_mom, d_mom, DType::kF32, n, 0.9, true)
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaKernelsTest, GemmIsABTransposed) {
  const int64_t m = 33, n = 47, k = 65, batch = 2;
  const std::vector<float> a = Random(batch * m * k, 31),
                           b = Random(batch * n * k, 32);
  void* da = Alloc(a.size() * 4);
  void* db = Alloc(b.size() * 4);
  void* dc = Alloc(batch * m * n * 4);
  ASSERT_TRUE(ctx_->Upload(a.data(), a.size(), da, DType::kF32).ok());
  ASSERT_TRUE(ctx_->Upload(b.data(), b.size(), db, DType::kF32).ok());
  ASSERT_TRUE(ctx_->Gemm(da, db, dc, DType::kF32, m, n, k, batch).ok());
  std::vector<float> c(batch * m * n);
  ASSERT_TRUE(ctx_->Download(dc, DType::kF32, c.size(), c.data()).ok());
  for (int64_t t = 0; t < batch; ++t)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l)
          s += double(a[t * m * k + i * k + l]) * b[t * n * k + j * k + l];
        ASSERT_NEAR(c[t * m * n + i * n + j], s, 1e-3) << i << "," << j;
      }
}

// The plan cache in device bytes (plan_cache.h's policy, tested on the CPU
// by plan_cache_test) on the device: with a 1-byte cap every new plan evicts
// the plans no job uses, never one a job uses, and ReleasePlans frees that
// job's plans and their memory.
TEST_F(CudaKernelsTest, PlanCacheIsCappedInBytesAndReleasedByJob) {
  EXPECT_GT(ctx_->PlanStats().cap, 0u) << "the default cap";
  ContextOptions capped;
  capped.plan_cache_bytes = 1;
  auto ctx = Context::Create(0, capped);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  ctx_ = *std::move(ctx);
  EXPECT_EQ(ctx_->PlanStats().cap, 1u);
  const Shape a{32, 48}, b{48, 80};
  CudaNsOptions tool;  // no owner
  CudaNsOptions job = tool;
  job.plan_owners = {7};
  ASSERT_TRUE(Gpu(Random(a.elements(), 1), a, 1, DType::kBF16, tool).ok());
  const PlanCacheStats first = ctx_->PlanStats();
  EXPECT_EQ(first.plans, 1u);
  EXPECT_GT(first.bytes, 1u);
  EXPECT_EQ(first.over_cap, 1u);
  // Job 7's plan evicts the tool's.
  ASSERT_TRUE(Gpu(Random(b.elements(), 2), b, 1, DType::kBF16, job).ok());
  PlanCacheStats s = ctx_->PlanStats();
  EXPECT_EQ(s.plans, 1u);
  EXPECT_EQ(s.freed, 1u);
  const uint64_t job_bytes = s.bytes;
  // The tool's plan again: it cannot evict job 7's.
  ASSERT_TRUE(Gpu(Random(a.elements(), 3), a, 1, DType::kBF16, tool).ok());
  s = ctx_->PlanStats();
  EXPECT_EQ(s.plans, 2u);
  EXPECT_EQ(s.bytes, job_bytes + first.bytes);
  const uint64_t memory = ctx_->MemoryBytes();
  ASSERT_TRUE(ctx_->ReleasePlans(7).ok());
  s = ctx_->PlanStats();
  EXPECT_EQ(s.plans, 1u);
  EXPECT_EQ(s.bytes, first.bytes);
  EXPECT_EQ(ctx_->MemoryBytes(), memory - job_bytes);
  EXPECT_TRUE(ctx_->ReleasePlans(7).ok()) << "released twice";
}

TEST_F(CudaKernelsTest, DescribesDevice) {
  const std::string d = ctx_->DeviceDescription();
  EXPECT_NE(d.find("sm_"), std::string::npos) << d;
  EXPECT_NE(ctx_->stream(), nullptr);
}

}  // namespace
}  // namespace dmuon::kernels::cuda
