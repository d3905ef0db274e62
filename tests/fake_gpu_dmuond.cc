// fake_gpu_dmuond: a TEST DOUBLE of dmuond_cuda, for testing GPU-transport
// clients on machines without a GPU. Never deploy it: its "GPU" is host
// memory.
//
// It is dmuond (daemon_main.h: same flags, --listen, --port-file, ...) whose
// executors are FakeDeviceExecutors and whose GPU transports are
// FakeTransports (server/testing/fake_device.h):
//   cuda_ipc: the client's "GPU memory" is a POSIX shared-memory segment the
//     client process created; cuda_ipc.mem_handle = "shm:" + its shm_open
//     name (e.g. "shm:/psm_1234"), offset a multiple of 64, bytes >= the
//     layout's total_bytes; the daemon maps [0, offset + bytes) of it and
//     reads gradients / writes updates in place, as dmuond_cuda does with
//     CUDA IPC memory. (An 8-byte mem_handle is an address in the daemon's
//     own process: useless from another process.) event_handle and
//     device_uuid are ignored.
//     When it releases such a region (the moment dmuond_cuda closes the IPC
//     handle: every computation using it ended), it prints to stderr
//       fake_gpu_dmuond: released cuda_ipc region shm:/NAME; the client's
//       segment is still there
//     or, when the client unlinked the segment before that (it freed its
//     memory before the daemon released it: the order is broken),
//       ... the client's segment is GONE (freed before the release)
//     so client tests can check the order in the daemon's log.
//   nccl: not served (UNIMPLEMENTED), as on a daemon without CUDA devices;
//     in-process tests use FakeTransports' fake communicators directly.
// --devices: 'auto' (the default here) or 'cuda' = two fake executors,
// 'cuda:0,1,...' = one per listed ordinal, 'cpu' = a plain CPU dmuond (no
// GPU transports).
// --fake-device-memory=BYTES: the total memory each fake executor reports
// as its device's (Executor::device_memory_capacity; 0, the default: none,
// like a host executor), so the defaults sized from GPU memory can be
// tested.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "daemon/daemon_main.h"
#include "server/gpu_logic.h"
#include "server/testing/fake_device.h"

ABSL_FLAG(uint64_t, fake_device_memory, 0,
          "TEST DOUBLE: the device memory each fake executor reports");

int main(int argc, char** argv) {
  using dmuon::server::testing::FakeDeviceExecutor;
  using dmuon::server::testing::FakeTransports;
  dmuon::server::GpuSupport gpu;
  gpu.executors = [](const std::string& devices, bool bf16_momentum,
                     bool strict, std::string* why)
      -> absl::StatusOr<std::vector<std::unique_ptr<dmuon::server::Executor>>> {
    if (bf16_momentum) {
      return absl::InvalidArgumentError(
          "fake_gpu_dmuond keeps fp32 momentum (no --momentum-dtype=bf16)");
    }
    auto spec = dmuon::server::ParseDeviceSpec(devices);
    if (!spec.ok()) return spec.status();
    const int n =
        spec->ordinals.empty() ? 2 : static_cast<int>(spec->ordinals.size());
    std::vector<std::unique_ptr<dmuon::server::Executor>> ex;
    for (int i = 0; i < n; ++i) {
      auto e = std::make_unique<FakeDeviceExecutor>(i, true, strict);
      e->capacity_bytes = absl::GetFlag(FLAGS_fake_device_memory);
      ex.push_back(std::move(e));
    }
    return ex;
  };
  gpu.transports = [](const std::vector<std::string>&) {
    auto t = std::make_shared<FakeTransports>();
    t->on_unmap = [](const std::string& handle) {
      if (handle.rfind("shm:", 0) != 0) return;
      const std::string name = handle.substr(4);
      const int fd = shm_open(name.c_str(), O_RDONLY, 0);
      if (fd >= 0) close(fd);
      std::fprintf(stderr,
                   "fake_gpu_dmuond: released cuda_ipc region %s; the "
                   "client's segment is %s\n",
                   handle.c_str(),
                   fd >= 0 ? "still there" : "GONE (freed before the release)");
      std::fflush(stderr);
    };
    return t;
  };
  // --devices=auto unless the command line says otherwise (a later flag
  // wins).
  std::vector<char*> args(argv, argv + argc);
  std::string devices = "--devices=auto";
  args.insert(args.begin() + 1, devices.data());
  args.push_back(nullptr);
  return dmuon::server::DaemonMain(argc + 1, args.data(), &gpu);
}
