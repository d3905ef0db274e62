// Newton–Schulz on the CPU against the exact SVD oracle
// (kernels/testing/oracle.h), on fresh random matrices every run.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/testing/oracle.h"

namespace dmuon::kernels {
namespace {

using testing::RandomNormal;
using testing::RandomWithSpectrum;
using testing::RelativeError;
using testing::SvdOracle;
using testing::ToDouble;
using testing::ToFloat;

class NsCpuTest : public ::testing::Test {
 protected:
  NsCpuTest() : seed_(std::random_device{}()), rng_(seed_) {}
  void SetUp() override { RecordProperty("seed", std::to_string(seed_)); }
  std::string Where(Shape s) const {
    return "shape " + ShapeString(s) + " seed " + std::to_string(seed_);
  }
  uint64_t seed_;
  std::mt19937_64 rng_;
};

NsOptions Options(Method method, Schedule schedule = ClassicSchedule()) {
  NsOptions o;
  o.method = method;
  o.schedule = std::move(schedule);
  return o;
}

std::vector<float> RunF32(const std::vector<double>& g, Shape s,
                          const NsOptions& o) {
  std::vector<float> in = ToFloat(g), out(in.size());
  absl::Status st =
      Orthogonalize(ConstMatrixF{s, in}, MatrixF{s, absl::MakeSpan(out)}, o);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

std::vector<double> RunF64(const std::vector<double>& g, Shape s,
                           const NsOptions& o) {
  std::vector<double> out(g.size());
  absl::Status st =
      Orthogonalize(ConstMatrixD{s, g}, MatrixD{s, absl::MakeSpan(out)}, o);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

const std::vector<Shape>& Shapes() {
  static const auto* shapes = new std::vector<Shape>{
      {64, 64}, {256, 256}, {100, 300},  {300, 100},  {1, 50}, {50, 1},
      {3, 5},   {5, 3},     {127, 1000}, {1000, 127}, {1, 1},  {200, 800}};
  return *shapes;
}

TEST_F(NsCpuTest, BothMethodsMatchSvdOracle) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    SCOPED_TRACE(MethodName(method));
    const NsOptions o = Options(method);
    for (Shape s : Shapes()) {
      const auto g = RandomNormal(s, rng_);
      const auto want = SvdOracle(g, s, o);
      EXPECT_LT(RelativeError(ToDouble(RunF32(g, s, o)), want), 1e-4)
          << Where(s);
      EXPECT_LT(RelativeError(RunF64(g, s, o), want), 1e-10) << Where(s);
    }
  }
}

TEST_F(NsCpuTest, IllConditionedBothMethods) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    const NsOptions o = Options(method);
    for (Shape s : {Shape{128, 128}, Shape{96, 384}, Shape{384, 96}}) {
      const auto g = RandomWithSpectrum(s, 1e-3, 1.0, rng_);
      const auto want = SvdOracle(g, s, o);
      EXPECT_LT(RelativeError(ToDouble(RunF32(g, s, o)), want), 1e-4)
          << MethodName(method) << " " << Where(s);
    }
  }
}

TEST_F(NsCpuTest, EverySchedule) {
  std::vector<Schedule> schedules = {
      ClassicSchedule(5), PolarExpressSchedule(5), PolarExpressSchedule(9),
      YouSchedule(5), ClassicSchedule(3)};
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<StepCoefficients> custom;
  for (int k = 0; k < 4; ++k)
    custom.push_back({2 + u(rng_), -1.5 + u(rng_), 0.5 + 0.2 * u(rng_)});
  auto c = CustomSchedule(custom);
  ASSERT_TRUE(c.ok()) << c.status();
  schedules.push_back(*c);
  const Shape s{80, 200};
  for (const Schedule& sched : schedules) {
    for (Method method : {Method::kDirect, Method::kGram}) {
      const NsOptions o = Options(method, sched);
      const auto g = RandomNormal(s, rng_);
      EXPECT_LT(RelativeError(ToDouble(RunF32(g, s, o)), SvdOracle(g, s, o)),
                1e-4)
          << sched.name << " " << MethodName(method) << " " << Where(s);
    }
  }
}

