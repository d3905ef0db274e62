// The service's sessions: lifetime (attach, detach, close), and the calls
// that are about the whole daemon (drain, busy, errors). Opening a session
// is open_session.cc; steps step.cc and param_work.cc; state state.cc;
// Status status.cc; idle jobs reaper.cc.

#include "server/service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/job.h"

namespace dmuon::server {

OptimizerService::OptimizerService(ServiceOptions options,
                                   std::unique_ptr<Scheduler> scheduler,
                                   ServiceMetrics* metrics)
    : options_(std::move(options)),
      scheduler_(std::move(scheduler)),
      metrics_(metrics),
      started_(std::chrono::steady_clock::now()),
      snapshots_(options_.state_dir, [metrics](double seconds) {
        if (metrics) metrics->Snapshot(seconds);
      }) {
  if (!options_.autotune_cache.empty()) {
    autotuner_ = std::make_unique<kernels::Autotuner>(options_.autotune_cache);
  }
  // The destructor removes the source before the service goes away.
  if (metrics_)
    metrics_->SetExecutorSource([this] { return ExecutorStatsWithLoad(); });
}

OptimizerService::~OptimizerService() {
  // The reaper first: it may be dropping a job through the scheduler.
  reaper_.Stop();
  scheduler_->Shutdown();
  if (metrics_) metrics_->SetExecutorSource(nullptr);
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

std::shared_ptr<Session> OptimizerService::FindSession(
    const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

absl::Status OptimizerService::Attach(const std::string& session_id,
                                      std::shared_ptr<StepSink> sink) {
  auto s = FindSession(session_id);
  if (!s)
    return absl::NotFoundError(
        "no open session with this session_id (expired or closed?)");
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
  return absl::OkStatus();
}

bool OptimizerService::Detach(const std::string& session_id,
                              const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  CloseLocked(it->second, why);
  return true;
}

absl::Status OptimizerService::CloseSession(
    const std::string& session_id,
    std::chrono::steady_clock::time_point release_by, bool* released) {
  std::shared_ptr<RegionRelease> release;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = sessions_.find(session_id); it != sessions_.end()) {
      release = it->second->release();
      CloseLocked(it->second, absl::OkStatus());
    } else if (auto c = closing_.find(session_id); c != closing_.end()) {
      release = c->second;  // closed when its Step stream ended
    } else {
      return absl::NotFoundError("no open session with this session_id");
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
                                   const absl::Status& why) {
  sessions_.erase(s->id());
  for (auto it = closing_.begin(); it != closing_.end();)
    it = it->second->done() ? closing_.erase(it) : std::next(it);
  closing_[s->id()] = s->release();
  if (auto job = s->job()) {
    absl::MutexLock jl(&job->mu());
    job->CloseRank(*s);
    if (job->mid_step() && job->Break()) {
      job->AbortStreams(absl::AbortedError(absl::StrCat(
          "rank ", s->rank(), " of job '", job->id(), "' left mid-step",
          why.ok() ? "" : absl::StrCat(" (", why.message(), ")"),
          "; reopen every rank and restore state from a checkpoint")));
    }
    if (const auto& sink = s->state(*job).sink) sink->Abort(absl::OkStatus());
    if (job->open_ranks() == 0 && job->broken()) {
      jobs_.erase(job->id());
      scheduler_->DropJob(job->serial());
      if (options_.device_transports)
        options_.device_transports->DropJob(job->serial());
    } else if (job->open_ranks() == 0) {
      // Kept for a restarted trainer to reopen, until the reaper drops it.
      job->set_drop_at(std::chrono::steady_clock::now() +
                       std::chrono::seconds(options_.job_retention_seconds));
      reaper_.Kick();
    }
  }
  if (s->transport() == v1::TRANSPORT_SHM && s->region())
    (void)transport::UnlinkShm(s->region()->name());
  if (metrics_) {
    metrics_->SetSessions(static_cast<int>(sessions_.size()));
    metrics_->SetJobs(static_cast<int>(jobs_.size()));
  }
}

int OptimizerService::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  return static_cast<int>(sessions_.size());
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
  if (st.ok()) return;
  const std::string code = absl::StatusCodeToString(st.code());
  stats_.CountError(code);
  if (metrics_) metrics_->Error(code);
}

void OptimizerService::RecordLatency(double seconds) {
  stats_.RecordLatency(seconds);
  if (metrics_) metrics_->StepCompleted(seconds);
}

}  // namespace dmuon::server
