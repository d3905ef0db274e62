// The gRPC adapter: the only place an absl::Status becomes a grpc::Status.
// Each RPC unpacks its request, calls OptimizerService, logs and counts
// failures, and converts the result. Step is a callback (reactor) stream:
// until its attach arrives no thread waits for it (a timer ends it after
// --attach-timeout-seconds); once attached, one worker thread calls the
// service and writes the queued responses, so the service never blocks on
// a slow client, and the stream can end with the service's own status
// while the client is idle (never CANCELLED in its place). A session's
// queued responses are bounded (--max-step-queue-bytes): past it the next
// request is not read (gRPC flow control pushes back). Every RPC first
// authenticates its caller and checks its role (auth.h); the caller's
// principal goes to the service, which keeps each job to its owner, and
// Status hides the ids of other principals' jobs. A stream opened with a
// token stays registered while it runs: once a SIGHUP reload has taken the
// token out of --auth-token-file (or lowered its role below the RPC's),
// EndRevokedStreams ends it (Step at once, GetState and SetState at their
// next chunk). mTLS identities are not revoked this way.

#ifndef DMUON_DAEMON_GRPC_SERVICE_H_
#define DMUON_DAEMON_GRPC_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/auth.h"
#include "daemon/log_limiter.h"
#include "proto/dmuon.grpc.pb.h"
#include "server/limits.h"
#include "server/service.h"

namespace dmuon::server {

// absl and gRPC share the canonical code numbering.
grpc::Status ToGrpc(const absl::Status& st);

// The adapter's own limits (docs/security.md "Limits"; defaults:
// server/limits.h).
struct GrpcOptions {
  // A Step stream whose first message (attach) has not come this long after
  // it started ends with DEADLINE_EXCEEDED naming --attach-timeout-seconds.
  int attach_timeout_seconds = kDefaultAttachTimeoutSeconds;
  // --max-step-queue-bytes: a session's Step responses queued and not yet
  // taken by its client; past it the stream's next request is not read
  // until the client has read below it.
  uint64_t max_step_queue_bytes = kDefaultMaxStepQueueBytes;
  // --max-streams-per-peer: Step, GetState and SetState streams open at
  // once from one peer host; one more is refused RESOURCE_EXHAUSTED.
  int max_streams_per_peer = kDefaultMaxStreamsPerPeer;
};

// A stream that a token revocation ends (the Step reactor, GetState and
// SetState calls): registered with its token's digest while it runs.
class RevocableStream {
 public:
  virtual ~RevocableStream() = default;
  // Ends the stream with `st` (not OK). Called with the registry's lock
  // held: it only flags or queues. True: the caller must then, without the
  // lock, call FinishRevoked(st) (a Step stream not attached yet).
  virtual bool Revoke(absl::Status st) = 0;
  virtual void FinishRevoked(absl::Status st) = 0;
};

class GrpcOptimizer final
    : public v1::Optimizer::WithCallbackMethod_Step<v1::Optimizer::Service> {
 public:
  // `auth` null: no authentication (every caller anonymous).
  explicit GrpcOptimizer(OptimizerService* service,
                         const Authenticator* auth = nullptr,
                         GrpcOptions options = {})
      : service_(service), auth_(auth), options_(options) {}

  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* Step(
      grpc::CallbackServerContext* ctx) override;
  grpc::Status GetState(grpc::ServerContext* ctx,
                        const v1::GetStateRequest* req,
                        grpc::ServerWriter<v1::StateChunk>* writer) override;
  grpc::Status SetState(grpc::ServerContext* ctx,
                        grpc::ServerReader<v1::StateChunk>* reader,
                        v1::SetStateResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status Mark(grpc::ServerContext* ctx, const v1::MarkRequest* req,
                    v1::MarkResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req,
                     v1::DrainResponse* resp) override;
  grpc::Status Undrain(grpc::ServerContext* ctx, const v1::UndrainRequest* req,
                       v1::UndrainResponse* resp) override;
  grpc::Status Trace(grpc::ServerContext* ctx, const v1::TraceRequest* req,
                     grpc::ServerWriter<v1::TraceChunk>* writer) override;

  // Called with the new draining state (the daemon flips health).
  void set_on_drain(std::function<void()> f) { on_drain_ = std::move(f); }
  // Undrain: undrains the service and flips health back to SERVING, or
  // refuses with an error (e.g. shutting down). Unset: only the service.
  void set_on_undrain(std::function<absl::Status()> f) {
    on_undrain_ = std::move(f);
  }

  // After the token file was re-read (SIGHUP): ends each open stream whose
  // token is gone (UNAUTHENTICATED) or whose role is now below its RPC's
  // (PERMISSION_DENIED), both naming the reload. A Step stream's session is
  // then reclaimed as for any ended stream. Returns how many were ended.
  int EndRevokedStreams() ABSL_LOCKS_EXCLUDED(streams_mu_);

 private:
  friend class StepReactor;
  friend class SyncStream;
  grpc::Status Done(const char* rpc, const grpc::ServerContextBase* ctx,
                    const absl::Status& st);
  // The caller of `rpc` if it may call it (auth.h), anonymous without auth.
  absl::StatusOr<Caller> Authorize(const grpc::ServerContextBase* ctx,
                                   const char* rpc, Role need) const;
  // Registers `stream`, opened by `caller` for an RPC that needs `need`,
  // until Unregister. Refuses, as EndRevokedStreams would end it, a token a
  // reload revoked since the stream was authorized, and RESOURCE_EXHAUSTED
  // a peer host that has max_streams_per_peer streams open.
  absl::Status Register(RevocableStream* stream, const Caller& caller,
                        Role need) ABSL_LOCKS_EXCLUDED(streams_mu_);
  void Unregister(RevocableStream* stream) ABSL_LOCKS_EXCLUDED(streams_mu_);
  // Why a stream opened with `digest`, needing `need`, may not go on; OK
  // when it may.
  absl::Status Revoked(const std::string& digest, Role need) const;
  OptimizerService* const service_;
  const Authenticator* const auth_;
  const GrpcOptions options_;
  // Done's failure lines, per peer host: a burst of 20, then 1 a second
  // (every failure is still counted in /metrics and Status).
  LogLimiter failure_log_{/*per_second=*/1, /*burst=*/20, /*max_peers=*/4096};
  std::function<void()> on_drain_;
  std::function<absl::Status()> on_undrain_;
  struct Registered {
    std::string digest;  // empty: no token (nothing to revoke)
    Role need;
    std::string host;  // PeerHost of its peer
  };
  absl::Mutex streams_mu_;
  std::map<RevocableStream*, Registered> streams_ ABSL_GUARDED_BY(streams_mu_);
  // Open streams per peer host (those of streams_).
  std::map<std::string, int> per_host_ ABSL_GUARDED_BY(streams_mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_GRPC_SERVICE_H_
