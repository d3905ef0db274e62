// OpenSession's admission (service_open.cc is the whole open): under the
// service's lock, cheap checks only. Whether the daemon has room
// (CheckCapacityLocked), and what the open may do to the daemon's jobs:
// join one (its owner, the resume rules, CheckJoin), replace an idle one,
// or make a new one, whose momentum bytes are reserved and whose snapshot
// is taken here while the job itself is made without the lock (BuildJob).

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/resume_step.h"
#include "server/service.h"

namespace dmuon::server {
namespace {
// Whether rank req.rank() with `table` may join the existing `job`.
absl::Status CheckJoin(const Job& job, const v1::OpenSessionRequest& req,
                       const Table& table)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  if (job.broken()) {
    return absl::AbortedError(
        absl::StrCat("job '", job.id(),
                     "' is broken (a rank left mid-step); close every rank "
                     "and start it again, restoring state from a checkpoint"));
  }
  if (job.world_size() != req.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job.id(), "' has world_size ", job.world_size(),
                     "; rank ", req.rank(), " says ", req.world_size()));
  }
  int ref = 0;
  while (ref < job.world_size() && !job.ranks()[ref]) ++ref;
  if (auto st = CompareTables(job.table(), ref < job.world_size() ? ref : 0,
                              table, req.rank());
      !st.ok()) {
    return st;
  }
  if (const auto& open = job.ranks()[req.rank()]) {
    const auto age = std::chrono::duration_cast<std::chrono::seconds>(
        std::chrono::steady_clock::now() - open->opened());
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", req.rank(), " of job '", job.id(), "' is already open",
        open->peer().empty() ? "" : absl::StrCat(" by ", open->peer()),
        ", for ", age.count(),
        " s: another trainer (or an earlier run still alive) uses this job "
        "id; give this one its own job_id, or stop that one (its session "
        "closes when its process ends)"));
  }
  if (job.joining(req.rank())) {
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", req.rank(), " of job '", job.id(),
        "' is being opened by another OpenSession right now: another trainer "
        "(or a retry overlapping its first try) uses this job id; give this "
        "one its own job_id, or open it again once that open ended"));
  }
  for (const auto& other : job.ranks()) {
    if (other && IsDeviceTransport(other->transport()) !=
                     IsDeviceTransport(req.transport())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", req.rank(), " of job '", job.id(), "' asks for ",
          v1::Transport_Name(req.transport()), " but rank ", other->rank(),
          " uses ", v1::Transport_Name(other->transport()),
          ": every rank of a job uses GPU transports (cuda_ipc, nccl) or "
          "none"));
    }
  }
  return absl::OkStatus();
}

// The job's ranks open or being opened, as "0,2".
std::string OpenRanks(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  std::string ranks;
  for (int r = 0; r < job.world_size(); ++r) {
    if (job.ranks()[r] || job.joining(r))
      absl::StrAppend(&ranks, ranks.empty() ? "" : ",", r);
  }
  return ranks;
}

// FRESH on a job holding momentum: ALREADY_EXISTS, naming the job, its step,
// where the momentum is and the two ways on.
absl::Status HoldsMomentumError(const std::string& id, int64_t completed,
                                const std::string& where) {
  return absl::AlreadyExistsError(absl::StrCat(
      "job '", id, "' already holds momentum: it has completed step ",
      completed, " (", where,
      ") and this session asked for a fresh start (resume=fresh). To go on "
      "from step ",
      completed + 1,
      " open it with resume=continue (Python: DMuon(..., resume=True)); to "
      "discard its momentum and start again at step 1, resume=replace "
      "(Python: resume=\"replace\"); or use another job_id"));
}

