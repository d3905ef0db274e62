// Internal to the service: the checks of a Step stream message against its
// job's and session's state, before anything of it is applied
// (StepPipeline). Each returns the error the stream ends with, naming the
// parameter, step or field; none changes anything. Call with the job's
// lock held.

#ifndef DMUON_SERVER_STEP_CHECKS_H_
#define DMUON_SERVER_STEP_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/dmuon.pb.h"
#include "server/job.h"

namespace dmuon::server {

// `step` is the session's step in progress (not one completed or skipped).
absl::Status CheckStep(const Session& s, const SessionState& st, int64_t step);

// `id` names a parameter of the job's table.
absl::Status CheckParam(const Job& job, int id);

// An inline gradient chunk: the session is inline, the step and parameter
// are valid, the parameter is not declared yet, and the chunk is the next
// of its tensor and ends within it.
absl::Status CheckGradientChunk(const Session& s, const Job& job,
                                const SessionState& st,
                                const v1::TensorChunk& c)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// A declaration's parameter ids, present and absent: each exists, none is
// declared twice (in this message or earlier in the step), an inline
// gradient is complete, and an absent one had no bytes sent.
absl::Status CheckDeclared(const Session& s, const Job& job,
                           const SessionState& st, const v1::GradientsReady& g)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// This step's momentum of each of `g.param_ids` (protocol minor 2:
// GradientsReady.momentum, else each group's): in [0, 1), one per id, and
// the same as another rank declared for the parameter.
absl::StatusOr<std::vector<double>> StepMomenta(const Session& s,
                                                const Job& job,
                                                const v1::GradientsReady& g)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

// Every rank says alike whether it has a gradient of a parameter
// (SHARDING_UNREDUCED excepted: a rank without one counts as zeros).
absl::Status CheckPresenceAgrees(const Session& s, const Job& job,
                                 const v1::GradientsReady& g)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_CHECKS_H_
