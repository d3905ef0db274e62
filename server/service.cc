#include "server/service.h"

#include <sys/random.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cost_model.h"
#include "planner/planner.h"
#include "server/job.h"
#include "server/param_work.h"

namespace dmuon::server {
namespace {

constexpr size_t kLatencyWindow = 4096;

std::string RandomToken() {
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof(b)) {
    ssize_t n = getrandom(b + got, sizeof(b) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s.push_back(hex[c >> 4]);
    s.push_back(hex[c & 15]);
  }
  return s;
}

// Row ranges of a SHARDING_ROWS parameter must tile [0, rows) exactly.
absl::Status CheckRowTiling(const Job& job,
                            const std::shared_ptr<Session>& incoming) {
  for (size_t i = 0; i < job.table.params.size(); ++i) {
    const ParamInfo& p = job.table.params[i];
    if (p.sharding != v1::SHARDING_ROWS) continue;
    std::vector<std::pair<int64_t, int64_t>> r;
    for (int k = 0; k < job.world_size; ++k) {
      const Session* s = job.ranks[k] ? job.ranks[k].get() : incoming.get();
      r.push_back({s->rows[i].begin, s->rows[i].end});
    }
    std::sort(r.begin(), r.end());
    int64_t next = 0;
    std::string ranges;
    for (auto& [b, e] : r)
      absl::StrAppend(&ranges, ranges.empty() ? "" : " ", "[", b, ",", e, ")");
    for (auto& [b, e] : r) {
      if (b != next) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", p.name, "' row shards ", ranges, " do not tile its ",
            p.shape.rows, " rows (gap or overlap at row ", std::min(b, next),
            ")"));
      }
      next = e;
    }
    if (next != p.shape.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' row shards ", ranges,
                       " do not cover its ", p.shape.rows, " rows"));
    }
  }
  return absl::OkStatus();
}

// Adds `job`'s per-step load on each executor to `predicted` and `measured`
// (sized the executor count) when they are not null and, when `out` is not
// null, lists it there under the executors' `devices`. The caller holds
// job.mu.
void AddJobLoad(const Job& job, const std::vector<ExecutorStats>& devices,
                std::vector<double>* predicted, std::vector<double>* measured,
                v1::JobStatus* out) {
  for (size_t e = 0; e < devices.size(); ++e) {
    const double p =
        e < job.plan.predicted_load.size() ? job.plan.predicted_load[e] : 0.0;
    const double m = e < job.last_step_compute_seconds.size()
                         ? job.last_step_compute_seconds[e]
                         : 0.0;
    if (predicted != nullptr) (*predicted)[e] += p;
    if (measured != nullptr) (*measured)[e] += m;
    if (out == nullptr) continue;
    v1::ExecutorLoad* l = out->add_executor_loads();
    l->set_device(devices[e].device);
    l->set_predicted_step_seconds(p);
    l->set_measured_step_seconds(m);
  }
}

}  // namespace

OptimizerService::OptimizerService(ServiceOptions options,
                                   std::unique_ptr<Scheduler> scheduler,
                                   ServiceMetrics* metrics)
    : options_(std::move(options)),
      scheduler_(std::move(scheduler)),
      metrics_(metrics),
      started_(std::chrono::steady_clock::now()) {
  if (!options_.autotune_cache.empty()) {
    autotuner_ = std::make_unique<kernels::Autotuner>(options_.autotune_cache);
  }
  // The destructor removes the source before the service goes away.
  if (metrics_)
    metrics_->SetExecutorSource([this] { return ExecutorStatsWithLoad(); });
}

OptimizerService::~OptimizerService() {
  // The reaper first: it may be dropping a job through the scheduler.
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    reaper_stop_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  scheduler_->Shutdown();
  if (metrics_) metrics_->SetExecutorSource(nullptr);
  std::vector<std::unique_ptr<transport::Region>> gpu;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sessions_) {
      if (s->transport == v1::TRANSPORT_SHM && s->region)
        (void)transport::UnlinkShm(s->region->name());
      // GPU regions may own transport threads whose callbacks use this
      // service: end them while it is whole.
      if (IsDeviceTransport(s->transport)) gpu.push_back(std::move(s->region));
    }
  }
  gpu.clear();
}

