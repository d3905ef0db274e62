// Test doubles for the service's GPU paths on the CPU (executor.h,
// device_transport.h): an executor that holds state and reads "device"
// memory that is host memory (with the CUDA executor's health rules and
// graph fallback, gpu_logic.h, and injectable graph-capture failures), and
// GPU transports whose regions are memory the test client owns
// (cuda_ipc-like: mapped; nccl-like: moved by a transfer thread).
// fake_daemon.h runs a job through the service with them;
// tests/fake_gpu_dmuond.cc is a whole daemon made of them. Header-only,
// testonly.
//
// FakeTransports' cuda_ipc.mem_handle (the "GPU memory" the client exports):
//   exactly sizeof(void*) bytes — the raw address of the client's memory (an
//     in-process test);
//   "shm:" + a POSIX shm name ("shm:/seg") — a segment the client process
//     created (another process: a Python test), mapped by the daemon;
//   anything else — INVALID_ARGUMENT naming mem_handle.
// Region byte 0 is that memory + cuda_ipc.offset (a multiple of 64).
// FakeTransports::on_unmap hears of each such region's release (the moment
// dmuond_cuda closes the IPC handle), for tests of the order the client
// frees its memory in.
// nccl-like sessions: with cuda_ipc set (pointer mode), the transfer thread
// copies straight from and to the client's memory; without (what
// dmuon::Client sends), the slots travel over a FakeNcclLink that the client
// finds in FakeTransports::fabric by the session's nccl.unique_id and rank,
// and pushes/pops in the order ncclSend/ncclRecv groups would post them.

#ifndef DMUON_SERVER_TESTING_FAKE_DEVICE_H_
#define DMUON_SERVER_TESTING_FAKE_DEVICE_H_

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/gpu_logic.h"
#include "server/service.h"
#include "transport/nccl.h"
#include "transport/transport.h"

namespace dmuon::server::testing {

// The CUDA executor's contract on the CPU. Its "Newton–Schulz launch" (the
// CPU executor's compute of the batch) goes through a GraphFallback and its
// results through Health, as cuda_executor.cc's do: with
// fail_graph_captures set, every launch with graphs fails before computing
// anything, as a failed capture does.
class FakeDeviceExecutor : public Executor {
 public:
  // keeps_step_start: as the CUDA executor, a copy of each task's state
  // from before its Compute (executor.h); false: none (rollbacks refused).
  explicit FakeDeviceExecutor(int i, bool keeps_step_start = true)
      : cpu_(NewCpuExecutor(i, 1)),
        name_("fake:" + std::to_string(i)),
        keeps_step_start_(keeps_step_start) {}
  std::string device() const override { return name_; }
  bool holds_state() const override { return true; }
  bool keeps_step_start() const override { return keeps_step_start_; }
  bool reads_device_memory() const override { return true; }
  bool healthy() const override { return healthy_ && health_.healthy(); }
  std::string last_error() const override { return health_.last_error(); }
  uint64_t memory_bytes() const override { return 4096; }
  uint64_t device_memory_capacity() const override { return capacity_bytes; }
  // The "device's" total memory it reports (0: none, as a host executor).
  uint64_t capacity_bytes = 0;
  uint64_t graph_fallbacks() const override { return graphs_.fallbacks(); }
  std::atomic<bool> healthy_{true};
  std::atomic<int> tasks_{0};
  std::atomic<bool> fail_graph_captures{false};
  // Set before the first Compute: runs at the start of every Compute (a
  // test holds a computation in flight with it).
  std::function<void()> on_compute;
  std::vector<std::string> warnings() {
    absl::MutexLock lock(&mu_);
    return warnings_;
  }

  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    if (on_compute) on_compute();
    absl::MutexLock lock(&mu_);
    if (health_.out_of_service()) {
      return absl::UnavailableError(
          absl::StrCat(name_, " is out of service: ", health_.last_error()));
    }
    absl::Status st = ComputeLocked(batch);
    health_.Record(st);
    return st;
  }

