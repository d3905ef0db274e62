#include "server/mark_store.h"

#include <random>

#include "gtest/gtest.h"

namespace dmuon::server {
namespace {

// A mark of `step` holding `floats` random floats in one parameter.
Mark MarkOf(int64_t step, size_t floats, std::mt19937* rng) {
  Mark m;
  m.header.set_completed_steps(step);
  std::uniform_real_distribution<float> u(-1, 1);
  m.momentum.emplace_back(floats);
  for (float& x : m.momentum[0]) x = u(*rng);
  m.path = "p" + std::to_string(step);
  return m;
}

std::vector<int64_t> Steps(const std::vector<Mark>& marks) {
  std::vector<int64_t> out;
  for (const Mark& m : marks) out.push_back(m.header.completed_steps());
  return out;
}

TEST(MarkStore, KeepsACopyAndASecondAddOfTheStepReplacesIt) {
  std::mt19937 rng(1);
  MarkStore store(4, 1 << 20);
  Mark m = MarkOf(5, 100, &rng);
  auto a = store.Add("j", m);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->existed);
  EXPECT_EQ(a->list.steps, std::vector<int64_t>{5});
  EXPECT_EQ(a->list.bytes, 400u);
  ASSERT_TRUE(store.Add("j", MarkOf(7, 100, &rng)).ok());
  // Another momentum for step 5 (a trainer resumed at an earlier mark and
  // reached 5 again): it replaces the first and becomes the newest. Its
  // file is the same path: nothing to remove.
  Mark other = MarkOf(5, 100, &rng);
  const std::vector<float> want = other.momentum[0];
  auto b = store.Add("j", other);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->existed);
  EXPECT_TRUE(b->dropped.empty());
  EXPECT_EQ(b->list.steps, (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(b->list.bytes, 800u);
  EXPECT_EQ(store.total_bytes(), 800u);
  auto got = store.Get("j", 5);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->momentum[0], want);
  // A replacement whose file could not be written (no path): the old file
  // is returned for removal, so a restart cannot find the abandoned run's.
  Mark unwritten = MarkOf(5, 100, &rng);
  unwritten.path.clear();
  auto c = store.Add("j", unwritten);
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->dropped.size(), 1u);
  EXPECT_EQ(c->dropped[0].path, "p5");
  EXPECT_FALSE(store.Get("j", 6).has_value());
  EXPECT_FALSE(store.Has("k", 5));
}

TEST(MarkStore, DropsTheJobsOldestPastItsCount) {
  std::mt19937 rng(2);
  MarkStore store(3, 1 << 20);
  for (int64_t s : {7, 3, 9})
    ASSERT_TRUE(store.Add("j", MarkOf(s, 4, &rng)).ok());
  ASSERT_TRUE(store.Add("k", MarkOf(1, 4, &rng)).ok());
  auto a = store.Add("j", MarkOf(11, 4, &rng));
  ASSERT_TRUE(a.ok());
  // Oldest added first (7), not the smallest step (3); k untouched.
  EXPECT_EQ(Steps(a->dropped), std::vector<int64_t>{7});
  EXPECT_EQ(a->dropped[0].path, "p7");
  EXPECT_EQ(a->list.steps, (std::vector<int64_t>{3, 9, 11}));
  EXPECT_EQ(store.List("k").steps, std::vector<int64_t>{1});
}

TEST(MarkStore, FreesTheOldestDaemonWideToFitTheBudget) {
  std::mt19937 rng(3);
  MarkStore store(8, 1000);  // 250 floats
  Mark a1 = MarkOf(1, 100, &rng);
  a1.path.clear();  // no file (no --state-dir, or its write failed)
  ASSERT_TRUE(store.Add("a", a1).ok());
  ASSERT_TRUE(store.Add("b", MarkOf(1, 100, &rng)).ok());  // with a file
  ASSERT_TRUE(store.Add("a", MarkOf(2, 40, &rng)).ok());
  EXPECT_EQ(store.total_bytes(), 960u);
  // 480 bytes: a@1 (oldest) and b@1 must leave memory; a@2 stays. a@1 has
  // no file: dropped. b@1 has one: kept on disk only (0 bytes), listed.
  auto c = store.Add("c", MarkOf(1, 120, &rng));
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->dropped.size(), 1u);
  EXPECT_EQ(c->dropped[0].header.completed_steps(), 1);
  EXPECT_EQ(store.List("a").steps, std::vector<int64_t>{2});
  EXPECT_EQ(store.List("b").steps, std::vector<int64_t>{1});
  EXPECT_EQ(store.List("b").bytes, 0u);
  auto b1 = store.Get("b", 1);
  ASSERT_TRUE(b1.has_value());
  EXPECT_TRUE(b1->momentum.empty());
  EXPECT_EQ(b1->path, "p1");
  EXPECT_EQ(store.total_bytes(), 640u);
}

TEST(MarkStore, AMarkLargerThanTheBudgetIsRefusedNamingTheFlag) {
  std::mt19937 rng(4);
  MarkStore store(8, 1000);
  ASSERT_TRUE(store.Add("a", MarkOf(1, 100, &rng)).ok());
  auto big = store.Add("a", MarkOf(2, 251, &rng));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("--mark-bytes=1000"),
            std::string::npos);
  EXPECT_NE(big.status().message().find("1004 bytes"), std::string::npos);
  // Nothing was dropped for it.
  EXPECT_EQ(store.List("a").steps, std::vector<int64_t>{1});
}

TEST(MarkStore, MarksOnDiskCountButHoldNoBytesAndDropJobReturnsAll) {
  std::mt19937 rng(5);
  MarkStore store(2, 1000);
  Mark disk = MarkOf(4, 100, &rng);
  EXPECT_TRUE(store.AddOnDisk("a", disk).empty());
  EXPECT_EQ(store.List("a").bytes, 0u);
  EXPECT_TRUE(store.Get("a", 4)->momentum.empty());
  EXPECT_EQ(store.Get("a", 4)->path, "p4");
  ASSERT_TRUE(store.Add("a", MarkOf(6, 100, &rng)).ok());
  auto third = store.Add("a", MarkOf(8, 100, &rng));
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(Steps(third->dropped), std::vector<int64_t>{4});
  auto all = store.DropJob("a");
  EXPECT_EQ(all.size(), 2u);
  EXPECT_TRUE(store.All().empty());
  EXPECT_EQ(store.total_bytes(), 0u);
}

}  // namespace
}  // namespace dmuon::server
