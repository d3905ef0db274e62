#include "kernels/cuda/testing/accuracy.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cuda/resolve_logic.h"

namespace dmuon::kernels::cuda::accuracy {

std::string Describe(DType asked, Method method, Shape shape,
                     const CudaNsOptions& o) {
  const ResolvedNs r = ResolveNs(shape, o);
  return std::string(DTypeName(asked)) + " " + std::string(MethodName(method)) +
         "->" + std::string(MethodName(r.method)) + "/" +
         std::string(DTypeName(r.compute)) + " " + ShapeString(shape);
}

double UnitRoundoff(DType t) {
  switch (t) {
    case DType::kF32:
      return std::ldexp(1.0, -24);
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -11);
  }
  return 1;
}

int Roundings(const plan::OpList& ops) {
  int n = 0;
  for (const plan::Op& op : ops.ops) {
    switch (op.kind) {
      case plan::OpKind::kNormalize:
      case plan::OpKind::kAddDiag:
        ++n;
        break;
      case plan::OpKind::kGemm:
        // One per product: a dense product, or the first panel of a
        // triangle-only one (the only panel whose D starts at element 0).
        if (op.gemm.d.offset == 0) ++n;
        break;
      default:
        break;
    }
  }
  return n;
}

double ErrorBound(Shape shape, const CudaNsOptions& options, DType out,
                  DType input_rounding) {
  const ResolvedNs r = ResolveNs(shape, options);
  const int n_round =
      Roundings(plan::BuildOps(MakePlanSpec(shape, 1, options)));
  const double u = UnitRoundoff(r.compute), u32 = UnitRoundoff(DType::kF32);
  const double f = r.method == Method::kGram ? 2 : 1;
  double bound = f * n_round * u +
                 2 * n_round * std::sqrt(static_cast<double>(shape.n())) * u32;
  if (UnitRoundoff(out) > u) bound += UnitRoundoff(out);
  if (input_rounding != DType::kF32) bound += UnitRoundoff(input_rounding);
  return bound;
}

const std::vector<Shape>& MatchesCpuShapes() {
  static const std::vector<Shape>* shapes = new std::vector<Shape>{
      {64, 64}, {96, 256},   {256, 96},  {1, 300},
      {300, 1}, {127, 1000}, {640, 1280}};  // 640: two triangle panels
  return *shapes;
}

std::vector<OptionsCall> OptionsCalls() {
  std::vector<OptionsCall> calls;
  for (const char* schedule : kOptionsSchedules) {
    for (bool symmetric : {true, false}) {
      for (Method method : {Method::kDirect, Method::kGram, Method::kAuto}) {
        CudaNsOptions o;
        o.ns.schedule = *ScheduleByName(schedule, 5);
        o.ns.method = method;
        o.symmetric = symmetric;
        o.compute = DType::kBF16;
        calls.push_back({o, std::string(schedule) +
                                (symmetric ? " sym " : " dense ") +
                                Describe(o.compute, method, kOptionsShape, o)});
      }
    }
  }
  return calls;
}

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double RelError(const float* got, const float* want, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double diff = double(got[i]) - double(want[i]);
    num += diff * diff;
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  return RelError(got.data(), want.data(),
                  static_cast<int64_t>(std::min(got.size(), want.size())));
}

std::vector<float> CpuReference(const std::vector<float>& host, Shape shape,
                                int64_t batch, const NsOptions& o) {
  std::vector<float> out(host.size());
  const int64_t e = shape.elements();
  for (int64_t b = 0; b < batch; ++b) {
    auto st = kernels::Orthogonalize(
        ConstMatrixF{shape, absl::MakeConstSpan(host.data() + b * e, e)},
        MatrixF{shape, absl::MakeSpan(out.data() + b * e, e)}, o);
    EXPECT_TRUE(st.ok()) << st;
  }
  return out;
}

}  // namespace dmuon::kernels::cuda::accuracy
