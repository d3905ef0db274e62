#include "client/session.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/protocol.h"
#include "base/trace.h"
#include "client/wire.h"
#include "proto/dmuon.grpc.pb.h"
#include "transport/doorbell.h"

namespace dmuon::client_internal {
namespace {

class SessionImpl final : public Session {
 public:
  // `region`: host memory (shm, inline); null for GPU transports.
  SessionImpl(std::shared_ptr<grpc::Channel> ch, std::string address,
              ClientOptions o, v1::OpenSessionResponse open,
              std::unique_ptr<transport::Region> region, RegionLayout layout,
              NcclInfo nccl)
      : stub_(v1::Optimizer::NewStub(ch)),
        address_(std::move(address)),
        options_(o),
        open_(std::move(open)),
        region_(std::move(region)),
        layout_(std::move(layout)),
        nccl_(std::move(nccl)),
        step_(open_.next_step()),
        n_(open_.layout().slots_size()),
        ready_(n_, 0),
        skipped_(n_, 0),
        absent_(n_, 0),
        received_ns_(n_, 0) {
    if (open_.has_doorbell() && open_.transport() == v1::TRANSPORT_SHM &&
        region_ != nullptr) {
      doorbell_.emplace(region_->bytes().data() + open_.doorbell().offset(),
                        n_);
      doorbell_seen_.assign(n_, 0);
    }
  }

  ~SessionImpl() override { (void)Close(); }

  absl::Status Start() {
    stream_ = stub_->Step(&stream_ctx_);
    v1::StepRequest a;
    a.mutable_attach()->set_session_id(open_.session_id());
    if (!stream_->Write(a)) return Finish("attach");
    reader_ = std::thread([this] { ReadLoop(); });
    return absl::OkStatus();
  }

  absl::Span<float> gradient(int i) override {
    if (i < 0 || i >= n_ || region_ == nullptr) return {};
    const auto& s = open_.layout().slots(i);
    return absl::MakeSpan(
        reinterpret_cast<float*>(region_->bytes().data() + s.gradient_offset()),
        s.bytes() / 4);
  }
  absl::Span<const float> update(int i) override {
    if (i < 0 || i >= n_ || region_ == nullptr) return {};
    const auto& s = open_.layout().slots(i);
    return absl::MakeConstSpan(reinterpret_cast<const float*>(
                                   region_->bytes().data() + s.update_offset()),
                               s.bytes() / 4);
  }
  int64_t step() const override { return step_; }
  std::string transport() const override {
    return TransportName(open_.transport());
  }
  const RegionLayout& layout() const override { return layout_; }
  const NcclInfo& nccl() const override { return nccl_; }
  bool doorbell() const override { return doorbell_.has_value(); }

  absl::Status GradientReady(int i) override { return GradientsReady({i}); }

  absl::Status CheckIds(absl::Span<const int> ids) const {
    for (int i : ids) {
      if (i < 0 || i >= n_) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter index ", i, " is outside [0, ", n_, ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status GradientsAbsent(absl::Span<const int> ids) override {
    if (absl::Status st = CheckIds(ids); !st.ok()) return st;
    std::lock_guard<std::mutex> w(write_mu_);
    if (absl::Status st = stream_status(); !st.ok()) return st;
    {
      // A daemon of minor 0 ignores absent_param_ids and would wait for these
      // gradients forever: refuse here, naming both versions.
      std::lock_guard<std::mutex> l(mu_);
      if (open_.capabilities().protocol_minor() < 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "a parameter without a gradient this step needs protocol minor 1; "
            "dmuond at ",
            address_, " (", open_.capabilities().version(), ") speaks minor ",
            open_.capabilities().protocol_minor(), ", this client ",
            ProtocolMinor(), ": upgrade the daemon"));
      }
    }
    if (RingDoorbell(ids, {}, /*absent=*/true)) return absl::OkStatus();
    v1::StepRequest m;
    m.mutable_gradients_ready()->set_step(step_);
    for (int i : ids) m.mutable_gradients_ready()->add_absent_param_ids(i);
    if (!stream_->Write(m)) return Broken();
    return absl::OkStatus();
  }

  absl::Status GradientsReady(absl::Span<const int> ids) override {
    return GradientsReadyWithMomentum(ids, {});
  }

