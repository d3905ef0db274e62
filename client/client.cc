#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/token.h"
#include "base/trace.h"
#include "client/session.h"
#include "client/wire.h"
#include "proto/dmuon.grpc.pb.h"
#include "transport/doorbell.h"
#include "transport/transport.h"

namespace dmuon {
namespace {

using client_internal::CheckDaemonMinor;
using client_internal::CheckLayout;
using client_internal::ExplainOpenError;
using client_internal::FromGrpc;
using client_internal::FromProto;
using client_internal::StartSession;
using client_internal::ToRequest;
using client_internal::TransportName;
using client_internal::WithAddress;

class ClientImpl : public Client {
 public:
  ClientImpl(std::string address, ClientOptions o,
             std::shared_ptr<grpc::Channel> ch)
      : address_(std::move(address)),
        options_(o),
        channel_(std::move(ch)),
        stub_(v1::Optimizer::NewStub(channel_)) {}
  const std::string& address() const override { return address_; }

  absl::StatusOr<std::vector<int>> DeviceCounts() override {
    v1::StatusResponse resp;
    grpc::Status st = WithRetries([&](grpc::ClientContext* ctx) {
      return stub_->Status(ctx, v1::StatusRequest(), &resp);
    });
    if (!st.ok()) {
      return WithAddress(
          absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                       st.error_message()),
          address_, "asking for its devices (Status)");
    }
    int healthy = 0;
    for (const auto& e : resp.executors()) healthy += e.healthy() ? 1 : 0;
    // A daemon whose every executor is unhealthy still counts as one
    // device: it is a pool member, and its own answer to OpenSession says
    // what is wrong.
    return std::vector<int>{std::max(1, healthy)};
  }

  // The bytes of an open shm session's segment: its tensors and, when the
  // daemon granted one, its doorbell, which must lie after them, aligned,
  // with the size this client computes.
  absl::StatusOr<uint64_t> ShmBytes(const v1::OpenSessionResponse& open) const {
    const uint64_t tensors = open.layout().total_bytes();
    if (!open.has_doorbell()) return tensors;
    const auto& d = open.doorbell();
    const uint64_t want = transport::DoorbellBytes(open.layout().slots_size());
    if (d.offset() < tensors || d.offset() % transport::kAlignment != 0 ||
        d.offset() > (uint64_t{1} << 62) || d.bytes() != want) {
      return absl::InternalError(absl::StrCat(
          "dmuond at ", address_, " answered doorbell {offset: ", d.offset(),
          ", bytes: ", d.bytes(),
          "}; this client expects an offset of at least ", tensors,
          ", a multiple of ", transport::kAlignment, ", and ", want,
          " bytes (docs/protocol.md \"Doorbell\")"));
    }
    return d.offset() + want;
  }

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(
      const SessionSpec& spec) override {
    auto layout = Client::ComputeRegionLayout(spec);
    if (spec.transport == TransportChoice::kCudaIpc ||
        spec.transport == TransportChoice::kNccl) {
      if (!layout.ok()) return layout.status();
      return OpenDevice(spec, *layout);
    }
    // Host transports: a table the client cannot lay out goes to the daemon
    // anyway, whose answer names the problem as for every other rank.
    const bool local = Client::IsLocalAddress(address_);
    v1::Transport t =
        spec.transport == TransportChoice::kInline ? v1::TRANSPORT_INLINE
        : spec.transport == TransportChoice::kShm  ? v1::TRANSPORT_SHM
        : local                                    ? v1::TRANSPORT_SHM
                                                   : v1::TRANSPORT_INLINE;
    v1::OpenSessionRequest req = ToRequest(spec, t);
    req.set_doorbell(t == v1::TRANSPORT_SHM && options_.doorbell);
    // The session's waits count themselves (SessionImpl::WaitForLocked).
    req.set_doorbell_waiters(req.doorbell());
    auto open = OpenChecked(req, layout);
    if (!open.ok()) return open.status();
    std::unique_ptr<transport::Region> region;
    if (t == v1::TRANSPORT_SHM) {
      auto bytes = ShmBytes(*open);
      if (!bytes.ok()) {
        CloseQuietly(open->session_id());
        return bytes.status();
      }
      auto r = transport::OpenShmRegion(open->shm_name(), *bytes);
      if (!r.ok() && spec.transport == TransportChoice::kAuto) {
        // The daemon is not on this host after all (or /dev/shm is not
        // shared with it): fall back to inline.
        CloseQuietly(open->session_id());
        open = OpenChecked(ToRequest(spec, v1::TRANSPORT_INLINE), layout);
        if (!open.ok()) return open.status();
        region = transport::NewHeapRegion(open->layout().total_bytes());
      } else if (!r.ok()) {
        CloseQuietly(open->session_id());
        return r.status();
      } else {
        region = std::move(*r);
      }
    } else {
      region = transport::NewHeapRegion(open->layout().total_bytes());
    }
    return StartSession(channel_, address_, options_, *open, std::move(region),
                        FromProto(open->layout()), NcclInfo());
  }

