// The element passes dmuond makes over each matrix of a step, on one core:
// the momentum step (kernels::MomentumUpdate, in place as the CPU executor
// called it, and with the old momentum kept in its buffer and the new one
// written to another, as it does now), the finiteness scan
// (kernels::FirstNonFinite), the lr scale (kernels::ScaleInPlace) and a memcpy
// of the momentum (the copy of it dmuond took at each step's start before it
// kept the buffer instead; also the memory floor), summed over a model's
// matrices. Beside them, in the same run, the momentum step as it was written
// before kernels/elementwise.h (the scalar two-sided lerp loop, built here with
// the project's -O2 like it was), so the ratio is measured, not remembered.
//
//   bazel build //benchmarks:elementwise_bench
//   taskset -c 1 bazel-bin/benchmarks/elementwise_bench --repeats=21
//       [--shapes=384x1152,...] [--json=benchmarks/results/x.json]
//
// Default shapes: the 16 matrices of the overlap bench's 4-layer d=384 GPT
// (per layer qkv 384x1152, proj 384x384, fc 1536x384 and 384x1536).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "kernels/finite.h"
#include "kernels/kernels.h"

ABSL_FLAG(std::string, shapes, "", "matrices, e.g. 384x1152,384x384");
ABSL_FLAG(int, repeats, 15, "timed rounds of the passes (median)");
ABSL_FLAG(std::string, json, "", "results file (none: print only)");

namespace dmuon::bench {
namespace {

// The momentum loop before kernels/elementwise.h, verbatim.
inline float Lerp(float start, float end, float weight) {
  return std::abs(weight) < 0.5f ? start + weight * (end - start)
                                 : end - (end - start) * (1.0f - weight);
}
void ScalarMomentum(const float* grad, float* momentum, float* update, size_t n,
                    double mu, bool nesterov) {
  const float w_grad = static_cast<float>(1.0 - mu);
  const float w_mom = static_cast<float>(mu);
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    const float m = Lerp(momentum[i], g, w_grad);
    momentum[i] = m;
    update[i] = nesterov ? Lerp(g, m, w_mom) : m;
  }
}

std::vector<kernels::Shape> DefaultShapes() {
  std::vector<kernels::Shape> s;
  for (int layer = 0; layer < 4; ++layer) {
    s.insert(s.end(), {{384, 1152}, {384, 384}, {1536, 384}, {384, 1536}});
  }
  return s;
}

int Run(const std::string& command) {
  std::vector<kernels::Shape> shapes = DefaultShapes();
  if (const std::string list = absl::GetFlag(FLAGS_shapes); !list.empty()) {
    auto parsed = ParseShapes(list);
    if (!parsed.ok()) {
      std::fprintf(stderr, "--shapes: %s\n",
                   std::string(parsed.status().message()).c_str());
      return 2;
    }
    shapes = *parsed;
  }
  std::vector<std::vector<float>> g, m, copy;
  int64_t elements = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = shapes[i].elements();
    elements += n;
    g.emplace_back(n), m.emplace_back(n), copy.emplace_back(n);
    FillRandom(2 * i + 1, absl::MakeSpan(g.back()));
    FillRandom(2 * i + 2, absl::MakeSpan(m.back()));
  }
  // Each pass over every matrix, as one step's work on the daemon's core.
  // Momentum values drift over the repeats; their cost does not.
  const std::vector<std::pair<std::string, std::function<absl::Status()>>>
      passes = {{"momentum (scalar, before)",
                 [&] {
                   for (size_t i = 0; i < g.size(); ++i)
                     ScalarMomentum(g[i].data(), m[i].data(), g[i].data(),
                                    g[i].size(), 0.95, true);
                   return absl::OkStatus();
                 }},
                {"momentum (kernels::MomentumUpdate)",
                 [&] {
                   for (size_t i = 0; i < g.size(); ++i) {
                     if (auto st = kernels::MomentumUpdate(
                             g[i], absl::MakeSpan(m[i]), absl::MakeSpan(g[i]),
                             0.95, true);
                         !st.ok())
                       return st;
                   }
                   return absl::OkStatus();
                 }},
                {"momentum, the old one kept (as dmuond now)",
                 [&] {
                   // Job::SaveStepStart swaps the buffers instead of copying:
                   // the step reads one and writes the other.
                   for (size_t i = 0; i < g.size(); ++i) {
                     if (auto st = kernels::MomentumUpdate(
                             g[i], m[i], absl::MakeSpan(copy[i]),
                             absl::MakeSpan(g[i]), 0.95, true);
                         !st.ok())
                       return st;
                   }
                   return absl::OkStatus();
                 }},
                {"finiteness scan (kernels::FirstNonFinite)",
                 [&] {
                   for (auto& x : g) {
                     if (kernels::FirstNonFinite(x.data(), x.size()) >= 0)
                       return absl::InternalError("non-finite");
                   }
                   return absl::OkStatus();
                 }},
                {"lr scale (kernels::ScaleInPlace)",
                 [&] {
                   for (auto& x : g)
                     kernels::ScaleInPlace(absl::MakeSpan(x), 1.0f);
                   return absl::OkStatus();
                 }},
                {"memcpy of the momentum (the step-start copy before)", [&] {
                   for (size_t i = 0; i < g.size(); ++i)
                     std::memcpy(copy[i].data(), m[i].data(), m[i].size() * 4);
                   return absl::OkStatus();
                 }}};
  // The passes in turn, one call each, --repeats times (after one warm-up
  // round): a slow spell of a noisy machine hits every pass alike, which
  // keeps the ratio honest.
  std::vector<std::vector<double>> samples(passes.size());
  const int repeats = absl::GetFlag(FLAGS_repeats);
  for (int round = -1; round < repeats; ++round) {
    for (size_t k = 0; k < passes.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      if (auto st = passes[k].second(); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", passes[k].first.c_str(),
                     std::string(st.message()).c_str());
        return 1;
      }
      const std::chrono::duration<double> dt =
          std::chrono::steady_clock::now() - t0;
      if (round >= 0) samples[k].push_back(dt.count());
    }
  }
  std::vector<Row> rows;
  for (size_t k = 0; k < passes.size(); ++k) {
    std::sort(samples[k].begin(), samples[k].end());
    Row r;
    r.shape = absl::StrCat(shapes.size(), " matrices, ", elements, " elements");
    r.method = passes[k].first;
    r.seconds = Median(samples[k]);
    r.samples = samples[k];
    rows.push_back(r);
  }
  std::printf("%-44s %10s\n", "pass (all matrices, one core)", "ms");
  for (const Row& r : rows) {
    std::printf("%-44s %10.2f\n", r.method.c_str(), r.seconds * 1e3);
  }
  std::printf("momentum: scalar / MomentumUpdate = %.2fx\n",
              rows[0].seconds / rows[1].seconds);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    if (auto st = WriteJson(path, "elementwise", CpuMachine(), command, rows);
        !st.ok()) {
      std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i)
    absl::StrAppend(&command, i ? " " : "", argv[i]);
  absl::ParseCommandLine(argc, argv);
  return dmuon::bench::Run(command);
}
