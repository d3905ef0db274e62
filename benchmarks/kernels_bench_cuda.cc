// ./dmuon bench kernels on a GPU (built with --config=cuda): in one run on
// one device, times the cuBLASLt bf16 GEMM (the peak: the shape's dominant
// product, (m x m)(m x n)), direct NS with triangle-only and with dense
// products, Gram NS (fp16), and batched direct and Gram vs one-by-one, each
// rate against that run's peak, every operand random (a product of zeros
// runs faster). Each row's error vs the CPU fp32 path is measured only up
// to --check_max_edge (the CPU reference of 4096x14336 alone takes seconds
// to tens of seconds, inside the GPU check's headline window): the output
// and the JSON's "cpu_check" say which shapes were not checked. stdout is
// line-buffered and --out is rewritten after every row, so a run cut short
// keeps the rows it measured.
// Without a device it says so and exits 0 (there is nothing to measure; the
// GPU check's probe decides whether that may happen).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/gpu/gpu_tool.h"
#include "kernels/cost_model.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"

ABSL_FLAG(std::string, shapes, "4096x4096,4096x14336,1024x4096,8192x28672",
          "comma-separated ROWSxCOLS shapes, measured in this order");
ABSL_FLAG(int, reps, 5, "timed repetitions per row (after one warm-up)");
ABSL_FLAG(int, inner, 5, "calls per timed repetition");
ABSL_FLAG(int, batch, 8, "batch of the batched vs one-by-one rows");
ABSL_FLAG(int, batch_max_edge, 4096, "largest min(rows, cols) batched");
ABSL_FLAG(int, check_max_edge, 4096,
          "largest max(rows, cols) whose error vs the CPU fp32 path is "
          "measured (0: none); larger shapes are timed unchecked");
ABSL_FLAG(std::string, out, "", "JSON results path (empty: none)");

