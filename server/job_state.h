// Internal to the service: a job's momentum in and out of the executors
// that hold it, and as snapshot file bytes (job_state.cc).

#ifndef DMUON_SERVER_JOB_STATE_H_
#define DMUON_SERVER_JOB_STATE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/job.h"
#include "server/scheduler.h"

namespace dmuon::server {

// Executors that hold state (executor.h): copy each parameter's state into
// the job's host mirrors before they are read (GetState, snapshots), and out
// to the executors after they are written (SetState). No-ops when no
// executor holds state.
absl::Status PullState(Scheduler& scheduler, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
absl::Status PushState(Scheduler& scheduler, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
// Executors that keep a step-start copy: puts the parameters of
// Job::TakeStepStartRestores back to their step-start copies (after a
// rollback, or a rolled-back computation's end). On failure the job is
// broken (its momentum is a mix of two steps) and the error returned.
absl::Status RestoreStepStarts(Scheduler& scheduler, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// The header of the job's state (GetState's first message, a snapshot's).
v1::StateHeader StateHeaderOf(const Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// The job's state as snapshot file bytes (snapshot_store.h), the executors'
// state pulled first, for SnapshotStore::Write once the lock is released.
// The caller checks that the job is not broken. Mid-step, the snapshot is
// of the last completed step (Job::last_complete_momentum, from the
// executors' step-start copies when they hold the state): FAILED_PRECONDITION
// while a computation runs or when executors hold the state without such a
// copy.
absl::StatusOr<std::string> SnapshotBytes(Scheduler& scheduler, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// The job's momentum by parameter, whole (fp32), copied out of its host
// buffers or the executors that hold it (zeros where none was made yet).
// Only meaningful between steps (no parameter of the next step ran).
absl::StatusOr<std::vector<std::vector<float>>> CopyMomentum(
    Scheduler& scheduler, Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// Whether a snapshot (or a mark) of job `id` with header `h` fits `table`:
// its step in range (DATA_LOSS), its parameters' names and whole shapes
// (INVALID_ARGUMENT naming the parameter).
absl::Status CheckSnapshot(const std::string& id, const Table& table,
                           const v1::StateHeader& h);
// Whether `table` has the whole matrices of `held` (a job reopened at
// another world size, or at a mark): names, whole shapes, groups, dtypes;
// shardings may differ. INVALID_ARGUMENT naming the parameter.
absl::Status CheckSameMatrices(const std::string& id, const Table& held,
                               const Table& table);

// How long a snapshot of a job waits for its running computations (each
// one executor call) to end.
inline constexpr absl::Duration kSnapshotWait = absl::Seconds(10);
// Waits (the lock released meanwhile) until no parameter of the job runs,
// at most `timeout`; whether none does.
bool WaitUntilNotRunning(Job& job, absl::Duration timeout)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

}  // namespace dmuon::server

#endif  // DMUON_SERVER_JOB_STATE_H_
