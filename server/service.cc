// The service's sessions: lifetime (attach, detach, close), a step message
// handed to its session's job (the path itself is StepPipeline,
// step_pipeline.h), and the calls that are about the whole daemon (drain,
// busy, errors). Opening a session is service_open.cc; state state.cc;
// Status service_status.cc; idle jobs service_reap.cc.

#include "server/service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/step_pipeline.h"

namespace dmuon::server {
namespace {

// What the service reports to when it is given no metrics.
ServiceMetrics* NoMetrics() {
  static NoServiceMetrics none;
  return &none;
}

}  // namespace

OptimizerService::OptimizerService(ServiceOptions options,
                                   std::unique_ptr<Scheduler> scheduler,
                                   ServiceMetrics* metrics)
    : options_(std::move(options)),
      scheduler_(std::move(scheduler)),
      metrics_(metrics != nullptr ? metrics : NoMetrics()),
      started_(std::chrono::steady_clock::now()),
      fallbacks_(options_.strict, options_.fallback_logged),
      snapshots_(
          options_.state_dir,
          [m = metrics_](double seconds) { m->Snapshot(seconds); },
          [m = metrics_, report = options_.snapshot_failed](
              const char* kind, const absl::Status& st) {
            m->SnapshotFailure(kind);
            if (report) report(st);
          }),
      pipeline_(std::make_unique<StepPipeline>(PipelineContext{
          options_.skip_nonfinite, options_.max_message_bytes,
          options_.snapshot_every, scheduler_.get(), &snapshots_, metrics_,
          &stats_, &fallbacks_, options_.trace})) {
  if (!options_.autotune_cache.empty()) {
    autotuner_ = std::make_unique<kernels::Autotuner>(options_.autotune_cache);
  }
  // The destructor removes the source before the service goes away.
  metrics_->SetExecutorSource([this] { return ExecutorStatsWithLoad(); });
  metrics_->SetFallbackSource([this] { return Fallbacks(); });
  metrics_->SetJobSource([this] { return JobMetricsNow(); });
  if (options_.attach_timeout_seconds > 0) {
    attach_reaper_.Start(
        [this] { return ExpireUnattached(std::chrono::steady_clock::now()); });
  }
}

OptimizerService::~OptimizerService() {
  // The reapers first: one may be dropping a job through the scheduler.
  reaper_.Stop();
  attach_reaper_.Stop();
  scheduler_->Shutdown();
  metrics_->SetExecutorSource(nullptr);
  metrics_->SetFallbackSource(nullptr);
  metrics_->SetJobSource(nullptr);
  std::vector<std::unique_ptr<transport::Region>> gpu;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : sessions_) {
      if (s->transport() == v1::TRANSPORT_SHM && s->region())
        (void)transport::UnlinkShm(s->region()->name());
      // GPU regions may own transport threads whose callbacks use this
      // service: end them while it is whole.
      if (IsDeviceTransport(s->transport())) gpu.push_back(s->TakeRegion());
    }
  }
  gpu.clear();
}

OptimizerService::Graveyard::~Graveyard() {
  bool any = false;
  std::string id;  // for the test hook
  for (const auto& [job, drop] : jobs_) {
    if (job && id.empty()) id = job->id();
    any |= job != nullptr;
  }
  for (const auto& s : sessions_) {
    any |= s != nullptr;
    if (!s || !id.empty()) continue;
    if (auto job = s->job()) id = job->id();
  }
  if (!any) return;
  const ServiceOptions& o = service_->options_;
  if (o.heavy_work_hook) o.heavy_work_hook(id, "release");
  for (const auto& [job, drop] : jobs_) {
    if (!job || !drop) continue;
    service_->scheduler_->DropJob(job->serial());
    if (o.device_transports) o.device_transports->DropJob(job->serial());
  }
  sessions_.clear();  // regions unmapped (the last holder of each)
  jobs_.clear();      // momentum freed (the last holder of each)
}

void OptimizerService::Graveyard::Bury(std::shared_ptr<Job> job,
                                       bool drop_state) {
  jobs_.emplace_back(std::move(job), drop_state);
}

std::shared_ptr<Session> OptimizerService::FindSession(
    const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

absl::Status OptimizerService::Attach(
    const std::string& session_id, std::shared_ptr<StepSink> sink,
    std::shared_ptr<transport::Doorbell>* doorbell) {
  auto s = FindSession(session_id);
  if (!s) return NoOpenSessionError();
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  absl::MutexLock lock(&job->mu());
  SessionState& st = s->state(*job);
  if (st.sink) {
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", s->rank(), " of job '", job->id(),
                     "' already has a Step stream"));
  }
  st.sink = std::move(sink);
  // The client has mapped the segment: the name is no longer needed.
  if (s->transport() == v1::TRANSPORT_SHM)
    (void)transport::UnlinkShm(s->region()->name());
  if (doorbell != nullptr) *doorbell = s->region()->doorbell();
  return absl::OkStatus();
}