namespace dmuon::bench {
namespace {

namespace cu = kernels::cuda;
using kernels::Method;
using kernels::Shape;

// Measures every shape, appending rows; `saved` runs after each row. The
// shapes whose CPU check was skipped go into `unchecked`.
absl::Status Run(cu::Context& ctx, std::vector<Row>& rows,
                 std::vector<std::string>& unchecked,
                 const std::function<void()>& saved) {
  auto shapes = ParseShapes(absl::GetFlag(FLAGS_shapes));
  if (!shapes.ok()) return shapes.status();
  const int reps = absl::GetFlag(FLAGS_reps),
            inner = absl::GetFlag(FLAGS_inner);
  uint64_t seed = std::random_device{}();
  for (Shape s : *shapes) {
    const int64_t m = s.m(), n = s.n(), e = s.elements();
    const int64_t batch = m <= absl::GetFlag(FLAGS_batch_max_edge)
                              ? absl::GetFlag(FLAGS_batch)
                              : 1;
    DeviceBuffers buf{&ctx, {}};
    // One random matrix, repeated over the batch (the rates do not depend
    // on the values being distinct; the error is measured on matrix 0).
    std::vector<float> host(e);
    FillRandom(seed++, absl::MakeSpan(host));
    const size_t bytes = e * batch * 2;
    auto in = buf.Get(bytes), out = buf.Get(bytes), ga = buf.Get(m * m * 2),
         gc = buf.Get(m * n * 2);
    for (auto* p : {&in, &out, &ga, &gc})
      if (!p->ok()) return p->status();
    for (int64_t i = 0; i < batch; ++i) {
      if (auto st =
              ctx.Upload(host.data(), e, static_cast<char*>(*in) + i * e * 2,
                         cu::DType::kBF16);
          !st.ok())
        return st;
    }
    if (auto st =
            ctx.Upload(host.data() + (e - m * m), m * m, *ga, cu::DType::kBF16);
        !st.ok())
      return st;
    // The products' outputs start random too.
    if (auto st = ctx.Upload(host.data(), e, *out, cu::DType::kBF16); !st.ok())
      return st;
    if (auto st = ctx.Upload(host.data(), m * n, *gc, cu::DType::kBF16);
        !st.ok())
      return st;
    auto timed = [&](const std::function<absl::Status()>& fn)
        -> absl::StatusOr<std::vector<double>> {
      return Time(
          [&]() -> absl::Status {
            for (int i = 0; i < inner; ++i)
              if (auto st = fn(); !st.ok()) return st;
            return ctx.Synchronize();
          },
          reps);
    };
    // Peak: the dominant product (m x m)(m x n) in bf16 as one dense GEMM.
    auto g = timed(
        [&] { return ctx.Gemm(*ga, *in, *gc, cu::DType::kBF16, m, n, m, 1); });
    if (!g.ok()) return g.status();
    for (double& t : *g) t /= inner;
    const double peak = 2.0 * m * m * n / Median(*g) / 1e9;
    const std::string name = absl::StrCat(s.rows, "x", s.cols);
    rows.push_back({name, 1, "gemm-bf16", Median(*g), peak, peak, 1.0, -1, *g});
    PrintTable({rows.back()});
    saved();

    std::vector<double> ref;
    if (std::max(s.rows, s.cols) > absl::GetFlag(FLAGS_check_max_edge)) {
      std::printf("%s: cpu check skipped (an edge above --check_max_edge=%d)\n",
                  name.c_str(), absl::GetFlag(FLAGS_check_max_edge));
      unchecked.push_back(name);
    } else {
      std::vector<float> r(e);
      auto st = kernels::Orthogonalize(
          kernels::ConstMatrixF{s, absl::MakeConstSpan(host.data(), e)},
          kernels::MatrixF{s, absl::MakeSpan(r)});
      if (!st.ok()) return st;
      ref.assign(r.begin(), r.end());
    }
    kernels::NsOptions base;
    const double dense = kernels::EstimateCost(Method::kDirect, s, base, 1.0)
                             .dense_equivalent_flops;
    struct Variant {
      std::string name;
      Method method;
      cu::DType compute;
      bool symmetric;
      int64_t batch;
      bool one_by_one;
    };
    std::vector<Variant> variants = {
        {"direct-bf16", Method::kDirect, cu::DType::kBF16, true, 1, false},
        {"direct-bf16-dense", Method::kDirect, cu::DType::kBF16, false, 1,
         false},
        // Gram always computes in fp16 (resolve_logic.h): no bf16 row.
        {"gram-fp16", Method::kGram, cu::DType::kF16, true, 1, false},
    };
    if (batch > 1) {
      variants.push_back({"direct-batched", Method::kDirect, cu::DType::kBF16,
                          true, batch, false});
      variants.push_back({"direct-1by1", Method::kDirect, cu::DType::kBF16,
                          true, batch, true});
      variants.push_back(
          {"gram-batched", Method::kGram, cu::DType::kF16, true, batch, false});
    }
    for (const Variant& v : variants) {
      cu::CudaNsOptions o;
      o.ns.method = v.method;
      o.compute = v.compute;
      o.symmetric = v.symmetric;
      auto call = [&]() -> absl::Status {
        if (!v.one_by_one) {
          return ctx.Orthogonalize({*in, cu::DType::kBF16, s, v.batch, bytes},
                                   {*out, cu::DType::kBF16, s, v.batch, bytes},
                                   o);
        }
        for (int64_t i = 0; i < v.batch; ++i) {
          char* pi = static_cast<char*>(*in) + i * e * 2;
          char* po = static_cast<char*>(*out) + i * e * 2;
          auto st =
              ctx.Orthogonalize({pi, cu::DType::kBF16, s, 1, size_t(e * 2)},
                                {po, cu::DType::kBF16, s, 1, size_t(e * 2)}, o);
          if (!st.ok()) return st;
        }
        return absl::OkStatus();
      };
      auto t = timed(call);
      if (!t.ok()) return t.status();
      for (double& x : *t) x /= inner;
      double err = -1;
      if (!ref.empty()) {
        std::vector<float> got(e);
        if (auto st = ctx.Download(*out, cu::DType::kBF16, e, got.data());
            !st.ok())
          return st;
        err = RelativeError(got, ref);
      }
      const double gf = v.batch * dense / Median(*t) / 1e9;
      rows.push_back(
          {name, v.batch, v.name, Median(*t), gf, peak, gf / peak, err, *t});
      PrintTable({rows.back()});
      saved();
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "CUDA Newton-Schulz kernels vs the same run's GEMM peak");
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a killed run keeps its lines
  absl::ParseCommandLine(argc, argv);
  namespace cu = dmuon::kernels::cuda;
  auto count = cu::DeviceCount();
  if (!count.ok() || *count == 0) {
    std::printf("kernels_bench_cuda: no CUDA device (%s); nothing measured\n",
                count.ok() ? "0 devices" : count.status().ToString().c_str());
    return 0;
  }
  auto ctx = cu::Context::Create(0);
  if (!ctx.ok()) {
    std::fprintf(stderr, "kernels_bench_cuda: %s\n",
                 ctx.status().ToString().c_str());
    return 1;
  }
  std::vector<dmuon::bench::Row> rows;
  std::vector<std::string> unchecked;
  nlohmann::json machine = {{"gpu", (*ctx)->DeviceDescription()},
                            {"host", dmuon::bench::CpuMachine()}};
  const std::string command =
      absl::StrCat("kernels_bench_cuda --shapes=", absl::GetFlag(FLAGS_shapes),
                   " --reps=", absl::GetFlag(FLAGS_reps),
                   " --inner=", absl::GetFlag(FLAGS_inner),
                   " --batch=", absl::GetFlag(FLAGS_batch),
                   " --check_max_edge=", absl::GetFlag(FLAGS_check_max_edge));
  absl::Status wst;
  auto save = [&] {
    const nlohmann::json cpu_check = {
        {"max_edge", absl::GetFlag(FLAGS_check_max_edge)},
        {"skipped_shapes", unchecked}};
    wst = dmuon::bench::WriteJson(absl::GetFlag(FLAGS_out), "kernels-gpu",
                                  machine, command, rows,
                                  {{"cpu_check", cpu_check}});
  };
  absl::Status st = dmuon::bench::Run(**ctx, rows, unchecked, save);
  std::printf("\nsummary (median of %d runs of %d calls)\n",
              absl::GetFlag(FLAGS_reps), absl::GetFlag(FLAGS_inner));
  dmuon::bench::PrintTable(rows);
  if (!unchecked.empty()) {
    std::printf("not checked vs the CPU fp32 path (--check_max_edge=%d):",
                absl::GetFlag(FLAGS_check_max_edge));
    for (const std::string& u : unchecked) std::printf(" %s", u.c_str());
    std::printf("\n");
  }
  save();
  if (!st.ok() || !wst.ok()) {
    std::fprintf(stderr, "kernels_bench_cuda: %s %s\n", st.ToString().c_str(),
                 wst.ToString().c_str());
    return 1;
  }
  return 0;
}
