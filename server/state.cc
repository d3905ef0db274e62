// Momentum state in and out: the GetState/SetState streams and the
// --state-dir snapshots (the files: snapshot_store.h).

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/resume_step.h"
#include "server/service.h"
#include "server/snapshot_store.h"
#include "server/step_pipeline.h"

namespace dmuon::server {
namespace {

// GetState's refusals: a broken job, or one mid-step.
absl::Status AtStepBoundary(const Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  if (job.broken()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(),
        "' is broken (a step failed or a rank left mid-step): its state may "
        "be half a step ahead; restore from your last checkpoint"));
  }
  if (job.mid_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(), "' is in the middle of step ",
        job.completed_steps() + 1, "; read or write state between steps"));
  }
  return absl::OkStatus();
}

// SetState's refusals (at its header and again at its commit).
absl::Status Settable(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  if (job.mid_step() || job.broken()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(),
        "' is in the middle of a step; restore state before the first step"));
  }
  if (job.state_readers() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a GetState of job '", job.id(),
        "' is reading its state; set it once that stream has ended"));
  }
  return absl::OkStatus();
}

uint64_t TensorBytes(const Job& job, int param) {
  return static_cast<uint64_t>(job.table().params[param].shape.elements()) *
         sizeof(float);
}

}  // namespace

StateReader::StateReader(OptimizerService* service, std::shared_ptr<Job> job,
                         v1::StateChunk header, uint64_t max_chunk)
    : service_(service),
      job_(std::move(job)),
      header_(std::move(header)),
      max_chunk_(std::max<uint64_t>(max_chunk, 1)) {}

StateReader::~StateReader() {
  // The parameters whose steps waited for the reader (StepPipeline::Submit) run
  // now, unless their step was rolled back or the job broke meanwhile
  // (then they end here, as their computation would have).
  std::map<int64_t, std::vector<int>> run;
  {
    absl::MutexLock lock(&job_->mu());
    for (const auto& [step, id] : job_->RemoveStateReader()) {
      if (job_->param(id).abandoned || job_->broken() || job_->dropped()) {
        (void)job_->EndParam(id);
        continue;
      }
      run[step].push_back(id);
    }
  }
  for (const auto& [step, ids] : run)
    service_->pipeline_->Submit(job_, step, ids);
}

