// GpuRank (gpu_rank.h): one cuda_ipc or nccl session over raw gRPC.

#include "benchmarks/gpu/gpu_rank.h"

#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "proto/dmuon.grpc.pb.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl_check.h"
#include "transport/transport.h"

namespace dmuon::bench {
namespace {

absl::Status FromGrpc(const grpc::Status& st, const std::string& what) {
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                      absl::StrCat(what, ": ", st.error_message()));
}

class GpuRankImpl final : public GpuRank {
 public:
  explicit GpuRankImpl(v1::Transport t) : transport_(t) {}
  ~GpuRankImpl() override {
    if (stream_) {
      ctx_->TryCancel();
      (void)stream_->Finish();
    }
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    if (base_ != nullptr) (void)cudaFree(base_);
  }

  absl::Status Init(const std::string& address, v1::OpenSessionRequest req) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = v1::Optimizer::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args));
    std::vector<transport::TensorView> views;
    for (const auto& p : req.parameters()) {
      const int64_t rows = p.sharding() == v1::SHARDING_ROWS
                               ? p.row_end() - p.row_begin()
                               : p.shape(0);
      views.push_back({rows, p.shape(1), 4});
    }
    auto layout = transport::ComputeLayout(views);
    if (!layout.ok()) return layout.status();
    layout_ = *layout;
    DMUON_CUDA_RETURN_IF_ERROR(cudaMalloc(&base_, layout_.total_bytes));
    DMUON_CUDA_RETURN_IF_ERROR(cudaMemset(base_, 0, layout_.total_bytes));
    req.set_transport(transport_);
    if (transport_ == v1::TRANSPORT_CUDA_IPC) {
      void* ev = nullptr;
      auto ex = transport::ExportCudaIpc(base_, layout_.total_bytes, &ev);
      if (!ex.ok()) return ex.status();
      event_ = static_cast<cudaEvent_t>(ev);
      auto* e = req.mutable_cuda_ipc();
      e->set_mem_handle(ex->mem_handle);
      e->set_offset(ex->offset);
      e->set_bytes(ex->bytes);
      e->set_event_handle(ex->event_handle);
      e->set_device_uuid(ex->device_uuid);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(120));
    if (auto st = stub_->OpenSession(&ctx, req, &open_); !st.ok())
      return FromGrpc(st, "OpenSession");
    if (open_.layout().total_bytes() != layout_.total_bytes) {
      return absl::InternalError(
          absl::StrCat("the daemon's layout has ", open_.layout().total_bytes(),
                       " bytes, ours ", layout_.total_bytes));
    }
    if (transport_ == v1::TRANSPORT_NCCL) {
      const v1::NcclSetup& n = open_.nccl();
      ncclUniqueId id;
      if (n.unique_id().size() != sizeof(id.internal))
        return absl::InternalError("OpenSession returned no NCCL unique id");
      std::memcpy(id.internal, n.unique_id().data(), sizeof(id.internal));
      // Blocking: returns once the daemon has joined too.
      DMUON_NCCL_RETURN_IF_ERROR(
          ncclCommInitRank(&comm_, n.nranks(), id, req.rank()));
      daemon_rank_ = n.daemon_rank();
    }
    ctx_ = std::make_unique<grpc::ClientContext>();
    stream_ = stub_->Step(ctx_.get());
    v1::StepRequest attach;
    attach.mutable_attach()->set_session_id(open_.session_id());
    if (!stream_->Write(attach))
      return absl::UnavailableError("the Step stream closed at attach");
    return absl::OkStatus();
  }

  float* gradient(int i) override {
    return reinterpret_cast<float*>(static_cast<char*>(base_) +
                                    layout_.slots[i].gradient_offset);
  }
  float* update(int i) override {
    return reinterpret_cast<float*>(static_cast<char*>(base_) +
                                    layout_.slots[i].update_offset);
  }
  int64_t elements(int i) const override {
    return layout_.slots[i].rows * layout_.slots[i].cols;
  }
  uint64_t region_bytes() const override { return layout_.total_bytes; }

  absl::StatusOr<double> Step(int64_t step,
                              const std::vector<int>& ids) override {
    const auto t0 = std::chrono::steady_clock::now();
    if (transport_ == v1::TRANSPORT_NCCL) {
      if (auto st = Group(ids, /*send=*/true); !st.ok()) return st;
    } else {
      DMUON_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, 0));
    }
    v1::StepRequest ready;
    ready.mutable_gradients_ready()->set_step(step);
    for (int id : ids) ready.mutable_gradients_ready()->add_param_ids(id);
    if (!stream_->Write(ready))
      return absl::UnavailableError("the Step stream closed");
    v1::StepResponse r;
    while (stream_->Read(&r)) {
      if (r.has_error()) {
        return absl::Status(
            static_cast<absl::StatusCode>(r.error().code()),
            absl::StrCat("parameter '", r.error().name(), "' (id ",
                         r.error().param_id(), "): ", r.error().message()));
      }
      if (r.has_updates_ready() && transport_ == v1::TRANSPORT_NCCL) {
        const auto& u = r.updates_ready().param_ids();
        if (auto st = Group({u.begin(), u.end()}, /*send=*/false); !st.ok())
          return st;
      }
      if (r.has_step_complete() && r.step_complete().step() == step) {
        DMUON_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(0));
        return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                             t0)
            .count();
      }
    }
    return FromGrpc(stream_->Finish(), "Step stream");
  }

  absl::StatusOr<std::vector<v1::StateChunk>> GetState() override {
    grpc::ClientContext ctx;
    v1::GetStateRequest req;
    req.set_session_id(open_.session_id());
    auto reader = stub_->GetState(&ctx, req);
    std::vector<v1::StateChunk> out;
    v1::StateChunk c;
    while (reader->Read(&c)) out.push_back(c);
    if (auto st = reader->Finish(); !st.ok()) return FromGrpc(st, "GetState");
    return out;
  }

  absl::StatusOr<v1::StatusResponse> Status() override {
    grpc::ClientContext ctx;
    v1::StatusResponse resp;
    if (auto st = stub_->Status(&ctx, v1::StatusRequest(), &resp); !st.ok())
      return FromGrpc(st, "Status");
    return resp;
  }

  absl::Status Close() override {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(open_.session_id());
    v1::CloseSessionResponse resp;
    if (auto st = stub_->CloseSession(&ctx, req, &resp); !st.ok())
      return FromGrpc(st, "CloseSession");
    return absl::OkStatus();
  }

 private:
  // One group of sends (gradients) or receives (updates) with the daemon, on
  // the legacy default stream, in `ids` order.
  absl::Status Group(const std::vector<int>& ids, bool send) {
    DMUON_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (int id : ids) {
      const size_t count = layout_.slots[id].bytes / sizeof(float);
      const ncclResult_t r = send ? ncclSend(gradient(id), count, ncclFloat32,
                                             daemon_rank_, comm_, 0)
                                  : ncclRecv(update(id), count, ncclFloat32,
                                             daemon_rank_, comm_, 0);
      if (r != ncclSuccess && first == ncclSuccess) first = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    DMUON_NCCL_RETURN_IF_ERROR(first);
    DMUON_NCCL_RETURN_IF_ERROR(end);
    return absl::OkStatus();
  }

  const v1::Transport transport_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
  v1::OpenSessionResponse open_;
  transport::Layout layout_;
  void* base_ = nullptr;
  cudaEvent_t event_ = nullptr;  // cuda_ipc
  ncclComm_t comm_ = nullptr;    // nccl
  int daemon_rank_ = 0;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>>
      stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuRank>> GpuRank::Open(
    const std::string& address, v1::OpenSessionRequest req,
    v1::Transport transport) {
  auto r = std::make_unique<GpuRankImpl>(transport);
  if (auto st = r->Init(address, std::move(req)); !st.ok()) return st;
  return std::unique_ptr<GpuRank>(std::move(r));
}

}  // namespace dmuon::bench
