#include "benchmarks/scaling/simulator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "benchmarks/scaling/workload.h"

namespace dmuon::scaling {
namespace {

constexpr char kShapes[] = "benchmarks/data/model_shapes.json";

Timeline Flat(int segs, double fwd, double bwd) {
  Timeline t;
  t.forward_s.assign(segs, fwd);
  t.backward_s.assign(segs, bwd);
  return t;
}

Task T(int segment, int owner, int key, double kernel) {
  Task t;
  t.segment = segment;
  t.owner = owner;
  t.shape_key = key;
  t.kernel_s = kernel;
  return t;
}

Workload Llama8b() {
  auto models = LoadModels(kShapes);
  EXPECT_TRUE(models.ok()) << models.status();
  auto m = FindModel(*models, "llama-3-8b");
  EXPECT_TRUE(m.ok()) << m.status();
  auto w = BuildWorkload(*m, KernelTimes::CostModel({}), {});
  EXPECT_TRUE(w.ok()) << w.status();
  return *w;
}

double Row(const std::vector<StrategyResult>& rows, const std::string& name,
           bool exposed = true) {
  for (const auto& r : rows)
    if (r.strategy == name) return exposed ? r.exposed_s : r.optimizer_s;
  ADD_FAILURE() << "no row " << name;
  return -1;
}

TEST(Pool, OneGpuNoOverlapIsTheSumOfKernelTimes) {
  for (Placement p : {Placement::kShared, Placement::kDedicated}) {
    auto r =
        SimulatePool(Flat(3, 0, 0),
                     {T(0, 0, 0, 1), T(1, 0, 1, 2), T(2, 0, 2, 3)}, {1, p, 16});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_DOUBLE_EQ(r->exposed, 6);
    EXPECT_DOUBLE_EQ(r->device_busy[0], 6);
  }
}

TEST(Pool, HandComputedOverlap) {
  // Backward: segment 1 in [0,2], segment 0 in [2,4]; forward 1 s each.
  // Dedicated: A (seg 1) runs [2,5], B (seg 0) [5,6]; forward seg 0 [6,7],
  // seg 1 [7,8]: 2 s later than the 6 s without an optimizer.
  const std::vector<Task> tasks = {T(1, 0, 0, 3), T(0, 0, 1, 1)};
  auto d = SimulatePool(Flat(2, 1, 2), tasks, {1, Placement::kDedicated, 16});
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->backward_end, 4);
  EXPECT_DOUBLE_EQ(d->baseline_end, 6);
  EXPECT_DOUBLE_EQ(d->forward_end, 8);
  EXPECT_DOUBLE_EQ(d->exposed, 2);
  // Shared: the one GPU does backward, then both kernels, then forward.
  auto s = SimulatePool(Flat(2, 1, 2), tasks, {1, Placement::kShared, 16});
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ(s->exposed, 4);
}

TEST(Pool, CommunicationIsSerialAndLatencyPipelined) {
  // Two devices, both gradients ready at 0. Reduces [0,1] and [1,2] arrive
  // at 1.5 and 2.5; kernels end at 3.5 and 4.5; broadcasts [3.5,4.5] and
  // [4.5,5.5] land at 5 and 6; the 1 s forward ends at 7 instead of 1.
  std::vector<Task> tasks = {T(0, 0, 0, 2), T(0, 1, 0, 2)};
  for (Task& t : tasks) t.reduce = t.broadcast = {1.0, 0.5};
  auto r = SimulatePool(Flat(1, 1, 0), tasks, {2, Placement::kDedicated, 16});
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->last_update, 6);
  EXPECT_DOUBLE_EQ(r->forward_end, 7);
  EXPECT_DOUBLE_EQ(r->exposed, 6);
}

