// The daemon side of the GPU transports (cuda_ipc, nccl) as the service sees
// them. A CUDA daemon (dmuond_cuda) passes an implementation in
// ServiceOptions (server/cuda/cuda_transports.cc); a CPU daemon has none and
// answers UNIMPLEMENTED for those transports. No CUDA type appears here.
//
// Open returns a Region whose device() view holds the session's tensors in
// GPU memory, laid out by `layout`: the client's own memory for cuda_ipc
// (mapped and validated), daemon memory filled by NCCL transfers (Pull/Push)
// for nccl. Every rank of a job must use GPU transports or none.

#ifndef DMUON_SERVER_DEVICE_TRANSPORT_H_
#define DMUON_SERVER_DEVICE_TRANSPORT_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "proto/dmuon.pb.h"
#include "transport/transport.h"

namespace dmuon::server {

class DeviceTransports {
 public:
  virtual ~DeviceTransports() = default;
  virtual bool Supports(v1::Transport t) const = 0;
  // Opens the daemon side of rank req.rank()'s session of job serial
  // `job_serial`, filling the transport's fields of `resp` (nccl: the
  // communicator's unique id). Errors name what the client must fix.
  virtual absl::StatusOr<std::unique_ptr<transport::Region>> Open(
      uint64_t job_serial, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) = 0;
  // The job is gone: release what it held (nccl: its communicator).
  virtual void DropJob(uint64_t job_serial) {}
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_DEVICE_TRANSPORT_H_
