// The trainer's side of the nccl transport's order (transport/nccl.h, its
// header comment), in plain C++ over an abstract blocking communicator: built
// and tested without CUDA (tests/gpu_transport_test.cc runs it against the
// daemon's side over transport/testing/fake_nccl.h). NcclPeer (nccl_peer.h)
// is this over NCCL.
//
//   right after joining: WarmUp (the communicator's first group);
//   per GradientsReady: HandOver (one send group, then the message);
//   once every gradient of the step is declared: ReceiveAnnounced (one
//     receive group per announcement, in order).

#ifndef DMUON_CLIENT_CUDA_NCCL_ORDER_H_
#define DMUON_CLIENT_CUDA_NCCL_ORDER_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "transport/nccl.h"

namespace dmuon::gpu {

// A trainer rank's blocking communicator as the order drives it.
class NcclGroups {
 public:
  virtual ~NcclGroups() = default;
  // ncclGroupStart; per transfer, in order, ncclSend or ncclRecv of
  // `bytes / 4` fp32 at base + offset to or from `peer`, on `stream` (a
  // cudaStream_t; null: the legacy default stream); ncclGroupEnd. Returns
  // when ncclGroupEnd does (a blocking communicator: once the group's
  // connections exist; the transfers complete later on the stream).
  virtual absl::Status Group(
      const std::vector<transport::NcclTransfer>& transfers, void* stream) = 0;
};

// Bytes of the trainer's warm-up scratch memory: a send slot, then a receive
// slot, of transport::kNcclWarmUpBytes each.
inline constexpr size_t kNcclTrainerWarmUpBytes =
    2 * transport::kNcclWarmUpBytes;

// The order over one trainer rank's communicator whose daemon is NCCL rank
// `daemon_rank`. The region is `layout` at `base` (device memory).
// Thread-compatible.
class NcclOrder {
 public:
  NcclOrder(NcclGroups& groups, int daemon_rank)
      : groups_(groups), daemon_rank_(daemon_rank) {}

  // The warm-up: one group {send of kNcclWarmUpBytes from scratch, receive
  // of kNcclWarmUpBytes into scratch + kNcclWarmUpBytes} with the daemon.
  // The communicator's first group, right after joining; `scratch`
  // (kNcclTrainerWarmUpBytes of device memory) must stay valid until the
  // stream has run it.
  absl::Status WarmUp(std::byte* scratch, void* stream);
  // One group of sends of `ids`' gradient slots, in order (slots of 0 bytes
  // move nothing: the daemon posts none either). INVALID_ARGUMENT for an
  // index outside the layout, before any call.
  absl::Status SendGradients(const RegionLayout& layout, std::byte* base,
                             absl::Span<const int> ids, void* stream);
  // One group of receives of `ids`' update slots, in order (as above).
  absl::Status ReceiveUpdates(const RegionLayout& layout, std::byte* base,
                              absl::Span<const int> ids, void* stream);
  // The hand-over rule: SendGradients(ids), then session.GradientsReady(ids).
  absl::Status HandOver(Session& session, const RegionLayout& layout,
                        std::byte* base, absl::Span<const int> ids,
                        void* stream);
  // After every gradient of the step is declared: one ReceiveUpdates per
  // Session::NextAnnounced() vector, in order, until it returns none.
  absl::Status ReceiveAnnounced(Session& session, const RegionLayout& layout,
                                std::byte* base, void* stream);

 private:
  absl::Status Slots(const RegionLayout& layout, std::byte* base,
                     absl::Span<const int> ids, bool send, void* stream);
  NcclGroups& groups_;
  const int daemon_rank_;
};

}  // namespace dmuon::gpu

#endif  // DMUON_CLIENT_CUDA_NCCL_ORDER_H_
