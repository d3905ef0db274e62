#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/dmuon.grpc.pb.h"
#include "transport/transport.h"

namespace dmuon {
namespace {

absl::Status FromGrpc(const grpc::Status& st, const std::string& address) {
  if (st.ok()) return absl::OkStatus();
  std::string msg = st.error_message();
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
      st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    msg = absl::StrCat("dmuond at ", address, ": ", msg);
  }
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), msg);
}

// The name a user writes ("cuda_ipc"), for messages and Session::transport().
std::string TransportName(v1::Transport t) {
  switch (t) {
    case v1::TRANSPORT_SHM:
      return "shm";
    case v1::TRANSPORT_INLINE:
      return "inline";
    case v1::TRANSPORT_CUDA_IPC:
      return "cuda_ipc";
    case v1::TRANSPORT_NCCL:
      return "nccl";
    default:
      return "unspecified";
  }
}

RegionLayout FromProto(const v1::RegionLayout& p) {
  RegionLayout l;
  l.total_bytes = p.total_bytes();
  for (const auto& t : p.slots()) {
    RegionSlot s;
    s.rows = t.local_shape_size() > 0 ? t.local_shape(0) : 0;
    s.cols = t.local_shape_size() > 1 ? t.local_shape(1) : 0;
    s.gradient_offset = t.gradient_offset();
    s.update_offset = t.update_offset();
    s.bytes = t.bytes();
    l.slots.push_back(s);
  }
  return l;
}

// INTERNAL when the daemon's layout is not the one the client computed (a
// GPU caller sized and exported its memory by the latter).
absl::Status CheckLayout(const RegionLayout& want, const RegionLayout& got,
                         const std::string& address) {
  if (want == got) return absl::OkStatus();
  std::string where;
  if (want.slots.size() != got.slots.size()) {
    where =
        absl::StrCat(got.slots.size(), " slots, expected ", want.slots.size());
  } else {
    for (size_t i = 0; i < want.slots.size() && where.empty(); ++i) {
      const RegionSlot &a = want.slots[i], &b = got.slots[i];
      if (a == b) continue;
      where = absl::StrCat("slot ", i, " is ", b.rows, "x", b.cols,
                           " at gradient offset ", b.gradient_offset,
                           ", update offset ", b.update_offset, "; expected ",
                           a.rows, "x", a.cols, " at ", a.gradient_offset, ", ",
                           a.update_offset);
    }
  }
  return absl::InternalError(
      absl::StrCat("dmuond at ", address, " laid out the session's region in ",
                   got.total_bytes, " bytes; the client computed ",
                   want.total_bytes, " bytes (Client::ComputeRegionLayout)",
                   where.empty() ? "" : absl::StrCat(": ", where),
                   "; the client and the daemon disagree on the protocol"));
}

// The numeric addresses `host` resolves to (empty when it does not).
std::set<std::string> Addresses(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, buf, sizeof(buf), nullptr, 0,
                    NI_NUMERICHOST) == 0) {
      out.insert(buf);
    }
  }
  freeaddrinfo(res);
  return out;
}

v1::OpenSessionRequest ToRequest(const SessionSpec& spec, v1::Transport t) {
  v1::OpenSessionRequest r;
  r.set_protocol_version(v1::PROTOCOL_VERSION_1);
  r.set_job_id(spec.job_id);
  r.set_rank(spec.rank);
  r.set_world_size(spec.world_size);
  r.set_transport(t);
  if (t == v1::TRANSPORT_CUDA_IPC) {
    auto* e = r.mutable_cuda_ipc();
    e->set_mem_handle(spec.cuda_ipc.mem_handle);
    e->set_offset(spec.cuda_ipc.offset);
    e->set_bytes(spec.cuda_ipc.bytes);
    e->set_event_handle(spec.cuda_ipc.event_handle);
    e->set_device_uuid(spec.cuda_ipc.device_uuid);
  }
  for (const GroupSpec& g : spec.groups) {
    auto* x = r.add_groups();
    x->set_momentum(g.momentum);
    x->set_nesterov(g.nesterov);
    x->set_ns_steps(g.ns_steps);
    x->set_schedule(g.schedule);
    for (const auto& c : g.coefficients) {
      auto* k = x->add_coefficients();
      k->set_a(c[0]);
      k->set_b(c[1]);
      k->set_c(c[2]);
    }
    x->set_method(g.method);
    x->set_adjust_lr_fn(g.adjust_lr_fn);
    x->set_eps(g.eps);
  }
  for (const ParamSpec& p : spec.params) {
    auto* s = r.add_parameters();
    s->set_name(p.name);
    s->add_shape(p.rows);
    s->add_shape(p.cols);
    s->set_dtype(v1::DTYPE_F32);
    s->set_sharding(p.sharding == Sharding::kRows ? v1::SHARDING_ROWS
                    : p.sharding == Sharding::kUnreduced
                        ? v1::SHARDING_UNREDUCED
                        : v1::SHARDING_REPLICATED);
    s->set_row_begin(p.row_begin);
    s->set_row_end(p.row_end);
    s->set_forward_order(p.forward_order);
    s->set_group(p.group);
    if (p.layer >= 0) s->set_layer(p.layer);
  }
  return r;
}

