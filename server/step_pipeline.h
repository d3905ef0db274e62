// Internal to the service: a step's path through the daemon.
//
//   Step stream message ─▶ OnRequest ─┬─ gradient chunk ─▶ OnGradientChunk
//                                     ├─ gradients_ready ▶ OnGradientsReady
//                                     │     (checks: step_checks.h; each
//                                     │      parameter arrives, Job::Arrive,
//                                     │      or is pulled: PullDone)
//                                     └─ rewind ─────────▶ OnRewind
//   parameters that may run ─▶ Submit ─▶ scheduler (ParamWork, param_work.h)
//   a parameter's step ended ─▶ Deliver ─┬─ Fail (the job breaks)
//                                        ├─ WriteHostUpdates
//                                        └─ Acknowledge (per rank), then the
//                                           snapshot and the held acks
//
// One StepPipeline per service, alive as long as it. It has no lock of its
// own: every transition takes the job's lock (job.h) and never the
// service's, so steps of different jobs never wait for each other here. The
// service finds the session and its job and hands the message over; nothing
// here knows gRPC, sessions by id, or the service.

#ifndef DMUON_SERVER_STEP_PIPELINE_H_
#define DMUON_SERVER_STEP_PIPELINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "base/trace.h"
#include "proto/dmuon.pb.h"
#include "server/ack_gate.h"
#include "server/fallbacks.h"
#include "server/job.h"
#include "server/scheduler.h"
#include "server/service_metrics.h"
#include "server/snapshot_store.h"
#include "server/step_stats.h"

namespace dmuon::server {

// What the pipeline uses of the daemon; every pointer outlives it.
struct PipelineContext {
  bool skip_nonfinite = true;      // ServiceOptions::skip_nonfinite
  uint64_t max_message_bytes = 0;  // inline updates go in chunks of it
  int snapshot_every = 0;          // ServiceOptions::snapshot_every
  Scheduler* scheduler = nullptr;  // runs the parameters' steps
  SnapshotStore* snapshots = nullptr;
  ServiceMetrics* metrics = nullptr;     // never null (NoServiceMetrics)
  StepStats* stats = nullptr;            // latencies and errors by code
  FallbackCounter* fallbacks = nullptr;  // rewinds counted (fallbacks.h)
  // The step timeline (step_trace.h); null: none. Records only while it is
  // started (--trace-file, or a Trace RPC's window).
  TraceRecorder* trace = nullptr;
};

class StepPipeline {
 public:
  explicit StepPipeline(PipelineContext ctx) : ctx_(ctx) {}
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  // One message of `s`'s Step stream (`job`: its job). An error ends that
  // stream and nothing of the message has been applied. `draining`: the
  // daemon starts no new step (one some rank started still finishes).
  absl::Status OnRequest(const std::shared_ptr<Session>& s,
                         const std::shared_ptr<Job>& job,
                         const v1::StepRequest& req, bool draining);
  // Submits the step of each of `params` of `job` (Job::Arrive said they
  // run) to the scheduler at once, without the job's lock; while a
  // GetState reads the job they wait for it instead (Job::Defer).
  void Submit(const std::shared_ptr<Job>& job, int64_t step,
              const std::vector<int>& params);
  // A parameter's step ended with `status`: its update goes to every rank
  // (or the job breaks). `compute_seconds`: its Executor::Compute time this
  // step (Work::Computed), counted in the job's measured load. `absent`:
  // every rank declared it absent (Job::Arrival::kAbsent): nothing was
  // computed, no update is written, and each rank's UpdatesReady lists it
  // in absent_param_ids. Takes the job's lock.
  void Deliver(const std::shared_ptr<Job>& job, int param, int64_t step,
               absl::Status status, bool nonfinite, double compute_seconds,
               bool absent = false);
  // Counts a failure by its code (stats and metrics).
  void CountError(const absl::Status& st) const;
  // PipelineContext::trace (ParamWork records its stages there).
  TraceRecorder* trace() const { return ctx_.trace; }

 private:
  // What a Deliver does once the job's lock is released: the snapshot a
  // completed step takes, and the acknowledgements that wait for it.
  struct Acks {
    bool durable = false;  // this step is snapshotted before it is acked
    std::vector<std::pair<std::shared_ptr<StepSink>, v1::StepResponse>> held;
    // nccl ranks' step_complete of a durable step: sent once the last
    // update send is posted and the snapshot is written.
    std::vector<std::shared_ptr<AckGate>> gates;
    // Made with `durable`: why the step's snapshot failed (empty: it did
    // not; StepComplete.not_durable), set before the held acks are sent and
    // before the gates' snapshot wait is done.
    std::shared_ptr<std::string> not_durable;
    std::string snapshot;  // empty: none
    int64_t snapshot_steps = 0;
  };

  absl::Status OnGradientChunk(Session& s, Job& job, SessionState& st,
                               const v1::TensorChunk& c)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
  // Checks the declaration whole, then lets each parameter arrive: those
  // that may run go to `ready`, those absent on every rank to `absent`.
  absl::Status OnGradientsReady(const std::shared_ptr<Session>& s,
                                const std::shared_ptr<Job>& job,
                                SessionState& st, const v1::GradientsReady& g,
                                std::vector<int>* ready,
                                std::vector<int>* absent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job->mu());
  absl::Status OnRewind(Session& s, Job& job, const v1::Rewind& r,
                        bool draining) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
  // Transports that move data (nccl; transport.h Region::Pull/Push), from
  // their own thread: gradients landed (the parameters arrive) or a
  // transfer failed (the job breaks, its streams end). Never holds a
  // Session itself: the last reference to one must not drop on a
  // transport's thread, whose region it would then destroy.
  void PullDone(const std::shared_ptr<Job>& job,
                const std::weak_ptr<Session>& session, int64_t step,
                const std::vector<int>& ids, const absl::Status& status);
  void TransferFailed(const std::shared_ptr<Job>& job,
                      const absl::Status& status);

  // Deliver's parts, under the job's lock.
  // The step fails for the whole job: every rank's stream ends with `why`.
  void Fail(Job& job, int param, int64_t step, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
  // Every host region's update (GPU regions: the executor wrote it), before
  // anything is announced; zeros when `skip`. A segment its client shrank
  // is DATA_LOSS naming the rank and segment.
  absl::Status WriteHostUpdates(Job& job, int param, int64_t step, bool skip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu());
  // Tells rank `s` its update is ready (inline: sends it), and that its
  // step is complete after its last parameter, now or through `acks`.
  void Acknowledge(const std::shared_ptr<Job>& job, Session& s, int param,
                   int64_t step, const absl::Status& status, bool skip,
                   bool absent, Acks& acks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job->mu());
  // Announces rank `s`'s update of `param` at `step`: its doorbell's update
  // word when its region has one (transport/doorbell.h), else `ready` on
  // its stream. A doorbell store that fails (the client shrank the
  // segment: DATA_LOSS) ends the rank's stream with that error.
  void Announce(Session& s, SessionState& st, int param, int64_t step,
                bool skip, bool absent, v1::StepResponse ready) const;
  // An inline rank's update of `param`, in chunks of the message limit.
  void SendUpdateChunks(Session& s, int param, int64_t step, int64_t elements,
                        StepSink& sink) const;

  const PipelineContext ctx_;
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_PIPELINE_H_
