#include "daemon/grpc_service.h"

#include <grpcpp/alarm.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/logging.h"
#include "server/doorbell_pump.h"
#include "transport/doorbell.h"

namespace dmuon::server {
namespace {

// CloseSession waits for the session's region to be released (every step
// computation using it ended, the mapping closed) until kReleaseMargin
// before the caller's deadline, and at most kMaxReleaseWait.
constexpr std::chrono::milliseconds kMaxReleaseWait{30000};
constexpr std::chrono::milliseconds kReleaseMargin{200};
// Statuses in log lines are cut there (they may quote a peer's job id).
constexpr size_t kMaxLoggedStatus = 1024;

}  // namespace

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()),
                      std::string(st.message()));
}

grpc::Status GrpcOptimizer::Done(const char* rpc,
                                 const grpc::ServerContextBase* ctx,
                                 const absl::Status& st) {
  if (!st.ok()) {
    service_->CountError(st);
    const std::string peer = ctx->peer();
    int64_t dropped = 0;
    if (failure_log_.Allow(peer, absl::Now(), &dropped)) {
      spdlog::warn("{} from {} failed: {}{}", rpc, peer,
                   LogSafe(st.ToString(), kMaxLoggedStatus),
                   dropped == 0
                       ? std::string()
                       : absl::StrCat(" (", dropped,
                                      " more failures from this peer were not "
                                      "logged: at most 1 a second after 20)"));
    }
  }
  return ToGrpc(st);
}

absl::StatusOr<Caller> GrpcOptimizer::Authorize(
    const grpc::ServerContextBase* ctx, const char* rpc, Role need) const {
  absl::StatusOr<Caller> caller = Caller{Role::kOperator, Principal{}, ""};
  if (auth_ != nullptr) caller = auth_->Check(*ctx, rpc, need);
  if (caller.ok()) caller->principal.peer = ctx->peer();
  return caller;
}

absl::Status GrpcOptimizer::Revoked(const std::string& digest,
                                    Role need) const {
  if (auth_ == nullptr || digest.empty()) return absl::OkStatus();
  const Role role = auth_->RoleOfDigest(digest);
  if (role == Role::kNone) {
    return absl::UnauthenticatedError(
        "the token this stream was opened with was revoked by a SIGHUP "
        "reload of --auth-token-file");
  }
  if (role < need) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a SIGHUP reload of --auth-token-file lowered the role of the token "
        "this stream was opened with to '",
        RoleName(role), "'; the stream needs '", RoleName(need),
        "' (or higher)"));
  }
  return absl::OkStatus();
}

absl::Status GrpcOptimizer::Register(RevocableStream* stream,
                                     const Caller& caller, Role need) {
  std::string host = PeerHost(caller.principal.peer);
  absl::MutexLock l(&streams_mu_);
  // Checked under the lock: a reload that ran since Authorize is seen here,
  // one that runs later finds the stream registered.
  if (!caller.token_digest.empty()) {
    if (absl::Status st = Revoked(caller.token_digest, need); !st.ok())
      return st;
  }
  int& open = per_host_[host];
  if (open >= options_.max_streams_per_peer) {
    if (open == 0) per_host_.erase(host);
    return absl::ResourceExhaustedError(absl::StrCat(
        host, " has ", open,
        " Step, GetState and SetState streams open, the most one peer may "
        "(--max-streams-per-peer=",
        options_.max_streams_per_peer, "): close some first"));
  }
  ++open;
  streams_.emplace(stream, Registered{caller.token_digest, need, host});
  return absl::OkStatus();
}

void GrpcOptimizer::Unregister(RevocableStream* stream) {
  absl::MutexLock l(&streams_mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) return;
  if (auto h = per_host_.find(it->second.host);
      h != per_host_.end() && --h->second <= 0) {
    per_host_.erase(h);
  }
  streams_.erase(it);
}

