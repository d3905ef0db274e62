#include "server/scheduler.h"

#include <algorithm>
#include <chrono>

#include "base/trace.h"
#include "server/share_cap.h"

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
      lanes_.emplace_back();
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
  const auto now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  for (auto& [index, work] : works) {
    const size_t i = static_cast<size_t>(index) % workers_.size();
    Lane& lane = lanes_[i];
    JobQueue& q = lane.jobs[work->job_serial()];
    if (q.ready.empty()) {
      // Becoming backlogged: start at the lane's virtual time (the least of
      // the backlogged jobs', or the start of the batch in flight if that
      // is less: none saved while idle), but never before the job's own
      // virtual time: a job whose next matrix comes while its own batch
      // runs keeps that batch's charge (else it would win every pick and
      // escape its weight and its principal's cap). See the sharing rule.
      bool any = false;
      double least = 0;
      for (const auto& [id, other] : lane.jobs) {
        if (other.ready.empty()) continue;
        least = any ? std::min(least, other.vtime) : other.vtime;
        any = true;
      }
      if (any) q.vtime = std::max(q.vtime, std::min(least, lane.last_start));
    }
    q.stats.job = work->job_serial();
    q.stats.weight = work->weight() > 0 ? work->weight() : 1;
    q.principal = work->principal();
    q.max_share = work->max_share();
    q.dropped = false;
    Queued e;
    e.order = work->forward_order();
    e.seq = seq_++;
    e.submitted = now;
    e.shape = work->shape();
    e.muon = work->muon();
    e.work = std::move(work);
    q.ready.Push(std::move(e));
    q.stats.queue_depth = static_cast<int>(q.ready.size());
    stats_[i].queue_depth = ++lane.depth;
  }
}

std::vector<Scheduler::Queued> Scheduler::PickBatch(Lane& lane, int max_batch,
                                                    uint64_t& job) {
  // The backlogged job of least virtual time; ties: least recently served.
  JobQueue* q = nullptr;
  for (auto& [id, other] : lane.jobs) {
    if (other.ready.empty()) continue;
    if (q == nullptr || other.vtime < q->vtime ||
        (other.vtime == q->vtime && other.last_pick < q->last_pick)) {
      q = &other;
      job = id;
    }
  }
  // The first in forward order, then its same shape and hyperparameters,
  // earliest first, up to max_batch.
  ReadyQueue& queue = q->ready;
  std::vector<Queued> picked = queue.PopBatch(max_batch);
  // Charged now, at the pick (the cost is predicted, not measured): the
  // next pick already sees it.
  double cost = 0;
  for (const Queued& p : picked) cost += p.work->flops();
  lane.last_start = q->vtime;
  q->vtime += cost / ChargedWeight(lane, job);
  q->last_pick = ++lane.picks;
  q->stats.cost += cost;
  q->stats.batches += 1;
  q->stats.matrices += picked.size();
  q->stats.queue_depth = static_cast<int>(queue.size());
  const auto now = std::chrono::steady_clock::now();
  for (const Queued& p : picked) {
    const double wait =
        std::chrono::duration<double>(now - p.submitted).count();
    q->stats.wait_seconds += wait;
    q->stats.max_wait_seconds = std::max(q->stats.max_wait_seconds, wait);
  }
  lane.depth -= static_cast<int>(picked.size());
  return picked;
}

double Scheduler::ChargedWeight(const Lane& lane, uint64_t job) {
  std::vector<ShareClaim> claims;
  size_t index = 0;
  for (const auto& [id, other] : lane.jobs) {
    // The picked job counts as backlogged: its batch is charged now.
    if (other.ready.empty() && id != job) continue;
    if (id == job) index = claims.size();
    claims.push_back({&other.principal, other.stats.weight, other.max_share});
  }
  return CappedWeights(claims)[index];
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

std::vector<JobShareStats> Scheduler::JobStats(int index) const {
  absl::MutexLock lock(&mu_);
  std::vector<JobShareStats> out;
  const Lane& lane = lanes_[static_cast<size_t>(index) % lanes_.size()];
  for (const auto& [id, q] : lane.jobs) out.push_back(q.stats);
  return out;
}

std::map<uint64_t, JobShareStats> Scheduler::JobTotals() const {
  absl::MutexLock lock(&mu_);
  std::map<uint64_t, JobShareStats> out;
  for (const Lane& lane : lanes_) {
    for (const auto& [id, q] : lane.jobs) {
      JobShareStats& t = out[id];
      t.job = id;
      t.weight = q.stats.weight;
      t.busy_seconds += q.stats.busy_seconds;
      t.cost += q.stats.cost;
      t.batches += q.stats.batches;
      t.matrices += q.stats.matrices;
      t.queue_depth += q.stats.queue_depth;
      t.wait_seconds += q.stats.wait_seconds;
      t.max_wait_seconds =
          std::max(t.max_wait_seconds, q.stats.max_wait_seconds);
      t.max_batch_seconds =
          std::max(t.max_batch_seconds, q.stats.max_batch_seconds);
    }
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
  // Its accounting goes with it (now, or once its queued matrices ran).
  absl::MutexLock lock(&mu_);
  for (Lane& lane : lanes_) {
    auto it = lane.jobs.find(job);
    if (it == lane.jobs.end()) continue;
    if (it->second.ready.empty()) {
      lane.jobs.erase(it);
    } else {
      it->second.dropped = true;
    }
  }
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
  for (;;) {
    std::vector<Queued> picked;
    uint64_t job = 0;
    BatchRun run;
    run.executor = static_cast<int>(index);
    {
      absl::MutexLock lock(&mu_);
      Lane& lane = lanes_[index];
      auto ready = [this, &lane] {
        mu_.AssertHeld();
        return stopping_ || lane.depth > 0;
      };
      mu_.Await(absl::Condition(&ready));
      if (lane.depth == 0) return;  // stopping, and nothing left to run
      picked = PickBatch(lane, max_batch, job);
      stats_[index].queue_depth = lane.depth;
      run.batch = batches_++;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<ComputeTask> tasks;
    std::vector<std::shared_ptr<Work>> ready;
    for (auto& p : picked) {
      absl::StatusOr<ComputeTask> t = p.work->Prepare();
      if (!t.ok()) {
        p.work->Finish(t.status());
        continue;
      }
      tasks.push_back(*t);
      ready.push_back(p.work);
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
    Account(index, job, busy, ready.size(), st.ok() ? flops : 0);
  }
}

// After a batch: the executor's counters and its job's busy time.
void Scheduler::Account(size_t index, uint64_t job, double busy,
                        size_t matrices, double flops) {
  absl::MutexLock lock(&mu_);
  ExecutorStats& stats = stats_[index];
  stats.busy_seconds += busy;
  stats.matrices += matrices;
  stats.flops += flops;
  Lane& lane = lanes_[index];
  auto it = lane.jobs.find(job);
  if (it != lane.jobs.end()) {
    it->second.stats.busy_seconds += busy;
    it->second.stats.max_batch_seconds =
        std::max(it->second.stats.max_batch_seconds, busy);
    if (it->second.dropped && it->second.ready.empty()) lane.jobs.erase(it);
  }
}

}  // namespace dmuon::server
