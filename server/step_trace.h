// Internal: what the step pipeline records in the step timeline
// (docs/design.md, "Tracing"), one event per stage of a matrix's step:
//
//   received  instant, the Step stream's thread: rank `rank` declared its
//             gradient (GradientsReady; nccl: its transfer landed)
//   queued    instant, the thread that submitted it: every rank's gradient
//             is in, the matrix waits on executor `executor`'s queue
//   gather    complete, the executor's worker: Prepare (the gradient read
//             from the ranks' regions, checked finite)
//   ns        complete, the executor's worker: the batched Executor::Compute
//             it ran in (momentum, Newton-Schulz, scale), `batch` and
//             `batch_size` naming the batch (same span for its matrices)
//   return    complete, the executor's worker: the update written to every
//             rank's region and UpdatesReady sent (StepPipeline::Deliver)
//
// Every event is named "<stage> <parameter name>" and carries args `stage`,
// `job`, `step`, `param` (the table index), `name` and `shape` ("RxC"), which
// the trainer's events carry too (dmuon/_trace.py): the merge
// (python -m dmuon.trace merge) links a matrix's events across processes by
// (job, step, name). Each function returns at once when `trace` is null or
// not recording.

#ifndef DMUON_SERVER_STEP_TRACE_H_
#define DMUON_SERVER_STEP_TRACE_H_

#include <cstdint>
#include <initializer_list>

#include "base/trace.h"
#include "server/job.h"

namespace dmuon::server {

inline bool Tracing(const TraceRecorder* trace) {
  return trace != nullptr && trace->enabled();
}

// A complete event [start_ns, end_ns] of `stage` of `param`'s step `step`.
void TraceStage(TraceRecorder* trace, const Job& job, int param, int64_t step,
                const char* stage, int64_t start_ns, int64_t end_ns,
                std::initializer_list<TraceArg> extra = {});
// An instant event of `stage` now.
void TraceStageNow(TraceRecorder* trace, const Job& job, int param,
                   int64_t step, const char* stage,
                   std::initializer_list<TraceArg> extra = {});

}  // namespace dmuon::server

#endif  // DMUON_SERVER_STEP_TRACE_H_
