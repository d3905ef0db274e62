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

// A client's declare words and momenta by parameter, every one marked:
// what Doorbell::Take returns after each word was stored once.
struct Words {
  explicit Words(int n) : words(n, 0), momentum(n, 0) {}
  std::vector<uint64_t> words;
  std::vector<double> momentum;
  uint64_t rewind = 0;
  transport::Doorbell::Declarations Taken() const {
    transport::Doorbell::Declarations d;
    for (size_t i = 0; i < words.size(); ++i)
      d.params.push_back(static_cast<int>(i));
    d.words = words;
    d.momentum = momentum;
    d.rewind = rewind;
    return d;
  }
};

std::vector<int> Ids(const absl::StatusOr<v1::StepRequest>& m) {
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  const auto& g = m->gradients_ready();
  return std::vector<int>(g.param_ids().begin(), g.param_ids().end());
}

TEST(NewDeclarations, NothingNewIsNothing) {
  DeclarationsSeen seen(4);
  EXPECT_TRUE(NewDeclarations(Words(4).Taken(), &seen).empty());
  // Marked but unchanged (a word stored again with its own value), or a
  // parameter the session does not have: nothing.
  transport::Doorbell::Declarations d;
  d.params = {1, 4, -1};
  d.words = {0, Word(1, 1, false, false), Word(2, 1, false, false)};
  d.momentum = {0, 0, 0};
  EXPECT_TRUE(NewDeclarations(d, &seen).empty());
}

// Only the marked parameters are looked at: a word that changed without
// its mark waits for it.
TEST(NewDeclarations, OnlyTheMarkedWords) {
  Words now(3);
  DeclarationsSeen seen(3);
  now.words[0] = Word(1, 1, false, false);
  now.words[2] = Word(2, 1, false, false);
  transport::Doorbell::Declarations d = now.Taken();
  d.params = {2};
  d.words = {now.words[2]};
  d.momentum = {0};
  auto msgs = NewDeclarations(d, &seen);
  ASSERT_EQ(msgs.size(), 1u);
  EXPECT_EQ(Ids(msgs[0]), (std::vector<int>{2}));
  msgs = NewDeclarations(now.Taken(), &seen);
  ASSERT_EQ(msgs.size(), 1u);
  EXPECT_EQ(Ids(msgs[0]), (std::vector<int>{0}));
}

// Random declarations of one or two steps, each parameter plain, with a
// momentum or absent, maybe a rewind: every changed word appears exactly
// once, in the message of its step and kind, rewind first, steps ascending;
// a second look finds nothing; a word written again (new serial) is new.
TEST(NewDeclarations, EveryChangedWordOnceInItsPlace) {
  std::mt19937_64 rng(std::random_device{}());
  for (int round = 0; round < 200; ++round) {
    const int n = 1 + static_cast<int>(rng() % 40);
    Words now(n);
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
    const auto msgs = NewDeclarations(now.Taken(), &seen);
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
    EXPECT_TRUE(NewDeclarations(now.Taken(), &seen).empty());
    // The same step declared again (after a rewind): new serials, new.
    if (!want.empty()) {
      const int id = want.begin()->first;
      now.words[id] = Word(++serial, want.begin()->second.first, false, false);
      const auto again = NewDeclarations(now.Taken(), &seen);
      ASSERT_EQ(again.size(), 1u);
      ASSERT_EQ(again[0].gradients_ready().param_ids_size(), 1);
      EXPECT_EQ(again[0].gradients_ready().param_ids(0), id);
    }
  }
}

// The stream's order: a rewind after the declarations the client made
// before it (their serials precede its own) and before the later ones, and
// with serials that wrapped around.
TEST(NewDeclarations, ARewindBetweenDeclarationsKeepsItsPlace) {
  for (uint32_t base : {uint32_t{0}, (uint32_t{1} << 22) - 2}) {
    Words now(3);
    DeclarationsSeen seen(3);
    now.words[2] = Word(base + 1, 6, false, false);  // step 6, before
    now.rewind = Word(base + 2, 5, false, false);    // then rewind 5
    now.words[0] = Word(base + 3, 5, false, false);  // then step 5 again
    const auto msgs = NewDeclarations(now.Taken(), &seen);
    ASSERT_EQ(msgs.size(), 3u) << base;
    EXPECT_EQ(msgs[0].gradients_ready().step(), 6) << base;
    EXPECT_EQ(Ids(msgs[0]), (std::vector<int>{2})) << base;
    ASSERT_TRUE(msgs[1].has_rewind()) << base;
    EXPECT_EQ(msgs[1].rewind().step(), 5) << base;
    EXPECT_EQ(msgs[2].gradients_ready().step(), 5) << base;
    EXPECT_EQ(Ids(msgs[2]), (std::vector<int>{0})) << base;
  }
}

