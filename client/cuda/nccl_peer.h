// The trainer's side of the client's nccl transport (client/client.h
// kNccl), for C++ trainers: the NCCL calls the client library leaves to its
// caller, in the order transport/nccl.h prescribes.
//
//   auto s = gpu::OpenNcclSession(*client, spec);  // region, session, joins
//   per step: write gradients into s->region->gradient(i) on `stream`, then
//     s->peer->HandOver(*s->session, *s->region, ids, stream);   // per group
//     (every gradient of the step declared, then)
//     s->peer->ReceiveAnnounced(*s->session, *s->region, stream);
//     s->session->FinishStep();  cudaStreamSynchronize(stream); read updates
//
// One communicator per job: NCCL refuses two ranks of one communicator on
// one GPU, so the trainer's GPU must not be the daemon's for the job.

#ifndef DMUON_CLIENT_CUDA_NCCL_PEER_H_
#define DMUON_CLIENT_CUDA_NCCL_PEER_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/cuda/device_region.h"

namespace dmuon::gpu {

// One trainer rank's membership of a job's NCCL communicator. Its calls
// enqueue work on `stream` (a cudaStream_t; null: the legacy default
// stream) and return without waiting for it. Thread-compatible.
class NcclPeer {
 public:
  // Joins the communicator of `info` (Session::nccl()) as NCCL rank `rank`
  // on the current CUDA device; returns once every rank and the daemon have
  // joined.
  static absl::StatusOr<std::unique_ptr<NcclPeer>> Join(const NcclInfo& info,
                                                        int rank);
  ~NcclPeer();  // aborts the communicator (the daemon's side is gone by then)
  NcclPeer(const NcclPeer&) = delete;
  NcclPeer& operator=(const NcclPeer&) = delete;

  // One group of ncclSend of `ids`' gradient slots to the daemon, in order.
  absl::Status SendGradients(const DeviceRegion& region,
                             absl::Span<const int> ids, void* stream = nullptr);
  // One group of ncclRecv of `ids`' update slots from the daemon, in order.
  absl::Status ReceiveUpdates(const DeviceRegion& region,
                              absl::Span<const int> ids,
                              void* stream = nullptr);

  // The hand-over rule: SendGradients(ids), then session.GradientsReady(ids).
  absl::Status HandOver(Session& session, const DeviceRegion& region,
                        absl::Span<const int> ids, void* stream = nullptr);
  // After every gradient of the step is declared: one ReceiveUpdates per
  // Session::NextAnnounced() vector, in order, until it returns none. The
  // updates are in the region once `stream` has caught up.
  absl::Status ReceiveAnnounced(Session& session, const DeviceRegion& region,
                                void* stream = nullptr);

 private:
  NcclPeer(void* comm, int daemon_rank)
      : comm_(comm), daemon_rank_(daemon_rank) {}
  absl::Status Group(const DeviceRegion& region, absl::Span<const int> ids,
                     bool send, void* stream);
  void* comm_;  // ncclComm_t
  const int daemon_rank_;
};

// A kNccl session, its region and its communicator. Members are destroyed
// session first, then the communicator, then the memory.
struct NcclSession {
  std::unique_ptr<DeviceRegion> region;
  std::unique_ptr<NcclPeer> peer;
  std::unique_ptr<Session> session;
};

// Lays out `spec`, allocates its region on the current device, opens the
// session over kNccl and joins the communicator (blocking until every rank
// of the job has opened and joined).
absl::StatusOr<NcclSession> OpenNcclSession(Client& client, SessionSpec spec);

}  // namespace dmuon::gpu

#endif  // DMUON_CLIENT_CUDA_NCCL_PEER_H_