std::shared_ptr<Session> OptimizerService::FindSession(
    const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

absl::StatusOr<v1::OpenSessionResponse> OptimizerService::OpenSession(
    const v1::OpenSessionRequest& req) {
  if (req.protocol_version() != v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol version ", static_cast<int>(req.protocol_version()),
        " is not supported: this daemon speaks version 1 (upgrade the client "
        "or the daemon)"));
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
  switch (req.transport()) {
    case v1::TRANSPORT_SHM:
    case v1::TRANSPORT_INLINE:
      break;
    case v1::TRANSPORT_CUDA_IPC:
    case v1::TRANSPORT_NCCL:
      if (DeviceTransportAvailable(req.transport())) break;
      return absl::UnimplementedError(
          absl::StrCat("transport ", v1::Transport_Name(req.transport()),
                       " is not available on this daemon (CPU "
                       "executors); use TRANSPORT_SHM or TRANSPORT_INLINE"));
    default:
      return absl::InvalidArgumentError(
          "transport is unspecified: use TRANSPORT_SHM or TRANSPORT_INLINE");
  }
  auto s = std::make_shared<Session>();
  auto table = BuildTable(req, &s->rows);
  if (!table.ok()) return table.status();
  std::vector<transport::TensorView> views;
  for (size_t i = 0; i < table->params.size(); ++i) {
    views.push_back(
        {s->rows[i].end - s->rows[i].begin, table->params[i].shape.cols, 4});
  }
  auto layout = transport::ComputeLayout(views);
  if (!layout.ok()) return layout.status();
  s->layout = *layout;
  s->rank = req.rank();
  s->transport = req.transport();

  // A job dropped idle, or snapshotted before a restart, resumes from its
  // snapshot: read now, before mu_ is taken for good.
  if (auto st = LoadPendingSnapshot(req.job_id()); !st.ok()) return st;
  // A new job's methods and costs are measured (--autotune-cache: on a cache
  // miss, real kernel runs) before mu_ is taken, so other sessions' calls
  // and Status are not held up; a rank that finds the job made meanwhile
  // throws this away.
  std::optional<std::pair<Table, std::vector<double>>> tuned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.count(req.job_id()) == 0)
      tuned.emplace(*table, std::vector<double>{});
  }
  if (tuned) tuned->second = TuneTable(tuned->first);
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) {
    return absl::UnavailableError(
        "dmuond is draining: it accepts no new sessions (connect to another)");
  }
  if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("dmuond serves at most ", options_.max_sessions,
                     " sessions (--max-sessions); all are in use"));
  }
  std::shared_ptr<Job> job;
  bool created = false;
  if (auto it = jobs_.find(req.job_id()); it != jobs_.end()) {
    job = it->second;
  } else {
    job = std::make_shared<Job>();
    job->id = req.job_id();
    job->serial = next_job_serial_++;
    job->world_size = req.world_size();
    if (!tuned) {  // the job was dropped between the look and now
      tuned.emplace(*table, std::vector<double>{});
      tuned->second = TuneTable(tuned->first);
    }
    job->table = std::move(tuned->first);
    job->ranks.resize(job->world_size);
    job->params.resize(job->table.params.size());
    for (size_t i = 0; i < job->table.params.size(); ++i) {
      const ParamInfo& p = job->table.params[i];
      // Executors holding state start from zeros without a host copy.
      if (!scheduler_->holds_state())
        job->params[i].momentum.assign(p.shape.elements(), 0.0f);
      job->params[i].arrived.assign(job->world_size, 0);
    }
    const std::vector<double>& costs = tuned->second;
    std::vector<int> layers;
    for (const ParamInfo& p : job->table.params) layers.push_back(p.layer);
    if (const std::vector<int> ok = scheduler_->Healthy();
        !ok.empty() && static_cast<int>(ok.size()) < scheduler_->executors()) {
      // New jobs avoid executors that lost their device.
      job->plan = planner::PlanOn(
          planner::PlanBest(costs, layers, static_cast<int>(ok.size())), ok,
          scheduler_->executors());
    } else {
      job->plan = planner::PlanBest(costs, layers, scheduler_->executors());
    }
    job->compute_seconds.assign(scheduler_->executors(), 0.0);
    job->last_step_compute_seconds.assign(scheduler_->executors(), 0.0);
    if (auto snap = snapshot_headers_.find(job->id);
        snap != snapshot_headers_.end()) {
      const v1::StateHeader& h = snap->second.header();
      if (h.parameters_size() != static_cast<int>(job->table.params.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job '", job->id, "' has a snapshot in --state-dir with ",
            h.parameters_size(), " parameters; this table has ",
            job->table.params.size()));
      }
      for (int i = 0; i < h.parameters_size(); ++i) {
        const ParamInfo& p = job->table.params[i];
        const auto& sp = h.parameters(i);
        if (sp.name() != p.name || sp.shape(0) != p.shape.rows ||
            sp.shape(1) != p.shape.cols) {
          return absl::InvalidArgumentError(absl::StrCat(
              "job '", job->id, "' snapshot parameter ", i, " is '", sp.name(),
              "' [", sp.shape(0), ",", sp.shape(1), "], the table says '",
              p.name, "' ", kernels::ShapeString(p.shape)));
        }
      }
      auto& mom = snapshot_momentum_[job->id];
      for (size_t i = 0; i < job->params.size(); ++i)
        job->params[i].momentum = std::move(mom[i]);
      job->completed_steps = h.completed_steps();
      snapshot_headers_.erase(snap);
      snapshot_momentum_.erase(job->id);
    }
    created = true;
  }
  std::lock_guard<std::mutex> jl(job->mu);
  if (!created) {
    if (job->broken) {
      return absl::AbortedError(absl::StrCat(
          "job '", job->id,
          "' is broken (a rank left mid-step); close every rank "
          "and start it again, restoring state from a checkpoint"));
    }
    if (job->world_size != req.world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", job->id, "' has world_size ", job->world_size,
                       "; rank ", req.rank(), " says ", req.world_size()));
    }
    int ref = 0;
    while (ref < job->world_size && !job->ranks[ref]) ++ref;
    if (auto st = CompareTables(job->table, ref < job->world_size ? ref : 0,
                                *table, req.rank());
        !st.ok()) {
      return st;
    }
    if (job->ranks[req.rank()]) {
      return absl::AlreadyExistsError(absl::StrCat(
          "rank ", req.rank(), " of job '", job->id, "' is already open"));
    }
    for (const auto& other : job->ranks) {
      if (other && IsDeviceTransport(other->transport) !=
                       IsDeviceTransport(s->transport)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", req.rank(), " of job '", job->id, "' asks for ",
            v1::Transport_Name(s->transport), " but rank ", other->rank,
            " uses ", v1::Transport_Name(other->transport),
            ": every rank of a job uses GPU transports (cuda_ipc, nccl) or "
            "none"));
      }
    }
  }
  if (job->open_ranks() + 1 == job->world_size) {
    if (auto st = CheckRowTiling(*job, s); !st.ok()) return st;
  }
  v1::OpenSessionResponse resp;
  if (s->transport == v1::TRANSPORT_SHM) {
    auto region = transport::CreateShmRegion(s->layout.total_bytes);
    if (!region.ok()) return region.status();
    s->region = std::move(*region);
  } else if (IsDeviceTransport(s->transport)) {
    auto region =
        options_.device_transports->Open(job->serial, req, s->layout, &resp);
    if (!region.ok()) {
      if (created) options_.device_transports->DropJob(job->serial);
      return region.status();
    }
    s->region = std::move(*region);
  } else {
    s->region = transport::NewHeapRegion(s->layout.total_bytes);
  }
  s->id = RandomToken();
  s->job = job;
  s->step = job->completed_steps + 1;
  s->declared.assign(job->table.params.size(), 0);
  s->received.assign(job->table.params.size(), 0);
  job->ranks[req.rank()] = s;
  if (created) jobs_[job->id] = job;
  sessions_[s->id] = s;
  if (metrics_) {
    metrics_->SetSessions(static_cast<int>(sessions_.size()));
    metrics_->SetJobs(static_cast<int>(jobs_.size()));
  }

  resp.set_session_id(s->id);
  resp.set_transport(s->transport);
  resp.set_next_step(s->step);
  if (s->transport == v1::TRANSPORT_SHM) resp.set_shm_name(s->region->name());
  auto* lay = resp.mutable_layout();
  lay->set_total_bytes(s->layout.total_bytes);
  for (size_t i = 0; i < s->layout.slots.size(); ++i) {
    const auto& sl = s->layout.slots[i];
    auto* t = lay->add_slots();
    t->set_param_id(static_cast<int>(i));
    t->add_local_shape(sl.rows);
    t->add_local_shape(sl.cols);
    t->set_gradient_offset(sl.gradient_offset);
    t->set_update_offset(sl.update_offset);
    t->set_bytes(sl.bytes);
  }
  auto* caps = resp.mutable_capabilities();
  caps->set_version(options_.version);
  caps->add_transports(v1::TRANSPORT_SHM);
  caps->add_transports(v1::TRANSPORT_INLINE);
  for (v1::Transport t : {v1::TRANSPORT_CUDA_IPC, v1::TRANSPORT_NCCL})
    if (DeviceTransportAvailable(t)) caps->add_transports(t);
  for (const auto& d : options_.devices) caps->add_devices(d);
  caps->set_max_message_bytes(options_.max_message_bytes);
  for (const char* n : {"classic", "polar_express", "you", "custom"})
    caps->add_schedules(n);
  for (const char* n : {"direct", "gram", "auto"}) caps->add_methods(n);
  return resp;
}

