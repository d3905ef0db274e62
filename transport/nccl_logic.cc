// The nccl transport's plain logic (nccl.h): ranks, transfers, the warm-up,
// the order rule and the abort policy.

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/nccl.h"

namespace dmuon::transport {

NcclRanks NcclRanksFor(int world_size) { return {world_size + 1, world_size}; }

std::vector<NcclTransfer> GradientReceives(const Layout& layout, int peer,
                                           const std::vector<int>& params) {
  std::vector<NcclTransfer> out;
  for (int p : params) {
    const Slot& s = layout.slots[p];
    if (s.bytes == 0) continue;  // the rank holds nothing (nccl_peer.cc too)
    out.push_back({false, peer, s.gradient_offset, s.bytes});
  }
  return out;
}

std::vector<NcclTransfer> UpdateSends(const Layout& layout, int peer,
                                      const std::vector<int>& params) {
  std::vector<NcclTransfer> out;
  for (int p : params) {
    const Slot& s = layout.slots[p];
    if (s.bytes == 0) continue;  // the rank holds nothing (nccl_peer.cc too)
    out.push_back({true, peer, s.update_offset, s.bytes});
  }
  return out;
}

uint64_t NcclWarmUpScratchBytes(NcclRanks ranks) {
  return static_cast<uint64_t>(ranks.nranks) * kNcclWarmUpBytes;
}

std::vector<NcclTransfer> DaemonWarmUp(NcclRanks ranks, std::byte* scratch) {
  std::vector<NcclTransfer> out;
  const uint64_t send_slot =
      static_cast<uint64_t>(ranks.daemon_rank) * kNcclWarmUpBytes;
  for (int r = 0; r < ranks.daemon_rank; ++r) {
    out.push_back({false, r, static_cast<uint64_t>(r) * kNcclWarmUpBytes,
                   kNcclWarmUpBytes, scratch});
    out.push_back({true, r, send_slot, kNcclWarmUpBytes, scratch});
  }
  return out;
}

std::vector<uint64_t> ExchangeOrder::GradientsPosted(int64_t step, int count) {
  if (step != step_) {
    step_ = step;
    posted_ = 0;
  }
  posted_ += count;
  std::vector<uint64_t> go;
  if (posted_ < params_) return go;
  std::vector<std::pair<int64_t, uint64_t>> keep;
  for (const auto& [s, token] : held_) {
    if (s <= step_) {
      go.push_back(token);
    } else {
      keep.push_back({s, token});
    }
  }
  held_ = std::move(keep);
  return go;
}

bool ExchangeOrder::MayPush(int64_t step, uint64_t token) {
  if (step < step_ || (step == step_ && posted_ >= params_)) return true;
  held_.push_back({step, token});
  return false;
}

absl::Status JudgeNccl(const NcclPolicy& policy, const NcclHealth& health) {
  if (!health.async_error.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the job's NCCL communicator failed: ", health.async_error.message()));
  }
  if (!health.initialized &&
      health.since_start_seconds > policy.init_timeout_seconds) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "not every rank joined the job's NCCL communicator within %.0f s "
        "(each trainer rank must call ncclCommInitRankConfig with the "
        "unique id from OpenSession)",
        policy.init_timeout_seconds));
  }
  if (health.oldest_pending_seconds > policy.transfer_timeout_seconds) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "an NCCL transfer waited %.0f s for its peer (limit %.0f s): a "
        "trainer rank died, hangs, or posts its sends and receives out of "
        "the protocol's order",
        health.oldest_pending_seconds, policy.transfer_timeout_seconds));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::transport
