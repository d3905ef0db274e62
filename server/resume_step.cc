#include "server/resume_step.h"

#include "absl/strings/str_cat.h"
#include "base/protocol.h"

namespace dmuon::server {

int64_t ResumeStepOf(const v1::OpenSessionRequest& req) {
  return SpeaksMinor(4) ? req.resume_step() : 0;
}

absl::Status CheckResumeStepField(const v1::OpenSessionRequest& req) {
  const int64_t step = ResumeStepOf(req);
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume_step is ", step,
        ": it must be the job's completed step to continue from (>= 1), or "
        "0 for the step the job is at"));
  }
  if (step > 0 && (req.resume() == v1::RESUME_FRESH ||
                   req.resume() == v1::RESUME_REPLACE)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume_step ", step, " asks to continue from a step, but resume is ",
        v1::Resume_Name(req.resume()),
        ", which starts the job at step 1: use RESUME_CONTINUE (or leave "
        "resume unspecified) with resume_step"));
  }
  return absl::OkStatus();
}

absl::Status ResumeStepError(const std::string& id, int64_t want, int64_t held,
                             const std::string& where,
                             const std::string& previous) {
  return absl::FailedPreconditionError(absl::StrCat(
      "job '", id, "' cannot resume at completed step ", want,
      ": dmuond holds its momentum of step ", held, " (", where, ")",
      previous.empty() ? "" : absl::StrCat("; ", previous),
      ". Resume at a step dmuond holds (load the trainer's checkpoint of that "
      "step), or restore the momentum of step ",
      want,
      " from a checkpoint (SetState; Python: load_state_dict of a "
      "state_dict with momentum)"));
}

}  // namespace dmuon::server
