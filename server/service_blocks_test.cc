// SHARDING_BLOCKS: ranks that hold any product of row and column runs of a
// matrix (the layouts DTensor placements give: 2-D meshes, uneven and
// strided shards, replicas, a rank holding nothing), over shm, inline and
// the GPU transports' CPU fakes. Every rank's update is checked against the
// fp64 reference of the assembled matrix, element by element through an
// index oracle written here (not through shard_map.h).

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "server/testing/fake_daemon.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

using Runs = std::vector<std::pair<int64_t, int64_t>>;
struct Held {
  Runs rows, cols;
};
struct Layout {
  std::string name;
  std::vector<Held> ranks;
};

constexpr int kWorld = 4;
constexpr int64_t kRows = 48, kCols = 24;
const std::vector<P> kBlocksTable = {{"a", 40, 24, v1::SHARDING_REPLICATED},
                                     {"b", kRows, kCols, v1::SHARDING_BLOCKS}};

std::vector<Layout> Layouts() {
  const Runs all_rows{{0, kRows}}, all_cols{{0, kCols}};
  std::vector<Layout> out;
  // (Shard(0), Shard(1)) on a 2x2 mesh, uneven in both dimensions.
  out.push_back({"2x2 mesh, uneven",
                 {{{{0, 25}}, {{0, 13}}},
                  {{{0, 25}}, {{13, 24}}},
                  {{{25, 48}}, {{0, 13}}},
                  {{{25, 48}}, {{13, 24}}}}});
  // FSDP2 x TP's strided rows: two runs per rank.
  Layout strided{"strided rows", {}};
  for (int r = 0; r < kWorld; ++r)
    strided.ranks.push_back(
        {{{r * 6, r * 6 + 6}, {24 + r * 6, 24 + r * 6 + 6}}, all_cols});
  out.push_back(strided);
  // HSDP: ranks 2 and 3 are replicas of ranks 0 and 1.
  out.push_back({"replicas",
                 {{{{0, 24}}, all_cols},
                  {{{24, 48}}, all_cols},
                  {{{0, 24}}, all_cols},
                  {{{24, 48}}, all_cols}}});
  // Fewer shards than ranks: rank 3 holds nothing.
  out.push_back({"a rank holds nothing",
                 {{{{0, 16}}, all_cols},
                  {{{16, 32}}, all_cols},
                  {{{32, 48}}, all_cols},
                  {{}, {}}}});
  // Strided columns, runs listed out of order, a partial replica.
  Layout cols{"strided columns out of order", {}};
  for (int r = 0; r < kWorld; ++r)
    cols.ranks.push_back(
        {all_rows, {{12 + r * 3, 12 + r * 3 + 3}, {r * 3, r * 3 + 3}}});
  cols.ranks[2].cols = {{18, 24}, {6, 12}};  // rank 3's columns again
  out.push_back(cols);
  return out;
}

std::vector<int64_t> Indices(const Runs& runs) {
  std::vector<int64_t> v;
  for (auto [b, e] : runs)
    for (int64_t i = b; i < e; ++i) v.push_back(i);
  return v;
}

void SetRuns(v1::ParameterSpec* s, const Held& h) {
  for (auto [b, e] : h.rows) {
    auto* x = s->add_row_runs();
    x->set_begin(b);
    x->set_end(e);
  }
  for (auto [b, e] : h.cols) {
    auto* x = s->add_col_runs();
    x->set_begin(b);
    x->set_end(e);
  }
}

// Rank r's local tensor of `whole`. With `poison`, an element a lower rank
// holds too is sent wrong: the daemon must use the lowest rank's.
std::vector<float> LocalOf(const Layout& l, int r,
                           const std::vector<float>& whole, bool poison) {
  const auto ri = Indices(l.ranks[r].rows), ci = Indices(l.ranks[r].cols);
  std::vector<float> out;
  for (int64_t i : ri) {
    for (int64_t j : ci) {
      bool lower = false;
      for (int k = 0; k < r && poison; ++k) {
        const auto rk = Indices(l.ranks[k].rows), ck = Indices(l.ranks[k].cols);
        lower |= std::count(rk.begin(), rk.end(), i) &&
                 std::count(ck.begin(), ck.end(), j);
      }
      out.push_back(whole[i * kCols + j] + (lower ? 1000.0f : 0.0f));
    }
  }
  return out;
}

