// ParamWork (param_work.h): gathering the gradients of a parameter's step.

#include "server/param_work.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cost_model.h"
#include "kernels/finite.h"
#include "server/job_state.h"
#include "server/step_pipeline.h"
#include "server/step_trace.h"

namespace dmuon::server {
namespace {

// Host regions are read only through Region::Read, never through their
// mapping: a client may shrink its shm segment at any moment, and a touch
// past its new end would be SIGBUS for the whole daemon; the copy fails
// with DATA_LOSS naming the segment instead.
absl::Status ReadGradient(const Session& s, int param, int64_t elements,
                          float* out) {
  absl::Status st = s.region()->Read(s.layout().slots[param].gradient_offset,
                                     out, elements * sizeof(float));
  if (st.ok()) return st;
  return absl::Status(st.code(),
                      absl::StrCat("rank ", s.rank(), ": ", st.message()));
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

// Host regions: the whole gradient of `param` into p.work, as its sharding
// says (rows gathered, blocks from the lowest rank holding each element,
// the mean in rank order, or rank 0's).
absl::Status GatherHost(const ParamInfo& info,
                        const std::vector<std::shared_ptr<Session>>& ranks,
                        int param, ParamState& p) {
  const int64_t n = info.shape.elements();
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
  return absl::OkStatus();
}

}  // namespace

ParamWork::ParamWork(StepPipeline& pipeline, std::shared_ptr<Job> job,
                     int param, int64_t step)
    : pipeline(pipeline), job(std::move(job)), param(param), step(step) {}

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
  TraceRecorder* trace = pipeline.trace();
  if (!Tracing(trace)) return Gather();
  const int64_t t0 = TraceNowNs();
  absl::StatusOr<ComputeTask> t = Gather();
  TraceStage(trace, *job, param, step, "gather", t0, TraceNowNs(),
             {{"ok", t.ok() ? 1 : 0}});
  return t;
}

void ParamWork::Ran(const BatchRun& run) {
  TraceRecorder* trace = pipeline.trace();
  if (!Tracing(trace)) return;
  trace->NameThread(absl::StrCat("executor ", run.executor));
  TraceStage(trace, *job, param, step, "ns", run.start_ns, run.end_ns,
             {{"executor", run.executor},
              {"batch", static_cast<int64_t>(run.batch)},
              {"batch_size", run.size}});
}

absl::StatusOr<ComputeTask> ParamWork::Gather() {
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
    // The executor holds the momentum; the host copy, if any, is its
    // initial value (ComputeTask::momentum).
    t.momentum = p.momentum.empty() ? nullptr : p.momentum.data();
    io = DeviceIoOf(ranks, param, info.sharding, p.absent);
    sessions = ranks;
    t.device_io = &io;
    t.nonfinite = &nonfinite;
    // Executors that keep a step-start copy take it in this Compute (job.h).
    job->SaveStepStart(param);
    return t;
  }
  const int64_t cols = info.shape.cols, n = info.shape.elements();
  if (auto st = GatherHost(info, ranks, param, p); !st.ok()) return st;
  if (const int64_t i = kernels::FirstNonFinite(p.work.data(), n); i >= 0) {
    nonfinite = true;
    return absl::InvalidArgumentError(kernels::NonFiniteMessage(
        absl::StrCat("gradient of parameter '", info.name, "' at step ", step),
        p.work[i], i, cols));
  }
  // The momentum as of the last completed step, kept until this step
  // completes: what a rollback or a mid-step snapshot needs (job.h). It
  // stays in step_start, which the step reads; the new momentum goes to the
  // other buffer.
  job->SaveStepStart(param);
  t.momentum = p.momentum.data();
  t.momentum_in = p.step_start.data();
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
  const bool traced = Tracing(pipeline.trace());
  const int64_t t0 = traced ? TraceNowNs() : 0;
  pipeline.Deliver(job, param, step, status, nonfinite, compute_seconds);
  if (traced) {
    TraceStage(pipeline.trace(), *job, param, step, "return", t0, TraceNowNs());
  }
  // The executor is done with the regions: a closed rank's may go now.
  sessions.clear();
}

}  // namespace dmuon::server
