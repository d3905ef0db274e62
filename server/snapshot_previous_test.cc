// A job's previous snapshot (SnapshotStore::PreviousPathOf, UsePrevious):
// kept by each write of a later step, used only when asked for its step.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "server/snapshot_store.h"
#include "server/testing/temp_dir.h"

namespace dmuon::server {
namespace {

// A snapshot of `job` after `steps` with fresh random momentum (returned).
std::string Encode(const std::string& job, int64_t steps,
                   std::vector<float>* momentum,
                   const std::string& owner = "") {
  static std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> n;
  v1::StateHeader h;
  h.set_job_id(job);
  h.set_completed_steps(steps);
  h.set_owner(owner);
  auto* p = h.add_parameters();
  p->set_name("w");
  p->add_shape(3);
  p->add_shape(5);
  momentum->resize(15);
  for (float& x : *momentum) x = n(rng);
  return EncodeSnapshot(h, {momentum});
}

// The step and momentum of the file at `path` (read whole, CRC checked).
std::pair<int64_t, std::vector<float>> StepAt(const std::string& path) {
  auto f = SnapshotStore::Read(path);
  EXPECT_TRUE(f.ok()) << path << ": " << f.status();
  if (!f.ok()) return {-1, {}};
  return {f->head.header().completed_steps(), f->momentum[0]};
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

TEST(PreviousSnapshot, EachLaterStepKeepsTheOneBefore) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<std::vector<float>> m(4);
  ASSERT_TRUE(store.Write("j", 1, 1, Encode("j", 1, &m[1])).ok());
  EXPECT_FALSE(Exists(store.PreviousPathOf("j")));  // the job's first file
  ASSERT_TRUE(store.Write("j", 1, 2, Encode("j", 2, &m[2])).ok());
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{2}, m[2]));
  EXPECT_EQ(StepAt(store.PreviousPathOf("j")),
            std::make_pair(int64_t{1}, m[1]));
  ASSERT_TRUE(store.Write("j", 1, 3, Encode("j", 3, &m[3])).ok());
  EXPECT_EQ(StepAt(store.PreviousPathOf("j")),
            std::make_pair(int64_t{2}, m[2]));
  // The same step written again (an idle drop after a --snapshot-every
  // write) replaces the file, and the step before stays the previous one.
  std::vector<float> again;
  ASSERT_TRUE(store.Write("j", 1, 3, Encode("j", 3, &again)).ok());
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{3}, again));
  EXPECT_EQ(StepAt(store.PreviousPathOf("j")),
            std::make_pair(int64_t{2}, m[2]));
  // Scan lists the job once, by its snapshot.
  auto scan = store.Scan();
  ASSERT_TRUE(scan.ok()) << scan.status();
  ASSERT_EQ(scan->good.size(), 1u);
  EXPECT_EQ(scan->good[0].second, store.PathOf("j"));
}

TEST(PreviousSnapshot, UsePreviousRollsBackAndKeepsTheNewerFile) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<float> m4, m5, m6;
  ASSERT_TRUE(store.Write("j", 1, 4, Encode("j", 4, &m4)).ok());
  ASSERT_TRUE(store.Write("j", 1, 5, Encode("j", 5, &m5)).ok());
  auto kept = store.UsePrevious("j", 4, "");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(absl::StrContains(*kept, ".rolled-back-")) << *kept;
  EXPECT_EQ(StepAt(*kept), std::make_pair(int64_t{5}, m5));
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{4}, m4));
  EXPECT_FALSE(Exists(store.PreviousPathOf("j")));
  // The job's snapshots go on from step 4: step 5 again is written (a new
  // step 5, not refused as older than the rolled-back file).
  ASSERT_TRUE(store.Write("j", 2, 5, Encode("j", 5, &m6)).ok());
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{5}, m6));
  EXPECT_EQ(StepAt(store.PreviousPathOf("j")), std::make_pair(int64_t{4}, m4));
}