int GrpcOptimizer::EndRevokedStreams() {
  std::vector<std::pair<RevocableStream*, absl::Status>> to_finish;
  int ended = 0;
  {
    absl::MutexLock l(&streams_mu_);
    for (auto it = streams_.begin(); it != streams_.end();) {
      absl::Status st = it->second.digest.empty()
                            ? absl::OkStatus()  // no token: mTLS, anonymous
                            : Revoked(it->second.digest, it->second.need);
      if (st.ok()) {
        ++it;
        continue;
      }
      ++ended;
      // A stream that Revoke leaves to FinishRevoked is alive until then:
      // nothing else finishes it (StepReactor::Revoke).
      if (it->first->Revoke(st)) to_finish.emplace_back(it->first, st);
      if (auto h = per_host_.find(it->second.host);
          h != per_host_.end() && --h->second <= 0) {
        per_host_.erase(h);
      }
      it = streams_.erase(it);
    }
  }
  for (auto& [stream, st] : to_finish) stream->FinishRevoked(std::move(st));
  return ended;
}

// GetState's and SetState's registration while the call runs: a revocation
// flags it, the call checks the flag at each chunk.
class SyncStream final : public RevocableStream {
 public:
  SyncStream(GrpcOptimizer* owner, grpc::ServerContextBase* ctx)
      : owner_(owner), ctx_(ctx) {}
  ~SyncStream() override { owner_->Unregister(this); }
  absl::Status Register(const Caller& caller, Role need) {
    return owner_->Register(this, caller, need);
  }
  bool Revoke(absl::Status st) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    revoked_ = std::move(st);
    // A call blocked writing to a client that stopped reading (GetState)
    // or waiting for one that stopped sending (SetState) ends too; the
    // client then sees CANCELLED, and the log and counters the revocation.
    ctx_->TryCancel();
    return false;
  }
  void FinishRevoked(absl::Status) override {}
  // OK until a revocation.
  absl::Status revoked() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    return revoked_;
  }

 private:
  GrpcOptimizer* const owner_;
  grpc::ServerContextBase* const ctx_;
  absl::Mutex mu_;
  absl::Status revoked_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A Step stream's state, shared by its reactor, the reactor's worker thread
// and the service (which holds it as the session's StepSink, maybe past the
// stream). The service calls Send and Abort with a job's lock held: they
// only queue. The reactions only record what completed. The worker does
// the rest and never holds mu_ while calling the reactor or the service
// (gRPC may run a reaction inline in a Start* call; reactions take mu_).
class StepCall final : public StepSink {
 public:
  // What the worker does next (Next, Drain).
  enum class Event {
    kWrite,         // *out is set: StartWrite it
    kRead,          // the read ended (read_ok(): a message is in)
    kStartRead,     // below the queue limit again: StartRead
    kDeclared,      // *declared is set: what the session's doorbell said
    kServiceEnded,  // the service ended the stream (service_status())
    kClientGone,    // a write failed or the call was cancelled
    kDrained,       // Drain: nothing more to write
  };

  explicit StepCall(uint64_t max_queue_bytes)
      : max_queue_bytes_(max_queue_bytes) {}

