// ./dmuon bench kernels (CPU): in one run on one machine, times the plain
// sgemm (the machine's peak), direct NS, Gram NS, and batched vs one-by-one
// NS, and reports every rate against that same run's peak.
//
//   bazel run //benchmarks:kernels_bench -- --shapes=1024x1024 --reps=5

#include <cblas.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "benchmarks/bench_util.h"
#include "kernels/cost_model.h"
#include "kernels/kernels.h"

ABSL_FLAG(std::string, shapes, "512x512,1024x1024,2048x2048,512x2048,1024x4096",
          "comma-separated ROWSxCOLS shapes (real models' shapes scaled down)");
ABSL_FLAG(int, reps, 5, "timed repetitions per row (after one warm-up)");
ABSL_FLAG(int, batch, 4, "batch size of the batched vs one-by-one rows");
ABSL_FLAG(int, batch_max_edge, 1024,
          "largest min(rows, cols) that gets batched rows");
ABSL_FLAG(int, threads, 0, "OpenBLAS threads (0: all cores)");
ABSL_FLAG(std::string, out, "", "JSON results path (empty: none)");

namespace dmuon::bench {
namespace {

using kernels::ConstMatrixF;
using kernels::MatrixF;
using kernels::Method;
using kernels::Shape;

std::string ShapeName(Shape s) { return absl::StrCat(s.rows, "x", s.cols); }

absl::Status Run(std::vector<Row>& rows) {
  auto shapes = ParseShapes(absl::GetFlag(FLAGS_shapes));
  if (!shapes.ok()) return shapes.status();
  const int reps = absl::GetFlag(FLAGS_reps);
  const int batch = absl::GetFlag(FLAGS_batch);
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (Shape s : *shapes) {
    const int64_t m = s.m(), n = s.n(), e = s.elements();
    std::vector<float> x(e * batch), out(e * batch), a(m * m), c(m * n);
    for (float& v : x) v = d(rng);
    for (float& v : a) v = d(rng);
    kernels::NsOptions o;
    const double dense = kernels::EstimateCost(Method::kDirect, s, o, 1.0)
                             .dense_equivalent_flops;

    // Peak: the dominant NS product, (m x m)(m x n), as one dense sgemm.
    auto gemm = Time(
        [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f,
                      a.data(), m, x.data(), n, 0.0f, c.data(), n);
          return absl::OkStatus();
        },
        reps);
    if (!gemm.ok()) return gemm.status();
    const double peak = 2.0 * m * m * n / Median(*gemm) / 1e9;
    rows.push_back(
        {ShapeName(s), 1, "gemm", Median(*gemm), peak, peak, 1.0, -1, *gemm});

    // fp64 reference of the first matrix for the error column.
    std::vector<double> x64(x.begin(), x.begin() + e), ref(e);
    const bool check = m <= 1024;
    if (check) {
      auto st =
          kernels::Orthogonalize(kernels::ConstMatrixD{s, x64},
                                 kernels::MatrixD{s, absl::MakeSpan(ref)}, o);
      if (!st.ok()) return st;
    }
    auto add = [&](const std::string& name, int64_t b,
                   const std::function<absl::Status()>& fn) -> absl::Status {
      auto t = Time(fn, reps);
      if (!t.ok()) return t.status();
      const double gf = b * dense / Median(*t) / 1e9;
      rows.push_back({ShapeName(s), b, name, Median(*t), gf, peak, gf / peak,
                      check ? RelativeError(out, ref) : -1.0, *t});
      PrintTable({rows.back()});
      return absl::OkStatus();
    };
    for (Method method : {Method::kDirect, Method::kGram}) {
      o.method = method;
      auto st = add(std::string(kernels::MethodName(method)), 1, [&] {
        return kernels::Orthogonalize(
            ConstMatrixF{s, absl::MakeConstSpan(x.data(), e)},
            MatrixF{s, absl::MakeSpan(out.data(), e)}, o);
      });
      if (!st.ok()) return st;
    }
    if (m > absl::GetFlag(FLAGS_batch_max_edge) || batch <= 1) continue;
    o.method = Method::kDirect;
    std::vector<ConstMatrixF> ins;
    std::vector<MatrixF> outs;
    for (int i = 0; i < batch; ++i) {
      ins.push_back({s, absl::MakeConstSpan(x.data() + i * e, e)});
      outs.push_back({s, absl::MakeSpan(out.data() + i * e, e)});
    }
    auto st = add("direct-batched", batch,
                  [&] { return kernels::OrthogonalizeBatch(ins, outs, o); });
    if (!st.ok()) return st;
    st = add("direct-1by1", batch, [&] {
      for (int i = 0; i < batch; ++i) {
        if (auto r = kernels::Orthogonalize(ins[i], outs[i], o); !r.ok())
          return r;
      }
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "CPU Newton-Schulz kernels vs the same run's sgemm peak");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  dmuon::kernels::SetCpuThreads(absl::GetFlag(FLAGS_threads));
  std::vector<dmuon::bench::Row> rows;
  absl::Status st = dmuon::bench::Run(rows);
  if (!st.ok()) {
    std::fprintf(stderr, "kernels_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("\nsummary (median of %d runs each)\n",
              absl::GetFlag(FLAGS_reps));
  dmuon::bench::PrintTable(rows);
  const std::string command = absl::StrCat(
      "./dmuon bench kernels --shapes=", absl::GetFlag(FLAGS_shapes),
      " --reps=", absl::GetFlag(FLAGS_reps),
      " --batch=", absl::GetFlag(FLAGS_batch));
  st = dmuon::bench::WriteJson(absl::GetFlag(FLAGS_out), "kernels-cpu",
                               dmuon::bench::CpuMachine(), command, rows);
  if (!st.ok()) {
    std::fprintf(stderr, "kernels_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
