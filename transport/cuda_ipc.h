// The cuda_ipc transport: trainer and daemon on one host, GPU tensors.
//
// The trainer allocates its region in GPU memory, laid out like any other
// (transport.h ComputeLayout: gradients, then updates, 64-byte aligned fp32
// slots), possibly inside a larger allocation (a caching allocator's block),
// and exports it (ExportCudaIpc): the allocation's IPC memory handle, the
// region's offset in it, its size, the GPU's UUID and, optionally, an IPC
// event it records after writing gradients. The daemon validates every field
// before use (ValidateCudaIpcExport), finds the GPU by UUID among its own,
// opens the handle, checks that the allocation really covers the region
// (ValidateCudaIpcMapping) and from then on reads gradients and writes
// updates in place — with peer copies when its executor runs on another GPU.
//
// The pure checks are plain C++ (cuda_ipc_logic.cc, tested on the CPU); the
// CUDA calls are in cuda_ipc.cc (--config=cuda). No CUDA type appears here.

#ifndef DMUON_TRANSPORT_CUDA_IPC_H_
#define DMUON_TRANSPORT_CUDA_IPC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace dmuon::transport {

inline constexpr size_t kCudaIpcHandleBytes = 64;  // CUDA_IPC_HANDLE_SIZE
inline constexpr size_t kCudaUuidBytes = 16;       // cudaUUID_t
// Region byte 0 must be aligned so that every slot is (kAlignment) too.
inline constexpr uint64_t kCudaIpcOffsetAlignment = kAlignment;

// The proto's CudaIpcExport in plain C++ (strings hold raw bytes).
struct CudaIpcExport {
  std::string mem_handle;    // cudaIpcMemHandle_t of the allocation
  uint64_t offset = 0;       // region byte 0 = allocation base + offset
  uint64_t bytes = 0;        // exported region size
  std::string event_handle;  // cudaIpcEventHandle_t, or empty
  std::string device_uuid;   // cudaDeviceProp.uuid
};

// Before any CUDA call: handle and UUID sizes, an aligned offset, no
// overflow, and an exported size that holds the layout. INVALID_ARGUMENT
// naming the field and both values.
absl::Status ValidateCudaIpcExport(const CudaIpcExport& e,
                                   uint64_t layout_bytes);

// After opening: the allocation the handle maps (`allocation_bytes` from
// its base) must contain [offset, offset + layout_bytes). INVALID_ARGUMENT
// otherwise (the client lied about, or freed, its buffer).
absl::Status ValidateCudaIpcMapping(const CudaIpcExport& e,
                                    uint64_t allocation_bytes,
                                    uint64_t layout_bytes);

// The index of `uuid` in `uuids` (this process's GPUs in ordinal order), or
// NOT_FOUND naming it and the GPUs this process sees.
absl::StatusOr<int> FindDeviceByUuid(const std::vector<std::string>& uuids,
                                     const std::string& uuid);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints UUIDs.
std::string UuidString(const std::string& uuid);

// --- CUDA side (cuda_ipc.cc; only in the --config=cuda build) ---

// Daemon: validates and maps a client's export. The Region's device() view
// is the region on the client's GPU (its ordinal in this process); the
// handles are closed when the Region is destroyed.
absl::StatusOr<std::unique_ptr<Region>> OpenCudaIpcRegion(
    const CudaIpcExport& e, uint64_t layout_bytes);

// Trainer: exports `bytes` of device memory at `ptr`, which may lie inside
// a larger allocation. With `event` non-null, also creates an interprocess
// event and returns it (a cudaEvent_t) there: record it on the stream that
// wrote the gradients before GradientsReady (the daemon waits on it).
absl::StatusOr<CudaIpcExport> ExportCudaIpc(void* ptr, uint64_t bytes,
                                            void** event);

}  // namespace dmuon::transport

#endif  // DMUON_TRANSPORT_CUDA_IPC_H_