// CONTINUE on a job holding none: NOT_FOUND.
absl::Status NothingToContinueError(const std::string& id,
                                    const std::string& state_dir) {
  return absl::NotFoundError(absl::StrCat(
      "job '", id,
      "' holds no momentum to continue (resume=continue): no completed step "
      "in this dmuond's memory",
      state_dir.empty()
          ? " (it runs without --state-dir, so a job does not outlive a "
            "restart)"
          : absl::StrCat(" nor a snapshot under --state-dir ", state_dir),
      ". Check the job_id and the daemon's address, or start the job at step "
      "1 with resume=fresh (Python: the default)"));
}

}  // namespace

v1::Resume OptimizerService::ResumeOf(const v1::OpenSessionRequest& req) {
  if (ResumeStepOf(req) > 0) return v1::RESUME_CONTINUE;  // a step continues
  return SpeaksMinor(1) ? req.resume() : v1::RESUME_UNSPECIFIED;
}

absl::Status OptimizerService::CheckSessionsLocked() const {
  if (draining_) {
    return absl::UnavailableError(
        "dmuond is draining: it accepts no new sessions (connect to another)");
  }
  if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("dmuond serves at most ", options_.max_sessions,
                     " sessions (--max-sessions); all are in use"));
  }
  return absl::OkStatus();
}

absl::Status OptimizerService::CheckCapacityLocked(
    const v1::OpenSessionRequest& req, const Table& table) const {
  if (auto st = CheckSessionsLocked(); !st.ok()) return st;
  // A job being made counts as existing for its other ranks: its bytes
  // are reserved already (creating_bytes_).
  if (options_.max_state_bytes > 0 && jobs_.count(req.job_id()) == 0 &&
      creating_.count(req.job_id()) == 0) {
    uint64_t held = creating_bytes_;
    for (const auto& [id, j] : jobs_) held += MomentumBytesOf(j->table());
    const uint64_t want = MomentumBytesOf(table);
    if (held + want > options_.max_state_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a new job of ", want,
          " bytes of fp32 momentum would bring the "
          "daemon's state to ",
          held + want, " bytes, over --max-state-bytes=",
          options_.max_state_bytes, " (", held - creating_bytes_, " held by ",
          jobs_.size(), " jobs, idle ones included",
          creating_.empty()
              ? ""
              : absl::StrCat(", ", creating_bytes_, " reserved by ",
                             creating_.size(), " being opened"),
          ")"));
    }
  }
  return absl::OkStatus();
}

QuotaUse OptimizerService::QuotaUseLocked(const std::string& owner) const {
  QuotaUse use;
  for (const auto& [id, j] : jobs_) {
    if (j->owner() != owner) continue;
    use.jobs += 1;
    use.state_bytes += MomentumBytesOf(j->table());
  }
  for (const auto& [id, c] : creating_) {
    if (c.owner != owner) continue;
    use.jobs += 1;
    use.state_bytes += c.bytes;
  }
  return use;
}

