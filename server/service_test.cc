// The service logic without sockets: sessions driven directly, Step
// responses caught by a fake sink, every update compared with an
// independent fp64 Muon reference (momentum in double, NS from the SVD).

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
#include "transport/transport.h"

namespace dmuon::server {
namespace {

using FakeSink = testing::RecordingSink;
using RecordingMetrics = testing::RecordingMetrics;

using Param = testing::TableParam;

std::unique_ptr<OptimizerService> NewService(
    ServiceOptions o = {}, int executors = 2,
    ServiceMetrics* metrics = nullptr) {
  std::vector<std::unique_ptr<Executor>> ex;
  for (int i = 0; i < executors; ++i) ex.push_back(NewCpuExecutor(i, 1));
  return std::make_unique<OptimizerService>(
      o, std::make_unique<Scheduler>(std::move(ex), 4), metrics);
}

v1::OpenSessionRequest Request(const std::string& job, int rank, int world,
                               v1::Transport t,
                               const std::vector<Param>& params) {
  return testing::OpenRequest(job, rank, world, t, params);
}

// A rank as a client would drive it, on a real shm segment or inline.
struct Rank {
  v1::OpenSessionResponse open;
  std::unique_ptr<transport::Region> shm;
  std::shared_ptr<FakeSink> sink = std::make_shared<FakeSink>();
  std::vector<std::string> inline_updates;  // by param

  absl::Status Open(OptimizerService& svc, const v1::OpenSessionRequest& req) {
    auto r = svc.OpenSession(req);
    if (!r.ok()) return r.status();
    open = *r;
    if (open.transport() == v1::TRANSPORT_SHM) {
      auto reg = transport::OpenShmRegion(open.shm_name(),
                                          open.layout().total_bytes());
      if (!reg.ok()) return reg.status();
      shm = std::move(*reg);
    }
    inline_updates.resize(open.layout().slots_size());
    return svc.Attach(open.session_id(), sink);
  }
  // Sends every gradient of `step`; grads[i] is this rank's view.
  absl::Status Send(OptimizerService& svc, int64_t step,
                    const std::vector<std::vector<float>>& grads) {
    v1::StepRequest ready;
    ready.mutable_gradients_ready()->set_step(step);
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& slot = open.layout().slots(i);
      if (shm) {
        std::memcpy(shm->bytes().data() + slot.gradient_offset(),
                    grads[i].data(), slot.bytes());
      } else {
        v1::StepRequest c;
        c.mutable_gradient()->set_step(step);
        c.mutable_gradient()->set_param_id(i);
        c.mutable_gradient()->set_data(grads[i].data(), slot.bytes());
        if (auto st = svc.OnStepRequest(open.session_id(), c); !st.ok())
          return st;
      }
      ready.mutable_gradients_ready()->add_param_ids(i);
    }
    return svc.OnStepRequest(open.session_id(), ready);
  }
  std::vector<float> Update(int param,
                            const std::vector<v1::StepResponse>& msgs) {
    const auto& slot = open.layout().slots(param);
    std::vector<float> out(slot.bytes() / 4);
    if (shm) {
      std::memcpy(out.data(), shm->bytes().data() + slot.update_offset(),
                  slot.bytes());
    } else {
      std::string bytes;
      for (const auto& m : msgs)
        if (m.has_update() && m.update().param_id() == param)
          bytes += m.update().data();
      EXPECT_EQ(bytes.size(), slot.bytes());
      std::memcpy(out.data(), bytes.data(),
                  std::min<size_t>(bytes.size(), slot.bytes()));
    }
    return out;
  }
};

// fp64 Muon (docs/design.md, "The math of a Muon step") for one parameter.
struct Reference {
  std::vector<double> m;
  std::vector<double> Step(const std::vector<double>& g, kernels::Shape s) {
    const double mu = 0.95;
    if (m.empty()) m.assign(g.size(), 0.0);
    std::vector<double> u(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      m[i] = mu * m[i] + (1 - mu) * g[i];
      u[i] = (1 - mu) * g[i] + mu * m[i];
    }
    auto o = kernels::testing::SvdOracle(u, s, kernels::NsOptions{});
    const double scale = std::sqrt(std::max(1.0, double(s.rows) / s.cols));
    for (double& x : o) x *= scale;
    return o;
  }
};

double RelErr(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i)
    num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

// Runs `steps` steps of a `world`-rank job and checks every rank's update.
void RunJob(v1::Transport t, int world, const std::vector<Param>& params,
            int steps, uint64_t seed) {
  auto svc = NewService();
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(ranks[r].Open(*svc, Request("job", r, world, t, params)).ok());
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<Reference> ref(params.size());
  for (int step = 1; step <= steps; ++step) {
    // Whole-matrix gradients per rank; each rank sends its view.
    std::vector<std::vector<std::vector<float>>> full(
        world, std::vector<std::vector<float>>(params.size()));
    std::vector<std::vector<double>> used(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      std::vector<float> base(p.rows * p.cols);
      for (float& x : base) x = d(rng);
      used[i].assign(base.size(), 0.0);
      for (int r = 0; r < world; ++r) {
        full[r][i] = base;
        if (p.sharding == v1::SHARDING_UNREDUCED)
          for (float& x : full[r][i]) x = d(rng);  // each rank its own gradient
      }
      for (size_t k = 0; k < base.size(); ++k) {
        if (p.sharding == v1::SHARDING_UNREDUCED) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += full[r][i][k];
          used[i][k] = sum / world;
        } else {
          used[i][k] = base[k];
        }
      }
    }
    std::vector<std::vector<double>> want(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      want[i] = ref[i].Step(used[i], {params[i].rows, params[i].cols});
    // Ranks send in reverse order: arrival order must not matter.
    for (int r = world - 1; r >= 0; --r) {
      std::vector<std::vector<float>> views(params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& slot = ranks[r].open.layout().slots(i);
        const int64_t rows = slot.local_shape(0);
        const int64_t begin =
            params[i].sharding == v1::SHARDING_ROWS
                ? std::min(params[i].rows,
                           r * ((params[i].rows + world - 1) / world))
                : 0;
        views[i].assign(full[r][i].begin() + begin * params[i].cols,
                        full[r][i].begin() + (begin + rows) * params[i].cols);
      }
      ASSERT_TRUE(ranks[r].Send(*svc, step, views).ok());
    }
    for (int r = 0; r < world; ++r) {
      auto msgs = ranks[r].sink->WaitStep(step);
      ASSERT_FALSE(msgs.empty());
      ASSERT_TRUE(msgs.back().has_step_complete())
          << "rank " << r << " step " << step;
      for (size_t i = 0; i < params.size(); ++i) {
        std::vector<float> got = ranks[r].Update(i, msgs);
        const auto& slot = ranks[r].open.layout().slots(i);
        const int64_t rows = slot.local_shape(0);
        const int64_t begin =
            params[i].sharding == v1::SHARDING_ROWS
                ? std::min(params[i].rows,
                           r * ((params[i].rows + world - 1) / world))
                : 0;
        std::vector<double> w(
            want[i].begin() + begin * params[i].cols,
            want[i].begin() + (begin + rows) * params[i].cols);
        EXPECT_LT(RelErr(got, w), 1e-4)
            << params[i].name << " rank " << r << " step " << step;
      }
    }
  }
  for (auto& r : ranks)
    EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
}

const std::vector<Param> kMixed = {{"attn.w", 48, 48, v1::SHARDING_REPLICATED},
                                   {"mlp.up", 96, 48, v1::SHARDING_ROWS},
                                   {"mlp.down", 48, 96, v1::SHARDING_UNREDUCED},
                                   {"attn.o", 48, 48, v1::SHARDING_REPLICATED}};

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
  auto state = svc->GetState(r.open.session_id());
  EXPECT_FALSE(
      state.ok());  // the job is broken: no half-applied state is served
}

