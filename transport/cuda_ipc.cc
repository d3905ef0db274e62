// The CUDA side of the cuda_ipc transport (cuda_ipc.h): opening a client's
// export in the daemon, and exporting a buffer in a trainer.

#include "transport/cuda_ipc.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"

namespace dmuon::transport {
namespace {

// The allocation holding `ptr`: its base and size, from the driver's
// cuMemGetAddressRange (reached through the runtime, so nothing links
// libcuda directly).
absl::Status AddressRange(const void* ptr, uintptr_t* base, size_t* size) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  DMUON_CUDA_RETURN_IF_ERROR(cudaGetDriverEntryPointByVersion(
      "cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    return absl::InternalError(
        "the CUDA driver has no cuMemGetAddressRange entry point");
  }
  CUdeviceptr b = 0;
  size_t s = 0;
  const CUresult r = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn)(
      &b, &s, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuMemGetAddressRange failed (CUresult ", static_cast<int>(r),
        "): the pointer is not in a device allocation"));
  }
  *base = static_cast<uintptr_t>(b);
  *size = s;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> DeviceUuids() {
  int count = 0;
  DMUON_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  std::vector<std::string> out;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    DMUON_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d));
    out.emplace_back(prop.uuid.bytes, kCudaUuidBytes);
  }
  return out;
}

class CudaIpcRegion final : public Region {
 public:
  CudaIpcRegion(int device, void* base, std::byte* region, uint64_t bytes,
                cudaEvent_t event)
      : mapped_(base), event_(event) {
    view_.device = device;
    view_.base = region;
    view_.bytes = bytes;
    view_.ready_event = event;
  }
  ~CudaIpcRegion() override {
    (void)cudaSetDevice(view_.device);
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    (void)cudaIpcCloseMemHandle(mapped_);
  }
  CudaIpcRegion(const CudaIpcRegion&) = delete;
  CudaIpcRegion& operator=(const CudaIpcRegion&) = delete;

  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return absl::OkStatus(); }
  const std::string& name() const override { return name_; }
  const DeviceView* device() const override { return &view_; }

 private:
  void* const mapped_;  // the allocation's base, as opened
  const cudaEvent_t event_;
  DeviceView view_;
  const std::string name_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> OpenCudaIpcRegion(
    const CudaIpcExport& e, uint64_t layout_bytes) {
  if (auto st = ValidateCudaIpcExport(e, layout_bytes); !st.ok()) return st;
  auto uuids = DeviceUuids();
  if (!uuids.ok()) return uuids.status();
  auto device = FindDeviceByUuid(*uuids, e.device_uuid);
  if (!device.ok()) return device.status();
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(*device));
  cudaIpcMemHandle_t mh;
  std::memcpy(&mh, e.mem_handle.data(), sizeof(mh));
  void* base = nullptr;
  if (const cudaError_t err =
          cudaIpcOpenMemHandle(&base, mh, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    base::ClearLastCudaError();
    return absl::InvalidArgumentError(absl::StrCat(
        "cudaIpcOpenMemHandle on ", UuidString(e.device_uuid), ": ",
        cudaGetErrorString(err),
        " (is the exporting process alive, on this host, and not this one?)"));
  }
  uintptr_t alloc_base = 0;
  size_t alloc_size = 0;
  absl::Status st = AddressRange(base, &alloc_base, &alloc_size);
  if (st.ok() && alloc_base != reinterpret_cast<uintptr_t>(base)) {
    st = absl::InternalError(
        "the opened handle does not map an allocation base");
  }
  if (st.ok()) st = ValidateCudaIpcMapping(e, alloc_size, layout_bytes);
  cudaEvent_t event = nullptr;
  if (st.ok() && !e.event_handle.empty()) {
    cudaIpcEventHandle_t eh;
    std::memcpy(&eh, e.event_handle.data(), sizeof(eh));
    if (const cudaError_t err = cudaIpcOpenEventHandle(&event, eh);
        err != cudaSuccess) {
      base::ClearLastCudaError();
      event = nullptr;
      st = absl::InvalidArgumentError(absl::StrCat(
          "cudaIpcOpenEventHandle: ", cudaGetErrorString(err),
          " (the event must be created with cudaEventInterprocess | "
          "cudaEventDisableTiming)"));
    }
  }
  if (!st.ok()) {
    (void)cudaIpcCloseMemHandle(base);
    return st;
  }
  return std::unique_ptr<Region>(new CudaIpcRegion(
      *device, base, static_cast<std::byte*>(base) + e.offset, e.bytes, event));
}

absl::StatusOr<CudaIpcExport> ExportCudaIpc(void* ptr, uint64_t bytes,
                                            void** event) {
  cudaPointerAttributes attr{};
  DMUON_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, ptr));
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(
        "ExportCudaIpc: the pointer is not device memory (cudaMalloc'ed or "
        "from a caching allocator's cudaMalloc)");
  }
  uintptr_t base = 0;
  size_t size = 0;
  if (auto st = AddressRange(ptr, &base, &size); !st.ok()) return st;
  CudaIpcExport e;
  e.offset = reinterpret_cast<uintptr_t>(ptr) - base;
  e.bytes = bytes;
  if (auto st = ValidateCudaIpcMapping(e, size, bytes); !st.ok()) return st;
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(attr.device));
  cudaIpcMemHandle_t mh;
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaIpcGetMemHandle(&mh, reinterpret_cast<void*>(base)));
  e.mem_handle.assign(reinterpret_cast<const char*>(&mh), sizeof(mh));
  cudaDeviceProp prop{};
  DMUON_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, attr.device));
  e.device_uuid.assign(prop.uuid.bytes, kCudaUuidBytes);
  if (event != nullptr) {
    cudaEvent_t ev = nullptr;
    DMUON_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(
        &ev, cudaEventDisableTiming | cudaEventInterprocess));
    cudaIpcEventHandle_t eh;
    if (const cudaError_t err = cudaIpcGetEventHandle(&eh, ev);
        err != cudaSuccess) {
      (void)cudaEventDestroy(ev);
      DMUON_CUDA_RETURN_IF_ERROR(err);
    }
    e.event_handle.assign(reinterpret_cast<const char*>(&eh), sizeof(eh));
    *event = ev;
  }
  return e;
}

}  // namespace dmuon::transport
