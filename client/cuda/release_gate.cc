// ReleaseGate, GuardSession, FreeWhenReleased (release_gate.h).

#include "client/cuda/release_gate.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dmuon::gpu {

void ReleaseGate::Exported() {
  std::lock_guard<std::mutex> l(mu_);
  state_ = State::kExported;
}

void ReleaseGate::OpenFailed(const absl::Status& status) {
  std::lock_guard<std::mutex> l(mu_);
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
      state_ = State::kUnknown;
      break;
    default:
      state_ = State::kIdle;
  }
}

void ReleaseGate::Opened() {
  std::lock_guard<std::mutex> l(mu_);
  state_ = State::kOpen;
}

void ReleaseGate::Closed(bool released) {
  std::lock_guard<std::mutex> l(mu_);
  state_ = released ? State::kReleased : State::kHeld;
}

bool ReleaseGate::may_free() const {
  std::lock_guard<std::mutex> l(mu_);
  return state_ == State::kIdle || state_ == State::kReleased;
}

std::string ReleaseGate::why_not() const {
  std::lock_guard<std::mutex> l(mu_);
  switch (state_) {
    case State::kIdle:
    case State::kReleased:
      return "";
    case State::kExported:
      return "it is being exported to a daemon (OpenSession in progress)";
    case State::kUnknown:
      return "an OpenSession over it ended without the daemon's answer: the "
             "daemon may have opened the session and mapped it";
    case State::kOpen:
      return "the session over it is still open: close the session first";
    case State::kHeld:
      return "the session over it was closed without the daemon confirming "
             "that it released the region (Close failed, or a step "
             "computation still used it when the wait ran out)";
  }
  return "";
}

namespace {

// Forwards to the session; Close() reports the release to the gate.
class GuardedSession final : public Session {
 public:
  GuardedSession(std::unique_ptr<Session> inner,
                 std::shared_ptr<ReleaseGate> gate)
      : inner_(std::move(inner)), gate_(std::move(gate)) {}
  ~GuardedSession() override { (void)Close(); }

  absl::Span<float> gradient(int i) override { return inner_->gradient(i); }
  absl::Span<const float> update(int i) override { return inner_->update(i); }
  int64_t step() const override { return inner_->step(); }
  std::string transport() const override { return inner_->transport(); }
  const RegionLayout& layout() const override { return inner_->layout(); }
  const NcclInfo& nccl() const override { return inner_->nccl(); }
  absl::Status GradientReady(int i) override {
    return inner_->GradientReady(i);
  }
  absl::Status GradientsReady(absl::Span<const int> ids) override {
    return inner_->GradientsReady(ids);
  }
  absl::Status GradientsReadyWithMomentum(
      absl::Span<const int> ids, absl::Span<const double> momentum) override {
    return inner_->GradientsReadyWithMomentum(ids, momentum);
  }
  absl::Status GradientsAbsent(absl::Span<const int> ids) override {
    return inner_->GradientsAbsent(ids);
  }
  absl::StatusOr<std::vector<int>> NextAnnounced() override {
    return inner_->NextAnnounced();
  }
  absl::Status WaitUpdate(int i) override { return inner_->WaitUpdate(i); }
  bool TryUpdate(int i) override { return inner_->TryUpdate(i); }
  int64_t update_received_ns(int i) const override {
    return inner_->update_received_ns(i);
  }
  bool skipped(int i) const override { return inner_->skipped(i); }
  bool absent(int i) const override { return inner_->absent(i); }
  absl::Status FinishStep() override { return inner_->FinishStep(); }
  std::string not_durable() const override { return inner_->not_durable(); }
  std::string notice() const override { return inner_->notice(); }
  absl::Status Rewind() override { return inner_->Rewind(); }
  absl::StatusOr<State> GetState() override { return inner_->GetState(); }
  absl::Status SetState(const State& state) override {
    return inner_->SetState(state);
  }
  absl::StatusOr<MarkInfo> Mark(int64_t step) override {
    return inner_->Mark(step);
  }
  uint32_t daemon_protocol_minor() const override {
    return inner_->daemon_protocol_minor();
  }
  absl::Status Close() override {
    std::lock_guard<std::mutex> l(mu_);
    absl::Status st = inner_->Close();
    if (!reported_) {
      reported_ = true;
      gate_->Closed(inner_->region_released());
    }
    return st;
  }
  bool region_released() const override { return inner_->region_released(); }

 private:
  const std::unique_ptr<Session> inner_;
  const std::shared_ptr<ReleaseGate> gate_;
  std::mutex mu_;
  bool reported_ = false;
};

}  // namespace

std::unique_ptr<Session> GuardSession(std::unique_ptr<Session> inner,
                                      std::shared_ptr<ReleaseGate> gate) {
  gate->Opened();
  return std::make_unique<GuardedSession>(std::move(inner), std::move(gate));
}

absl::Status FreeWhenReleased(const ReleaseGate& gate,
                              const std::function<absl::Status()>& free) {
  if (!gate.may_free()) {
    return absl::FailedPreconditionError(
        absl::StrCat("exported GPU memory kept, not freed (the CUDA driver "
                     "frees it when the process exits): ",
                     gate.why_not()));
  }
  return free();
}

}  // namespace dmuon::gpu
