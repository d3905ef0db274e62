// Several dmuond processes on loopback serving one multi-rank job as a pool:
// every rank plans the same split of the table, every update of every step
// is checked against the fp64 reference in the rank processes.

#include <gtest/gtest.h>

#include <algorithm>
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

void RunPool(int daemons, int world, const std::string& transport) {
  std::vector<std::unique_ptr<Daemon>> pool;
  std::string addresses;
  for (int d = 0; d < daemons; ++d) {
    pool.push_back(std::make_unique<Daemon>());
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
  // Each daemon served its share of the table, and only that.
  SessionSpec spec;
  spec.params = TestTable(0, world);
  const std::vector<int> owner = Client::PlanPool(spec, daemons);
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

TEST(Pool, TwoDaemonsTwoRanksShm) { RunPool(2, 2, "shm"); }
TEST(Pool, ThreeDaemonsFourRanksInline) { RunPool(3, 4, "inline"); }

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
