// The trainer's side of the client's nccl transport (client/client.h
// kNccl), for C++ trainers: the NCCL calls the client library leaves to its
// caller, in the order transport/nccl.h prescribes.
//
//   auto s = gpu::OpenNcclSession(*client, spec);  // region, session, joins
//                                                  // and warms up
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
#include "client/cuda/nccl_order.h"

namespace dmuon::gpu {

// One trainer rank's membership of a job's NCCL communicator. Its calls
// enqueue work on `stream` (a cudaStream_t; null: the legacy default
// stream) and return without waiting for it. Thread-compatible.
class NcclPeer {
 public:
  // Joins the communicator of `info` (Session::nccl()) as NCCL rank `rank`
  // on the current CUDA device and posts the warm-up on `stream` (its first
  // group: transport/nccl.h); returns once every rank and the daemon have
  // joined and the daemon has posted its side of the warm-up, so that every
  // later group end returns without waiting for the daemon.
  static absl::StatusOr<std::unique_ptr<NcclPeer>> Join(const NcclInfo& info,
                                                        int rank,
                                                        void* stream = nullptr);
  // Aborts the communicator (the daemon's side is gone by then), then frees
  // the warm-up's memory.
  ~NcclPeer();
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
  // The groups over NCCL.
  class Groups final : public NcclGroups {
   public:
    explicit Groups(void* comm) : comm_(comm) {}
    absl::Status Group(const std::vector<transport::NcclTransfer>& transfers,
                       void* stream) override;
    void* comm() const { return comm_; }

   private:
    void* comm_;  // ncclComm_t
  };
  NcclPeer(void* comm, int daemon_rank, void* scratch)
      : groups_(comm), order_(groups_, daemon_rank), scratch_(scratch) {}
  Groups groups_;
  NcclOrder order_;
  void* scratch_;  // kNcclTrainerWarmUpBytes of device memory
};

// A kNccl session, its region and its communicator. Members are destroyed
// session first, then the communicator, then the memory.
struct NcclSession {
  std::unique_ptr<DeviceRegion> region;
  std::unique_ptr<NcclPeer> peer;
  std::unique_ptr<Session> session;
};

// Lays out `spec`, allocates its region on the current device, opens the
// session over kNccl and joins the communicator with its warm-up on the
// legacy default stream (blocking until every rank of the job has opened
// and joined, and the daemon has posted its warm-up).
absl::StatusOr<NcclSession> OpenNcclSession(Client& client, SessionSpec spec);

}  // namespace dmuon::gpu

#endif  // DMUON_CLIENT_CUDA_NCCL_PEER_H_
