// Status and the executors' load for /metrics: what the daemon is doing,
// read under the service's and each job's lock.

#include <algorithm>
#include <chrono>

#include "server/job.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// Adds `job`'s per-step load on each executor to `predicted` and `measured`
// (sized the executor count) when they are not null and, when `out` is not
// null, lists it there under the executors' `devices`.
void AddJobLoad(const Job& job, const std::vector<ExecutorStats>& devices,
                std::vector<double>* predicted, std::vector<double>* measured,
                v1::JobStatus* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  const std::vector<double>& last = job.last_step_compute_seconds();
  for (size_t e = 0; e < devices.size(); ++e) {
    const double p = e < job.plan().predicted_load.size()
                         ? job.plan().predicted_load[e]
                         : 0.0;
    const double m = e < last.size() ? last[e] : 0.0;
    if (predicted != nullptr) (*predicted)[e] += p;
    if (measured != nullptr) (*measured)[e] += m;
    if (out == nullptr) continue;
    v1::ExecutorLoad* l = out->add_executor_loads();
    l->set_device(devices[e].device);
    l->set_predicted_step_seconds(p);
    l->set_measured_step_seconds(m);
  }
}

// Fills `out`'s use of the executors from the scheduler's accounting
// (`shares`, by job serial; `all_seconds`: every listed job's seconds).
void SetShare(const Job& job, const std::map<uint64_t, JobShareStats>& shares,
              double all_seconds, v1::JobStatus* out) {
  out->set_weight(job.weight());
  auto it = shares.find(job.serial());
  if (it == shares.end()) return;
  const JobShareStats& s = it->second;
  out->set_device_seconds(s.busy_seconds);
  out->set_device_share(all_seconds > 0 ? s.busy_seconds / all_seconds : 0);
  if (s.matrices > 0)
    out->set_queue_wait_mean_seconds(s.wait_seconds /
                                     static_cast<double>(s.matrices));
  out->set_queue_wait_max_seconds(s.max_wait_seconds);
}

// Each listed job's marks (JobStatus.marks), and a job held only as marks
// (no momentum in memory nor snapshot: resumable at a mark alone) listed
// with its marks and nothing else.
void FillMarks(std::map<std::string, MarkList> marks, v1::StatusResponse* r) {
  for (auto& j : *r->mutable_jobs()) {
    auto it = marks.find(j.job_id());
    if (it == marks.end()) continue;
    for (int64_t step : it->second.steps) j.add_marks(step);
    j.set_mark_bytes(it->second.bytes);
    marks.erase(it);
  }
  for (const auto& [id, list] : marks) {
    auto* j = r->add_jobs();
    j->set_job_id(id);
    for (int64_t step : list.steps) j->add_marks(step);
    j->set_mark_bytes(list.bytes);
  }
}

}  // namespace

std::vector<ExecutorStats> OptimizerService::ExecutorStatsWithLoad() const {
  std::vector<ExecutorStats> stats = scheduler_->Stats();
  std::vector<double> predicted(stats.size(), 0.0);
  std::vector<double> measured(stats.size(), 0.0);
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      absl::MutexLock jl(&job->mu());
      if (job->open()) AddJobLoad(*job, stats, &predicted, &measured, nullptr);
    }
  }
  for (size_t i = 0; i < stats.size(); ++i) {
    stats[i].predicted_step_seconds = predicted[i];
    stats[i].measured_step_seconds = measured[i];
  }
  return stats;
}

std::vector<SnapshotStore::Error> OptimizerService::SnapshotErrors() const {
  if (!snapshots_.enabled()) return {};
  return snapshots_.errors();
}