TEST(Pool, SameShapeWorkIsBatchedAndLeavesTogether) {
  // W keeps the device busy [0,1] while the others arrive. Then X (seg 0)
  // and Z (seg 1) share a shape, Y (seg 2) does not. Batched: {X,Z} [1,3],
  // Y [3,4]; forward [3,4] [4,5] [5,6]. One by one: X, Z, Y end at 2, 3, 4;
  // forward [2,3] [3,4] [4,5].
  const std::vector<Task> tasks = {T(0, 0, 2, 1), T(0, 0, 1, 1), T(2, 0, 0, 1),
                                   T(1, 0, 1, 1)};
  auto b = SimulatePool(Flat(3, 1, 0), tasks, {1, Placement::kDedicated, 16});
  auto o = SimulatePool(Flat(3, 1, 0), tasks, {1, Placement::kDedicated, 1});
  ASSERT_TRUE(b.ok() && o.ok());
  EXPECT_DOUBLE_EQ(b->forward_end, 6);
  EXPECT_DOUBLE_EQ(o->forward_end, 5);
}

TEST(Pool, RejectsBadInput) {
  EXPECT_FALSE(SimulatePool(Flat(1, 0, 0), {T(0, 1, 0, 1)}, {1}).ok());
  EXPECT_FALSE(SimulatePool(Flat(1, 0, 0), {T(2, 0, 0, 1)}, {1}).ok());
  EXPECT_FALSE(SimulatePool(Timeline{}, {}, {1}).ok());
}

TEST(Strategies, InfiniteBandwidthAndFreeKernelsExposeNothing) {
  Workload w = Llama8b();
  Scenario sc = w.scenario;
  sc.timeline.after_backward_s = 0;
  sc.timeline.apply_s.clear();
  for (MatrixCost& m : sc.matrices) m.ours_s = m.redundant_s = 0;
  sc.links.nvlink_bandwidth = sc.links.ib_bandwidth =
      std::numeric_limits<double>::infinity();
  sc.links.nvlink_latency = sc.links.ib_latency = 0;
  for (int g : {1, 8, 64}) {
    sc.gpus = g;
    auto rows = SimulateStrategies(sc);
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_NEAR(Row(*rows, "dmuon"), 0, 1e-12) << g;
    EXPECT_NEAR(Row(*rows, "dmuon_dedicated"), 0, 1e-12) << g;
    EXPECT_NEAR(Row(*rows, "round_robin"), 0, 1e-12) << g;
  }
}

TEST(Strategies, RedundantAndAdamwDoNotDependOnGpuCount) {
  Scenario sc = Llama8b().scenario;
  sc.gpus = 1;
  auto one = SimulateStrategies(sc);
  ASSERT_TRUE(one.ok());
  for (int g : {2, 8, 16, 64, 256}) {
    sc.gpus = g;
    auto rows = SimulateStrategies(sc);
    ASSERT_TRUE(rows.ok());
    EXPECT_DOUBLE_EQ(Row(*rows, "redundant"), Row(*one, "redundant"));
    EXPECT_DOUBLE_EQ(Row(*rows, "adamw"), Row(*one, "adamw"));
  }
}

TEST(Strategies, DmuonExposedFallsWithGpuCount) {
  // Shared placement with the default links; dedicated with free links (with
  // real links its small tail, the last layer's reduce + kernel + broadcast,
  // grows once transfers cross nodes: more GPUs can cost a little there).
  for (bool free_links : {false, true}) {
    Scenario sc = Llama8b().scenario;
    if (free_links) {
      sc.links.nvlink_bandwidth = sc.links.ib_bandwidth =
          std::numeric_limits<double>::infinity();
      sc.links.nvlink_latency = sc.links.ib_latency = 0;
    }
    const std::string name = free_links ? "dmuon_dedicated" : "dmuon";
    double last = 1e30;
    for (int g : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
      sc.gpus = g;
      auto rows = SimulateStrategies(sc);
      ASSERT_TRUE(rows.ok());
      const double e = Row(*rows, name);
      EXPECT_LE(e, last + 1e-12) << name << " at " << g << " GPUs";
      last = e;
    }
  }
}

