#include "client/wire.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/protocol.h"

namespace dmuon::client_internal {

absl::Status WithAddress(const absl::Status& status, absl::string_view address,
                         absl::string_view doing) {
  if (status.ok()) return status;
  return absl::Status(
      status.code(), absl::StrCat("dmuond at ", address, ": ", doing,
                                  doing.empty() ? "" : ": ", status.message()));
}

absl::Status FromGrpc(const grpc::Status& st, const std::string& address) {
  if (st.ok()) return absl::OkStatus();
  absl::Status s(static_cast<absl::StatusCode>(st.error_code()),
                 st.error_message());
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
      st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return WithAddress(s, address);
  }
  return s;
}

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

v1::OpenSessionRequest ToRequest(const SessionSpec& spec, v1::Transport t) {
  v1::OpenSessionRequest r;
  r.set_protocol_version(v1::PROTOCOL_VERSION_1);
  r.set_protocol_minor(ProtocolMinor());
  r.set_client_version(kDmuonVersion);
  switch (spec.resume) {
    case Resume::kAuto:
      r.set_resume(v1::RESUME_UNSPECIFIED);
      break;
    case Resume::kFresh:
      r.set_resume(v1::RESUME_FRESH);
      break;
    case Resume::kContinue:
      r.set_resume(v1::RESUME_CONTINUE);
      break;
    case Resume::kReplace:
      r.set_resume(v1::RESUME_REPLACE);
      break;
  }
  r.set_resume_step(spec.resume_step);
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
    switch (p.sharding) {
      case Sharding::kRows:
        s->set_sharding(v1::SHARDING_ROWS);
        break;
      case Sharding::kUnreduced:
        s->set_sharding(v1::SHARDING_UNREDUCED);
        break;
      case Sharding::kBlocks:
        s->set_sharding(v1::SHARDING_BLOCKS);
        break;
      case Sharding::kReplicated:
        s->set_sharding(v1::SHARDING_REPLICATED);
        break;
    }
    s->set_row_begin(p.row_begin);
    s->set_row_end(p.row_end);
    if (p.sharding == Sharding::kBlocks) {
      for (const auto& [b, e] : p.row_runs) {
        auto* x = s->add_row_runs();
        x->set_begin(b);
        x->set_end(e);
      }
      for (const auto& [b, e] : p.col_runs) {
        auto* x = s->add_col_runs();
        x->set_begin(b);
        x->set_end(e);
      }
    }
    s->set_forward_order(p.forward_order);
    s->set_group(p.group);
    if (p.layer >= 0) s->set_layer(p.layer);
  }
  return r;
}

namespace {

// The first parameter sent as SHARDING_BLOCKS, or nullptr.
const v1::ParameterSpec* FirstBlocks(const v1::OpenSessionRequest& req) {
  for (const auto& p : req.parameters()) {
    if (p.sharding() == v1::SHARDING_BLOCKS) return &p;
  }
  return nullptr;
}

}  // namespace

uint32_t RequiredMinor(const v1::OpenSessionRequest& req) {
  if (req.resume_step() != 0) return 4;
  if (FirstBlocks(req) != nullptr) return 3;
  return req.resume() != v1::RESUME_UNSPECIFIED ? 1 : 0;
}

absl::Status CheckDaemonMinor(const v1::OpenSessionRequest& req,
                              const v1::OpenSessionResponse& resp,
                              const std::string& address) {
  const uint32_t need = RequiredMinor(req);
  const uint32_t has = resp.capabilities().protocol_minor();
  if (has >= need) return absl::OkStatus();
  if (const v1::ParameterSpec* b = FirstBlocks(req); b != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dmuond at ", address, " (version ", resp.capabilities().version(),
        ") speaks protocol 1.", has, "; this client (version ", kDmuonVersion,
        ", protocol 1.", ProtocolMinor(), ") sends parameter '", b->name(),
        "' as SHARDING_BLOCKS (a DTensor's local shard), which needs protocol "
        "1.",
        need,
        " (an older daemon does not know it): upgrade dmuond, or route the "
        "DTensor parameters to AdamW. The session it opened was closed "
        "unused"));
  }
  if (req.resume_step() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dmuond at ", address, " (version ", resp.capabilities().version(),
        ") speaks protocol 1.", has, "; this client (version ", kDmuonVersion,
        ", protocol 1.", ProtocolMinor(), ") asked to resume at step ",
        req.resume_step(), ", which needs protocol 1.", need,
        " (an older daemon ignores it and continues from whatever step the "
        "job is at): upgrade dmuond, or open without a resume step. The "
        "session it opened was closed unused"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "dmuond at ", address, " (version ", resp.capabilities().version(),
      ") speaks protocol 1.", has, "; this client (version ", kDmuonVersion,
      ", protocol 1.", ProtocolMinor(), ") asked for ",
      v1::Resume_Name(req.resume()), ", which needs protocol 1.", need,
      " (an older daemon ignores it and would continue or start the job "
      "regardless): upgrade dmuond, or open without a resume mode "
      "(Resume::kAuto; Python: resume=\"auto\"). The session it opened was "
      "closed unused"));
}

absl::Status CheckFeatureMinor(const v1::OpenSessionResponse& open,
                               uint32_t need, absl::string_view feature,
                               const std::string& address) {
  const uint32_t has = open.capabilities().protocol_minor();
  if (has >= need) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "dmuond at ", address, " (version ", open.capabilities().version(),
      ") speaks protocol 1.", has, "; this client (version ", kDmuonVersion,
      ", protocol 1.", ProtocolMinor(), ") asked for ", feature,
      ", which needs protocol 1.", need,
      " (an older daemon does not know it): upgrade dmuond. Nothing was "
      "sent"));
}

absl::Status ExplainOpenError(const v1::OpenSessionRequest& req,
                              const absl::Status& status) {
  const v1::ParameterSpec* b = FirstBlocks(req);
  if (b == nullptr || status.code() != absl::StatusCode::kInvalidArgument ||
      !absl::StrContains(
          status.message(),
          absl::StrCat("sharding ", v1::SHARDING_BLOCKS, " is unknown"))) {
    return status;
  }
  return absl::Status(
      status.code(),
      absl::StrCat(status.message(), " (this client, version ", kDmuonVersion,
                   ", sends parameter '", b->name(),
                   "' as SHARDING_BLOCKS, a DTensor's local shard, which needs "
                   "protocol 1.3: upgrade dmuond, or route the DTensor "
                   "parameters to AdamW)"));
}

}  // namespace dmuon::client_internal