  absl::Status GradientsReadyWithMomentum(
      absl::Span<const int> ids, absl::Span<const double> momentum) override {
    if (absl::Status st = CheckIds(ids); !st.ok()) return st;
    if (!momentum.empty() && momentum.size() != ids.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GradientsReady: ", momentum.size(),
                       " momentum values for ", ids.size(), " parameters"));
    }
    std::lock_guard<std::mutex> w(write_mu_);
    if (absl::Status st = stream_status(); !st.ok()) return st;
    if (!momentum.empty()) {
      // A daemon older than minor 2 ignores GradientsReady.momentum and
      // would use each group's momentum: refuse here, naming both versions.
      std::lock_guard<std::mutex> l(mu_);
      if (open_.capabilities().protocol_minor() < 2) {
        return absl::FailedPreconditionError(absl::StrCat(
            "a per-step momentum (a momentum other than the one the session "
            "was opened with, e.g. OneCycleLR/CyclicLR with "
            "cycle_momentum=True) needs protocol minor 2; dmuond at ",
            address_, " (", open_.capabilities().version(),
            ") speaks protocol 1.", open_.capabilities().protocol_minor(),
            ", this client 1.", ProtocolMinor(), ": upgrade the daemon"));
      }
    }
    if (open_.transport() == v1::TRANSPORT_INLINE) {
      const uint64_t max =
          transport::MaxChunkPayload(open_.capabilities().max_message_bytes());
      for (int i : ids) {
        const auto& s = open_.layout().slots(i);
        const char* base = reinterpret_cast<const char*>(
            region_->bytes().data() + s.gradient_offset());
        for (const auto& c : transport::SplitChunks(s.bytes(), max)) {
          v1::StepRequest m;
          m.mutable_gradient()->set_step(step_);
          m.mutable_gradient()->set_param_id(i);
          m.mutable_gradient()->set_offset(c.offset);
          m.mutable_gradient()->set_data(base + c.offset, c.bytes);
          if (!stream_->Write(m)) return Broken();
        }
      }
    }
    if (RingDoorbell(ids, momentum, /*absent=*/false)) return absl::OkStatus();
    v1::StepRequest m;
    m.mutable_gradients_ready()->set_step(step_);
    for (int i : ids) m.mutable_gradients_ready()->add_param_ids(i);
    for (double b : momentum) m.mutable_gradients_ready()->add_momentum(b);
    if (!stream_->Write(m)) return Broken();
    return absl::OkStatus();
  }

  // With a doorbell (and a step it can name): stores each id's declare word
  // (and momentum) after its gradient, then rings once; false: the caller
  // sends the Step message instead. write_mu_ held, ids checked.
  bool RingDoorbell(absl::Span<const int> ids,
                    absl::Span<const double> momentum, bool absent) {
    if (!doorbell_ || !transport::DoorbellStepFits(step_)) return false;
    for (size_t k = 0; k < ids.size(); ++k) {
      transport::DoorbellWord w;
      w.serial = ++declare_serial_;
      w.step = step_;
      w.flag_a = !momentum.empty();
      w.flag_b = absent;
      if (w.flag_a) doorbell_->SetMomentum(ids[k], momentum[k]);
      doorbell_->Declare(ids[k], transport::EncodeWord(w));
    }
    doorbell_->Ring();
    return true;
  }