absl::StatusOr<std::optional<v1::StateChunk>> StateReader::Next() {
  if (header_) {
    std::optional<v1::StateChunk> h = std::move(header_);
    header_.reset();
    return h;
  }
  Job& job = *job_;
  const bool holds_state = service_->scheduler_->holds_state();
  // The chunk Next returned last has been written (or dropped): its bytes
  // go back before the next ones are leased. Executors that hold state:
  // the lease also covers buf_ (the whole parameter), kept until buf_ goes.
  if (!holds_state) lease_.Release();
  // The table never changes, and param_ and offset_ are this reader's own:
  // the lease is taken without the job's lock (it may wait).
  while (param_ < job.num_params() && offset_ >= TensorBytes(job, param_)) {
    ++param_;
    offset_ = 0;
    buf_.clear();
    buf_.shrink_to_fit();
    lease_.Release();
  }
  if (param_ >= job.num_params()) return std::nullopt;
  if (lease_.bytes() == 0) {
    chunk_ = LeaseChunk(TensorBytes(job, param_) - offset_, holds_state);
    if (chunk_ == 0) return lease_error_;
  }
  const uint64_t n = std::min(chunk_, TensorBytes(job, param_) - offset_);
  absl::MutexLock lock(&job.mu());
  if (job.broken() || job.dropped()) {
    return absl::AbortedError(
        absl::StrCat("job '", job.id(), "' ",
                     job.broken() ? "broke" : "was dropped (no rank open)",
                     " while its state was read; read it again"));
  }
  const uint64_t bytes = TensorBytes(job, param_);
  const char* base = nullptr;
  Scheduler& scheduler = *service_->scheduler_;
  if (scheduler.holds_state()) {
    if (buf_.empty()) {
      // Start from the host mirror: an executor that has no copy of the
      // parameter yet (a job resumed from its snapshot, before its first
      // step) leaves the buffer as it is, and the mirror is the state then.
      const std::vector<float>& mirror = job.param(param_).momentum;
      const uint64_t elements = job.table().params[param_].shape.elements();
      if (mirror.size() == elements) {
        buf_.assign(mirror.begin(), mirror.end());
      } else {
        buf_.assign(elements, 0.0f);
      }
      const StateKey key{job.serial(), param_};
      if (auto st = scheduler.ReadState(job.plan().executor_of[param_], key,
                                        absl::MakeSpan(buf_));
          !st.ok()) {
        buf_.clear();  // a retry reads it again, never the partial copy
        return absl::Status(
            st.code(),
            absl::StrCat("reading the momentum of parameter '",
                         job.table().params[param_].name, "' of job '",
                         job.id(), "': ", st.message()));
      }
    }
    base = reinterpret_cast<const char*>(buf_.data());
  } else {
    base = reinterpret_cast<const char*>(job.param(param_).momentum.data());
  }
  v1::StateChunk ch;
  auto* mc = ch.mutable_momentum();
  mc->set_param_id(param_);
  mc->set_name(job.table().params[param_].name);
  mc->set_offset(offset_);
  mc->set_total_bytes(bytes);
  mc->set_data(base + offset_, n);
  offset_ += n;
  return std::optional<v1::StateChunk>(std::move(ch));
}

uint64_t StateReader::LeaseChunk(uint64_t remaining, bool holds_state) {
  // Twice the chunk (it, and the copy gRPC serializes until the write
  // returns), plus the whole parameter that executors holding state are read
  // into; at least a chunk of kMinStateChunk when the budget is short.
  const uint64_t whole = holds_state ? TensorBytes(*job_, param_) : 0;
  const uint64_t want = std::min(max_chunk_, remaining);
  const uint64_t min = std::min(want, kMinStateChunk);
  auto lease = service_->read_budget_.Acquire(
      whole + 2 * min, whole + 2 * want, service_->options_.state_read_wait);
  if (!lease.ok()) {
    lease_error_ = lease.status();
    return 0;
  }
  lease_ = *std::move(lease);
  return std::clamp<uint64_t>((lease_.bytes() - whole) / 2, min, want);
}

absl::StatusOr<std::unique_ptr<StateReader>> OptimizerService::ReadState(
    const std::string& session_id, const Principal& who) {
  auto s = FindSession(session_id);
  if (!s) return NoOpenSessionError();
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  if (auto st = CheckJobOwner(who, job->owner(), job->id()); !st.ok())
    return st;
  absl::MutexLock lock(&job->mu());
  if (auto st = AtStepBoundary(*job); !st.ok()) return st;
  v1::StateChunk head;
  *head.mutable_header() = StateHeaderOf(*job);
  job->AddStateReader();
  return std::unique_ptr<StateReader>(
      new StateReader(this, job, std::move(head),
                      transport::MaxChunkPayload(options_.max_message_bytes)));
}

StateWriter::StateWriter(OptimizerService* service, std::shared_ptr<Job> job,
                         int64_t completed_steps)
    : service_(service),
      job_(std::move(job)),
      completed_steps_(completed_steps),
      mom_(job_->num_params()),
      got_(job_->num_params(), 0) {}

