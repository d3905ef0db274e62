#include "server/shard_map.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dmuon::server {
namespace {

using kernels::Shape;

// The oracle: every local element's matrix index, by listing the runs'
// indices (the definition in shard_map.h), not through Blocks().
std::vector<int64_t> Indices(const std::vector<IndexRun>& runs) {
  std::vector<int64_t> v;
  for (const IndexRun& r : runs)
    for (int64_t i = r.begin; i < r.end; ++i) v.push_back(i);
  return v;
}

TEST(ShardMapTest, ScatterAndGatherFollowTheDefinitionOnRandomMaps) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const Shape shape{1 + static_cast<int64_t>(rng() % 17),
                      1 + static_cast<int64_t>(rng() % 13)};
    // Random disjoint runs in a random order: cut [0, n) at random points,
    // keep some pieces, shuffle.
    auto runs = [&](int64_t n) {
      std::vector<IndexRun> out;
      for (int64_t b = 0; b < n;) {
        const int64_t e = b + 1 + static_cast<int64_t>(rng() % n);
        if (rng() % 3) out.push_back({b, std::min(e, n)});
        b = e;
      }
      if (out.empty()) out.push_back({0, 1});
      std::shuffle(out.begin(), out.end(), rng);
      return out;
    };
    auto rows = runs(shape.rows), cols = runs(shape.cols);
    auto map = ShardMap::FromRuns(rows, cols, shape, "parameter 'w'");
    ASSERT_TRUE(map.ok()) << map.status();
    const auto ri = Indices(rows), ci = Indices(cols);
    ASSERT_EQ(map->local_rows(), static_cast<int64_t>(ri.size()));
    ASSERT_EQ(map->local_cols(), static_cast<int64_t>(ci.size()));
    std::vector<float> local(map->elements());
    for (float& x : local) x = static_cast<float>(rng() % 1000);
    std::vector<float> matrix(shape.elements(), -1.0f);
    ScatterToMatrix(*map, shape, local.data(), matrix.data());
    std::vector<float> want(shape.elements(), -1.0f);
    for (size_t i = 0; i < ri.size(); ++i)
      for (size_t j = 0; j < ci.size(); ++j)
        want[ri[i] * shape.cols + ci[j]] = local[i * ci.size() + j];
    ASSERT_EQ(matrix, want) << map->DebugString();
    std::vector<float> back(map->elements(), -2.0f);
    GatherFromMatrix(*map, shape, matrix.data(), back.data());
    ASSERT_EQ(back, local) << map->DebugString();
  }
}

TEST(ShardMapTest, RowsAndWholeAreContiguous) {
  const Shape shape{6, 4};
  EXPECT_TRUE(ShardMap::Whole(shape).Contiguous(shape));
  const ShardMap r = ShardMap::Rows(2, 5, 4);
  EXPECT_TRUE(r.Contiguous(shape));
  EXPECT_EQ(r.offset(shape), 8);
  EXPECT_EQ(r.elements(), 12);
  auto cols = ShardMap::FromRuns({{0, 6}}, {{0, 2}}, shape, "p");
  ASSERT_TRUE(cols.ok());
  EXPECT_FALSE(cols->Contiguous(shape));
}

TEST(ShardMapTest, BadRunsAreNamed) {
  const Shape shape{6, 4};
  auto err = [&](std::vector<IndexRun> r, std::vector<IndexRun> c) {
    auto m = ShardMap::FromRuns(r, c, shape, "parameter 'w'");
    EXPECT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(m.status().message());
  };
  EXPECT_NE(err({{0, 7}}, {{0, 4}}).find("row_runs[0] [0,7)"),
            std::string::npos);
  EXPECT_NE(err({{0, 6}}, {{2, 2}}).find("col_runs[0] [2,2)"),
            std::string::npos);
  EXPECT_NE(err({{0, 3}, {2, 4}}, {{0, 4}}).find("overlap"), std::string::npos);
  EXPECT_NE(err({{0, 3}}, {}).find("1 row_runs and 0 col_runs"),
            std::string::npos);
  std::vector<IndexRun> many;
  for (int i = 0; i <= kMaxRuns; ++i) many.push_back({i, i + 1});
  auto big = ShardMap::FromRuns(many, {{0, 1}}, {kMaxRuns + 1, 1}, "p");
  EXPECT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("over the limit"), std::string::npos);
  auto none = ShardMap::FromRuns({}, {}, shape, "p");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_TRUE(none->Blocks().empty());
}