absl::Status OptimizerService::AdmitLocked(const v1::OpenSessionRequest& req,
                                           const Table& table,
                                           const Principal& who,
                                           OpenAdmission* a) {
  const v1::Resume resume = ResumeOf(req);
  if (auto it = jobs_.find(req.job_id()); it != jobs_.end()) {
    if (auto st = AdmitToJobLocked(req, table, who, it->second, a); !st.ok())
      return st;
    if (a->job || a->rebuilt) return absl::OkStatus();  // joined, rebuilt
    // Replaced: made anew below, from zero.
  } else if (ResumesAtMarkLocked(req)) {
    return AdmitRebuildLocked(req, table, who, nullptr, ResumeStepOf(req), a);
  } else if (resume == v1::RESUME_REPLACE && snapshots_.enabled()) {
    const SnapshotFile* old = pending_.Find(req.job_id());
    if (auto st =
            CheckJobOwner(who, old ? old->head.header().owner() : std::string(),
                          req.job_id());
        !st.ok()) {
      return st;
    }
    if (auto moved = snapshots_.Replace(req.job_id(), next_job_serial_);
        !moved.ok()) {
      return moved.status();
    }
    pending_.Drop(req.job_id());
  }
  const SnapshotFile* pending = pending_.Find(req.job_id());
  if (pending) {
    if (auto st =
            CheckJobOwner(who, pending->head.header().owner(), req.job_id());
        !st.ok()) {
      return st;
    }
  }
  // A job held only as marks is its owner's too: a new run of the id by
  // another principal would drop them (PublishLocked's DropMarks).
  if (auto st = CheckMarksOwner(who, req.job_id()); !st.ok()) return st;
  const int64_t pending_done =
      pending ? pending->head.header().completed_steps() : 0;
  if (resume == v1::RESUME_FRESH && pending_done > 0) {
    return HoldsMomentumError(
        req.job_id(), pending_done,
        absl::StrCat("in its snapshot under --state-dir ", options_.state_dir,
                     ", not loaded yet"));
  }
  if (const int64_t want = ResumeStepOf(req);
      want > 0 && pending_done > 0 && want != pending_done) {
    return ResumeStepError(req.job_id(), want, pending_done,
                           "in its snapshot, read for an open of another "
                           "rank",
                           MarksHeld(req.job_id()));
  }
  if (resume == v1::RESUME_CONTINUE && pending_done <= 0) {
    absl::Status none =
        NothingToContinueError(req.job_id(), options_.state_dir);
    const std::string aside = pending_.MovedAside(req.job_id());
    if (aside.empty()) return none;
    return absl::NotFoundError(absl::StrCat(none.message(), " (", aside, ")"));
  }
  if (pending) {
    if (auto st = CheckSnapshot(req.job_id(), table, pending->head.header());
        !st.ok()) {
      return st;
    }
  }
  // Admitted: the job is made without mu_ (BuildJob); until it is
  // published other opens of the id wait, and its bytes count as held.
  // A resumed job keeps its snapshot's owner; a new one is `who`'s.
  const std::string owner = pending ? pending->head.header().owner() : who.name;
  if (!owner.empty() && owner == who.name) {
    if (auto st = CheckQuota(owner, who.quotas, QuotaUseLocked(owner),
                             MomentumBytesOf(table));
        !st.ok()) {
      return st;
    }
  }
  a->created = true;
  a->serial = next_job_serial_++;
  a->owner = owner;
  a->weight = who.weight > 0 ? who.weight : 1;
  a->max_device_share = who.quotas.max_device_share;
  if (pending) {
    a->resumed = Summarize(pending->head.header());
    a->snapshot = pending_.Take(req.job_id());
  }
  a->reserved = MomentumBytesOf(table);
  creating_bytes_ += a->reserved;
  creating_[req.job_id()] = Creating{a->owner, a->reserved};
  a->ranks.assign(req.world_size(), nullptr);
  return absl::OkStatus();
}