absl::StatusOr<std::unique_ptr<StateWriter>> OptimizerService::WriteState(
    const v1::StateChunk& first, const Principal& who) {
  if (!first.has_header()) {
    return absl::InvalidArgumentError(
        "SetState: the first message must carry the header");
  }
  auto s = FindSession(first.session_id());
  if (!s) return NoOpenSessionError();
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  if (auto st = CheckJobOwner(who, job->owner(), job->id()); !st.ok())
    return st;
  {
    absl::MutexLock lock(&job->mu());
    if (auto st = Settable(*job); !st.ok()) return st;
  }
  // The table is constant: checked without the lock.
  const v1::StateHeader& h = first.header();
  if (!h.job_id().empty() && h.job_id() != job->id()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetState: the header is of job '", h.job_id(),
                     "'; this session's job is '", job->id(), "'"));
  }
  const auto& params = job->table().params;
  if (h.parameters_size() != static_cast<int>(params.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has ", h.parameters_size(),
                     " parameters; the job's table has ", params.size()));
  }
  for (int i = 0; i < h.parameters_size(); ++i) {
    const auto& sp = h.parameters(i);
    if (sp.name() != params[i].name || sp.shape_size() != 2 ||
        sp.shape(0) != params[i].shape.rows ||
        sp.shape(1) != params[i].shape.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("state parameter ", i, " '", sp.name(),
                       "' does not match the table's '", params[i].name, "' ",
                       kernels::ShapeString(params[i].shape)));
    }
  }
  if (h.completed_steps() < 0 || h.completed_steps() > kMaxCompletedSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "completed_steps ", h.completed_steps(), " is outside [0, 2^62]"));
  }
  return std::unique_ptr<StateWriter>(
      new StateWriter(this, job, h.completed_steps()));
}

absl::Status StateWriter::Add(const v1::StateChunk& chunk) {
  if (!chunk.has_momentum())
    return absl::InvalidArgumentError("SetState: a second header");
  const v1::MomentumChunk& c = chunk.momentum();
  const auto& params = job_->table().params;
  if (c.param_id() < 0 || c.param_id() >= static_cast<int>(params.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum chunk for parameter id ", c.param_id(),
                     " which does not exist"));
  }
  const int id = c.param_id();
  const ParamInfo& p = params[id];
  const uint64_t bytes = TensorBytes(*job_, id);
  if (c.total_bytes() != 0 && c.total_bytes() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum chunk of '", p.name, "' says its tensor has ",
                     c.total_bytes(), " bytes; the header declared ",
                     kernels::ShapeString(p.shape), ", ", bytes, " bytes"));
  }
  if (c.offset() == got_[id] && c.offset() + c.data().size() > bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum chunk of '", p.name, "' at offset ", c.offset(),
                     " (", c.data().size(), " bytes) runs past the ", bytes,
                     " bytes the header declared for it (",
                     kernels::ShapeString(p.shape), ")"));
  }
  if (c.offset() != got_[id]) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum chunk of '", p.name, "' at offset ", c.offset(),
                     " (", c.data().size(), " bytes) does not continue the ",
                     bytes, "-byte tensor"));
  }
  if (c.data().empty()) return absl::OkStatus();
  if (mom_[id].empty()) {
    mom_[id].assign(p.shape.elements(), 0.0f);
    buffered_ += bytes;
  }
  std::memcpy(reinterpret_cast<char*>(mom_[id].data()) + c.offset(),
              c.data().data(), c.data().size());
  got_[id] += c.data().size();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StateWriter::Commit() {
  const auto& params = job_->table().params;
  for (size_t i = 0; i < params.size(); ++i) {
    const uint64_t bytes = TensorBytes(*job_, static_cast<int>(i));
    if (got_[i] != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("momentum of '", params[i].name,
                       "' is incomplete: ", got_[i], " of ", bytes, " bytes"));
    }
  }
  const std::shared_ptr<Job>& job = job_;
  absl::MutexLock lock(&job->mu());
  if (auto st = Settable(*job); !st.ok()) return st;
  for (size_t i = 0; i < params.size(); ++i)
    job->param(static_cast<int>(i)).momentum = std::move(mom_[i]);
  buffered_ = 0;
  if (auto st = PushState(*service_->scheduler_, *job); !st.ok()) {
    // Some executors may hold the new state and others the old: the job
    // cannot step until state is set again.
    job->Break();
    return st;
  }
  job->SetCompletedSteps(completed_steps_);
  if (service_->snapshots_.enabled()) {
    // An explicit restore may go back: a newer snapshot file of the id (an
    // earlier run, or this job before the restore) is replaced by the
    // restored state now, and kept aside (SnapshotStore::Restore).
    auto kept = service_->snapshots_.Restore(
        job->id(), job->serial(), job->completed_steps(),
        [&]() -> absl::StatusOr<std::string> {
          job->mu().AssertHeld();
          return SnapshotBytes(*service_->scheduler_, *job);
        });
    if (!kept.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "SetState: the state is set (step ", job->completed_steps(),
          ") but could not replace the newer snapshot of job '", job->id(),
          "' in --state-dir, which a restarted daemon would resume from: ",
          kept.status().message()));
    }
  }
  return job->completed_steps();
}