TEST_F(NsCpuTest, GramRestartSettings) {
  const Shape s{64, 256};
  for (int restart : {0, 1, 2, 4, 7}) {
    NsOptions o = Options(Method::kGram);
    o.gram_restart_after = restart;
    const auto g = RandomNormal(s, rng_);
    EXPECT_LT(RelativeError(RunF64(g, s, o), SvdOracle(g, s, o)), 1e-10)
        << "restart " << restart;
  }
}

TEST_F(NsCpuTest, AutoPicksAMethodAndStaysExact) {
  const NsOptions o = Options(Method::kAuto);
  for (Shape s : {Shape{64, 64}, Shape{64, 512}}) {
    const auto g = RandomNormal(s, rng_);
    EXPECT_LT(RelativeError(ToDouble(RunF32(g, s, o)), SvdOracle(g, s, o)),
              1e-4)
        << Where(s);
  }
}

TEST_F(NsCpuTest, BatchedEqualsUnbatched) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    const NsOptions o = Options(method);
    const Shape s{48, 130};
    std::vector<std::vector<float>> in,
        out(5, std::vector<float>(s.elements()));
    std::vector<ConstMatrixF> ins;
    std::vector<MatrixF> outs;
    for (int i = 0; i < 5; ++i) in.push_back(ToFloat(RandomNormal(s, rng_)));
    for (int i = 0; i < 5; ++i) {
      ins.push_back({s, in[i]});
      outs.push_back({s, absl::MakeSpan(out[i])});
    }
    ASSERT_TRUE(OrthogonalizeBatch(ins, outs, o).ok());
    for (int i = 0; i < 5; ++i) {
      std::vector<float> one(s.elements());
      ASSERT_TRUE(
          Orthogonalize(ins[i], MatrixF{s, absl::MakeSpan(one)}, o).ok());
      EXPECT_EQ(one, out[i]) << "batch element " << i;
    }
  }
}

// The scaled batch (the CPU executor's lr scale) gives ScaleInPlace's bits
// after the unscaled call, tall and wide, in place too; a wrong count of
// scales is refused.
TEST_F(NsCpuTest, ScaledBatchEqualsScaleInPlaceAfter) {
  std::uniform_real_distribution<double> u(0.3, 4.0);
  for (const Shape s : {Shape{150, 40}, Shape{40, 150}, Shape{64, 64}}) {
    const NsOptions o = Options(Method::kAuto);
    std::vector<std::vector<float>> in, want, got;
    std::vector<ConstMatrixF> ins, got_in;
    std::vector<MatrixF> got_out;
    std::vector<float> scale;
    for (int i = 0; i < 3; ++i) {
      in.push_back(ToFloat(RandomNormal(s, rng_)));
      scale.push_back(i == 1 ? 1.0f : static_cast<float>(u(rng_)));
    }
    got = in;  // in place, as the executor runs it
    for (int i = 0; i < 3; ++i) {
      std::vector<float> w(s.elements());
      ASSERT_TRUE(Orthogonalize(ConstMatrixF{s, in[i]},
                                MatrixF{s, absl::MakeSpan(w)}, o)
                      .ok());
      ScaleInPlace(absl::MakeSpan(w), scale[i]);
      want.push_back(w);
      got_in.push_back({s, got[i]});
      got_out.push_back({s, absl::MakeSpan(got[i])});
    }
    ASSERT_TRUE(OrthogonalizeBatch(got_in, got_out, o, scale).ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(want[i], got[i]) << Where(s) << " matrix " << i;
    }
    const absl::Status st = OrthogonalizeBatch(
        got_in, got_out, o, absl::MakeConstSpan(scale).subspan(1));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("3 inputs but 2 scales"), std::string::npos)
        << st.message();
    // A scale that is not finite is refused, named, nothing written.
    std::vector<float> bad = scale;
    bad[1] = std::numeric_limits<float>::infinity();
    const std::vector<std::vector<float>> before = got;
    const absl::Status inf = OrthogonalizeBatch(got_in, got_out, o, bad);
    EXPECT_EQ(inf.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(inf.message().find("scale 1 is inf"), std::string::npos)
        << inf.message();
    EXPECT_EQ(got, before);
  }
}

