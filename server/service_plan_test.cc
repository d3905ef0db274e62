// The service's plan and load without sockets: per-executor predicted and
// measured load in Status, a plugged-in tuning backend keying the cache and
// costing the plan, measuring without holding other calls, layers spread
// over the executors.

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
#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_metrics.h"
#include "server/testing/recording_sink.h"
#include "server/testing/service_harness.h"
#include "server/testing/temp_dir.h"
#include "transport/transport.h"

namespace dmuon::server::testing {
namespace {

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
  const std::string tmpl = NewTempDir("tune");
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
  const std::string tmpl = NewTempDir("tunelock");
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
  const std::string tmpl = NewTempDir("layers");
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

}  // namespace
}  // namespace dmuon::server::testing
