#include "daemon/grpc_service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "daemon/logging.h"

namespace dmuon::server {
namespace {

// CloseSession waits for the session's region to be released (every step
// computation using it ended, the mapping closed) until kReleaseMargin
// before the caller's deadline, and at most kMaxReleaseWait.
constexpr std::chrono::milliseconds kMaxReleaseWait{30000};
constexpr std::chrono::milliseconds kReleaseMargin{200};
// Statuses in log lines are cut there (they may quote a peer's job id).
constexpr size_t kMaxLoggedStatus = 1024;

// Step responses queued by the service, written by one thread per stream.
class QueueSink : public StepSink {
 public:
  void Send(v1::StepResponse m) override {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    q_.push_back(std::move(m));
    cv_.notify_all();
  }
  void Abort(absl::Status st) override {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    if (!st.ok()) {  // the reason travels in-band: the stream is cancelled next
      v1::StepResponse r;
      r.mutable_error()->set_param_id(-1);
      r.mutable_error()->set_code(static_cast<int>(st.code()));
      r.mutable_error()->set_message(std::string(st.message()));
      q_.push_back(std::move(r));
    }
    closed_ = true;
    status_ = st;
    cv_.notify_all();
  }
  // Writer loop: returns when closed and drained, or the client is gone.
  // A stream the service ended while the handler waits in Read is
  // cancelled, which is what unblocks that Read (the reason went in-band).
  // It is never cancelled while the handler is outside Read: the handler
  // then returns the stream's status itself (a cancel would race it, and
  // the client would get CANCELLED instead of that status).
  void Run(grpc::ServerContext* ctx,
           grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* s) {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return !q_.empty() || closed_ || stop_; });
      while (!q_.empty()) {
        v1::StepResponse m = std::move(q_.front());
        q_.pop_front();
        l.unlock();
        const bool ok = s->Write(m);
        l.lock();
        if (!ok) {
          closed_ = true;
          return;
        }
      }
      if (stop_) return;
      if (closed_) {
        if (reading_) ctx->TryCancel();
        return;
      }
    }
  }
  // The handler is about to block in Read; false: the service ended the
  // stream (do not read).
  bool BeginRead() {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return false;
    reading_ = true;
    return true;
  }
  void EndRead() {
    std::lock_guard<std::mutex> l(mu_);
    reading_ = false;
  }
  void Stop() {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  bool aborted(absl::Status* st) {
    std::lock_guard<std::mutex> l(mu_);
    *st = status_;
    return closed_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::StepResponse> q_;
  bool closed_ = false;
  bool stop_ = false;
  bool reading_ = false;  // the handler is in (or about to be in) Read
  absl::Status status_;
};

}  // namespace

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()),
                      std::string(st.message()));
}

grpc::Status GrpcOptimizer::Done(const char* rpc,
                                 const grpc::ServerContext* ctx,
                                 const absl::Status& st) {
  if (!st.ok()) {
    service_->CountError(st);
    spdlog::warn("{} from {} failed: {}", rpc, ctx->peer(),
                 LogSafe(st.ToString(), kMaxLoggedStatus));
  }
  return ToGrpc(st);
}

absl::StatusOr<Caller> GrpcOptimizer::Authorize(const grpc::ServerContext* ctx,
                                                const char* rpc,
                                                Role need) const {
  if (auth_ == nullptr) return Caller{Role::kOperator, Principal{}};
  return auth_->Check(*ctx, rpc, need);
}

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

grpc::Status GrpcOptimizer::Step(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  if (auto caller = Authorize(ctx, "Step", Role::kTrainer); !caller.ok())
    return Done("Step", ctx, caller.status());
  v1::StepRequest req;
  if (!stream->Read(&req)) return grpc::Status::OK;
  if (!req.has_attach()) {
    return Done("Step", ctx,
                absl::InvalidArgumentError(
                    "the first Step message must be attach{session_id}"));
  }
  const std::string id = req.attach().session_id();
  auto sink = std::make_shared<QueueSink>();
  if (absl::Status st = service_->Attach(id, sink); !st.ok())
    return Done("Step", ctx, st);
  std::thread writer([&] { sink->Run(ctx, stream); });
  absl::Status result;
  for (;;) {
    if (!sink->BeginRead()) break;  // the service ended the stream
    const bool got = stream->Read(&req);
    sink->EndRead();
    if (!got) break;
    result = service_->OnStepRequest(id, req);
    if (!result.ok()) break;
  }
  absl::Status aborted;
  const bool ended_by_service = sink->aborted(&aborted);
  // The stream is the session's lifeline: whichever way it ended, the
  // session is reclaimed (a no-op when CloseSession already did).
  const absl::Status why = !result.ok()       ? result
                           : ended_by_service ? aborted
                           : ctx->IsCancelled()
                               ? absl::CancelledError("client disconnected")
                               : absl::OkStatus();
  if (service_->Detach(id, why)) {
    spdlog::info(
        "session closed: Step stream of {} ended ({})", ctx->peer(),
        why.ok() ? "normally" : LogSafe(why.ToString(), kMaxLoggedStatus));
  }
  sink->Stop();
  writer.join();
  if (!result.ok()) return Done("Step", ctx, result);
  return Done("Step", ctx, aborted);
}

grpc::Status GrpcOptimizer::GetState(
    grpc::ServerContext* ctx, const v1::GetStateRequest* req,
    grpc::ServerWriter<v1::StateChunk>* writer) {
  auto caller = Authorize(ctx, "GetState", Role::kTrainer);
  if (!caller.ok()) return Done("GetState", ctx, caller.status());
  auto chunks = service_->GetState(req->session_id(), caller->principal);
  if (!chunks.ok()) return Done("GetState", ctx, chunks.status());
  for (const auto& c : *chunks) {
    if (!writer->Write(c))
      return Done("GetState", ctx, absl::CancelledError("client went away"));
  }
  return grpc::Status::OK;
}

grpc::Status GrpcOptimizer::SetState(grpc::ServerContext* ctx,
                                     grpc::ServerReader<v1::StateChunk>* reader,
                                     v1::SetStateResponse* resp) {
  auto caller = Authorize(ctx, "SetState", Role::kTrainer);
  if (!caller.ok()) return Done("SetState", ctx, caller.status());
  std::vector<v1::StateChunk> chunks;
  v1::StateChunk c;
  while (reader->Read(&c)) chunks.push_back(std::move(c));
  auto r = service_->SetState(chunks, caller->principal);
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

}  // namespace dmuon::server
