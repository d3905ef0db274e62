// A job's state on executors that hold it (job_state.h, executor.h): host
// mirrors of device-resident momentum are filled before they are read and
// pushed back after they are written, and step-start copies restored.

#include "server/job_state.h"

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/limits.h"
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

absl::StatusOr<std::vector<std::vector<float>>> CopyMomentum(
    Scheduler& scheduler, Job& job) {
  if (auto st = PullState(scheduler, job); !st.ok()) return st;
  std::vector<std::vector<float>> out(job.num_params());
  for (int i = 0; i < job.num_params(); ++i) {
    const std::vector<float>& m = job.param(i).momentum;
    if (m.empty()) {
      out[i].assign(job.table().params[i].shape.elements(), 0.0f);
    } else {
      out[i] = m;
    }
  }
  return out;
}

absl::Status CheckSnapshot(const std::string& id, const Table& table,
                           const v1::StateHeader& h) {
  if (h.completed_steps() < 0 || h.completed_steps() > kMaxCompletedSteps) {
    return absl::DataLossError(absl::StrCat(
        "job '", id, "' has a snapshot in --state-dir with completed_steps ",
        h.completed_steps(),
        ", outside [0, 2^62]: remove the file to start the job afresh"));
  }
  if (h.parameters_size() != static_cast<int>(table.params.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", id, "' has a snapshot in --state-dir with ",
                     h.parameters_size(), " parameters; this table has ",
                     table.params.size()));
  }
  for (int i = 0; i < h.parameters_size(); ++i) {
    const ParamInfo& p = table.params[i];
    const auto& sp = h.parameters(i);
    if (sp.name() != p.name || sp.shape(0) != p.shape.rows ||
        sp.shape(1) != p.shape.cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", id, "' snapshot parameter ", i, " is '", sp.name(), "' [",
          sp.shape(0), ",", sp.shape(1), "], the table says '", p.name, "' ",
          kernels::ShapeString(p.shape)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSameMatrices(const std::string& id, const Table& held,
                               const Table& table) {
  if (held.params.size() != table.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", id, "' has ", held.params.size(),
        " parameters; this table has ", table.params.size(),
        ": a job reopened at another world size (or at a mark) keeps its "
        "whole-matrix table"));
  }
  for (size_t i = 0; i < held.params.size(); ++i) {
    const ParamInfo& a = held.params[i];
    const ParamInfo& b = table.params[i];
    if (a.name != b.name || a.shape != b.shape || a.group != b.group ||
        a.dtype != b.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", id, "' parameter ", i, " is '", a.name, "' ",
          kernels::ShapeString(a.shape), " of group ", a.group,
          "; this table says '", b.name, "' ", kernels::ShapeString(b.shape),
          " of group ", b.group,
          ": a job reopened at another world size (or at a mark) keeps its "
          "whole matrices (names, shapes, groups); only the shardings may "
          "change"));
    }
  }
  return absl::OkStatus();
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