// One step's whole gradients of kBlocksTable, drawn from `rng`, and the
// fp64 reference's updates for them (`ref`: one per parameter).
struct Drawn {
  std::vector<std::vector<float>> whole;
  std::vector<std::vector<double>> want;
};
Drawn Draw(std::mt19937_64& rng, std::vector<Reference>& ref) {
  std::normal_distribution<float> dist;
  Drawn d;
  for (size_t i = 0; i < kBlocksTable.size(); ++i) {
    const P& p = kBlocksTable[i];
    d.whole.emplace_back(p.rows * p.cols);
    for (float& x : d.whole.back()) x = dist(rng);
    d.want.push_back(
        ref[i].Step({d.whole[i].begin(), d.whole[i].end()}, {p.rows, p.cols}));
  }
  return d;
}

// Three steps of `layout` on daemon `d` (opened here over `t`), gradients
// drawn from `seed`; returns every step's updates, to compare transports.
std::vector<std::vector<std::vector<std::vector<float>>>> RunLayout(
    Daemon& d, const Layout& layout, bool device, v1::Transport t,
    uint64_t seed) {
  d.table = kBlocksTable;
  d.edit = [&](int rank, v1::OpenSessionRequest* req) {
    SetRuns(req->mutable_parameters(1), layout.ranks[rank]);
  };
  std::vector<std::vector<std::vector<std::vector<float>>>> all;
  const absl::Status open = d.Open(kWorld, device, t);
  EXPECT_TRUE(open.ok()) << open;
  if (!open.ok()) return all;
  std::mt19937_64 rng(seed);
  std::vector<Reference> ref(2);
  for (int64_t step = 1; step <= 3; ++step) {
    const Drawn drawn = Draw(rng, ref);
    const auto& whole = drawn.whole;
    const auto& want = drawn.want;
    std::vector<std::vector<std::vector<float>>> grads(kWorld);
    for (int r = 0; r < kWorld; ++r)
      grads[r] = {whole[0], LocalOf(layout, r, whole[1], /*poison=*/true)};
    auto got = d.Step(step, grads);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_LT(RelErr(got[r][0], want[0]), 1e-4) << layout.name;
      const auto ri = Indices(layout.ranks[r].rows);
      const auto ci = Indices(layout.ranks[r].cols);
      EXPECT_EQ(got[r][1].size(), ri.size() * ci.size()) << layout.name;
      if (got[r][1].size() != ri.size() * ci.size()) continue;
      std::vector<double> mine;
      for (int64_t i : ri)
        for (int64_t j : ci) mine.push_back(want[1][i * kCols + j]);
      if (mine.empty()) continue;
      EXPECT_LT(RelErr(got[r][1], mine), 1e-4)
          << layout.name << " rank " << r << " step " << step;
    }
    all.push_back(std::move(got));
  }
  return all;
}

TEST(Blocks, EveryLayoutEqualsTheReferenceOverShmAndTheGpuTransports) {
  const uint64_t seed = std::random_device{}();
  for (const Layout& l : Layouts()) {
    SCOPED_TRACE(l.name);
    Daemon cpu(false);
    const auto host = RunLayout(cpu, l, false, v1::TRANSPORT_SHM, seed);
    ASSERT_EQ(host.size(), 3u);
    for (v1::Transport t : {v1::TRANSPORT_CUDA_IPC, v1::TRANSPORT_NCCL}) {
      Daemon dev(true);
      dev.transports->nccl = true;
      // The device gather and scatter (fake_device.h, as the CUDA
      // executor's kBlocks) give the host's updates bit for bit.
      const auto moved = RunLayout(dev, l, true, t, seed);
      EXPECT_EQ(moved, host) << v1::Transport_Name(t);
      EXPECT_EQ(dev.State(), cpu.State()) << v1::Transport_Name(t);
    }
  }
}

TEST(Blocks, InlineWithARankHoldingNothing) {
  const Layout l = Layouts()[3];
  auto svc = NewService();
  std::vector<Rank> ranks(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    auto req =
        OpenRequest("job", r, kWorld, v1::TRANSPORT_INLINE, kBlocksTable);
    SetRuns(req.mutable_parameters(1), l.ranks[r]);
    ASSERT_TRUE(ranks[r].Open(*svc, req).ok());
  }
  EXPECT_EQ(ranks[3].open.layout().slots(1).bytes(), 0u);
  EXPECT_EQ(ranks[3].open.layout().slots(1).local_shape(0), 0);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<Reference> ref(2);
  for (int64_t step = 1; step <= 2; ++step) {
    const Drawn drawn = Draw(rng, ref);
    const auto& whole = drawn.whole;
    const auto& want = drawn.want;
    for (int r = kWorld - 1; r >= 0; --r) {
      ASSERT_TRUE(
          ranks[r]
              .Send(*svc, step, {whole[0], LocalOf(l, r, whole[1], true)})
              .ok());
    }
    for (int r = 0; r < kWorld; ++r) {
      auto msgs = ranks[r].sink->WaitStep(step);
      ASSERT_TRUE(!msgs.empty() && msgs.back().has_step_complete());
      const auto got = ranks[r].Update(1, msgs);
      std::vector<double> mine;
      for (int64_t i : Indices(l.ranks[r].rows))
        for (int64_t j : Indices(l.ranks[r].cols))
          mine.push_back(want[1][i * kCols + j]);
      ASSERT_EQ(got.size(), mine.size());
      if (!mine.empty()) {
        EXPECT_LT(RelErr(got, mine), 1e-4) << "rank " << r;
      }
    }
  }
}

