// Test doubles for the service's GPU paths on the CPU (executor.h,
// device_transport.h): an executor that holds state and reads "device"
// memory that is host memory, and GPU transports whose regions are memory
// the test client owns (cuda_ipc-like: mapped; nccl-like: moved by a
// transfer thread). fake_daemon.h runs a job through the service with them.
// Header-only, testonly.

#ifndef DMUON_SERVER_FAKE_DEVICE_H_
#define DMUON_SERVER_FAKE_DEVICE_H_

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <thread>

#include "server/service.h"
#include "transport/transport.h"

namespace dmuon::server::testing {

class FakeDeviceExecutor : public Executor {
 public:
  explicit FakeDeviceExecutor(int i)
      : cpu_(NewCpuExecutor(i, 1)), name_("fake:" + std::to_string(i)) {}
  std::string device() const override { return name_; }
  bool holds_state() const override { return true; }
  bool reads_device_memory() const override { return true; }
  bool healthy() const override { return healthy_; }
  uint64_t memory_bytes() const override { return 4096; }
  std::atomic<bool> healthy_{true};
  std::atomic<int> tasks_{0};

  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::vector<float>> g(batch.size());
    std::vector<ComputeTask> inner;
    for (size_t k = 0; k < batch.size(); ++k) {
      const ComputeTask& t = batch[k];
      const int64_t n = t.shape.elements(), cols = t.shape.cols;
      tasks_++;
      auto& m = state_[t.state];
      if (m.empty())
        m = t.momentum ? std::vector<float>(t.momentum, t.momentum + n)
                       : std::vector<float>(n, 0.0f);
      g[k].assign(n, 0.0f);
      if (t.device_io == nullptr) {
        std::copy(t.grad, t.grad + n, g[k].begin());
      } else {
        const DeviceIo& io = *t.device_io;
        for (const DevicePart& p : io.parts) {
          EXPECT_EQ(p.device, -1);
          const int64_t off =
              io.gather == Gather::kRows ? p.row_begin * cols : 0;
          const int64_t len = (p.row_end - p.row_begin) * cols;
          if (io.gather == Gather::kMean) {
            for (int64_t i = 0; i < n; ++i) g[k][i] += p.grad[i];
          } else if (io.gather == Gather::kRows || &p == &io.parts[0]) {
            std::copy(p.grad, p.grad + len, g[k].begin() + off);
          }
        }
        if (io.gather == Gather::kMean)
          for (float& x : g[k]) x *= 1.0f / static_cast<float>(io.parts.size());
        bool bad = false;
        for (float x : g[k]) bad |= !std::isfinite(x);
        *t.nonfinite = bad;
        if (bad) {
          std::fill(g[k].begin(), g[k].end(), 0.0f);
          continue;
        }
      }
      ComputeTask c = t;
      c.grad = g[k].data();
      c.update = g[k].data();
      c.momentum = m.data();
      c.device_io = nullptr;
      inner.push_back(c);
    }
    if (auto st = cpu_->Compute(inner); !st.ok()) return st;
    for (size_t k = 0; k < batch.size(); ++k) {
      const ComputeTask& t = batch[k];
      if (t.device_io == nullptr) {
        std::copy(g[k].begin(), g[k].end(), t.update);
        continue;
      }
      const int64_t cols = t.shape.cols;
      for (const DevicePart& p : t.device_io->parts) {
        const int64_t off =
            t.device_io->gather == Gather::kRows ? p.row_begin * cols : 0;
        std::copy(g[k].begin() + off,
                  g[k].begin() + off + (p.row_end - p.row_begin) * cols,
                  p.update);
      }
    }
    return absl::OkStatus();
  }
  absl::Status ReadState(const StateKey& key, absl::Span<float> host) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = state_.find(key);
    if (it != state_.end())
      std::copy(it->second.begin(), it->second.end(), host.begin());
    return absl::OkStatus();
  }
  absl::Status WriteState(const StateKey& key,
                          absl::Span<const float> host) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = state_.find(key);
    if (it != state_.end()) it->second.assign(host.begin(), host.end());
    return absl::OkStatus();
  }
  void DropJob(uint64_t job) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = state_.begin(); it != state_.end();)
      it = it->first.job == job ? state_.erase(it) : std::next(it);
  }
  size_t states() {
    std::lock_guard<std::mutex> lock(mu_);
    return state_.size();
  }

 private:
  std::unique_ptr<Executor> cpu_;
  const std::string name_;
  std::mutex mu_;
  std::map<StateKey, std::vector<float>> state_;
};

