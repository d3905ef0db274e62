// Session's implementation (internal to //client): one session on one
// daemon, its Step stream read by a thread of its own.

#ifndef DMUON_CLIENT_SESSION_H_
#define DMUON_CLIENT_SESSION_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "proto/dmuon.pb.h"
#include "transport/transport.h"

namespace dmuon::client_internal {

// The session the daemon at `address` opened (`open`), attached to its Step
// stream. `region`: host memory (shm, inline); null for GPU transports.
// `layout`: the region's (or the caller's GPU memory's) layout.
absl::StatusOr<std::unique_ptr<Session>> StartSession(
    std::shared_ptr<grpc::Channel> channel, std::string address,
    ClientOptions options, v1::OpenSessionResponse open,
    std::unique_ptr<transport::Region> region, RegionLayout layout,
    NcclInfo nccl);

}  // namespace dmuon::client_internal

#endif  // DMUON_CLIENT_SESSION_H_