TEST(Service, AutoMethodIsMeasuredCachedAndExact) {
  char tmpl[] = "/tmp/dmuon-tune-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
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

// Random gradients for every parameter of `ps` (whole matrices).
std::vector<std::vector<float>> RandomGradients(const std::vector<Param>& ps,
                                                std::mt19937_64& rng) {
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> g;
  for (const Param& p : ps) {
    g.emplace_back(p.rows * p.cols);
    for (float& x : g.back()) x = d(rng);
  }
  return g;
}

// The planner's cost of a parameter nothing measured (service.h).
double ModelCost(kernels::Shape shape) {
  return kernels::EstimateCost(kernels::Method::kDirect, shape,
                               kernels::NsOptions())
             .flops /
         kNominalFlopsPerSecond;
}

TEST(Service, StatusReportsPredictedAndMeasuredLoadPerExecutor) {
  RecordingMetrics metrics;
  auto svc = NewService({}, 3, &metrics);
  // Two matrices on three executors: the planner puts the larger on cpu:0,
  // the other on cpu:1; cpu:2 stays idle.
  const std::vector<Param> ps = {{"big", 96, 64, v1::SHARDING_REPLICATED},
                                 {"small", 40, 40, v1::SHARDING_REPLICATED}};
  const std::vector<double> costs = {ModelCost({96, 64}), ModelCost({40, 40})};
  const planner::Plan plan = planner::PlanBest(costs, {}, 3);
  ASSERT_EQ(plan.executor_of, (std::vector<int>{0, 1}));
  Rank a;
  ASSERT_TRUE(a.Open(*svc, Request("a", 0, 1, v1::TRANSPORT_SHM, ps)).ok());

  // Planned before any step; nothing measured yet.
  v1::StatusResponse st = svc->Status();
  ASSERT_EQ(st.executors_size(), 3);
  for (int e = 0; e < 3; ++e) {
    EXPECT_DOUBLE_EQ(st.executors(e).predicted_step_seconds(),
                     plan.predicted_load[e])
        << e;
    EXPECT_EQ(st.executors(e).measured_step_seconds(), 0) << e;
  }

  std::mt19937_64 rng(std::random_device{}());
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(a.Send(*svc, step, RandomGradients(ps, rng)).ok());
    auto msgs = a.sink->WaitStep(step);
    ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
  }
  st = svc->Status();
  EXPECT_DOUBLE_EQ(st.executors(0).predicted_step_seconds(), costs[0]);
  EXPECT_DOUBLE_EQ(st.executors(1).predicted_step_seconds(), costs[1]);
  EXPECT_EQ(st.executors(2).predicted_step_seconds(), 0);
  for (int e = 0; e < 2; ++e) {
    const double m = st.executors(e).measured_step_seconds();
    EXPECT_TRUE(std::isfinite(m) && m > 0) << e << ": " << m;
    // One step of one small matrix: well under the time it all took.
    EXPECT_LT(m, st.uptime_seconds()) << e;
  }
  EXPECT_EQ(st.executors(2).measured_step_seconds(), 0);
  // The job's own breakdown, one entry per executor.
  ASSERT_EQ(st.jobs_size(), 1);
  ASSERT_EQ(st.jobs(0).executor_loads_size(), 3);
  for (int e = 0; e < 3; ++e) {
    const v1::ExecutorLoad& l = st.jobs(0).executor_loads(e);
    EXPECT_EQ(l.device(), st.executors(e).device());
    EXPECT_EQ(l.predicted_step_seconds(),
              st.executors(e).predicted_step_seconds());
    EXPECT_EQ(l.measured_step_seconds(),
              st.executors(e).measured_step_seconds());
  }
  // The metrics' executor source serves the same numbers (how /metrics
  // renders them: daemon/prometheus_metrics_test.cc).
  const std::vector<ExecutorStats> exported = metrics.Executors();
  ASSERT_EQ(exported.size(), 3u);
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(exported[e].device, "cpu:" + std::to_string(e));
    EXPECT_DOUBLE_EQ(exported[e].predicted_step_seconds,
                     st.executors(e).predicted_step_seconds())
        << e;
    EXPECT_DOUBLE_EQ(exported[e].measured_step_seconds,
                     st.executors(e).measured_step_seconds())
        << e;
  }

  // A second job adds its plan to the sums (its one matrix goes to cpu:0)
  // but no measurement until it completes a step.
  const std::vector<Param> qs = {{"v", 64, 32, v1::SHARDING_REPLICATED}};
  Rank b;
  ASSERT_TRUE(b.Open(*svc, Request("b", 0, 1, v1::TRANSPORT_INLINE, qs)).ok());
  const double cost_b = ModelCost({64, 32});
  const v1::StatusResponse both = svc->Status();
  EXPECT_DOUBLE_EQ(both.executors(0).predicted_step_seconds(),
                   costs[0] + cost_b);
  EXPECT_DOUBLE_EQ(both.executors(1).predicted_step_seconds(), costs[1]);
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(both.executors(e).measured_step_seconds(),
              st.executors(e).measured_step_seconds())
        << e;
  }

  // Closed jobs no longer load the executors (their listing stays).
  ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
  st = svc->Status();
  EXPECT_DOUBLE_EQ(st.executors(0).predicted_step_seconds(), cost_b);
  for (int e = 0; e < 3; ++e) {
    if (e > 0) {
      EXPECT_EQ(st.executors(e).predicted_step_seconds(), 0) << e;
    }
    EXPECT_EQ(st.executors(e).measured_step_seconds(), 0) << e;
  }
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  st = svc->Status();
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(st.executors(e).predicted_step_seconds(), 0) << e;
    EXPECT_EQ(st.executors(e).measured_step_seconds(), 0) << e;
  }
  EXPECT_EQ(st.jobs_size(), 2);
  EXPECT_EQ(metrics.Executors().at(0).predicted_step_seconds, 0);
}

