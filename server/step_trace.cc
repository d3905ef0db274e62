// The step pipeline's timeline events (step_trace.h).

#include "server/step_trace.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::server {
namespace {

TraceEvent StageEvent(const Job& job, int param, int64_t step,
                      const char* stage,
                      std::initializer_list<TraceArg> extra) {
  const ParamInfo& info = job.table().params[param];
  TraceEvent e;
  e.name = absl::StrCat(stage, " ", info.name);
  e.category = "step";
  e.args.reserve(6 + extra.size());
  e.args.emplace_back("stage", stage);
  e.args.emplace_back("job", job.id());
  e.args.emplace_back("step", step);
  e.args.emplace_back("param", param);
  e.args.emplace_back("name", info.name);
  e.args.emplace_back("shape",
                      absl::StrCat(info.shape.rows, "x", info.shape.cols));
  e.args.insert(e.args.end(), extra.begin(), extra.end());
  return e;
}

}  // namespace

void TraceStage(TraceRecorder* trace, const Job& job, int param, int64_t step,
                const char* stage, int64_t start_ns, int64_t end_ns,
                std::initializer_list<TraceArg> extra) {
  if (!Tracing(trace)) return;
  TraceEvent e = StageEvent(job, param, step, stage, extra);
  e.ts_ns = start_ns;
  e.dur_ns = end_ns > start_ns ? end_ns - start_ns : 0;
  trace->Record(std::move(e));
}

void TraceStageNow(TraceRecorder* trace, const Job& job, int param,
                   int64_t step, const char* stage,
                   std::initializer_list<TraceArg> extra) {
  if (!Tracing(trace)) return;
  TraceEvent e = StageEvent(job, param, step, stage, extra);
  e.phase = 'i';
  e.ts_ns = TraceNowNs();
  trace->Record(std::move(e));
}

}  // namespace dmuon::server
