// The GPU transports of dmuond_cuda (cuda_transports.h).

#include "server/cuda/cuda_transports.h"

#include <map>
#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"

namespace dmuon::server {
namespace {

transport::CudaIpcExport FromProto(const v1::CudaIpcExport& p) {
  transport::CudaIpcExport e;
  e.mem_handle = p.mem_handle();
  e.offset = p.offset();
  e.bytes = p.bytes();
  e.event_handle = p.event_handle();
  e.device_uuid = p.device_uuid();
  return e;
}

class CudaTransports final : public DeviceTransports {
 public:
  explicit CudaTransports(std::vector<int> devices)
      : devices_(std::move(devices)) {}

  bool Supports(v1::Transport t) const override {
    return t == v1::TRANSPORT_CUDA_IPC ||
           (t == v1::TRANSPORT_NCCL && !devices_.empty());
  }

  absl::StatusOr<std::unique_ptr<transport::Region>> Open(
      uint64_t job_serial, const v1::OpenSessionRequest& req,
      const transport::Layout& layout, v1::OpenSessionResponse* resp) override {
    if (req.transport() == v1::TRANSPORT_CUDA_IPC) {
      if (!req.has_cuda_ipc()) {
        return absl::InvalidArgumentError(
            "TRANSPORT_CUDA_IPC needs cuda_ipc: the exported GPU region (see "
            "docs/protocol.md)");
      }
      return transport::OpenCudaIpcRegion(FromProto(req.cuda_ipc()),
                                          layout.total_bytes);
    }
    if (req.transport() != v1::TRANSPORT_NCCL || devices_.empty()) {
      return absl::UnimplementedError(
          absl::StrCat("transport ", v1::Transport_Name(req.transport()),
                       " is not served by this daemon"));
    }
    absl::MutexLock lock(&mu_);
    std::shared_ptr<transport::NcclJob>& job = jobs_[job_serial];
    if (job == nullptr || job->ended()) {
      // Jobs spread over the devices; all of a device's NCCL calls come
      // from its one worker thread.
      const int device = devices_[job_serial % devices_.size()];
      std::shared_ptr<transport::NcclWorker>& worker = workers_[device];
      if (worker == nullptr)
        worker = std::make_shared<transport::NcclWorker>(policy_);
      auto started =
          transport::StartNcclJob(req.world_size(), device, worker, policy_);
      if (!started.ok()) {
        jobs_.erase(job_serial);
        return started.status();
      }
      job = *std::move(started);
    }
    auto region = job->OpenRegion(req.rank(), layout);
    if (!region.ok()) return region.status();
    auto* n = resp->mutable_nccl();
    n->set_unique_id(job->unique_id());
    n->set_nranks(job->ranks().nranks);
    n->set_daemon_rank(job->ranks().daemon_rank);
    return region;
  }

  void DropJob(uint64_t job_serial) override {
    std::shared_ptr<transport::NcclJob> job;
    {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(job_serial);
      if (it == jobs_.end()) return;
      job = std::move(it->second);
      jobs_.erase(it);
    }
  }

 private:
  const std::vector<int> devices_;
  const transport::NcclPolicy policy_;
  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<transport::NcclJob>> jobs_
      ABSL_GUARDED_BY(mu_);
  std::map<int, std::shared_ptr<transport::NcclWorker>> workers_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::shared_ptr<DeviceTransports> NewCudaTransports(
    const std::vector<std::string>& devices) {
  std::vector<int> ordinals;
  for (const std::string& d : devices) {
    int n = -1;
    if (d.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(d.substr(5), &n))
      ordinals.push_back(n);
  }
  return std::make_shared<CudaTransports>(std::move(ordinals));
}

}  // namespace dmuon::server