absl::Status OptimizerService::SnapshotAll() {
  if (!snapshots_.enabled()) return absl::OkStatus();
  std::vector<std::shared_ptr<Job>> jobs;
  bool draining = false;
  {
    absl::MutexLock lock(&mu_);
    draining = draining_;
    for (auto& [id, j] : jobs_) jobs.push_back(j);
  }
  absl::Status first;
  for (auto& j : jobs) {
    std::string bytes;
    int64_t steps = 0;
    {
      absl::MutexLock lock(&j->mu());
      // A job the reaper dropped saved its own; a broken one has nothing
      // consistent (its last snapshot stays).
      if (j->broken() || j->dropped()) continue;
      if (j->mid_step()) {
        // Not while draining: a step of a live job is taken by the next
        // --snapshot-every write instead.
        if (!draining && j->running()) continue;
        if (draining) {
          // The final snapshot: a computation in progress ends (an executor
          // call) and the step still incomplete is void, so that no client
          // is told a step is complete that the snapshot does not hold.
          (void)WaitUntilNotRunning(*j, kSnapshotWait);
          if (!j->running() && j->RollBack()) {
            // Executors that hold the state put back their step-start
            // copies; if they cannot, the job broke (no snapshot).
            if (auto st = RestoreStepStarts(*scheduler_, *j); !st.ok()) {
              j->AbortStreams(st);
              if (first.ok()) first = st;
              continue;
            }
            j->AbortStreams(absl::UnavailableError(absl::StrCat(
                "dmuond is shutting down: step ", j->completed_steps() + 1,
                " of job '", j->id(),
                "' was not complete and is void; the state as of step ",
                j->completed_steps(),
                " is snapshotted: reopen every rank and continue from step ",
                j->completed_steps() + 1)));
          }
        }
      }
      auto got = SnapshotBytes(*scheduler_, *j);
      if (!got.ok()) {
        if (first.ok()) first = got.status();
        continue;
      }
      bytes = *std::move(got);
      steps = j->completed_steps();
    }
    if (auto st = snapshots_.Write(j->id(), j->serial(), steps, bytes);
        !st.ok() && first.ok())
      first = st;
  }
  return first;
}

absl::Status OptimizerService::LoadSnapshots() {
  if (!snapshots_.enabled()) return absl::OkStatus();
  // Each file is checked now (a bad one is reported at start), its CRC a
  // chunk at a time with none of its momentum kept; the momentum is read
  // only when its job is reopened (LoadPendingSnapshot, streamed again).
  auto scan = snapshots_.Scan();
  if (!scan.ok()) return scan.status();
  LoadMarks();  // their headers only
  // Their headers (from the check) describe them in Status until opened.
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < scan->good.size(); ++i) {
    const auto& [job_id, path] = scan->good[i];
    pending_.AddFile(job_id, path, Summarize(scan->headers[i]));
  }
  for (auto& [job_id, notice] : scan->moved_aside)
    pending_.AddMovedAside(job_id, std::move(notice));
  return scan->first_error;
}