// "Device" memory the client owns; the request carries its address.
class ClientMappedRegion : public transport::Region {
 public:
  ClientMappedRegion(std::byte* base, uint64_t bytes) {
    view_.base = base;
    view_.bytes = bytes;
  }
  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }
  const transport::DeviceView* device() const override { return &view_; }

 private:
  transport::DeviceView view_;
  std::string name_;
};

// nccl-like: the daemon's own memory, filled from the client's and sent back
// to it by a transfer thread (Region::Pull / Push), in submission order;
// with `fail` set, transfers fail as a dead peer's would.
class FakeMovingRegion : public transport::Region {
 public:
  FakeMovingRegion(std::byte* client, const transport::Layout& layout,
                   const std::atomic<bool>* fail)
      : client_(client),
        layout_(layout),
        mem_(layout.total_bytes),
        fail_(fail) {
    view_.base = mem_.data();
    view_.bytes = mem_.size();
    thread_ = std::thread([this] { Loop(); });
  }
  ~FakeMovingRegion() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }
  const transport::DeviceView* device() const override { return &view_; }
  bool moves_data() const override { return true; }
  void Pull(int64_t, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    Queue(
        [this, params, done] {
          for (int p : params) {
            const auto& s = layout_.slots[p];
            std::memcpy(mem_.data() + s.gradient_offset,
                        client_ + s.gradient_offset, s.bytes);
          }
        },
        done);
  }
  void Push(int64_t, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    Queue(
        [this, params, done] {
          for (int p : params) {
            const auto& s = layout_.slots[p];
            std::memcpy(client_ + s.update_offset,
                        mem_.data() + s.update_offset, s.bytes);
          }
        },
        done);
  }

 private:
  void Queue(std::function<void()> copy,
             std::function<void(absl::Status)> done) {
    std::lock_guard<std::mutex> l(mu_);
    q_.push_back([this, copy, done] {
      if (fail_->load()) return done(absl::UnavailableError("peer gone"));
      copy();
      done(absl::OkStatus());
    });
    cv_.notify_all();
  }
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      auto f = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      f();
      l.lock();
    }
  }
  std::byte* const client_;
  const transport::Layout layout_;
  std::vector<std::byte> mem_;
  const std::atomic<bool>* fail_;
  transport::DeviceView view_;
  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::thread thread_;
};

// cuda_ipc and nccl on host memory. The client's memory address travels in
// cuda_ipc.mem_handle for both (a test's shortcut).
class FakeTransports : public DeviceTransports {
 public:
  bool Supports(v1::Transport t) const override {
    return t == v1::TRANSPORT_CUDA_IPC || (nccl && t == v1::TRANSPORT_NCCL);
  }
  absl::StatusOr<std::unique_ptr<transport::Region>> Open(
      uint64_t, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) override {
    if (req.cuda_ipc().bytes() < layout.total_bytes)
      return absl::InvalidArgumentError("exported region too small");
    std::byte* base = nullptr;
    std::memcpy(&base, req.cuda_ipc().mem_handle().data(), sizeof(base));
    if (req.transport() == v1::TRANSPORT_NCCL) {
      resp->mutable_nccl()->set_nranks(req.world_size() + 1);
      return std::unique_ptr<transport::Region>(
          new FakeMovingRegion(base, layout, &fail));
    }
    return std::unique_ptr<transport::Region>(
        new ClientMappedRegion(base, req.cuda_ipc().bytes()));
  }
  bool nccl = false;
  std::atomic<bool> fail{false};
  std::atomic<int> dropped{0};
  void DropJob(uint64_t) override { dropped++; }
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_FAKE_DEVICE_H_