TEST(Strategies, OneGpuWithoutTrainerTimeIsTheKernelSum) {
  Scenario sc;
  sc.timeline = Flat(3, 0, 0);
  sc.matrices = {{0, 0, 1.0, 2.0, 8}, {1, 1, 2.0, 3.0, 8}, {2, 0, 0.5, 1.0, 8}};
  sc.adamw_all_s = 0.25;
  sc.gpus = 1;
  auto rows = SimulateStrategies(sc);
  ASSERT_TRUE(rows.ok());
  EXPECT_DOUBLE_EQ(Row(*rows, "redundant"), 6.0);
  EXPECT_DOUBLE_EQ(Row(*rows, "round_robin"), 3.5);
  EXPECT_DOUBLE_EQ(Row(*rows, "dmuon"), 3.5);
  EXPECT_DOUBLE_EQ(Row(*rows, "dmuon", false), 3.5);
  EXPECT_DOUBLE_EQ(Row(*rows, "adamw"), 0.25);
}

TEST(Links, HierarchicalCollectives) {
  Links l;
  const double s = 1e9;
  EXPECT_DOUBLE_EQ(AllGather(l, 1, s).total(), 0);
  EXPECT_DOUBLE_EQ(ReduceTo(l, 1, s).total(), 0);
  EXPECT_DOUBLE_EQ(AllGather(l, 8, s).busy, 7.0 / 8 * s / l.nvlink_bandwidth);
  EXPECT_DOUBLE_EQ(AllGather(l, 8, s).latency, l.nvlink_latency);
  EXPECT_DOUBLE_EQ(
      AllGather(l, 16, s).busy,
      0.5 * s / (8 * l.ib_bandwidth) + 7.0 / 8 * s / l.nvlink_bandwidth);
  EXPECT_DOUBLE_EQ(AllReduce(l, 16, s).busy, 2 * AllGather(l, 16, s).busy);
  EXPECT_DOUBLE_EQ(
      ReduceTo(l, 64, s).busy,
      2 * 7.0 / 8 * s / l.nvlink_bandwidth + s / (8 * l.ib_bandwidth));
  EXPECT_DOUBLE_EQ(ReduceTo(l, 64, s).latency,
                   2 * l.nvlink_latency + 3 * l.ib_latency);
  // More nodes never make a per-matrix reduce cheaper.
  EXPECT_LE(ReduceTo(l, 8, s).busy, ReduceTo(l, 16, s).busy);
  // FSDP2: gathering a row-sharded matrix into its owner costs what an
  // all-gather does, less than reducing an unreduced one.
  EXPECT_DOUBLE_EQ(GatherTo(l, 64, s).busy, AllGather(l, 64, s).busy);
  EXPECT_DOUBLE_EQ(ScatterFrom(l, 64, s).total(), GatherTo(l, 64, s).total());
  EXPECT_LT(GatherTo(l, 64, s).busy, ReduceTo(l, 64, s).busy);
  EXPECT_DOUBLE_EQ(GatherTo(l, 1, s).total(), 0);
  EXPECT_DOUBLE_EQ(
      AllToAll(l, 16, s).busy,
      0.5 * s / l.ib_bandwidth + 7.0 / 16 * s / l.nvlink_bandwidth);
  EXPECT_DOUBLE_EQ(AllToAll(l, 8, s).busy, 7.0 / 8 * s / l.nvlink_bandwidth);
}