 private:
  absl::Status ComputeLocked(absl::Span<const ComputeTask> batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
      // Before anything can change it, skipped tasks included.
      if (keeps_step_start_) start_[t.state] = m;
      g[k].assign(n, 0.0f);
      if (t.device_io == nullptr) {
        std::copy(t.grad, t.grad + n, g[k].begin());
      } else {
        const DeviceIo& io = *t.device_io;
        if (io.gather == Gather::kBlocks) {
          // As the CUDA executor: each distinct map from its lowest holder,
          // highest first.
          std::vector<const ShardMap*> maps;
          for (const DevicePart& p : io.parts) maps.push_back(&p.map);
          const std::vector<int> holders = DistinctHolders(maps);
          for (auto h = holders.rbegin(); h != holders.rend(); ++h) {
            const DevicePart& p = io.parts[*h];
            EXPECT_EQ(p.device, -1);
            ScatterToMatrix(p.map, t.shape, p.grad, g[k].data());
          }
        }
        for (const DevicePart& p : io.parts) {
          if (io.gather == Gather::kBlocks) break;
          EXPECT_EQ(p.device, -1);
          const int64_t off =
              io.gather == Gather::kRows ? p.row_begin * cols : 0;
          const int64_t len = (p.row_end - p.row_begin) * cols;
          if (io.gather == Gather::kMean) {
            if (p.grad == nullptr) continue;  // absent on its rank: zeros
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
    if (!inner.empty()) {
      const kernels::Shape shape = inner[0].shape;
      absl::Status st = graphs_.Run(
          name_,
          GraphKey(shape.rows, shape.cols, static_cast<int64_t>(inner.size()),
                   std::string(kernels::MethodName(inner[0].muon->ns.method))),
          [&](bool use_graphs) {
            if (use_graphs && fail_graph_captures) {
              return absl::InternalError(
                  "fake_device.h:1: cudaStreamEndCapture failed: "
                  "cudaErrorStreamCaptureUnsupported (operation not permitted "
                  "when stream is capturing)");
            }
            return cpu_->Compute(inner);
          },
          [] { return absl::OkStatus(); },
          [&](const std::string& w) {
            mu_.AssertHeld();  // Run calls back on this thread, under mu_
            warnings_.push_back(w);
          });
      if (!st.ok()) return st;
    }
    for (size_t k = 0; k < batch.size(); ++k) {
      const ComputeTask& t = batch[k];
      if (t.device_io == nullptr) {
        std::copy(g[k].begin(), g[k].end(), t.update);
        continue;
      }
      const int64_t cols = t.shape.cols;
      for (const DevicePart& p : t.device_io->parts) {
        if (t.device_io->gather == Gather::kBlocks) {
          GatherFromMatrix(p.map, t.shape, g[k].data(), p.update);
          continue;
        }
        const int64_t off =
            t.device_io->gather == Gather::kRows ? p.row_begin * cols : 0;
        std::copy(g[k].begin() + off,
                  g[k].begin() + off + (p.row_end - p.row_begin) * cols,
                  p.update);
      }
    }
    return absl::OkStatus();
  }

 public:
  absl::Status ReadState(const StateKey& key, absl::Span<float> host) override {
    absl::MutexLock lock(&mu_);
    auto it = state_.find(key);
    if (it != state_.end())
      std::copy(it->second.begin(), it->second.end(), host.begin());
    return absl::OkStatus();
  }
  absl::Status WriteState(const StateKey& key,
                          absl::Span<const float> host) override {
    absl::MutexLock lock(&mu_);
    auto it = state_.find(key);
    if (it != state_.end()) it->second.assign(host.begin(), host.end());
    return absl::OkStatus();
  }
  absl::Status RestoreStepStart(const StateKey& key) override {
    absl::MutexLock lock(&mu_);
    if (!keeps_step_start_) return Executor::RestoreStepStart(key);
    auto it = start_.find(key);
    if (it != start_.end()) state_[key] = it->second;
    restores_++;
    return absl::OkStatus();
  }
  absl::Status ReadStepStart(const StateKey& key,
                             absl::Span<float> host) override {
    absl::MutexLock lock(&mu_);
    if (!keeps_step_start_) return Executor::ReadStepStart(key, host);
    auto it = start_.find(key);
    if (it != start_.end())
      std::copy(it->second.begin(), it->second.end(), host.begin());
    return absl::OkStatus();
  }
  // RestoreStepStart calls.
  std::atomic<int> restores_{0};
  void DropJob(uint64_t job) override {
    absl::MutexLock lock(&mu_);
    for (auto it = state_.begin(); it != state_.end();)
      it = it->first.job == job ? state_.erase(it) : std::next(it);
    for (auto it = start_.begin(); it != start_.end();)
      it = it->first.job == job ? start_.erase(it) : std::next(it);
  }
  size_t states() {
    absl::MutexLock lock(&mu_);
    return state_.size();
  }

 private:
  std::unique_ptr<Executor> cpu_;
  const std::string name_;
  const bool keeps_step_start_;
  Health health_;
  GraphFallback graphs_{true};
  absl::Mutex mu_;
  std::map<StateKey, std::vector<float>> state_ ABSL_GUARDED_BY(mu_);
  // By key: its state before its last Compute (keeps_step_start_).
  std::map<StateKey, std::vector<float>> start_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> warnings_ ABSL_GUARDED_BY(mu_);  // GraphFallback's
};

// "Device" memory the client owns; the request carries its address (or the
// name of its shm segment, mapped by `mapping`, which the region keeps).
// `on_release` runs when the region is gone (the mapping closed), as
// cudaIpcCloseMemHandle would be.
class ClientMappedRegion : public transport::Region {
 public:
  ClientMappedRegion(std::byte* base, uint64_t bytes,
                     std::unique_ptr<transport::Region> mapping = nullptr,
                     std::function<void()> on_release = nullptr)
      : mapping_(std::move(mapping)), on_release_(std::move(on_release)) {
    view_.base = base;
    view_.bytes = bytes;
  }
  ~ClientMappedRegion() override {
    mapping_.reset();
    if (on_release_) on_release_();
  }
  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }
  const transport::DeviceView* device() const override { return &view_; }

 private:
  std::unique_ptr<transport::Region> mapping_;
  const std::function<void()> on_release_;
  transport::DeviceView view_;
  std::string name_;
};

// One trainer rank's point-to-point link with the daemon in a fake NCCL
// communicator: two FIFOs of slots, tagged with their parameter id (real
// NCCL matches by order alone; the tag lets the fake check that order).
class FakeNcclLink {
 public:
  struct Slot {
    int param = -1;
    std::vector<std::byte> data;
  };
  // to_daemon: a gradient (the trainer's ncclSend); else an update (the
  // daemon's ncclSend).
  void Send(bool to_daemon, Slot slot) {
    absl::MutexLock l(&mu_);
    (to_daemon ? to_daemon_ : to_client_).push_back(std::move(slot));
  }
  // The next slot for the daemon (at_daemon) or the trainer, waiting up to
  // `timeout`; UNAVAILABLE naming the side when none comes (a peer that
  // never posted its send).
  absl::StatusOr<Slot> Receive(bool at_daemon,
                               std::chrono::milliseconds timeout) {
    absl::MutexLock l(&mu_);
    std::deque<Slot>& q = at_daemon ? to_daemon_ : to_client_;
    auto sent = [&q] { return !q.empty(); };  // under mu_
    if (!mu_.AwaitWithTimeout(absl::Condition(&sent),
                              absl::FromChrono(timeout))) {
      return absl::UnavailableError(
          absl::StrCat("fake nccl: no ", at_daemon ? "gradient" : "update",
                       " sent within ", timeout.count(), " ms"));
    }
    Slot s = std::move(q.front());
    q.pop_front();
    return s;
  }

 private:
  absl::Mutex mu_;
  std::deque<Slot> to_daemon_ ABSL_GUARDED_BY(mu_);
  std::deque<Slot> to_client_ ABSL_GUARDED_BY(mu_);
};

// The fake communicators: one link per (unique id, trainer rank), made by
// whichever side asks first.
class FakeNcclFabric {
 public:
  std::shared_ptr<FakeNcclLink> Link(const std::string& unique_id, int rank) {
    absl::MutexLock l(&mu_);
    auto& link = links_[{unique_id, rank}];
    if (!link) link = std::make_shared<FakeNcclLink>();
    return link;
  }

 private:
  absl::Mutex mu_;
  std::map<std::pair<std::string, int>, std::shared_ptr<FakeNcclLink>> links_
      ABSL_GUARDED_BY(mu_);
};

// nccl-like: the daemon's own memory, filled from the client's and sent back
// to it by a transfer thread (Region::Pull / Push), in submission order:
// straight from and to `client` memory, or (client null) over `link`, where
// a gradient that is not the next one Pull expects fails the transfer (the
// order rule of transport/nccl.h broken). As the real region, a step's
// pushes are held until every gradient of it was pulled or declared absent
// (Region::Absent; transport/nccl.h ExchangeOrder); an empty push (an
// absent parameter's answer) moves nothing but keeps its place. With
// `fail` set, transfers fail as a dead peer's would.
class FakeMovingRegion : public transport::Region {
 public:
  FakeMovingRegion(std::byte* client, const transport::Layout& layout,
                   const std::atomic<bool>* fail,
                   std::shared_ptr<FakeNcclLink> link = nullptr)
      : client_(client),
        link_(std::move(link)),
        layout_(layout),
        mem_(layout.total_bytes),
        fail_(fail),
        order_(static_cast<int>(layout.slots.size())) {
    view_.base = mem_.data();
    view_.bytes = mem_.size();
    thread_ = std::thread([this] { Loop(); });
  }
  ~FakeMovingRegion() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }
  const transport::DeviceView* device() const override { return &view_; }
  bool moves_data() const override { return true; }
  void Pull(int64_t step, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    absl::MutexLock l(&order_mu_);
    const int count = static_cast<int>(params.size());
    Queue(
        [this, params]() -> absl::Status {
          for (int p : params) {
            const auto& s = layout_.slots[p];
            if (client_ != nullptr) {
              std::memcpy(mem_.data() + s.gradient_offset,
                          client_ + s.gradient_offset, s.bytes);
              continue;
            }
            auto got = link_->Receive(/*at_daemon=*/true, kLinkTimeout);
            if (!got.ok()) return got.status();
            if (got->param != p || got->data.size() != s.bytes) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "fake nccl: received the gradient of parameter ", got->param,
                  " (", got->data.size(), " bytes) where parameter ", p, " (",
                  s.bytes,
                  " bytes) was expected: sends out of the order of "
                  "GradientsReady"));
            }
            std::memcpy(mem_.data() + s.gradient_offset, got->data.data(),
                        s.bytes);
          }
          return absl::OkStatus();
        },
        done);
    Release(order_.GradientsPosted(step, count));
  }
  void Absent(int64_t step, int count) override {
    absl::MutexLock l(&order_mu_);
    Release(order_.GradientsPosted(step, count));
  }
  void Push(int64_t step, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    absl::MutexLock l(&order_mu_);
    const uint64_t token = ++next_token_;
    if (!order_.MayPush(step, token)) {
      held_[token] = {std::move(params), std::move(done)};
      return;
    }
    QueuePush(std::move(params), std::move(done));
  }

 private:
  static constexpr std::chrono::milliseconds kLinkTimeout{10000};
  void Release(const std::vector<uint64_t>& tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(order_mu_) {
    for (uint64_t token : tokens) {
      auto it = held_.find(token);
      QueuePush(std::move(it->second.first), std::move(it->second.second));
      held_.erase(it);
    }
  }
  void QueuePush(std::vector<int> params,
                 std::function<void(absl::Status)> done) {
    Queue(
        [this, params]() -> absl::Status {
          for (int p : params) {
            const auto& s = layout_.slots[p];
            if (client_ != nullptr) {
              std::memcpy(client_ + s.update_offset,
                          mem_.data() + s.update_offset, s.bytes);
              continue;
            }
            const std::byte* u = mem_.data() + s.update_offset;
            link_->Send(/*to_daemon=*/false,
                        {p, std::vector<std::byte>(u, u + s.bytes)});
          }
          return absl::OkStatus();
        },
        done);
  }
  void Queue(std::function<absl::Status()> copy,
             std::function<void(absl::Status)> done) {
    absl::MutexLock l(&mu_);
    q_.push_back([this, copy, done] {
      if (fail_->load()) return done(absl::UnavailableError("peer gone"));
      done(copy());
    });
  }
  void Loop() {
    auto woken = [this] {
      mu_.AssertHeld();
      return stop_ || !q_.empty();
    };
    for (;;) {
      std::function<void()> f;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(&woken));
        if (q_.empty()) return;
        f = std::move(q_.front());
        q_.pop_front();
      }
      f();
    }
  }
  std::byte* const client_;
  const std::shared_ptr<FakeNcclLink> link_;
  const transport::Layout layout_;
  std::vector<std::byte> mem_;
  const std::atomic<bool>* fail_;
  absl::Mutex order_mu_;  // the order of Queue calls is the posting order
  transport::ExchangeOrder order_ ABSL_GUARDED_BY(order_mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(order_mu_) = 0;
  std::map<uint64_t,
           std::pair<std::vector<int>, std::function<void(absl::Status)>>>
      held_ ABSL_GUARDED_BY(order_mu_);
  transport::DeviceView view_;
  const std::string name_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> q_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// cuda_ipc and nccl on host memory (see the top of this file for what
// cuda_ipc.mem_handle may hold).
class FakeTransports : public DeviceTransports {
 public:
  bool Supports(v1::Transport t) const override {
    return t == v1::TRANSPORT_CUDA_IPC || (nccl && t == v1::TRANSPORT_NCCL);
  }
  absl::StatusOr<std::unique_ptr<transport::Region>> Open(
      uint64_t job_serial, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) override {
    if (req.transport() == v1::TRANSPORT_NCCL) {
      // The communicator, as the real transport answers it.
      auto* n = resp->mutable_nccl();
      n->set_nranks(req.world_size() + 1);
      n->set_daemon_rank(req.world_size());
      std::string id = absl::StrCat("fake-nccl-job-", job_serial);
      id.resize(128, '\0');
      n->set_unique_id(id);
      if (!req.has_cuda_ipc()) {
        return std::unique_ptr<transport::Region>(new FakeMovingRegion(
            nullptr, layout, &fail, fabric->Link(id, req.rank())));
      }
    }
    const v1::CudaIpcExport& e = req.cuda_ipc();
    if (e.bytes() < layout.total_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc.bytes ", e.bytes(), " < the layout's ", layout.total_bytes,
          " bytes: exported region too small"));
    }
    if (e.offset() % transport::kAlignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc.offset ", e.offset(), " is not a multiple of 64"));
    }
    std::byte* base = nullptr;
    std::unique_ptr<transport::Region> mapping;
    const std::string& h = e.mem_handle();
    if (h.size() == sizeof(base)) {
      std::memcpy(&base, h.data(), sizeof(base));
    } else if (h.rfind("shm:", 0) == 0) {
      auto m = transport::OpenShmRegion(h.substr(4), e.offset() + e.bytes());
      if (!m.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda_ipc.mem_handle '", h,
            "': cannot map it: ", std::string(m.status().message())));
      }
      mapping = std::move(*m);
      base = mapping->bytes().data();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.mem_handle has ", h.size(),
                       " bytes: the fake daemon takes a ", sizeof(base),
                       "-byte address or \"shm:<POSIX shm name>\""));
    }
    if (req.transport() == v1::TRANSPORT_NCCL) {
      return std::unique_ptr<transport::Region>(
          new FakeMovingRegion(base + e.offset(), layout, &fail));
    }
    std::function<void()> release;
    if (on_unmap) release = [f = on_unmap, h] { f(h); };
    return std::unique_ptr<transport::Region>(new ClientMappedRegion(
        base + e.offset(), e.bytes(), std::move(mapping), std::move(release)));
  }
  bool nccl = false;
  std::atomic<bool> fail{false};
  // Set before the first Open: called with the request's mem_handle when a
  // cuda_ipc-like region is released (its mapping closed).
  std::function<void(const std::string& mem_handle)> on_unmap;
  std::atomic<int> dropped{0};
  // The nccl-like sessions' links (when no cuda_ipc pointer is given).
  const std::shared_ptr<FakeNcclFabric> fabric =
      std::make_shared<FakeNcclFabric>();
  void DropJob(uint64_t) override { dropped++; }
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_FAKE_DEVICE_H_