absl::Status OptimizerService::AdmitToJobLocked(
    const v1::OpenSessionRequest& req, const Table& table, const Principal& who,
    std::shared_ptr<Job> job, OpenAdmission* a) {
  // Before anything that could describe the job (CheckJoin's messages).
  if (auto st = CheckJobOwner(who, job->owner(), req.job_id()); !st.ok())
    return st;
  const v1::Resume resume = ResumeOf(req);
  // Resume (docs/protocol.md "Resume"): the job in memory is the job's
  // newest state (a snapshot of it on disk is as old or older).
  absl::MutexLock jl(&job->mu());
  const int64_t done = job->completed_steps();
  // Ranks being opened count as open: they will be.
  const int open = job->open_ranks() + job->joining();
  if (resume == v1::RESUME_FRESH && done > 0) {
    return HoldsMomentumError(
        job->id(), done,
        open > 0 ? absl::StrCat(open, " of its ", job->world_size(),
                                " ranks open on this dmuond")
                 : "idle in this dmuond's memory");
  }
  if (resume == v1::RESUME_CONTINUE && done == 0)
    return NothingToContinueError(job->id(), options_.state_dir);
  const int64_t want = ResumeStepOf(req);
  // A mark of the step asked wins over the job's own state of that step
  // when no rank is open: the trainer's checkpoint of step N was taken with
  // the mark of N, while the job may have reached N again in another run
  // (resumed at an earlier mark) that no checkpoint holds. Ranks open (the
  // others of a restart joining the job its first rank made from the mark)
  // just join.
  const bool at_mark =
      want > 0 && (want != done || open == 0) && ResumesAtMarkLocked(req);
  if (want > 0 && want != done && !at_mark) {
    return ResumeStepError(job->id(), want, done,
                           "in this dmuond's memory, which it resumes from "
                           "while it holds the job",
                           MarksHeld(job->id()));
  }
  // Protocol minor 5: made anew at the mark, or at another world size.
  if (at_mark || (SpeaksMinor(5) && open == 0 && resume != v1::RESUME_REPLACE &&
                  req.world_size() != job->world_size())) {
    if (open > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job->id(), "' cannot resume at its mark of step ", want,
          ": rank", open > 1 ? "s " : " ", OpenRanks(*job), " of it ",
          open > 1 ? "are" : "is", " open, past completed step ", done,
          ". Close every session of the job first (stop those trainers)"));
    }
    if (auto st = CheckSameMatrices(job->id(), job->table(), table); !st.ok())
      return st;
    if (job->broken()) return CheckJoin(*job, req, table);  // its refusal
    job->BeginJoin(0);  // held until the new job is published
    return AdmitRebuildLocked(req, table, who, job, at_mark ? want : 0, a);
  }
  if (resume != v1::RESUME_REPLACE || (open > 0 && done == 0)) {
    // Joined (REPLACE too: the other ranks of a job just started, at step
    // 1, hold nothing to discard).
    if (auto st = CheckJoin(*job, req, table); !st.ok()) return st;
    job->BeginJoin(req.rank());
    a->job = job;
    a->ranks = job->ranks();
    return absl::OkStatus();
  }
  if (open > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id(), "' cannot be replaced (resume=replace): rank",
        open > 1 ? "s " : " ", OpenRanks(*job), " of it ",
        open > 1 ? "are" : "is", " open, past completed step ", done,
        ". Close every session of the job first (stop those trainers), "
        "then open it again with resume=replace; or use another job_id"));
  }
  // Idle: its snapshot goes first (nothing changes if that fails), then
  // the job, as the reaper drops one (service_reap.cc); its memory and
  // executors' state are let go of after mu_ (OpenChecked).
  if (snapshots_.enabled()) {
    if (auto moved = snapshots_.Replace(job->id(), next_job_serial_);
        !moved.ok()) {
      return moved.status();
    }
  }
  job->MarkDropped();
  a->replaced = job;
  jobs_.erase(job->id());
  return absl::OkStatus();
}

void OptimizerService::AbandonLocked(const v1::OpenSessionRequest& req,
                                     OpenAdmission* a, Graveyard& gone) {
  if (a->created) {
    creating_.erase(req.job_id());
    creating_bytes_ -= a->reserved;
    a->reserved = 0;
    AbandonRebuildLocked(a);
    // The snapshot it took is read again by the next open of the id.
    if (a->resumed && snapshots_.enabled()) {
      const std::string path = snapshots_.PathOf(req.job_id());
      if (::access(path.c_str(), F_OK) == 0)
        pending_.AddFile(req.job_id(), path, *a->resumed);
    }
    // Made for nothing: its memory (and a GPU transport's state) go.
    if (a->job) gone.Bury(std::move(a->job), /*drop_state=*/true);
    return;
  }
  if (!a->job) return;
  absl::MutexLock jl(&a->job->mu());
  a->job->EndJoin(req.rank());
  // Idle again: its drop may be due (the reaper skipped it meanwhile).
  if (a->job->open_ranks() == 0 && a->job->joining() == 0) reaper_.Kick();
}

}  // namespace dmuon::server