absl::Status OptimizerService::Attach(const std::string& session_id,
                                      std::shared_ptr<StepSink> sink) {
  auto s = FindSession(session_id);
  if (!s)
    return absl::NotFoundError(
        "no open session with this session_id (expired or closed?)");
  auto job = s->job.lock();
  if (!job) return absl::AbortedError("the session's job is gone");
  std::lock_guard<std::mutex> lock(job->mu);
  if (s->sink) {
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", s->rank, " of job '", job->id, "' already has a Step stream"));
  }
  s->sink = std::move(sink);
  // The client has mapped the segment: the name is no longer needed.
  if (s->transport == v1::TRANSPORT_SHM)
    (void)transport::UnlinkShm(s->region->name());
  return absl::OkStatus();
}

bool OptimizerService::Detach(const std::string& session_id,
                              const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return false;
  CloseLocked(it->second, why);
  return true;
}

absl::Status OptimizerService::CloseSession(
    const std::string& session_id,
    std::chrono::steady_clock::time_point release_by, bool* released) {
  std::shared_ptr<RegionRelease> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = sessions_.find(session_id); it != sessions_.end()) {
      release = it->second->release;
      CloseLocked(it->second, absl::OkStatus());
    } else if (auto c = closing_.find(session_id); c != closing_.end()) {
      release = c->second;  // closed when its Step stream ended
    } else {
      return absl::NotFoundError("no open session with this session_id");
    }
  }
  // Without mu_: the step computations that still hold the session finish
  // (Deliver takes only the job's lock), and the last one releases it.
  const bool done = release->WaitUntil(release_by);
  if (done) {
    std::lock_guard<std::mutex> lock(mu_);
    closing_.erase(session_id);
  }
  if (released != nullptr) *released = done;
  return absl::OkStatus();
}

