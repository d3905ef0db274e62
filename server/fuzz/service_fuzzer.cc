// Fuzzes the service's request handlers with sequences of requests, as a
// hostile or broken client could send them through the gRPC adapter:
// OpenSession tables, Step stream messages (gradients_ready, gradient
// chunks) in any order, GetState, SetState chunk streams, Detach, Close,
// Status, idle-job reaping and Mark (resuming at a mark: an OpenSession's
// resume_step), on the real OptimizerService with a
// FastExecutor (no Newton–Schulz). Any crash, sanitizer report or leak is a
// bug; errors are expected and ignored.
//
// Input: records of [op: 1 byte][length: 2 bytes LE][payload], parsed with
// protobuf where the op takes a message (see Op). A session operand is the
// payload's first byte modulo the sessions opened so far.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "proto/dmuon.pb.h"
#include "server/fuzz/fuzz_support.h"
#include "server/service.h"
#include "server/testing/state_streams.h"

namespace dmuon::server::fuzz {
namespace {

enum Op : uint8_t {
  kOpen = 0,        // payload: OpenSessionRequest
  kAttach = 1,      // payload[0]: session
  kStep = 2,        // payload[0]: session, then a StepRequest
  kGetState = 3,    // payload[0]: session
  kStateChunk = 4,  // payload: StateChunk, appended to the pending SetState
                    // (an empty session_id: the last session opened, since
                    // session ids are secrets an input cannot know)
  kSetState = 5,    // SetState of the pending chunks
  kDetach = 6,      // payload[0]: session
  kClose = 7,       // payload[0]: session
  kStatus = 8,
  kReap = 9,   // ReapIdleJobs as if an hour had passed
  kMark = 10,  // payload[0]: session, payload[1] (if any): the step
  kOps = 11,
};

class NullSink final : public StepSink {
 public:
  void Send(v1::StepResponse) override {}
  void Abort(absl::Status) override {}
};

// Small limits so that the fuzzer explores logic rather than allocations.
ServiceOptions Options() {
  ServiceOptions o;
  o.max_sessions = 8;
  o.max_message_bytes = 1 << 20;
  o.job_retention_seconds = 0;
  o.max_state_bytes = 64 << 20;  // as dmuond always has one
  return o;
}

void Run(const uint8_t* data, size_t size) {
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::make_unique<FastExecutor>());
  ex.push_back(std::make_unique<FastExecutor>());
  OptimizerService svc(Options(), std::make_unique<Scheduler>(std::move(ex), 4),
                       /*metrics=*/nullptr);
  std::vector<std::string> sessions;
  std::vector<v1::StateChunk> pending;
  // By session: its job has several ranks (a rewind then waits for the
  // other ranks' asks, which this one thread would never send).
  std::vector<bool> several;
  auto session = [&](const uint8_t* p, size_t n) -> std::string {
    if (sessions.empty() || n == 0) return "no-such-session";
    return sessions[p[0] % sessions.size()];
  };
  size_t i = 0;
  while (i + 3 <= size) {
    const uint8_t op = data[i] % kOps;
    const size_t len =
        std::min<size_t>(data[i + 1] | (data[i + 2] << 8), size - i - 3);
    const uint8_t* p = data + i + 3;
    i += 3 + len;
    switch (op) {
      case kOpen: {
        v1::OpenSessionRequest req;
        if (!req.ParseFromArray(p, static_cast<int>(len))) break;
        auto r = svc.OpenSession(req);
        if (r.ok()) {
          sessions.push_back(r->session_id());
          several.push_back(req.world_size() > 1);
        }
        break;
      }
      case kAttach:
        (void)svc.Attach(session(p, len), std::make_shared<NullSink>());
        break;
      case kStep: {
        if (len == 0) break;
        v1::StepRequest req;
        if (!req.ParseFromArray(p + 1, static_cast<int>(len - 1))) break;
        if (req.has_rewind() && !sessions.empty() &&
            several[p[0] % sessions.size()])
          break;
        (void)svc.OnStepRequest(session(p, len), req);
        break;
      }
      case kGetState:
        (void)testing::GetState(svc, session(p, len));
        break;
      case kStateChunk: {
        v1::StateChunk c;
        if (c.ParseFromArray(p, static_cast<int>(len))) {
          if (c.session_id().empty() && !sessions.empty())
            c.set_session_id(sessions.back());
          pending.push_back(std::move(c));
        }
        break;
      }
      case kSetState:
        (void)testing::SetState(svc, pending);
        pending.clear();
        break;
      case kDetach:
        svc.Detach(session(p, len), absl::CancelledError("fuzz"));
        break;
      case kClose:
        (void)svc.CloseSession(session(p, len));
        break;
      case kStatus:
        (void)svc.Status();
        break;
      case kReap:
        (void)svc.ReapIdleJobs(std::chrono::steady_clock::now() +
                               std::chrono::hours(1));
        break;
      case kMark: {
        v1::MarkRequest req;
        req.set_session_id(session(p, len));
        req.set_step(len > 1 ? p[1] : 0);
        (void)svc.Mark(req);
        break;
      }
    }
  }
  for (const std::string& s : sessions) {
    svc.Detach(s, absl::CancelledError("fuzz: end of input"));
  }
}

}  // namespace
}  // namespace dmuon::server::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dmuon::server::fuzz::SilenceProtobufLogs();
  dmuon::server::fuzz::Run(data, size);
  return 0;
}
