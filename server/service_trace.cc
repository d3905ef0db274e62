// OptimizerService::CaptureTrace (service.h): a window of the step
// timeline, for the Trace RPC (dmuonctl trace).

#include <unistd.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/service.h"

namespace dmuon::server {

absl::StatusOr<std::string> OptimizerService::CaptureTrace(
    double seconds, const std::function<bool()>& cancelled) {
  if (!(seconds > 0 && seconds <= kMaxTraceSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat("TraceRequest.seconds must be in (0, ", kMaxTraceSeconds,
                     "], got ", seconds));
  }
  TraceRecorder* trace = options_.trace;
  if (trace == nullptr) {
    return absl::FailedPreconditionError(
        "this dmuond records no step timeline");
  }
  (void)trace->TakeEvents();  // stragglers of an earlier window
  if (!trace->TryStart()) {
    return absl::FailedPreconditionError(
        "dmuond is recording its step timeline already (--trace-file: read "
        "that file; or another Trace call: try again after it)");
  }
  const auto end =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(seconds));
  bool gone = false;
  while (std::chrono::steady_clock::now() < end && !(gone = cancelled())) {
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        end - std::chrono::steady_clock::now(), std::chrono::milliseconds(50)));
  }
  trace->Stop();
  std::string file = trace->TakeFileJson(getpid());
  if (gone) return absl::CancelledError("the Trace caller went away");
  return file;
}

}  // namespace dmuon::server
