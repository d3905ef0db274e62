// Momentum state in and out: the GetState/SetState streams and the
// --state-dir snapshots (the files: snapshot_store.h).

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/job_state.h"
#include "server/service.h"
#include "server/snapshot_store.h"

namespace dmuon::server {
namespace {

v1::StateHeader HeaderOf(const Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  v1::StateHeader h;
  h.set_job_id(job.id());
  h.set_owner(job.owner());
  h.set_completed_steps(job.completed_steps());
  for (const auto& p : job.table().params) *h.add_parameters() = ToSpec(p);
  for (const auto& g : job.table().groups) *h.add_groups() = g;
  return h;
}

// The job's state as GetState's stream: its header, then its momentum in
// chunks of at most `max_chunk` bytes.
absl::StatusOr<std::vector<v1::StateChunk>> StateChunks(const Job& job,
                                                        uint64_t max_chunk)
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
  std::vector<v1::StateChunk> out;
  v1::StateChunk head;
  *head.mutable_header() = HeaderOf(job);
  out.push_back(std::move(head));
  for (int i = 0; i < job.num_params(); ++i) {
    const auto& m = job.param(i).momentum;
    const uint64_t bytes = m.size() * sizeof(float);
    const char* base = reinterpret_cast<const char*>(m.data());
    for (const auto& c : transport::SplitChunks(bytes, max_chunk)) {
      v1::StateChunk ch;
      auto* mc = ch.mutable_momentum();
      mc->set_param_id(i);
      mc->set_name(job.table().params[i].name);
      mc->set_offset(c.offset);
      mc->set_total_bytes(bytes);
      mc->set_data(base + c.offset, c.bytes);
      out.push_back(std::move(ch));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<v1::StateChunk>> OptimizerService::GetState(
    const std::string& session_id, const Principal& who) {
  auto s = FindSession(session_id);
  if (!s) return absl::NotFoundError("no open session with this session_id");
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  if (auto st = CheckJobOwner(who, job->owner(), job->id()); !st.ok())
    return st;
  absl::MutexLock lock(&job->mu());
  if (!job->broken() && !job->mid_step()) {
    if (auto st = PullState(*scheduler_, *job); !st.ok()) return st;
  }
  return StateChunks(*job,
                     transport::MaxChunkPayload(options_.max_message_bytes));
}

absl::StatusOr<int64_t> OptimizerService::SetState(
    const std::vector<v1::StateChunk>& chunks, const Principal& who) {
  if (chunks.empty() || !chunks[0].has_header()) {
    return absl::InvalidArgumentError(
        "SetState: the first message must carry the header");
  }
  auto s = FindSession(chunks[0].session_id());
  if (!s)
    return absl::NotFoundError(
        "SetState: no open session with this session_id");
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  if (auto st = CheckJobOwner(who, job->owner(), job->id()); !st.ok())
    return st;
  const v1::StateHeader& h = chunks[0].header();
  absl::MutexLock lock(&job->mu());
  if (job->mid_step() || job->broken()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id(),
        "' is in the middle of a step; restore state before the first step"));
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
  // Assemble into scratch: nothing changes unless every byte is accounted for.
  std::vector<std::vector<float>> mom(params.size());
  std::vector<uint64_t> got(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i)
    mom[i].assign(params[i].shape.elements(), 0.0f);
  for (size_t k = 1; k < chunks.size(); ++k) {
    if (!chunks[k].has_momentum())
      return absl::InvalidArgumentError("SetState: a second header");
    const v1::MomentumChunk& c = chunks[k].momentum();
    if (c.param_id() < 0 || c.param_id() >= static_cast<int>(params.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("momentum chunk for parameter id ", c.param_id(),
                       " which does not exist"));
    }
    const uint64_t bytes = mom[c.param_id()].size() * sizeof(float);
    if (c.offset() != got[c.param_id()] ||
        c.offset() + c.data().size() > bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "momentum chunk of '", params[c.param_id()].name, "' at offset ",
          c.offset(), " (", c.data().size(), " bytes) does not continue the ",
          bytes, "-byte tensor"));
    }
    std::memcpy(reinterpret_cast<char*>(mom[c.param_id()].data()) + c.offset(),
                c.data().data(), c.data().size());
    got[c.param_id()] += c.data().size();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (got[i] != mom[i].size() * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "momentum of '", params[i].name, "' is incomplete: ", got[i], " of ",
          mom[i].size() * sizeof(float), " bytes"));
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    job->param(static_cast<int>(i)).momentum = std::move(mom[i]);
  if (auto st = PushState(*scheduler_, *job); !st.ok()) {
    // Some executors may hold the new state and others the old: the job
    // cannot step until state is set again.
    job->Break();
    return st;
  }
  job->SetCompletedSteps(h.completed_steps());
  return job->completed_steps();
}

absl::StatusOr<std::string> SnapshotBytes(Scheduler& scheduler, Job& job) {
  if (job.mid_step() && (job.running() || !job.can_roll_back())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id(), "' is in the middle of step ",
        job.completed_steps() + 1,
        job.running() ? " (a computation is running)"
                      : " on executors that hold state (its momentum has "
                        "advanced in place)",
        ": no snapshot of its last completed step ", job.completed_steps(),
        " can be taken now"));
  }
  if (auto st = PullState(scheduler, job); !st.ok()) return st;
  // Mid-step (host momentum): each parameter that ran this step as of
  // before it, i.e. the whole job at its last completed step.
  return EncodeSnapshot(HeaderOf(job), job.last_complete_momentum());
}

bool WaitUntilNotRunning(Job& job, absl::Duration timeout)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  auto idle = [&job] {
    job.mu().AssertHeld();
    return !job.running();
  };
  return job.mu().AwaitWithDeadline(absl::Condition(&idle),
                                    absl::Now() + timeout);
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
  // Each file is checked now (a bad one is reported at start) but its
  // momentum is read again only when its job is reopened.
  auto scan = snapshots_.Scan();
  if (!scan.ok()) return scan.status();
  absl::MutexLock lock(&mu_);
  for (const auto& [job_id, path] : scan->first) pending_.AddFile(job_id, path);
  return scan->second;
}

absl::Status OptimizerService::LoadPendingSnapshot(const std::string& job_id) {
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
  return absl::DataLossError(absl::StrCat(
      "job '", job_id, "' has a snapshot in --state-dir that cannot be used (",
      bad.message(), "); it was moved aside to ", *moved,
      ": open the job again to start it from zero momentum at step 1, or "
      "restore its state (SetState) from a checkpoint"));
}

}  // namespace dmuon::server
