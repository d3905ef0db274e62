// StepPipeline (step_pipeline.h): a step's messages in, its parameters
// submitted, its updates delivered.

#include "server/step_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/job_state.h"
#include "server/param_work.h"
#include "server/session_error.h"
#include "server/step_checks.h"
#include "server/step_trace.h"
#include "transport/doorbell.h"

namespace dmuon::server {
namespace {

void StartStep(SessionState& st) {
  if (st.step_started) return;
  st.step_started = true;
  st.step_t0 = std::chrono::steady_clock::now();
}

// The rank's step ended: the next one starts clean.
void EndSessionStep(SessionState& st, int64_t step) {
  st.step = step + 1;
  st.delivered = 0;
  st.step_started = false;
  std::fill(st.declared.begin(), st.declared.end(), 0);
  std::fill(st.received.begin(), st.received.end(), 0);
}

// Whether any parameter of `g` still runs a step that was rolled back (a
// rank left mid-step, RollBack): its computation ends before it can run
// again.
bool StillRunning(const Job& job, const v1::GradientsReady& g)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  for (const auto* list : {&g.param_ids(), &g.absent_param_ids()}) {
    for (int id : *list) {
      if (id >= 0 && id < job.num_params() && job.param(id).running)
        return true;
    }
  }
  return false;
}

// Host regions are written only through Region::Write, never through their
// mapping: a client may shrink its shm segment at any moment, and a touch
// past its new end would be SIGBUS for the whole daemon; the copy fails
// with DATA_LOSS naming the segment instead. (The inline transport's heap
// region is also sent from directly: UpdateOf.)
absl::Status WriteUpdate(const Session& s, int param, const float* in,
                         int64_t elements) {
  absl::Status st = s.region()->Write(s.layout().slots[param].update_offset, in,
                                      elements * sizeof(float));
  if (st.ok()) return st;
  return absl::Status(st.code(),
                      absl::StrCat("rank ", s.rank(), ": ", st.message()));
}
const float* UpdateOf(const Session& s, int param) {
  return reinterpret_cast<const float*>(s.region()->bytes().data() +
                                        s.layout().slots[param].update_offset);
}

v1::StepResponse ErrorResponse(int64_t step, int param, const std::string& name,
                               const absl::Status& status, bool skipped) {
  v1::StepResponse r;
  auto* e = r.mutable_error();
  e->set_step(step);
  e->set_param_id(param);
  e->set_name(name);
  e->set_code(static_cast<int>(status.code()));
  e->set_message(std::string(status.message()));
  e->set_skipped(skipped);
  return r;
}

}  // namespace

