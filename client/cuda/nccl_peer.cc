// NcclPeer (nccl_peer.h): the trainer's NCCL calls.

#include "client/cuda/nccl_peer.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/nccl_check.h"

namespace dmuon::gpu {

absl::StatusOr<std::unique_ptr<NcclPeer>> NcclPeer::Join(const NcclInfo& info,
                                                         int rank) {
  ncclUniqueId id;
  if (info.unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclPeer: the unique id has ", info.unique_id.size(),
                     " bytes, NCCL's has ", sizeof(id.internal),
                     " (is this an nccl session?)"));
  }
  std::memcpy(id.internal, info.unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  DMUON_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, info.nranks, id, rank));
  return std::unique_ptr<NcclPeer>(new NcclPeer(comm, info.daemon_rank));
}

NcclPeer::~NcclPeer() {
  if (comm_ != nullptr) (void)ncclCommAbort(static_cast<ncclComm_t>(comm_));
}

absl::Status NcclPeer::Group(const DeviceRegion& region,
                             absl::Span<const int> ids, bool send,
                             void* stream) {
  const int n = static_cast<int>(region.layout().slots.size());
  for (int id : ids) {
    if (id < 0 || id >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter index ", id, " is outside [0, ", n, ")"));
    }
  }
  const ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DMUON_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  ncclResult_t first = ncclSuccess;
  for (int id : ids) {
    const size_t count = static_cast<size_t>(region.elements(id));
    if (count == 0) continue;  // holds nothing: the daemon posts none either
    const ncclResult_t r = send ? ncclSend(region.gradient(id), count,
                                           ncclFloat32, daemon_rank_, comm, s)
                                : ncclRecv(region.update(id), count,
                                           ncclFloat32, daemon_rank_, comm, s);
    if (r != ncclSuccess && first == ncclSuccess) first = r;
  }
  const ncclResult_t end = ncclGroupEnd();
  DMUON_NCCL_RETURN_IF_ERROR(first);
  DMUON_NCCL_RETURN_IF_ERROR(end);
  return absl::OkStatus();
}

absl::Status NcclPeer::SendGradients(const DeviceRegion& region,
                                     absl::Span<const int> ids, void* stream) {
  return Group(region, ids, /*send=*/true, stream);
}

absl::Status NcclPeer::ReceiveUpdates(const DeviceRegion& region,
                                      absl::Span<const int> ids, void* stream) {
  return Group(region, ids, /*send=*/false, stream);
}

absl::Status NcclPeer::HandOver(Session& session, const DeviceRegion& region,
                                absl::Span<const int> ids, void* stream) {
  if (auto st = SendGradients(region, ids, stream); !st.ok()) return st;
  return session.GradientsReady(ids);
}

absl::Status NcclPeer::ReceiveAnnounced(Session& session,
                                        const DeviceRegion& region,
                                        void* stream) {
  for (;;) {
    auto ids = session.NextAnnounced();
    if (!ids.ok()) return ids.status();
    if (ids->empty()) return absl::OkStatus();
    if (auto st = ReceiveUpdates(region, *ids, stream); !st.ok()) return st;
  }
}

absl::StatusOr<NcclSession> OpenNcclSession(Client& client, SessionSpec spec) {
  spec.transport = TransportChoice::kNccl;
  auto layout = Client::ComputeRegionLayout(spec);
  if (!layout.ok()) return layout.status();
  NcclSession out;
  auto region = DeviceRegion::Allocate(*layout, /*export_ipc=*/false);
  if (!region.ok()) return region.status();
  out.region = std::move(*region);
  auto session = client.OpenSession(spec);
  if (!session.ok()) return session.status();
  auto peer = NcclPeer::Join((*session)->nccl(), spec.rank);
  if (!peer.ok()) return peer.status();
  out.peer = std::move(*peer);
  out.session = std::move(*session);
  return out;
}

}  // namespace dmuon::gpu