TEST(Pool, Fsdp2AllGathersGateTheForwardAndCountInTheBaseline) {
  // Two 1 s segments, no backward; each segment's parameter all-gather
  // takes 1 s on the channel. Bare job: gathers [0,1] [1,2], forward [1,2]
  // [2,3]: baseline 3. One update of segment 1 (kernel [0,2], free
  // transfers): its all-gather waits for it, [2,3]; forward seg 1 [3,4].
  Timeline tl = Flat(2, 1, 0);
  tl.unshard = {{1.0, 0.0}, {1.0, 0.0}};
  auto bare = SimulatePool(tl, {}, {1, Placement::kDedicated, 16});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_DOUBLE_EQ(bare->baseline_end, 3);
  EXPECT_DOUBLE_EQ(bare->exposed, 0);
  auto r = SimulatePool(tl, {T(1, 0, 0, 2)}, {1, Placement::kDedicated, 16});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->baseline_end, 3);
  EXPECT_DOUBLE_EQ(r->forward_end, 4);
  EXPECT_DOUBLE_EQ(r->exposed, 1);
  tl.unshard.pop_back();
  EXPECT_FALSE(SimulatePool(tl, {}, {1}).ok());
}

// A 2-segment job for hand computation: segment 0 has no Muon matrix, the
// two matrices of segment 1 take 2 s of NS each and 4 bytes on the wire.
// NVLink at 1 byte/s, no latency: on 2 GPUs (one node) a GatherTo or
// ScatterFrom of 4 bytes takes 1/2 x 4 = 2 s, a ReduceTo 4 s.
Scenario TwoGpuJob(Job job) {
  Scenario sc;
  sc.job = job;
  sc.gpus = 2;
  sc.timeline.forward_s = {0, 4};
  sc.timeline.backward_s = {0, 0};
  sc.timeline.after_backward_s = 1;  // non-Muon AdamW, whole model
  sc.timeline.apply_s = {0, 2};      // applying both updates, whole model
  sc.matrices = {{1, 0, 2.0, 2.0, 4}, {1, 1, 2.0, 2.0, 4}};
  sc.adamw_all_s = 3;
  sc.segment_param_bytes = {2, 8};  // all-gathers of 1 s and 4 s
  sc.links.nvlink_bandwidth = 1;
  sc.links.nvlink_latency = sc.links.ib_latency = 0;
  return sc;
}

TEST(Strategies, Fsdp2OnTwoGpusHandComputed) {
  // Each rank: AdamW of its half of the non-Muon parameters 0.5 s, applying
  // its rows 1 s. The channel: gather M0 [0,2]; M0's NS [2,4] on its owner;
  // segment 0's all-gather (queued at 0.5, earlier segment first) [2,3];
  // gather M1 [3,5], NS [5,7]; scatter M0 [5,7], M1 [7,9]; segment 1's
  // all-gather [9,13]; its forward + apply [13,18]. The bare job: all-gathers
  // [0,1] [1,5], forward [5,9]. Exposed 9 s in both placements.
  auto rows = SimulateStrategies(TwoGpuJob(Job::kFsdp2));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_NEAR(Row(*rows, "dmuon"), 9, 1e-12);
  EXPECT_NEAR(Row(*rows, "dmuon_dedicated"), 9, 1e-12);
  // No forward, no all-gathers: gathers [0,2] [2,4], NS [2,4] [4,6],
  // scatters [4,6] [6,8], apply [8,9].
  EXPECT_NEAR(Row(*rows, "dmuon", false), 9, 1e-12);
  // Sharded AdamW: 3 / 2 after backward delays every all-gather by 1.5 s.
  EXPECT_NEAR(Row(*rows, "adamw"), 1.5, 1e-12);
  // Redundant: all-gather all 8 bytes (4 s), NS of both (4 s), AdamW and
  // apply of the rank's half (1.5 s).
  EXPECT_NEAR(Row(*rows, "redundant", false), 9.5, 1e-12);
  EXPECT_NEAR(Row(*rows, "redundant"), 9.5, 1e-12);
  // Round-robin: one matrix per GPU; each all-to-all moves half of its 4
  // bytes (2 s), twice; NS 2 s; 1.5 s of AdamW and apply.
  EXPECT_NEAR(Row(*rows, "round_robin"), 7.5, 1e-12);
  // The same job replicated: a ReduceTo or BroadcastFrom is 4 s; the ranks
  // run all the AdamW (1 s) and apply (2 s); AdamW 3 s.
  auto rep = SimulateStrategies(TwoGpuJob(Job::kReplicated));
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_NEAR(Row(*rep, "adamw"), 3, 1e-12);
  // Reduce M0 [0,4], M1 [4,8]; NS [4,6], [8,10]; broadcast M0 [8,12], M1
  // [12,16]; forward + apply [16,22] vs 4 without an optimizer.
  EXPECT_NEAR(Row(*rep, "dmuon_dedicated"), 18, 1e-12);
}

