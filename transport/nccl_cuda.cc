// The CUDA and NCCL side of the nccl transport (nccl.h): the communicator
// the worker drives, a job's communicator and the memory of its warm-up and
// of its sessions' regions (nccl_region.cc moves it).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "base/device_alloc.h"
#include "transport/nccl.h"
#include "transport/nccl_check.h"

namespace dmuon::transport {
namespace {

// A non-blocking communicator: joined on the worker thread at the first
// Poll; every later call waits for the previous one to leave
// ncclInProgress, as non-blocking NCCL requires.
class RealComm final : public NcclComm {
 public:
  // `scratch`: the warm-up's device memory (DaemonWarmUp), freed with this.
  RealComm(const ncclUniqueId& id, NcclRanks ranks, int device,
           double enqueue_timeout_seconds, void* scratch)
      : id_(id),
        ranks_(ranks),
        device_(device),
        enqueue_timeout_(enqueue_timeout_seconds),
        scratch_(scratch) {}
  ~RealComm() override {
    (void)cudaSetDevice(device_);
    (void)cudaFree(scratch_);
    for (auto& [marker, ev] : events_) (void)cudaEventDestroy(ev);
    for (cudaEvent_t ev : free_events_) (void)cudaEventDestroy(ev);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  absl::Status Poll() override {
    if (comm_ == nullptr) {
      if (!init_error_.ok()) return init_error_;
      init_error_ = Init();
      if (!init_error_.ok()) return init_error_;
    }
    auto idle = Idle();
    if (!idle.ok()) return idle.status();
    return *idle ? absl::OkStatus() : absl::UnavailableError("in progress");
  }

  absl::StatusOr<uint64_t> Post(
      const std::vector<NcclTransfer>& transfers) override {
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (auto st = WaitIdle(); !st.ok()) return st;
    // An empty group (an absent parameter's answer, Region::Absent) makes
    // no NCCL call: only its event marks its place in the stream.
    if (!transfers.empty()) {
      DMUON_NCCL_RETURN_IF_ERROR(ncclGroupStart());
      absl::Status first;
      for (const NcclTransfer& t : transfers) {
        first = Transfer(t);
        if (!first.ok()) break;
      }
      // The group is closed even after an error: the group state belongs to
      // this thread, which serves the device's other communicators too.
      const ncclResult_t end = ncclGroupEnd();
      if (!first.ok()) return first;
      DMUON_NCCL_RETURN_IF_ERROR(end);
      if (auto st = WaitIdle(); !st.ok()) return st;
    }
    cudaEvent_t ev = nullptr;
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    } else {
      DMUON_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    }
    DMUON_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, stream_));
    events_.push_back({++next_marker_, ev});
    return next_marker_;
  }

  absl::StatusOr<bool> Done(uint64_t marker) override {
    auto it = events_.begin();
    while (it != events_.end() && it->first < marker) ++it;
    if (it == events_.end() || it->first != marker) return true;  // retired
    const cudaError_t e = cudaEventQuery(it->second);
    if (e == cudaErrorNotReady) return false;
    DMUON_CUDA_RETURN_IF_ERROR(e);
    // Completion is in stream order: every earlier group is done too.
    while (!events_.empty() && events_.front().first <= marker) {
      free_events_.push_back(events_.front().second);
      events_.pop_front();
    }
    return true;
  }

  void Abort() override {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    init_error_ = absl::CancelledError("aborted");
  }
  // Nothing is pending here: abort is the teardown that never waits on a
  // peer.
  void Close() override { Abort(); }

