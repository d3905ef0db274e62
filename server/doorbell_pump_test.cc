// The doorbell's declare side as Step messages (doorbell_pump.h): what
// changed since the last look, on fresh random words, in the order the
// service must see it; and the pump on a real segment, fed by a client
// view of it, ending with DATA_LOSS when the client cuts the doorbell off.

#include "server/doorbell_pump.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "transport/transport.h"

namespace dmuon::server {
namespace {

using transport::DecodeWord;
using transport::DoorbellWord;
using transport::EncodeWord;

uint64_t Word(uint32_t serial, int64_t step, bool momentum, bool absent) {
  return EncodeWord(DoorbellWord{serial, step, momentum, absent});
}

TEST(NewDeclarations, NothingNewIsNothing) {
  transport::Doorbell::Declarations now;
  now.words.assign(4, 0);
  now.momentum.assign(4, 0);
  DeclarationsSeen seen(4);
  EXPECT_TRUE(NewDeclarations(now, &seen).empty());
}

// Random declarations of one or two steps, each parameter plain, with a
// momentum or absent, maybe a rewind: every changed word appears exactly
// once, in the message of its step and kind, rewind first, steps ascending;
// a second look finds nothing; a word written again (new serial) is new.
TEST(NewDeclarations, EveryChangedWordOnceInItsPlace) {
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 200; ++round) {
    const int n = 1 + static_cast<int>(rng() % 40);
    transport::Doorbell::Declarations now;
    now.words.assign(n, 0);
    now.momentum.assign(n, 0);
    DeclarationsSeen seen(n);
    uint32_t serial = 0;
    const int64_t step = 1 + static_cast<int64_t>(rng() % 1000);
    const bool rewind = rng() % 2;
    if (rewind) now.rewind = Word(++serial, step, false, false);
    std::map<int, std::pair<int64_t, int>> want;  // id -> step, kind
    for (int i = 0; i < n; ++i) {
      if (rng() % 3 == 0) continue;  // not declared
      const int64_t s = step + static_cast<int64_t>(rng() % 2);
      const int kind = static_cast<int>(rng() % 3);  // plain, momentum, absent
      now.words[i] = Word(++serial, s, kind == 1, kind == 2);
      now.momentum[i] = kind == 1 ? 0.5 + 0.001 * i : 0;
      want[i] = {s, kind};
    }
    const auto msgs = NewDeclarations(now, &seen);
    size_t k = 0;
    if (rewind) {
      ASSERT_FALSE(msgs.empty());
      ASSERT_TRUE(msgs[0].has_rewind());
      EXPECT_EQ(msgs[0].rewind().step(), step);
      k = 1;
    }
    std::map<int, std::pair<int64_t, int>> got;
    int64_t last_step = 0;
    for (; k < msgs.size(); ++k) {
      ASSERT_TRUE(msgs[k].has_gradients_ready());
      const auto& g = msgs[k].gradients_ready();
      EXPECT_GE(g.step(), last_step) << "steps ascending";
      last_step = g.step();
      const bool with_momentum = g.momentum_size() > 0;
      if (with_momentum) {
        ASSERT_EQ(g.momentum_size(), g.param_ids_size());
        EXPECT_EQ(g.absent_param_ids_size(), 0);
      }
      for (int j = 0; j < g.param_ids_size(); ++j) {
        const int id = g.param_ids(j);
        EXPECT_EQ(got.count(id), 0u) << "twice: " << id;
        got[id] = {g.step(), with_momentum ? 1 : 0};
        if (with_momentum) {
          EXPECT_EQ(g.momentum(j), now.momentum[id]);
        }
      }
      for (int id : g.absent_param_ids()) {
        EXPECT_EQ(got.count(id), 0u) << "twice: " << id;
        got[id] = {g.step(), 2};
      }
    }
    EXPECT_EQ(got, want);
    EXPECT_TRUE(NewDeclarations(now, &seen).empty());
    // The same step declared again (after a rewind): new serials, new.
    if (!want.empty()) {
      const int id = want.begin()->first;
      now.words[id] = Word(++serial, want.begin()->second.first, false, false);
      const auto again = NewDeclarations(now, &seen);
      ASSERT_EQ(again.size(), 1u);
      ASSERT_EQ(again[0].gradients_ready().param_ids_size(), 1);
      EXPECT_EQ(again[0].gradients_ready().param_ids(0), id);
    }
  }
}

// What a pump posted, for a test to wait on.
class Posted {
 public:
  void Add(absl::StatusOr<v1::StepRequest> m) {
    absl::MutexLock l(&mu_);
    got_.push_back(std::move(m));
  }
  // Waits (up to 30 s) for `count` posts; returns them.
  std::vector<absl::StatusOr<v1::StepRequest>> Wait(size_t count) {
    absl::MutexLock l(&mu_);
    auto enough = [&] {
      mu_.AssertHeld();
      return got_.size() >= count;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return got_;
  }

 private:
  absl::Mutex mu_;
  std::vector<absl::StatusOr<v1::StepRequest>> got_ ABSL_GUARDED_BY(mu_);
};

TEST(DoorbellPump, PostsWhatTheClientRangThenTheCutOff) {
  constexpr int kParams = 3;
  auto r = transport::CreateShmRegion(4096, kParams);
  ASSERT_TRUE(r.ok()) << r.status();
  auto bell = (*r)->doorbell();
  auto client = transport::OpenShmRegion(
      (*r)->name(), bell->offset() + transport::DoorbellBytes(kParams));
  ASSERT_TRUE(client.ok()) << client.status();
  transport::DoorbellView v((*client)->bytes().data() + bell->offset(),
                            kParams);
  Posted posted;
  {
    DoorbellPump pump(bell, [&](absl::StatusOr<v1::StepRequest> m) {
      posted.Add(std::move(m));
    });
    v.Declare(2, Word(1, 1, false, false));
    v.Declare(0, Word(2, 1, false, false));
    v.Ring();
    auto got = posted.Wait(1);
    ASSERT_EQ(got.size(), 1u);
    ASSERT_TRUE(got[0].ok()) << got[0].status();
    const auto& g = got[0]->gradients_ready();
    EXPECT_EQ(g.step(), 1);
    std::vector<int> ids(g.param_ids().begin(), g.param_ids().end());
    EXPECT_EQ(ids, (std::vector<int>{0, 2}));
    // The client cuts the doorbell off: the pump posts DATA_LOSS, stops.
    const int fd = ::shm_open((*r)->name().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 4096), 0);
    ::close(fd);
    // (No ring: the client's own pages past 4096 are gone too; the pump
    // looks again within 100 ms.)
    got = posted.Wait(2);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[1].status().code(), absl::StatusCode::kDataLoss)
        << got[1].status();
  }  // joined
  ASSERT_TRUE(transport::UnlinkShm((*r)->name()).ok());
}

TEST(DoorbellPump, StopsWhileWaiting) {
  auto r = transport::CreateShmRegion(4096, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  int posts = 0;
  {
    DoorbellPump pump((*r)->doorbell(),
                      [&](absl::StatusOr<v1::StepRequest>) { ++posts; });
  }
  EXPECT_EQ(posts, 0);
  ASSERT_TRUE(transport::UnlinkShm((*r)->name()).ok());
}

}  // namespace
}  // namespace dmuon::server
