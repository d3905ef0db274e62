// Idle jobs (the rules: docs/protocol.md "Idle jobs"): a job whose ranks
// have all closed is dropped after ServiceOptions::job_retention_seconds,
// snapshotted first with --state-dir (LoadPendingSnapshot reads it back).
// The pass is OptimizerService::ReapIdleJobs; the thread that runs it is a
// DeadlineThread (deadline_thread.h).

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// A snapshot that failed keeps its job; the next try is this much later
// (not at once: the disk is likely still full or read-only).
constexpr std::chrono::seconds kSnapshotRetry(60);

}  // namespace

void OptimizerService::StartReaper(
    std::function<void(const ReapResult&)> report) {
  reaper_.Start([this, report = std::move(report)] {
    const ReapResult r = ReapIdleJobs(std::chrono::steady_clock::now());
    if (report && (!r.dropped.empty() || !r.failed.empty())) report(r);
    return r.next;
  });
}

ReapResult OptimizerService::ReapIdleJobs(
    std::chrono::steady_clock::time_point now) {
  ReapResult out;
  using Clock = std::chrono::steady_clock;
  // Due jobs and the drop time each was due at: a job reopened (and maybe
  // closed again) meanwhile has another, and is kept.
  std::vector<std::pair<std::shared_ptr<Job>, Clock::time_point>> due;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      absl::MutexLock jl(&job->mu());
      // A rank being opened (Job::joining) keeps it.
      if (job->open_ranks() > 0 || job->joining() > 0 ||
          job->drop_at() == Clock::time_point::max())
        continue;
      if (job->drop_at() <= now) {
        due.emplace_back(job, job->drop_at());
      } else {
        out.next = std::min(out.next, job->drop_at());
      }
    }
  }
  for (auto& [job, at] : due) {
    bool snapshotted = false;
    absl::Status saved;
    if (snapshots_.enabled()) {
      std::string bytes;
      int64_t steps = 0;
      {
        absl::MutexLock jl(&job->mu());
        if (job->open_ranks() > 0 || job->joining() > 0 || job->drop_at() != at)
          continue;
        // A broken job's state is not consistent: nothing to keep. A job
        // whose step was rolled back (a rank left mid-step) may still be
        // ending a computation of it.
        if (!job->broken()) {
          (void)WaitUntilNotRunning(*job, kSnapshotWait);
          auto got = SnapshotBytes(*scheduler_, *job);
          saved = got.status();
          if (got.ok()) {
            bytes = *std::move(got);
            steps = job->completed_steps();
          }
        }
      }
      if (!bytes.empty()) {
        saved = snapshots_.Write(job->id(), job->serial(), steps, bytes);
        snapshotted = saved.ok();
      }
    }
    // Its executors' state is let go of after mu_ (its host copies when
    // `due` goes).
    Graveyard gone(this);
    absl::MutexLock lock(&mu_);
    absl::MutexLock jl(&job->mu());
    auto it = jobs_.find(job->id());
    if (it == jobs_.end() || it->second != job || job->open_ranks() > 0 ||
        job->joining() > 0 || job->drop_at() != at) {
      continue;  // reopened while its snapshot was written: kept
    }
    if (!saved.ok()) {
      CountError(saved);
      out.failed.push_back(absl::Status(
          saved.code(),
          absl::StrCat("job '", job->id(),
                       "' kept past its retention: ", saved.message(),
                       "; retried in ", kSnapshotRetry.count(), "s")));
      job->set_drop_at(now + kSnapshotRetry);
      out.next = std::min(out.next, job->drop_at());
      continue;
    }
    job->MarkDropped();
    jobs_.erase(it);
    gone.Bury(job, /*drop_state=*/true);
    // The host copies go with the job; the next of this id reads the file.
    if (snapshotted) {
      pending_.AddFile(job->id(), snapshots_.PathOf(job->id()),
                       Summarize(StateHeaderOf(*job)));
    }
    out.dropped.emplace_back(job->id(), snapshotted);
    metrics_->SetJobs(static_cast<int>(jobs_.size()));
  }
  return out;
}

}  // namespace dmuon::server