  absl::Status WaitUpdate(int i) override {
    if (i < 0 || i >= n_)
      return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
    std::unique_lock<std::mutex> l(mu_);
    // Seen already (an earlier look took many words in): no look again.
    if (ready_[i]) return absl::OkStatus();
    if (!WaitForLocked(l,
                       [&] { return ready_[i] || !final_.ok() || ended_; })) {
      return absl::DeadlineExceededError(
          absl::StrCat("update of parameter ", i, " (step ", step_,
                       ") not back from dmuond at ", address_, " within ",
                       options_.deadline.count(), " ms"));
    }
    if (ready_[i]) return absl::OkStatus();
    return final_.ok() ? absl::AbortedError(absl::StrCat("dmuond at ", address_,
                                                         " ended the stream"))
                       : final_;
  }
  absl::StatusOr<std::vector<int>> NextAnnounced() override {
    std::unique_lock<std::mutex> l(mu_);
    // Absent parameters count as returned (nothing to receive for them).
    const auto all_returned = [&] {
      return announced_returned_ + absent_announced_ >= n_;
    };
    if (all_returned()) return std::vector<int>();
    const auto has_current = [&] {
      while (!announced_.empty() && announced_.front().first < step_)
        announced_.pop_front();  // a finished step's (never for this one)
      return !announced_.empty() && announced_.front().first == step_;
    };
    if (!WaitForLocked(l, [&] {
          return has_current() || all_returned() || !final_.ok() || ended_;
        })) {
      return absl::DeadlineExceededError(
          absl::StrCat("no update of step ", step_, " announced by dmuond at ",
                       address_, " within ", options_.deadline.count(), " ms (",
                       announced_returned_, " of ", n_,
                       " returned; with nccl, every gradient of the step "
                       "must be declared first)"));
    }
    if (!has_current() && all_returned()) return std::vector<int>();
    if (!has_current()) {
      return final_.ok() ? absl::AbortedError(absl::StrCat(
                               "dmuond at ", address_, " ended the stream"))
                         : final_;
    }
    std::vector<int> ids = std::move(announced_.front().second);
    announced_.pop_front();
    announced_returned_ += static_cast<int>(ids.size());
    return ids;
  }
  bool absent(int i) const override {
    std::lock_guard<std::mutex> l(mu_);
    return i >= 0 && i < n_ && absent_[i];
  }
  bool TryUpdate(int i) override {
    std::lock_guard<std::mutex> l(mu_);
    if (i < 0 || i >= n_) return false;
    if (!ready_[i] && doorbell_) ScanDoorbellLocked();
    return ready_[i];
  }
  int64_t update_received_ns(int i) const override {
    std::lock_guard<std::mutex> l(mu_);
    return i >= 0 && i < n_ ? received_ns_[i] : 0;
  }
  bool skipped(int i) const override {
    std::lock_guard<std::mutex> l(mu_);
    return i >= 0 && i < n_ && skipped_[i];
  }