void OptimizerService::CloseLocked(std::shared_ptr<Session> s,
                                   const absl::Status& why) {
  sessions_.erase(s->id);
  for (auto it = closing_.begin(); it != closing_.end();)
    it = it->second->done() ? closing_.erase(it) : std::next(it);
  closing_[s->id] = s->release;
  auto job = s->job.lock();
  if (job) {
    std::lock_guard<std::mutex> jl(job->mu);
    s->closed = true;
    if (job->ranks[s->rank] == s) job->ranks[s->rank] = nullptr;
    if (job->mid_step() && !job->broken) {
      job->broken = true;
      const absl::Status abort = absl::AbortedError(absl::StrCat(
          "rank ", s->rank, " of job '", job->id, "' left mid-step",
          why.ok() ? "" : absl::StrCat(" (", why.message(), ")"),
          "; reopen every rank and restore state from a checkpoint"));
      for (auto& other : job->ranks)
        if (other && other->sink) other->sink->Abort(abort);
    }
    if (s->sink) s->sink->Abort(absl::OkStatus());
    if (job->open_ranks() == 0 && job->broken) {
      jobs_.erase(job->id);
      scheduler_->DropJob(job->serial);
      if (options_.device_transports)
        options_.device_transports->DropJob(job->serial);
    } else if (job->open_ranks() == 0) {
      // Kept for a restarted trainer to reopen, until the reaper drops it.
      job->drop_at = std::chrono::steady_clock::now() +
                     std::chrono::seconds(options_.job_retention_seconds);
      {
        std::lock_guard<std::mutex> rl(reaper_mu_);
        reaper_kicked_ = true;
      }
      reaper_cv_.notify_all();
    }
  }
  if (s->transport == v1::TRANSPORT_SHM && s->region)
    (void)transport::UnlinkShm(s->region->name());
  if (metrics_) {
    metrics_->SetSessions(static_cast<int>(sessions_.size()));
    metrics_->SetJobs(static_cast<int>(jobs_.size()));
  }
}

int OptimizerService::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
  return static_cast<int>(sessions_.size());
}

bool OptimizerService::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
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

bool OptimizerService::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, job] : jobs_) {
    std::lock_guard<std::mutex> jl(job->mu);
    if (!job->broken && job->mid_step()) return true;
  }
  return false;
}

int OptimizerService::open_sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(sessions_.size());
}

void OptimizerService::CountError(const absl::Status& st) const {
  if (st.ok()) return;
  const std::string code = absl::StatusCodeToString(st.code());
  {
    std::lock_guard<std::mutex> lock(latency_mu_);
    ++errors_[code];
  }
  if (metrics_) metrics_->Error(code);
}

