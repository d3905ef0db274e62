// The Step stream's client messages: inline gradient chunks and
// gradients-ready declarations.

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/protocol.h"
#include "server/job.h"
#include "server/param_work.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

absl::Status CheckStep(const Session& s, const SessionState& st, int64_t step) {
  if (step == st.step) return absl::OkStatus();
  if (step < st.step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is already complete for rank ", s.rank(),
                     "; the next step is ", st.step));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, " skips step ", st.step, " (rank ", s.rank(), ")"));
}

absl::Status CheckParam(const Job& job, int id) {
  if (id >= 0 && id < job.num_params()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("parameter id ", id, " does not exist (the table has ",
                   job.num_params(), " parameters)"));
}

void StartStep(SessionState& st) {
  if (st.step_started) return;
  st.step_started = true;
  st.step_t0 = std::chrono::steady_clock::now();
}

}  // namespace

absl::Status OptimizerService::OnStepRequest(const std::string& session_id,
                                             const v1::StepRequest& req) {
  auto s = FindSession(session_id);
  if (!s) return absl::NotFoundError("session is closed");
  auto job = s->job();
  if (!job) return absl::AbortedError("the session's job is gone");
  const bool draining = this->draining();
  std::vector<int> ready, absent;  // to submit; to deliver as absent
  int64_t step = 0;
  {
    absl::MutexLock lock(&job->mu());
    if (req.has_gradients_ready()) {
      // A step rolled back while these parameters ran (a rank left
      // mid-step, RollBack) ends their computation before they can run
      // again; it always ends (an executor call), so wait for it.
      auto idle = [&job, &req] {
        job->mu().AssertHeld();
        for (int id : req.gradients_ready().param_ids()) {
          if (id >= 0 && id < job->num_params() && job->param(id).running)
            return false;
        }
        for (int id : req.gradients_ready().absent_param_ids()) {
          if (id >= 0 && id < job->num_params() && job->param(id).running)
            return false;
        }
        return true;
      };
      job->mu().Await(absl::Condition(&idle));
    }
    if (!job->Holds(*s)) return absl::NotFoundError("session is closed");
    if (job->broken()) {
      return absl::AbortedError(absl::StrCat(
          "job '", job->id(), "' is broken (a rank left mid-step)"));
    }
    SessionState& st = s->state(*job);
    if (draining && !job->mid_step() &&
        (req.has_gradient() || req.has_gradients_ready())) {
      // No step starts once the daemon drains, so the final snapshot holds
      // every step a client was told is complete; a step some rank started
      // already finishes.
      return absl::UnavailableError(absl::StrCat(
          "dmuond is draining (Drain or SIGTERM): step ", st.step, " of job '",
          job->id(), "' was not started and is refused; its state as of step ",
          st.step - 1,
          " is kept (--state-dir: snapshotted); reopen the job (on this "
          "daemon once restarted, or another) and continue from step ",
          st.step));
    }
    if (req.has_rewind()) {
      // Protocol minor 1: undo the last completed step (job.h Job::Rewind).
      if (draining) {
        return absl::UnavailableError(absl::StrCat(
            "dmuond is draining (Drain or SIGTERM): rewinding step ",
            req.rewind().step(), " of job '", job->id(),
            "' is refused (its state as of that step is kept)"));
      }
      if (job->world_size() == 1) return job->Rewind(req.rewind().step());
      // Several ranks: the step is undone once every rank asked; this rank
      // waits for that (its next messages, the redo, stay unread).
      if (auto e = job->AskRewind(s->rank(), req.rewind().step()); !e.ok())
        return e;
      return job->AwaitRewind(*s, req.rewind().step());
    }
    if (req.has_gradient() || req.has_gradients_ready()) {
      if (auto e = job->CheckNoRewindPending(
              s->rank(), req.has_gradient() ? req.gradient().step()
                                            : req.gradients_ready().step());
          !e.ok())
        return e;
    }
    if (req.has_gradient()) {
      const v1::TensorChunk& c = req.gradient();
      if (s->transport() != v1::TRANSPORT_INLINE) {
        return absl::InvalidArgumentError(
            "gradient chunks are for TRANSPORT_INLINE; this session's "
            "gradients go in its shm segment");
      }
      if (auto e = CheckStep(*s, st, c.step()); !e.ok()) return e;
      if (auto e = CheckParam(*job, c.param_id()); !e.ok()) return e;
      const std::string& name = job->table().params[c.param_id()].name;
      const auto& slot = s->layout().slots[c.param_id()];
      if (st.declared[c.param_id()]) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient chunk for parameter '", name,
                         "' after it was declared ready at step ", c.step()));
      }
      if (c.offset() != st.received[c.param_id()]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient chunk for parameter '", name, "' at offset ", c.offset(),
            "; expected ", st.received[c.param_id()], " (chunks in order)"));
      }
      if (c.offset() + c.data().size() > slot.bytes) {
        return absl::OutOfRangeError(
            absl::StrCat("gradient chunk for parameter '", name,
                         "' ends at byte ", c.offset() + c.data().size(),
                         "; the tensor has ", slot.bytes, " bytes"));
      }
      std::memcpy(
          s->region()->bytes().data() + slot.gradient_offset + c.offset(),
          c.data().data(), c.data().size());
      st.received[c.param_id()] += c.data().size();
      st.bytes_in += c.data().size();
      if (metrics_) metrics_->BytesReceived(c.data().size());
      StartStep(st);
      return absl::OkStatus();
    }
    if (!req.has_gradients_ready()) {
      return absl::InvalidArgumentError(
          "expected gradients_ready, gradient or rewind after attach");
    }
    const v1::GradientsReady& g = req.gradients_ready();
    if (auto e = CheckStep(*s, st, g.step()); !e.ok()) return e;
    std::vector<uint8_t> seen(job->num_params(), 0);
    for (int id : g.param_ids()) {
      if (auto e = CheckParam(*job, id); !e.ok()) return e;
      const std::string& name = job->table().params[id].name;
      if (st.declared[id] || seen[id]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", name, "' declared ready twice at step ", g.step()));
      }
      seen[id] = 1;
      if (s->transport() == v1::TRANSPORT_INLINE &&
          st.received[id] != s->layout().slots[id].bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient of parameter '", name,
                         "' is incomplete: ", st.received[id], " of ",
                         s->layout().slots[id].bytes, " bytes received"));
      }
    }
    // Protocol minor 2: this step's momentum per parameter (empty: each
    // group's). A daemon of an older minor ignores it, as that release did.
    const bool step_momentum = ProtocolMinor() >= 2 && g.momentum_size() > 0;
    if (step_momentum && g.momentum_size() != g.param_ids_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradients_ready.momentum at step ", g.step(), " has ",
          g.momentum_size(), " values for ", g.param_ids_size(),
          " param_ids: send one per param_ids entry (same order), or none"));
    }
    std::vector<double> betas;  // by param_ids entry: this step's momentum
    for (int k = 0; k < g.param_ids_size(); ++k) {
      const ParamInfo& info = job->table().params[g.param_ids(k)];
      const double m = step_momentum ? g.momentum(k) : info.muon.momentum;
      if (!(m >= 0 && m < 1)) {  // NaN too
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", info.name, "' at step ", g.step(),
            ": gradients_ready.momentum must be in [0, 1), got ", m));
      }
      // Every rank that declares the parameter uses the same momentum (a
      // rank that sends none: its group's).
      const ParamState& p = job->param(g.param_ids(k));
      if (p.has_step_momentum && p.step_momentum != m) {
        // Shortest first; every digit when that does not tell them apart.
        std::string ours = absl::StrCat(m),
                    theirs = absl::StrCat(p.step_momentum);
        if (ours == theirs) {
          ours = absl::StrFormat("%.17g", m);
          theirs = absl::StrFormat("%.17g", p.step_momentum);
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", info.name, "' at step ", g.step(), ": rank ",
            s->rank(), " declared it with momentum ", ours,
            " but another rank with ", theirs,
            " (gradients_ready.momentum; a rank that sends none uses its "
            "group's, ",
            info.muon.momentum,
            "); every rank must send the same momentum for a parameter"));
      }
      betas.push_back(m);
    }
    // Protocol minor 1: parameters without a gradient this step (torch:
    // .grad is None). Nothing is read for them; they complete as absent.
    for (int id : g.absent_param_ids()) {
      if (auto e = CheckParam(*job, id); !e.ok()) return e;
      const std::string& name = job->table().params[id].name;
      if (st.declared[id] || seen[id]) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter '", name, "' declared twice at step ",
                         g.step(), " (absent_param_ids included)"));
      }
      seen[id] = 1;
      if (st.received[id] != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", name, "' declared absent at step ", g.step(),
            " after ", st.received[id], " bytes of its gradient were sent"));
      }
    }
    // SHARDING_REPLICATED (rank 0's gradient is the one used), SHARDING_ROWS
    // and SHARDING_BLOCKS: every rank must say alike whether it has a
    // gradient (a rank holding nothing of a BLOCKS matrix too).
    // SHARDING_UNREDUCED: absent only when absent on every rank; a rank
    // without one counts as zeros in the mean (torch DDP's all-reduce with
    // find_unused_parameters).
    for (const auto* list : {&g.param_ids(), &g.absent_param_ids()}) {
      const bool none = list == &g.absent_param_ids();
      for (int id : *list) {
        if (int r = job->AbsentDisagrees(s->rank(), id, none); r >= 0) {
          const ParamInfo& info = job->table().params[id];
          return absl::InvalidArgumentError(absl::StrCat(
              "parameter '", info.name, "' at step ", g.step(), ": rank ",
              s->rank(), none ? " has no gradient (absent)" : " has one",
              " but rank ", r, none ? " has one" : " has none (absent)", "; a ",
              v1::Sharding_Name(info.sharding),
              " parameter is present or absent on every rank alike "
              "(SHARDING_UNREDUCED counts a missing gradient as zeros)"));
        }
      }
    }
    if (s->transport() == v1::TRANSPORT_SHM) {
      if (auto e = s->region()->Check(); !e.ok()) return e;
    }
    StartStep(st);
    const std::vector<int> ids(g.param_ids().begin(), g.param_ids().end());
    for (int id : ids) st.declared[id] = 1;
    for (size_t k = 0; k < ids.size(); ++k) {
      ParamState& p = job->param(ids[k]);
      p.step_momentum = betas[k];
      p.has_step_momentum = true;
    }
    for (int id : g.absent_param_ids()) {
      st.declared[id] = 1;
      switch (job->Arrive(s->rank(), id, /*absent=*/true)) {
        case Job::Arrival::kRun:
          ready.push_back(id);  // SHARDING_UNREDUCED, present elsewhere
          break;
        case Job::Arrival::kAbsent:
          absent.push_back(id);
          break;
        case Job::Arrival::kWaiting:
          break;
      }
    }
    step = g.step();
    if (s->region()->moves_data()) {
      // nccl: the gradients come by transfers; they count as arrived once
      // they have landed (PullDone). Absent ones move nothing: no receive is
      // posted for them, but the region counts them among the step's
      // gradients (its update sends wait for all of them).
      if (!ids.empty() || g.absent_param_ids_size() == 0) {
        std::weak_ptr<Session> weak = s;
        s->region()->Pull(
            g.step(), ids,
            [this, job, weak, step = g.step(), ids](absl::Status e) {
              PullDone(job, weak, step, ids, e);
            });
      }
      if (g.absent_param_ids_size() > 0)
        s->region()->Absent(g.step(), g.absent_param_ids_size());
    } else {
      for (int id : ids) {
        if (s->transport() == v1::TRANSPORT_SHM) {
          st.bytes_in += s->layout().slots[id].bytes;
          if (metrics_) metrics_->BytesReceived(s->layout().slots[id].bytes);
        }
        if (job->Arrive(s->rank(), id) == Job::Arrival::kRun)
          ready.push_back(id);
      }
    }
  }
  SubmitParams(job, step, ready);
  for (int id : absent) {
    Deliver(job, id, step, absl::OkStatus(), /*nonfinite=*/false,
            /*compute_seconds=*/0, /*absent=*/true);
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
