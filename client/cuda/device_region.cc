// DeviceRegion (device_region.h): cudaMalloc, ExportCudaIpc, the event.

#include "client/cuda/device_region.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "base/cuda_status.h"
#include "base/device_alloc.h"
#include "transport/cuda_ipc.h"

namespace dmuon::gpu {

absl::StatusOr<std::unique_ptr<DeviceRegion>> DeviceRegion::Allocate(
    const RegionLayout& layout, bool export_ipc) {
  if (layout.slots.empty()) {
    return absl::InvalidArgumentError(
        "DeviceRegion: the layout is empty (a table without parameters?)");
  }
  int device = 0;
  DMUON_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::unique_ptr<DeviceRegion> r(new DeviceRegion(layout, device));
  // At least one aligned block: a rank holding nothing of every matrix
  // (SHARDING_BLOCKS) has a 0-byte layout, and cudaMalloc(0) gives no
  // pointer to export.
  const size_t bytes =
      std::max<uint64_t>(layout.total_bytes, transport::kAlignment);
  auto zeroed = base::MallocZeroed(bytes);
  if (!zeroed.ok()) return zeroed.status();
  r->base_ = *zeroed;
  if (export_ipc) {
    auto e = transport::ExportCudaIpc(r->base_, bytes, &r->event_);
    if (!e.ok()) return e.status();
    r->export_.mem_handle = std::move(e->mem_handle);
    r->export_.offset = e->offset;
    r->export_.bytes = e->bytes;
    r->export_.event_handle = std::move(e->event_handle);
    r->export_.device_uuid = std::move(e->device_uuid);
  }
  return r;
}

DeviceRegion::~DeviceRegion() {
  const absl::Status st = FreeWhenReleased(*gate_, [&] {
    if (event_ != nullptr)
      (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    if (base_ != nullptr) (void)cudaFree(base_);
    return absl::OkStatus();
  });
  if (!st.ok()) {
    std::fprintf(stderr, "dmuon: DeviceRegion of %llu bytes on cuda:%d: %s\n",
                 static_cast<unsigned long long>(layout_.total_bytes), device_,
                 std::string(st.message()).c_str());
  }
}

float* DeviceRegion::gradient(int i) const {
  if (i < 0 || i >= static_cast<int>(layout_.slots.size())) return nullptr;
  return reinterpret_cast<float*>(static_cast<char*>(base_) +
                                  layout_.slots[i].gradient_offset);
}

float* DeviceRegion::update(int i) const {
  if (i < 0 || i >= static_cast<int>(layout_.slots.size())) return nullptr;
  return reinterpret_cast<float*>(static_cast<char*>(base_) +
                                  layout_.slots[i].update_offset);
}

int64_t DeviceRegion::elements(int i) const {
  if (i < 0 || i >= static_cast<int>(layout_.slots.size())) return 0;
  return layout_.slots[i].rows * layout_.slots[i].cols;
}

absl::Status DeviceRegion::GradientsWritten(void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (event_ == nullptr) {
    DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return absl::OkStatus();
  }
  DMUON_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), s));
  return absl::OkStatus();
}

absl::StatusOr<CudaIpcSession> OpenCudaIpcSession(Client& client,
                                                  SessionSpec spec) {
  spec.transport = TransportChoice::kCudaIpc;
  auto layout = Client::ComputeRegionLayout(spec);
  if (!layout.ok()) return layout.status();
  CudaIpcSession out;
  auto region = DeviceRegion::Allocate(*layout, /*export_ipc=*/true);
  if (!region.ok()) return region.status();
  out.region = std::move(*region);
  spec.cuda_ipc = out.region->cuda_ipc();
  const std::shared_ptr<ReleaseGate>& gate = out.region->gate();
  gate->Exported();
  auto session = client.OpenSession(spec);
  if (!session.ok()) {
    gate->OpenFailed(session.status());
    return session.status();
  }
  out.session = GuardSession(std::move(*session), gate);
  return out;
}

}  // namespace dmuon::gpu
