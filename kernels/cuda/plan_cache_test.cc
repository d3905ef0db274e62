// The plan cache's policy (plan_cache.h): eviction by bytes, least recently
// used first, never a plan an open job uses; the cap exceeded only when
// everything else is in use; releasing a job frees the plans no other job
// uses. Scripted cases, then random operations checked against a model the
// test keeps itself (sizes, recency, owners).

#include "kernels/cuda/plan_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace dmuon::kernels::cuda {
namespace {

using Keys = std::vector<std::string>;
const std::vector<uint64_t> kNone;

// MakeRoom then Insert, as the Context creates a plan; the evicted keys.
Keys Add(PlanCache& c, const std::string& key, uint64_t bytes,
         const std::vector<uint64_t>& owners) {
  Keys evicted = c.MakeRoom(bytes);
  c.Insert(key, bytes, owners);
  return evicted;
}

TEST(PlanCache, EvictsTheLeastRecentlyUsedBytesFirst) {
  PlanCache c(100);
  EXPECT_TRUE(Add(c, "a", 30, kNone).empty());
  EXPECT_TRUE(Add(c, "b", 30, kNone).empty());
  EXPECT_TRUE(Add(c, "c", 30, kNone).empty());
  EXPECT_EQ(c.bytes(), 90u);
  EXPECT_TRUE(c.Use("a", kNone));  // b is now the least recently used
  EXPECT_FALSE(c.Use("zz", kNone));
  EXPECT_EQ(Add(c, "d", 10, kNone), Keys{}) << "100 bytes fit a 100 cap";
  EXPECT_EQ(Add(c, "e", 50, kNone), (Keys{"b", "c"}));
  EXPECT_EQ(c.bytes(), 90u);
  EXPECT_TRUE(c.Contains("a") && c.Contains("d") && c.Contains("e"));
  EXPECT_EQ(c.freed(), 2u);
  EXPECT_EQ(c.over_cap(), 0u);
  // A plan larger than the cap: everything outside use goes, it stays.
  EXPECT_EQ(Add(c, "huge", 150, kNone), (Keys{"a", "d", "e"}));
  EXPECT_EQ(c.bytes(), 150u);
  EXPECT_EQ(c.over_cap(), 1u);
  EXPECT_EQ(Add(c, "f", 10, kNone), Keys{"huge"});
}

TEST(PlanCache, PlansInUseAreNeverEvictedAndTheCapGivesWayToThem) {
  PlanCache c(100);
  Add(c, "job1", 40, {1});
  Add(c, "free", 40, kNone);
  EXPECT_TRUE(c.InUse("job1"));
  EXPECT_FALSE(c.InUse("free"));
  // job1's plan is the least recently used, but in use.
  EXPECT_EQ(Add(c, "job2", 50, {2}), Keys{"free"});
  EXPECT_EQ(c.bytes(), 90u);
  // Everything is in use: the new plan goes over the cap, counted.
  EXPECT_EQ(Add(c, "job3", 70, {3}), Keys{});
  EXPECT_EQ(c.bytes(), 160u);
  EXPECT_EQ(c.over_cap(), 1u);
  // When job3 closes its plan is freed, and the cache is within the cap.
  EXPECT_EQ(c.Release(3), Keys{"job3"});
  EXPECT_EQ(c.bytes(), 90u);
}

TEST(PlanCache, ReleasingAJobFreesThePlansNoOtherJobUses) {
  PlanCache c(1000);
  Add(c, "shared", 10, {1, 2});
  Add(c, "only1", 20, {1});
  Add(c, "untagged", 30, kNone);
  Add(c, "only2", 40, {2});
  EXPECT_TRUE(c.Use("untagged", {1}));  // now job 1 uses it too
  Add(c, "other1", 50, {1});
  EXPECT_EQ(c.Release(1), (Keys{"only1", "untagged", "other1"}));
  EXPECT_EQ(c.bytes(), 50u);
  EXPECT_TRUE(c.InUse("shared"));
  EXPECT_EQ(c.Release(1), Keys{}) << "released twice";
  EXPECT_EQ(c.Release(7), Keys{}) << "a job without plans";
  EXPECT_EQ(c.Release(2), (Keys{"shared", "only2"}));
  EXPECT_EQ(c.bytes(), 0u);
  EXPECT_EQ(c.size(), 0u);
  // A plan used with no owner stays until evicted.
  Add(c, "tool", 10, kNone);
  EXPECT_EQ(c.Release(0), Keys{});
  EXPECT_TRUE(c.Contains("tool"));
}

// Random plans, uses and releases against the test's own model.
TEST(PlanCache, RandomOperationsKeepThePolicy) {
  struct Model {
    uint64_t bytes = 0;
    uint64_t last_use = 0;
    std::set<uint64_t> owners;
  };
  for (uint64_t cap : {0u, 100u, 1000u}) {
    PlanCache c(cap);
    std::map<std::string, Model> model;
    uint64_t clock = 0;
    std::mt19937 rng(static_cast<uint32_t>(cap) + 3);
    auto owners_of = [&] {
      std::vector<uint64_t> o;
      const int n = rng() % 3;  // 0: no owner
      for (int i = 0; i < n; ++i) o.push_back(1 + rng() % 5);
      return o;
    };
    auto sum = [&] {
      uint64_t s = 0;
      for (const auto& [k, m] : model) s += m.bytes;
      return s;
    };
    for (int step = 0; step < 3000; ++step) {
      SCOPED_TRACE("cap " + std::to_string(cap) + " step " +
                   std::to_string(step));
      const std::string key = "p" + std::to_string(rng() % 40);
      const int op = rng() % 10;
      if (op < 2) {  // a job closes
        const uint64_t job = 1 + rng() % 5;
        Keys want;
        std::map<uint64_t, std::string> gone;
        for (auto& [k, m] : model) {
          if (m.owners.erase(job) && m.owners.empty()) gone[m.last_use] = k;
        }
        for (const auto& [use, k] : gone) {
          want.push_back(k);
          model.erase(k);
        }
        ASSERT_EQ(c.Release(job), want);
      } else if (model.count(key)) {  // a cached plan is used
        const std::vector<uint64_t> o = owners_of();
        ASSERT_TRUE(c.Use(key, o));
        model[key].last_use = ++clock;
        model[key].owners.insert(o.begin(), o.end());
      } else {  // a new plan
        const uint64_t bytes = rng() % 120;
        const std::vector<uint64_t> o = owners_of();
        const Keys evicted = c.MakeRoom(bytes);
        uint64_t newest_evicted = 0, last_evicted_bytes = 0;
        for (const std::string& k : evicted) {
          ASSERT_TRUE(model.count(k)) << k;
          ASSERT_TRUE(model[k].owners.empty()) << k << " is in use";
          newest_evicted = std::max(newest_evicted, model[k].last_use);
          last_evicted_bytes = model[k].bytes;
          model.erase(k);
        }
        // Least recently used first: every survivor outside use is newer.
        for (const auto& [k, m] : model) {
          if (m.owners.empty()) {
            ASSERT_GT(m.last_use, newest_evicted) << k;
          }
        }
        // No more than needed: before the last eviction it did not fit.
        if (!evicted.empty()) {
          ASSERT_GT(sum() + last_evicted_bytes + bytes, cap);
        }
        c.Insert(key, bytes, o);
        model[key] = {bytes, ++clock, std::set<uint64_t>(o.begin(), o.end())};
        // Over the cap only when everything else is in use.
        if (c.bytes() > cap) {
          for (const auto& [k, m] : model) {
            if (k != key) {
              ASSERT_FALSE(m.owners.empty()) << k;
            }
          }
        }
      }
      ASSERT_EQ(c.bytes(), sum());
      ASSERT_EQ(c.size(), model.size());
      for (const auto& [k, m] : model) {
        ASSERT_EQ(c.InUse(k), !m.owners.empty()) << k;
      }
    }
  }
}

}  // namespace
}  // namespace dmuon::kernels::cuda
