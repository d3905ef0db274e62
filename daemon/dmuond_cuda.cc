// dmuond_cuda: dmuond (daemon_main.h) with CUDA executors (cuda_executor.h),
// the GPU transports (cuda_transports.h) and the autotuner measuring on a
// GPU (cuda_tuning.h): --devices=cuda:0,1 or auto.

#include "daemon/daemon_main.h"
#include "server/cuda/cuda_executor.h"
#include "server/cuda/cuda_transports.h"
#include "server/cuda/cuda_tuning.h"

int main(int argc, char** argv) {
  dmuon::server::GpuSupport gpu;
  gpu.executors = [](const std::string& devices, bool bf16_momentum,
                     bool strict, std::string* why) {
    dmuon::server::CudaExecutorOptions o;
    o.bf16_momentum = bf16_momentum;
    o.strict = strict;
    return dmuon::server::NewCudaExecutors(devices, o, why);
  };
  gpu.transports = [](const std::vector<std::string>& devices) {
    return dmuon::server::NewCudaTransports(devices);
  };
  // Methods are measured as the executors run them (the momentum dtype does
  // not change how Newton–Schulz runs).
  gpu.tuning = [](const std::vector<std::string>& devices) {
    return dmuon::server::NewCudaTuning(devices,
                                        dmuon::server::CudaExecutorOptions());
  };
  return dmuon::server::DaemonMain(argc, argv, &gpu);
}
