// Rewind (protocol minor 1): undoing the last completed step so that a
// client can declare its gradients again (edited after their hand-off, or a
// step the trainer skipped), and the cases it is refused.

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

const std::vector<Param> kTwo = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                 {"b", 40, 24, v1::SHARDING_REPLICATED}};

v1::StepRequest RewindOf(int64_t step) {
  v1::StepRequest m;
  m.mutable_rewind()->set_step(step);
  return m;
}

// Runs `grads` as steps from..to on rank `r`; returns the last updates.
std::vector<std::vector<float>> RunSteps(
    OptimizerService& svc, Rank& r, int from, int to,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> last;
  for (int s = from; s <= to; ++s) {
    EXPECT_TRUE(r.Send(svc, s, grads[s - from]).ok()) << "step " << s;
    auto msgs = r.sink->WaitStep(s);
    EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete()) << s;
    last.clear();
    for (int i = 0; i < r.open.layout().slots_size(); ++i)
      last.push_back(r.Update(i, msgs));
  }
  return last;
}

TEST(Rewind, RedoneStepIsExactlyTheEditedOne) {
  // Steps 1-2, step 2 rewound and redone with other (edited) gradients,
  // rewound and redone once more, then step 3: every update is bit for bit
  // that of a run that had the edited gradients from the start.
  std::mt19937_64 rng(7);
  const auto g =
      StepsOfGradients(kTwo, 4, rng);  // g[1]: handed off, g[3]: edited
  for (v1::Transport t : {v1::TRANSPORT_SHM, v1::TRANSPORT_INLINE}) {
    auto ref_svc = NewService();
    Rank ref;
    ASSERT_TRUE(ref.Open(*ref_svc, Request("ref", 0, 1, t, kTwo)).ok());
    const auto want2 = RunSteps(*ref_svc, ref, 1, 2, {g[0], g[3]});
    const auto want3 = RunSteps(*ref_svc, ref, 3, 3, {g[2]});

    auto svc = NewService();
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, t, kTwo)).ok());
    RunSteps(*svc, r, 1, 2, {g[0], g[1]});
    ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(2)).ok());
    EXPECT_EQ(svc->Status().jobs(0).completed_steps(), 1);
    RunSteps(*svc, r, 2, 2, {g[1]});
    ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(2)).ok());
    EXPECT_EQ(RunSteps(*svc, r, 2, 2, {g[3]}), want2) << t;
    EXPECT_EQ(RunSteps(*svc, r, 3, 3, {g[2]}), want3) << t;
    EXPECT_EQ(svc->Status().jobs(0).completed_steps(), 3);
  }
}

TEST(Rewind, RefusedOutsideTheLastCompletedStepOfAOneRankJob) {
  std::mt19937_64 rng(8);
  const auto g = StepsOfGradients(kTwo, 2, rng);
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  // Nothing completed yet.
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  RunSteps(*svc, r, 1, 1, {g[0]});
  // Not the last completed step.
  absl::Status st = svc->OnStepRequest(r.open.session_id(), RewindOf(2));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("last completed step is 1"), std::string::npos)
      << st;
  // Once: a rewound step must be redone before it can be rewound again.
  ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).ok());
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);

  // Mid-step: a gradient of the next step arrived.
  auto svc2 = NewService();
  Rank q;
  ASSERT_TRUE(q.Open(*svc2, Request("k", 0, 1, v1::TRANSPORT_SHM, kTwo)).ok());
  RunSteps(*svc2, q, 1, 1, {g[0]});
  v1::StepRequest one;
  one.mutable_gradients_ready()->set_step(2);
  one.mutable_gradients_ready()->add_param_ids(0);
  ASSERT_TRUE(svc2->OnStepRequest(q.open.session_id(), one).ok());
  EXPECT_EQ(svc2->OnStepRequest(q.open.session_id(), RewindOf(1)).code(),
            absl::StatusCode::kFailedPrecondition);

  // Two ranks.
  auto svc3 = NewService();
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc3, Request("w", 0, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(b.Open(*svc3, Request("w", 1, 2, v1::TRANSPORT_SHM, kTwo)).ok());
  ASSERT_TRUE(a.Send(*svc3, 1, g[0]).ok());
  ASSERT_TRUE(b.Send(*svc3, 1, g[0]).ok());
  a.sink->WaitStep(1);
  st = svc3->OnStepRequest(a.open.session_id(), RewindOf(1));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("2 ranks"), std::string::npos) << st;
}

}  // namespace
}  // namespace dmuon::server::testing
