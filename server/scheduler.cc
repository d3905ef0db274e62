#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

#include "base/trace.h"

namespace dmuon::server {

Scheduler::Scheduler(std::vector<std::unique_ptr<Executor>> executors,
                     int max_batch)
    : max_batch_(std::max(1, max_batch)) {
  reads_device_memory_ = !executors.empty();
  bool all_keep = true;
  {
    absl::MutexLock lock(&mu_);
    for (auto& e : executors) {
      holds_state_ = holds_state_ || e->holds_state();
      all_keep = all_keep && (!e->holds_state() || e->keeps_step_start());
      reads_device_memory_ = reads_device_memory_ && e->reads_device_memory();
      ExecutorStats stats;
      stats.device = e->device();
      stats_.push_back(stats);
      queues_.emplace_back();
      workers_.push_back(Worker{std::move(e), std::thread()});
    }
  }
  keeps_step_start_ = holds_state_ && all_keep;
  for (size_t i = 0; i < workers_.size(); ++i)
    workers_[i].thread = std::thread([this, i] { Loop(i); });
}

Scheduler::~Scheduler() { Shutdown(); }

void Scheduler::Submit(int index, std::shared_ptr<Work> work) {
  std::vector<std::pair<int, std::shared_ptr<Work>>> one;
  one.emplace_back(index, std::move(work));
  SubmitAll(std::move(one));
}

void Scheduler::SubmitAll(
    std::vector<std::pair<int, std::shared_ptr<Work>>> works) {
  absl::MutexLock lock(&mu_);
  for (auto& [index, work] : works) {
    const size_t i = static_cast<size_t>(index) % workers_.size();
    queues_[i].push_back({work->forward_order(), seq_++, std::move(work)});
    stats_[i].queue_depth = static_cast<int>(queues_[i].size());
  }
}

std::vector<ExecutorStats> Scheduler::Stats() const {
  absl::MutexLock lock(&mu_);
  std::vector<ExecutorStats> out;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Executor& e = *workers_[i].executor;
    out.push_back(stats_[i]);
    out.back().healthy = e.healthy();
    out.back().memory_bytes = e.memory_bytes();
    out.back().last_error = e.last_error();
    out.back().graph_fallbacks = e.graph_fallbacks();
  }
  return out;
}

std::vector<int> Scheduler::Healthy() const {
  std::vector<int> out;
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].executor->healthy()) out.push_back(static_cast<int>(i));
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

absl::Status Scheduler::RestoreStepStart(int index, const StateKey& key) {
  return executor(index).RestoreStepStart(key);
}

absl::Status Scheduler::ReadStepStart(int index, const StateKey& key,
                                      absl::Span<float> host) {
  return executor(index).ReadStepStart(key, host);
}

void Scheduler::DropJob(uint64_t job) {
  for (auto& w : workers_) w.executor->DropJob(job);
}

void Scheduler::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  for (auto& w : workers_) {
    if (w.thread.joinable()) w.thread.join();
  }
}

void Scheduler::Loop(size_t index) {
  Executor& executor = *workers_[index].executor;
  const int max_batch = executor.batching_saves_time() ? max_batch_ : 1;
  auto earlier = [](const Queued& a, const Queued& b) {
    return a.order != b.order ? a.order < b.order : a.seq < b.seq;
  };
  for (;;) {
    std::vector<std::shared_ptr<Work>> picked;
    BatchRun run;
    run.executor = static_cast<int>(index);
    {
      absl::MutexLock lock(&mu_);
      std::vector<Queued>& queue = queues_[index];
      auto ready = [this, &queue] {
        mu_.AssertHeld();
        return stopping_ || !queue.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue.empty()) return;  // stopping, and nothing left to run
      auto first = std::min_element(queue.begin(), queue.end(), earlier);
      std::shared_ptr<Work> head = first->work;
      queue.erase(first);
      picked.push_back(head);
      // Same shape and hyperparameters, earliest first, up to max_batch.
      std::sort(queue.begin(), queue.end(), earlier);
      for (auto it = queue.begin();
           it != queue.end() && static_cast<int>(picked.size()) < max_batch;) {
        ComputeTask x, y;
        x.shape = head->shape();
        x.muon = head->muon();
        y.shape = it->work->shape();
        y.muon = it->work->muon();
        if (SameBatchKey(x, y)) {
          picked.push_back(it->work);
          it = queue.erase(it);
        } else {
          ++it;
        }
      }
      stats_[index].queue_depth = static_cast<int>(queue.size());
      run.batch = batches_++;
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
    run.size = static_cast<int>(ready.size());
    run.start_ns = TraceNowNs();
    absl::Status st = executor.Compute(tasks);
    run.end_ns = TraceNowNs();
    const double compute = static_cast<double>(run.end_ns - run.start_ns) / 1e9;
    double flops = 0;
    for (auto& work : ready) {
      flops += work->flops();
      work->Ran(run);
      work->Computed(compute / static_cast<double>(ready.size()));
      work->Finish(st);
    }
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    absl::MutexLock lock(&mu_);
    ExecutorStats& stats = stats_[index];
    stats.busy_seconds += busy;
    stats.matrices += ready.size();
    if (st.ok()) stats.flops += flops;
  }
}

}  // namespace dmuon::server