 private:
  // kCudaIpc / kNccl: no host region; the caller's GPU memory is laid out
  // by `layout`.
  absl::StatusOr<std::unique_ptr<Session>> OpenDevice(
      const SessionSpec& spec, const RegionLayout& layout) {
    const v1::Transport t = spec.transport == TransportChoice::kCudaIpc
                                ? v1::TRANSPORT_CUDA_IPC
                                : v1::TRANSPORT_NCCL;
    const std::string name = TransportName(t);
    if (t == v1::TRANSPORT_CUDA_IPC) {
      if (spec.cuda_ipc.mem_handle.empty()) {
        return absl::InvalidArgumentError(
            "transport cuda_ipc needs SessionSpec::cuda_ipc: the exported GPU "
            "region (mem_handle is empty; see client/client.h)");
      }
      if (spec.cuda_ipc.bytes < layout.total_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda_ipc.bytes is ", spec.cuda_ipc.bytes, " but the region needs ",
            layout.total_bytes,
            " bytes (Client::ComputeRegionLayout(spec).total_bytes)"));
      }
    }
    auto open = Open(ToRequest(spec, t));
    if (!open.ok()) {
      const absl::Status& st = open.status();
      if (st.code() == absl::StatusCode::kUnimplemented) {
        return absl::UnimplementedError(absl::StrCat(
            "dmuond at ", address_, " does not serve transport ", name, ": ",
            st.message(),
            " (GPU transports need dmuond_cuda with CUDA --devices; or use "
            "shm/inline with host copies)"));
      }
      if (st.code() == absl::StatusCode::kUnavailable ||
          st.code() == absl::StatusCode::kDeadlineExceeded) {
        return st;  // already names the address
      }
      return WithAddress(st, address_,
                         absl::StrCat("opening a ", name, " session"));
    }
    auto fail = [&](absl::Status st) {
      CloseQuietly(open->session_id());
      return st;
    };
    if (open->transport() != t) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "dmuond at ", address_, " answered a ", name,
          " session with transport ", TransportName(open->transport()))));
    }
    if (absl::Status st =
            CheckLayout(layout, FromProto(open->layout()), address_);
        !st.ok()) {
      return fail(st);
    }
    NcclInfo nccl;
    if (t == v1::TRANSPORT_NCCL) {
      nccl.unique_id = open->nccl().unique_id();
      nccl.nranks = open->nccl().nranks();
      nccl.daemon_rank = open->nccl().daemon_rank();
      if (nccl.unique_id.empty() || nccl.nranks != spec.world_size + 1 ||
          nccl.daemon_rank < 0 || nccl.daemon_rank >= nccl.nranks ||
          nccl.daemon_rank == spec.rank) {
        return fail(absl::InternalError(absl::StrCat(
            "dmuond at ", address_, " answered an nccl session with ",
            nccl.unique_id.size(), "-byte unique_id, nranks ", nccl.nranks,
            ", daemon_rank ", nccl.daemon_rank, " for rank ", spec.rank, " of ",
            spec.world_size, " (expected nranks = world_size + 1)")));
      }
    }
    return StartSession(channel_, address_, options_, *open, nullptr, layout,
                        std::move(nccl));
  }

  // Open, then the daemon's layout checked against the computed one (when
  // the client could compute it).
  absl::StatusOr<v1::OpenSessionResponse> OpenChecked(
      const v1::OpenSessionRequest& req,
      const absl::StatusOr<RegionLayout>& layout) {
    auto open = Open(req);
    if (!open.ok()) return open.status();
    if (absl::Status st =
            layout.ok()
                ? CheckLayout(*layout, FromProto(open->layout()), address_)
                : absl::OkStatus();
        !st.ok()) {
      CloseQuietly(open->session_id());
      return st;
    }
    return open;
  }

  absl::StatusOr<v1::OpenSessionResponse> Open(
      const v1::OpenSessionRequest& req) {
    v1::OpenSessionResponse resp;
    grpc::Status st = WithRetries([&](grpc::ClientContext* ctx) {
      return stub_->OpenSession(ctx, req, &resp);
    });
    if (!st.ok()) return ExplainOpenError(req, FromGrpc(st, address_));
    // An older daemon ignored what it does not know: refused here, after
    // the fact (its minor is in the answer), and its session closed.
    if (absl::Status v = CheckDaemonMinor(req, resp, address_); !v.ok()) {
      CloseQuietly(resp.session_id());
      return v;
    }
    return resp;
  }

  // Runs `call` (one RPC on the context it is given, each with the
  // deadline) again after UNAVAILABLE, up to options_.retries times with
  // doubling backoff: for calls that are safe to repeat.
  template <typename Call>
  grpc::Status WithRetries(const Call& call) {
    auto backoff = options_.backoff;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
      grpc::Status st = call(&ctx);
      if (st.ok() || st.error_code() != grpc::StatusCode::UNAVAILABLE ||
          attempt >= options_.retries) {
        return st;
      }
      std::this_thread::sleep_for(backoff);
      backoff *= 2;
    }
  }
  void CloseQuietly(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    v1::CloseSessionResponse resp;
    (void)stub_->CloseSession(&ctx, req, &resp);
  }

  const std::string address_;
  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
};

}  // namespace

