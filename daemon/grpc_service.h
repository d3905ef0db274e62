// The gRPC adapter: the only place an absl::Status becomes a grpc::Status.
// Each RPC unpacks its request, calls OptimizerService, logs and counts
// failures, and converts the result. Step streams get a queue and a writer
// thread so the service never blocks on a slow client.

#ifndef DMUON_DAEMON_GRPC_SERVICE_H_
#define DMUON_DAEMON_GRPC_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/dmuon.grpc.pb.h"
#include "server/service.h"

namespace dmuon::server {

// absl and gRPC share the canonical code numbering.
grpc::Status ToGrpc(const absl::Status& st);

class GrpcOptimizer final : public v1::Optimizer::Service {
 public:
  explicit GrpcOptimizer(OptimizerService* service) : service_(service) {}

  grpc::Status OpenSession(grpc::ServerContext* ctx,
                           const v1::OpenSessionRequest* req,
                           v1::OpenSessionResponse* resp) override;
  grpc::Status Step(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>*
                        stream) override;
  grpc::Status GetState(grpc::ServerContext* ctx,
                        const v1::GetStateRequest* req,
                        grpc::ServerWriter<v1::StateChunk>* writer) override;
  grpc::Status SetState(grpc::ServerContext* ctx,
                        grpc::ServerReader<v1::StateChunk>* reader,
                        v1::SetStateResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req,
                     v1::DrainResponse* resp) override;

  // Called with the new draining state (the daemon flips health).
  void set_on_drain(std::function<void()> f) { on_drain_ = std::move(f); }

 private:
  grpc::Status Done(const char* rpc, const grpc::ServerContext* ctx,
                    const absl::Status& st);
  OptimizerService* const service_;
  std::function<void()> on_drain_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_GRPC_SERVICE_H_