TEST(PreviousSnapshot, AStepNotHeldIsNotFoundAndChangesNothing) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<float> m1, m2;
  auto none = store.UsePrevious("j", 1, "");
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), "no previous"));
  ASSERT_TRUE(store.Write("j", 1, 1, Encode("j", 1, &m1)).ok());
  ASSERT_TRUE(store.Write("j", 1, 2, Encode("j", 2, &m2)).ok());
  auto other = store.UsePrevious("j", 7, "");
  EXPECT_TRUE(absl::IsNotFound(other.status())) << other.status();
  EXPECT_TRUE(absl::StrContains(other.status().message(), "holds step 1"))
      << other.status();
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{2}, m2));
  EXPECT_EQ(StepAt(store.PreviousPathOf("j")), std::make_pair(int64_t{1}, m1));
}

// The previous file is used only when it reads back whole and is the same
// owner's: a damaged one never replaces a good snapshot, and another
// principal's (a new job of the id) is never resumed.
TEST(PreviousSnapshot, ADamagedOrAnotherOwnersPreviousFileIsNotUsed) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<float> m1, m2;
  ASSERT_TRUE(store.Write("j", 1, 1, Encode("j", 1, &m1, "alice")).ok());
  ASSERT_TRUE(store.Write("j", 1, 2, Encode("j", 2, &m2, "alice")).ok());
  auto other = store.UsePrevious("j", 1, "bob");
  EXPECT_TRUE(absl::IsNotFound(other.status())) << other.status();
  EXPECT_TRUE(
      absl::StrContains(other.status().message(), "another job or owner"))
      << other.status();
  {  // one momentum byte of the previous file flipped
    std::fstream f(store.PreviousPathOf("j"),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-8, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-8, std::ios::end);
    f.put(static_cast<char>(c ^ 0x40));
  }
  auto damaged = store.UsePrevious("j", 1, "alice");
  EXPECT_TRUE(absl::IsNotFound(damaged.status())) << damaged.status();
  EXPECT_TRUE(absl::StrContains(damaged.status().message(), "checksum"))
      << damaged.status();
  EXPECT_EQ(StepAt(store.PathOf("j")), std::make_pair(int64_t{2}, m2));
}

// A job's snapshot moved aside (corrupt): the next run of the id starts
// from zero, and the old run's previous file goes at its first write.
TEST(PreviousSnapshot, ANewRunOfTheIdDropsTheOldRunsPreviousFile) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<float> m;
  ASSERT_TRUE(store.Write("j", 1, 9, Encode("j", 9, &m)).ok());
  ASSERT_TRUE(store.Write("j", 1, 10, Encode("j", 10, &m)).ok());
  ASSERT_TRUE(
      store.MoveAside(store.PathOf("j"), absl::DataLossError("test")).ok());
  ASSERT_TRUE(Exists(store.PreviousPathOf("j")));
  ASSERT_TRUE(store.Write("j", 2, 10, Encode("j", 10, &m)).ok());
  EXPECT_FALSE(Exists(store.PreviousPathOf("j")));
  EXPECT_FALSE(store.UsePrevious("j", 9, "").ok());
}

TEST(PreviousSnapshot, ReplaceAndRestoreDropThePreviousFile) {
  SnapshotStore store(testing::NewTempDir("prev"), nullptr);
  std::vector<float> m;
  ASSERT_TRUE(store.Write("a", 1, 1, Encode("a", 1, &m)).ok());
  ASSERT_TRUE(store.Write("a", 1, 2, Encode("a", 2, &m)).ok());
  ASSERT_TRUE(Exists(store.PreviousPathOf("a")));
  ASSERT_TRUE(store.Replace("a", 2).ok());
  EXPECT_FALSE(Exists(store.PreviousPathOf("a")));
  EXPECT_FALSE(store.UsePrevious("a", 1, "").ok());

  ASSERT_TRUE(store.Write("b", 1, 8, Encode("b", 8, &m)).ok());
  ASSERT_TRUE(store.Write("b", 1, 9, Encode("b", 9, &m)).ok());
  std::vector<float> restored;
  auto kept = store.Restore("b", 1, 3, [&]() -> absl::StatusOr<std::string> {
    return Encode("b", 3, &restored);
  });
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(StepAt(store.PathOf("b")), std::make_pair(int64_t{3}, restored));
  // Step 8 was of the rolled-back run: not a step to resume from.
  EXPECT_FALSE(Exists(store.PreviousPathOf("b")));
}

}  // namespace
}  // namespace dmuon::server
