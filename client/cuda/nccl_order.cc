// NcclOrder (nccl_order.h): the trainer's groups, in the protocol's order.

#include "client/cuda/nccl_order.h"

#include "absl/strings/str_cat.h"

namespace dmuon::gpu {

absl::Status NcclOrder::WarmUp(std::byte* scratch, void* stream) {
  using transport::kNcclWarmUpBytes;
  return groups_.Group(
      {{true, daemon_rank_, 0, kNcclWarmUpBytes, scratch},
       {false, daemon_rank_, kNcclWarmUpBytes, kNcclWarmUpBytes, scratch}},
      stream);
}

absl::Status NcclOrder::Slots(const RegionLayout& layout, std::byte* base,
                              absl::Span<const int> ids, bool send,
                              void* stream) {
  const int n = static_cast<int>(layout.slots.size());
  std::vector<transport::NcclTransfer> transfers;
  for (int id : ids) {
    if (id < 0 || id >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter index ", id, " is outside [0, ", n, ")"));
    }
    const RegionSlot& s = layout.slots[id];
    if (s.bytes == 0) continue;  // holds nothing: the daemon posts none either
    transfers.push_back({send, daemon_rank_,
                         send ? s.gradient_offset : s.update_offset, s.bytes,
                         base});
  }
  return groups_.Group(transfers, stream);
}

absl::Status NcclOrder::SendGradients(const RegionLayout& layout,
                                      std::byte* base,
                                      absl::Span<const int> ids, void* stream) {
  return Slots(layout, base, ids, /*send=*/true, stream);
}

absl::Status NcclOrder::ReceiveUpdates(const RegionLayout& layout,
                                       std::byte* base,
                                       absl::Span<const int> ids,
                                       void* stream) {
  return Slots(layout, base, ids, /*send=*/false, stream);
}

absl::Status NcclOrder::HandOver(Session& session, const RegionLayout& layout,
                                 std::byte* base, absl::Span<const int> ids,
                                 void* stream) {
  if (auto st = SendGradients(layout, base, ids, stream); !st.ok()) return st;
  return session.GradientsReady(ids);
}

absl::Status NcclOrder::ReceiveAnnounced(Session& session,
                                         const RegionLayout& layout,
                                         std::byte* base, void* stream) {
  for (;;) {
    auto ids = session.NextAnnounced();
    if (!ids.ok()) return ids.status();
    if (ids->empty()) return absl::OkStatus();
    if (auto st = ReceiveUpdates(layout, base, *ids, stream); !st.ok())
      return st;
  }
}

}  // namespace dmuon::gpu
