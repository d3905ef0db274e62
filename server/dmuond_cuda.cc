// dmuond_cuda: dmuond (daemon_main.h) with CUDA executors (cuda_executor.h)
// and the GPU transports (cuda_transports.h): --devices=cuda:0,1 or auto.

#include "server/cuda_executor.h"
#include "server/cuda_transports.h"
#include "server/daemon_main.h"

int main(int argc, char** argv) {
  dmuon::server::GpuSupport gpu;
  gpu.executors = [](const std::string& devices, bool bf16_momentum,
                     std::string* why) {
    dmuon::server::CudaExecutorOptions o;
    o.bf16_momentum = bf16_momentum;
    return dmuon::server::NewCudaExecutors(devices, o, why);
  };
  gpu.transports = [](const std::vector<std::string>& devices) {
    return dmuon::server::NewCudaTransports(devices);
  };
  return dmuon::server::DaemonMain(argc, argv, &gpu);
}