// A measurement backend that is not the CPU's: deterministic times per
// shape, recorded calls.
struct FakeTuning {
  std::vector<std::string> calls;  // "RxC/bN/method"

  Tuning Make() {
    Tuning t;
    t.device = "fake:accelerator";
    t.dtype = "bf16/f16";
    t.tolerance = 1e-2;
    t.measure = [this](kernels::Shape shape, int64_t batch,
                       const kernels::NsOptions& ns) {
      return kernels::Autotuner::MeasureFn(
          [this, shape,
           batch](kernels::Method m) -> absl::StatusOr<kernels::Measurement> {
            calls.push_back(absl::StrCat(shape.rows, "x", shape.cols, "/b",
                                         batch, "/",
                                         std::string(kernels::MethodName(m))));
            return Time(shape, m);
          });
    };
    return t;
  }
  // 32x128: Gram faster. 64x64: direct faster. 16x64: Gram faster but
  // outside the tolerance, so direct.
  static kernels::Measurement Time(kernels::Shape s, kernels::Method m) {
    const bool gram = m == kernels::Method::kGram;
    kernels::Measurement x;
    x.error = 1e-6;
    if (s.rows == 32 && s.cols == 128) {
      x.seconds = gram ? 1e-3 : 2e-3;
    } else if (s.rows == 64 && s.cols == 64) {
      x.seconds = gram ? 5e-3 : 3e-3;
    } else {
      x.seconds = gram ? 0.5e-3 : 4e-3;
      if (gram) x.error = 0.5;
    }
    return x;
  }
};

