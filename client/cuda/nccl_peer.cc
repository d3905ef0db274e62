// NcclPeer (nccl_peer.h): the trainer's NCCL calls, in NcclOrder's order.

#include "client/cuda/nccl_peer.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "base/device_alloc.h"
#include "transport/nccl_check.h"

namespace dmuon::gpu {

namespace {

// Region byte 0 (DeviceRegion hands out slot addresses only); null for a
// layout without slots, which no transfer addresses.
std::byte* Base(const DeviceRegion& region) {
  const RegionLayout& l = region.layout();
  if (l.slots.empty()) return nullptr;
  return reinterpret_cast<std::byte*>(region.gradient(0)) -
         l.slots[0].gradient_offset;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclPeer>> NcclPeer::Join(const NcclInfo& info,
                                                         int rank,
                                                         void* stream) {
  ncclUniqueId id;
  if (info.unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclPeer: the unique id has ", info.unique_id.size(),
                     " bytes, NCCL's has ", sizeof(id.internal),
                     " (is this an nccl session?)"));
  }
  std::memcpy(id.internal, info.unique_id.data(), sizeof(id.internal));
  auto zeroed = base::MallocZeroed(kNcclTrainerWarmUpBytes);
  if (!zeroed.ok()) return zeroed.status();
  void* scratch = *zeroed;
  ncclComm_t comm = nullptr;
  if (const ncclResult_t r = ncclCommInitRank(&comm, info.nranks, id, rank);
      r != ncclSuccess) {
    (void)cudaFree(scratch);
    DMUON_NCCL_RETURN_IF_ERROR(r);
  }
  std::unique_ptr<NcclPeer> peer(new NcclPeer(comm, info.daemon_rank, scratch));
  // The communicator's first group (transport/nccl.h): connects both
  // directions with the daemon before any step's transfer.
  if (auto st = peer->order_.WarmUp(static_cast<std::byte*>(scratch), stream);
      !st.ok()) {
    return st;
  }
  return peer;
}

NcclPeer::~NcclPeer() {
  if (groups_.comm() != nullptr)
    (void)ncclCommAbort(static_cast<ncclComm_t>(groups_.comm()));
  (void)cudaFree(scratch_);
}

absl::Status NcclPeer::Groups::Group(
    const std::vector<transport::NcclTransfer>& transfers, void* stream) {
  const ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  DMUON_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  ncclResult_t first = ncclSuccess;
  for (const transport::NcclTransfer& t : transfers) {
    void* data = t.base + t.offset;
    const size_t count = t.bytes / sizeof(float);
    const ncclResult_t r =
        t.send ? ncclSend(data, count, ncclFloat32, t.peer, comm, s)
               : ncclRecv(data, count, ncclFloat32, t.peer, comm, s);
    if (r != ncclSuccess && first == ncclSuccess) first = r;
  }
  const ncclResult_t end = ncclGroupEnd();
  DMUON_NCCL_RETURN_IF_ERROR(first);
  DMUON_NCCL_RETURN_IF_ERROR(end);
  return absl::OkStatus();
}

absl::Status NcclPeer::SendGradients(const DeviceRegion& region,
                                     absl::Span<const int> ids, void* stream) {
  return order_.SendGradients(region.layout(), Base(region), ids, stream);
}

absl::Status NcclPeer::ReceiveUpdates(const DeviceRegion& region,
                                      absl::Span<const int> ids, void* stream) {
  return order_.ReceiveUpdates(region.layout(), Base(region), ids, stream);
}

absl::Status NcclPeer::HandOver(Session& session, const DeviceRegion& region,
                                absl::Span<const int> ids, void* stream) {
  return order_.HandOver(session, region.layout(), Base(region), ids, stream);
}

absl::Status NcclPeer::ReceiveAnnounced(Session& session,
                                        const DeviceRegion& region,
                                        void* stream) {
  return order_.ReceiveAnnounced(session, region.layout(), Base(region),
                                 stream);
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
