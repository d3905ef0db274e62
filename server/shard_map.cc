#include "server/shard_map.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace dmuon::server {
namespace {

int64_t Total(const std::vector<IndexRun>& runs) {
  int64_t n = 0;
  for (const IndexRun& r : runs) n += r.size();
  return n;
}

// Every run non-empty, inside [0, extent), none overlapping another.
absl::Status CheckRuns(const std::vector<IndexRun>& runs, int64_t extent,
                       const std::string& who, const char* field,
                       const char* unit) {
  if (runs.size() > static_cast<size_t>(kMaxRuns)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " ", field, " has ", runs.size(), " runs, over the limit of ",
        kMaxRuns, " (merge adjacent runs; a DTensor layout needs a few)"));
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const IndexRun& r = runs[i];
    if (r.begin < 0 || r.end > extent || r.begin >= r.end) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, " ", field, "[", i, "] [", r.begin, ",", r.end,
          ") is not a non-empty part of its ", extent, " ", unit, "s"));
    }
  }
  std::vector<IndexRun> sorted = runs;
  std::sort(
      sorted.begin(), sorted.end(),
      [](const IndexRun& a, const IndexRun& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].begin < sorted[i - 1].end) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, " ", field, " runs [", sorted[i - 1].begin, ",",
          sorted[i - 1].end, ") and [", sorted[i].begin, ",", sorted[i].end,
          ") overlap: a rank holds each ", unit, " at most once"));
    }
  }
  return absl::OkStatus();
}

std::string RunsString(const std::vector<IndexRun>& runs) {
  constexpr size_t kShown = 4;
  std::string s;
  for (size_t i = 0; i < runs.size() && i < kShown; ++i)
    absl::StrAppend(&s, i ? " " : "", "[", runs[i].begin, ",", runs[i].end,
                    ")");
  if (runs.size() > kShown)
    absl::StrAppend(&s, " ... (", runs.size(), " runs)");
  return s;
}

}  // namespace

ShardMap ShardMap::Whole(kernels::Shape shape) {
  return Rows(0, shape.rows, shape.cols);
}

ShardMap ShardMap::Rows(int64_t begin, int64_t end, int64_t cols) {
  ShardMap m;
  m.rows_ = {{begin, end}};
  m.cols_ = {{0, cols}};
  m.local_rows_ = end - begin;
  m.local_cols_ = cols;
  return m;
}

absl::StatusOr<ShardMap> ShardMap::FromRuns(std::vector<IndexRun> rows,
                                            std::vector<IndexRun> cols,
                                            kernels::Shape shape,
                                            const std::string& who) {
  if (rows.empty() != cols.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " is SHARDING_BLOCKS with ", rows.size(), " row_runs and ",
        cols.size(),
        " col_runs: send both (the rank's rows and columns) or neither (the "
        "rank holds nothing of it)"));
  }
  if (auto st = CheckRuns(rows, shape.rows, who, "row_runs", "row"); !st.ok()) {
    return st;
  }
  if (auto st = CheckRuns(cols, shape.cols, who, "col_runs", "column");
      !st.ok()) {
    return st;
  }
  if (static_cast<int64_t>(rows.size()) * static_cast<int64_t>(cols.size()) >
      kMaxBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, " has ", rows.size(), " row_runs x ", cols.size(), " col_runs = ",
        rows.size() * cols.size(), " blocks, over the limit of ", kMaxBlocks));
  }
  ShardMap m;
  m.local_rows_ = Total(rows);
  m.local_cols_ = Total(cols);
  m.rows_ = std::move(rows);
  m.cols_ = std::move(cols);
  return m;
}

bool ShardMap::Contiguous(kernels::Shape shape) const {
  return rows_.size() == 1 && cols_.size() == 1 && cols_[0].begin == 0 &&
         cols_[0].end == shape.cols;
}

std::vector<Block> ShardMap::Blocks() const {
  std::vector<Block> out;
  out.reserve(rows_.size() * cols_.size());
  int64_t lr = 0;
  for (const IndexRun& r : rows_) {
    int64_t lc = 0;
    for (const IndexRun& c : cols_) {
      out.push_back({lr, lc, r.begin, c.begin, r.size(), c.size()});
      lc += c.size();
    }
    lr += r.size();
  }
  return out;
}

std::string ShardMap::DebugString() const {
  if (rows_.empty()) return "nothing";
  return absl::StrCat("rows ", RunsString(rows_), " x cols ",
                      RunsString(cols_));
}

