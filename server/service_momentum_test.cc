// A per-step momentum (GradientsReady.momentum, protocol minor 2): torch's
// LR schedulers that cycle momentum (OneCycleLR, CyclicLR) change each
// group's beta every step. Every update is checked against an independent
// fp64 reference of torch.optim.Muon's rule with that step's beta
// (buf.lerp_(g, 1 - beta); Nesterov: g.lerp(buf, beta)), across batching,
// several ranks and a rewind; and the requests refused.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "server/service.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

// fp64 Muon with a beta given per step (Reference has a fixed 0.95).
struct BetaReference {
  std::vector<double> m;
  std::vector<double> Step(const std::vector<float>& g, kernels::Shape s,
                           double beta, bool nesterov) {
    if (m.empty()) m.assign(g.size(), 0.0);
    std::vector<double> u(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      m[i] = m[i] + (1 - beta) * (g[i] - m[i]);      // buf.lerp_(g, 1 - beta)
      u[i] = nesterov ? g[i] + beta * (m[i] - g[i])  // g.lerp(buf, beta)
                      : m[i];
    }
    auto o = ::dmuon::kernels::testing::SvdOracle(u, s, kernels::NsOptions{});
    const double scale = std::sqrt(std::max(1.0, double(s.rows) / s.cols));
    for (double& x : o) x *= scale;
    return o;
  }
};

// Declares every gradient of `grads` at `step` (this rank's views), with
// `momentum` as GradientsReady.momentum (empty: none sent). Inline: the
// chunks are sent first unless `chunks` is false (sent already: a
// declaration retried after it was refused).
absl::Status SendWith(OptimizerService& svc, Rank& r, int64_t step,
                      const std::vector<std::vector<float>>& grads,
                      const std::vector<double>& momentum, bool chunks = true) {
  v1::StepRequest ready;
  ready.mutable_gradients_ready()->set_step(step);
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& slot = r.open.layout().slots(i);
    if (r.shm) {
      std::memcpy(r.shm->bytes().data() + slot.gradient_offset(),
                  grads[i].data(), slot.bytes());
    } else if (chunks) {
      v1::StepRequest c;
      c.mutable_gradient()->set_step(step);
      c.mutable_gradient()->set_param_id(i);
      c.mutable_gradient()->set_data(grads[i].data(), slot.bytes());
      if (auto st = svc.OnStepRequest(r.open.session_id(), c); !st.ok())
        return st;
    }
    ready.mutable_gradients_ready()->add_param_ids(i);
  }
  for (double b : momentum) ready.mutable_gradients_ready()->add_momentum(b);
  return svc.OnStepRequest(r.open.session_id(), ready);
}

void ExpectHas(const absl::Status& st, const std::vector<std::string>& parts) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  for (const auto& p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << p << ": " << st;
}

// Same shapes: the two parameters are batched together (one NS call) while
// each uses its own beta.
const std::vector<Param> kPair = {{"a.w", 24, 16, v1::SHARDING_REPLICATED},
                                  {"b.w", 24, 16, v1::SHARDING_REPLICATED},
                                  {"c.w", 16, 40, v1::SHARDING_REPLICATED}};

void ChangingBetaMatchesTorch(v1::Transport t, bool nesterov) {
  auto svc = NewService();
  Rank r;
  auto req = Request("j", 0, 1, t, kPair);
  req.mutable_groups(0)->set_momentum(0.9);
  req.mutable_groups(0)->set_nesterov(nesterov);
  ASSERT_TRUE(r.Open(*svc, req).ok());
  std::mt19937_64 rng(11);
  std::vector<BetaReference> ref(kPair.size());
  // By step: the betas sent (empty: none, the group's 0.9 for every one).
  const std::vector<std::vector<double>> sent = {
      {0.95, 0.95, 0.95}, {}, {0.85, 0.6, 0.9},
      {0.5, 0.0, 0.75},   {}, {0.999, 0.9, 0.3}};
  for (int step = 1; step <= static_cast<int>(sent.size()); ++step) {
    auto g = RandomGradients(kPair, rng);
    ASSERT_TRUE(SendWith(*svc, r, step, g, sent[step - 1]).ok());
    auto msgs = r.sink->WaitStep(step);
    ASSERT_FALSE(msgs.empty());
    ASSERT_TRUE(msgs.back().has_step_complete()) << "step " << step;
    for (size_t i = 0; i < kPair.size(); ++i) {
      const double beta = sent[step - 1].empty() ? 0.9 : sent[step - 1][i];
      auto want =
          ref[i].Step(g[i], {kPair[i].rows, kPair[i].cols}, beta, nesterov);
      EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4)
          << kPair[i].name << " step " << step << " beta " << beta;
    }
  }
  EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
}

