#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

namespace dmuon::server {

Scheduler::Scheduler(std::vector<std::unique_ptr<Executor>> executors,
                     int max_batch)
    : max_batch_(std::max(1, max_batch)) {
  reads_device_memory_ = !executors.empty();
  for (auto& e : executors) {
    holds_state_ = holds_state_ || e->holds_state();
    reads_device_memory_ = reads_device_memory_ && e->reads_device_memory();
    auto w = std::make_unique<Worker>();
    w->stats.device = e->device();
    w->executor = std::move(e);
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_)
    w->thread = std::thread([this, p = w.get()] { Loop(p); });
}

Scheduler::~Scheduler() { Shutdown(); }

void Scheduler::Submit(int index, std::shared_ptr<Work> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Worker& w = *workers_[static_cast<size_t>(index) % workers_.size()];
    w.queue.push_back({work->forward_order(), seq_++, std::move(work)});
    w.stats.queue_depth = static_cast<int>(w.queue.size());
  }
  cv_.notify_all();
}

std::vector<ExecutorStats> Scheduler::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ExecutorStats> out;
  for (const auto& w : workers_) {
    out.push_back(w->stats);
    out.back().healthy = w->executor->healthy();
    out.back().memory_bytes = w->executor->memory_bytes();
    out.back().last_error = w->executor->last_error();
    out.back().graph_fallbacks = w->executor->graph_fallbacks();
  }
  return out;
}

std::vector<int> Scheduler::Healthy() const {
  std::vector<int> out;
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i]->executor->healthy()) out.push_back(static_cast<int>(i));
  return out;
}

absl::Status Scheduler::ReadState(int index, const StateKey& key,
                                  absl::Span<float> host) {
  return executor(index).ReadState(key, host);
}

absl::Status Scheduler::WriteState(int index, const StateKey& key,
                                   absl::Span<const float> host) {
  return executor(index).WriteState(key, host);
}

void Scheduler::DropJob(uint64_t job) {
  for (auto& w : workers_) w->executor->DropJob(job);
}

void Scheduler::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
  }
}

void Scheduler::Loop(Worker* w) {
  for (;;) {
    std::vector<std::shared_ptr<Work>> picked;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !w->queue.empty(); });
      if (w->queue.empty()) return;  // stopping, and nothing left to run
      auto first = std::min_element(
          w->queue.begin(), w->queue.end(),
          [](const Queued& a, const Queued& b) {
            return a.order != b.order ? a.order < b.order : a.seq < b.seq;
          });
      std::shared_ptr<Work> head = first->work;
      w->queue.erase(first);
      picked.push_back(head);
      // Same shape and hyperparameters, earliest first, up to max_batch.
      std::sort(w->queue.begin(), w->queue.end(),
                [](const Queued& a, const Queued& b) {
                  return a.order != b.order ? a.order < b.order : a.seq < b.seq;
                });
      for (auto it = w->queue.begin();
           it != w->queue.end() &&
           static_cast<int>(picked.size()) < max_batch_;) {
        ComputeTask x, y;
        x.shape = head->shape();
        x.muon = head->muon();
        y.shape = it->work->shape();
        y.muon = it->work->muon();
        if (SameBatchKey(x, y)) {
          picked.push_back(it->work);
          it = w->queue.erase(it);
        } else {
          ++it;
        }
      }
      w->stats.queue_depth = static_cast<int>(w->queue.size());
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<ComputeTask> tasks;
    std::vector<std::shared_ptr<Work>> ready;
    for (auto& work : picked) {
      absl::StatusOr<ComputeTask> t = work->Prepare();
      if (!t.ok()) {
        work->Finish(t.status());
        continue;
      }
      tasks.push_back(*t);
      ready.push_back(work);
    }
    const auto c0 = std::chrono::steady_clock::now();
    absl::Status st = w->executor->Compute(tasks);
    const double compute =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0)
            .count();
    double flops = 0;
    for (auto& work : ready) {
      flops += work->flops();
      work->Computed(compute / static_cast<double>(ready.size()));
      work->Finish(st);
    }
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    std::lock_guard<std::mutex> lock(mu_);
    w->stats.busy_seconds += busy;
    w->stats.matrices += ready.size();
    w->stats.batches += ready.empty() ? 0 : 1;
    if (st.ok()) w->stats.flops += flops;
  }
}

}  // namespace dmuon::server
