#include "daemon/usable_cpus.h"

#include <sched.h>

#include <thread>

#include "gtest/gtest.h"

namespace dmuon {
namespace {

TEST(QuotaCores, V2) {
  EXPECT_EQ(QuotaCoresV2("max 100000\n"), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("100000 100000\n"), 1);
  EXPECT_EQ(QuotaCoresV2("150000 100000"), 2);  // 1.5 cores: rounded up
  EXPECT_EQ(QuotaCoresV2("50000 100000"), 1);   // half a core: at least 1
  EXPECT_EQ(QuotaCoresV2("800000 100000"), 8);
  EXPECT_EQ(QuotaCoresV2(""), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("garbage"), std::nullopt);
  EXPECT_EQ(QuotaCoresV2("100000 0"), std::nullopt);
}

TEST(QuotaCores, V1) {
  EXPECT_EQ(QuotaCoresV1("-1\n", "100000\n"), std::nullopt);
  EXPECT_EQ(QuotaCoresV1("250000\n", "100000\n"), 3);
  EXPECT_EQ(QuotaCoresV1("x", "100000"), std::nullopt);
}

// Pinned to one core, the process may use one core, however many the
// machine has (the defect: hardware_concurrency() counted them all).
TEST(UsableCpus, FollowsTheAffinityMask) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  const int before = UsableCpus();
  EXPECT_GE(before, 1);
  EXPECT_LE(before, CPU_COUNT(&saved));
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(UsableCpus(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(saved), &saved), 0);
  EXPECT_EQ(UsableCpus(), before);
}

}  // namespace
}  // namespace dmuon