TEST(StepMomentum, ChangingBetaMatchesTorchShmNesterov) {
  ChangingBetaMatchesTorch(v1::TRANSPORT_SHM, true);
}
TEST(StepMomentum, ChangingBetaMatchesTorchInlineNesterov) {
  ChangingBetaMatchesTorch(v1::TRANSPORT_INLINE, true);
}
TEST(StepMomentum, ChangingBetaMatchesTorchShmPlain) {
  ChangingBetaMatchesTorch(v1::TRANSPORT_SHM, false);
}

// Two ranks, every sharding: the same beta from both ranks (a rank may send
// none when the group's is the one) is used; a different one is refused
// naming the parameter and both values, and nothing of it changes.
TEST(StepMomentum, RanksAgreeOrAreRefused) {
  auto svc = NewService();
  constexpr int kWorld = 2;
  std::vector<Rank> ranks(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(
        ranks[r]
            .Open(*svc, Request("j", r, kWorld, v1::TRANSPORT_SHM, kMixed))
            .ok());
  }
  std::mt19937_64 rng(5);
  std::vector<BetaReference> ref(kMixed.size());
  // Views of whole-matrix gradients: rank r's rows of SHARDING_ROWS; an
  // SHARDING_UNREDUCED parameter gets the same gradient on both ranks, so
  // the mean is that gradient.
  auto views = [&](int r, const std::vector<std::vector<float>>& g) {
    std::vector<std::vector<float>> out(kMixed.size());
    for (size_t i = 0; i < kMixed.size(); ++i)
      out[i] = RankView(kMixed[i], r, kWorld, g[i]);
    return out;
  };
  for (int step = 1; step <= 3; ++step) {
    auto g = RandomGradients(kMixed, rng);
    const std::vector<double> betas = {0.95 - 0.1 * step, 0.95,
                                       0.5 + 0.1 * step, 0.95 - 0.05 * step};
    if (step == 2) {
      // Rank 1 disagrees on mlp.down (SHARDING_UNREDUCED): refused.
      ASSERT_TRUE(SendWith(*svc, ranks[0], step, views(0, g), betas).ok());
      std::vector<double> other = betas;
      other[2] = 0.25;
      ExpectHas(SendWith(*svc, ranks[1], step, views(1, g), other),
                {"parameter 'mlp.down'", "at step 2", "rank 1", "momentum 0.25",
                 "another rank with 0.7"});
      ASSERT_TRUE(SendWith(*svc, ranks[1], step, views(1, g), betas).ok());
    } else if (step == 3) {
      // Rank 1 sends none: only for a step whose betas are all the group's.
      const std::vector<double> group(kMixed.size(), 0.95);
      ASSERT_TRUE(SendWith(*svc, ranks[0], step, views(0, g), group).ok());
      ASSERT_TRUE(SendWith(*svc, ranks[1], step, views(1, g), {}).ok());
    } else {
      for (int r = kWorld - 1; r >= 0; --r)
        ASSERT_TRUE(SendWith(*svc, ranks[r], step, views(r, g), betas).ok());
    }
    for (int r = 0; r < kWorld; ++r) {
      auto msgs = ranks[r].sink->WaitStep(step);
      ASSERT_FALSE(msgs.empty());
      ASSERT_TRUE(msgs.back().has_step_complete()) << "rank " << r;
    }
    for (size_t i = 0; i < kMixed.size(); ++i) {
      const double beta = step == 3 ? 0.95 : betas[i];
      auto want = ref[i].Step(g[i], {kMixed[i].rows, kMixed[i].cols}, beta,
                              /*nesterov=*/true);
      auto got = ranks[0].Update(i, {});
      if (kMixed[i].sharding == v1::SHARDING_ROWS) {
        auto got1 = ranks[1].Update(i, {});
        got.insert(got.end(), got1.begin(), got1.end());
      }
      EXPECT_LT(RelErr(got, want), 1e-4)
          << kMixed[i].name << " step " << step << " beta " << beta;
    }
  }
  // A rank that sends none (the group's 0.95) against one that sent 0.5.
  auto g = RandomGradients(kMixed, rng);
  const std::vector<double> half(kMixed.size(), 0.5);
  ASSERT_TRUE(SendWith(*svc, ranks[0], 4, views(0, g), half).ok());
  ExpectHas(SendWith(*svc, ranks[1], 4, views(1, g), {}),
            {"parameter 'attn.w'", "rank 1", "momentum 0.95",
             "another rank with 0.5", "its group's"});
  // Values apart in the last digits only are written out whole.
  std::vector<double> close = half;
  close[0] = 0.5 + 1e-12;
  ExpectHas(SendWith(*svc, ranks[1], 4, views(1, g), close),
            {"parameter 'attn.w'", "momentum 0.50000000000099998",
             "another rank with 0.5 "});
  for (auto& r : ranks) (void)svc->CloseSession(r.open.session_id());
}

