// The daemon's side of an nccl session (nccl.h NewNcclRegion) and a job's
// communicator with its warm-up (AddJobCommunicator): plain C++ over the
// worker; the memory is only an address here (nccl_cuda.cc allocates it).

#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/nccl.h"

namespace dmuon::transport {
namespace {

class NcclRegion final : public Region {
 public:
  NcclRegion(std::shared_ptr<NcclWorker> worker, int comm, int rank,
             Layout layout, DeviceView view, std::function<void()> free_memory)
      : worker_(std::move(worker)),
        comm_(comm),
        rank_(rank),
        layout_(std::move(layout)),
        view_(view),
        free_memory_(std::move(free_memory)),
        order_(static_cast<int>(layout_.slots.size())) {}
  ~NcclRegion() override {
    // The job's communicator ends with any of its sessions: nothing may
    // still move this memory when it is freed.
    worker_->AbortAndWait(
        comm_, absl::CancelledError(absl::StrCat(
                   "rank ", rank_,
                   "'s session closed; the job's NCCL communicator ended")));
    std::vector<Held> held;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [token, h] : held_) held.push_back(std::move(h));
      held_.clear();
    }
    for (Held& h : held) h.done(absl::CancelledError("session closed"));
    if (free_memory_) free_memory_();
  }

  absl::Span<std::byte> bytes() override { return {}; }
  absl::Status Check() const override { return worker_->status(comm_); }
  const std::string& name() const override { return name_; }
  const DeviceView* device() const override { return &view_; }
  bool moves_data() const override { return true; }

  void Pull(int64_t step, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    absl::MutexLock lock(&mu_);
    worker_->Submit(comm_, WithBase(GradientReceives(layout_, rank_, params)),
                    nullptr, std::move(done));
    Release(order_.GradientsPosted(step, static_cast<int>(params.size())));
  }

  // Absent parameters: no receive (the client sent nothing), but they count
  // among the step's gradients, so the held update sends can go once the
  // last of them is declared.
  void Absent(int64_t step, int count) override {
    absl::MutexLock lock(&mu_);
    Release(order_.GradientsPosted(step, count));
  }

  void Push(int64_t step, std::vector<int> params,
            std::function<void(absl::Status)> done) override {
    absl::MutexLock lock(&mu_);
    const uint64_t token = ++next_token_;
    auto transfers = WithBase(UpdateSends(layout_, rank_, params));
    if (order_.MayPush(step, token)) {
      worker_->Submit(comm_, std::move(transfers), std::move(done), nullptr);
    } else {
      held_[token] = {std::move(transfers), std::move(done)};
    }
  }

 private:
  struct Held {
    std::vector<NcclTransfer> transfers;
    std::function<void(absl::Status)> done;
  };
  // Submits the held pushes `tokens`, in order.
  void Release(const std::vector<uint64_t>& tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (uint64_t token : tokens) {
      auto it = held_.find(token);
      worker_->Submit(comm_, std::move(it->second.transfers),
                      std::move(it->second.done), nullptr);
      held_.erase(it);
    }
  }
  std::vector<NcclTransfer> WithBase(std::vector<NcclTransfer> t) const {
    for (NcclTransfer& x : t) x.base = view_.base;
    return t;
  }

  const std::shared_ptr<NcclWorker> worker_;
  const int comm_;
  const int rank_;
  const Layout layout_;
  const DeviceView view_;
  const std::function<void()> free_memory_;
  const std::string name_;
  absl::Mutex mu_;  // the order of Submit calls is the posting order
  ExchangeOrder order_ ABSL_GUARDED_BY(mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int AddJobCommunicator(NcclWorker& worker, std::unique_ptr<NcclComm> comm,
                       NcclRanks ranks, std::byte* scratch) {
  const int id = worker.Add(std::move(comm));
  // No one else knows `id` yet: this is the communicator's first group. A
  // failure of it fails the communicator, which everything later hears of.
  worker.Submit(id, DaemonWarmUp(ranks, scratch), nullptr, nullptr);
  return id;
}

std::unique_ptr<Region> NewNcclRegion(std::shared_ptr<NcclWorker> worker,
                                      int comm, int rank, Layout layout,
                                      DeviceView view,
                                      std::function<void()> free_memory) {
  return std::make_unique<NcclRegion>(std::move(worker), comm, rank,
                                      std::move(layout), view,
                                      std::move(free_memory));
}

}  // namespace dmuon::transport