absl::Status OptimizerService::UsePreviousSnapshot(
    const std::string& job_id, int64_t want, const v1::StateHeader& head) {
  const int64_t held = head.completed_steps();
  auto kept = snapshots_.UsePrevious(job_id, want, head.owner());
  if (absl::IsNotFound(kept.status())) {
    return ResumeStepError(
        job_id, want, held,
        absl::StrCat("in its snapshot under --state-dir ", options_.state_dir),
        absl::StrCat(kept.status().message(), "; ", MarksHeld(job_id)));
  }
  return kept.status();
}

absl::Status OptimizerService::LoadPendingSnapshot(const std::string& job_id,
                                                   const Principal& who,
                                                   int64_t resume_step) {
  std::optional<std::string> path;
  {
    absl::MutexLock lock(&mu_);
    auto not_reading = [this, &job_id] {
      mu_.AssertHeld();
      return !pending_.reading(job_id);
    };
    mu_.Await(absl::Condition(&not_reading));
    if (jobs_.count(job_id)) return absl::OkStatus();
    path = pending_.StartRead(job_id);
    if (!path) return absl::OkStatus();
  }
  // The owner first, from the header alone: another principal's open never
  // makes the daemon read a job's momentum. (A header that cannot be read
  // is left to Read, which reports the file and moves it aside.)
  if (auto head = SnapshotStore::ReadHeader(*path); head.ok()) {
    absl::Status st = CheckJobOwner(who, head->owner(), job_id);
    const bool other_step =
        st.ok() && resume_step > 0 && head->completed_steps() != resume_step;
    // Resumed at a mark (service_rebuild.cc), even one of the snapshot's own
    // step (the snapshot may be another run's): the file stays unread.
    if (st.ok() && resume_step > 0 && SpeaksMinor(5) &&
        marks_.Has(job_id, resume_step)) {
      absl::MutexLock lock(&mu_);
      pending_.AbortRead(job_id);
      return absl::OkStatus();
    }
    if (other_step) st = UsePreviousSnapshot(job_id, resume_step, *head);
    if (!st.ok()) {
      absl::MutexLock lock(&mu_);
      pending_.AbortRead(job_id);
      return st;
    }
  }
  auto file = SnapshotStore::Read(*path);
  absl::Status bad = file.status();
  if (file.ok() && file->head.header().job_id() != job_id) {
    bad = absl::DataLossError(absl::StrCat("snapshot ", *path, " is of job '",
                                           file->head.header().job_id(),
                                           "', not '", job_id, "'"));
  }
  if (bad.ok() || absl::IsNotFound(bad)) {
    absl::MutexLock lock(&mu_);
    return pending_.FinishRead(job_id, *path, std::move(file));
  }
  // Corrupt or crafted: refused, and moved aside (never overwritten or
  // deleted) so that the next open of the id starts afresh, knowingly.
  auto moved = snapshots_.MoveAside(*path, bad);
  absl::MutexLock lock(&mu_);
  if (!moved.ok()) {
    // Left in place: every open of the id fails until it is dealt with.
    return pending_.FinishRead(job_id, *path, moved.status());
  }
  (void)pending_.FinishRead(job_id, *path, bad);
  pending_.Forget(job_id, *path);
  pending_.AddMovedAside(
      job_id, absl::StrCat("its snapshot could not be used (", bad.message(),
                           ") and was moved aside to ", *moved));
  return absl::DataLossError(absl::StrCat(
      "job '", job_id, "' has a snapshot in --state-dir that cannot be used (",
      bad.message(), "); it was moved aside to ", *moved,
      ": open the job again to start it from zero momentum at step 1, or "
      "restore its state (SetState) from a checkpoint"));
}

}  // namespace dmuon::server
