// Several dmuond processes on loopback serving one multi-rank job as a pool:
// every rank plans the same split of the table, every update of every step
// is checked against the fp64 reference in the rank processes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "client/client.h"
#include "tests/muon_job.h"
#include "tests/process.h"

namespace dmuon::testing {
namespace {

// One daemon per entry of `executors` (its --cpu-executors), `world` rank
// processes checking every update against the fp64 reference.
void RunPool(const std::vector<int>& executors, int world,
             const std::string& transport) {
  const int daemons = static_cast<int>(executors.size());
  std::vector<std::unique_ptr<Daemon>> pool;
  std::string addresses;
  for (int d = 0; d < daemons; ++d) {
    pool.push_back(std::make_unique<Daemon>(std::vector<std::string>{
        "--cpu-executors=" + std::to_string(executors[d])}));
    ASSERT_NE(pool.back()->port(), 0);
    addresses += (d ? "," : "") + pool.back()->address();
  }
  const uint64_t seed = std::random_device{}();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::make_unique<Process>(std::vector<std::string>{
        Runfile("tests/rank_main"), "--server=" + addresses, "--job=pooled",
        "--rank=" + std::to_string(r), "--world=" + std::to_string(world),
        "--transport=" + transport, "--steps=10",
        "--seed=" + std::to_string(seed)}));
  }
  for (auto& p : ranks) EXPECT_EQ(p->Wait(240), 0) << "seed " << seed;
  // Each daemon served its share of the table (planned over its executors,
  // all healthy), and only that.
  SessionSpec spec;
  spec.params = TestTable(0, world);
  const std::vector<int> owner = Client::PlanPool(spec, executors);
  int total = 0;
  for (int d = 0; d < daemons; ++d) {
    int code;
    const std::string s = Ctl(pool[d]->address(), {"status", "--json"}, &code);
    ASSERT_EQ(code, 0) << s;
    const int mine =
        static_cast<int>(std::count(owner.begin(), owner.end(), d));
    total += mine;
    if (mine > 0) {
      EXPECT_NE(s.find("\"parameters\": " + std::to_string(mine)),
                std::string::npos)
          << s;
      EXPECT_NE(s.find("\"completedSteps\": \"10\""), std::string::npos) << s;
    }
  }
  EXPECT_EQ(total, static_cast<int>(spec.params.size()));
}

TEST(Pool, TwoDaemonsTwoRanksShm) { RunPool({1, 1}, 2, "shm"); }
TEST(Pool, ThreeDaemonsFourRanksInline) { RunPool({1, 1, 1}, 4, "inline"); }
// A 3-executor and a 1-executor daemon: the split follows the devices, and
// every update still matches the reference.
TEST(Pool, UnequalDaemonsTwoRanksShm) { RunPool({3, 1}, 2, "shm"); }

// `n` equal matrices (equal cost-model flops).
SessionSpec EqualTable(int n) {
  SessionSpec spec;
  for (int i = 0; i < n; ++i) {
    ParamSpec p;
    p.name = "w" + std::to_string(i);
    p.rows = p.cols = 32;
    spec.params.push_back(p);
  }
  return spec;
}

TEST(Pool, PlansOverTheDaemonsDevicesAsTheirStatusReportsThem) {
  Daemon big({"--cpu-executors=3"}), small({"--cpu-executors=1"});
  ASSERT_NE(big.port(), 0);
  ASSERT_NE(small.port(), 0);
  auto client = Client::ConnectPool({big.address(), small.address()});
  ASSERT_TRUE(client.ok()) << client.status();
  auto counts = (*client)->DeviceCounts();
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_EQ(*counts, (std::vector<int>{3, 1}));
  // Equal matrices: the first daemon's summed cost is within one matrix of
  // three times the second's (each of the 4 devices gets n/4, +-1).
  for (int n : {40, 41, 42, 43}) {
    const std::vector<int> owner = Client::PlanPool(EqualTable(n), *counts);
    const int on_big =
        static_cast<int>(std::count(owner.begin(), owner.end(), 0));
    const int on_small = n - on_big;
    EXPECT_LE(std::abs(on_big - 3 * on_small), 3) << n;
    EXPECT_GE(on_big, 3 * (n / 4)) << n;
  }

  // The pool session opens with that plan: each daemon's job holds its share.
  SessionSpec spec = EqualTable(41);
  spec.job_id = "unequal";
  spec.transport = TransportChoice::kInline;
  const std::vector<int> owner = Client::PlanPool(spec, *counts);
  auto s = (*client)->OpenSession(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  int code;
  const int on_big =
      static_cast<int>(std::count(owner.begin(), owner.end(), 0));
  std::string st = Ctl(big.address(), {"status", "--json"}, &code);
  EXPECT_NE(st.find("\"parameters\": " + std::to_string(on_big)),
            std::string::npos)
      << st;
  st = Ctl(small.address(), {"status", "--json"}, &code);
  EXPECT_NE(st.find("\"parameters\": " + std::to_string(41 - on_big)),
            std::string::npos)
      << st;
  EXPECT_TRUE((*s)->Close().ok());
}

TEST(Pool, PoolOwnerIsHonouredAndCheckedAsIs) {
  Daemon a, b;
  ASSERT_NE(a.port(), 0);
  ASSERT_NE(b.port(), 0);
  auto client = Client::ConnectPool({a.address(), b.address()});
  ASSERT_TRUE(client.ok()) << client.status();
  SessionSpec spec = EqualTable(5);
  spec.transport = TransportChoice::kInline;
  // Not what the planner would do (1 of 5 on daemon 0): used as is.
  spec.job_id = "owned";
  spec.pool_owner = {1, 1, 0, 1, 1};
  {
    auto s = (*client)->OpenSession(spec);
    ASSERT_TRUE(s.ok()) << s.status();
    int code;
    std::string st = Ctl(a.address(), {"status", "--json"}, &code);
    EXPECT_NE(st.find("\"parameters\": 1"), std::string::npos) << st;
    st = Ctl(b.address(), {"status", "--json"}, &code);
    EXPECT_NE(st.find("\"parameters\": 4"), std::string::npos) << st;
    // Parameter i is still parameter i: its gradient and update are its own.
    EXPECT_EQ((*s)->gradient(2).size(), 32u * 32u);
    EXPECT_TRUE((*s)->Close().ok());
  }
  spec.job_id = "bad-size";
  spec.pool_owner = {0, 1};
  auto s = (*client)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.status().message()).find("pool_owner has 2"),
            std::string::npos)
      << s.status();
  spec.job_id = "bad-index";
  spec.pool_owner = {0, 1, 0, 2, 1};
  s = (*client)->OpenSession(spec);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.status().message()).find("'w3'"), std::string::npos)
      << s.status();
}

