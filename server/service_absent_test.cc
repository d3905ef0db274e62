// Absent parameters (GradientsReady.absent_param_ids, protocol minor 1):
// torch.optim.Muon skips a parameter whose .grad is None, so the daemon
// computes nothing for it, leaves its momentum untouched and answers it in
// UpdatesReady.absent_param_ids; the step still completes. The multi-rank
// rules by sharding, and the requests refused.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "server/service.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"

namespace dmuon::server::testing {
namespace {

// Declares `present` (their gradients written: shm slot or inline chunks)
// and `absent` at `step`, in one GradientsReady.
absl::Status Declare(OptimizerService& svc, Rank& r, int64_t step,
                     const std::vector<std::vector<float>>& grads,
                     const std::vector<int>& present,
                     const std::vector<int>& absent) {
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(step);
  for (int i : present) {
    const auto& slot = r.open.layout().slots(i);
    if (r.shm) {
      std::memcpy(r.shm->bytes().data() + slot.gradient_offset(),
                  grads[i].data(), slot.bytes());
    } else {
      v1::StepRequest c;
      c.mutable_gradient()->set_step(step);
      c.mutable_gradient()->set_param_id(i);
      c.mutable_gradient()->set_data(grads[i].data(), slot.bytes());
      if (auto st = svc.OnStepRequest(r.open.session_id(), c); !st.ok())
        return st;
    }
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  for (int i : absent) ready.mutable_gradients_ready()->add_absent_param_ids(i);
  return svc.OnStepRequest(r.open.session_id(), ready);
}

// The ids a step's UpdatesReady messages listed, present and absent.
void Announced(const std::vector<v1::StepResponse>& msgs,
               std::vector<int>* present, std::vector<int>* absent) {
  for (const auto& m : msgs) {
    if (!m.has_updates_ready()) continue;
    for (int i : m.updates_ready().param_ids()) present->push_back(i);
    for (int i : m.updates_ready().absent_param_ids()) absent->push_back(i);
  }
}

const std::vector<Param> kTwo = {{"a.w", 24, 16, v1::SHARDING_REPLICATED},
                                 {"b.w", 16, 32, v1::SHARDING_REPLICATED}};

// A parameter absent in a step keeps its momentum: its next update is the
// reference's that skipped that step; the other parameter steps as usual.
void AbsentKeepsMomentum(v1::Transport t) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, t, kTwo)).ok());
  std::mt19937_64 rng(7);
  std::vector<Reference> ref(2);
  // Step 2: b.w absent; step 4: both absent.
  const std::vector<std::vector<int>> absent_at = {{}, {1}, {}, {0, 1}, {}};
  for (int step = 1; step <= 5; ++step) {
    auto g = RandomGradients(kTwo, rng);
    const auto& absent = absent_at[step - 1];
    std::vector<int> present;
    for (int i = 0; i < 2; ++i)
      if (std::find(absent.begin(), absent.end(), i) == absent.end())
        present.push_back(i);
    std::vector<float> before_b;
    if (r.shm) {
      const auto& slot = r.open.layout().slots(1);
      before_b.resize(slot.bytes() / 4);
      std::memcpy(before_b.data(), r.shm->bytes().data() + slot.update_offset(),
                  slot.bytes());
    }
    ASSERT_TRUE(Declare(*svc, r, step, g, present, absent).ok());
    auto msgs = r.sink->WaitStep(step);
    ASSERT_FALSE(msgs.empty());
    ASSERT_TRUE(msgs.back().has_step_complete()) << "step " << step;
    std::vector<int> got_present, got_absent;
    Announced(msgs, &got_present, &got_absent);
    std::sort(got_present.begin(), got_present.end());
    std::sort(got_absent.begin(), got_absent.end());
    std::vector<int> want_absent = absent;
    std::sort(want_absent.begin(), want_absent.end());
    EXPECT_EQ(got_present, present) << "step " << step;
    EXPECT_EQ(got_absent, want_absent) << "step " << step;
    for (int i : present) {
      auto want = ref[i].Step(ToDouble(g[i]), {kTwo[i].rows, kTwo[i].cols});
      EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4)
          << kTwo[i].name << " step " << step;
    }
    for (const auto& m : msgs) {
      if (m.has_update()) {
        EXPECT_NE(
            std::find(present.begin(), present.end(), m.update().param_id()),
            present.end())
            << "update bytes sent for an absent parameter";
      }
    }
    if (r.shm && step == 2) {  // the absent one's update slot is untouched
      const auto& slot = r.open.layout().slots(1);
      EXPECT_EQ(0, std::memcmp(before_b.data(),
                               r.shm->bytes().data() + slot.update_offset(),
                               slot.bytes()));
    }
  }
  EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
}

TEST(Absent, KeepsMomentumShm) { AbsentKeepsMomentum(v1::TRANSPORT_SHM); }
TEST(Absent, KeepsMomentumInline) { AbsentKeepsMomentum(v1::TRANSPORT_INLINE); }