class SessionImpl : public Session {
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
        received_(n_, 0) {}

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

  absl::Status GradientReady(int i) override { return GradientsReady({i}); }

  absl::Status GradientsReady(absl::Span<const int> ids) override {
    for (int i : ids) {
      if (i < 0 || i >= n_) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter index ", i, " is outside [0, ", n_, ")"));
      }
    }
    std::lock_guard<std::mutex> w(write_mu_);
    if (absl::Status st = stream_status(); !st.ok()) return st;
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
    v1::StepRequest m;
    m.mutable_gradients_ready()->set_step(step_);
    for (int i : ids) m.mutable_gradients_ready()->add_param_ids(i);
    if (!stream_->Write(m)) return Broken();
    return absl::OkStatus();
  }

  absl::Status WaitUpdate(int i) override {
    if (i < 0 || i >= n_)
      return absl::InvalidArgumentError(absl::StrCat("parameter index ", i));
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, options_.deadline,
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
    if (announced_returned_ >= n_) return std::vector<int>();
    const auto has_current = [&] {
      while (!announced_.empty() && announced_.front().first < step_)
        announced_.pop_front();  // a finished step's (never for this one)
      return !announced_.empty() && announced_.front().first == step_;
    };
    if (!cv_.wait_for(l, options_.deadline, [&] {
          return has_current() || !final_.ok() || ended_;
        })) {
      return absl::DeadlineExceededError(
          absl::StrCat("no update of step ", step_, " announced by dmuond at ",
                       address_, " within ", options_.deadline.count(), " ms (",
                       announced_returned_, " of ", n_,
                       " returned; with nccl, every gradient of the step "
                       "must be declared first)"));
    }
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
  bool TryUpdate(int i) override {
    std::lock_guard<std::mutex> l(mu_);
    return i >= 0 && i < n_ && ready_[i];
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
    ++step_;
    announced_.clear();
    announced_returned_ = 0;
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(skipped_.begin(), skipped_.end(), 0);
    std::fill(received_.begin(), received_.end(), 0);
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
    if (st.ok()) step_ = resp.completed_steps() + 1;
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

  void ReadLoop() {
    v1::StepResponse r;
    while (stream_->Read(&r)) {
      std::lock_guard<std::mutex> l(mu_);
      if (r.has_update()) {
        const auto& u = r.update();
        if (u.param_id() < 0 || u.param_id() >= n_ || region_ == nullptr)
          continue;
        const auto& s = open_.layout().slots(u.param_id());
        if (u.offset() + u.data().size() > s.bytes()) continue;
        std::memcpy(region_->bytes().data() + s.update_offset() + u.offset(),
                    u.data().data(), u.data().size());
      } else if (r.has_updates_ready()) {
        std::vector<int> ids;
        for (int i : r.updates_ready().param_ids()) {
          if (i < 0 || i >= n_) continue;
          ready_[i] = 1;
          ids.push_back(i);
        }
        if (!ids.empty())
          announced_.emplace_back(r.updates_ready().step(), std::move(ids));
      } else if (r.has_error()) {
        const auto& e = r.error();
        if (e.param_id() >= 0 && e.param_id() < n_ && e.skipped()) {
          skipped_[e.param_id()] = 1;
        } else {
          final_ = absl::Status(
              static_cast<absl::StatusCode>(e.code()),
              absl::StrCat(e.message(), " (dmuond at ", address_, ")"));
        }
      } else if (r.has_step_complete()) {
        complete_ = std::max(complete_, r.step_complete().step());
      }
      cv_.notify_all();
    }
    grpc::Status st = stream_->Finish();
    std::lock_guard<std::mutex> l(mu_);
    ended_ = true;
    if (final_.ok() && !st.ok() && !closed_) final_ = FromGrpc(st, address_);
    cv_.notify_all();
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
  std::mutex write_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> ready_, skipped_;
  std::vector<uint64_t> received_;
  // UpdatesReady messages (step, ids) not yet returned by NextAnnounced, and
  // how many ids of the current step it has returned.
  std::deque<std::pair<int64_t, std::vector<int>>> announced_;
  int announced_returned_ = 0;
  int64_t complete_ = 0;
  absl::Status final_;
  bool ended_ = false;
  // Set by Close() (under write_mu_), read by the reader thread (under mu_):
  // atomic, since the two hold different locks.
  std::atomic<bool> closed_{false};
  // Close(): the daemon released the region (region_released()).
  std::atomic<bool> released_{false};
};

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
      return absl::Status(
          static_cast<absl::StatusCode>(st.error_code()),
          absl::StrCat("asking dmuond at ", address_,
                       " for its devices (Status): ", st.error_message()));
    }
    int healthy = 0;
    for (const auto& e : resp.executors()) healthy += e.healthy() ? 1 : 0;
    // A daemon whose every executor is unhealthy still counts as one
    // device: it is a pool member, and its own answer to OpenSession says
    // what is wrong.
    return std::vector<int>{std::max(1, healthy)};
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
    auto open = OpenChecked(ToRequest(spec, t), layout);
    if (!open.ok()) return open.status();
    std::unique_ptr<transport::Region> region;
    if (t == v1::TRANSPORT_SHM) {
      auto r = transport::OpenShmRegion(open->shm_name(),
                                        open->layout().total_bytes());
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
    auto s = std::make_unique<SessionImpl>(
        channel_, address_, options_, *open, std::move(region),
        FromProto(open->layout()), NcclInfo());
    if (absl::Status st = s->Start(); !st.ok()) return st;
    return std::unique_ptr<Session>(std::move(s));
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
      return absl::Status(
          st.code(), absl::StrCat("opening a ", name, " session on dmuond at ",
                                  address_, ": ", st.message()));
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
    auto s = std::make_unique<SessionImpl>(channel_, address_, options_, *open,
                                           nullptr, layout, std::move(nccl));
    if (absl::Status st = s->Start(); !st.ok()) return st;
    return std::unique_ptr<Session>(std::move(s));
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
    if (!st.ok()) return FromGrpc(st, address_);
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

bool Client::IsLocalAddress(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return true;
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1" || host == "0.0.0.0" ||
      host.rfind("127.", 0) == 0) {
    return true;
  }
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return false;
  if (host == name) return true;
  const std::set<std::string> mine = Addresses(name);
  for (const std::string& a : Addresses(host))
    if (mine.count(a) > 0) return true;
  return false;
}

bool operator==(const RegionSlot& a, const RegionSlot& b) {
  return a.rows == b.rows && a.cols == b.cols &&
         a.gradient_offset == b.gradient_offset &&
         a.update_offset == b.update_offset && a.bytes == b.bytes;
}

bool operator==(const RegionLayout& a, const RegionLayout& b) {
  return a.total_bytes == b.total_bytes && a.slots == b.slots;
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
    views.push_back({rows, p.cols, sizeof(float)});
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

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& address, ClientOptions options) {
  auto creds = options.credentials ? options.credentials
                                   : grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  auto ch = grpc::CreateCustomChannel(address, creds, args);
  if (!ch->WaitForConnected(std::chrono::system_clock::now() +
                            options.deadline)) {
    return absl::UnavailableError(absl::StrCat(
        "dmuond at ", address, " is not reachable (waited ",
        options.deadline.count(),
        " ms); is it running? start it with `dmuond --listen=", address, "`"));
  }
  return std::unique_ptr<Client>(
      new ClientImpl(address, options, std::move(ch)));
}

}  // namespace dmuon