  void Send(v1::StepResponse m) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (service_ended_) return;
    Push(std::move(m));
  }
  void HoldEnd() override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    ++holds_;
  }
  // Queued even after the service ended the stream: Drain waits for it.
  void SendHeld(v1::StepResponse m) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    --holds_;
    if (!client_gone_) Push(std::move(m));
  }
  void Abort(absl::Status st) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (service_ended_) return;
    if (!st.ok()) {  // in-band too, for clients that read it there
      v1::StepResponse r;
      r.mutable_error()->set_param_id(-1);
      r.mutable_error()->set_code(static_cast<int>(st.code()));
      r.mutable_error()->set_message(std::string(st.message()));
      Push(std::move(r));
    }
    service_ended_ = true;
    service_status_ = std::move(st);
  }

  // Before the first message: the first of these wins (true); the other
  // then does nothing.
  bool FirstReadDone() ABSL_LOCKS_EXCLUDED(mu_) { return Leave(); }
  bool AttachTimedOut() ABSL_LOCKS_EXCLUDED(mu_) { return Leave(); }
  bool RevokedBeforeAttach() ABSL_LOCKS_EXCLUDED(mu_) { return Leave(); }

  // Reactions.
  void ReadDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    read_pending_ = false;
    read_done_ = true;
    read_ok_ = ok;
  }
  void WriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    write_pending_ = false;
    queued_bytes_ -= in_flight_bytes_;
    in_flight_bytes_ = 0;
    if (!ok) client_gone_ = true;
  }
  void Cancelled() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    client_gone_ = true;
  }

  // The session's doorbell pump (doorbell_pump.h): a Step message it read
  // from the doorbell, or why it stopped. Taken by Next in order, between
  // the stream's reads, under the same queue limit (the pump loads again
  // only once the worker took what it posted: at most one load waits here).
  void PostDeclared(absl::StatusOr<v1::StepRequest> m)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    declared_.push_back(std::move(m));
  }
  // The worker, once the client half-closed: the next posted message
  // whatever the queue holds (the client's last declarations), or none.
  std::optional<absl::StatusOr<v1::StepRequest>> TakeDeclared()
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (declared_.empty()) return std::nullopt;
    return PopDeclared();
  }

  // The worker: a read is started (StartRead next).
  void Reading() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    read_pending_ = true;
  }
  // The worker, while the stream runs: waits for the next thing to do.
  // kRead consumes the read's end (read_ok() says how it ended).
  Event Next(v1::StepResponse* out, absl::StatusOr<v1::StepRequest>* declared)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(this, &StepCall::HasEvent));
    if (client_gone_) return Event::kClientGone;
    if (service_ended_) return Event::kServiceEnded;
    if (CanWrite()) return PopInto(out);
    if (read_done_) {
      read_done_ = false;
      return Event::kRead;
    }
    if (CanTakeDeclared()) {
      *declared = PopDeclared();
      return Event::kDeclared;
    }
    read_pending_ = true;  // CanStartRead
    return Event::kStartRead;
  }
  // The worker, once the stream ends: what is queued goes out first.
  Event Drain(v1::StepResponse* out) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    // No more responses from the service: the session is closed.
    service_ended_ = true;
    mu_.Await(absl::Condition(this, &StepCall::Drainable));
    if (!client_gone_ && CanWrite()) return PopInto(out);
    return Event::kDrained;
  }
  bool read_ok() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    return read_ok_;
  }
  absl::Status service_status() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    return service_status_;
  }

 private:
  void Push(v1::StepResponse m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t bytes = m.ByteSizeLong();
    queued_bytes_ += bytes;
    q_.emplace_back(std::move(m), bytes);
  }
  Event PopInto(v1::StepResponse* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *out = std::move(q_.front().first);
    in_flight_bytes_ = q_.front().second;
    q_.pop_front();
    write_pending_ = true;
    return Event::kWrite;
  }
  bool Leave() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (!waiting_attach_) return false;
    waiting_attach_ = false;
    return true;
  }
  bool CanWrite() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !q_.empty() && !write_pending_;
  }
  bool CanTakeDeclared() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !declared_.empty() && queued_bytes_ < max_queue_bytes_;
  }
  // The oldest posted message; declared_ is not empty.
  absl::StatusOr<v1::StepRequest> PopDeclared()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto m = std::move(declared_.front());
    declared_.pop_front();
    return m;
  }
  bool HasEvent() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return client_gone_ || service_ended_ || CanWrite() || read_done_ ||
           CanTakeDeclared() ||
           (!read_pending_ && queued_bytes_ < max_queue_bytes_);
  }
  // Finish waits for the write in flight (a client gone fails it at once)
  // and for the messages the service holds (SendHeld).
  bool Drainable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_pending_) return false;
    return client_gone_ || CanWrite() || (q_.empty() && holds_ == 0);
  }

  const uint64_t max_queue_bytes_;
  absl::Mutex mu_;
  bool waiting_attach_ ABSL_GUARDED_BY(mu_) = true;
  // Responses not yet written, with their sizes; queued_bytes_ counts them
  // and the one being written (in_flight_bytes_).
  std::deque<std::pair<v1::StepResponse, uint64_t>> q_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::StatusOr<v1::StepRequest>> declared_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t in_flight_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  int holds_ ABSL_GUARDED_BY(mu_) = 0;  // HoldEnd without SendHeld yet
  bool read_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
  bool service_ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status service_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// One Step stream. Until its first message no thread waits for it: a
