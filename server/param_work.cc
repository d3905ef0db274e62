// Gathering gradients for a parameter's step and delivering its update.

#include "server/param_work.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cost_model.h"
#include "server/ack_gate.h"
#include "server/job_state.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

// Host regions are read and written only through Region::Read/Write, never
// through their mapping: a client may shrink its shm segment at any moment,
// and a touch past its new end would be SIGBUS for the whole daemon; the
// copies fail with DATA_LOSS naming the segment instead. (The inline
// transport's heap region is also sent from directly: UpdateOf.)
absl::Status ReadGradient(const Session& s, int param, int64_t elements,
                          float* out) {
  absl::Status st = s.region()->Read(s.layout().slots[param].gradient_offset,
                                     out, elements * sizeof(float));
  if (st.ok()) return st;
  return absl::Status(st.code(),
                      absl::StrCat("rank ", s.rank(), ": ", st.message()));
}
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

// Every rank's slots of `param` in its GPU region.
// `absent` (by rank; empty: none): ranks that declared it absent, whose
// parts have no gradient (DevicePart::grad null).
DeviceIo DeviceIoOf(const std::vector<std::shared_ptr<Session>>& ranks,
                    int param, v1::Sharding sharding,
                    const std::vector<uint8_t>& absent) {
  DeviceIo io;
  io.gather = sharding == v1::SHARDING_ROWS        ? Gather::kRows
              : sharding == v1::SHARDING_UNREDUCED ? Gather::kMean
              : sharding == v1::SHARDING_BLOCKS    ? Gather::kBlocks
                                                   : Gather::kFirst;
  for (const auto& s : ranks) {
    const transport::DeviceView* d = s->region()->device();
    const transport::Slot& slot = s->layout().slots[param];
    DevicePart part;
    part.device = d->device;
    part.grad = reinterpret_cast<const float*>(d->base + slot.gradient_offset);
    part.update = reinterpret_cast<float*>(d->base + slot.update_offset);
    const ShardMap& held = s->shards()[param];
    if (io.gather == Gather::kBlocks) {
      part.map = held;
    } else {
      part.row_begin = held.rows()[0].begin;
      part.row_end = held.rows()[0].end;
    }
    part.ready_event = d->ready_event;
    if (!absent.empty() && absent[s->rank()]) {
      part.grad = nullptr;  // nothing was written or sent: zeros
      part.ready_event = nullptr;
    }
    io.parts.push_back(part);
  }
  return io;
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

ParamWork::ParamWork(OptimizerService* service, std::shared_ptr<Job> job,
                     int param, int64_t step)
    : service(service), job(std::move(job)), param(param), step(step) {}

int32_t ParamWork::forward_order() const {
  return job->table().params[param].forward_order;
}
kernels::Shape ParamWork::shape() const {
  return job->table().params[param].shape;
}
const MuonParams* ParamWork::muon() const {
  return &job->table().params[param].muon;
}
double ParamWork::flops() const {
  const ParamInfo& p = job->table().params[param];
  return kernels::EstimateCost(p.muon.ns.method, p.shape, p.muon.ns).flops;
}

absl::StatusOr<ComputeTask> ParamWork::Prepare() {
  const ParamInfo& info = job->table().params[param];
  std::vector<std::shared_ptr<Session>> ranks;
  {
    absl::MutexLock lock(&job->mu());
    if (job->broken()) return absl::AbortedError("job broken");
    ranks = job->ranks();
  }
  for (const auto& s : ranks) {
    if (!s) return absl::AbortedError("a rank left mid-step");
    if (auto st = s->region()->Check(); !st.ok()) {
      return absl::DataLossError(
          absl::StrCat("rank ", s->rank(), ": ", st.message()));
    }
  }
  ParamState& p = job->running_param(param);
  ComputeTask t;
  t.momentum = p.momentum.empty() ? nullptr : p.momentum.data();
  t.shape = info.shape;
  t.muon = &info.muon;
  if (p.has_step_momentum && p.step_momentum != info.muon.momentum) {
    // This step's momentum (GradientsReady.momentum, protocol minor 2).
    // Batching compares NS options, not momentum (SameBatchKey), and each
    // executor reads the momentum per task.
    step_muon = info.muon;
    step_muon.momentum = p.step_momentum;
    t.muon = &step_muon;
  }
  t.lr_scale = info.lr_scale;
  t.state = {job->serial(), param};
  if (ranks[0]->region()->device() != nullptr) {
    // GPU transports: the executor gathers on the device and checks
    // finiteness there (nonfinite is set before Finish).
    // SHARDING_UNREDUCED present on some ranks only: an absent rank's part
    // has no gradient (zeros in the mean) and still receives the update.
    io = DeviceIoOf(ranks, param, info.sharding, p.absent);
    sessions = ranks;
    t.device_io = &io;
    t.nonfinite = &nonfinite;
    // Executors that keep a step-start copy take it in this Compute (job.h).
    job->SaveStepStart(param);
    return t;
  }
  const int64_t cols = info.shape.cols, n = info.shape.elements();
  p.work.resize(n);
  switch (info.sharding) {
    case v1::SHARDING_ROWS:
      for (const auto& s : ranks) {
        const ShardMap& held = s->shards()[param];
        if (auto st = ReadGradient(*s, param, held.elements(),
                                   p.work.data() + held.offset(info.shape));
            !st.ok()) {
          return st;
        }
      }
      break;
    case v1::SHARDING_BLOCKS: {
      // A map several ranks hold alike (whole replicas: HSDP's Replicate()
      // dimension) is read once, from the lowest of them. The rest go
      // highest rank first, so an element held in maps that only overlap
      // ends as the lowest rank's too, whatever the others sent.
      std::vector<const ShardMap*> maps;
      for (const auto& s : ranks) maps.push_back(&s->shards()[param]);
      const std::vector<int> holders = DistinctHolders(maps);
      std::vector<float> local;
      for (auto k = holders.rbegin(); k != holders.rend(); ++k) {
        const ShardMap& held = *maps[*k];
        local.resize(held.elements());
        if (auto st =
                ReadGradient(*ranks[*k], param, held.elements(), local.data());
            !st.ok()) {
          return st;
        }
        ScatterToMatrix(held, info.shape, local.data(), p.work.data());
      }
      break;
    }
    case v1::SHARDING_UNREDUCED: {
      // The mean in rank order 0..W-1, so arrival order never changes a bit.
      std::fill(p.work.begin(), p.work.end(), 0.0f);
      std::vector<float> g(n);
      for (const auto& s : ranks) {
        // A rank that declared it absent contributes zeros (nothing read).
        if (!p.absent.empty() && p.absent[s->rank()]) continue;
        if (auto st = ReadGradient(*s, param, n, g.data()); !st.ok()) return st;
        for (int64_t i = 0; i < n; ++i) p.work[i] += g[i];
      }
      const float inv = 1.0f / static_cast<float>(ranks.size());
      for (float& x : p.work) x *= inv;
      break;
    }
    default:  // replicated: rank 0's gradient
      if (auto st = ReadGradient(*ranks[0], param, n, p.work.data());
          !st.ok()) {
        return st;
      }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(p.work[i])) {
      nonfinite = true;
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of parameter '", info.name, "' at step ", step,
                       " has a non-finite value (", p.work[i], ") at element (",
                       i / cols, ",", i % cols, ")"));
    }
  }
  // The momentum as of the last completed step, kept until this step
  // completes: what a rollback or a mid-step snapshot needs (job.h).
  job->SaveStepStart(param);
  t.grad = p.work.data();
  t.update = p.work.data();
  return t;
}

