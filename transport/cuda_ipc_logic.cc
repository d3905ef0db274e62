// The cuda_ipc transport's checks (cuda_ipc.h), plain C++.

#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/cuda_ipc.h"

namespace dmuon::transport {

absl::Status ValidateCudaIpcExport(const CudaIpcExport& e,
                                   uint64_t layout_bytes) {
  if (e.mem_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.mem_handle has ", e.mem_handle.size(),
                     " bytes; a cudaIpcMemHandle_t has ", kCudaIpcHandleBytes));
  }
  if (!e.event_handle.empty() && e.event_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.event_handle has ", e.event_handle.size(),
        " bytes; a cudaIpcEventHandle_t has ", kCudaIpcHandleBytes,
        " (leave it empty to synchronize before GradientsReady instead)"));
  }
  if (e.device_uuid.size() != kCudaUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.device_uuid has ", e.device_uuid.size(),
                     " bytes; a CUDA device UUID has ", kCudaUuidBytes));
  }
  if (e.offset % kCudaIpcOffsetAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.offset ", e.offset, " is not a multiple of ",
        kCudaIpcOffsetAlignment, " (the region's slots must stay aligned)"));
  }
  if (e.bytes > std::numeric_limits<uint64_t>::max() - e.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.offset ", e.offset, " + bytes ", e.bytes, " overflows"));
  }
  if (e.bytes < layout_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.bytes ", e.bytes, " is smaller than the session's layout (",
        layout_bytes, " bytes: every gradient and update slot, fp32)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateCudaIpcMapping(const CudaIpcExport& e,
                                    uint64_t allocation_bytes,
                                    uint64_t layout_bytes) {
  if (e.offset > allocation_bytes ||
      layout_bytes > allocation_bytes - e.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the exported allocation has ", allocation_bytes,
        " bytes; the region needs [", e.offset, ", ", e.offset + layout_bytes,
        ") of it (was the buffer freed or reallocated?)"));
  }
  return absl::OkStatus();
}

std::string UuidString(const std::string& uuid) {
  const std::string hex = absl::BytesToHexString(uuid);
  std::string s = "GPU-";
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s.push_back('-');
    s.append(hex, 2 * i, 2);
  }
  return s;
}

absl::StatusOr<int> FindDeviceByUuid(const std::vector<std::string>& uuids,
                                     const std::string& uuid) {
  for (size_t i = 0; i < uuids.size(); ++i) {
    if (uuids[i] == uuid) return static_cast<int>(i);
  }
  std::vector<std::string> seen;
  for (const std::string& u : uuids) seen.push_back(UuidString(u));
  return absl::NotFoundError(absl::StrCat(
      "the exported memory is on ", UuidString(uuid),
      ", which this daemon does not see (it sees ",
      seen.empty() ? std::string("no GPU") : absl::StrJoin(seen, ", "),
      "); run dmuond_cuda where that GPU is visible, or use TRANSPORT_NCCL"));
}

}  // namespace dmuon::transport
