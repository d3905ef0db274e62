// Mark (protocol minor 5; docs/protocol.md "Marks"): a copy of a job's
// momentum at the completed step its trainer checkpointed, kept by the
// MarkStore (bounded per job and daemon-wide) and, with --state-dir, as a
// file written before Mark returns; and the marks found in --state-dir at
// start (LoadMarks). Resuming at a mark is OpenSession's (service_admit.cc).

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/protocol.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// The completed step `asked` (0: the job's) of `job` as a step that may be
// marked now: the job's own, its successor not yet computed.
absl::StatusOr<int64_t> MarkableStep(const Job& job, int64_t asked)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  const int64_t done = job.completed_steps();
  if (job.dropped()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(),
        "' was dropped (idle, or replaced by a new run) while this session "
        "marked it: nothing to mark"));
  }
  if (job.broken()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(),
        "' is broken (a step failed or a rank left "
        "mid-step): its momentum is not that of a completed step; nothing "
        "to mark"));
  }
  if (done == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(),
        "' has completed no step yet: there is no momentum to mark (mark "
        "after a step's update came back)"));
  }
  const int64_t step = asked == 0 ? done : asked;
  if (step != done) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Mark of step ", step, ": job '", job.id(), "' is at completed step ",
        done,
        ", and only the step a job is at can be marked (its momentum "
        "of other steps is gone)"));
  }
  for (int i = 0; i < job.num_params(); ++i) {
    const ParamState& p = job.param(i);
    if (p.running || p.ran) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Mark of step ", step, ": job '", job.id(), "' is at completed step ",
          done, " but its step ", done + 1,
          " is being computed (every rank handed in its gradients): its "
          "momentum is past step ",
          done,
          "; mark between a step's updates and the next step's gradients"));
    }
  }
  return step;
}

}  // namespace

absl::StatusOr<v1::MarkResponse> OptimizerService::Mark(
    const v1::MarkRequest& req, const Principal& who) {
  if (!SpeaksMinor(5)) {
    return absl::UnimplementedError(absl::StrCat(
        "Mark needs protocol minor 5; this dmuond speaks protocol 1.",
        ProtocolMinor(), ": upgrade it"));
  }
  if (req.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MarkRequest.step is ", req.step(),
        ": it must be the job's completed step (>= 1), or 0 for the step the "
        "job is at"));
  }
  auto s = FindSession(req.session_id());
  if (!s) return NoOpenSessionError();
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  if (auto st = CheckJobOwner(who, job->owner(), job->id()); !st.ok())
    return st;
  v1::MarkResponse resp;
  server::Mark mark;
  {
    absl::MutexLock jl(&job->mu());
    auto step = MarkableStep(*job, req.step());
    if (!step.ok()) return step.status();
    resp.set_step(*step);
    // A step held already is marked again (MarkStore: the trainer may have
    // resumed at an earlier mark and reached it anew).
    if (auto st = marks_.CheckFits(MomentumBytesOf(job->table())); !st.ok())
      return st;
    auto copy = CopyMomentum(*scheduler_, *job);
    if (!copy.ok()) return copy.status();
    mark.header = StateHeaderOf(*job);
    mark.momentum = *std::move(copy);
  }
  if (snapshots_.enabled()) {
    std::vector<const std::vector<float>*> ptrs;
    for (const auto& m : mark.momentum) ptrs.push_back(&m);
    const std::string bytes = EncodeSnapshot(mark.header, ptrs);
    if (auto st = snapshots_.WriteMark(job->id(), resp.step(), bytes);
        st.ok()) {
      mark.path = snapshots_.MarkPathOf(job->id(), resp.step());
    } else {
      resp.set_not_durable(std::string(st.message()));
    }
  }
  const std::string path = mark.path;
  absl::StatusOr<MarkStore::Added> added;
  {
    // Added only while the job is still the id's: a new run published
    // meanwhile has dropped the id's marks (PublishLocked, under mu_), and
    // this one, of the run it replaced, must not come back after it.
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job->id());
    if (it == jobs_.end() || it->second != job) {
      added = absl::AbortedError(absl::StrCat(
          "job '", job->id(), "' was dropped or replaced while its step ",
          resp.step(), " was being marked: nothing was marked"));
    } else {
      added = marks_.Add(job->id(), std::move(mark));
    }
  }
  if (!added.ok()) {
    snapshots_.RemoveMark(path);
    return added.status();
  }
  for (const server::Mark& gone : added->dropped)
    if (snapshots_.enabled()) snapshots_.RemoveMark(gone.path);
  const MarkList& list = added->list;
  for (int64_t step : list.steps) resp.add_marks(step);
  resp.set_mark_bytes(list.bytes);
  return resp;
}

void OptimizerService::LoadMarks() {
  if (!snapshots_.enabled()) return;
  // Added in step order, so that "the oldest" (dropped first) is the lowest
  // step after a restart too, not the directory's order.
  std::vector<SnapshotStore::MarkFile> files = snapshots_.ScanMarks();
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) {
    return a.header.completed_steps() < b.header.completed_steps();
  });
  for (SnapshotStore::MarkFile& f : files) {
    server::Mark m;
    m.header = std::move(f.header);
    m.path = std::move(f.path);
    for (const server::Mark& gone : marks_.AddOnDisk(f.job_id, std::move(m)))
      snapshots_.RemoveMark(gone.path);
  }
}

void OptimizerService::DropMarks(const std::string& job_id) {
  for (const server::Mark& gone : marks_.DropJob(job_id))
    if (snapshots_.enabled()) snapshots_.RemoveMark(gone.path);
}

std::string OptimizerService::MarksHeld(const std::string& job_id) const {
  const MarkList list = marks_.List(job_id);
  if (list.steps.empty()) return "no marks";
  return absl::StrCat("marks of steps ", absl::StrJoin(list.steps, ", "));
}

absl::Status OptimizerService::CheckMarksOwner(
    const Principal& who, const std::string& job_id) const {
  for (int64_t step : marks_.List(job_id).steps) {
    if (auto head = marks_.Header(job_id, step))
      return CheckJobOwner(who, head->owner(), job_id);
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