bool OptimizerService::Detach(const std::string& session_id,
                              const absl::Status& why) {
  Graveyard gone(this);  // after the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  CloseLocked(it->second, why, gone);
  return true;
}

absl::Status OptimizerService::CloseSession(
    const std::string& session_id,
    std::chrono::steady_clock::time_point release_by, bool* released) {
  std::shared_ptr<RegionRelease> release;
  {
    Graveyard gone(this);  // after the lock
    absl::MutexLock lock(&mu_);
    if (auto it = sessions_.find(session_id); it != sessions_.end()) {
      release = it->second->release();
      CloseLocked(it->second, absl::OkStatus(), gone);
    } else if (auto c = closing_.find(session_id); c != closing_.end()) {
      release = c->second;  // closed when its Step stream ended
    } else {
      return NoOpenSessionError();
    }
  }
  // Without mu_: the step computations that still hold the session finish
  // (Deliver takes only the job's lock), and the last one releases it.
  const bool done = release->WaitUntil(release_by);
  if (done) {
    absl::MutexLock lock(&mu_);
    closing_.erase(session_id);
  }
  if (released != nullptr) *released = done;
  return absl::OkStatus();
}

void OptimizerService::CloseLocked(std::shared_ptr<Session> s,
                                   const absl::Status& why, Graveyard& gone) {
  sessions_.erase(s->id());
  for (auto it = closing_.begin(); it != closing_.end();)
    it = it->second->done() ? closing_.erase(it) : std::next(it);
  closing_[s->id()] = s->release();
  // The job's other ranks, closed with it when its step is rolled back.
  std::vector<std::shared_ptr<Session>> others;
  if (auto job = s->job()) {
    absl::MutexLock jl(&job->mu());
    job->CloseRank(*s);
    const std::string left = absl::StrCat(
        "rank ", s->rank(), " of job '", job->id(), "' left mid-step",
        why.ok() ? " (its Step stream ended before the step completed)"
                 : absl::StrCat(" (", why.message(), ")"));
    // What the leaving rank's own stream ends with: OK only when no step
    // of its was cut short (a half-close right after its last
    // gradients_ready must not read as a step taken).
    absl::Status own = absl::OkStatus();
    if (job->mid_step() && !job->broken() && job->RollBack()) {
      // The step is void for every rank (its updates are not all out):
      // the job goes back to its last completed step and is kept like an
      // idle job, every rank closed, for the trainer to reopen. Executors
      // that hold the state put back their step-start copies (the job
      // breaks, and is dropped below, when they cannot).
      const absl::Status restored = RestoreStepStarts(*scheduler_, *job);
      own = absl::AbortedError(
          restored.ok()
              ? absl::StrCat(
                    left, ": step ", job->completed_steps() + 1,
                    " was not taken; the job is back at its last completed "
                    "step ",
                    job->completed_steps(),
                    " and kept for --job-retention-seconds",
                    options_.state_dir.empty() ? "" : " (then snapshotted)",
                    ": reopen every rank and continue from step ",
                    job->completed_steps() + 1)
              : absl::StrCat(left, "; ", restored.message(),
                             "; reopen every rank and restore state from a "
                             "checkpoint"));
      job->AbortStreams(own);
      for (const auto& r : job->ranks())
        if (r) others.push_back(r);
      for (const auto& r : others) job->CloseRank(*r);
    } else if (job->mid_step() && job->Break()) {
      // Executors that hold state advanced it in place: no way back.
      own = absl::AbortedError(absl::StrCat(
          left, "; reopen every rank and restore state from a checkpoint"));
      job->AbortStreams(own);
    }
    if (const auto& sink = s->state(*job).sink) sink->Abort(own);
    if (job->open_ranks() == 0 && job->broken()) {
      // A rank being opened meanwhile finds it broken (PublishLocked).
      jobs_.erase(job->id());
      job->MarkDropped();
      gone.Bury(job, /*drop_state=*/true);
      // The next job of this id resumes from the last snapshot on disk,
      // never from zero over it.
      if (snapshots_.enabled()) {
        const std::string path = snapshots_.PathOf(job->id());
        // Described by the file (the broken job's own state is not).
        auto head = SnapshotStore::ReadHeader(path);
        if (::access(path.c_str(), F_OK) == 0) {
          pending_.AddFile(job->id(), path,
                           head.ok() ? Summarize(*head) : SnapshotSummary{});
        }
      }
    } else if (job->open_ranks() == 0) {
      // Kept for a restarted trainer to reopen, until the reaper drops it
      // (not while a rank of it is being opened: Job::joining).
      job->set_drop_at(std::chrono::steady_clock::now() +
                       std::chrono::seconds(options_.job_retention_seconds));
      reaper_.Kick();
    }
  }
  if (s->transport() == v1::TRANSPORT_SHM && s->region())
    (void)transport::UnlinkShm(s->region()->name());
  gone.Bury(s);  // its region is unmapped after mu_
  for (const auto& r : others) {
    gone.Bury(r);
    sessions_.erase(r->id());
    closing_[r->id()] = r->release();
    if (r->transport() == v1::TRANSPORT_SHM && r->region())
      (void)transport::UnlinkShm(r->region()->name());
  }
  LimitIdleJobsLocked();
  metrics_->SetSessions(static_cast<int>(sessions_.size()));
  metrics_->SetJobs(static_cast<int>(jobs_.size()));
}