  absl::Status FinishStep() override {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, options_.deadline, [&] {
          return complete_ >= step_ || !final_.ok() || ended_;
        })) {
      return absl::DeadlineExceededError(
          absl::StrCat("step ", step_, " not complete from dmuond at ",
                       address_, " within ", options_.deadline.count(), " ms"));
    }
    if (complete_ < step_)
      return final_.ok() ? absl::AbortedError("stream ended") : final_;
    // Every word of this step was stored before its step_complete was sent:
    // take them as seen now, so that none reads as new after a Rewind.
    if (doorbell_) ScanDoorbellLocked();
    ++step_;
    ResetStepLocked();
    return absl::OkStatus();
  }

  std::string notice() const override { return open_.notice(); }
  std::string not_durable() const override {
    std::lock_guard<std::mutex> l(mu_);
    return not_durable_;
  }

  absl::Status Rewind() override {
    std::lock_guard<std::mutex> w(write_mu_);
    if (absl::Status st = stream_status(); !st.ok()) return st;
    int64_t undone = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (open_.capabilities().protocol_minor() < 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Rewind needs protocol minor 1; dmuond at ", address_, " (",
            open_.capabilities().version(), ") speaks minor ",
            open_.capabilities().protocol_minor(), ": upgrade it"));
      }
      if (step_ <= 1 || complete_ != step_ - 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Rewind: no completed step to undo (the step being built is ",
            step_, "); call it right after FinishStep()"));
      }
      undone = --step_;
      complete_ = undone - 1;
      ResetStepLocked();
    }
    if (doorbell_ && transport::DoorbellStepFits(undone)) {
      transport::DoorbellWord w;
      w.serial = ++declare_serial_;
      w.step = undone;
      doorbell_->Rewind(transport::EncodeWord(w));
      doorbell_->Ring();
      return absl::OkStatus();
    }
    v1::StepRequest m;
    m.mutable_rewind()->set_step(undone);
    if (!stream_->Write(m)) return Broken();
    return absl::OkStatus();
  }

  absl::StatusOr<State> GetState() override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::GetStateRequest req;
    req.set_session_id(open_.session_id());
    auto reader = stub_->GetState(&ctx, req);
    State s;
    v1::StateChunk c;
    while (reader->Read(&c)) {
      if (c.has_header()) {
        s.completed_steps = c.header().completed_steps();
        for (const auto& p : c.header().parameters()) {
          s.names.push_back(p.name());
          s.shapes.push_back({p.shape().begin(), p.shape().end()});
          s.momentum.emplace_back(p.shape(0) * p.shape(1));
        }
      } else if (c.has_momentum()) {
        const auto& m = c.momentum();
        if (m.param_id() < 0 ||
            m.param_id() >= static_cast<int>(s.momentum.size()) ||
            m.offset() + m.data().size() >
                s.momentum[m.param_id()].size() * 4) {
          return absl::DataLossError(
              "GetState: a momentum chunk outside its tensor");
        }
        std::memcpy(reinterpret_cast<char*>(s.momentum[m.param_id()].data()) +
                        m.offset(),
                    m.data().data(), m.data().size());
      }
    }
    if (absl::Status st = FromGrpc(reader->Finish(), address_); !st.ok())
      return st;
    return s;
  }

  absl::StatusOr<MarkInfo> Mark(int64_t step) override {
    if (step < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Mark: step must be a completed step >= 1, or 0 for the step the "
          "job is at; got ",
          step));
    }
    if (absl::Status v = CheckFeatureMinor(
            open_, kMarkMinor,
            step == 0 ? std::string("Mark (of the step the job is at)")
                      : absl::StrCat("Mark (of step ", step, ")"),
            address_);
        !v.ok()) {
      return v;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::MarkRequest req;
    req.set_session_id(open_.session_id());
    req.set_step(step);
    v1::MarkResponse resp;
    if (absl::Status st = FromGrpc(stub_->Mark(&ctx, req, &resp), address_);
        !st.ok()) {
      return st;
    }
    MarkInfo m;
    m.step = resp.step();
    m.marks.assign(resp.marks().begin(), resp.marks().end());
    m.mark_bytes = resp.mark_bytes();
    m.not_durable = resp.not_durable();
    return m;
  }

  uint32_t daemon_protocol_minor() const override {
    return open_.capabilities().protocol_minor();
  }

  absl::Status SetState(const State& s) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::SetStateResponse resp;
    auto writer = stub_->SetState(&ctx, &resp);
    v1::StateChunk h;
    h.set_session_id(open_.session_id());
    h.mutable_header()->set_completed_steps(s.completed_steps);
    for (size_t i = 0; i < s.names.size(); ++i) {
      auto* p = h.mutable_header()->add_parameters();
      p->set_name(s.names[i]);
      for (int64_t d : s.shapes[i]) p->add_shape(d);
    }
    bool ok = writer->Write(h);
    const uint64_t max = transport::MaxChunkPayload(options_.max_message_bytes);
    for (size_t i = 0; ok && i < s.momentum.size(); ++i) {
      const uint64_t bytes = s.momentum[i].size() * 4;
      const char* base = reinterpret_cast<const char*>(s.momentum[i].data());
      for (const auto& c : transport::SplitChunks(bytes, max)) {
        v1::StateChunk m;
        m.mutable_momentum()->set_param_id(static_cast<int>(i));
        m.mutable_momentum()->set_offset(c.offset);
        m.mutable_momentum()->set_total_bytes(bytes);
        m.mutable_momentum()->set_data(base + c.offset, c.bytes);
        if (!(ok = writer->Write(m))) break;
      }
    }
    writer->WritesDone();
    absl::Status st = FromGrpc(writer->Finish(), address_);
    if (st.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      // A step left unfinished before the load (its words stored, never
      // taken) must not read as the new step's: taken as seen first.
      if (doorbell_) ScanDoorbellLocked();
      step_ = resp.completed_steps() + 1;
      ResetStepLocked();
    }
    return st;
  }

  absl::Status Close() override {
    std::lock_guard<std::mutex> w(write_mu_);
    if (closed_.exchange(true)) return absl::OkStatus();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::CloseSessionRequest req;
    req.set_session_id(open_.session_id());
    v1::CloseSessionResponse resp;
    absl::Status st = FromGrpc(stub_->CloseSession(&ctx, req, &resp), address_);
    if (st.code() == absl::StatusCode::kNotFound) {
      // The daemon closed it already (its Step stream ended) and released
      // its region since.
      st = absl::OkStatus();
      released_ = true;
    } else {
      released_ = st.ok() && resp.region_released();
    }
    stream_ctx_.TryCancel();
    if (reader_.joinable()) reader_.join();
    return st;
  }
  bool region_released() const override { return released_; }

 private:
  absl::Status stream_status() {
    std::lock_guard<std::mutex> l(mu_);
    if (!final_.ok()) return final_;
    if (ended_)
      return absl::AbortedError(
          absl::StrCat("the Step stream to dmuond at ", address_, " ended"));
    return absl::OkStatus();
  }
  absl::Status Broken() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, options_.deadline, [&] { return ended_; });
    return final_.ok() ? absl::UnavailableError(absl::StrCat(
                             "lost the Step stream to dmuond at ", address_))
                       : final_;
  }
  absl::Status Finish(const char* what) {
    return FromGrpc(stream_->Finish(), address_);
  }

  // Waits (mu_ held through `l`) until `done()`, or for the deadline:
  // false then. Without a doorbell on cv_, which ReadLoop notifies. With
  // one, the waiting thread takes the doorbell's words in itself, and
  // sleeps on its update counter counted as a waiter: dmuond wakes this
  // process only while a thread of it waits, not at every announcement
  // (each wake interrupted the trainer's core, a thread of ours woken to
  // read the words as they landed), and ReadLoop moves the counter for its
  // own news. `seen` is read before the look at the words (the order
  // DoorbellView::WaitUpdates asks for).
  template <typename Done>
  bool WaitForLocked(std::unique_lock<std::mutex>& l, Done done) {
    const auto deadline = std::chrono::steady_clock::now() + options_.deadline;
    if (!doorbell_) return cv_.wait_until(l, deadline, done);
    while (true) {
      const uint32_t seen = doorbell_->update_counter();
      ScanDoorbellLocked();
      if (done()) return true;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
      l.unlock();
      // The cap is defence only (every news moves the counter and wakes):
      // long enough that a wake lost to a bug shows as a stall in tests.
      doorbell_->WaitUpdates(seen,
                             std::min(left, std::chrono::milliseconds(2000)));
      l.lock();
    }
  }

  // Forgets the step's announcements: a new step (FinishStep, Rewind,
  // SetState). mu_ held.
  void ResetStepLocked() {
    announced_.clear();
    announced_returned_ = 0;
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(received_ns_.begin(), received_ns_.end(), 0);
    std::fill(skipped_.begin(), skipped_.end(), 0);
    std::fill(absent_.begin(), absent_.end(), 0);
    absent_announced_ = 0;
  }

  // ReadLoop's news, after it changed the state under mu_ (and released
  // it): to the waiters on cv_, and to those on the doorbell's counter.
  void Notify() {
    cv_.notify_all();
    if (doorbell_) doorbell_->PokeUpdates();
  }

  // Takes in every doorbell word dmuond stored since the last scan (the
  // marked ones: the scan costs what changed, not n words) and
  // announces the step in progress (an older step's is only marked seen),
  // as ReadLoop takes in an UpdatesReady. True when one did. mu_ held.
  bool ScanDoorbellLocked() {
    std::vector<int> ids;
    bool any = false;
    const int64_t now = TraceNowNs();
    doorbell_->TakeUpdated(&doorbell_marked_);
    for (int i : doorbell_marked_) {
      const uint64_t raw = doorbell_->update_word(i);
      if (raw == doorbell_seen_[i]) continue;
      doorbell_seen_[i] = raw;
      const transport::DoorbellWord w = transport::DecodeWord(raw);
      if (w.step != step_ || ready_[i]) continue;
      any = true;
      if (w.flag_b) {  // absent
        AbsentInLocked(i);
        continue;
      }
      skipped_[i] |= w.flag_a ? 1 : 0;  // skipped
      UpdateInLocked(i, now, &ids);
    }
    if (!ids.empty()) announced_.emplace_back(step_, std::move(ids));
    return any;
  }

  // Parameter i's update is in its slot (an updates_ready, a doorbell
  // word): WaitUpdate returns for it, and `ids` collects it for
  // NextAnnounced. mu_ held.
  void UpdateInLocked(int i, int64_t now, std::vector<int>* ids) {
    ready_[i] = 1;
    received_ns_[i] = now;
    ids->push_back(i);
  }
  // Parameter i, declared absent (no gradient this step), is answered:
  // done, nothing to receive; NextAnnounced counts it without returning
  // it. mu_ held.
  void AbsentInLocked(int i) {
    ready_[i] = 1;
    absent_[i] = 1;
    ++absent_announced_;
  }

  void ReadLoop() {
    v1::StepResponse r;
    while (stream_->Read(&r)) {
      {
        std::lock_guard<std::mutex> l(mu_);
        TakeLocked(r);
      }
      Notify();
    }
    grpc::Status st = stream_->Finish();
    {
      std::lock_guard<std::mutex> l(mu_);
      ended_ = true;
      if (final_.ok() && !st.ok() && !closed_) final_ = FromGrpc(st, address_);
    }
    Notify();
  }

  // One message of the Step stream, taken in. mu_ held.
  void TakeLocked(const v1::StepResponse& r) {
    if (r.has_update()) {
      const auto& u = r.update();
      if (u.param_id() < 0 || u.param_id() >= n_ || region_ == nullptr) return;
      const auto& s = open_.layout().slots(u.param_id());
      if (u.offset() + u.data().size() > s.bytes()) return;
      std::memcpy(region_->bytes().data() + s.update_offset() + u.offset(),
                  u.data().data(), u.data().size());
    } else if (r.has_updates_ready()) {
      std::vector<int> ids;
      const int64_t now = TraceNowNs();
      for (int i : r.updates_ready().param_ids()) {
        if (i >= 0 && i < n_) UpdateInLocked(i, now, &ids);
      }
      if (!ids.empty())
        announced_.emplace_back(r.updates_ready().step(), std::move(ids));
      for (int i : r.updates_ready().absent_param_ids()) {
        if (i >= 0 && i < n_) AbsentInLocked(i);
      }
    } else if (r.has_error()) {
      const auto& e = r.error();
      if (e.param_id() >= 0 && e.param_id() < n_ && e.skipped()) {
        skipped_[e.param_id()] = 1;
      } else {
        final_ = WithAddress(
            absl::Status(static_cast<absl::StatusCode>(e.code()), e.message()),
            address_);
      }
    } else if (r.has_step_complete()) {
      complete_ = std::max(complete_, r.step_complete().step());
      not_durable_ = r.step_complete().not_durable();
    }
  }

  std::unique_ptr<v1::Optimizer::Stub> stub_;
  const std::string address_;
  const ClientOptions options_;
  const v1::OpenSessionResponse open_;
  std::unique_ptr<transport::Region> region_;  // null: GPU transports
  const RegionLayout layout_;
  const NcclInfo nccl_;
  int64_t step_;
  const int n_;
  grpc::ClientContext stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
  std::thread reader_;
  // The doorbell (docs/protocol.md), when the daemon granted one: its update
  // words as last scanned (guarded by mu_; scanned by the waits, TryUpdate
  // and FinishStep, WaitForLocked).
  std::optional<transport::DoorbellView> doorbell_;
  std::vector<uint64_t> doorbell_seen_;
  std::vector<int> doorbell_marked_;  // ScanDoorbellLocked's, mu_ held
  // The serial of the last word this client stored (guarded by write_mu_).
  uint32_t declare_serial_ = 0;
  std::mutex write_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> ready_, skipped_, absent_;
  // By parameter: when its UpdatesReady was read (update_received_ns).
  std::vector<int64_t> received_ns_;
  // Absent parameters announced in the current step (NextAnnounced counts
  // them as returned).
  int absent_announced_ = 0;
  // UpdatesReady messages (step, ids) not yet returned by NextAnnounced, and
  // how many ids of the current step it has returned.
  std::deque<std::pair<int64_t, std::vector<int>>> announced_;
  int announced_returned_ = 0;
  int64_t complete_ = 0;
  std::string not_durable_;  // the last step_complete's
  absl::Status final_;
  bool ended_ = false;
  // Set by Close() (under write_mu_), read by the reader thread (under mu_):
  // atomic, since the two hold different locks.
  std::atomic<bool> closed_{false};
  // Close(): the daemon released the region (region_released()).
  std::atomic<bool> released_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> StartSession(
    std::shared_ptr<grpc::Channel> channel, std::string address,
    ClientOptions options, v1::OpenSessionResponse open,
    std::unique_ptr<transport::Region> region, RegionLayout layout,
    NcclInfo nccl) {
  auto s = std::make_unique<SessionImpl>(
      std::move(channel), std::move(address), options, std::move(open),
      std::move(region), std::move(layout), std::move(nccl));
  if (absl::Status st = s->Start(); !st.ok()) return st;
  return std::unique_ptr<Session>(std::move(s));
}

}  // namespace dmuon::client_internal
