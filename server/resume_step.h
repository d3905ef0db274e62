// OpenSessionRequest.resume_step (protocol minor 4; docs/protocol.md
// "Resume at a step"): the completed step a trainer continues from. dmuond
// holds a job's momentum for the step the job is at (in memory, or in its
// snapshot) and, under --state-dir, for the step of its previous snapshot
// (SnapshotStore::PreviousPathOf): an open asking for any other step is
// refused, naming what is held, rather than continuing from another step's
// momentum (which would apply a step twice, or lose one, without a word).

#ifndef DMUON_SERVER_RESUME_STEP_H_
#define DMUON_SERVER_RESUME_STEP_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "proto/dmuon.pb.h"

namespace dmuon::server {

// The request's resume_step as this daemon honours it: 0 (none) for a
// build speaking a minor before 4 (//daemon:dmuond_prev), which ignores it.
int64_t ResumeStepOf(const v1::OpenSessionRequest& req);

// INVALID_ARGUMENT naming the field for a resume_step this request cannot
// carry: negative, or with RESUME_FRESH / RESUME_REPLACE (which start the
// job at step 1). OK otherwise (0: not asked).
absl::Status CheckResumeStepField(const v1::OpenSessionRequest& req);

// The refusal of an open asking for step `want` of job `id`, which is at
// step `held` (`where`: "in this dmuond's memory", "in its snapshot ...");
// `previous` says what the previous snapshot holds (or that there is none).
// FAILED_PRECONDITION: the job exists, but not at that step.
absl::Status ResumeStepError(const std::string& id, int64_t want, int64_t held,
                             const std::string& where,
                             const std::string& previous = "");

}  // namespace dmuon::server

#endif  // DMUON_SERVER_RESUME_STEP_H_