// fp64 elements above about 1e154 overflow the sum of squares; they are
// finite, so the matrix is orthogonalized (normalization makes the result
// scale-free): the same result as the matrix at unit scale.
TEST_F(NsCpuTest, HugeFiniteDoublesAreNormalizedNotRejected) {
  for (const Shape s : {Shape{30, 70}, Shape{70, 30}}) {
    const NsOptions o = Options(Method::kAuto);
    const std::vector<double> g = RandomNormal(s, rng_);
    std::vector<double> huge = g;
    for (double& v : huge) v *= 1e200;
    const std::vector<double> want = RunF64(g, s, o);
    EXPECT_LT(RelativeError(RunF64(huge, s, o), want), 1e-12) << Where(s);
  }
}

TEST_F(NsCpuTest, InPlace) {
  const Shape s{40, 70};
  const auto g = RandomNormal(s, rng_);
  std::vector<float> buf = ToFloat(g);
  const NsOptions o;
  ASSERT_TRUE(
      Orthogonalize(ConstMatrixF{s, buf}, MatrixF{s, absl::MakeSpan(buf)}, o)
          .ok());
  EXPECT_LT(RelativeError(ToDouble(buf), SvdOracle(g, s, o)), 1e-4);
}

TEST_F(NsCpuTest, ZeroMatrixGivesZeros) {
  for (Method method : {Method::kDirect, Method::kGram}) {
    const Shape s{16, 32};
    std::vector<float> in(s.elements(), 0.0f), out(s.elements(), 7.0f);
    ASSERT_TRUE(Orthogonalize(ConstMatrixF{s, in},
                              MatrixF{s, absl::MakeSpan(out)}, Options(method))
                    .ok());
    for (float v : out) ASSERT_EQ(v, 0.0f);
  }
}

TEST_F(NsCpuTest, NonFiniteInputIsRejectedAndNamed) {
  const Shape s{8, 12};
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> in = ToFloat(RandomNormal(s, rng_));
    in[3 * 12 + 5] = bad;
    std::vector<float> out(s.elements(), 1.0f);
    absl::Status st =
        Orthogonalize(ConstMatrixF{s, in}, MatrixF{s, absl::MakeSpan(out)});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("(3,5)"), std::string::npos) << st;
    for (float v : out) EXPECT_EQ(v, 1.0f) << "output touched on error";
  }
}

TEST_F(NsCpuTest, BadShapesAndBuffers) {
  std::vector<float> in(100, 1.0f), out(100);
  auto code = [&](Shape si, size_t ni, Shape so, size_t no) {
    return Orthogonalize(ConstMatrixF{si, absl::MakeConstSpan(in.data(), ni)},
                         MatrixF{so, absl::MakeSpan(out.data(), no)})
        .code();
  };
  EXPECT_EQ(code({0, 5}, 100, {0, 5}, 100), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({5, 0}, 100, {5, 0}, 100), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({-1, 5}, 100, {-1, 5}, 100),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({10, 10}, 99, {10, 10}, 100),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({10, 10}, 100, {10, 10}, 50),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({10, 10}, 100, {5, 20}, 100),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({10, 10}, 100, {10, 10}, 100), absl::StatusCode::kOk);
  absl::Status st =
      Orthogonalize(ConstMatrixF{{10, 10}, absl::MakeConstSpan(in.data(), 99)},
                    MatrixF{{10, 10}, absl::MakeSpan(out)});
  EXPECT_NE(st.message().find("input buffer holds 99"), std::string::npos)
      << st;
}