TEST(Strategies, Fsdp2OnOneGpuIsTheReplicatedJob) {
  Scenario sc = Llama8b().scenario;
  sc.gpus = 1;
  auto rep = SimulateStrategies(sc);
  sc.job = Job::kFsdp2;
  auto fsdp = SimulateStrategies(sc);
  ASSERT_TRUE(rep.ok() && fsdp.ok());
  ASSERT_EQ(rep->size(), fsdp->size());
  for (size_t i = 0; i < rep->size(); ++i) {
    EXPECT_EQ((*rep)[i].strategy, (*fsdp)[i].strategy);
    EXPECT_NEAR((*rep)[i].exposed_s, (*fsdp)[i].exposed_s, 1e-9)
        << (*rep)[i].strategy;
    EXPECT_NEAR((*rep)[i].optimizer_s, (*fsdp)[i].optimizer_s, 1e-9)
        << (*rep)[i].strategy;
  }
}

TEST(Strategies, Fsdp2RankWorkScalesAsOneOverG) {
  // Free links and kernels: all that is left on a rank is AdamW of its
  // shard of the non-Muon parameters and applying its rows, both / G;
  // sharded AdamW is adamw_all / G.
  Scenario sc = Llama8b().scenario;
  sc.job = Job::kFsdp2;
  for (MatrixCost& m : sc.matrices) m.ours_s = m.redundant_s = 0;
  sc.links.nvlink_bandwidth = sc.links.ib_bandwidth =
      std::numeric_limits<double>::infinity();
  sc.links.nvlink_latency = sc.links.ib_latency = 0;
  double apply = 0;
  for (double a : sc.timeline.apply_s) apply += a;
  const double local = sc.timeline.after_backward_s + apply;
  ASSERT_GT(local, 0);
  for (int g : {1, 2, 8, 64}) {
    sc.gpus = g;
    auto rows = SimulateStrategies(sc);
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_NEAR(Row(*rows, "dmuon"), local / g, 1e-9) << g;
    EXPECT_NEAR(Row(*rows, "dmuon_dedicated"), local / g, 1e-9) << g;
    EXPECT_NEAR(Row(*rows, "redundant"), local / g, 1e-9) << g;
    EXPECT_NEAR(Row(*rows, "adamw"), sc.adamw_all_s / g, 1e-9) << g;
  }
}

