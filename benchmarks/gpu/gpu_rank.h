// A trainer rank over a GPU transport for the GPU check's tools, speaking
// the protocol directly (the C++ client library has shm and inline only).
// The rank's region lives in this process's GPU memory, laid out as the
// daemon lays it out (transport::ComputeLayout):
//   TRANSPORT_CUDA_IPC: exported to the daemon at OpenSession; gradients are
//     read and updates written in place by the daemon;
//   TRANSPORT_NCCL: the rank joins the job's communicator with the unique id
//     from OpenSession and moves slots with ncclSend/ncclRecv in the order
//     transport/nccl.h prescribes (all of a step's gradient sends, then the
//     update receives as UpdatesReady messages name them).
// One thread.

#ifndef DMUON_BENCHMARKS_GPU_GPU_RANK_H_
#define DMUON_BENCHMARKS_GPU_GPU_RANK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/dmuon.pb.h"

namespace dmuon::bench {

class GpuRank {
 public:
  // `req` without transport or cuda_ipc (filled here); `transport` is
  // TRANSPORT_CUDA_IPC or TRANSPORT_NCCL. The region is allocated on the
  // current CUDA device.
  static absl::StatusOr<std::unique_ptr<GpuRank>> Open(
      const std::string& address, v1::OpenSessionRequest req,
      v1::Transport transport);
  virtual ~GpuRank() = default;

  virtual float* gradient(int param) = 0;  // device pointers, fp32
  virtual float* update(int param) = 0;
  virtual int64_t elements(int param) const = 0;  // of this rank's view
  virtual uint64_t region_bytes() const = 0;

  // Hands over the gradients of `ids` (written on the legacy default stream)
  // for `step` — cuda_ipc: records the exported event; nccl: sends them —
  // declares them ready and waits for StepComplete (nccl: receiving each
  // update as it is announced). Returns the seconds from handing over to
  // StepComplete; a ParameterError is an error here.
  virtual absl::StatusOr<double> Step(int64_t step,
                                      const std::vector<int>& ids) = 0;
  virtual absl::StatusOr<std::vector<v1::StateChunk>> GetState() = 0;
  virtual absl::StatusOr<v1::StatusResponse> Status() = 0;
  virtual absl::Status Close() = 0;
};

}  // namespace dmuon::bench

#endif  // DMUON_BENCHMARKS_GPU_GPU_RANK_H_