v1::StatusResponse OptimizerService::Status() const {
  v1::StatusResponse r;
  r.set_version(options_.version);
  // Before mu_: the store's lock may be held for a whole write.
  if (snapshots_.enabled())
    for (auto& e : snapshots_.errors())
      r.add_snapshot_errors(std::move(e.message));
  r.set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_)
          .count());
  const auto now = std::chrono::steady_clock::now();
  std::vector<ExecutorStats> stats = scheduler_->Stats();
  const std::map<uint64_t, JobShareStats> shares = scheduler_->JobTotals();
  std::vector<double> predicted(stats.size(), 0.0);
  std::vector<double> measured(stats.size(), 0.0);
  {
    absl::MutexLock lock(&mu_);
    r.set_serving(!draining_);
    double all_seconds = 0;  // every listed job's device seconds
    for (const auto& [id, job] : jobs_) {
      auto it = shares.find(job->serial());
      if (it != shares.end()) all_seconds += it->second.busy_seconds;
    }
    for (const auto& [id, job] : jobs_) {
      absl::MutexLock jl(&job->mu());
      auto* j = r.add_jobs();
      j->set_job_id(id);
      j->set_world_size(job->world_size());
      j->set_ranks_open(job->open_ranks());
      j->set_parameters(job->num_params());
      uint64_t bytes = 0;  // fp32 momentum, wherever it lives
      for (const auto& p : job->table().params)
        bytes += p.shape.elements() * sizeof(float);
      j->set_state_bytes(bytes);
      j->set_completed_steps(job->completed_steps());
      SetShare(*job, shares, all_seconds, j);
      if (job->open_ranks() == 0 &&
          job->drop_at() != std::chrono::steady_clock::time_point::max()) {
        j->set_drop_in_seconds(std::max(
            0.0, std::chrono::duration<double>(job->drop_at() - now).count()));
      }
      int64_t rewind_step = 0;
      for (int rank : job->RewindWaiting(&rewind_step))
        j->add_rewind_waiting_ranks(rank);
      j->set_rewind_step(rewind_step);
      // A job without open ranks (or broken) keeps its listing but no
      // longer loads the executors.
      const bool open = job->open();
      AddJobLoad(*job, stats, open ? &predicted : nullptr,
                 open ? &measured : nullptr, j);
      for (const auto& s : job->ranks()) {
        if (!s) continue;
        const SessionState& st = s->state(*job);
        auto* ss = r.add_sessions();
        ss->set_job_id(id);
        ss->set_rank(s->rank());
        ss->set_transport(s->transport());
        ss->set_step(st.step);
        ss->set_bytes_received(st.bytes_in);
        ss->set_bytes_sent(st.bytes_out);
        ss->set_open_seconds(
            std::chrono::duration<double>(now - s->opened()).count());
      }
    }
    // Jobs that are only a snapshot file, listed until a rank opens one.
    for (const auto& [id, disk] : pending_.OnDisk()) {
      if (jobs_.count(id)) continue;
      auto* j = r.add_jobs();
      j->set_job_id(id);
      j->set_on_disk(true);
      j->set_parameters(disk.parameters);
      j->set_state_bytes(disk.state_bytes);
      j->set_completed_steps(disk.completed_steps);
    }
    FillMarks(marks_.All(), &r);
  }
  for (size_t i = 0; i < stats.size(); ++i) {
    stats[i].predicted_step_seconds = predicted[i];
    stats[i].measured_step_seconds = measured[i];
  }
  for (const ExecutorStats& e : stats) {
    auto* x = r.add_executors();
    x->set_device(e.device);
    x->set_busy_seconds(e.busy_seconds);
    x->set_queue_depth(e.queue_depth);
    x->set_matrices(e.matrices);
    x->set_flops(e.flops);
    x->set_healthy(e.healthy);
    x->set_memory_bytes(e.memory_bytes);
    x->set_last_error(e.last_error);
    x->set_graph_fallbacks(e.graph_fallbacks);
    x->set_predicted_step_seconds(e.predicted_step_seconds);
    x->set_measured_step_seconds(e.measured_step_seconds);
  }
  stats_.Fill(&r);
  for (const auto& [kind, n] : Fallbacks()) (*r.mutable_fallbacks())[kind] = n;
  return r;
}

std::map<std::string, uint64_t> OptimizerService::Fallbacks() const {
  std::map<std::string, uint64_t> counts = fallbacks_.Counts();
  for (const ExecutorStats& e : scheduler_->Stats())
    counts[std::string(kFallbackGraphEager)] += e.graph_fallbacks;
  return counts;
}

}  // namespace dmuon::server
