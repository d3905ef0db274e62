// The doorbell's update side (OpenSessionRequest.doorbell, docs/protocol.md
// "Doorbell"): a shm session that asks for one learns of its updates from
// words in its segment, never from UpdatesReady; every update is still the
// fp64 reference's; skipped and absent parameters say so in their word; a
// Rewind's redone step gets new words; asked with another transport, the
// open is refused naming the field. (Its declare side reaches the service
// through the daemon's adapter: doorbell_pump_test, tests/daemon_test.)

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "server/service.h"
#include "server/testing/service_harness.h"
#include "transport/doorbell.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kThree = {{"a.w", 24, 16, v1::SHARDING_REPLICATED},
                                   {"b.w", 16, 32, v1::SHARDING_REPLICATED},
                                   {"c.w", 8, 8, v1::SHARDING_REPLICATED}};

v1::OpenSessionRequest DoorbellRequest(const std::string& job,
                                       const std::vector<Param>& params) {
  auto req = Request(job, 0, 1, v1::TRANSPORT_SHM, params);
  req.set_doorbell(true);
  return req;
}

transport::DoorbellView View(Rank& r) {
  return transport::DoorbellView(
      r.shm->bytes().data() + r.open.doorbell().offset(),
      r.open.layout().slots_size());
}

int CountUpdatesReady(const std::vector<v1::StepResponse>& msgs) {
  int n = 0;
  for (const auto& m : msgs) n += m.has_updates_ready() ? 1 : 0;
  return n;
}

TEST(Doorbell, GrantedAfterTheTensors) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, DoorbellRequest("j", kThree)).ok());
  ASSERT_TRUE(r.open.has_doorbell());
  EXPECT_GE(r.open.doorbell().offset(), r.open.layout().total_bytes());
  EXPECT_EQ(r.open.doorbell().offset() % transport::kAlignment, 0u);
  EXPECT_EQ(r.open.doorbell().bytes(), transport::DoorbellBytes(3));
  // Nothing announced yet: every word and the counter are zero.
  auto v = View(r);
  EXPECT_EQ(v.update_counter(), 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(v.update_word(i), 0u);

  // Not asked: no doorbell, as before.
  Rank plain;
  ASSERT_TRUE(
      plain.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, kThree)).ok());
  EXPECT_FALSE(plain.open.has_doorbell());
}

// OpenSessionRequest.doorbell_waiters reaches dmuond's side of the doorbell
// (whose wake rule doorbell_test checks): asked, it wakes the client only
// while one of its threads waits; not asked, at every announcement.
TEST(Doorbell, WakesOnlyWaitersWhenTheClientCountsThem) {
  auto svc = NewService();
  Rank counted, plain;
  auto req = DoorbellRequest("j", kThree);
  req.set_doorbell_waiters(true);
  ASSERT_TRUE(counted.Open(*svc, req).ok());
  ASSERT_NE(counted.bell, nullptr);
  EXPECT_TRUE(counted.bell->client_counts_waiters());
  ASSERT_TRUE(plain.Open(*svc, DoorbellRequest("k", kThree)).ok());
  ASSERT_NE(plain.bell, nullptr);
  EXPECT_FALSE(plain.bell->client_counts_waiters());
}

TEST(Doorbell, EveryUpdateAnnouncedInItsWordNoneOnTheStream) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, DoorbellRequest("j", kThree)).ok());
  auto v = View(r);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<Reference> ref(3);
  std::set<uint32_t> serials;
  uint32_t announced = 0;
  for (int step = 1; step <= 3; ++step) {
    const auto g = RandomGradients(kThree, rng);
    ASSERT_TRUE(r.Send(*svc, step, g).ok());
    const auto msgs = r.sink->WaitStep(step);
    ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
    EXPECT_EQ(CountUpdatesReady(msgs), 0) << "step " << step;
    for (int i = 0; i < 3; ++i) {
      const auto w = transport::DecodeWord(v.update_word(i));
      EXPECT_EQ(w.step, step) << kThree[i].name;
      EXPECT_FALSE(w.flag_a || w.flag_b) << kThree[i].name;
      serials.insert(w.serial);
      const auto want =
          ref[i].Step(ToDouble(g[i]), {kThree[i].rows, kThree[i].cols});
      EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4)
          << kThree[i].name << " step " << step;
    }
    announced += 3;
    EXPECT_EQ(v.update_counter(), announced);
  }
  EXPECT_EQ(serials.size(), 9u) << "every announcement a new word";
}

