// A daemon harness for the service's GPU paths on the CPU: one job of a
// small table with every sharding mode, its ranks driven through the service
// over shm, or over the fake GPU transports of fake_device.h. Header-only,
// testonly.

#ifndef DMUON_SERVER_TESTING_FAKE_DAEMON_H_
#define DMUON_SERVER_TESTING_FAKE_DAEMON_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/service.h"
#include "server/testing/fake_device.h"
#include "server/testing/open_request.h"
#include "server/testing/recording_sink.h"
#include "server/testing/state_streams.h"
#include "transport/transport.h"

namespace dmuon::server::testing {

using Sink = RecordingSink;

using P = TableParam;
inline const std::vector<P> kTable = {{"a", 40, 24, v1::SHARDING_REPLICATED},
                                      {"b", 48, 24, v1::SHARDING_ROWS},
                                      {"c", 24, 40, v1::SHARDING_UNREDUCED},
                                      {"d", 40, 24, v1::SHARDING_REPLICATED}};

// One daemon (CPU, or fake device) with `world` ranks of one job.
struct Daemon {
  std::shared_ptr<FakeTransports> transports;
  std::vector<FakeDeviceExecutor*> fakes;
  std::unique_ptr<OptimizerService> svc;
  std::vector<v1::OpenSessionResponse> open;
  std::vector<std::unique_ptr<transport::Region>> shm;
  std::vector<std::vector<std::byte>> client_mem;  // device regions
  std::vector<std::shared_ptr<Sink>> sinks;
  // The job's table (kTable unless a test sets another before Open), and
  // an edit of each rank's request before it is sent (e.g. its
  // SHARDING_BLOCKS runs).
  std::vector<P> table = kTable;
  std::function<void(int rank, v1::OpenSessionRequest*)> edit;

  // keeps_step_start: the fake executors' (FakeDeviceExecutor); their
  // strict mode is o.strict's (dmuond --strict gives it to both).
  Daemon(bool device, ServiceOptions o = {}, int executors = 2,
         ServiceMetrics* metrics = nullptr, bool keeps_step_start = true) {
    std::vector<std::unique_ptr<Executor>> ex;
    for (int i = 0; i < executors; ++i) {
      if (device) {
        auto f =
            std::make_unique<FakeDeviceExecutor>(i, keeps_step_start, o.strict);
        fakes.push_back(f.get());
        ex.push_back(std::move(f));
      } else {
        ex.push_back(NewCpuExecutor(i, 1));
      }
    }
    transports = std::make_shared<FakeTransports>();
    o.device_transports = transports;
    svc = std::make_unique<OptimizerService>(
        o, std::make_unique<Scheduler>(std::move(ex), 4), metrics);
  }

  v1::OpenSessionRequest Request(int rank, int world, v1::Transport t) {
    auto req = OpenRequest("job", rank, world, t, table);
    if (edit) edit(rank, &req);
    return req;
  }

  // device: cuda_ipc (or `t` when given), else shm.
  absl::Status Open(int world, bool device,
                    v1::Transport t = v1::TRANSPORT_CUDA_IPC) {
    open.resize(world);
    shm.resize(world);
    client_mem.resize(world);
    for (int r = 0; r < world; ++r) {
      auto req = Request(r, world, device ? t : v1::TRANSPORT_SHM);
      if (device) {
        client_mem[r].assign(1 << 20, std::byte{0});
        std::byte* base = client_mem[r].data();
        req.mutable_cuda_ipc()->set_mem_handle(&base, sizeof(base));
        req.mutable_cuda_ipc()->set_bytes(client_mem[r].size());
      }
      auto o = svc->OpenSession(req);
      if (!o.ok()) return o.status();
      open[r] = *o;
      if (!device) {
        auto m =
            transport::OpenShmRegion(o->shm_name(), o->layout().total_bytes());
        if (!m.ok()) return m.status();
        shm[r] = std::move(*m);
      }
      sinks.push_back(std::make_shared<Sink>());
      if (auto st = svc->Attach(o->session_id(), sinks.back()); !st.ok())
        return st;
    }
    return absl::OkStatus();
  }