TEST(Service, PluggedTuningKeysTheCacheChoosesTheMethodAndCostsThePlan) {
  char tmpl[] = "/tmp/dmuon-tune-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  FakeTuning fake;
  ServiceOptions o;
  o.autotune_cache = std::string(tmpl) + "/tune.json";
  o.tuning = fake.Make();
  const std::vector<Param> ps = {{"wide", 32, 128, v1::SHARDING_REPLICATED},
                                 {"square", 64, 64, v1::SHARDING_REPLICATED},
                                 {"noisy", 16, 64, v1::SHARDING_REPLICATED}};
  auto req = Request("j", 0, 1, v1::TRANSPORT_SHM, ps);
  req.mutable_groups(0)->set_method("auto");
  const kernels::Method chosen[] = {kernels::Method::kGram,
                                    kernels::Method::kDirect,
                                    kernels::Method::kDirect};
  std::vector<double> costs;
  for (size_t i = 0; i < ps.size(); ++i)
    costs.push_back(
        FakeTuning::Time({ps[i].rows, ps[i].cols}, chosen[i]).seconds);
  EXPECT_EQ(costs, (std::vector<double>{1e-3, 3e-3, 4e-3}));
  const planner::Plan plan = planner::PlanBest(costs, {}, 2);

  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(r.Open(*svc, req).ok());
    // Both methods measured once per shape, one matrix at a time.
    EXPECT_EQ(fake.calls,
              (std::vector<std::string>{"32x128/b1/direct", "32x128/b1/gram",
                                        "64x64/b1/direct", "64x64/b1/gram",
                                        "16x64/b1/direct", "16x64/b1/gram"}));
    // The plan balances the measured seconds of the chosen methods.
    v1::StatusResponse st = svc->Status();
    ASSERT_EQ(st.executors_size(), 2);
    double total = 0;
    for (int e = 0; e < 2; ++e) {
      EXPECT_DOUBLE_EQ(st.executors(e).predicted_step_seconds(),
                       plan.predicted_load[e])
          << e;
      total += st.executors(e).predicted_step_seconds();
    }
    EXPECT_NEAR(total, 8e-3, 1e-15);

    // The step runs the chosen methods (the executors count their flops)
    // and is still exact Muon.
    std::mt19937_64 rng(std::random_device{}());
    const auto g = RandomGradients(ps, rng);
    ASSERT_TRUE(r.Send(*svc, 1, g).ok());
    auto msgs = r.sink->WaitStep(1);
    ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
    for (size_t i = 0; i < ps.size(); ++i) {
      Reference ref;
      EXPECT_LT(RelErr(r.Update(i, msgs),
                       ref.Step(std::vector<double>(g[i].begin(), g[i].end()),
                                {ps[i].rows, ps[i].cols})),
                1e-4)
          << ps[i].name;
    }
    double want_flops = 0, direct_flops = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      const kernels::Shape shape{ps[i].rows, ps[i].cols};
      want_flops +=
          kernels::EstimateCost(chosen[i], shape, kernels::NsOptions()).flops;
      direct_flops += kernels::EstimateCost(kernels::Method::kDirect, shape,
                                            kernels::NsOptions())
                          .flops;
    }
    ASSERT_NE(want_flops, direct_flops);
    // An executor counts its matrices just after delivering their updates.
    double flops = 0;
    for (int tries = 0; tries < 2000; ++tries) {
      st = svc->Status();
      uint64_t matrices = 0;
      flops = 0;
      for (const auto& e : st.executors()) {
        flops += e.flops();
        matrices += e.matrices();
      }
      if (matrices == ps.size()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_DOUBLE_EQ(flops, want_flops);
  }

  // The cache is keyed by the backend's device and dtype, not the CPU's.
  kernels::Autotuner cache(o.autotune_cache);
  ASSERT_TRUE(cache.load_status().ok()) << cache.load_status();
  for (size_t i = 0; i < ps.size(); ++i) {
    kernels::TuneKey key;
    key.device = "fake:accelerator";
    key.dtype = "bf16/f16";
    key.shape = {ps[i].rows, ps[i].cols};
    key.schedule = "classic/5";
    auto hit = cache.Lookup(key);
    ASSERT_TRUE(hit.has_value()) << key.ToString();
    EXPECT_EQ(hit->method, chosen[i]) << key.ToString();
    EXPECT_EQ(hit->candidates.size(), 2u);
    key.device = kernels::CpuDeviceName();
    key.dtype = "f32";
    EXPECT_FALSE(cache.Lookup(key).has_value()) << key.ToString();
  }

  // A daemon restarted on the cache measures nothing and plans the same.
  fake.calls.clear();
  auto svc = NewService(o);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, req).ok());
  EXPECT_TRUE(fake.calls.empty());
  const v1::StatusResponse st = svc->Status();
  for (int e = 0; e < 2; ++e) {
    EXPECT_DOUBLE_EQ(st.executors(e).predicted_step_seconds(),
                     plan.predicted_load[e])
        << e;
  }
}

TEST(Service, MeasuringANewTableHoldsNoOtherCallUp) {
  // The tuning backend blocks until released: while it measures inside one
  // OpenSession, Status and another job's OpenSession must still answer.
  char tmpl[] = "/tmp/dmuon-tunelock-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  std::atomic<bool> first{true};
  ServiceOptions o;
  o.autotune_cache = std::string(tmpl) + "/tune.json";
  o.tuning.device = "fake:slow";
  o.tuning.measure = [&](kernels::Shape, int64_t, const kernels::NsOptions&) {
    return kernels::Autotuner::MeasureFn(
        [&](kernels::Method m) -> absl::StatusOr<kernels::Measurement> {
          if (first.exchange(false)) {
            entered.set_value();
            go.wait();
          }
          kernels::Measurement x;
          x.seconds = m == kernels::Method::kDirect ? 1e-3 : 2e-3;
          x.error = 1e-6;
          return x;
        });
  };
  auto svc = NewService(o);
  auto slow = Request("slow", 0, 1, v1::TRANSPORT_SHM,
                      {{"w", 32, 64, v1::SHARDING_REPLICATED}});
  slow.mutable_groups(0)->set_method("auto");
  Rank a;
  std::thread opener([&] { EXPECT_TRUE(a.Open(*svc, slow).ok()); });
  entered.get_future().wait();
  auto status = std::async(std::launch::async, [&] { return svc->Status(); });
  Rank b;  // method "direct": nothing to measure
  auto other = std::async(std::launch::async, [&] {
    return b.Open(*svc, Request("other", 0, 1, v1::TRANSPORT_SHM,
                                {{"v", 16, 16, v1::SHARDING_REPLICATED}}));
  });
  const bool answered =
      status.wait_for(std::chrono::seconds(20)) == std::future_status::ready &&
      other.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  release.set_value();
  opener.join();
  ASSERT_TRUE(answered) << "a call waited for another job's measurement";
  EXPECT_TRUE(other.get().ok());
  EXPECT_LE(status.get().jobs_size(), 1);  // "slow" was still being measured
  EXPECT_EQ(svc->Status().jobs_size(), 2);
}

