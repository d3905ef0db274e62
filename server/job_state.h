// Internal to the service: a job's momentum in and out of the executors
// that hold it (device_state.cc), and as snapshot file bytes (state.cc).

#ifndef DMUON_SERVER_JOB_STATE_H_
#define DMUON_SERVER_JOB_STATE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// The job's state as snapshot file bytes (snapshot_store.h), the executors'
// state pulled first, for SnapshotStore::Write once the lock is released.
// The caller checks that the state is consistent (not broken, not mid-step).
absl::StatusOr<std::string> SnapshotBytes(Scheduler& scheduler, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

}  // namespace dmuon::server

#endif  // DMUON_SERVER_JOB_STATE_H_
