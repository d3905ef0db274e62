#include "server/read_budget.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

namespace dmuon::server {
namespace {

TEST(ReadBudget, GrantsWhatIsFreeBetweenMinAndWant) {
  ReadBudget b(100);
  auto a = b.Acquire(10, 60, absl::ZeroDuration());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bytes(), 60u);
  auto c = b.Acquire(10, 60, absl::ZeroDuration());  // 40 free: a smaller one
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bytes(), 40u);
  EXPECT_EQ(b.leased(), 100u);
  EXPECT_EQ(b.leases(), 2);
}

TEST(ReadBudget, RefusesWhenFullAndNamesTheFlag) {
  ReadBudget b(100);
  auto a = b.Acquire(100, 100, absl::ZeroDuration());
  ASSERT_TRUE(a.ok());
  auto c = b.Acquire(1, 10, absl::Milliseconds(20));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max-state-read-bytes=100"),
            std::string::npos)
      << c.status();
  a->Release();
  EXPECT_EQ(b.leased(), 0u);
  EXPECT_TRUE(b.Acquire(1, 10, absl::ZeroDuration()).ok());
}

TEST(ReadBudget, AWaiterGetsTheBytesGivenBack) {
  ReadBudget b(100);
  auto a = b.Acquire(100, 100, absl::ZeroDuration());
  ASSERT_TRUE(a.ok());
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    *a = ReadBudget::Lease();  // moved over: given back
  });
  auto c = b.Acquire(30, 30, absl::Seconds(30));
  t.join();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bytes(), 30u);
  EXPECT_EQ(b.leased(), 30u);
}

TEST(ReadBudget, OneRequestLargerThanTheCapacityProgressesAlone) {
  ReadBudget b(100);
  auto big = b.Acquire(250, 250, absl::ZeroDuration());
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->bytes(), 250u);
  EXPECT_FALSE(b.Acquire(1, 1, absl::ZeroDuration()).ok());
  big->Release();
  EXPECT_EQ(b.leased(), 0u);
}

TEST(ReadBudget, ConcurrentReadersNeverHoldMoreThanTheCapacity) {
  constexpr uint64_t kCapacity = 1000;
  ReadBudget b(kCapacity);
  std::atomic<uint64_t> held{0}, most{0};
  std::atomic<int> granted{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 8; ++r) {
    readers.emplace_back([&, r] {
      std::mt19937 rng(r);
      for (int i = 0; i < 300; ++i) {
        const uint64_t min = 1 + rng() % 200;
        auto l = b.Acquire(min, min + rng() % 400, absl::Seconds(30));
        ASSERT_TRUE(l.ok()) << l.status();
        ASSERT_GE(l->bytes(), min);
        const uint64_t now = held += l->bytes();
        uint64_t m = most.load();
        while (now > m && !most.compare_exchange_weak(m, now)) {
        }
        held -= l->bytes();
        ++granted;
      }
    });
  }
  for (auto& t : readers) t.join();
  EXPECT_EQ(granted.load(), 8 * 300);
  EXPECT_LE(most.load(), kCapacity);
  EXPECT_EQ(b.leased(), 0u);
  EXPECT_EQ(b.leases(), 0);
}

}  // namespace
}  // namespace dmuon::server