// A step rewound and redone with another beta is that beta's step from the
// momentum before it.
TEST(StepMomentum, RewoundStepRedoneWithAnotherBeta) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kPair)).ok());
  std::mt19937_64 rng(3);
  const auto g1 = RandomGradients(kPair, rng), g2 = RandomGradients(kPair, rng);
  std::vector<BetaReference> ref(kPair.size());
  for (size_t i = 0; i < kPair.size(); ++i)
    ref[i].Step(g1[i], {kPair[i].rows, kPair[i].cols}, 0.8, true);
  ASSERT_TRUE(SendWith(*svc, r, 1, g1, {0.8, 0.8, 0.8}).ok());
  ASSERT_TRUE(r.sink->WaitStep(1).back().has_step_complete());
  ASSERT_TRUE(SendWith(*svc, r, 2, g2, {0.3, 0.2, 0.1}).ok());
  ASSERT_TRUE(r.sink->WaitStep(2).back().has_step_complete());
  v1::StepRequest rewind;
  rewind.mutable_rewind()->set_step(2);
  ASSERT_TRUE(svc->OnStepRequest(r.open.session_id(), rewind).ok());
  ASSERT_TRUE(SendWith(*svc, r, 2, g2, {0.7, 0.6, 0.5}).ok());
  auto msgs = r.sink->WaitStep(2);
  ASSERT_TRUE(msgs.back().has_step_complete());
  const double betas[] = {0.7, 0.6, 0.5};
  for (size_t i = 0; i < kPair.size(); ++i) {
    auto want =
        ref[i].Step(g2[i], {kPair[i].rows, kPair[i].cols}, betas[i], true);
    EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4) << kPair[i].name;
  }
  EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
}

// Refused, each naming what is wrong, before anything of the declaration
// takes effect: the step then runs with a correct one.
TEST(StepMomentum, BadValuesAreRefused) {
  for (v1::Transport t : {v1::TRANSPORT_SHM, v1::TRANSPORT_INLINE}) {
    auto svc = NewService();
    Rank r;
    ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, t, kPair)).ok());
    std::mt19937_64 rng(9);
    auto g = RandomGradients(kPair, rng);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    ExpectHas(SendWith(*svc, r, 1, g, {0.9, 0.9}),
              {"gradients_ready.momentum", "2 values for 3 param_ids"});
    ExpectHas(SendWith(*svc, r, 1, g, {0.9, 1.5, 0.9}, false),
              {"parameter 'b.w'", "momentum must be in [0, 1), got 1.5"});
    ExpectHas(SendWith(*svc, r, 1, g, {0.9, 0.9, 1.0}, false),
              {"parameter 'c.w'", "must be in [0, 1), got 1"});
    ExpectHas(SendWith(*svc, r, 1, g, {-0.1, 0.9, 0.9}, false),
              {"parameter 'a.w'", "got -0.1"});
    ExpectHas(SendWith(*svc, r, 1, g, {0.9, nan, 0.9}, false),
              {"parameter 'b.w'", "got nan"});
    ExpectHas(SendWith(*svc, r, 1, g, {0.9, 0.9, inf}, false),
              {"parameter 'c.w'", "got inf"});
    BetaReference ref;
    ASSERT_TRUE(SendWith(*svc, r, 1, g, {0.9, 0.9, 0.9}, false).ok()) << t;
    auto msgs = r.sink->WaitStep(1);
    ASSERT_TRUE(msgs.back().has_step_complete());
    EXPECT_LT(RelErr(r.Update(0, msgs), ref.Step(g[0], {24, 16}, 0.9, true)),
              1e-4);
    EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
}

}  // namespace
}  // namespace dmuon::server::testing
