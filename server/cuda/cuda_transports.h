// The GPU transports of dmuond_cuda (device_transport.h): cuda_ipc
// (transport/cuda_ipc.h) and nccl (transport/nccl.h). Built only with
// --config=cuda; no CUDA type appears here.

#ifndef DMUON_SERVER_CUDA_CUDA_TRANSPORTS_H_
#define DMUON_SERVER_CUDA_CUDA_TRANSPORTS_H_

#include <memory>
#include <string>
#include <vector>

#include "server/device_transport.h"

namespace dmuon::server {

// `devices`: the CUDA executors' names ("cuda:0", ...); NCCL jobs are spread
// over them (job serial modulo their count), each device's NCCL calls made
// by one thread. cuda_ipc regions are wherever the client's memory is.
std::shared_ptr<DeviceTransports> NewCudaTransports(
    const std::vector<std::string>& devices);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_CUDA_CUDA_TRANSPORTS_H_
