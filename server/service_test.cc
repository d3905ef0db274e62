// The service logic without sockets (testing/service_harness.h): steps of
// every sharding mode and transport checked against the fp64 reference, bad
// requests and their codes, non-finite gradients, the "auto" method.

#include "server/service.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cost_model.h"
#include "kernels/testing/oracle.h"
#include "planner/planner.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "server/testing/state_streams.h"
#include "server/testing/temp_dir.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

TEST(Service, OneRankInline) {
  RunJob(v1::TRANSPORT_INLINE, 1, kMixed, 3, std::random_device{}());
}
TEST(Service, ThreeRanksShmEveryShardingMode) {
  RunJob(v1::TRANSPORT_SHM, 3, kMixed, 4, std::random_device{}());
}
TEST(Service, TwoRanksInline) {
  RunJob(v1::TRANSPORT_INLINE, 2, kMixed, 2, std::random_device{}());
}

TEST(Service, TableMismatchNamesParameterAndBothValues) {
  auto svc = NewService();
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_INLINE,
                                   {{"layers.3.mlp.w1", 64, 112,
                                     v1::SHARDING_REPLICATED}}))
                  .ok());
  absl::Status st = b.Open(
      *svc, Request("j", 1, 2, v1::TRANSPORT_INLINE,
                    {{"layers.3.mlp.w1", 64, 88, v1::SHARDING_REPLICATED}}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      st.message().find(
          "'layers.3.mlp.w1' shape [64,88] does not match rank 0's [64,112]"),
      std::string::npos)
      << st;
  // Layers must agree too, unset included.
  auto with_layer =
      Request("k", 0, 2, v1::TRANSPORT_INLINE,
              {{"layers.3.mlp.w1", 64, 112, v1::SHARDING_REPLICATED}});
  with_layer.mutable_parameters(0)->set_layer(3);
  Rank c, d;
  ASSERT_TRUE(c.Open(*svc, with_layer).ok());
  st = d.Open(*svc,
              Request("k", 1, 2, v1::TRANSPORT_INLINE,
                      {{"layers.3.mlp.w1", 64, 112, v1::SHARDING_REPLICATED}}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(
                "'layers.3.mlp.w1' layer unset does not match rank 0's 3"),
            std::string::npos)
      << st;
}

// Every call given a session id that names no open session (never opened,
// or closed) fails alike: NOT_FOUND, in NoOpenSessionError's words.
TEST(Service, NoOpenSessionIsOneError) {
  auto svc = NewService(ServiceOptions());
  const absl::Status want = NoOpenSessionError();
  EXPECT_EQ(want.code(), absl::StatusCode::kNotFound);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE,
                                   {{"w", 8, 8, v1::SHARDING_REPLICATED}}))
                  .ok());
  const std::string closed = r.open.session_id();
  ASSERT_TRUE(svc->CloseSession(closed).ok());
  for (const std::string& id : {std::string("never-opened"), closed}) {
    EXPECT_EQ(svc->Attach(id, std::make_shared<FakeSink>()), want) << id;
    v1::StepRequest m;
    m.mutable_gradients_ready()->set_step(1);
    EXPECT_EQ(svc->OnStepRequest(id, m), want) << id;
    EXPECT_EQ(svc->CloseSession(id), want) << id;
    EXPECT_EQ(svc->ReadState(id).status(), want) << id;
    v1::StateChunk head;
    head.set_session_id(id);
    head.mutable_header();
    EXPECT_EQ(svc->WriteState(head).status(), want) << id;
  }
}

TEST(Service, BadRequestsGetFittingCodes) {
  ServiceOptions o;
  o.max_sessions = 1;
  auto svc = NewService(o);
  auto req = Request("j", 0, 1, v1::TRANSPORT_INLINE,
                     {{"w", 8, 8, v1::SHARDING_REPLICATED}});
  auto bad = req;
  bad.set_protocol_version(static_cast<v1::ProtocolVersion>(7));
  EXPECT_EQ(svc->OpenSession(bad).status().code(),
            absl::StatusCode::kFailedPrecondition);
  bad = req;
  bad.mutable_parameters(0)->set_shape(1, 0);
  EXPECT_EQ(svc->OpenSession(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = req;
  bad.mutable_parameters(0)->set_layer(-1);
  EXPECT_EQ(svc->OpenSession(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = req;
  bad.set_transport(v1::TRANSPORT_NCCL);
  EXPECT_EQ(svc->OpenSession(bad).status().code(),
            absl::StatusCode::kUnimplemented);
  bad = req;
  bad.set_rank(3);
  EXPECT_EQ(svc->OpenSession(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, req).ok());
  // A session id is 16 random bytes in lowercase hex.
  EXPECT_EQ(r.open.session_id().size(), 32u);
  EXPECT_EQ(r.open.session_id().find_first_not_of("0123456789abcdef"),
            std::string::npos)
      << r.open.session_id();
  auto again = Request("k", 0, 1, v1::TRANSPORT_INLINE,
                       {{"w", 8, 8, v1::SHARDING_REPLICATED}});
  EXPECT_EQ(svc->OpenSession(again).status().code(),
            absl::StatusCode::kResourceExhausted);

  // Unknown parameter id, out-of-order steps, double declaration.
  v1::StepRequest m;
  m.mutable_gradients_ready()->set_step(1);
  m.mutable_gradients_ready()->add_param_ids(5);
  absl::Status st = svc->OnStepRequest(r.open.session_id(), m);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("parameter id 5 does not exist"),
            std::string::npos)
      << st;
  m.mutable_gradients_ready()->set_step(2);
  m.mutable_gradients_ready()->set_param_ids(0, 0);
  st = svc->OnStepRequest(r.open.session_id(), m);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("skips step 1"), std::string::npos) << st;
  // Inline: ready before the bytes arrived.
  m.mutable_gradients_ready()->set_step(1);
  st = svc->OnStepRequest(r.open.session_id(), m);
  EXPECT_NE(st.message().find("incomplete"), std::string::npos) << st;
  // Oversized chunk.
  v1::StepRequest c;
  c.mutable_gradient()->set_step(1);
  c.mutable_gradient()->set_param_id(0);
  c.mutable_gradient()->set_data(std::string(8 * 8 * 4 + 4, '\0'));
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), c).code(),
            absl::StatusCode::kOutOfRange);
  // A full, correct step still works after all of that.
  ASSERT_TRUE(r.Send(*svc, 1, {std::vector<float>(64, 1.0f)}).ok());
  auto msgs = r.sink->WaitStep(1);
  ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
  // Step 1 again is a repeat.
  st = r.Send(*svc, 1, {std::vector<float>(64, 1.0f)});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("already complete"), std::string::npos) << st;
}

