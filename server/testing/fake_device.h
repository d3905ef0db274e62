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
// dmuon::Client sends), the daemon's side is the real one (transport/nccl.h:
// NewNcclRegion over an NcclWorker, the job's communicator added with its
// warm-up by AddJobCommunicator), its communicator a FakeNcclNet
// (transport/testing/fake_nccl.h: NCCL's blocking semantics) that the
// trainer finds with FakeTransports::NcclNet(session's nccl.unique_id) and
// joins as its rank.

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
#include "transport/testing/fake_nccl.h"
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
  // strict: dmuond --strict (a failed graph fails the batch).
  explicit FakeDeviceExecutor(int i, bool keeps_step_start = true,
                              bool strict = false)
      : cpu_(NewCpuExecutor(i, 1)),
        name_("fake:" + std::to_string(i)),
        keeps_step_start_(keeps_step_start),
        graphs_(true, strict) {}
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
  GraphFallback graphs_;
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

// nccl-like in pointer mode: the daemon's own memory, filled from the
// client's and sent back to it by a transfer thread (Region::Pull / Push),
// in submission order, straight from and to `client` memory. As the real
// region, a step's pushes are held until every gradient of it was pulled or
// declared absent (Region::Absent; transport/nccl.h ExchangeOrder); an empty
// push (an absent parameter's answer) moves nothing but keeps its place.
// With `fail` set, transfers fail as a dead peer's would.
class FakeMovingRegion : public transport::Region {
 public:
  FakeMovingRegion(std::byte* client, const transport::Layout& layout,
                   const std::atomic<bool>* fail)
      : client_(client),
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
            std::memcpy(mem_.data() + s.gradient_offset,
                        client_ + s.gradient_offset, s.bytes);
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
            std::memcpy(client_ + s.update_offset,
                        mem_.data() + s.update_offset, s.bytes);
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
      if (!req.has_cuda_ipc()) return OpenNccl(job_serial, req, layout, resp);
      // Pointer mode: the communicator, as the real transport answers it.
      auto* n = resp->mutable_nccl();
      n->set_nranks(req.world_size() + 1);
      n->set_daemon_rank(req.world_size());
      std::string id = absl::StrCat("fake-nccl-job-", job_serial);
      id.resize(128, '\0');
      n->set_unique_id(id);
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
  // The communicator a trainer joins for a session whose nccl.unique_id is
  // `unique_id` (null: none such).
  std::shared_ptr<transport::testing::FakeNcclNet> NcclNet(
      const std::string& unique_id) {
    absl::MutexLock l(&nccl_mu_);
    auto it = nets_.find(unique_id);
    return it == nets_.end() ? nullptr : it->second;
  }

  bool nccl = false;
  // Set before the first Open: how long a fake NCCL call blocks before it
  // reports a hang (every rank's, and the worker's transfer deadline) ...
  std::chrono::milliseconds nccl_timeout{10000};
  // ... and false to leave out the daemon's warm-up (the daemon before it,
  // for the test that the old order deadlocks).
  bool nccl_warm_up = true;
  std::atomic<bool> fail{false};
  // Set before the first Open: called with the request's mem_handle when a
  // cuda_ipc-like region is released (its mapping closed).
  std::function<void(const std::string& mem_handle)> on_unmap;
  std::atomic<int> dropped{0};
  void DropJob(uint64_t job_serial) override {
    dropped++;
    absl::MutexLock l(&nccl_mu_);
    auto it = nccl_jobs_.find(job_serial);
    if (it == nccl_jobs_.end()) return;
    worker_->Remove(it->second.comm);
    nccl_jobs_.erase(it);
  }

 private:
  struct NcclJob {
    std::shared_ptr<transport::testing::FakeNcclNet> net;
    int comm = 0;
    std::shared_ptr<std::vector<std::byte>> scratch;  // the warm-up's
  };
  // As CudaTransports does over NCCL: one communicator per job (a new one
  // once it has ended), the daemon's region over host memory.
  absl::StatusOr<std::unique_ptr<transport::Region>> OpenNccl(
      uint64_t job_serial, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) {
    absl::MutexLock l(&nccl_mu_);
    if (worker_ == nullptr) {
      transport::NcclPolicy policy;
      policy.init_timeout_seconds = policy.transfer_timeout_seconds =
          std::chrono::duration<double>(nccl_timeout).count();
      worker_ = std::make_shared<transport::NcclWorker>(policy);
    }
    const transport::NcclRanks ranks =
        transport::NcclRanksFor(req.world_size());
    NcclJob& job = nccl_jobs_[job_serial];
    if (job.net == nullptr || !worker_->status(job.comm).ok()) {
      if (job.net != nullptr) worker_->Remove(job.comm);
      job.net = std::make_shared<transport::testing::FakeNcclNet>(ranks.nranks,
                                                                  nccl_timeout);
      // Kept by the transports and every region of the communicator (whose
      // end aborts it): it may outlive the job's entry.
      job.scratch = std::make_shared<std::vector<std::byte>>(
          transport::NcclWarmUpScratchBytes(ranks));
      scratch_.push_back(job.scratch);
      auto comm =
          transport::testing::NewFakeDaemonComm(job.net, ranks.daemon_rank);
      job.comm = nccl_warm_up
                     ? transport::AddJobCommunicator(*worker_, std::move(comm),
                                                     ranks, job.scratch->data())
                     : worker_->Add(std::move(comm));
      std::string id =
          absl::StrCat("fake-nccl-job-", job_serial, "-", ++nccl_generation_);
      id.resize(128, '\0');
      nets_[id] = job.net;
      unique_ids_[job.net.get()] = id;
    }
    auto* n = resp->mutable_nccl();
    n->set_nranks(ranks.nranks);
    n->set_daemon_rank(ranks.daemon_rank);
    n->set_unique_id(unique_ids_[job.net.get()]);
    auto mem = std::make_shared<std::vector<std::byte>>(layout.total_bytes);
    transport::DeviceView view;  // device -1: host memory, as the executor's
    view.base = mem->data();
    view.bytes = mem->size();
    return transport::NewNcclRegion(worker_, job.comm, req.rank(), layout, view,
                                    [mem, scratch = job.scratch] {});
  }

  absl::Mutex nccl_mu_;
  std::shared_ptr<transport::NcclWorker> worker_ ABSL_GUARDED_BY(nccl_mu_);
  std::map<uint64_t, NcclJob> nccl_jobs_ ABSL_GUARDED_BY(nccl_mu_);
  std::map<std::string, std::shared_ptr<transport::testing::FakeNcclNet>> nets_
      ABSL_GUARDED_BY(nccl_mu_);
  std::map<const transport::testing::FakeNcclNet*, std::string> unique_ids_
      ABSL_GUARDED_BY(nccl_mu_);
  std::vector<std::shared_ptr<std::vector<std::byte>>> scratch_
      ABSL_GUARDED_BY(nccl_mu_);
  int nccl_generation_ ABSL_GUARDED_BY(nccl_mu_) = 0;
};

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_FAKE_DEVICE_H_
