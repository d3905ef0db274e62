// GetState and SetState as whole streams in one call, for tests and fuzzers:
// the service's own entry points are the streaming ReadState and WriteState
// (server/service.h), which the daemon's gRPC adapter drives chunk by chunk.

#ifndef DMUON_SERVER_TESTING_STATE_STREAMS_H_
#define DMUON_SERVER_TESTING_STATE_STREAMS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/dmuon.pb.h"
#include "server/principal.h"
#include "server/service.h"

namespace dmuon::server::testing {

// The whole GetState stream: ReadState, drained.
inline absl::StatusOr<std::vector<v1::StateChunk>> GetState(
    OptimizerService& svc, const std::string& session_id,
    const Principal& who = {}) {
  auto reader = svc.ReadState(session_id, who);
  if (!reader.ok()) return reader.status();
  std::vector<v1::StateChunk> out;
  for (;;) {
    auto c = (*reader)->Next();
    if (!c.ok()) return c.status();
    if (!c->has_value()) return out;
    out.push_back(**std::move(c));
  }
}

// The whole SetState stream: WriteState with the first chunk (the header),
// Add each other one, Commit; returns the job's completed steps.
inline absl::StatusOr<int64_t> SetState(
    OptimizerService& svc, const std::vector<v1::StateChunk>& chunks,
    const Principal& who = {}) {
  if (chunks.empty()) {
    return absl::InvalidArgumentError(
        "SetState: the first message must carry the header");
  }
  auto w = svc.WriteState(chunks[0], who);
  if (!w.ok()) return w.status();
  for (size_t k = 1; k < chunks.size(); ++k) {
    if (auto st = (*w)->Add(chunks[k]); !st.ok()) return st;
  }
  return (*w)->Commit();
}

}  // namespace dmuon::server::testing

#endif  // DMUON_SERVER_TESTING_STATE_STREAMS_H_
