#include "server/fallbacks.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dmuon::server {
namespace {

using Logged = std::vector<std::pair<std::string, std::string>>;

FallbackCounter::Log Recorder(Logged* out) {
  return [out](std::string_view kind, const std::string& reason) {
    out->emplace_back(std::string(kind), reason);
  };
}

TEST(FallbackCounter, ListsEveryKindAtZero) {
  FallbackCounter c;
  const auto counts = c.Counts();
  ASSERT_EQ(counts.size(), DaemonFallbackKinds().size());
  for (const std::string& k : DaemonFallbackKinds())
    EXPECT_EQ(counts.at(k), 0u);
  EXPECT_EQ(counts.count("graph_eager"), 1u);
  EXPECT_EQ(counts.count("unhealthy_executor"), 1u);
  EXPECT_EQ(counts.count("rewind"), 1u);
}

// Random kinds and counts from threads at once: every one counted, each
// kind logged once, with the reason of its first occurrence.
TEST(FallbackCounter, CountsEveryTakeAndLogsEachKindOnce) {
  Logged logged;
  FallbackCounter c(false, Recorder(&logged));
  std::mt19937 rng(std::random_device{}());
  const std::vector<std::string>& kinds = DaemonFallbackKinds();
  std::vector<std::vector<int>> plan(4);
  std::map<std::string, uint64_t> expect;
  for (auto& p : plan) {
    const int n = std::uniform_int_distribution<int>(1, 200)(rng);
    for (int i = 0; i < n; ++i) {
      const int k = std::uniform_int_distribution<int>(0, 2)(rng);
      p.push_back(k);
      ++expect[kinds[k]];
    }
  }
  std::vector<std::thread> threads;
  for (const auto& p : plan)
    threads.emplace_back([&c, &p, &kinds] {
      for (int k : p) {
        if (kinds[k] == kFallbackRewind) {
          c.Add(kinds[k], "why " + kinds[k]);
        } else {
          ASSERT_TRUE(c.Take(kinds[k], "why " + kinds[k], "fix").ok());
        }
      }
    });
  for (auto& t : threads) t.join();
  const auto counts = c.Counts();
  for (const std::string& k : kinds) EXPECT_EQ(counts.at(k), expect[k]) << k;
  EXPECT_EQ(logged.size(), expect.size());
  std::set<std::string> seen;
  for (const auto& [kind, reason] : logged) {
    EXPECT_TRUE(seen.insert(kind).second) << kind << " logged twice";
    EXPECT_EQ(reason, "why " + kind);
  }
}

TEST(FallbackCounter, StrictRefusesNamingKindReasonAndRemedy) {
  Logged logged;
  FallbackCounter c(true, Recorder(&logged));
  EXPECT_TRUE(c.strict());
  const absl::Status st =
      c.Take(kFallbackUnhealthyExecutor, "executor cuda:1 is unhealthy",
             "replace the device");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  for (const char* part :
       {"--strict", "'unhealthy_executor'", "executor cuda:1 is unhealthy",
        "replace the device"})
    EXPECT_NE(st.message().find(part), std::string::npos) << st;
  EXPECT_EQ(c.Counts().at("unhealthy_executor"), 0u);
  EXPECT_TRUE(logged.empty());
  // What strict never refuses is still counted and logged.
  c.Add(kFallbackRewind, "job 'j' step 3");
  EXPECT_EQ(c.Counts().at("rewind"), 1u);
  ASSERT_EQ(logged.size(), 1u);
}

}  // namespace
}  // namespace dmuon::server