TEST(Pool, PlanWithDeviceCountsIsPlanBestOverSlots) {
  SessionSpec spec;
  for (int i = 0; i < 23; ++i) {
    ParamSpec p;
    p.name = "p" + std::to_string(i);
    p.rows = 16 + 8 * (i % 5);
    p.cols = 24 + 16 * (i % 3);
    p.layer = i / 4;
    spec.params.push_back(p);
  }
  const std::vector<int> counts = {2, 3, 1};
  const std::vector<int> owner = Client::PlanPool(spec, counts);
  EXPECT_EQ(Client::PlanPool(spec, counts), owner);  // deterministic
  // Slots 0-1: daemon 0; 2-4: daemon 1; 5: daemon 2. The slot plan is the
  // one PlanPool makes over 6 daemons of one device.
  const std::vector<int> slots = Client::PlanPool(spec, 6);
  ASSERT_EQ(slots.size(), owner.size());
  const int daemon_of[] = {0, 0, 1, 1, 1, 2};
  for (size_t i = 0; i < owner.size(); ++i)
    EXPECT_EQ(owner[i], daemon_of[slots[i]]) << i;
  // One device each is the old overload.
  EXPECT_EQ(Client::PlanPool(spec, std::vector<int>{1, 1}),
            Client::PlanPool(spec, 2));
  EXPECT_EQ(Client::PlanPool(spec, std::vector<int>{1, 1, 1}),
            Client::PlanPool(spec, 3));
  // Counts below 1 count as 1.
  EXPECT_EQ(Client::PlanPool(spec, std::vector<int>{0, 1}),
            Client::PlanPool(spec, 2));
}

TEST(Pool, EveryProcessPlansTheSameSplit) {
  SessionSpec spec;
  spec.params = TestTable(0, 4);
  const auto a = Client::PlanPool(spec, 3);
  spec.params = TestTable(3, 4);  // another rank: other row ranges, same plan
  EXPECT_EQ(Client::PlanPool(spec, 3), a);
  // Every daemon gets work when there is enough of it.
  for (int d = 0; d < 3; ++d) EXPECT_NE(std::count(a.begin(), a.end(), d), 0);
}

TEST(Pool, PlanSpreadsEachLayerOverTheDaemons) {
  // Four blocks of three equal matrices on four daemons, listed by kind
  // (every q, then every k, then every v): by cost alone each block lands
  // on one daemon; with layers each block's three go to three daemons.
  SessionSpec spec;
  for (const char* kind : {"q", "k", "v"}) {
    for (int b = 0; b < 4; ++b) {
      ParamSpec p;
      p.name = "blocks." + std::to_string(b) + "." + kind;
      p.rows = p.cols = 32;
      p.layer = b;
      spec.params.push_back(p);
    }
  }
  auto daemons_of_block = [&](const std::vector<int>& owner, int b) {
    std::set<int> d;
    for (size_t i = 0; i < owner.size(); ++i)
      if (static_cast<int>(i) % 4 == b) d.insert(owner[i]);  // blocks.b.*
    return d.size();
  };
  const std::vector<int> owner = Client::PlanPool(spec, 4);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(daemons_of_block(owner, b), 3u) << b;
  EXPECT_EQ(Client::PlanPool(spec, 4), owner);
  for (ParamSpec& p : spec.params) p.layer = -1;
  EXPECT_EQ(daemons_of_block(Client::PlanPool(spec, 4), 0), 1u);
}

}  // namespace
}  // namespace dmuon::testing