TEST_F(NsCpuTest, MismatchedBatch) {
  std::vector<float> a(20, 1.0f), b(20, 1.0f), oa(20), ob(20);
  std::vector<ConstMatrixF> in = {{{4, 5}, a}, {{5, 4}, b}};
  std::vector<MatrixF> out = {{{4, 5}, absl::MakeSpan(oa)},
                              {{5, 4}, absl::MakeSpan(ob)}};
  absl::Status st = OrthogonalizeBatch(in, out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("batch input 1 has shape [5,4]"),
            std::string::npos)
      << st;
  out.pop_back();
  EXPECT_EQ(OrthogonalizeBatch(in, out).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NsCpuTest, InvalidOptions) {
  std::vector<float> in(20, 1.0f), out(20);
  const Shape s{4, 5};
  NsOptions o;
  o.eps = 0;
  EXPECT_EQ(
      Orthogonalize(ConstMatrixF{s, in}, MatrixF{s, absl::MakeSpan(out)}, o)
          .code(),
      absl::StatusCode::kInvalidArgument);
  o = NsOptions{};
  o.schedule.steps.clear();
  EXPECT_EQ(
      Orthogonalize(ConstMatrixF{s, in}, MatrixF{s, absl::MakeSpan(out)}, o)
          .code(),
      absl::StatusCode::kInvalidArgument);
  o = NsOptions{};
  o.schedule.steps[2].b = std::nan("");
  EXPECT_EQ(
      Orthogonalize(ConstMatrixF{s, in}, MatrixF{s, absl::MakeSpan(out)}, o)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(CustomSchedule({}).ok());
  EXPECT_FALSE(ScheduleByName("quintic", 5).ok());
  EXPECT_FALSE(ScheduleByName("classic", 0).ok());
  // One bound for every schedule, named or custom.
  EXPECT_EQ(ScheduleByName("classic", kMaxNsSteps)->steps.size(),
            static_cast<size_t>(kMaxNsSteps));
  EXPECT_FALSE(ScheduleByName("you", kMaxNsSteps + 1).ok());
  EXPECT_TRUE(ScheduleByName("polar_express", 200).ok());
  EXPECT_TRUE(CustomSchedule(std::vector<StepCoefficients>(
                                 kMaxNsSteps, {3.4445, -4.7750, 2.0315}))
                  .ok());
  EXPECT_FALSE(CustomSchedule(std::vector<StepCoefficients>(
                                  kMaxNsSteps + 1, {3.4445, -4.7750, 2.0315}))
                   .ok());
  EXPECT_FALSE(ParseMethod("fast").ok());
}

TEST(Schedules, KnownValues) {
  const Schedule c = ClassicSchedule();
  ASSERT_EQ(c.steps.size(), 5u);
  EXPECT_DOUBLE_EQ(c.steps[4].a, 3.4445);
  EXPECT_DOUBLE_EQ(c.steps[4].b, -4.7750);
  EXPECT_DOUBLE_EQ(c.steps[4].c, 2.0315);
  const Schedule pe = PolarExpressSchedule(9);
  ASSERT_EQ(pe.steps.size(), 9u);
  EXPECT_DOUBLE_EQ(pe.norm_safety, 1.01);
  EXPECT_DOUBLE_EQ(pe.steps[0].a, 8.28721201814563 / 1.01);
  EXPECT_DOUBLE_EQ(pe.steps[0].c, 17.300387312530933 / std::pow(1.01, 5));
  EXPECT_DOUBLE_EQ(pe.steps[6].a, 1.8750014808534479);  // the last set is raw
  EXPECT_DOUBLE_EQ(pe.steps[8].b, -1.2500016453999487);
  const Schedule you = YouSchedule(6);
  EXPECT_DOUBLE_EQ(you.steps[0].a, 4.0848);
  EXPECT_DOUBLE_EQ(you.steps[5].c, 1.2012);
  auto by_name = ScheduleByName("polar_express", 4);
  ASSERT_TRUE(by_name.ok());
  EXPECT_EQ(by_name->steps.size(), 4u);
}

}  // namespace
}  // namespace dmuon::kernels