// What a pump posted, for a test to wait on.
class Posted {
 public:
  void Add(absl::StatusOr<v1::StepRequest> m) {
    absl::MutexLock l(&mu_);
    got_.push_back(std::move(m));
  }
  // A pump's `post` into this.
  DoorbellPump::Post Sink() {
    return [this](absl::StatusOr<v1::StepRequest> m) { Add(std::move(m)); };
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

// A segment with a doorbell for kParams and the client's view of it.
struct Segment {
  static constexpr int kParams = 3;
  Segment() {
    auto r = transport::CreateShmRegion(4096, kParams);
    EXPECT_TRUE(r.ok()) << r.status();
    region = std::move(*r);
    bell = region->doorbell();
    auto c = transport::OpenShmRegion(
        region->name(), bell->offset() + transport::DoorbellBytes(kParams));
    EXPECT_TRUE(c.ok()) << c.status();
    client = std::move(*c);
  }
  ~Segment() { (void)transport::UnlinkShm(region->name()); }
  transport::DoorbellView view() const {
    return transport::DoorbellView(client->bytes().data() + bell->offset(),
                                   kParams);
  }
  std::unique_ptr<transport::Region> region, client;
  std::shared_ptr<transport::Doorbell> bell;
};

TEST(DoorbellPump, PostsWhatTheClientRangThenTheCutOff) {
  Segment seg;
  auto v = seg.view();
  Posted posted;
  {
    // Declared before the pump starts: its first load sees both.
    v.Declare(2, Word(1, 1, false, false));
    v.Declare(0, Word(2, 1, false, false));
    v.Ring();
    DoorbellPump pump(seg.bell, posted.Sink());
    auto got = posted.Wait(1);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0]->gradients_ready().step(), 1);
    EXPECT_EQ(Ids(got[0]), (std::vector<int>{0, 2}));
    pump.Taken();
    // The client cuts the doorbell off: the pump posts DATA_LOSS, stops.
    const int fd = ::shm_open(seg.region->name().c_str(), O_RDWR, 0);
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
}

// Nothing new is loaded while a load's messages wait for the service: a
// client changing its words meanwhile queues nothing; once they are taken
// its last words come, once.
TEST(DoorbellPump, LoadsAgainOnlyOnceItsMessagesAreTaken) {
  Segment seg;
  auto v = seg.view();
  Posted posted;
  DoorbellPump pump(seg.bell, posted.Sink());
  v.Declare(0, Word(1, 1, false, false));
  v.Ring();
  ASSERT_EQ(posted.Wait(1).size(), 1u);
  for (uint32_t k = 2; k < 200; ++k) {  // not taken: none of these posts
    v.Declare(1, Word(k, 1, false, false));
    v.Ring();
  }
  ::usleep(300 * 1000);  // three of its periodic looks
  EXPECT_EQ(posted.Wait(1).size(), 1u);
  pump.Taken();
  auto got = posted.Wait(2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(Ids(got[1]), (std::vector<int>{1}));
}

// A half-closed stream's last declarations: StopAndFlush posts what the
// thread had not, and nothing twice.
TEST(DoorbellPump, StopAndFlushPostsTheLastDeclarationsOnce) {
  Segment seg;
  auto v = seg.view();
  Posted posted;
  DoorbellPump pump(seg.bell, posted.Sink());
  v.Declare(1, Word(1, 3, false, false));  // no ring: maybe seen, maybe not
  pump.StopAndFlush();
  auto got = posted.Wait(1);
  int seen = 0;
  for (const auto& m : got) {
    for (int id : Ids(m)) seen += id == 1;
  }
  EXPECT_EQ(seen, 1);
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