void OptimizerService::RecordLatency(double seconds) {
  std::lock_guard<std::mutex> lock(latency_mu_);
  if (latencies_.size() < kLatencyWindow) {
    latencies_.push_back(seconds);
  } else {
    latencies_[latency_next_] = seconds;
  }
  latency_next_ = (latency_next_ + 1) % kLatencyWindow;
  ++latency_count_;
  if (metrics_) metrics_->StepCompleted(seconds);
}

std::vector<ExecutorStats> OptimizerService::ExecutorStatsWithLoad() const {
  std::vector<ExecutorStats> stats = scheduler_->Stats();
  std::vector<double> predicted(stats.size(), 0.0);
  std::vector<double> measured(stats.size(), 0.0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, job] : jobs_) {
      std::lock_guard<std::mutex> jl(job->mu);
      if (job->open()) AddJobLoad(*job, stats, &predicted, &measured, nullptr);
    }
  }
  for (size_t i = 0; i < stats.size(); ++i) {
    stats[i].predicted_step_seconds = predicted[i];
    stats[i].measured_step_seconds = measured[i];
  }
  return stats;
}

v1::StatusResponse OptimizerService::Status() const {
  v1::StatusResponse r;
  r.set_version(options_.version);
  r.set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_)
          .count());
  const auto now = std::chrono::steady_clock::now();
  std::vector<ExecutorStats> stats = scheduler_->Stats();
  std::vector<double> predicted(stats.size(), 0.0);
  std::vector<double> measured(stats.size(), 0.0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    r.set_serving(!draining_);
    for (const auto& [id, job] : jobs_) {
      std::lock_guard<std::mutex> jl(job->mu);
      auto* j = r.add_jobs();
      j->set_job_id(id);
      j->set_world_size(job->world_size);
      j->set_ranks_open(job->open_ranks());
      j->set_parameters(static_cast<int>(job->table.params.size()));
      uint64_t bytes = 0;  // fp32 momentum, wherever it lives
      for (const auto& p : job->table.params)
        bytes += p.shape.elements() * sizeof(float);
      j->set_state_bytes(bytes);
      j->set_completed_steps(job->completed_steps);
      if (job->open_ranks() == 0 &&
          job->drop_at != std::chrono::steady_clock::time_point::max()) {
        j->set_drop_in_seconds(std::max(
            0.0, std::chrono::duration<double>(job->drop_at - now).count()));
      }
      // A job without open ranks (or broken) keeps its listing but no
      // longer loads the executors.
      const bool open = job->open();
      AddJobLoad(*job, stats, open ? &predicted : nullptr,
                 open ? &measured : nullptr, j);
      for (const auto& s : job->ranks) {
        if (!s) continue;
        auto* ss = r.add_sessions();
        ss->set_job_id(id);
        ss->set_rank(s->rank);
        ss->set_transport(s->transport);
        ss->set_step(s->step);
        ss->set_bytes_received(s->bytes_in);
        ss->set_bytes_sent(s->bytes_out);
        ss->set_open_seconds(
            std::chrono::duration<double>(now - s->opened).count());
      }
    }
  }
  for (size_t i = 0; i < stats.size(); ++i) {
    stats[i].predicted_step_seconds = predicted[i];
    stats[i].measured_step_seconds = measured[i];
  }
  for (const ExecutorStats& e : stats) {
    auto* x = r.add_executors();
    x->set_device(e.device);
    x->set_busy_seconds(e.busy_seconds);
    x->set_queue_depth(e.queue_depth);
    x->set_matrices(e.matrices);
    x->set_flops(e.flops);
    x->set_healthy(e.healthy);
    x->set_memory_bytes(e.memory_bytes);
    x->set_last_error(e.last_error);
    x->set_graph_fallbacks(e.graph_fallbacks);
    x->set_predicted_step_seconds(e.predicted_step_seconds);
    x->set_measured_step_seconds(e.measured_step_seconds);
  }
  std::lock_guard<std::mutex> lock(latency_mu_);
  auto* l = r.mutable_step_latency();
  l->set_count(latency_count_);
  if (!latencies_.empty()) {
    std::vector<double> v = latencies_;
    std::sort(v.begin(), v.end());
    auto q = [&](double f) {
      return v[std::min(v.size() - 1, static_cast<size_t>(f * v.size()))];
    };
    l->set_p50_seconds(q(0.5));
    l->set_p90_seconds(q(0.9));
    l->set_p99_seconds(q(0.99));
    l->set_max_seconds(v.back());
  }
  for (const auto& [code, n] : errors_) (*r.mutable_errors())[code] = n;
  return r;
}

}  // namespace dmuon::server