absl::Status StepPipeline::OnRequest(const std::shared_ptr<Session>& s,
                                     const std::shared_ptr<Job>& job,
                                     const v1::StepRequest& req,
                                     bool draining) {
  std::vector<int> ready, absent;  // to submit; to deliver as absent
  int64_t step = 0;
  {
    absl::MutexLock lock(&job->mu());
    if (req.has_gradients_ready()) {
      // A rolled-back computation always ends (an executor call): wait.
      auto idle = [&job, &req] {
        job->mu().AssertHeld();
        return !StillRunning(*job, req.gradients_ready());
      };
      job->mu().Await(absl::Condition(&idle));
    }
    if (!job->Holds(*s)) return NoOpenSessionError();
    if (job->broken()) {
      return absl::AbortedError(absl::StrCat(
          "job '", job->id(), "' is broken (a rank left mid-step)"));
    }
    SessionState& st = s->state(*job);
    const bool steps = req.has_gradient() || req.has_gradients_ready();
    if (draining && !job->mid_step() && steps) {
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
    if (req.has_rewind()) return OnRewind(*s, *job, req.rewind(), draining);
    if (steps) {
      if (auto e = job->CheckNoRewindPending(
              s->rank(), req.has_gradient() ? req.gradient().step()
                                            : req.gradients_ready().step());
          !e.ok())
        return e;
    }
    if (req.has_gradient())
      return OnGradientChunk(*s, *job, st, req.gradient());
    if (!req.has_gradients_ready()) {
      return absl::InvalidArgumentError(
          "expected gradients_ready, gradient or rewind after attach");
    }
    if (auto e = OnGradientsReady(s, job, st, req.gradients_ready(), &ready,
                                  &absent);
        !e.ok())
      return e;
    step = req.gradients_ready().step();
  }
  Submit(job, step, ready);
  for (int id : absent) {
    Deliver(job, id, step, absl::OkStatus(), /*nonfinite=*/false,
            /*compute_seconds=*/0, /*absent=*/true);
  }
  return absl::OkStatus();
}

absl::Status StepPipeline::OnRewind(Session& s, Job& job, const v1::Rewind& r,
                                    bool draining) {
  // Protocol minor 1: undo the last completed step (job.h Job::Rewind).
  if (draining) {
    return absl::UnavailableError(
        absl::StrCat("dmuond is draining (Drain or SIGTERM): rewinding step ",
                     r.step(), " of job '", job.id(),
                     "' is refused (its state as of that step is ", "kept)"));
  }
  absl::Status st;
  if (job.world_size() == 1) {
    st = job.Rewind(r.step());
  } else {
    // Several ranks: the step is undone once every rank asked; this rank
    // waits for that (its next messages, the redo, stay unread).
    st = job.AskRewind(s.rank(), r.step());
    if (st.ok()) st = job.AwaitRewind(s, r.step());
  }
  // One count per step rewound: every rank's round ends alike, rank 0's
  // counts it. (A client's request: --strict never refuses it.)
  if (st.ok() && s.rank() == 0 && ctx_.fallbacks != nullptr) {
    ctx_.fallbacks->Add(
        kFallbackRewind,
        absl::StrCat("job '", job.id(), "' rewound its completed step ",
                     r.step(),
                     " (computed again: gradients edited after "
                     "their hand-off, a second backward, or a voided step)"));
  }
  return st;
}

absl::Status StepPipeline::OnGradientChunk(Session& s, Job& job,
                                           SessionState& st,
                                           const v1::TensorChunk& c) {
  if (auto e = CheckGradientChunk(s, job, st, c); !e.ok()) return e;
  const auto& slot = s.layout().slots[c.param_id()];
  std::memcpy(s.region()->bytes().data() + slot.gradient_offset + c.offset(),
              c.data().data(), c.data().size());
  st.received[c.param_id()] += c.data().size();
  st.bytes_in += c.data().size();
  ctx_.metrics->BytesReceived(c.data().size());
  StartStep(st);
  return absl::OkStatus();
}

absl::Status StepPipeline::OnGradientsReady(const std::shared_ptr<Session>& s,
                                            const std::shared_ptr<Job>& job,
                                            SessionState& st,
                                            const v1::GradientsReady& g,
                                            std::vector<int>* ready,
                                            std::vector<int>* absent) {
  if (auto e = CheckStep(*s, st, g.step()); !e.ok()) return e;
  if (auto e = CheckDeclared(*s, *job, st, g); !e.ok()) return e;
  auto betas = StepMomenta(*s, *job, g);
  if (!betas.ok()) return betas.status();
  if (auto e = CheckPresenceAgrees(*s, *job, g); !e.ok()) return e;
  if (s->transport() == v1::TRANSPORT_SHM) {
    if (auto e = s->region()->Check(); !e.ok()) return e;
  }
  // Checked whole: from here on the declaration is applied.
  StartStep(st);
  const std::vector<int> ids(g.param_ids().begin(), g.param_ids().end());
  for (size_t k = 0; k < ids.size(); ++k) {
    st.declared[ids[k]] = 1;
    ParamState& p = job->param(ids[k]);
    p.step_momentum = (*betas)[k];
    p.has_step_momentum = true;
  }
  for (int id : g.absent_param_ids()) {
    st.declared[id] = 1;
    switch (job->Arrive(s->rank(), id, /*absent=*/true)) {
      case Job::Arrival::kRun:
        ready->push_back(id);  // SHARDING_UNREDUCED, present elsewhere
        break;
      case Job::Arrival::kAbsent:
        absent->push_back(id);
        break;
      case Job::Arrival::kWaiting:
        break;
    }
  }
  if (!s->region()->moves_data()) {
    if (Tracing(ctx_.trace)) {
      ctx_.trace->NameThread("Step streams (gRPC)");
      for (int id : ids) {
        TraceStageNow(ctx_.trace, *job, id, g.step(), "received",
                      {{"rank", s->rank()}});
      }
    }
    for (int id : ids) {
      if (s->transport() == v1::TRANSPORT_SHM) {
        st.bytes_in += s->layout().slots[id].bytes;
        ctx_.metrics->BytesReceived(s->layout().slots[id].bytes);
      }
      if (job->Arrive(s->rank(), id) == Job::Arrival::kRun)
        ready->push_back(id);
    }
    return absl::OkStatus();
  }
  // nccl: the gradients come by transfers; they count as arrived once they
  // have landed (PullDone). Absent ones move nothing: no receive is posted
  // for them, but the region counts them among the step's gradients (its
  // update sends wait for all of them).
  if (!ids.empty() || g.absent_param_ids_size() == 0) {
    std::weak_ptr<Session> weak = s;
    s->region()->Pull(g.step(), ids,
                      [this, job, weak, step = g.step(), ids](absl::Status e) {
                        PullDone(job, weak, step, ids, e);
                      });
  }
  if (g.absent_param_ids_size() > 0)
    s->region()->Absent(g.step(), g.absent_param_ids_size());
  return absl::OkStatus();
}

void StepPipeline::Submit(const std::shared_ptr<Job>& job, int64_t step,
                          const std::vector<int>& params) {
  if (params.empty()) return;
  {
    // A GetState reads the job at its step boundary: these wait for it
    // (the last reader submits them, StateReader).
    absl::MutexLock lock(&job->mu());
    if (job->state_readers() > 0) {
      for (int id : params) job->Defer(step, id);
      return;
    }
  }
  // All at once: a worker woken by the first would otherwise batch a part
  // of them, and the batches (and their launches) would vary by step.
  std::vector<std::pair<int, std::shared_ptr<Work>>> works;
  works.reserve(params.size());
  for (int id : params) {
    const int executor = job->plan().executor_of[id];
    TraceStageNow(ctx_.trace, *job, id, step, "queued",
                  {{"executor", executor}});
    works.emplace_back(executor,
                       std::make_shared<ParamWork>(*this, job, id, step));
  }
  ctx_.scheduler->SubmitAll(std::move(works));
}

void StepPipeline::PullDone(const std::shared_ptr<Job>& job,
                            const std::weak_ptr<Session>& session, int64_t step,
                            const std::vector<int>& ids,
                            const absl::Status& status) {
  if (!status.ok()) return TransferFailed(job, status);
  std::vector<int> ready;
  {
    absl::MutexLock lock(&job->mu());
    // The job's own reference (its ranks), if the session is still open.
    Session* s = nullptr;
    for (const auto& r : job->ranks()) {
      if (r && !r.owner_before(session) && !session.owner_before(r))
        s = r.get();
    }
    if (s == nullptr || job->broken()) return;
    SessionState& st = s->state(*job);
    for (int id : ids) {
      TraceStageNow(ctx_.trace, *job, id, step, "received",
                    {{"rank", s->rank()}});
      st.bytes_in += s->layout().slots[id].bytes;
      ctx_.metrics->BytesReceived(s->layout().slots[id].bytes);
      if (job->Arrive(s->rank(), id) == Job::Arrival::kRun) ready.push_back(id);
    }
  }
  Submit(job, step, ready);
}

void StepPipeline::TransferFailed(const std::shared_ptr<Job>& job,
                                  const absl::Status& status) {
  absl::MutexLock lock(&job->mu());
  if (!job->Break()) return;
  const absl::Status why(
      status.code(),
      absl::StrCat("job '", job->id(), "': ", status.message(),
                   "; reopen every rank and restore state from a checkpoint"));
  job->AbortStreams(why);
  CountError(why);
}

void StepPipeline::Deliver(const std::shared_ptr<Job>& job, int param,
                           int64_t step, absl::Status status, bool nonfinite,
                           double compute_seconds, bool absent) {
  if (nonfinite) ctx_.metrics->NonFiniteGradient();
  Acks acks;
  // A step that --snapshot-every snapshots is acknowledged (step_complete)
  // only once its snapshot is written: a daemon killed after a client was
  // told a step is complete restarts from that step (durable state).
  acks.durable = ctx_.snapshots->enabled() && ctx_.snapshot_every > 0 &&
                 step % ctx_.snapshot_every == 0;
  if (acks.durable) acks.not_durable = std::make_shared<std::string>();
  {
    absl::MutexLock lock(&job->mu());
    // A step rolled back meanwhile (a rank left mid-step): discarded, and
    // an executor's state put back to its step-start copy.
    if (!job->EndParam(param)) {
      (void)RestoreStepStarts(*ctx_.scheduler, *job);
      return;
    }
    if (job->broken()) return;
    job->AddComputeSeconds(param, compute_seconds);
    const bool skip = nonfinite && ctx_.skip_nonfinite;
    if (!status.ok() && !skip) return Fail(*job, param, step, status);
    if (!absent) {
      if (auto e = WriteHostUpdates(*job, param, step, skip); !e.ok())
        return Fail(*job, param, step, e);
    }
    // Before the first announcement: no rank can have seen the update
    // earlier (the exposed latency's end, Job::FinishParam).
    const auto delivered = std::chrono::steady_clock::now();
    for (auto& s : job->ranks()) {
      if (s) Acknowledge(job, *s, param, step, status, skip, absent, acks);
    }
    // Nothing of the next step can have started: every rank's step ends in
    // this critical section, so the state copied here is consistent.
    if (job->FinishParam(step, delivered) && ctx_.snapshots->enabled() &&
        ctx_.snapshot_every > 0 &&
        job->completed_steps() % ctx_.snapshot_every == 0) {
      if (auto bytes = SnapshotBytes(*ctx_.scheduler, *job); bytes.ok()) {
        acks.snapshot = *std::move(bytes);
        acks.snapshot_steps = job->completed_steps();
      } else {
        CountError(bytes.status());
        if (acks.not_durable) *acks.not_durable = bytes.status().ToString();
      }
    }
  }
  if (!acks.snapshot.empty()) {
    if (auto st = ctx_.snapshots->Write(job->id(), job->serial(),
                                        acks.snapshot_steps, acks.snapshot);
        !st.ok()) {
      CountError(st);
      if (acks.not_durable) *acks.not_durable = st.ToString();
    }
  }
  for (auto& [sink, done] : acks.held) {
    if (acks.not_durable)
      done.mutable_step_complete()->set_not_durable(*acks.not_durable);
    sink->SendHeld(std::move(done));
  }
  for (auto& gate : acks.gates) gate->Done();
}

void StepPipeline::Fail(Job& job, int param, int64_t step,
                        const absl::Status& why) {
  const std::string& name = job.table().params[param].name;
  job.Break();
  for (auto& s : job.ranks()) {
    if (!s) continue;
    const auto& sink = s->state(job).sink;
    if (!sink) continue;
    sink->Send(ErrorResponse(step, param, name, why, false));
    sink->Abort(why);
  }
  CountError(why);
}

absl::Status StepPipeline::WriteHostUpdates(Job& job, int param, int64_t step,
                                            bool skip) {
  const ParamInfo& info = job.table().params[param];
  std::vector<float> zeros, local;
  for (auto& s : job.ranks()) {
    if (!s || s->region()->device()) continue;
    const ShardMap& held = s->shards()[param];
    const int64_t n = held.elements();
    if (n == 0) continue;  // holds nothing (SHARDING_BLOCKS)
    if (skip && zeros.size() < static_cast<size_t>(n)) zeros.assign(n, 0.0f);
    const float* work = job.param(param).work.data();
    const float* in = skip ? zeros.data() : work + held.offset(info.shape);
    if (!skip && !held.Contiguous(info.shape)) {
      local.resize(n);
      GatherFromMatrix(held, info.shape, work, local.data());
      in = local.data();
    }
    if (auto e = WriteUpdate(*s, param, in, n); !e.ok()) {
      return absl::Status(
          e.code(),
          absl::StrCat("the update of parameter '", info.name, "' at step ",
                       step, " cannot be delivered: ", e.message()));
    }
  }
  return absl::OkStatus();
}

void StepPipeline::Acknowledge(const std::shared_ptr<Job>& job, Session& s,
                               int param, int64_t step,
                               const absl::Status& status, bool skip,
                               bool absent, Acks& acks) {
  SessionState& st = s.state(*job);
  const int64_t n = absent ? 0 : s.shards()[param].elements();
  st.bytes_out += n * sizeof(float);
  if (n > 0) ctx_.metrics->BytesSent(n * sizeof(float));
  if (!st.sink) return;  // not attached: nothing to tell
  if (skip) {
    st.sink->Send(ErrorResponse(step, param, job->table().params[param].name,
                                status, true));
  }
  if (s.transport() == v1::TRANSPORT_INLINE && !absent)
    SendUpdateChunks(s, param, step, n, *st.sink);
  v1::StepResponse ready;
  ready.mutable_updates_ready()->set_step(step);
  if (absent) {
    ready.mutable_updates_ready()->add_absent_param_ids(param);
  } else {
    ready.mutable_updates_ready()->add_param_ids(param);
  }
  const bool last = ++st.delivered == job->num_params();
  v1::StepResponse done;
  done.mutable_step_complete()->set_step(step);
  if (s.region()->moves_data()) {
    // nccl: UpdatesReady once the send is posted (the client posts the
    // matching receive when it reads it), StepComplete after the last, and
    // on a durable step only once its snapshot is written too.
    std::shared_ptr<AckGate> gate;
    if (last) {
      gate = std::make_shared<AckGate>(
          acks.durable ? 2 : 1,
          [sink = st.sink, done, why = acks.not_durable]() mutable {
            if (why) done.mutable_step_complete()->set_not_durable(*why);
            sink->Send(std::move(done));
          });
      if (acks.durable) acks.gates.push_back(gate);
    }
    // An absent parameter: an empty push (nothing to send), in its place
    // among the others (transport.h Region::Absent).
    s.region()->Push(step,
                     absent ? std::vector<int>() : std::vector<int>{param},
                     [this, job, sink = st.sink, ready, gate](absl::Status e) {
                       if (!e.ok()) return TransferFailed(job, e);
                       sink->Send(ready);
                       if (gate) gate->Done();
                     });
  } else {
    Announce(s, st, param, step, skip, absent, std::move(ready));
    if (last && acks.durable) {
      st.sink->HoldEnd();
      acks.held.emplace_back(st.sink, std::move(done));
    } else if (last) {
      st.sink->Send(std::move(done));
    }
  }
  if (!last) return;
  const double seconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - st.step_t0)
                             .count();
  ctx_.stats->RecordLatency(seconds);
  ctx_.metrics->StepCompleted(seconds);
  EndSessionStep(st, step);
}

