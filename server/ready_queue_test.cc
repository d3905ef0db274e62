// ReadyQueue (ready_queue.h) against the rule it keeps, written the plain
// way as the oracle (sort the queue by forward order then arrival, take the
// first, then scan for SameBatchKey mates, earliest first): on fresh random
// pushes and pops of a few shapes, options that batch together or not and
// null ones, every pick the same entries in the same order.

#include "server/ready_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace dmuon::server {
namespace {

using Entry = ReadyQueue::Entry;

// The scheduler's rule before ReadyQueue, on a plain vector.
std::vector<Entry> OraclePop(std::vector<Entry>& q, int max_batch) {
  std::vector<Entry> picked;
  if (q.empty()) return picked;
  std::sort(q.begin(), q.end(), [](const Entry& a, const Entry& b) {
    return a.order != b.order ? a.order < b.order : a.seq < b.seq;
  });
  picked.push_back(q.front());
  q.erase(q.begin());
  ComputeTask x;
  x.shape = picked.front().shape;
  x.muon = picked.front().muon;
  for (auto it = q.begin();
       it != q.end() && static_cast<int>(picked.size()) < max_batch;) {
    ComputeTask y;
    y.shape = it->shape;
    y.muon = it->muon;
    if (SameBatchKey(x, y)) {
      picked.push_back(*it);
      it = q.erase(it);
    } else {
      ++it;
    }
  }
  return picked;
}

TEST(ReadyQueue, PicksWhatSortAndScanPick) {
  std::mt19937_64 rng(std::random_device{}());
  // Options: a and b batch together (equal values, two objects), c does
  // not (another eps), null never.
  MuonParams a, b, c;
  c.ns.eps = 2e-7;
  const MuonParams* options[] = {&a, &b, &c, nullptr};
  const kernels::Shape shapes[] = {{4, 8}, {8, 4}, {16, 16}};
  for (int round = 0; round < 300; ++round) {
    ReadyQueue q;
    std::vector<Entry> oracle;
    uint64_t seq = 0;
    const int max_batch = 1 + static_cast<int>(rng() % 6);
    for (int op = 0; op < 200; ++op) {
      if (rng() % 3 != 0) {  // push, sometimes many
        for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) {
          Entry e;
          e.order = static_cast<int32_t>(rng() % 12);
          e.seq = seq++;
          e.shape = shapes[rng() % 3];
          e.muon = options[rng() % 4];
          q.Push(e);
          oracle.push_back(e);
        }
      } else {
        const auto got = q.PopBatch(max_batch);
        const auto want = OraclePop(oracle, max_batch);
        ASSERT_EQ(got.size(), want.size()) << "round " << round;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i].seq, want[i].seq) << "round " << round;
          ASSERT_EQ(got[i].order, want[i].order);
        }
      }
      ASSERT_EQ(q.size(), oracle.size());
      ASSERT_EQ(q.empty(), oracle.empty());
    }
    while (!oracle.empty()) {  // drained alike
      const auto got = q.PopBatch(max_batch);
      const auto want = OraclePop(oracle, max_batch);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i].seq, want[i].seq);
    }
    EXPECT_TRUE(q.PopBatch(max_batch).empty());
  }
}

// A batch key outlives the options object of the entry that made it: once
// that entry is taken, the key is a queued member's.
TEST(ReadyQueue, AClassKeyNeverPointsAtATakenEntrysOptions) {
  ReadyQueue q;
  auto first = std::make_unique<MuonParams>();
  MuonParams second;
  Entry e;
  e.shape = {4, 4};
  e.order = 0;
  e.seq = 0;
  e.muon = first.get();
  q.Push(e);
  e.order = 1;
  e.seq = 1;
  e.muon = &second;
  q.Push(e);
  ASSERT_EQ(q.PopBatch(1).size(), 1u);
  first.reset();  // (ASan: a key left pointing here is a use after free)
  e.order = 2;
  e.seq = 2;
  q.Push(e);
  const auto got = q.PopBatch(4);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].seq, 1u);
  EXPECT_EQ(got[1].seq, 2u);
}

}  // namespace
}  // namespace dmuon::server