TEST(Service, NonFiniteGradientSkippedStateUntouched) {
  auto svc = NewService();
  const std::vector<Param> ps = {{"w", 16, 24, v1::SHARDING_REPLICATED}};
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  std::vector<float> g1(16 * 24), g2(16 * 24);
  for (float& x : g1) x = d(rng);
  for (float& x : g2) x = d(rng);
  ASSERT_TRUE(r.Send(*svc, 1, {g1}).ok());
  r.sink->WaitStep(1);
  auto bad = g2;
  bad[30] = NAN;
  ASSERT_TRUE(r.Send(*svc, 2, {bad}).ok());
  auto msgs = r.sink->WaitStep(2);
  bool reported = false;
  for (const auto& m : msgs) {
    if (m.has_error()) {
      reported = m.error().skipped() && m.error().name() == "w" &&
                 m.error().message().find("non-finite") != std::string::npos;
    }
  }
  EXPECT_TRUE(reported);
  for (float x : r.Update(0, msgs)) ASSERT_EQ(x, 0.0f);
  // Step 3 must equal a run that never saw step 2.
  ASSERT_TRUE(r.Send(*svc, 3, {g2}).ok());
  msgs = r.sink->WaitStep(3);
  Reference ref;
  ref.Step(std::vector<double>(g1.begin(), g1.end()), {16, 24});
  auto want = ref.Step(std::vector<double>(g2.begin(), g2.end()), {16, 24});
  EXPECT_LT(RelErr(r.Update(0, msgs), want), 1e-4);
}

TEST(Service, NonFiniteGradientFailsTheStepUnderFailPolicy) {
  ServiceOptions o;
  o.skip_nonfinite = false;
  auto svc = NewService(o);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE,
                                   {{"w", 4, 6, v1::SHARDING_REPLICATED}}))
                  .ok());
  std::vector<float> g(24, 1.0f);
  g[7] = INFINITY;
  ASSERT_TRUE(r.Send(*svc, 1, {g}).ok());
  absl::Status st;
  ASSERT_TRUE(r.sink->WaitAbort(&st));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("parameter 'w' at step 1 has a non-finite value "
                              "(inf) at element (1,1)"),
            std::string::npos)
      << st;
  auto state = GetState(*svc, r.open.session_id());
  EXPECT_FALSE(
      state.ok());  // the job is broken: no half-applied state is served
}

TEST(Service, AutoMethodIsMeasuredCachedAndExact) {
  const std::string tmpl = NewTempDir("tune");
  ServiceOptions o;
  o.autotune_cache = std::string(tmpl) + "/tune.json";
  auto svc = NewService(o);
  auto req = Request("j", 0, 1, v1::TRANSPORT_SHM,
                     {{"w", 32, 128, v1::SHARDING_REPLICATED}});
  req.mutable_groups(0)->set_method("auto");
  Rank r;
  ASSERT_TRUE(r.Open(*svc, req).ok());
  std::vector<float> g(32 * 128);
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (float& x : g) x = d(rng);
  ASSERT_TRUE(r.Send(*svc, 1, {g}).ok());
  auto msgs = r.sink->WaitStep(1);
  Reference ref;
  EXPECT_LT(
      RelErr(r.Update(0, msgs),
             ref.Step(std::vector<double>(g.begin(), g.end()), {32, 128})),
      1e-4);
  kernels::Autotuner cache(o.autotune_cache);
  ASSERT_TRUE(cache.load_status().ok()) << cache.load_status();
  kernels::TuneKey key;
  key.device = kernels::CpuDeviceName();
  key.shape = {32, 128};
  key.schedule = "classic/5";
  auto hit = cache.Lookup(key);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->candidates.size(), 2u);
}

}  // namespace
}  // namespace dmuon::server::testing