void OptimizerService::LimitIdleJobsLocked() {
  using Clock = std::chrono::steady_clock;
  // Idle jobs (no open rank, waiting for their drop), oldest close first
  // (the retention is one for all, so the earliest drop time).
  std::vector<std::pair<Clock::time_point, std::shared_ptr<Job>>> idle;
  for (const auto& [id, job] : jobs_) {
    absl::MutexLock jl(&job->mu());
    if (job->open_ranks() == 0 && job->joining() == 0 && !job->dropped() &&
        job->drop_at() != Clock::time_point::max()) {
      idle.emplace_back(job->drop_at(), job);
    }
  }
  const size_t keep = static_cast<size_t>(std::max(0, options_.max_idle_jobs));
  if (idle.size() <= keep) return;
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i + keep < idle.size(); ++i) {
    Job& job = *idle[i].second;
    absl::MutexLock jl(&job.mu());
    // Due now: the reaper drops it (snapshotted first with --state-dir).
    if (job.drop_at() > now) job.set_drop_at(now);
  }
  reaper_.Kick();
}

std::chrono::steady_clock::time_point OptimizerService::ExpireUnattached(
    std::chrono::steady_clock::time_point now) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point next = Clock::time_point::max();
  if (options_.attach_timeout_seconds <= 0) return next;
  const auto timeout = std::chrono::seconds(options_.attach_timeout_seconds);
  // Held past the lock: a session's region goes when its last holder does.
  std::vector<std::shared_ptr<Session>> due;
  Graveyard gone(this);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, s] : sessions_) {
    if (auto job = s->job()) {
      absl::MutexLock jl(&job->mu());
      if (s->state(*job).sink) continue;  // attached
    }
    if (s->opened() + timeout <= now) {
      due.push_back(s);
    } else {
      next = std::min(next, s->opened() + timeout);
    }
  }
  for (const auto& s : due) {
    CloseLocked(s,
                absl::DeadlineExceededError(
                    absl::StrCat("rank ", s->rank(),
                                 " never attached its Step stream within "
                                 "--attach-timeout-seconds=",
                                 options_.attach_timeout_seconds)),
                gone);
  }
  return next;
}

int OptimizerService::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  return static_cast<int>(sessions_.size());
}

void OptimizerService::Undrain() {
  absl::MutexLock lock(&mu_);
  draining_ = false;
}

std::map<std::string, std::string> OptimizerService::JobOwners() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::string> owners;
  for (const auto& [id, job] : jobs_) owners[id] = job->owner();
  for (const auto& [id, disk] : pending_.OnDisk())
    owners.emplace(id, disk.owner);  // only a file: its header's owner
  return owners;
}

bool OptimizerService::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

bool OptimizerService::Busy() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    absl::MutexLock jl(&job->mu());
    if (!job->broken() && job->mid_step()) return true;
  }
  return false;
}

int OptimizerService::open_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

void OptimizerService::CountError(const absl::Status& st) const {
  pipeline_->CountError(st);
}

absl::Status OptimizerService::OnStepRequest(const std::string& session_id,
                                             const v1::StepRequest& req) {
  auto s = FindSession(session_id);
  if (!s) return NoOpenSessionError();
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  return pipeline_->OnRequest(s, job, req, draining());
}

}  // namespace dmuon::server