 private:
  absl::Status Init() {
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DMUON_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    DMUON_NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(
        &comm_, ranks_.nranks, id_, ranks_.daemon_rank, &config));
    return absl::OkStatus();
  }

  // True: idle; false: an operation (joining, enqueuing) is in progress.
  absl::StatusOr<bool> Idle() {
    ncclResult_t state = ncclSuccess;
    DMUON_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclInProgress) return false;
    DMUON_NCCL_RETURN_IF_ERROR(state);
    return true;
  }

  absl::Status WaitIdle() {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      auto idle = Idle();
      if (!idle.ok()) return idle.status();
      if (*idle) return absl::OkStatus();
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count() > enqueue_timeout_) {
        return absl::DeadlineExceededError(
            absl::StrCat("enqueuing an NCCL group took over ", enqueue_timeout_,
                         " s: a trainer rank did not post its side (each "
                         "posts the warm-up group right after joining; a "
                         "trainer built before the warm-up never does)"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  absl::Status Transfer(const NcclTransfer& t) {
    const size_t count = t.bytes / sizeof(float);
    if (t.send) {
      DMUON_NCCL_RETURN_IF_ERROR(ncclSend(t.base + t.offset, count, ncclFloat32,
                                          t.peer, comm_, stream_));
    } else {
      DMUON_NCCL_RETURN_IF_ERROR(ncclRecv(t.base + t.offset, count, ncclFloat32,
                                          t.peer, comm_, stream_));
    }
    return absl::OkStatus();
  }

  const ncclUniqueId id_;
  const NcclRanks ranks_;
  const int device_;
  const double enqueue_timeout_;
  void* const scratch_;
  ncclComm_t comm_ = nullptr;
  absl::Status init_error_;
  cudaStream_t stream_ = nullptr;
  uint64_t next_marker_ = 0;
  std::deque<std::pair<uint64_t, cudaEvent_t>> events_;
  std::vector<cudaEvent_t> free_events_;
};

class NcclJobImpl final : public NcclJob {
 public:
  NcclJobImpl(std::string id, NcclRanks ranks, int device,
              std::shared_ptr<NcclWorker> worker, int comm)
      : id_(std::move(id)),
        ranks_(ranks),
        device_(device),
        worker_(std::move(worker)),
        comm_(comm) {}
  ~NcclJobImpl() override { worker_->Remove(comm_); }

  const std::string& unique_id() const override { return id_; }
  NcclRanks ranks() const override { return ranks_; }

  absl::StatusOr<std::unique_ptr<Region>> OpenRegion(
      int rank, const Layout& layout) override {
    if (auto st = worker_->status(comm_); !st.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job's NCCL communicator has ended (", st.message(),
                       "); close every rank and open the job again"));
    }
    DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    auto zeroed = base::MallocZeroed(layout.total_bytes);
    if (!zeroed.ok()) return zeroed.status();
    void* mem = *zeroed;
    DeviceView view;
    view.device = device_;
    view.base = static_cast<std::byte*>(mem);
    view.bytes = layout.total_bytes;
    const int device = device_;
    return NewNcclRegion(worker_, comm_, rank, layout, view, [device, mem] {
      (void)cudaSetDevice(device);
      (void)cudaFree(mem);
    });
  }

  void Abort(absl::Status why) override { worker_->Abort(comm_, why); }
  bool ended() const override { return !worker_->status(comm_).ok(); }

 private:
  const std::string id_;
  const NcclRanks ranks_;
  const int device_;
  const std::shared_ptr<NcclWorker> worker_;
  const int comm_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<NcclJob>> StartNcclJob(
    int world_size, int device, std::shared_ptr<NcclWorker> worker,
    NcclPolicy policy) {
  ncclUniqueId id;
  DMUON_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  const NcclRanks ranks = NcclRanksFor(world_size);
  DMUON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  auto zeroed = base::MallocZeroed(NcclWarmUpScratchBytes(ranks));
  if (!zeroed.ok()) return zeroed.status();
  void* scratch = *zeroed;
  const int comm = AddJobCommunicator(
      *worker,
      std::make_unique<RealComm>(id, ranks, device,
                                 policy.transfer_timeout_seconds, scratch),
      ranks, static_cast<std::byte*>(scratch));
  return std::shared_ptr<NcclJob>(
      new NcclJobImpl(std::string(id.internal, sizeof(id.internal)), ranks,
                      device, std::move(worker), comm));
}

}  // namespace dmuon::transport