TEST(Service, PlanSpreadsEachLayerOverTheExecutors) {
  // Four matrices of equal measured cost (a backend timing every shape
  // alike) but different shapes, so the executors' flops tell which ran
  // where; layers 0, 1, 0, 1 in table order. By cost alone (ties by index)
  // cpu:0 would get both of layer 0 and cpu:1 both of layer 1.
  char tmpl[] = "/tmp/dmuon-layers-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.autotune_cache = std::string(tmpl) + "/tune.json";
  o.tuning.device = "fake:uniform";
  o.tuning.measure = [](kernels::Shape, int64_t, const kernels::NsOptions&) {
    return kernels::Autotuner::MeasureFn(
        [](kernels::Method m) -> absl::StatusOr<kernels::Measurement> {
          kernels::Measurement x;
          x.seconds = m == kernels::Method::kDirect ? 1e-3 : 2e-3;
          x.error = 1e-6;
          return x;
        });
  };
  const std::vector<Param> ps = {{"b0.q", 32, 64, v1::SHARDING_REPLICATED},
                                 {"b1.q", 40, 64, v1::SHARDING_REPLICATED},
                                 {"b0.k", 48, 64, v1::SHARDING_REPLICATED},
                                 {"b1.k", 56, 64, v1::SHARDING_REPLICATED}};
  const std::vector<int> layers = {0, 1, 0, 1};
  auto req = Request("j", 0, 1, v1::TRANSPORT_SHM, ps);
  req.mutable_groups(0)->set_method("auto");
  for (int i = 0; i < 4; ++i) req.mutable_parameters(i)->set_layer(layers[i]);
  const std::vector<double> costs(4, 1e-3);
  const planner::Plan plan = planner::PlanBest(costs, layers, 2);
  EXPECT_EQ(planner::SameLayerPairs(plan.executor_of, layers), 0);
  EXPECT_EQ(planner::SameLayerPairs(planner::PlanBest(costs, {}, 2).executor_of,
                                    layers),
            2);

  auto svc = NewService(o);
  Rank r;
  ASSERT_TRUE(r.Open(*svc, req).ok());
  std::mt19937_64 rng(std::random_device{}());
  ASSERT_TRUE(r.Send(*svc, 1, RandomGradients(ps, rng)).ok());
  auto msgs = r.sink->WaitStep(1);
  ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
  // An executor counts its matrices just after delivering their updates.
  v1::StatusResponse st;
  for (int tries = 0; tries < 2000; ++tries) {
    st = svc->Status();
    ASSERT_EQ(st.executors_size(), 2);
    if (st.executors(0).matrices() + st.executors(1).matrices() == 4) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<double> want(2, 0.0);
  for (int i = 0; i < 4; ++i) {
    want[plan.executor_of[i]] +=
        kernels::EstimateCost(kernels::Method::kDirect,
                              {ps[i].rows, ps[i].cols}, kernels::NsOptions())
            .flops;
  }
  for (int e = 0; e < 2; ++e) {
    EXPECT_EQ(st.executors(e).matrices(), 2u) << e;
    EXPECT_DOUBLE_EQ(st.executors(e).flops(), want[e]) << e;
    EXPECT_DOUBLE_EQ(st.executors(e).predicted_step_seconds(), 2e-3) << e;
  }
}

TEST(Service, RankLeavingMidStepAbortsItsJobOnly) {
  auto svc = NewService();
  const std::vector<Param> ps = {{"w", 8, 8, v1::SHARDING_UNREDUCED}};
  Rank a, b, other;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(other.Open(*svc, Request("k", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  ASSERT_TRUE(a.Send(*svc, 1, {std::vector<float>(64, 1.0f)}).ok());
  svc->Detach(b.open.session_id(), absl::CancelledError("client died"));
  absl::Status st;
  ASSERT_TRUE(a.sink->WaitAbort(&st));
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted);
  EXPECT_NE(st.message().find("rank 1 of job 'j' left mid-step"),
            std::string::npos)
      << st;
  // The segment of the dead rank is gone; the other job keeps stepping.
  EXPECT_EQ(transport::OpenShmRegion(b.open.shm_name(), 1).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(other.Send(*svc, 1, {std::vector<float>(64, 2.0f)}).ok());
  auto msgs = other.sink->WaitStep(1);
  EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
}

TEST(Service, ShrunkSegmentIsDataLoss) {
  auto svc = NewService();
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM,
                                   {{"w", 32, 32, v1::SHARDING_REPLICATED}}))
                  .ok());
  // The client shrinks its segment (through its own descriptor).
  int fd = -1;
  for (int cand = 3; cand < 1024; ++cand) {
    char path[64], link[256] = {0};
    snprintf(path, sizeof(path), "/proc/self/fd/%d", cand);
    if (readlink(path, link, sizeof(link) - 1) > 0 &&
        std::string(link).find(r.open.shm_name().substr(1)) !=
            std::string::npos) {
      fd = cand;
    }
  }
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);
  v1::StepRequest m;
  m.mutable_gradients_ready()->set_step(1);
  m.mutable_gradients_ready()->add_param_ids(0);
  EXPECT_EQ(svc->OnStepRequest(r.open.session_id(), m).code(),
            absl::StatusCode::kDataLoss);
}