// CheckCover on maps given by value (pointers to them), with a fresh budget.
absl::Status Cover(const std::vector<ShardMap>& maps, Shape shape,
                   int64_t* budget = nullptr) {
  std::vector<const ShardMap*> p;
  for (const ShardMap& m : maps) p.push_back(&m);
  int64_t fresh = kCoverBudget;
  return CheckCover(p, shape, "w", budget ? budget : &fresh);
}

TEST(ShardMapTest, CoverAcceptsReplicasAndEmptyRanksAndNamesAHole) {
  const Shape shape{5, 4};
  auto m = [&](std::vector<IndexRun> r, std::vector<IndexRun> c) {
    return *ShardMap::FromRuns(r, c, shape, "p");
  };
  // A 2x2 mesh (Shard(0), Shard(1)) with uneven rows.
  std::vector<ShardMap> grid{m({{0, 3}}, {{0, 2}}), m({{0, 3}}, {{2, 4}}),
                             m({{3, 5}}, {{0, 2}}), m({{3, 5}}, {{2, 4}})};
  EXPECT_TRUE(Cover(grid, shape).ok());
  // Replicas (HSDP) and a rank holding nothing.
  std::vector<ShardMap> hsdp{m({{0, 3}}, {{0, 4}}), m({{3, 5}}, {{0, 4}}),
                             m({{0, 3}}, {{0, 4}}), m({{3, 5}}, {{0, 4}}),
                             m({}, {})};
  EXPECT_TRUE(Cover(hsdp, shape).ok());
  // Strided rows: {0,1,4} and {2,3}.
  std::vector<ShardMap> strided{m({{0, 2}, {4, 5}}, {{0, 4}}),
                                m({{2, 4}}, {{0, 4}})};
  EXPECT_TRUE(Cover(strided, shape).ok());
  grid.pop_back();
  auto st = Cover(grid, shape);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("element (3,2) is held by no rank"),
            std::string::npos)
      << st;
  EXPECT_NE(st.message().find("rank 2: rows [3,5) x cols [0,2)"),
            std::string::npos)
      << st;
}

TEST(ShardMapTest, DistinctHoldersReadEachReplicatedMapOnceFromItsLowestRank) {
  const ShardMap a = ShardMap::Rows(0, 3, 4), b = ShardMap::Rows(3, 6, 4);
  const ShardMap none;
  const std::vector<const ShardMap*> maps{&none, &a, &b, &a, &b, &none};
  EXPECT_EQ(DistinctHolders(maps), (std::vector<int>{1, 2}));
}

TEST(ShardMapTest, CoverRefusesTooManyBlocksAndSharesItsBudget) {
  // 4096 row runs on each of 64 ranks: 2^18 blocks, the limit; one more
  // rank passes it.
  const Shape shape{4096, 2};
  std::vector<IndexRun> rows;
  for (int i = 0; i < 4096; ++i) rows.push_back({i, i + 1});
  const ShardMap fine = *ShardMap::FromRuns(rows, {{0, 2}}, shape, "p");
  std::vector<ShardMap> maps(64, fine);
  EXPECT_TRUE(Cover(maps, shape).ok());
  maps.push_back(fine);
  auto st = Cover(maps, shape);
  EXPECT_NE(st.message().find("over the limit of 262144"), std::string::npos)
      << st;
  // A checkerboard of single elements costs rows x cols cells: the budget
  // of one table is shared by its parameters.
  std::vector<IndexRun> cols;
  for (int i = 0; i < 2; ++i) cols.push_back({i, i + 1});
  const ShardMap cells = *ShardMap::FromRuns(rows, cols, shape, "p");
  int64_t budget = 3 * 4096 * 2;
  EXPECT_TRUE(Cover({cells}, shape, &budget).ok());
  EXPECT_EQ(budget, 2 * 4096 * 2);
  EXPECT_TRUE(Cover({cells}, shape, &budget).ok());
  EXPECT_TRUE(Cover({cells}, shape, &budget).ok());
  st = Cover({cells}, shape, &budget);
  EXPECT_NE(st.message().find("more than the table's cover checks may examine"),
            std::string::npos)
      << st;
  // A hole's message lists the first 8 ranks and the count.
  std::vector<ShardMap> many(20, ShardMap::Rows(0, 1, 2));
  st = Cover(many, shape);
  EXPECT_NE(st.message().find("rank 7: rows [0,1)"), std::string::npos) << st;
  EXPECT_EQ(st.message().find("rank 8:"), std::string::npos) << st;
  EXPECT_NE(st.message().find("(20 ranks)"), std::string::npos) << st;
  // A long run list shows its first runs and the count.
  EXPECT_NE(fine.DebugString().find("[3,4) ... (4096 runs)"), std::string::npos)
      << fine.DebugString();
}

}  // namespace
}  // namespace dmuon::server
