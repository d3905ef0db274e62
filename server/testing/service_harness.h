// Test-only: the service driven as clients would drive it, without sockets
// (ranks on real shm segments or inline messages, Step responses caught by
// a RecordingSink), and an independent fp64 Muon reference (momentum in
// double, NS from the SVD) to check every update against. Header-only,
// testonly; used by the service_*_test files.

#ifndef DMUON_SERVER_TESTING_SERVICE_HARNESS_H_
#define DMUON_SERVER_TESTING_SERVICE_HARNESS_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/testing/oracle.h"
#include "server/executor.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_sink.h"
#include "transport/doorbell.h"
#include "transport/transport.h"

namespace dmuon::server::testing {

using FakeSink = RecordingSink;

using Param = TableParam;

inline std::unique_ptr<OptimizerService> NewService(
    ServiceOptions o = {}, int executors = 2,
    ServiceMetrics* metrics = nullptr) {
  std::vector<std::unique_ptr<Executor>> ex;
  for (int i = 0; i < executors; ++i) ex.push_back(NewCpuExecutor(i, 1));
  return std::make_unique<OptimizerService>(
      o, std::make_unique<Scheduler>(std::move(ex), 4), metrics);
}

inline v1::OpenSessionRequest Request(const std::string& job, int rank,
                                      int world, v1::Transport t,
                                      const std::vector<Param>& params) {
  return OpenRequest(job, rank, world, t, params);
}

// A rank as a client would drive it, on a real shm segment or inline.
struct Rank {
  v1::OpenSessionResponse open;
  std::unique_ptr<transport::Region> shm;
  std::shared_ptr<FakeSink> sink = std::make_shared<FakeSink>();
  // dmuond's side of the session's doorbell (Attach's), or null.
  std::shared_ptr<transport::Doorbell> bell;
  std::vector<std::string> inline_updates;  // by param

  absl::Status Open(OptimizerService& svc, const v1::OpenSessionRequest& req,
                    const Principal& who = {}) {
    auto r = svc.OpenSession(req, who);
    if (!r.ok()) return r.status();
    open = *r;
    if (open.transport() == v1::TRANSPORT_SHM) {
      // With a doorbell (requested by req.doorbell) the segment holds it
      // after the tensors.
      auto reg = transport::OpenShmRegion(
          open.shm_name(), open.has_doorbell() ? open.doorbell().offset() +
                                                     open.doorbell().bytes()
                                               : open.layout().total_bytes());
      if (!reg.ok()) return reg.status();
      shm = std::move(*reg);
    }
    inline_updates.resize(open.layout().slots_size());
    return svc.Attach(open.session_id(), sink, &bell);
  }
  // Sends every gradient of `step`; grads[i] is this rank's view.
  absl::Status Send(OptimizerService& svc, int64_t step,
                    const std::vector<std::vector<float>>& grads) {
    v1::StepRequest ready;
    ready.mutable_gradients_ready()->set_step(step);
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& slot = open.layout().slots(i);
      if (shm) {
        if (slot.bytes() > 0)  // 0: the rank holds nothing (BLOCKS)
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
      if (slot.bytes() > 0)
        std::memcpy(out.data(), shm->bytes().data() + slot.update_offset(),
                    slot.bytes());
    } else {
      std::string bytes;
      for (const auto& m : msgs)
        if (m.has_update() && m.update().param_id() == param)
          bytes += m.update().data();
      EXPECT_EQ(bytes.size(), slot.bytes());
      if (!bytes.empty())
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
    auto o = ::dmuon::kernels::testing::SvdOracle(u, s, kernels::NsOptions{});
    const double scale = std::sqrt(std::max(1.0, double(s.rows) / s.cols));
    for (double& x : o) x *= scale;
    return o;
  }
};

inline std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline double RelErr(const std::vector<float>& a,
                     const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i)
    num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

// Rank r's view of a whole matrix of parameter `p` in a job of `world`
// ranks: its rows for SHARDING_ROWS (cut as OpenRequest cuts them), else
// the whole matrix.
template <typename T>
std::vector<T> RankView(const Param& p, int r, int world,
                        const std::vector<T>& whole) {
  int64_t begin = 0, end = p.rows;
  if (p.sharding == v1::SHARDING_ROWS) {
    const int64_t per = (p.rows + world - 1) / world;
    begin = std::min(p.rows, r * per);
    end = std::min(p.rows, (r + 1) * per);
  }
  return {whole.begin() + begin * p.cols, whole.begin() + end * p.cols};
}

// Runs `steps` steps of a `world`-rank job and checks every rank's update.
inline void RunJob(v1::Transport t, int world, const std::vector<Param>& params,
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
      for (size_t i = 0; i < params.size(); ++i)
        views[i] = RankView(params[i], r, world, full[r][i]);
      ASSERT_TRUE(ranks[r].Send(*svc, step, views).ok());
    }
    for (int r = 0; r < world; ++r) {
      auto msgs = ranks[r].sink->WaitStep(step);
      ASSERT_FALSE(msgs.empty());
      ASSERT_TRUE(msgs.back().has_step_complete())
          << "rank " << r << " step " << step;
      for (size_t i = 0; i < params.size(); ++i) {
        std::vector<float> got = ranks[r].Update(i, msgs);
        EXPECT_LT(RelErr(got, RankView(params[i], r, world, want[i])), 1e-4)
            << params[i].name << " rank " << r << " step " << step;
      }
    }
  }
  for (auto& r : ranks)
    EXPECT_TRUE(svc->CloseSession(r.open.session_id()).ok());
}

inline const std::vector<Param> kMixed = {
    {"attn.w", 48, 48, v1::SHARDING_REPLICATED},
    {"mlp.up", 96, 48, v1::SHARDING_ROWS},
    {"mlp.down", 48, 96, v1::SHARDING_UNREDUCED},
    {"attn.o", 48, 48, v1::SHARDING_REPLICATED}};

// Random gradients for every parameter of `ps` (whole matrices).
inline std::vector<std::vector<float>> RandomGradients(
    const std::vector<Param>& ps, std::mt19937_64& rng) {
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> g;
  for (const Param& p : ps) {
    g.emplace_back(p.rows * p.cols);
    for (float& x : g.back()) x = d(rng);
  }
  return g;
}

// `steps` steps of RandomGradients.
inline std::vector<std::vector<std::vector<float>>> StepsOfGradients(
    const std::vector<Param>& ps, int steps, std::mt19937_64& rng) {
  std::vector<std::vector<std::vector<float>>> g;
  for (int k = 0; k < steps; ++k) g.push_back(RandomGradients(ps, rng));
  return g;
}

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_SERVICE_HARNESS_H_
