// OpenSession's request and response, nothing about jobs: the request's own
// checks and limits (ValidateOpen, CheckLimits), the tuning of a new job's
// table (TuneTable, run without the service's lock), and the response's
// session, layout and capabilities (FillOpenResponse). The open itself, with
// the job it joins or makes, is service_open.cc.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/protocol.h"
#include "kernels/cost_model.h"
#include "server/job.h"
#include "server/resume_step.h"
#include "server/service.h"
#include "transport/doorbell.h"

namespace dmuon::server {
absl::Status OptimizerService::CheckLimits(
    const v1::OpenSessionRequest& req) const {
  const std::string& id = req.job_id();
  if (id.size() > static_cast<size_t>(options_.max_job_id_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id is ", id.size(), " bytes; at most ",
                     options_.max_job_id_bytes, " (--max-job-id-bytes)"));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "job_id '%s' has byte 0x%02x at %d: job ids are printable ASCII "
          "(0x20-0x7e: letters, digits, space, punctuation)",
          absl::CHexEscape(id.substr(0, 64)), c, i));
    }
  }
  if (req.world_size() > options_.max_world_size) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "world_size ", req.world_size(), " is over this daemon's limit of ",
        options_.max_world_size, " ranks per job (--max-world-size)"));
  }
  if (req.parameters_size() > options_.max_job_parameters) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the table has ", req.parameters_size(),
        " parameters; this daemon takes at most ", options_.max_job_parameters,
        " per job (--max-job-parameters)"));
  }
  // Malformed shapes are BuildTable's to report; here only their size.
  int64_t elements = 0;
  bool over = false;
  for (const v1::ParameterSpec& p : req.parameters()) {
    if (p.shape_size() != 2 || p.shape(0) <= 0 || p.shape(1) <= 0) continue;
    int64_t n = 0;
    if (__builtin_mul_overflow(p.shape(0), p.shape(1), &n) ||
        __builtin_add_overflow(elements, n, &elements)) {
      over = true;
      break;
    }
  }
  if (over || elements > options_.max_job_elements) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the table has ",
        over ? std::string("more than 2^63") : absl::StrCat(elements),
        " matrix elements; this daemon takes at most ",
        options_.max_job_elements, " per job (--max-job-elements)"));
  }
  for (int i = 0; i < req.groups_size(); ++i) {
    const v1::HyperparameterGroup& g = req.groups(i);
    if (g.coefficients_size() > options_.max_ns_steps ||
        (g.has_ns_steps() && g.ns_steps() > options_.max_ns_steps)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("group ", i, ": a schedule of ",
                       std::max<int64_t>(g.coefficients_size(), g.ns_steps()),
                       " Newton-Schulz steps; this daemon runs at most ",
                       options_.max_ns_steps, " (--max-ns-steps)"));
    }
  }
  return absl::OkStatus();
}

absl::Status OptimizerService::ValidateOpen(
    const v1::OpenSessionRequest& req) const {
  if (req.protocol_version() != v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", static_cast<int>(req.protocol_version()),
        " is not supported: this daemon speaks version 1 (upgrade the client "
        "or the daemon)"));
  }
  if (SpeaksMinor(1) && req.protocol_minor() > ProtocolMinor()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the client speaks protocol 1.", req.protocol_minor(), " (client ",
        req.client_version().empty() ? "version unknown"
                                     : req.client_version().substr(0, 64),
        ") but this dmuond speaks protocol 1.", ProtocolMinor(), " (dmuond ",
        options_.version,
        "), which lacks features the client may use: upgrade dmuond to a "
        "release of protocol 1.",
        req.protocol_minor(), " or newer, or use a client of protocol 1.",
        ProtocolMinor()));
  }
  if (auto st = CheckResumeStepField(req); !st.ok()) return st;
  if (SpeaksMinor(1) && !v1::Resume_IsValid(req.resume())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume is ", static_cast<int>(req.resume()),
        ", not a Resume this dmuond knows (RESUME_UNSPECIFIED, RESUME_FRESH, "
        "RESUME_CONTINUE, RESUME_REPLACE)"));
  }
  if (req.doorbell() && req.transport() != v1::TRANSPORT_SHM) {
    return absl::InvalidArgumentError(absl::StrCat(
        "doorbell is set with transport ", v1::Transport_Name(req.transport()),
        ": a doorbell lives in a shm segment (TRANSPORT_SHM only)"));
  }
  if (req.job_id().empty())
    return absl::InvalidArgumentError("job_id is empty");
  if (req.world_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be >= 1, got ", req.world_size()));
  }
  if (req.rank() < 0 || req.rank() >= req.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", req.rank(),
                     " is outside [0, world_size=", req.world_size(), ")"));
  }
  if (auto st = CheckLimits(req); !st.ok()) return st;
  switch (req.transport()) {
    case v1::TRANSPORT_SHM:
    case v1::TRANSPORT_INLINE:
      return absl::OkStatus();
    case v1::TRANSPORT_CUDA_IPC:
    case v1::TRANSPORT_NCCL:
      if (DeviceTransportAvailable(req.transport())) return absl::OkStatus();
      return absl::UnimplementedError(
          absl::StrCat("transport ", v1::Transport_Name(req.transport()),
                       " is not available on this daemon (CPU "
                       "executors); use TRANSPORT_SHM or TRANSPORT_INLINE"));
    default:
      return absl::InvalidArgumentError(
          "transport is unspecified: use TRANSPORT_SHM or TRANSPORT_INLINE");
  }
}