TEST(Doorbell, SkippedAndAbsentSayItInTheWord) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, DoorbellRequest("j", kThree)).ok());
  auto v = View(r);
  std::mt19937_64 rng(std::random_device{}());
  auto g = RandomGradients(kThree, rng);
  g[0][5] = NAN;  // a.w: skipped (non-finite); c.w: absent
  for (int i = 0; i < 2; ++i) {
    const auto& slot = r.open.layout().slots(i);
    std::memcpy(r.shm->bytes().data() + slot.gradient_offset(), g[i].data(),
                slot.bytes());
  }
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(1);
  ready.mutable_gradients_ready()->add_param_ids(0);
  ready.mutable_gradients_ready()->add_param_ids(1);
  ready.mutable_gradients_ready()->add_absent_param_ids(2);
  ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), ready).ok());
  const auto msgs = r.sink->WaitStep(1);
  ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
  EXPECT_EQ(CountUpdatesReady(msgs), 0);
  const auto a = transport::DecodeWord(v.update_word(0));
  const auto b = transport::DecodeWord(v.update_word(1));
  const auto c = transport::DecodeWord(v.update_word(2));
  EXPECT_TRUE(a.step == 1 && a.flag_a && !a.flag_b);
  EXPECT_TRUE(b.step == 1 && !b.flag_a && !b.flag_b);
  EXPECT_TRUE(c.step == 1 && c.flag_b && !c.flag_a);
  for (float x : r.Update(0, msgs)) ASSERT_EQ(x, 0.0f);
  // The skip's reason still comes on the stream.
  bool reported = false;
  for (const auto& m : msgs)
    reported |=
        m.has_error() && m.error().skipped() && m.error().name() == "a.w";
  EXPECT_TRUE(reported);
}

TEST(Doorbell, RewoundStepIsAnnouncedAnew) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, DoorbellRequest("j", kThree)).ok());
  auto v = View(r);
  std::mt19937_64 rng(std::random_device{}());
  const auto g = RandomGradients(kThree, rng);
  ASSERT_TRUE(r.Send(*svc, 1, g).ok());
  r.sink->WaitStep(1);
  std::vector<uint64_t> first(3);
  for (int i = 0; i < 3; ++i) first[i] = v.update_word(i);
  v1::StepRequest rewind;
  rewind.mutable_rewind()->set_step(1);
  ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), rewind).ok());
  const auto again = RandomGradients(kThree, rng);
  ASSERT_TRUE(r.Send(*svc, 1, again).ok());
  const auto msgs = r.sink->WaitStep(1);
  ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
  std::vector<Reference> ref(3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(v.update_word(i), first[i]) << "the same step, a new word";
    EXPECT_EQ(transport::DecodeWord(v.update_word(i)).step, 1);
    const auto want =
        ref[i].Step(ToDouble(again[i]), {kThree[i].rows, kThree[i].cols});
    EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4) << kThree[i].name;
  }
}

TEST(Doorbell, OnlyWithShm) {
  auto svc = NewService();
  auto req = Request("j", 0, 1, v1::TRANSPORT_INLINE, kThree);
  req.set_doorbell(true);
  auto r = svc->OpenSession(req);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("doorbell"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("TRANSPORT_INLINE"), std::string::npos)
      << r.status();
}

}  // namespace
}  // namespace dmuon::server::testing