TEST(Service, StateRoundTripContinuesLikeUninterrupted) {
  const std::vector<Param> ps = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                 {"b", 40, 24, v1::SHARDING_REPLICATED}};
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  std::vector<std::vector<std::vector<float>>> grads(4);
  for (auto& step : grads) {
    for (const auto& p : ps) {
      step.emplace_back(p.rows * p.cols);
      for (float& x : step.back()) x = d(rng);
    }
  }
  auto run = [&](OptimizerService& svc, Rank& r, int from, int to) {
    std::vector<std::vector<float>> last;
    for (int s = from; s <= to; ++s) {
      EXPECT_TRUE(r.Send(svc, s, grads[s - 1]).ok());
      auto msgs = r.sink->WaitStep(s);
      last = {r.Update(0, msgs), r.Update(1, msgs)};
    }
    return last;
  };
  auto svc1 = NewService();
  Rank r1;
  ASSERT_TRUE(
      r1.Open(*svc1, Request("j", 0, 1, v1::TRANSPORT_INLINE, ps)).ok());
  run(*svc1, r1, 1, 2);
  auto state = svc1->GetState(r1.open.session_id());
  ASSERT_TRUE(state.ok()) << state.status();
  auto straight = run(*svc1, r1, 3, 4);

  auto svc2 = NewService();
  Rank r2;
  ASSERT_TRUE(r2.Open(*svc2, Request("j", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  (*state)[0].set_session_id(r2.open.session_id());
  auto set = svc2->SetState(*state);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(*set, 2);
  auto resumed = run(*svc2, r2, 3, 4);
  EXPECT_EQ(resumed, straight);  // bit for bit

  // A state whose table differs is refused, naming the parameter.
  auto other = *state;
  other[0].mutable_header()->mutable_parameters(1)->set_shape(0, 41);
  EXPECT_EQ(svc2->SetState(other).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Service, SnapshotResumesAfterRestart) {
  char tmpl[] = "/tmp/dmuon-state-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;
  o.snapshot_every = 1;
  const std::vector<Param> ps = {{"w", 20, 30, v1::SHARDING_REPLICATED}};
  std::vector<std::vector<float>> g(3, std::vector<float>(600));
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> d;
  for (auto& v : g)
    for (float& x : v) x = d(rng);
  std::vector<float> straight;
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    for (int s = 1; s <= 2; ++s) {
      ASSERT_TRUE(r.Send(*svc, s, {g[s - 1]}).ok());
      r.sink->WaitStep(s);
    }
  }  // the daemon goes away after step 2 (snapshot written at each step)
  {
    auto ref = NewService();
    Rank r;
    ASSERT_TRUE(r.Open(*ref, Request("x", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    for (int s = 1; s <= 3; ++s) {
      ASSERT_TRUE(r.Send(*ref, s, {g[s - 1]}).ok());
      auto msgs = r.sink->WaitStep(s);
      straight = r.Update(0, msgs);
    }
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  EXPECT_EQ(r.open.next_step(), 3);
  ASSERT_TRUE(r.Send(*svc, 3, {g[2]}).ok());
  auto msgs = r.sink->WaitStep(3);
  EXPECT_EQ(r.Update(0, msgs), straight);
}

TEST(Service, RacingSnapshotsEndWithTheNewestState) {
  // --snapshot-every writes (on the step's thread) race whole-daemon
  // snapshots (shutdown, here a thread calling SnapshotAll without pause):
  // every write must succeed and the file must end with the last step.
  char tmpl[] = "/tmp/dmuon-race-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;
  o.snapshot_every = 1;
  const std::vector<Param> ps = {{"w", 48, 64, v1::SHARDING_REPLICATED}};
  std::mt19937_64 rng(std::random_device{}());
  constexpr int kSteps = 30;
  {
    auto svc = NewService(o);
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("race", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0}, writes{0};
    std::thread spammer([&] {
      while (!stop) {
        if (!svc->SnapshotAll().ok()) failures++;
        writes++;
      }
    });
    for (int s = 1; s <= kSteps; ++s) {
      ASSERT_TRUE(r.Send(*svc, s, RandomGradients(ps, rng)).ok());
      r.sink->WaitStep(s);
    }
    stop = true;
    spammer.join();
    EXPECT_EQ(failures.load(), 0) << "of " << writes.load();
    EXPECT_EQ(svc->Status().errors_size(), 0);
  }
  auto svc = NewService(o);
  ASSERT_TRUE(svc->LoadSnapshots().ok());
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("race", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  EXPECT_EQ(r.open.next_step(), kSteps + 1);
}

// Idle jobs (ServiceOptions::job_retention_seconds): the reaper is driven
// with the test's clock, never started.
using Clock = std::chrono::steady_clock;

// Runs steps `from`..`from + grads.size() - 1` of a one-rank job and returns
// the last step's update of each parameter.
std::vector<std::vector<float>> RunSteps(
    OptimizerService& svc, Rank& r, int64_t from,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> last;
  for (size_t k = 0; k < grads.size(); ++k) {
    const int64_t step = from + static_cast<int64_t>(k);
    EXPECT_TRUE(r.Send(svc, step, grads[k]).ok()) << "step " << step;
    auto msgs = r.sink->WaitStep(step);
    EXPECT_TRUE(!msgs.empty() && msgs.back().has_step_complete())
        << "step " << step;
    last.clear();
    for (int i = 0; i < r.open.layout().slots_size(); ++i)
      last.push_back(r.Update(i, msgs));
  }
  return last;
}

// Feeds `grads` (by step, by parameter) to one fp64 reference per parameter
// and returns the last step's updates.
std::vector<std::vector<double>> ReferenceSteps(
    std::vector<Reference>& ref, const std::vector<Param>& ps,
    const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<double>> want(ps.size());
  for (const auto& step : grads) {
    for (size_t i = 0; i < ps.size(); ++i) {
      want[i] = ref[i].Step(std::vector<double>(step[i].begin(), step[i].end()),
                            {ps[i].rows, ps[i].cols});
    }
  }
  return want;
}

std::vector<std::vector<std::vector<float>>> StepsOfGradients(
    const std::vector<Param>& ps, int steps, std::mt19937_64& rng) {
  std::vector<std::vector<std::vector<float>>> g;
  for (int k = 0; k < steps; ++k) g.push_back(RandomGradients(ps, rng));
  return g;
}

const std::vector<Param> kIdle = {{"a", 24, 40, v1::SHARDING_REPLICATED},
                                  {"b", 40, 24, v1::SHARDING_REPLICATED}};

TEST(Service, IdleJobResumesBeforeItsRetentionAndIsDroppedAfter) {
  RecordingMetrics metrics;
  ServiceOptions o;
  o.job_retention_seconds = 600;
  auto svc = NewService(o, 2, &metrics);
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 4, rng);
  std::vector<Reference> ref(kIdle.size());
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
    RunSteps(*svc, r, 1, {g[0], g[1]});
    ReferenceSteps(ref, kIdle, {g[0], g[1]});
    EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0) << "a rank is open";
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  const Clock::time_point closed = Clock::now();
  v1::StatusResponse st = svc->Status();
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).ranks_open(), 0);
  EXPECT_GT(st.jobs(0).drop_in_seconds(), 590);
  EXPECT_LE(st.jobs(0).drop_in_seconds(), 600);

  // Before the deadline: kept, and the next drop time is reported.
  ReapResult reap = svc->ReapIdleJobs(closed + std::chrono::seconds(599));
  EXPECT_TRUE(reap.dropped.empty());
  EXPECT_TRUE(reap.failed.empty());
  EXPECT_GT(reap.next, closed + std::chrono::seconds(599));
  EXPECT_LE(reap.next, Clock::now() + std::chrono::seconds(600));
  ASSERT_EQ(svc->Status().jobs_size(), 1);

  // Reopened: the daemon-held momentum continues (step 3 after 1 and 2).
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 3);
    const auto got = RunSteps(*svc, r, 3, {g[2]});
    const auto want = ReferenceSteps(ref, kIdle, {g[2]});
    for (size_t i = 0; i < kIdle.size(); ++i)
      EXPECT_LT(RelErr(got[i], want[i]), 1e-4) << kIdle[i].name;
    // Open again: never dropped, however late.
    EXPECT_TRUE(svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24))
                    .dropped.empty());
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }

  // After the deadline: gone from Status and /metrics.
  reap = svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(601));
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_EQ(reap.dropped[0].first, "j");
  EXPECT_FALSE(reap.dropped[0].second) << "no --state-dir: no snapshot";
  EXPECT_EQ(reap.next, Clock::time_point::max());
  st = svc->Status();
  EXPECT_EQ(st.jobs_size(), 0);
  EXPECT_EQ(metrics.jobs(), 0);
  EXPECT_TRUE(
      svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24)).dropped.empty());

  // Reopened after the drop, without --state-dir: zero momentum, step 1.
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
  const auto got = RunSteps(*svc, r, 1, {g[3]});
  std::vector<Reference> fresh(kIdle.size());
  const auto want = ReferenceSteps(fresh, kIdle, {g[3]});
  for (size_t i = 0; i < kIdle.size(); ++i)
    EXPECT_LT(RelErr(got[i], want[i]), 1e-4) << kIdle[i].name;
}