bool operator==(const RegionSlot& a, const RegionSlot& b) {
  return a.rows == b.rows && a.cols == b.cols &&
         a.gradient_offset == b.gradient_offset &&
         a.update_offset == b.update_offset && a.bytes == b.bytes;
}

bool operator==(const RegionLayout& a, const RegionLayout& b) {
  return a.total_bytes == b.total_bytes && a.slots == b.slots;
}

absl::Status Session::HandOff(int i, absl::Span<const float> grad,
                              absl::Span<const double> momentum,
                              int64_t* copied_ns) {
  const std::string t = transport();
  if (t == "cuda_ipc" || t == "nccl") {
    return absl::FailedPreconditionError(absl::StrCat(
        "HandOff: a ", t, " session has no host memory: parameter ", i,
        "'s gradient goes to your GPU region (layout().slots[", i, "])"));
  }
  if (momentum.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("HandOff: ", momentum.size(),
                     " momentum values for parameter ", i, " (at most 1)"));
  }
  const absl::Span<float> dst = gradient(i);
  if (grad.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HandOff: parameter ", i, "'s gradient has ", grad.size(),
        " elements; its buffer on this rank holds ", dst.size(),
        dst.empty() ? " (or the table has no parameter of that index)" : ""));
  }
  if (!grad.empty())
    std::memcpy(dst.data(), grad.data(), grad.size() * sizeof(float));
  if (copied_ns != nullptr) *copied_ns = TraceNowNs();
  const int ids[] = {i};
  return GradientsReadyWithMomentum(ids, momentum);
}

