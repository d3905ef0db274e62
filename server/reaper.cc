// Idle jobs (the rules: docs/protocol.md "Idle jobs"): a job whose ranks
// have all closed is dropped after ServiceOptions::job_retention_seconds,
// snapshotted first with --state-dir (LoadPendingSnapshot reads it back).
//
// No thread polls: CloseLocked stores the drop time on the job and kicks the
// reaper, which sleeps until the earliest drop time or the next kick.

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// A snapshot that failed keeps its job; the next try is this much later
// (not at once: the disk is likely still full or read-only).
constexpr std::chrono::seconds kSnapshotRetry(60);

}  // namespace

ReapResult OptimizerService::ReapIdleJobs(
    std::chrono::steady_clock::time_point now) {
  ReapResult out;
  using Clock = std::chrono::steady_clock;
  // Due jobs and the drop time each was due at: a job reopened (and maybe
  // closed again) meanwhile has another, and is kept.
  std::vector<std::pair<std::shared_ptr<Job>, Clock::time_point>> due;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, job] : jobs_) {
      std::lock_guard<std::mutex> jl(job->mu);
      if (job->open_ranks() > 0 || job->drop_at == Clock::time_point::max())
        continue;
      if (job->drop_at <= now) {
        due.emplace_back(job, job->drop_at);
      } else {
        out.next = std::min(out.next, job->drop_at);
      }
    }
  }
  for (auto& [job, at] : due) {
    bool snapshotted = false;
    absl::Status saved;
    if (!options_.state_dir.empty()) {
      std::string bytes;
      int64_t steps = 0;
      {
        std::lock_guard<std::mutex> jl(job->mu);
        if (job->open_ranks() > 0 || job->drop_at != at) continue;
        // A broken job's state is not consistent: nothing to keep.
        if (!job->broken) {
          saved = PullStateLocked(*job);
          if (saved.ok()) {
            bytes = SerializeJobLocked(*job);
            steps = job->completed_steps;
          }
        }
      }
      if (!bytes.empty()) {
        saved = WriteSnapshot(job->id, job->serial, steps, bytes);
        snapshotted = saved.ok();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> jl(job->mu);
    auto it = jobs_.find(job->id);
    if (it == jobs_.end() || it->second != job || job->open_ranks() > 0 ||
        job->drop_at != at) {
      continue;  // reopened while its snapshot was written: kept
    }
    if (!saved.ok()) {
      CountError(saved);
      out.failed.push_back(absl::Status(
          saved.code(),
          absl::StrCat("job '", job->id,
                       "' kept past its retention: ", saved.message(),
                       "; retried in ", kSnapshotRetry.count(), "s")));
      job->drop_at = now + kSnapshotRetry;
      out.next = std::min(out.next, job->drop_at);
      continue;
    }
    job->dropped = true;
    jobs_.erase(it);
    scheduler_->DropJob(job->serial);
    if (options_.device_transports)
      options_.device_transports->DropJob(job->serial);
    // The host copies go with the job; the next of this id reads the file.
    if (snapshotted) snapshot_files_[job->id] = SnapshotPath(job->id);
    out.dropped.emplace_back(job->id, snapshotted);
    if (metrics_) metrics_->SetJobs(static_cast<int>(jobs_.size()));
  }
  return out;
}

void OptimizerService::StartReaper(
    std::function<void(const ReapResult&)> report) {
  reaper_ = std::thread([this, report = std::move(report)] {
    std::unique_lock<std::mutex> lock(reaper_mu_);
    while (!reaper_stop_) {
      // Cleared before the pass: a close during it kicks another.
      reaper_kicked_ = false;
      lock.unlock();
      const ReapResult r = ReapIdleJobs(std::chrono::steady_clock::now());
      if (report && (!r.dropped.empty() || !r.failed.empty())) report(r);
      lock.lock();
      auto woken = [this] { return reaper_stop_ || reaper_kicked_; };
      if (r.next == std::chrono::steady_clock::time_point::max()) {
        reaper_cv_.wait(lock, woken);
      } else {
        reaper_cv_.wait_until(lock, r.next, woken);
      }
    }
  });
}

}  // namespace dmuon::server