void StepPipeline::Announce(Session& s, SessionState& st, int param,
                            int64_t step, bool skip, bool absent,
                            v1::StepResponse ready) const {
  const std::shared_ptr<transport::Doorbell> bell = s.region()->doorbell();
  if (bell == nullptr || !transport::DoorbellStepFits(step)) {
    st.sink->Send(std::move(ready));
    return;
  }
  transport::DoorbellWord w;
  w.serial = ++st.doorbell_serial;
  w.step = step;
  w.flag_a = skip;
  w.flag_b = absent;
  if (absl::Status e = bell->Announce(param, transport::EncodeWord(w));
      !e.ok()) {
    st.sink->Abort(absl::Status(
        e.code(), absl::StrCat("rank ", s.rank(), ": the update of parameter ",
                               param, " at step ", step,
                               " cannot be announced: ", e.message())));
  }
}

void StepPipeline::SendUpdateChunks(Session& s, int param, int64_t step,
                                    int64_t elements, StepSink& sink) const {
  const uint64_t bytes = elements * sizeof(float);
  const char* base = reinterpret_cast<const char*>(UpdateOf(s, param));
  for (const auto& c : transport::SplitChunks(
           bytes, transport::MaxChunkPayload(ctx_.max_message_bytes))) {
    v1::StepResponse r;
    auto* u = r.mutable_update();
    u->set_step(step);
    u->set_param_id(param);
    u->set_offset(c.offset);
    u->set_data(base + c.offset, c.bytes);
    sink.Send(std::move(r));
  }
}

void StepPipeline::CountError(const absl::Status& st) const {
  if (st.ok()) return;
  const std::string code = absl::StatusCodeToString(st.code());
  ctx_.stats->CountError(code);
  ctx_.metrics->Error(code);
}

}  // namespace dmuon::server