void OptimizerService::FillOpenResponse(const Session& s,
                                        v1::OpenSessionResponse* resp) const {
  resp->set_session_id(s.id());
  resp->set_transport(s.transport());
  if (s.transport() == v1::TRANSPORT_SHM)
    resp->set_shm_name(s.region()->name());
  if (const auto bell = s.region()->doorbell()) {
    resp->mutable_doorbell()->set_offset(bell->offset());
    resp->mutable_doorbell()->set_bytes(bell->bytes());
  }
  auto* lay = resp->mutable_layout();
  lay->set_total_bytes(s.layout().total_bytes);
  for (size_t i = 0; i < s.layout().slots.size(); ++i) {
    const auto& sl = s.layout().slots[i];
    auto* t = lay->add_slots();
    t->set_param_id(static_cast<int>(i));
    t->add_local_shape(sl.rows);
    t->add_local_shape(sl.cols);
    t->set_gradient_offset(sl.gradient_offset);
    t->set_update_offset(sl.update_offset);
    t->set_bytes(sl.bytes);
  }
  auto* caps = resp->mutable_capabilities();
  caps->set_version(options_.version);
  caps->set_protocol_minor(ProtocolMinor());
  caps->add_transports(v1::TRANSPORT_SHM);
  caps->add_transports(v1::TRANSPORT_INLINE);
  for (v1::Transport t : {v1::TRANSPORT_CUDA_IPC, v1::TRANSPORT_NCCL})
    if (DeviceTransportAvailable(t)) caps->add_transports(t);
  for (const auto& d : options_.devices) caps->add_devices(d);
  caps->set_max_message_bytes(options_.max_message_bytes);
  for (const char* n : {"classic", "polar_express", "you", "custom"})
    caps->add_schedules(n);
  for (const char* n : {"direct", "gram", "auto"}) caps->add_methods(n);
}

std::vector<double> OptimizerService::TuneTable(Table& table) {
  const Tuning& tuning = options_.tuning;
  const bool cpu = !tuning.measure;
  std::vector<double> costs;
  for (ParamInfo& p : table.params) {
    double seconds = -1;
    if (autotuner_) {
      kernels::TuneKey key;
      key.device = cpu ? kernels::CpuDeviceName() : tuning.device;
      if (!cpu) key.dtype = tuning.dtype;
      key.shape = p.shape;
      key.schedule = absl::StrCat(p.muon.ns.schedule.name, "/",
                                  p.muon.ns.schedule.steps.size());
      std::optional<kernels::TuneResult> r;
      if (p.muon.ns.method == kernels::Method::kAuto) {
        auto tuned =
            autotuner_->Choose(key,
                               cpu ? kernels::CpuMeasure(p.shape, 1, p.muon.ns)
                                   : tuning.measure(p.shape, 1, p.muon.ns),
                               tuning.tolerance);
        if (tuned.ok()) r = *tuned;
      } else {
        r = autotuner_->Lookup(key);
      }
      if (r) {
        if (p.muon.ns.method == kernels::Method::kAuto)
          p.muon.ns.method = r->method;
        auto it = r->candidates.find(
            std::string(kernels::MethodName(p.muon.ns.method)));
        if (it != r->candidates.end()) seconds = it->second.seconds;
      }
    }
    if (p.muon.ns.method == kernels::Method::kAuto) {
      p.muon.ns.method = kernels::CheapestMethod(p.shape, p.muon.ns);
    }
    if (seconds < 0) {
      seconds =
          kernels::EstimateCost(p.muon.ns.method, p.shape, p.muon.ns).flops /
          kNominalFlopsPerSecond;
    }
    costs.push_back(seconds);
  }
  return costs;
}

bool OptimizerService::DeviceTransportAvailable(v1::Transport t) const {
  return options_.device_transports != nullptr &&
         options_.device_transports->Supports(t) &&
         scheduler_->reads_device_memory();
}

}  // namespace dmuon::server