TEST(Absent, GetStateSeesUntouchedMomentum) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  std::mt19937_64 rng(3);
  auto g = RandomGradients(kTwo, rng);
  ASSERT_TRUE(Declare(*svc, r, 1, g, {0, 1}, {}).ok());
  r.sink->WaitStep(1);
  std::vector<std::vector<v1::StateChunk>> states;
  for (int step = 1; step <= 2; ++step) {
    auto chunks = GetState(*svc, r.open.session_id());
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    states.push_back(*std::move(chunks));
    if (step == 1) {
      ASSERT_TRUE(Declare(*svc, r, 2, g, {}, {0, 1}).ok());
      auto msgs = r.sink->WaitStep(2);
      ASSERT_TRUE(msgs.back().has_step_complete());
    }
  }
  ASSERT_EQ(states[0].size(), states[1].size());
  EXPECT_EQ(states[1][0].header().completed_steps(), 2);
  for (size_t k = 1; k < states[0].size(); ++k) {
    EXPECT_EQ(states[0][k].momentum().data(), states[1][k].momentum().data())
        << "momentum changed by an absent step";
  }
}

TEST(Absent, RefusedRequests) {
  auto svc = NewService();
  std::mt19937_64 rng(1);
  auto g = RandomGradients(kTwo, rng);
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("dup", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
    auto st = Declare(*svc, r, 1, g, {0}, {0});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("a.w"), std::string::npos) << st;
  }
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("range", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
    auto st = Declare(*svc, r, 1, g, {}, {7});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("again", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
    ASSERT_TRUE(Declare(*svc, r, 1, g, {}, {1}).ok());
    auto st = Declare(*svc, r, 1, g, {}, {1});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
}

// SHARDING_REPLICATED and SHARDING_ROWS: every rank must agree; the rank
// that disagrees is refused naming the parameter.
TEST(Absent, ReplicatedAndRowsRanksMustAgree) {
  for (v1::Sharding sh : {v1::SHARDING_REPLICATED, v1::SHARDING_ROWS}) {
    auto svc = NewService();
    const std::vector<Param> ps = {{"w", 16, 16, sh}};
    Rank a, b;
    ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, ps)).ok());
    ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, ps)).ok());
    std::vector<std::vector<float>> g = {std::vector<float>(16 * 16, 1.0f)};
    ASSERT_TRUE(Declare(*svc, a, 1, g, {0}, {}).ok());
    auto st = Declare(*svc, b, 1, g, {}, {0});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("'w'"), std::string::npos) << st;
    EXPECT_NE(
        st.message().find(sh == v1::SHARDING_ROWS ? "SHARDING_ROWS"
                                                  : "SHARDING_REPLICATED"),
        std::string::npos)
        << st;
  }
}

// Every rank absent: no computation, the step completes on every rank.
TEST(Absent, AllRanksAbsentCompletes) {
  auto svc = NewService();
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kMixed)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kMixed)).ok());
  std::vector<std::vector<float>> none;
  ASSERT_TRUE(Declare(*svc, a, 1, none, {}, {0, 1, 2, 3}).ok());
  ASSERT_TRUE(Declare(*svc, b, 1, none, {}, {3, 2, 1, 0}).ok());
  for (Rank* r : {&a, &b}) {
    auto msgs = r->sink->WaitStep(1);
    ASSERT_FALSE(msgs.empty());
    EXPECT_TRUE(msgs.back().has_step_complete());
    std::vector<int> present, absent;
    Announced(msgs, &present, &absent);
    EXPECT_TRUE(present.empty());
    EXPECT_EQ(absent.size(), 4u);
  }
}

// SHARDING_UNREDUCED absent on one rank only: that rank counts as zeros in
// the mean (torch DDP's all-reduce of an unused parameter), so the update
// is the reference's step on g0 / 2. Absent on both: skipped.
TEST(Absent, UnreducedAbsentRankCountsAsZeros) {
  auto svc = NewService();
  const std::vector<Param> ps = {{"u", 16, 24, v1::SHARDING_UNREDUCED}};
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, ps)).ok());
  std::mt19937_64 rng(11);
  Reference ref;
  for (int step = 1; step <= 3; ++step) {
    auto g0 = RandomGradients(ps, rng);
    auto g1 = RandomGradients(ps, rng);
    // Fill rank 1's slot with garbage: it must not be read when absent.
    std::vector<std::vector<float>> junk = {std::vector<float>(16 * 24, 1e30f)};
    const auto& slot = b.open.layout().slots(0);
    std::memcpy(b.shm->bytes().data() + slot.gradient_offset(), junk[0].data(),
                slot.bytes());
    if (step == 2) {  // both absent
      ASSERT_TRUE(Declare(*svc, b, step, g1, {}, {0}).ok());
      ASSERT_TRUE(Declare(*svc, a, step, g0, {}, {0}).ok());
      auto msgs = a.sink->WaitStep(step);
      b.sink->WaitStep(step);
      std::vector<int> present, absent;
      Announced(msgs, &present, &absent);
      EXPECT_EQ(absent, std::vector<int>{0});
      continue;
    }
    // Rank 1 absent (declared first), rank 0 present.
    ASSERT_TRUE(Declare(*svc, b, step, g1, {}, {0}).ok());
    ASSERT_TRUE(Declare(*svc, a, step, g0, {0}, {}).ok());
    auto msgs = a.sink->WaitStep(step);
    auto msgs_b = b.sink->WaitStep(step);
    ASSERT_TRUE(msgs.back().has_step_complete());
    std::vector<double> used(g0[0].size());
    for (size_t k = 0; k < used.size(); ++k) used[k] = g0[0][k] * 0.5f;
    auto want = ref.Step(used, {16, 24});
    EXPECT_LT(RelErr(a.Update(0, msgs), want), 1e-4) << "step " << step;
    EXPECT_LT(RelErr(b.Update(0, msgs_b), want), 1e-4) << "step " << step;
  }
}

}  // namespace
}  // namespace dmuon::server::testing