TEST(Service, RetentionZeroDropsWhenTheLastRankCloses) {
  ServiceOptions o;
  o.job_retention_seconds = 0;
  auto svc = NewService(o);
  std::mt19937_64 rng(std::random_device{}());
  Rank a, b;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  const auto g = RandomGradients(kIdle, rng);
  ASSERT_TRUE(a.Send(*svc, 1, g).ok());
  ASSERT_TRUE(b.Send(*svc, 1, g).ok());
  a.sink->WaitStep(1);
  b.sink->WaitStep(1);
  ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
  // One rank still open: kept.
  EXPECT_TRUE(svc->ReapIdleJobs(Clock::now()).dropped.empty());
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0) << "due now";
  const ReapResult reap = svc->ReapIdleJobs(Clock::now());
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_EQ(svc->Status().jobs_size(), 0);
}

TEST(Service, ReattachingOneRankCancelsTheDrop) {
  ServiceOptions o;
  o.job_retention_seconds = 600;
  auto svc = NewService(o);
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 2, rng);
  std::vector<Reference> ref(kIdle.size());
  ReferenceSteps(ref, kIdle, {g[0]});
  {
    Rank a, b;
    ASSERT_TRUE(
        a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
    ASSERT_TRUE(
        b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
    ASSERT_TRUE(a.Send(*svc, 1, g[0]).ok());
    ASSERT_TRUE(b.Send(*svc, 1, g[0]).ok());
    a.sink->WaitStep(1);
    b.sink->WaitStep(1);
    ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
    // The stream of the last rank ends between steps (not a clean close):
    // the job is idle all the same, not broken.
    EXPECT_TRUE(svc->Detach(b.open.session_id(),
                            absl::CancelledError("trainer restarted")));
  }
  // Rank 0 is back: the drop is off, even long after its time.
  Rank a;
  ASSERT_TRUE(a.Open(*svc, Request("j", 0, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(svc->Status().jobs(0).drop_in_seconds(), 0);
  EXPECT_TRUE(
      svc->ReapIdleJobs(Clock::now() + std::chrono::hours(24)).dropped.empty());
  Rank b;
  ASSERT_TRUE(b.Open(*svc, Request("j", 1, 2, v1::TRANSPORT_SHM, kIdle)).ok());
  EXPECT_EQ(b.open.next_step(), 2);
  ASSERT_TRUE(a.Send(*svc, 2, g[1]).ok());
  ASSERT_TRUE(b.Send(*svc, 2, g[1]).ok());
  const auto msgs = a.sink->WaitStep(2);
  b.sink->WaitStep(2);
  const auto want = ReferenceSteps(ref, kIdle, {g[1]});
  for (size_t i = 0; i < kIdle.size(); ++i)
    EXPECT_LT(RelErr(a.Update(i, msgs), want[i]), 1e-4) << kIdle[i].name;
  // Closing again restarts the whole retention from this close.
  const Clock::time_point before = Clock::now();
  ASSERT_TRUE(svc->CloseSession(a.open.session_id()).ok());
  ASSERT_TRUE(svc->CloseSession(b.open.session_id()).ok());
  EXPECT_TRUE(
      svc->ReapIdleJobs(before + std::chrono::seconds(599)).dropped.empty());
  EXPECT_EQ(svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(600))
                .dropped.size(),
            1u);
}

TEST(Service, DroppedJobWithStateDirResumesBitExactlyFromItsSnapshot) {
  char tmpl[] = "/tmp/dmuon-idle-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  ServiceOptions o;
  o.state_dir = tmpl;  // snapshot_every 0: only the drop writes one
  o.job_retention_seconds = 30;
  std::mt19937_64 rng(std::random_device{}());
  const auto g = StepsOfGradients(kIdle, 4, rng);
  // The same steps without interruption, on a daemon that keeps the job.
  std::vector<std::vector<float>> straight;
  {
    auto ref = NewService();
    Rank r;
    ASSERT_TRUE(
        r.Open(*ref, Request("x", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    straight = RunSteps(*ref, r, 1, g);
  }
  auto svc = NewService(o);
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
    RunSteps(*svc, r, 1, {g[0], g[1]});
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }
  const std::string file = std::string(tmpl) + "/job-736e6170.dmst";
  EXPECT_NE(access(file.c_str(), F_OK), 0) << "nothing written before";
  const ReapResult reap =
      svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(31));
  ASSERT_EQ(reap.dropped.size(), 1u);
  EXPECT_TRUE(reap.dropped[0].second) << "snapshotted";
  EXPECT_TRUE(reap.failed.empty());
  EXPECT_EQ(access(file.c_str(), F_OK), 0);
  EXPECT_EQ(svc->Status().jobs_size(), 0);
  // A shutdown snapshot now leaves the dropped job's file alone.
  ASSERT_TRUE(svc->SnapshotAll().ok());

  // Reopened (over another transport): step 3 from the snapshot, then 4.
  {
    Rank r;
    ASSERT_TRUE(
        r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
    EXPECT_EQ(r.open.next_step(), 3);
    EXPECT_EQ(RunSteps(*svc, r, 3, {g[2], g[3]}), straight);  // bit for bit
    ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  }

  // Dropped again (step 4 saved), and the file damaged: a reopen is refused
  // rather than silently starting from zero; once the file is removed, the
  // job starts afresh.
  ASSERT_EQ(
      svc->ReapIdleJobs(Clock::now() + std::chrono::seconds(31)).dropped.size(),
      1u);
  {
    FILE* f = fopen(file.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    fseek(f, 40, SEEK_SET);
    fputc(0x5a, f);
    fclose(f);
  }
  auto refused =
      svc->OpenSession(Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("remove " + file),
            std::string::npos)
      << refused.status();
  ASSERT_EQ(unlink(file.c_str()), 0);
  Rank r;
  ASSERT_TRUE(
      r.Open(*svc, Request("snap", 0, 1, v1::TRANSPORT_INLINE, kIdle)).ok());
  EXPECT_EQ(r.open.next_step(), 1);
}

TEST(Service, ReaperThreadDropsIdleJobsByItself) {
  ServiceOptions o;
  o.job_retention_seconds = 0;
  // Outlive the service: its reaper thread reports into them.
  absl::Mutex mu;
  std::vector<std::string> reported;  // guarded by mu
  auto svc = NewService(o);
  svc->StartReaper([&](const ReapResult& r) {
    absl::MutexLock lock(&mu);
    for (const auto& [job, snapshotted] : r.dropped) reported.push_back(job);
  });
  Rank r;
  ASSERT_TRUE(r.Open(*svc, Request("j", 0, 1, v1::TRANSPORT_SHM, kIdle)).ok());
  std::mt19937_64 rng(std::random_device{}());
  RunSteps(*svc, r, 1, {RandomGradients(kIdle, rng)});
  EXPECT_EQ(svc->Status().jobs_size(), 1) << "open: kept";
  ASSERT_TRUE(svc->CloseSession(r.open.session_id()).ok());
  // The report comes after the drop.
  auto reported_one = [&] { return !reported.empty(); };  // under mu
  absl::MutexLock lock(&mu);
  mu.AwaitWithTimeout(absl::Condition(&reported_one), absl::Seconds(10));
  EXPECT_EQ(svc->Status().jobs_size(), 0);
  EXPECT_EQ(reported, std::vector<std::string>{"j"});
}

}  // namespace
}  // namespace dmuon::server
