// The Step stream's client messages: inline gradient chunks and
// gradients-ready declarations.

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "server/job.h"
#include "server/param_work.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

absl::Status CheckStep(const Session& s, int64_t step) {
  if (step == s.step) return absl::OkStatus();
  if (step < s.step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is already complete for rank ", s.rank,
                     "; the next step is ", s.step));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, " skips step ", s.step, " (rank ", s.rank, ")"));
}

absl::Status CheckParam(const Job& job, int id) {
  if (id >= 0 && id < static_cast<int>(job.params.size()))
    return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("parameter id ", id, " does not exist (the table has ",
                   job.params.size(), " parameters)"));
}

}  // namespace

absl::Status OptimizerService::OnStepRequest(const std::string& session_id,
                                             const v1::StepRequest& req) {
  auto s = FindSession(session_id);
  if (!s) return absl::NotFoundError("session is closed");
  auto job = s->job.lock();
  if (!job) return absl::AbortedError("the session's job is gone");
  std::vector<std::shared_ptr<Work>> ready;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    if (s->closed) return absl::NotFoundError("session is closed");
    if (job->broken) {
      return absl::AbortedError(
          absl::StrCat("job '", job->id, "' is broken (a rank left mid-step)"));
    }
    if (req.has_gradient()) {
      const v1::TensorChunk& c = req.gradient();
      if (s->transport != v1::TRANSPORT_INLINE) {
        return absl::InvalidArgumentError(
            "gradient chunks are for TRANSPORT_INLINE; this session's "
            "gradients go in its shm segment");
      }
      if (auto st = CheckStep(*s, c.step()); !st.ok()) return st;
      if (auto st = CheckParam(*job, c.param_id()); !st.ok()) return st;
      const std::string& name = job->table.params[c.param_id()].name;
      const auto& slot = s->layout.slots[c.param_id()];
      if (s->declared[c.param_id()]) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient chunk for parameter '", name,
                         "' after it was declared ready at step ", c.step()));
      }
      if (c.offset() != s->received[c.param_id()]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gradient chunk for parameter '", name, "' at offset ", c.offset(),
            "; expected ", s->received[c.param_id()], " (chunks in order)"));
      }
      if (c.offset() + c.data().size() > slot.bytes) {
        return absl::OutOfRangeError(
            absl::StrCat("gradient chunk for parameter '", name,
                         "' ends at byte ", c.offset() + c.data().size(),
                         "; the tensor has ", slot.bytes, " bytes"));
      }
      std::memcpy(s->region->bytes().data() + slot.gradient_offset + c.offset(),
                  c.data().data(), c.data().size());
      s->received[c.param_id()] += c.data().size();
      s->bytes_in += c.data().size();
      if (metrics_) metrics_->BytesReceived(c.data().size());
      if (!s->step_started) {
        s->step_started = true;
        s->step_t0 = std::chrono::steady_clock::now();
      }
      return absl::OkStatus();
    }
    if (!req.has_gradients_ready()) {
      return absl::InvalidArgumentError(
          "expected gradients_ready or gradient after attach");
    }
    const v1::GradientsReady& g = req.gradients_ready();
    if (auto st = CheckStep(*s, g.step()); !st.ok()) return st;
    std::vector<uint8_t> seen(job->params.size(), 0);
    for (int id : g.param_ids()) {
      if (auto st = CheckParam(*job, id); !st.ok()) return st;
      const std::string& name = job->table.params[id].name;
      if (s->declared[id] || seen[id]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", name, "' declared ready twice at step ", g.step()));
      }
      seen[id] = 1;
      if (s->transport == v1::TRANSPORT_INLINE &&
          s->received[id] != s->layout.slots[id].bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("gradient of parameter '", name,
                         "' is incomplete: ", s->received[id], " of ",
                         s->layout.slots[id].bytes, " bytes received"));
      }
    }
    if (s->transport == v1::TRANSPORT_SHM) {
      if (auto st = s->region->Check(); !st.ok()) return st;
    }
    if (!s->step_started) {
      s->step_started = true;
      s->step_t0 = std::chrono::steady_clock::now();
    }
    if (s->region->moves_data()) {
      // nccl: the gradients come by transfers; they count as arrived once
      // they have landed (PullDone).
      const std::vector<int> ids(g.param_ids().begin(), g.param_ids().end());
      for (int id : ids) s->declared[id] = 1;
      std::weak_ptr<Session> weak = s;
      s->region->Pull(g.step(), ids,
                      [this, job, weak, step = g.step(), ids](absl::Status st) {
                        PullDone(job, weak, step, ids, st);
                      });
      return absl::OkStatus();
    }
    const bool complete = job->open_ranks() == job->world_size;
    for (int id : g.param_ids()) {
      s->declared[id] = 1;
      if (s->transport == v1::TRANSPORT_SHM) {
        s->bytes_in += s->layout.slots[id].bytes;
        if (metrics_) metrics_->BytesReceived(s->layout.slots[id].bytes);
      }
      ParamState& p = job->params[id];
      p.arrived[s->rank] = 1;
      if (++p.arrived_count == job->world_size && complete) {
        p.running = true;
        ready.push_back(std::make_shared<ParamWork>(this, job, id, g.step()));
      }
    }
  }
  for (auto& w : ready) {
    auto* pw = static_cast<ParamWork*>(w.get());
    scheduler_->Submit(job->plan.executor_of[pw->param], std::move(w));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