TEST(Strategies, Fsdp2TrafficPerRankAndPerOwner) {
  Scenario sc;
  sc.matrices = {{1, 0, 1, 1, 4}, {1, 1, 1, 1, 8}};
  sc.job = Job::kFsdp2;
  sc.gpus = 2;  // one node
  Traffic t = DmuonTraffic(sc, {0, 1});
  EXPECT_DOUBLE_EQ(t.rank_out, 6);  // its half of each matrix
  EXPECT_DOUBLE_EQ(t.rank_in, 6);
  EXPECT_DOUBLE_EQ(t.owner_in, 4);  // the other half of the 8-byte one
  EXPECT_DOUBLE_EQ(t.owner_out, 4);
  EXPECT_DOUBLE_EQ(t.node_in, 0);
  sc.gpus = 16;  // two nodes; owners on different nodes
  t = DmuonTraffic(sc, {0, 8});
  EXPECT_DOUBLE_EQ(t.rank_out, 12.0 / 16);
  EXPECT_DOUBLE_EQ(t.owner_in, 15.0 / 16 * 8);
  EXPECT_DOUBLE_EQ(t.node_in, 0.5 * 8);  // the other node's half
  t = DmuonTraffic(sc, {0, 1});          // both on node 0
  EXPECT_DOUBLE_EQ(t.node_in, 0.5 * 12);
  sc.job = Job::kReplicated;  // whole unreduced gradients and updates
  t = DmuonTraffic(sc, {0, 8});
  EXPECT_DOUBLE_EQ(t.rank_out, 12);
  EXPECT_DOUBLE_EQ(t.rank_in, 12);
}

TEST(Workload, ModelTablesMatchTheirSummaries) {
  auto models = LoadModels(kShapes);
  ASSERT_TRUE(models.ok()) << models.status();
  auto m = FindModel(*models, "llama-3-8b");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matrices.size(), 224u);
  EXPECT_DOUBLE_EQ(m->muon_params(), 6979321856.0);
  EXPECT_FALSE(FindModel(*models, "nope").ok());
  auto w = BuildWorkload(*m, KernelTimes::CostModel({}), {});
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->scenario.timeline.forward_s.size(), 34u);  // 32 + 2
  EXPECT_NEAR(w->scenario.timeline.backward(),
              2 * w->scenario.timeline.forward(), 1e-9);
  EXPECT_DOUBLE_EQ(w->scenario.adamw_all_s,
                   (w->muon_params + w->other_params) * 28 / 4.3e12);
  auto mix = FindModel(*models, "mixtral-8x7b");
  ASSERT_TRUE(mix.ok());
  auto wm = BuildWorkload(*mix, KernelTimes::CostModel({}), {});
  ASSERT_TRUE(wm.ok());
  EXPECT_LT(wm->active_params, wm->muon_params);  // 2 of 8 experts active
}

TEST(KernelTimes, MeasuredRatesInterpolateByFlops) {
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                             : "/tmp") +
      "/kernels.json";
  std::ofstream(path) << R"({"rows": [
    {"shape": "512x512", "batch": 1, "method": "gemm", "seconds": 1e-4},
    {"shape": "512x512", "batch": 1, "method": "direct", "seconds": 0.01},
    {"shape": "2048x2048", "batch": 1, "method": "direct", "seconds": 0.5},
    {"shape": "2048x2048", "batch": 4, "method": "direct-batched", "seconds": 9},
    {"shape": "512x512", "batch": 1, "method": "gram", "seconds": 0.02}]})";
  Hardware hw;
  hw.momentum_bytes = 0;
  hw.kernel_overhead_s = 0;
  auto k = KernelTimes::Measured(path, hw);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_NEAR(k->Ours({512, 512}).second, 0.01, 1e-12);
  EXPECT_EQ(k->Ours({512, 512}).first, "direct");
  EXPECT_NEAR(k->Ours({2048, 2048}).second, 0.5, 1e-12);
  // 1024^2 lies between in flops: its rate between the two measured rates.
  const double f512 = 5 * (3.0 * 512 * 512 * 512 + 512.0 * 512 * 512);
  const double f2048 = 64 * f512, f1024 = 8 * f512;
  const double t = k->Ours({1024, 1024}).second;
  EXPECT_GT(f1024 / t, f512 / 0.01);
  EXPECT_LT(f1024 / t, f2048 / 0.5);
  // Redundant: no dense row, so the direct rate at the dense flop count.
  EXPECT_GT(k->Redundant({512, 512}), 0.01);
  EXPECT_FALSE(KernelTimes::Measured("/nonexistent.json", hw).ok());
}

}  // namespace
}  // namespace dmuon::scaling