v1::OpenSessionRequest BlocksRequest(int rank, int world, const Held& h) {
  auto req = OpenRequest("job", rank, world, v1::TRANSPORT_SHM, kBlocksTable);
  SetRuns(req.mutable_parameters(1), h);
  return req;
}

TEST(Blocks, BadRunsAreRefusedNamingTheField) {
  auto svc = NewService();
  auto refused = [&](const Held& h, const std::string& says) {
    auto r = svc->OpenSession(BlocksRequest(0, 2, h));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
  };
  refused({{{0, 49}}, {{0, 24}}}, "parameter 'b' row_runs[0] [0,49)");
  refused({{{0, 8}}, {{5, 5}}}, "col_runs[0] [5,5)");
  refused({{{0, 8}, {4, 12}}, {{0, 24}}}, "overlap");
  refused({{{0, 8}}, {}}, "1 row_runs and 0 col_runs");
  auto req = BlocksRequest(0, 2, {{{0, 8}}, {{0, 24}}});
  auto* r = req.mutable_parameters(0)->add_row_runs();
  r->set_end(4);
  auto st = svc->OpenSession(req);
  EXPECT_NE(st.status().message().find(
                "parameter 'a' has row_runs/col_runs but is not "
                "SHARDING_BLOCKS"),
            std::string::npos)
      << st.status();
  EXPECT_TRUE(svc->Status().sessions().empty());
}

TEST(Blocks, AHoleIsRefusedAtTheLastRankAndTheJobStillOpens) {
  auto svc = NewService();
  Rank r0, r1;
  ASSERT_TRUE(r0.Open(*svc, BlocksRequest(0, 2, {{{0, 20}}, {{0, 24}}})).ok());
  auto hole = svc->OpenSession(BlocksRequest(1, 2, {{{24, 48}}, {{0, 24}}}));
  EXPECT_EQ(hole.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(hole.status().message().find(
                "parameter 'b' element (20,0) is held by no rank"),
            std::string::npos)
      << hole.status();
  EXPECT_NE(hole.status().message().find("rank 1: rows [24,48) x cols [0,24)"),
            std::string::npos)
      << hole.status();
  // Nothing of rank 0 was lost: rank 1 opens with a right layout (overlap
  // allowed) and the job steps.
  ASSERT_TRUE(r1.Open(*svc, BlocksRequest(1, 2, {{{16, 48}}, {{0, 24}}})).ok());
  std::mt19937_64 rng(std::random_device{}());
  const auto whole = RandomGradients(kBlocksTable, rng);
  const Layout l{"", {{{{0, 20}}, {{0, 24}}}, {{{16, 48}}, {{0, 24}}}}};
  ASSERT_TRUE(r1.Send(*svc, 1, {whole[0], LocalOf(l, 1, whole[1], true)}).ok());
  ASSERT_TRUE(r0.Send(*svc, 1, {whole[0], LocalOf(l, 0, whole[1], true)}).ok());
  Reference ref;
  const auto want =
      ref.Step({whole[1].begin(), whole[1].end()}, {kRows, kCols});
  auto got = r1.Update(1, r1.sink->WaitStep(1));
  EXPECT_LT(RelErr(got, {want.begin() + 16 * kCols, want.end()}), 1e-4);
}

TEST(Blocks, PresentOnOneRankAndAbsentOnAnotherIsRefused) {
  auto svc = NewService();
  Rank r0, r1;
  ASSERT_TRUE(r0.Open(*svc, BlocksRequest(0, 2, {{{0, 48}}, {{0, 24}}})).ok());
  ASSERT_TRUE(r1.Open(*svc, BlocksRequest(1, 2, {{}, {}})).ok());
  v1::StepRequest a, b;
  a.mutable_gradients_ready()->set_step(1);
  a.mutable_gradients_ready()->add_param_ids(1);
  ASSERT_TRUE(svc->OnStepRequest(r0.open.session_id(), a).ok());
  b.mutable_gradients_ready()->set_step(1);
  b.mutable_gradients_ready()->add_absent_param_ids(1);
  auto st = svc->OnStepRequest(r1.open.session_id(), b);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a SHARDING_BLOCKS parameter is present or "
                              "absent on every rank alike"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace dmuon::server::testing