void ParamWork::Finish(absl::Status status) {
  if (nonfinite && status.ok() && io.parts.size() > 0) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "gradient of parameter '", job->table().params[param].name,
        "' at step ", step,
        " has a non-finite value (NaN or Inf; found on the device)"));
  }
  service->Deliver(job, param, step, status, nonfinite, compute_seconds);
  // The executor is done with the regions: a closed rank's may go now.
  sessions.clear();
}

void OptimizerService::SubmitParams(const std::shared_ptr<Job>& job,
                                    int64_t step,
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
    works.emplace_back(job->plan().executor_of[id],
                       std::make_shared<ParamWork>(this, job, id, step));
  }
  scheduler_->SubmitAll(std::move(works));
}

void OptimizerService::Deliver(const std::shared_ptr<Job>& job, int param,
                               int64_t step, absl::Status status,
                               bool nonfinite, double compute_seconds,
                               bool absent) {
  const ParamInfo& info = job->table().params[param];
  if (nonfinite && metrics_) metrics_->NonFiniteGradient();
  std::string snapshot;
  int64_t snapshot_steps = 0;
  // A step that --snapshot-every snapshots is acknowledged (step_complete)
  // only once its snapshot is written: a daemon killed after a client was
  // told a step is complete restarts from that step (durable state).
  const bool durable = snapshots_.enabled() && options_.snapshot_every > 0 &&
                       step % options_.snapshot_every == 0;
  std::vector<std::pair<std::shared_ptr<StepSink>, v1::StepResponse>> acks;
  // nccl ranks' step_complete of a durable step: sent once the last update
  // send is posted and the snapshot below is written.
  std::vector<std::shared_ptr<AckGate>> gates;
  {
    absl::MutexLock lock(&job->mu());
    // A step rolled back meanwhile (a rank left mid-step): discarded, and
    // an executor's state put back to its step-start copy.
    if (!job->EndParam(param)) {
      (void)RestoreStepStarts(*scheduler_, *job);
      return;
    }
    if (job->broken()) return;
    job->AddComputeSeconds(param, compute_seconds);
    const bool skip = nonfinite && options_.skip_nonfinite;
    // The step fails for the whole job: every rank's stream ends with it.
    auto fail = [&](const absl::Status& why) {
      job->mu().AssertHeld();
      job->Break();
      for (auto& s : job->ranks()) {
        if (!s) continue;
        const auto& sink = s->state(*job).sink;
        if (!sink) continue;
        sink->Send(ErrorResponse(step, param, info.name, why, false));
        sink->Abort(why);
      }
      CountError(why);
    };
    if (!status.ok() && !skip) return fail(status);
    // Every host region's update first (GPU regions: the executor wrote it,
    // zeros when skipped), before anything is announced: a segment its
    // client shrank fails the step (DATA_LOSS naming the rank and segment).
    std::vector<float> zeros, local;
    for (auto& s : job->ranks()) {
      if (absent) break;  // no update: the slot is left as it was
      if (!s || s->region()->device()) continue;
      const ShardMap& held = s->shards()[param];
      const int64_t n = held.elements();
      if (n == 0) continue;  // holds nothing (SHARDING_BLOCKS)
      if (skip && zeros.size() < static_cast<size_t>(n)) zeros.assign(n, 0.0f);
      const float* work = job->param(param).work.data();
      const float* in = skip ? zeros.data() : work + held.offset(info.shape);
      if (!skip && !held.Contiguous(info.shape)) {
        local.resize(n);
        GatherFromMatrix(held, info.shape, work, local.data());
        in = local.data();
      }
      if (auto e = WriteUpdate(*s, param, in, n); !e.ok()) {
        return fail(absl::Status(
            e.code(),
            absl::StrCat("the update of parameter '", info.name, "' at step ",
                         step, " cannot be delivered: ", e.message())));
      }
    }
    for (auto& s : job->ranks()) {
      if (!s) continue;
      SessionState& st = s->state(*job);
      const int64_t n = absent ? 0 : s->shards()[param].elements();
      // Inline: the update goes out in chunks from the (heap) region.
      const float* out = s->transport() == v1::TRANSPORT_INLINE
                             ? UpdateOf(*s, param)
                             : nullptr;
      st.bytes_out += n * sizeof(float);
      if (metrics_ && n > 0) metrics_->BytesSent(n * sizeof(float));
      if (!st.sink) continue;
      if (skip)
        st.sink->Send(ErrorResponse(step, param, info.name, status, true));
      if (s->transport() == v1::TRANSPORT_INLINE && !absent) {
        const uint64_t bytes = n * sizeof(float);
        const char* base = reinterpret_cast<const char*>(out);
        for (const auto& c : transport::SplitChunks(
                 bytes,
                 transport::MaxChunkPayload(options_.max_message_bytes))) {
          v1::StepResponse r;
          auto* u = r.mutable_update();
          u->set_step(step);
          u->set_param_id(param);
          u->set_offset(c.offset);
          u->set_data(base + c.offset, c.bytes);
          st.sink->Send(std::move(r));
        }
      }
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
      if (s->region()->moves_data()) {
        // nccl: UpdatesReady once the send is posted (the client posts the
        // matching receive when it reads it), StepComplete after the last,
        // and on a durable step only once its snapshot is written too (as
        // `acks` below).
        std::shared_ptr<AckGate> gate;
        if (last) {
          gate = std::make_shared<AckGate>(
              durable ? 2 : 1, [sink = st.sink, done] { sink->Send(done); });
          if (durable) gates.push_back(gate);
        }
        // An absent parameter: an empty push (nothing to send), in its
        // place among the others (transport.h Region::Absent).
        s->region()->Push(
            step, absent ? std::vector<int>() : std::vector<int>{param},
            [this, job, sink = st.sink, ready, gate](absl::Status e) {
              if (!e.ok()) return TransferFailed(job, e);
              sink->Send(ready);
              if (gate) gate->Done();
            });
      } else {
        st.sink->Send(std::move(ready));
        if (last && durable) {
          acks.emplace_back(st.sink, std::move(done));
        } else if (last) {
          st.sink->Send(std::move(done));
        }
      }
      if (last) {
        RecordLatency(std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - st.step_t0)
                          .count());
        st.step = step + 1;
        st.delivered = 0;
        st.step_started = false;
        std::fill(st.declared.begin(), st.declared.end(), 0);
        std::fill(st.received.begin(), st.received.end(), 0);
      }
    }
    if (job->FinishParam(step)) {
      // Nothing of the next step can have started: every rank's step ends
      // in this critical section, so the state copied here is consistent.
      if (snapshots_.enabled() && options_.snapshot_every > 0 &&
          job->completed_steps() % options_.snapshot_every == 0) {
        if (auto bytes = SnapshotBytes(*scheduler_, *job); bytes.ok()) {
          snapshot = *std::move(bytes);
          snapshot_steps = job->completed_steps();
        } else {
          CountError(bytes.status());
        }
      }
    }
  }
  if (!snapshot.empty()) {
    if (auto st = snapshots_.Write(job->id(), job->serial(), snapshot_steps,
                                   snapshot);
        !st.ok())
      CountError(st);
  }
  for (auto& [sink, done] : acks) sink->Send(std::move(done));
  for (auto& gate : gates) gate->Done();
}

}  // namespace dmuon::server