  std::byte* Base(int r) {
    return shm[r] ? shm[r]->bytes().data() : client_mem[r].data();
  }

  // Sends every rank's gradients (grads[r][i] is rank r's view) and
  // returns every rank's updates. absent[r] (when given): the parameters
  // rank r declares absent instead (no gradient written; their update
  // slots are returned as they are).
  std::vector<std::vector<std::vector<float>>> Step(
      int64_t step, const std::vector<std::vector<std::vector<float>>>& grads,
      std::vector<std::vector<v1::StepResponse>>* msgs = nullptr,
      const std::vector<std::vector<int>>& absent = {}) {
    const int world = static_cast<int>(open.size());
    for (int r = world - 1; r >= 0; --r) {
      v1::StepRequest ready;
      ready.mutable_gradients_ready()->set_step(step);
      for (size_t i = 0; i < table.size(); ++i) {
        if (!absent.empty() && std::count(absent[r].begin(), absent[r].end(),
                                          static_cast<int>(i)) > 0) {
          ready.mutable_gradients_ready()->add_absent_param_ids(i);
          continue;
        }
        const auto& slot = open[r].layout().slots(i);
        if (slot.bytes() > 0)  // 0: the rank holds nothing (BLOCKS)
          std::memcpy(Base(r) + slot.gradient_offset(), grads[r][i].data(),
                      slot.bytes());
        ready.mutable_gradients_ready()->add_param_ids(i);
      }
      EXPECT_TRUE(svc->OnStepRequest(open[r].session_id(), ready).ok());
    }
    std::vector<std::vector<std::vector<float>>> out(world);
    for (int r = 0; r < world; ++r) {
      auto m = sinks[r]->WaitStep(step);
      EXPECT_TRUE(!m.empty() && m.back().has_step_complete());
      if (msgs) msgs->push_back(m);
      for (size_t i = 0; i < table.size(); ++i) {
        const auto& slot = open[r].layout().slots(i);
        std::vector<float> u(slot.bytes() / 4);
        if (slot.bytes() > 0)
          std::memcpy(u.data(), Base(r) + slot.update_offset(), slot.bytes());
        out[r].push_back(std::move(u));
      }
    }
    return out;
  }

  std::vector<std::vector<float>> State() {
    auto chunks = GetState(*svc, open[0].session_id());
    EXPECT_TRUE(chunks.ok()) << chunks.status();
    std::vector<std::vector<float>> m(table.size());
    if (!chunks.ok()) return m;
    for (const auto& c : *chunks) {
      if (!c.has_momentum()) continue;
      auto& v = m[c.momentum().param_id()];
      const std::string& d = c.momentum().data();
      v.resize(v.size() + d.size() / 4);
      std::memcpy(v.data() + v.size() - d.size() / 4, d.data(), d.size());
    }
    return m;
  }
};

inline std::vector<std::vector<std::vector<float>>> Grads(int world,
                                                          uint64_t seed,
                                                          bool nan = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<std::vector<std::vector<float>>> g(world);
  for (int r = 0; r < world; ++r) {
    for (const P& p : kTable) {
      const int64_t rows = p.sharding == v1::SHARDING_ROWS
                               ? (r + 1) * p.rows / world - r * p.rows / world
                               : p.rows;
      std::vector<float> v(rows * p.cols);
      for (float& x : v) x = d(rng);
      g[r].push_back(std::move(v));
    }
  }
  // Replicated: every rank holds the same gradient (rank 0's is used).
  for (int r = 1; r < world; ++r) g[r][0] = g[0][0], g[r][3] = g[0][3];
  if (nan) g[0][3][5] = NAN;
  return g;
}

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_FAKE_DAEMON_H_
