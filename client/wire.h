// The client's side of the wire (internal to //client): proto <-> client
// types, gRPC status -> absl::Status, and the one way a client error names
// the daemon it came from.

#ifndef DMUON_CLIENT_WIRE_H_
#define DMUON_CLIENT_WIRE_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "proto/dmuon.pb.h"

namespace dmuon::client_internal {

// `status` with the daemon named in front of its message:
// "dmuond at <address>: <doing>: <message>", or without "<doing>: " when
// `doing` is empty. OK stays OK. Messages that are a sentence about the
// daemon ("... not back from dmuond at <address> within ...") name it in
// their own words instead.
absl::Status WithAddress(const absl::Status& status, absl::string_view address,
                         absl::string_view doing = "");

// A gRPC status as an absl::Status; UNAVAILABLE and DEADLINE_EXCEEDED
// (the daemon is gone or slow) name the daemon (WithAddress).
absl::Status FromGrpc(const grpc::Status& st, const std::string& address);

// The name a user writes ("cuda_ipc"), for messages and Session::transport().
std::string TransportName(v1::Transport t);

RegionLayout FromProto(const v1::RegionLayout& p);

// INTERNAL when the daemon's layout is not the one the client computed (a
// GPU caller sized and exported its memory by the latter).
absl::Status CheckLayout(const RegionLayout& want, const RegionLayout& got,
                         const std::string& address);

// The OpenSession request for `spec` over transport `t`.
v1::OpenSessionRequest ToRequest(const SessionSpec& spec, v1::Transport t);

// The protocol minor a daemon must speak to honour `req` (base/protocol.h):
// 3 when a parameter is SHARDING_BLOCKS, else 1 when it asks for a Resume,
// else 0.
uint32_t RequiredMinor(const v1::OpenSessionRequest& req);

// FAILED_PRECONDITION naming both versions when the daemon that answered
// `resp` speaks a minor older than RequiredMinor(req); OK otherwise.
absl::Status CheckDaemonMinor(const v1::OpenSessionRequest& req,
                              const v1::OpenSessionResponse& resp,
                              const std::string& address);

// The protocol minor Session::Mark needs (base/protocol.h: 5).
inline constexpr uint32_t kMarkMinor = 5;

// FAILED_PRECONDITION naming both versions when the daemon that answered
// `open` speaks a minor older than `need`, the minor `feature` (what the
// caller asked for, in words) needs; OK otherwise.
absl::Status CheckFeatureMinor(const v1::OpenSessionResponse& open,
                               uint32_t need, absl::string_view feature,
                               const std::string& address);

// `status` (OpenSession's error) with what to do when it is a daemon older
// than RequiredMinor(req) refusing a feature it does not know (a
// SHARDING_BLOCKS parameter: "sharding 4 is unknown"); else `status`.
absl::Status ExplainOpenError(const v1::OpenSessionRequest& req,
                              const absl::Status& status);

}  // namespace dmuon::client_internal

#endif  // DMUON_CLIENT_WIRE_H_
