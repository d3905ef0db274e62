// A job made anew by an open (protocol minor 5; docs/protocol.md "Marks",
// "Any world size"): resumed at one of its marks, or reopened, with no rank
// open, at another world size (and shardings) than it had. Its momentum is
// always whole matrices, so it carries over: the new job is made
// (BuildJob) from the mark's momentum or the old job's, like a job resumed
// from its snapshot. The old job in memory, if any, is held meanwhile
// (Job::BeginJoin of its rank 0: the reaper and resume=replace leave it)
// and dropped when the new one is published; an open that fails leaves it
// as it was.

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/resume_step.h"
#include "server/service.h"

namespace dmuon::server {

bool OptimizerService::ResumesAtMarkLocked(
    const v1::OpenSessionRequest& req) const {
  // A mark of the step asked wins over a snapshot or a job in memory of the
  // same step (AdmitToJobLocked: those may be another run's step N).
  const int64_t want = ResumeStepOf(req);
  return want > 0 && SpeaksMinor(5) && marks_.Has(req.job_id(), want);
}

absl::Status OptimizerService::AdmitRebuildLocked(
    const v1::OpenSessionRequest& req, const Table& table, const Principal& who,
    std::shared_ptr<Job> old, int64_t mark_step, OpenAdmission* a) {
  const std::string& id = req.job_id();
  if (old) {
    a->owner = old->owner();
    a->weight = old->weight();
    a->max_device_share = old->max_device_share();
  } else {
    auto head = marks_.Header(id, mark_step);
    if (!head) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id, "': its mark of step ", mark_step,
                       " was dropped meanwhile; ", MarksHeld(id)));
    }
    if (auto st = CheckJobOwner(who, head->owner(), id); !st.ok()) return st;
    if (auto st = CheckSnapshot(id, table, *head); !st.ok()) return st;
    a->owner = head->owner();
    a->weight = who.weight > 0 ? who.weight : 1;
    a->max_device_share = who.quotas.max_device_share;  // as AdmitLocked
    // A job the daemon does not hold: its bytes count as a new job's
    // (--max-state-bytes was checked by CheckCapacityLocked; the quota here).
    if (!a->owner.empty() && a->owner == who.name) {
      if (auto st = CheckQuota(a->owner, who.quotas, QuotaUseLocked(a->owner),
                               MomentumBytesOf(table));
          !st.ok()) {
        return st;
      }
    }
    a->reserved = MomentumBytesOf(table);
  }
  a->mark_step = mark_step;
  a->rebuild_from = std::move(old);
  a->rebuilt = true;
  a->created = true;
  a->serial = next_job_serial_++;
  // An old job's bytes stay counted (it is in jobs_ until published).
  creating_bytes_ += a->reserved;
  creating_[id] = Creating{a->owner, a->reserved};
  a->ranks.assign(req.world_size(), nullptr);
  return absl::OkStatus();
}

absl::Status OptimizerService::DropUnreadableMark(const std::string& id,
                                                  int64_t step,
                                                  const server::Mark& mark,
                                                  const absl::Status& why) {
  // Moved aside and forgotten, so that it is not listed (and failed) again.
  marks_.Remove(id, step);
  auto aside = snapshots_.MoveAside(mark.path, why);
  return absl::DataLossError(
      absl::StrCat("job '", id, "': its mark of step ", step,
                   " cannot be used (", why.message(), "); the file ",
                   aside.ok() ? absl::StrCat("was moved aside to ", *aside)
                              : absl::StrCat("could not be moved aside (",
                                             aside.status().message(), ")"),
                   " and the mark dropped; ", MarksHeld(id)));
}

absl::Status OptimizerService::LoadRebuildState(
    const v1::OpenSessionRequest& req, OpenAdmission* a) {
  const std::string& id = req.job_id();
  SnapshotFile state;
  if (a->mark_step > 0) {
    std::optional<server::Mark> mark = marks_.Get(id, a->mark_step);
    if (!mark) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id, "': its mark of step ", a->mark_step,
                       " was dropped meanwhile; ", MarksHeld(id)));
    }
    if (mark->momentum.empty()) {  // on disk only: read now, CRC and all
      auto file = SnapshotStore::Read(mark->path);
      absl::Status bad = file.status();
      if (file.ok() &&
          (file->head.header().job_id() != id ||
           file->head.header().completed_steps() != a->mark_step)) {
        bad = absl::DataLossError(
            absl::StrCat("mark ", mark->path, " holds step ",
                         file->head.header().completed_steps(), " of job '",
                         file->head.header().job_id(), "', not step ",
                         a->mark_step, " of job '", id, "'"));
      }
      if (!bad.ok()) return DropUnreadableMark(id, a->mark_step, *mark, bad);
      mark->momentum = std::move(file->momentum);
    }
    *state.head.mutable_header() = std::move(mark->header);
    state.momentum = std::move(mark->momentum);
  } else {
    Job& old = *a->rebuild_from;
    absl::MutexLock jl(&old.mu());
    auto copy = CopyMomentum(*scheduler_, old);
    if (!copy.ok()) return copy.status();
    *state.head.mutable_header() = StateHeaderOf(old);
    state.momentum = *std::move(copy);
  }
  a->snapshot = std::move(state);
  return absl::OkStatus();
}

absl::Status OptimizerService::PublishRebuildLocked(OpenAdmission* a) {
  const std::string& id = a->job->id();
  if (a->mark_step > 0 && snapshots_.enabled()) {
    // The job's snapshot (a later step of the run resumed from) is kept
    // aside: the new run's snapshots go on from the mark's step.
    if (auto moved = snapshots_.Replace(id, a->serial); !moved.ok())
      return moved.status();
    if (!pending_.reading(id)) pending_.Drop(id);
  }
  if (std::shared_ptr<Job> old = std::move(a->rebuild_from)) {
    absl::MutexLock jl(&old->mu());
    old->EndJoin(0);
    old->MarkDropped();
    a->replaced = std::move(old);
  }
  return absl::OkStatus();
}

void OptimizerService::AbandonRebuildLocked(OpenAdmission* a) {
  std::shared_ptr<Job> old = std::move(a->rebuild_from);
  if (!old) return;
  absl::MutexLock jl(&old->mu());
  old->EndJoin(0);
  // Idle again: its drop may be due (the reaper skipped it meanwhile).
  if (old->open_ranks() == 0 && old->joining() == 0) reaper_.Kick();
}

}  // namespace dmuon::server
