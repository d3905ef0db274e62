// A job's state on executors that hold it (job_state.h, executor.h): host
// mirrors of device-resident momentum are filled before they are read and
// pushed back after they are written, and step-start copies restored.

#include "server/job_state.h"

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/snapshot_store.h"

namespace dmuon::server {

absl::Status PullState(Scheduler& scheduler, Job& job) {
  if (!scheduler.holds_state()) return absl::OkStatus();
  for (int i = 0; i < job.num_params(); ++i) {
    std::vector<float>& m = job.param(i).momentum;
    if (m.empty()) m.assign(job.table().params[i].shape.elements(), 0.0f);
    const StateKey key{job.serial(), i};
    if (auto st = scheduler.ReadState(job.plan().executor_of[i], key,
                                      absl::MakeSpan(m));
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("reading the momentum of parameter '",
                                       job.table().params[i].name, "' of job '",
                                       job.id(), "': ", st.message()));
    }
    // Mid-step: a parameter that ran this step advanced in place; the
    // executor's step-start copy is its last completed step's momentum
    // (Job::last_complete_momentum).
    ParamState& p = job.param(i);
    if (!job.keeps_step_start() || !p.ran || !p.has_step_start) continue;
    p.step_start.assign(m.size(), 0.0f);
    if (auto st = scheduler.ReadStepStart(job.plan().executor_of[i], key,
                                          absl::MakeSpan(p.step_start));
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("reading the step-start momentum of "
                                       "parameter '",
                                       job.table().params[i].name, "' of job '",
                                       job.id(), "': ", st.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status RestoreStepStarts(Scheduler& scheduler, Job& job) {
  absl::Status first;
  for (int i : job.TakeStepStartRestores()) {
    const StateKey key{job.serial(), i};
    if (auto st = scheduler.RestoreStepStart(job.plan().executor_of[i], key);
        !st.ok() && first.ok()) {
      first = absl::Status(
          st.code(), absl::StrCat("restoring the momentum of parameter '",
                                  job.table().params[i].name, "' of job '",
                                  job.id(), "' to its last completed step ",
                                  job.completed_steps(), ": ", st.message()));
    }
  }
  if (!first.ok()) job.Break();
  return first;
}

absl::Status PushState(Scheduler& scheduler, Job& job) {
  if (!scheduler.holds_state()) return absl::OkStatus();
  for (int i = 0; i < job.num_params(); ++i) {
    const std::vector<float>& m = job.param(i).momentum;
    if (m.empty()) continue;
    const StateKey key{job.serial(), i};
    if (auto st = scheduler.WriteState(job.plan().executor_of[i], key,
                                       absl::MakeConstSpan(m));
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("writing the momentum of parameter '",
                                       job.table().params[i].name, "' of job '",
                                       job.id(), "': ", st.message()));
    }
  }
  return absl::OkStatus();
}

v1::StateHeader StateHeaderOf(const Job& job) {
  v1::StateHeader h;
  h.set_job_id(job.id());
  h.set_owner(job.owner());
  h.set_completed_steps(job.completed_steps());
  for (const auto& p : job.table().params) *h.add_parameters() = ToSpec(p);
  for (const auto& g : job.table().groups) *h.add_groups() = g;
  return h;
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
  return EncodeSnapshot(StateHeaderOf(job), job.last_complete_momentum());
}

bool WaitUntilNotRunning(Job& job, absl::Duration timeout) {
  auto idle = [&job] {
    job.mu().AssertHeld();
    return !job.running();
  };
  return job.mu().AwaitWithDeadline(absl::Condition(&idle),
                                    absl::Now() + timeout);
}

}  // namespace dmuon::server