// timer (--attach-timeout-seconds) ends it if none comes. The attach starts
// the worker thread (Work), which calls the service and starts every read
// and write; the reactions hand their results to it through the StepCall.
// A request is read only while the session's queued responses are under
// --max-step-queue-bytes. Finish is called once, with the stream's real
// status, whether or not a read is pending: never a cancel in its place.
// A revoked token (GrpcOptimizer::EndRevokedStreams) ends it as the timer
// does before the attach, and as the service's Abort does after it.
class StepReactor final
    : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>,
      public RevocableStream {
 public:
  StepReactor(GrpcOptimizer* owner, grpc::CallbackServerContext* ctx)
      : owner_(owner),
        ctx_(ctx),
        call_(
            std::make_shared<StepCall>(owner->options_.max_step_queue_bytes)) {
    absl::StatusOr<Caller> caller =
        owner_->Authorize(ctx, "Step", Role::kTrainer);
    absl::Status st = caller.status();
    if (st.ok()) st = owner_->Register(this, *caller, Role::kTrainer);
    if (!st.ok()) {
      (void)call_->FirstReadDone();
      Finish(owner_->Done("Step", ctx_, st));
      return;
    }
    StartRead(&req_);
    const int seconds = owner_->options_.attach_timeout_seconds;
    alarm_.Set(std::chrono::system_clock::now() + std::chrono::seconds(seconds),
               [this, call = call_, seconds](bool fired) {
                 // The reactor is alive: nothing has finished it (the
                 // first read has not ended).
                 if (!fired || !call->AttachTimedOut()) return;
                 Finish(owner_->Done(
                     "Step", ctx_,
                     absl::DeadlineExceededError(absl::StrCat(
                         "the Step stream sent no attach{session_id} within "
                         "--attach-timeout-seconds=",
                         seconds, " of its start"))));
               });
  }

  void OnReadDone(bool ok) override {
    if (attached_) {
      call_->ReadDone(ok);
      return;
    }
    attached_ = true;  // the read side's reactions never overlap
    if (!call_->FirstReadDone()) return;  // the timer finished the stream
    alarm_.Cancel();
    if (!ok) {  // closed before its first message
      Finish(grpc::Status::OK);
      return;
    }
    if (!req_.has_attach()) {
      Finish(owner_->Done(
          "Step", ctx_,
          absl::InvalidArgumentError(
              "the first Step message must be attach{session_id}")));
      return;
    }
    worker_ = std::thread([this] { Work(); });
  }
  void OnWriteDone(bool ok) override { call_->WriteDone(ok); }
  void OnCancel() override { call_->Cancelled(); }
  void OnDone() override {
    // No revocation reaches it from now on.
    owner_->Unregister(this);
    // The worker's last act was Finish; OnDone runs on a gRPC thread.
    if (worker_.joinable()) {
      if (worker_.get_id() == std::this_thread::get_id()) {
        worker_.detach();
      } else {
        worker_.join();
      }
    }
    delete this;
  }

  // Called with the registry's lock held, so the reactor is alive. Before
  // the attach, taking the stream from the timer and the first read leaves
  // its Finish to FinishRevoked; after it, the worker ends the stream as
  // for the service's Abort (the session is detached).
  bool Revoke(absl::Status st) override {
    if (call_->RevokedBeforeAttach()) return true;
    call_->Abort(std::move(st));
    return false;
  }
  void FinishRevoked(absl::Status st) override {
    Finish(owner_->Done("Step", ctx_, st));
  }

 private:
  void Work() {
    OptimizerService* const service = owner_->service_;
    const std::string id = req_.attach().session_id();
    // Revoked while the attach was read: the session is left alone.
    if (absl::Status st = call_->service_status(); !st.ok()) {
      Finish(owner_->Done("Step", ctx_, st));
      return;
    }
    std::shared_ptr<transport::Doorbell> bell;
    if (absl::Status st = service->Attach(id, call_, &bell); !st.ok()) {
      Finish(owner_->Done("Step", ctx_, st));
      return;
    }
    // The session's declarations through its doorbell, if it has one: Step
    // messages as the stream's, taken in turn below. Stopped (joined) before
    // the session is detached.
    std::unique_ptr<DoorbellPump> pump;
    if (bell != nullptr) {
      pump = std::make_unique<DoorbellPump>(
          std::move(bell), [call = call_](absl::StatusOr<v1::StepRequest> m) {
            call->PostDeclared(std::move(m));
          });
    }
    call_->Reading();
    StartRead(&req_);
    absl::Status result;  // the service refused a request
    absl::Status why;     // why the stream ended, for Detach
    absl::StatusOr<v1::StepRequest> declared;
    for (bool done = false; !done;) {
      switch (call_->Next(&writing_, &declared)) {
        case StepCall::Event::kWrite:
          StartWrite(&writing_);
          break;
        case StepCall::Event::kStartRead:
          StartRead(&req_);
          break;
        case StepCall::Event::kRead:
          if (!call_->read_ok()) {  // the client closed its side, or left
            why = ctx_->IsCancelled()
                      ? absl::CancelledError("client disconnected")
                      : absl::OkStatus();
            // A half-close: what the client declared through its doorbell
            // before it comes first, as a stream's messages would have.
            if (pump != nullptr && why.ok()) {
              result = TakeLastDeclarations(*pump, id);
              if (!result.ok()) why = result;
            }
            done = true;
          } else if (result = service->OnStepRequest(id, req_); !result.ok()) {
            why = result;
            done = true;
          }
          break;
        case StepCall::Event::kDeclared:
          result = OnDeclared(declared, id);
          pump->Taken();
          if (!result.ok()) {
            why = result;
            done = true;
          }
          break;
        case StepCall::Event::kServiceEnded:
          why = call_->service_status();
          done = true;
          break;
        case StepCall::Event::kClientGone:
        case StepCall::Event::kDrained:
          why = absl::CancelledError("client disconnected");
          done = true;
          break;
      }
    }
    pump.reset();
    // The stream is the session's lifeline: whichever way it ended, the
    // session is reclaimed (a no-op when CloseSession already did).
    if (service->Detach(id, why)) {
      spdlog::info(
          "session closed: Step stream of {} ended ({})", ctx_->peer(),
          why.ok() ? "normally" : LogSafe(why.ToString(), kMaxLoggedStatus));
    }
    while (call_->Drain(&writing_) == StepCall::Event::kWrite)
      StartWrite(&writing_);
    Finish(owner_->Done("Step", ctx_,
                        !result.ok() ? result : call_->service_status()));
  }

  // After a half-close: the pump stopped, its last load and everything
  // still queued handed to the service in order; the first refusal.
  absl::Status TakeLastDeclarations(DoorbellPump& pump, const std::string& id) {
    pump.StopAndFlush();
    while (auto m = call_->TakeDeclared()) {
      if (absl::Status st = OnDeclared(*m, id); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // A message the pump read from the doorbell, to the service as the
  // stream's would go; a pump that failed (DATA_LOSS) ends the stream alike.
  absl::Status OnDeclared(const absl::StatusOr<v1::StepRequest>& m,
                          const std::string& id) {
    return m.ok() ? owner_->service_->OnStepRequest(id, *m) : m.status();
  }

  GrpcOptimizer* const owner_;
  grpc::CallbackServerContext* const ctx_;
  const std::shared_ptr<StepCall> call_;
  grpc::Alarm alarm_;
  bool attached_ = false;     // the first read ended (OnReadDone only)
  std::thread worker_;        // set by the first OnReadDone, joined by OnDone
  v1::StepRequest req_;       // the read in progress, then the worker's
  v1::StepResponse writing_;  // the write in progress
};

grpc::Status GrpcOptimizer::OpenSession(grpc::ServerContext* ctx,
                                        const v1::OpenSessionRequest* req,
                                        v1::OpenSessionResponse* resp) {
  auto caller = Authorize(ctx, "OpenSession", Role::kTrainer);
  if (!caller.ok()) return Done("OpenSession", ctx, caller.status());
  auto r = service_->OpenSession(*req, caller->principal);
  if (r.ok()) {
    *resp = std::move(*r);
    spdlog::info(
        "session opened: job '{}' rank {}/{} transport {} parameters {} from "
        "{}",
        LogSafe(req->job_id()), req->rank(), req->world_size(),
        v1::Transport_Name(resp->transport()), req->parameters_size(),
        ctx->peer());
  }
  return Done("OpenSession", ctx, r.status());
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* GrpcOptimizer::Step(
    grpc::CallbackServerContext* ctx) {
  return new StepReactor(this, ctx);
}

grpc::Status GrpcOptimizer::GetState(
    grpc::ServerContext* ctx, const v1::GetStateRequest* req,
    grpc::ServerWriter<v1::StateChunk>* writer) {
  auto caller = Authorize(ctx, "GetState", Role::kTrainer);
  if (!caller.ok()) return Done("GetState", ctx, caller.status());
  SyncStream live(this, ctx);
  if (absl::Status st = live.Register(*caller, Role::kTrainer); !st.ok())
    return Done("GetState", ctx, st);
  // The job is held at its step boundary until `reader` goes (its steps
  // wait meanwhile); one chunk at a time is copied out of its state.
  auto reader = service_->ReadState(req->session_id(), caller->principal);
  if (!reader.ok()) return Done("GetState", ctx, reader.status());
  for (;;) {
    auto chunk = (*reader)->Next();
    if (!chunk.ok()) return Done("GetState", ctx, chunk.status());
    if (!chunk->has_value()) break;
    if (absl::Status st = live.revoked(); !st.ok())
      return Done("GetState", ctx, st);
    if (!writer->Write(**chunk)) {
      absl::Status st = live.revoked();
      return Done("GetState", ctx,
                  st.ok() ? absl::CancelledError("client went away") : st);
    }
  }
  return grpc::Status::OK;
}

grpc::Status GrpcOptimizer::SetState(grpc::ServerContext* ctx,
                                     grpc::ServerReader<v1::StateChunk>* reader,
                                     v1::SetStateResponse* resp) {
  auto caller = Authorize(ctx, "SetState", Role::kTrainer);
  if (!caller.ok()) return Done("SetState", ctx, caller.status());
  SyncStream live(this, ctx);
  if (absl::Status st = live.Register(*caller, Role::kTrainer); !st.ok())
    return Done("SetState", ctx, st);
  // The first message (session, header) is checked before anything else
  // is read: a refused stream is answered at once, the rest unread.
  v1::StateChunk c;
  if (!reader->Read(&c)) {
    if (absl::Status st = live.revoked(); !st.ok())
      return Done("SetState", ctx, st);
    return Done("SetState", ctx,
                absl::InvalidArgumentError(
                    "SetState: the first message must carry the header"));
  }
  auto w = service_->WriteState(c, caller->principal);
  if (!w.ok()) return Done("SetState", ctx, w.status());
  // Each chunk goes into the new state as it comes (the service refuses
  // one past what the header declared); none is kept as a message.
  while (reader->Read(&c)) {
    if (absl::Status st = live.revoked(); !st.ok())
      return Done("SetState", ctx, st);
    if (absl::Status st = (*w)->Add(c); !st.ok())
      return Done("SetState", ctx, st);
  }
  if (absl::Status st = live.revoked(); !st.ok())
    return Done("SetState", ctx, st);
  auto r = (*w)->Commit();
  if (r.ok()) resp->set_completed_steps(*r);
  return Done("SetState", ctx, r.status());
}

grpc::Status GrpcOptimizer::CloseSession(grpc::ServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) {
  if (auto caller = Authorize(ctx, "CloseSession", Role::kTrainer);
      !caller.ok()) {
    return Done("CloseSession", ctx, caller.status());
  }
  // Wait for the region's release until shortly before the caller's
  // deadline, and at most kMaxReleaseWait.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                        ctx->deadline() - std::chrono::system_clock::now()) -
                    kReleaseMargin;
  const auto wait = std::clamp<std::chrono::milliseconds>(
      left, std::chrono::milliseconds(0), kMaxReleaseWait);
  bool released = false;
  absl::Status st = service_->CloseSession(
      req->session_id(), std::chrono::steady_clock::now() + wait, &released);
  if (st.ok()) {
    resp->set_region_released(released);
    if (released) {
      spdlog::info("session closed by {}", ctx->peer());
    } else {
      spdlog::warn(
          "session closed by {}: its region is still in use by a step "
          "computation; told the client not to free it",
          ctx->peer());
    }
  }
  return Done("CloseSession", ctx, st);
}

grpc::Status GrpcOptimizer::Mark(grpc::ServerContext* ctx,
                                 const v1::MarkRequest* req,
                                 v1::MarkResponse* resp) {
  auto caller = Authorize(ctx, "Mark", Role::kTrainer);
  if (!caller.ok()) return Done("Mark", ctx, caller.status());
  auto r = service_->Mark(*req, caller->principal);
  if (r.ok()) {
    *resp = std::move(*r);
    if (!resp->not_durable().empty()) {
      spdlog::warn("mark of step {} kept in memory only: {}", resp->step(),
                   LogSafe(resp->not_durable(), kMaxLoggedStatus));
    }
  }
  return Done("Mark", ctx, r.status());
}

grpc::Status GrpcOptimizer::Status(grpc::ServerContext* ctx,
                                   const v1::StatusRequest*,
                                   v1::StatusResponse* resp) {
  auto caller = Authorize(ctx, "Status", Role::kReader);
  if (!caller.ok()) return Done("Status", ctx, caller.status());
  *resp = service_->Status();
  const Principal& who = caller->principal;
  if (who.name.empty() || who.any_job) return grpc::Status::OK;
  // Other principals' jobs are counted, their ids (and their sessions')
  // redacted; a job made after Status() is unknown here, so redacted too.
  const std::map<std::string, std::string> owners = service_->JobOwners();
  auto visible = [&](const std::string& job) {
    auto it = owners.find(job);
    return it != owners.end() && MaySeeJob(who, it->second);
  };
  for (auto& j : *resp->mutable_jobs())
    if (!visible(j.job_id())) j.set_job_id("(redacted)");
  for (auto& s : *resp->mutable_sessions())
    if (!visible(s.job_id())) s.set_job_id("(redacted)");
  // A snapshot error names its job (its file name is the id in hex).
  resp->clear_snapshot_errors();
  for (auto& e : service_->SnapshotErrors()) {
    resp->add_snapshot_errors(
        visible(e.job_id) ? std::move(e.message)
                          : "(redacted: a snapshot error of a job you may not "
                            "see)");
  }
  return grpc::Status::OK;
}

grpc::Status GrpcOptimizer::Drain(grpc::ServerContext* ctx,
                                  const v1::DrainRequest*,
                                  v1::DrainResponse* resp) {
  if (auto caller = Authorize(ctx, "Drain", Role::kOperator); !caller.ok())
    return Done("Drain", ctx, caller.status());
  resp->set_sessions(service_->Drain());
  spdlog::warn(
      "draining (requested by {}): new sessions refused, {} still open",
      ctx->peer(), resp->sessions());
  if (on_drain_) on_drain_();
  return grpc::Status::OK;
}

grpc::Status GrpcOptimizer::Undrain(grpc::ServerContext* ctx,
                                    const v1::UndrainRequest*,
                                    v1::UndrainResponse*) {
  if (auto caller = Authorize(ctx, "Undrain", Role::kOperator); !caller.ok())
    return Done("Undrain", ctx, caller.status());
  if (on_undrain_) {
    if (absl::Status st = on_undrain_(); !st.ok())
      return Done("Undrain", ctx, st);
  } else {
    service_->Undrain();
  }
  spdlog::warn("undrained (requested by {}): new sessions accepted",
               ctx->peer());
  return grpc::Status::OK;
}

grpc::Status GrpcOptimizer::Trace(grpc::ServerContext* ctx,
                                  const v1::TraceRequest* req,
                                  grpc::ServerWriter<v1::TraceChunk>* writer) {
  if (auto caller = Authorize(ctx, "Trace", Role::kOperator); !caller.ok())
    return Done("Trace", ctx, caller.status());
  spdlog::info("recording the step timeline for {} s (Trace, requested by {})",
               req->seconds(), ctx->peer());
  auto file = service_->CaptureTrace(req->seconds(),
                                     [ctx] { return ctx->IsCancelled(); });
  if (!file.ok()) return Done("Trace", ctx, file.status());
  // Chunks well under any message limit (gRPC's default 4 MiB).
  constexpr size_t kChunk = 1 << 20;
  for (size_t at = 0; at < file->size(); at += kChunk) {
    v1::TraceChunk c;
    c.set_data(file->substr(at, kChunk));
    if (!writer->Write(c)) {
      return Done("Trace", ctx,
                  absl::CancelledError("the Trace caller went away"));
    }
  }
  return grpc::Status::OK;
}

}  // namespace dmuon::server