absl::StatusOr<RegionLayout> Client::ComputeRegionLayout(
    const SessionSpec& spec) {
  std::vector<transport::TensorView> views;
  views.reserve(spec.params.size());
  for (size_t i = 0; i < spec.params.size(); ++i) {
    const ParamSpec& p = spec.params[i];
    if (p.rows <= 0 || p.cols <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' (index ", i, ") has shape [",
                       p.rows, ",", p.cols, "]: both must be positive"));
    }
    int64_t rows = p.rows;
    if (p.sharding == Sharding::kRows) {
      if (p.row_begin < 0 || p.row_end > p.rows || p.row_begin >= p.row_end) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", p.name, "' (index ", i, ") row range [", p.row_begin,
            ",", p.row_end, ") is empty or outside its ", p.rows, " rows"));
      }
      rows = p.row_end - p.row_begin;
    }
    int64_t cols = p.cols;
    if (p.sharding == Sharding::kBlocks) {
      // The daemon checks the runs (disjoint, limits, coverage); here only
      // what the local shape needs.
      auto length = [&](const std::vector<std::pair<int64_t, int64_t>>& runs,
                        int64_t n,
                        const char* what) -> absl::StatusOr<int64_t> {
        int64_t sum = 0;
        for (const auto& [b, e] : runs) {
          if (b < 0 || e > n || b >= e) {
            return absl::InvalidArgumentError(absl::StrCat(
                "parameter '", p.name, "' (index ", i, ") ", what, " run [", b,
                ",", e, ") is empty or outside its ", n, " ", what, "s"));
          }
          sum += e - b;
        }
        return sum;
      };
      auto r = length(p.row_runs, p.rows, "row");
      if (!r.ok()) return r.status();
      auto c = length(p.col_runs, p.cols, "column");
      if (!c.ok()) return c.status();
      if ((*r == 0) != (*c == 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", p.name, "' (index ", i, ") has ", p.row_runs.size(),
            " row runs and ", p.col_runs.size(),
            " column runs: both lists are empty (this rank holds nothing) "
            "or neither is"));
      }
      rows = *r;
      cols = *c;
    }
    views.push_back({rows, cols, sizeof(float)});
  }
  auto l = transport::ComputeLayout(views);
  if (!l.ok()) return l.status();
  RegionLayout out;
  out.total_bytes = l->total_bytes;
  for (const transport::Slot& s : l->slots) {
    out.slots.push_back(
        {s.rows, s.cols, s.gradient_offset, s.update_offset, s.bytes});
  }
  return out;
}

namespace {

// Adds `authorization: Bearer <token>` to every call of the channel
// (call credentials would need a TLS channel; a loopback daemon may take
// tokens in plaintext).
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->insert({"authorization", *header_});
    }
    m->Proceed();
  }

 private:
  const std::string* const header_;
};

class BearerFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerFactory(const std::string& token)
      : header_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel
};

absl::StatusOr<std::string> ReadPem(const char* what, const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  std::stringstream ss;
  if (in) ss << in.rdbuf();
  if (!in || ss.str().empty())
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, ": cannot read it"));
  return ss.str();
}

// The channel of `options`: credentials, TLS files, the bearer token.
absl::StatusOr<std::shared_ptr<grpc::Channel>> NewChannel(
    const std::string& address, const ClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> creds = options.credentials;
  grpc::ChannelArguments args;
  if (!creds && !options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    auto ca = ReadPem("TLS CA file", options.tls_ca_file);
    auto cert = ReadPem("TLS certificate file", options.tls_cert_file);
    auto key = ReadPem("TLS key file", options.tls_key_file);
    for (const auto* r : {&ca, &cert, &key})
      if (!r->ok()) return r->status();
    ssl.pem_root_certs = *ca;
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
    creds = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty())
      args.SetSslTargetNameOverride(options.tls_server_name);
  } else if (!creds && !options.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "a TLS client certificate needs the CA file of dmuond's certificate "
        "(tls_ca_file, DMUON_TLS_CA_FILE)");
  }
  if (!creds) creds = grpc::InsecureChannelCredentials();
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.token.empty())
    return grpc::CreateCustomChannel(address, creds, args);
  // gRPC aborts the process on a header value it cannot send.
  if (absl::Status st =
          CheckToken(options.token, "the token (token, DMUON_TOKEN)");
      !st.ok()) {
    return st;
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<BearerFactory>(options.token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, creds, args, std::move(interceptors));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& address, ClientOptions options) {
  if (absl::Status st = CheckAddress(address); !st.ok()) return st;
  auto channel = NewChannel(address, options);
  if (!channel.ok()) return channel.status();
  std::shared_ptr<grpc::Channel> ch = *std::move(channel);
  const std::chrono::milliseconds wait = options.connect_deadline.count() > 0
                                             ? options.connect_deadline
                                             : options.deadline;
  if (!ch->WaitForConnected(std::chrono::system_clock::now() + wait)) {
    return absl::UnavailableError(absl::StrCat(
        "dmuond at ", address, " is not reachable (waited ", wait.count(),
        " ms); is it running? start it with `dmuond --listen=", address, "`"));
  }
  return std::unique_ptr<Client>(
      new ClientImpl(address, options, std::move(ch)));
}

}  // namespace dmuon
