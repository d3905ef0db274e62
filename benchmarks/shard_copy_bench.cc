// ./dmuon bench shards: what dmuond's host path pays to gather a matrix's
// gradient from its ranks' local tensors and to return each rank its part
// of the update, per sharding layout (server/shard_map.h: the copies
// param_work.cc makes), against one plain memcpy of the matrix each way,
// measured alternately in one run. The layouts are those DTensor gives a
// GPT-2-sized matrix on 4 ranks.

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/bench_util.h"
#include "server/shard_map.h"

ABSL_FLAG(int, rows, 3072, "matrix rows");
ABSL_FLAG(int, cols, 768, "matrix columns");
ABSL_FLAG(int, reps, 31, "timed repetitions per layout (after a warm-up)");
ABSL_FLAG(int, rounds, 5, "alternating rounds (the median of their medians)");
ABSL_FLAG(std::string, out, "", "JSON results path");

namespace dmuon::bench {
namespace {

using server::IndexRun;
using server::ShardMap;

struct Layout {
  std::string name;
  std::vector<ShardMap> ranks;
};

std::vector<Layout> Layouts(kernels::Shape s) {
  auto map = [&](std::vector<IndexRun> r, std::vector<IndexRun> c) {
    return *ShardMap::FromRuns(r, c, s, "bench");
  };
  const int64_t r4 = s.rows / 4, r2 = s.rows / 2, c2 = s.cols / 2;
  std::vector<Layout> out;
  Layout rows{"Shard(0) on 4 ranks (rows)", {}};
  for (int k = 0; k < 4; ++k)
    rows.ranks.push_back(ShardMap::Rows(k * r4, (k + 1) * r4, s.cols));
  out.push_back(rows);
  out.push_back(
      {"(Shard(0), Shard(1)) on 2x2",
       {map({{0, r2}}, {{0, c2}}), map({{0, r2}}, {{c2, s.cols}}),
        map({{r2, s.rows}}, {{0, c2}}), map({{r2, s.rows}}, {{c2, s.cols}})}});
  Layout cols{"Shard(1) on 4 ranks (columns)", {}};
  for (int k = 0; k < 4; ++k)
    cols.ranks.push_back(
        map({{0, s.rows}}, {{k * s.cols / 4, (k + 1) * s.cols / 4}}));
  out.push_back(cols);
  Layout strided{"strided rows, 2 runs per rank", {}};
  const int64_t r8 = s.rows / 8;
  for (int k = 0; k < 4; ++k)
    strided.ranks.push_back(map(
        {{k * r8, (k + 1) * r8}, {(k + 4) * r8, (k + 5) * r8}}, {{0, s.cols}}));
  out.push_back(strided);
  out.push_back(
      {"(Replicate(), Shard(0)) on 2x2 (HSDP: updates to both replicas)",
       {ShardMap::Rows(0, r2, s.cols), ShardMap::Rows(r2, s.rows, s.cols),
        ShardMap::Rows(0, r2, s.cols), ShardMap::Rows(r2, s.rows, s.cols)}});
  return out;
}

int Main() {
  const kernels::Shape s{absl::GetFlag(FLAGS_rows), absl::GetFlag(FLAGS_cols)};
  const int reps = absl::GetFlag(FLAGS_reps);
  std::vector<float> whole(s.elements()), back(s.elements());
  FillRandom(1, absl::MakeSpan(whole));
  const std::vector<Layout> layouts = Layouts(s);
  // Each rank's local tensor, as a client would have written it.
  std::vector<std::vector<std::vector<float>>> local(layouts.size());
  for (size_t l = 0; l < layouts.size(); ++l) {
    for (const ShardMap& m : layouts[l].ranks) {
      local[l].emplace_back(m.elements());
      server::GatherFromMatrix(m, s, whole.data(), local[l].back().data());
    }
  }
  // One step's copies, as param_work.cc makes them: the gradient in from
  // each distinct map's lowest rank (highest first), every rank's update
  // out.
  auto step = [&](size_t l) {
    const auto& ranks = layouts[l].ranks;
    for (size_t k = ranks.size(); k-- > 0;) {
      if (std::find(ranks.begin(), ranks.begin() + k, ranks[k]) !=
          ranks.begin() + k) {
        continue;  // a lower rank's replica is read instead
      }
      server::ScatterToMatrix(ranks[k], s, local[l][k].data(), back.data());
    }
    for (size_t k = 0; k < ranks.size(); ++k)
      server::GatherFromMatrix(ranks[k], s, back.data(), local[l][k].data());
  };
  std::vector<float> spare(s.elements());
  auto memcpys = [&] {
    std::memcpy(back.data(), whole.data(), s.elements() * sizeof(float));
    std::memcpy(spare.data(), back.data(), s.elements() * sizeof(float));
  };
  auto time = [&](const std::function<void()>& fn) {
    fn();
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const absl::Time t0 = absl::Now();
      fn();
      t.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    std::sort(t.begin(), t.end());
    return Median(t);
  };
  std::vector<std::vector<double>> per(layouts.size() + 1);
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    per[0].push_back(time(memcpys));
    for (size_t l = 0; l < layouts.size(); ++l)
      per[l + 1].push_back(time([&] { step(l); }));
  }
  for (auto& v : per) std::sort(v.begin(), v.end());
  const double base = Median(per[0]);
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-60s %10s %8s\n", "layout", "us/step", "x memcpy");
  std::printf("%-60s %10.1f %8.2f\n", "memcpy of the matrix in and out",
              base * 1e6, 1.0);
  for (size_t l = 0; l < layouts.size(); ++l) {
    const double t = Median(per[l + 1]);
    int64_t rects = 0;
    for (const ShardMap& m : layouts[l].ranks) rects += m.Blocks().size();
    std::printf("%-60s %10.1f %8.2f\n", layouts[l].name.c_str(), t * 1e6,
                t / base);
    rows.push_back({{"layout", layouts[l].name},
                    {"rectangles", rects},
                    {"seconds", t},
                    {"ratio_to_memcpy", t / base},
                    {"round_medians", per[l + 1]}});
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    nlohmann::json j = {{"benchmark", "shard_copy"},
                        {"date", absl::FormatTime("%Y-%m-%d", absl::Now(),
                                                  absl::UTCTimeZone())},
                        {"machine", CpuMachine()},
                        {"command", "./dmuon bench shards"},
                        {"shape", absl::StrCat(s.rows, "x", s.cols)},
                        {"memcpy_seconds", base},
                        {"rows", rows}};
    std::ofstream(out) << j.dump(2) << "\n";
    std::printf("wrote %s\n", out.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return dmuon::bench::Main();
}