void ScatterToMatrix(const ShardMap& map, kernels::Shape shape,
                     const float* local, float* matrix) {
  const int64_t lc = map.local_cols();
  for (const Block& b : map.Blocks()) {
    for (int64_t i = 0; i < b.height; ++i) {
      std::memcpy(matrix + (b.row + i) * shape.cols + b.col,
                  local + (b.local_row + i) * lc + b.local_col,
                  b.width * sizeof(float));
    }
  }
}

void GatherFromMatrix(const ShardMap& map, kernels::Shape shape,
                      const float* matrix, float* local) {
  const int64_t lc = map.local_cols();
  for (const Block& b : map.Blocks()) {
    for (int64_t i = 0; i < b.height; ++i) {
      std::memcpy(local + (b.local_row + i) * lc + b.local_col,
                  matrix + (b.row + i) * shape.cols + b.col,
                  b.width * sizeof(float));
    }
  }
}

std::vector<int> DistinctHolders(absl::Span<const ShardMap* const> maps) {
  absl::flat_hash_set<ShardMap> seen;
  std::vector<int> out;
  for (size_t k = 0; k < maps.size(); ++k) {
    if (!maps[k]->empty() && seen.insert(*maps[k]).second)
      out.push_back(static_cast<int>(k));
  }
  return out;
}

absl::Status CheckCover(absl::Span<const ShardMap* const> maps,
                        kernels::Shape shape, const std::string& name,
                        int64_t* budget) {
  int64_t blocks = 0;
  for (const ShardMap* m : maps)
    blocks += static_cast<int64_t>(m->rows().size() * m->cols().size());
  if (blocks > kMaxMatrixBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", name, "' is held as ", blocks,
        " blocks (row runs x column runs) over its ranks, over the limit of ",
        kMaxMatrixBlocks, " (each is a copy per step): use fewer runs"));
  }
  // Compress both dimensions to the runs' boundaries, so the check costs
  // what the maps do, not what the matrix does, then count each cell's
  // holders with a 2-D difference array.
  std::vector<int64_t> rb{0, shape.rows}, cb{0, shape.cols};
  for (const ShardMap* m : maps) {
    for (const IndexRun& r : m->rows()) rb.insert(rb.end(), {r.begin, r.end});
    for (const IndexRun& c : m->cols()) cb.insert(cb.end(), {c.begin, c.end});
  }
  for (auto* v : {&rb, &cb}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const int64_t nr = static_cast<int64_t>(rb.size()) - 1;
  const int64_t nc = static_cast<int64_t>(cb.size()) - 1;
  if (nr * nc > *budget) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", name, "' is cut by its ranks' runs into ", nr, " x ", nc,
        " pieces, more than the table's cover checks may examine (",
        kCoverBudget, " in all): use fewer runs"));
  }
  *budget -= nr * nc;
  auto at = [](const std::vector<int64_t>& v, int64_t x) {
    return std::lower_bound(v.begin(), v.end(), x) - v.begin();
  };
  std::vector<int32_t> diff((nr + 1) * (nc + 1), 0);
  for (const ShardMap* m : maps) {
    for (const Block& b : m->Blocks()) {
      const int64_t r0 = at(rb, b.row), r1 = at(rb, b.row + b.height);
      const int64_t c0 = at(cb, b.col), c1 = at(cb, b.col + b.width);
      diff[r0 * (nc + 1) + c0] += 1;
      diff[r0 * (nc + 1) + c1] -= 1;
      diff[r1 * (nc + 1) + c0] -= 1;
      diff[r1 * (nc + 1) + c1] += 1;
    }
  }
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      int32_t& x = diff[i * (nc + 1) + j];
      if (i > 0) x += diff[(i - 1) * (nc + 1) + j];
      if (j > 0) x += diff[i * (nc + 1) + j - 1];
      if (i > 0 && j > 0) x -= diff[(i - 1) * (nc + 1) + j - 1];
    }
  }
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      if (diff[i * (nc + 1) + j] > 0) continue;
      constexpr size_t kShownRanks = 8;
      std::string held;
      for (size_t k = 0; k < maps.size() && k < kShownRanks; ++k)
        absl::StrAppend(&held, k ? "; " : "", "rank ", k, ": ",
                        maps[k]->DebugString());
      if (maps.size() > kShownRanks)
        absl::StrAppend(&held, "; ... (", maps.size(), " ranks)");
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", name, "' element (", rb[i], ",", cb[j],
                       ") is held by no rank (", held,
                       "): the ranks' SHARDING_BLOCKS runs must cover its ",
                       shape.rows, "x", shape.cols, " elements"));
    }
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
