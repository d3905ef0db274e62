// GPU memory for the client's GPU transports (client/client.h kCudaIpc,
// kNccl), for C++ trainers: the CUDA calls the client library leaves to its
// caller. (Python trainers do the same through torch.)
//
//   SessionSpec spec = ...;  spec.transport = TransportChoice::kCudaIpc;
//   auto s = gpu::OpenCudaIpcSession(*client, spec);    // allocates, exports
//   per step: write gradients into s->region->gradient(i) (device memory)
//             on `stream`, then
//     s->region->GradientsWritten(stream);              // records the event
//     s->session->GradientsReady(ids);
//     ... s->session->WaitUpdate(i) / NextAnnounced(); read
//     s->region->update(i); s->session->FinishStep();
//   at the end: destroy s (or s->session, then s->region): the session is
//     closed first and the memory freed only once the daemon confirmed it
//     released the region (release_gate.h).
//
// nccl_peer.h adds the communicator for kNccl. No CUDA type appears in
// these headers (streams and events are void*).

#ifndef DMUON_CLIENT_CUDA_DEVICE_REGION_H_
#define DMUON_CLIENT_CUDA_DEVICE_REGION_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/cuda/release_gate.h"

namespace dmuon::gpu {

// A session's region in this process's GPU memory, laid out by a
// RegionLayout (Client::ComputeRegionLayout). Freed on destruction, when
// gate() allows it: an exported region whose cuda_ipc session has not been
// closed with the daemon's confirmation that it released the region is kept
// instead (the driver frees it at process exit) and the reason printed to
// stderr, so the daemon never maps freed memory. OpenCudaIpcSession wires
// the gate to the session. Thread-compatible.
class DeviceRegion {
 public:
  // `layout.total_bytes` of zeroed device memory on the current CUDA device.
  // With `export_ipc`, also exports it for kCudaIpc (cuda_ipc()) with an
  // interprocess event (transport/cuda_ipc.h ExportCudaIpc).
  static absl::StatusOr<std::unique_ptr<DeviceRegion>> Allocate(
      const RegionLayout& layout, bool export_ipc);
  ~DeviceRegion();
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;

  const RegionLayout& layout() const { return layout_; }
  // For SessionSpec::cuda_ipc; empty unless exported.
  const CudaIpcRegion& cuda_ipc() const { return export_; }
  // Whether the memory may be freed (release_gate.h); shared with the
  // session opened over it.
  const std::shared_ptr<ReleaseGate>& gate() const { return gate_; }
  int device() const { return device_; }  // CUDA ordinal

  // Parameter i's slots (device pointers, fp32, this rank's view); null for
  // an index outside the layout.
  float* gradient(int i) const;
  float* update(int i) const;
  int64_t elements(int i) const;  // of this rank's view; 0 outside

  // cuda_ipc's hand-over rule: the gradients were written on `stream` (a
  // cudaStream_t; null: the legacy default stream); records the exported
  // event there (without one: synchronizes the stream). Call it before
  // GradientReady/GradientsReady.
  absl::Status GradientsWritten(void* stream = nullptr);

 private:
  DeviceRegion(const RegionLayout& layout, int device)
      : layout_(layout), device_(device) {}
  const RegionLayout layout_;
  const int device_;
  void* base_ = nullptr;
  void* event_ = nullptr;  // cudaEvent_t, interprocess; exported regions
  CudaIpcRegion export_;
  const std::shared_ptr<ReleaseGate> gate_ = std::make_shared<ReleaseGate>();
};

// A kCudaIpc session and its region. Members are destroyed session first:
// the session (guarded, release_gate.h) closes and records whether the
// daemon released the region, then the region is freed if it did.
struct CudaIpcSession {
  std::unique_ptr<DeviceRegion> region;
  std::unique_ptr<Session> session;
};

// Lays out `spec`, allocates and exports its region on the current device
// and opens the session over kCudaIpc (spec.transport and spec.cuda_ipc are
// set here). The session is GuardSession's: its Close() (or destruction)
// tells the region's gate whether the daemon released the region.
absl::StatusOr<CudaIpcSession> OpenCudaIpcSession(Client& client,
                                                  SessionSpec spec);

}  // namespace dmuon::gpu

#endif  // DMUON_CLIENT_CUDA_DEVICE_REGION_H_
