// OpenSession, step by step: validate the request, tune a new job's table,
// find or create the job (planned, resumed from its snapshot), check the
// rank may join it, open its region, publish the session.

#include <sys/random.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/protocol.h"
#include "kernels/cost_model.h"
#include "planner/planner.h"
#include "server/job.h"
#include "server/resume_step.h"
#include "server/service.h"

namespace dmuon::server {
namespace {

std::string RandomToken() {
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof(b)) {
    ssize_t n = getrandom(b + got, sizeof(b) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(b), sizeof(b)));
}

// Row ranges of a SHARDING_ROWS parameter must tile [0, rows) exactly, and
// a SHARDING_BLOCKS parameter's ranks must hold every element between them
// (shard_map.h CheckCover; replicas allowed). Every rank but `rank` is
// open; `shards` are that rank's.
absl::Status CheckShardCover(const Job& job, int rank,
                             const std::vector<ShardMap>& shards)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  int64_t budget = kCoverBudget;  // for the whole table (shard_map.h)
  for (size_t i = 0; i < job.table().params.size(); ++i) {
    const ParamInfo& p = job.table().params[i];
    // Not a lambda: clang's analysis would not see the lock held in it.
    std::vector<const ShardMap*> held;
    for (int k = 0; k < job.world_size(); ++k)
      held.push_back(k == rank ? &shards[i] : &job.ranks()[k]->shards()[i]);
    if (p.sharding == v1::SHARDING_BLOCKS) {
      if (auto st = CheckCover(held, p.shape, p.name, &budget); !st.ok())
        return st;
      continue;
    }
    if (p.sharding != v1::SHARDING_ROWS) continue;
    std::vector<std::pair<int64_t, int64_t>> r;
    for (const ShardMap* m : held) {
      const IndexRun& x = m->rows()[0];
      r.push_back({x.begin, x.end});
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

// The fp32 momentum a job of `table` holds (whole matrices).
uint64_t MomentumBytes(const Table& table) {
  uint64_t n = 0;
  for (const ParamInfo& p : table.params)
    n += static_cast<uint64_t>(p.shape.elements()) * sizeof(float);
  return n;
}

// Whether a snapshot of job `id` fits `table`.
absl::Status CheckSnapshot(const std::string& id, const Table& table,
                           const v1::StateHeader& h) {
  if (h.completed_steps() < 0 || h.completed_steps() > kMaxCompletedSteps) {
    return absl::DataLossError(absl::StrCat(
        "job '", id, "' has a snapshot in --state-dir with completed_steps ",
        h.completed_steps(),
        ", outside [0, 2^62]: remove the file to start the job afresh"));
  }
  if (h.parameters_size() != static_cast<int>(table.params.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", id, "' has a snapshot in --state-dir with ",
                     h.parameters_size(), " parameters; this table has ",
                     table.params.size()));
  }
  for (int i = 0; i < h.parameters_size(); ++i) {
    const ParamInfo& p = table.params[i];
    const auto& sp = h.parameters(i);
    if (sp.name() != p.name || sp.shape(0) != p.shape.rows ||
        sp.shape(1) != p.shape.cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", id, "' snapshot parameter ", i, " is '", sp.name(), "' [",
          sp.shape(0), ",", sp.shape(1), "], the table says '", p.name, "' ",
          kernels::ShapeString(p.shape)));
    }
  }
  return absl::OkStatus();
}

// Whether rank req.rank() with `table` may join the existing `job`.
absl::Status CheckJoin(const Job& job, const v1::OpenSessionRequest& req,
                       const Table& table)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
  if (job.broken()) {
    return absl::AbortedError(
        absl::StrCat("job '", job.id(),
                     "' is broken (a rank left mid-step); close every rank "
                     "and start it again, restoring state from a checkpoint"));
  }
  if (job.world_size() != req.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job.id(), "' has world_size ", job.world_size(),
                     "; rank ", req.rank(), " says ", req.world_size()));
  }
  int ref = 0;
  while (ref < job.world_size() && !job.ranks()[ref]) ++ref;
  if (auto st = CompareTables(job.table(), ref < job.world_size() ? ref : 0,
                              table, req.rank());
      !st.ok()) {
    return st;
  }
  if (const auto& open = job.ranks()[req.rank()]) {
    const auto age = std::chrono::duration_cast<std::chrono::seconds>(
        std::chrono::steady_clock::now() - open->opened());
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", req.rank(), " of job '", job.id(), "' is already open",
        open->peer().empty() ? "" : absl::StrCat(" by ", open->peer()),
        ", for ", age.count(),
        " s: another trainer (or an earlier run still alive) uses this job "
        "id; give this one its own job_id, or stop that one (its session "
        "closes when its process ends)"));
  }
  for (const auto& other : job.ranks()) {
    if (other && IsDeviceTransport(other->transport()) !=
                     IsDeviceTransport(req.transport())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", req.rank(), " of job '", job.id(), "' asks for ",
          v1::Transport_Name(req.transport()), " but rank ", other->rank(),
          " uses ", v1::Transport_Name(other->transport()),
          ": every rank of a job uses GPU transports (cuda_ipc, nccl) or "
          "none"));
    }
  }
  return absl::OkStatus();
}

// What a minor adds is gated on ProtocolMinor(), so that a build speaking an
// older minor (//daemon:dmuond_prev) behaves as that release did: protocol
// 1.0 knew neither resume nor protocol_minor (both ignored).
bool SpeaksMinor(uint32_t minor) { return ProtocolMinor() >= minor; }

// The request's resume_step as this daemon honours it (0: none).
int64_t ResumeStepOf(const v1::OpenSessionRequest& req) {
  return SpeaksMinor(4) ? req.resume_step() : 0;
}

// The request's Resume as this daemon honours it: a resume_step continues.
v1::Resume ResumeOf(const v1::OpenSessionRequest& req) {
  if (ResumeStepOf(req) > 0) return v1::RESUME_CONTINUE;
  return SpeaksMinor(1) ? req.resume() : v1::RESUME_UNSPECIFIED;
}

// FRESH on a job holding momentum: ALREADY_EXISTS, naming the job, its step,
// where the momentum is and the two ways on.
absl::Status HoldsMomentumError(const std::string& id, int64_t completed,
                                const std::string& where) {
  return absl::AlreadyExistsError(absl::StrCat(
      "job '", id, "' already holds momentum: it has completed step ",
      completed, " (", where,
      ") and this session asked for a fresh start (resume=fresh). To go on "
      "from step ",
      completed + 1,
      " open it with resume=continue (Python: DMuon(..., resume=True)); to "
      "discard its momentum and start again at step 1, resume=replace "
      "(Python: resume=\"replace\"); or use another job_id"));
}

// CONTINUE on a job holding none: NOT_FOUND.
absl::Status NothingToContinueError(const std::string& id,
                                    const std::string& state_dir) {
  return absl::NotFoundError(absl::StrCat(
      "job '", id,
      "' holds no momentum to continue (resume=continue): no completed step "
      "in this dmuond's memory",
      state_dir.empty()
          ? " (it runs without --state-dir, so a job does not outlive a "
            "restart)"
          : absl::StrCat(" nor a snapshot under --state-dir ", state_dir),
      ". Check the job_id and the daemon's address, or start the job at step "
      "1 with resume=fresh (Python: the default)"));
}

}  // namespace

absl::StatusOr<v1::OpenSessionResponse> OptimizerService::OpenSession(
    const v1::OpenSessionRequest& req, const Principal& who) {
  if (auto st = ValidateOpen(req); !st.ok()) return st;
  std::vector<ShardMap> shards;
  auto table = BuildTable(req, &shards);
  if (!table.ok()) return table.status();
  std::vector<transport::TensorView> views;
  for (const ShardMap& m : shards)
    views.push_back({m.local_rows(), m.local_cols(), 4});
  auto layout = transport::ComputeLayout(views);
  if (!layout.ok()) return layout.status();
  // Everything cheap first: an open refused anyway reads no snapshot.
  {
    absl::MutexLock lock(&mu_);
    if (auto st = CheckCapacityLocked(req, *table); !st.ok()) return st;
    pending_.BeginOpen(req.job_id());
  }
  auto resp =
      OpenChecked(req, who, *table, std::move(shards), *std::move(layout));
  // A snapshot read for opens that all failed is not kept: its memory is
  // held only for a job that exists (the next open reads it again).
  absl::MutexLock lock(&mu_);
  if (pending_.EndOpen(req.job_id()) && !resp.ok() &&
      jobs_.count(req.job_id()) == 0) {
    pending_.Unload(req.job_id());
  }
  return resp;
}

absl::Status OptimizerService::CheckCapacityLocked(
    const v1::OpenSessionRequest& req, const Table& table) const {
  if (draining_) {
    return absl::UnavailableError(
        "dmuond is draining: it accepts no new sessions (connect to another)");
  }
  if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("dmuond serves at most ", options_.max_sessions,
                     " sessions (--max-sessions); all are in use"));
  }
  if (options_.max_state_bytes > 0 && jobs_.count(req.job_id()) == 0) {
    uint64_t held = 0;
    for (const auto& [id, j] : jobs_) held += MomentumBytes(j->table());
    const uint64_t want = MomentumBytes(table);
    if (held + want > options_.max_state_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a new job of ", want,
          " bytes of fp32 momentum would bring the "
          "daemon's state to ",
          held + want,
          " bytes, over --max-state-bytes=", options_.max_state_bytes, " (",
          held, " held by ", jobs_.size(), " jobs, idle ones included)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::OpenSessionResponse> OptimizerService::OpenChecked(
    const v1::OpenSessionRequest& req, const Principal& who, const Table& table,
    std::vector<ShardMap> shards, transport::Layout layout) {
  // A job dropped idle, or snapshotted before a restart, resumes from its
  // snapshot: read now, before mu_ is taken for good.
  // resume=replace discards the snapshot anyway: one that cannot be used
  // (moved aside, or left in place for Replace to move) does not stop it.
  if (auto st = LoadPendingSnapshot(req.job_id(), who, ResumeStepOf(req));
      !st.ok() &&
      !(ResumeOf(req) == v1::RESUME_REPLACE && absl::IsDataLoss(st))) {
    return st;
  }
  // A new job's methods and costs are measured (--autotune-cache: on a cache
  // miss, real kernel runs) before mu_ is taken, so other sessions' calls
  // and Status are not held up; a rank that finds the job made meanwhile
  // throws this away.
  std::optional<Tuned> tuned;
  {
    absl::MutexLock lock(&mu_);
    if (jobs_.count(req.job_id()) == 0)
      tuned.emplace(table, std::vector<double>{});
  }
  if (tuned) tuned->second = TuneTable(tuned->first);

  absl::MutexLock lock(&mu_);
  if (auto st = CheckCapacityLocked(req, table); !st.ok()) return st;
  bool created = false;
  auto found = FindOrCreateJobLocked(req, table, tuned, who, &created);
  if (!found.ok()) return found.status();
  const std::shared_ptr<Job> job = *std::move(found);
  absl::MutexLock jl(&job->mu());
  if (!created) {
    if (auto st = CheckJoin(*job, req, table); !st.ok()) return st;
  }
  if (job->open_ranks() + 1 == job->world_size()) {
    if (auto st = CheckShardCover(*job, req.rank(), shards); !st.ok())
      return st;
  }
  v1::OpenSessionResponse resp;
  auto region = OpenRegion(*job, created, req, layout, &resp);
  if (!region.ok()) return region.status();
  auto s = std::make_shared<Session>(
      RandomToken(), job, req.rank(), req.transport(), std::move(layout),
      std::move(shards), *std::move(region), who.peer);
  job->OpenRank(s);
  if (created) {
    jobs_[job->id()] = job;
    // Starts from zero although a snapshot of the id was found: say why.
    if (std::string aside = pending_.TakeMovedAside(job->id()); !aside.empty())
      resp.set_notice(absl::StrCat("job '", job->id(),
                                   "' starts from zero "
                                   "momentum at step 1: ",
                                   aside));
  }
  sessions_[s->id()] = s;
  attach_reaper_.Kick();  // its attach deadline
  metrics_->SetSessions(static_cast<int>(sessions_.size()));
  metrics_->SetJobs(static_cast<int>(jobs_.size()));
  resp.set_next_step(s->state(*job).step);
  FillOpenResponse(*s, &resp);
  return resp;
}

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
  if (SpeaksMinor(1) && !v1::Resume_IsValid(req.resume())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume is ", static_cast<int>(req.resume()),
        ", not a Resume this dmuond knows (RESUME_UNSPECIFIED, RESUME_FRESH, "
        "RESUME_CONTINUE, RESUME_REPLACE)"));
  }
  if (SpeaksMinor(4)) {
    if (auto st = CheckResumeStepField(req); !st.ok()) return st;
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

absl::StatusOr<std::shared_ptr<Job>> OptimizerService::FindOrCreateJobLocked(
    const v1::OpenSessionRequest& req, const Table& table,
    std::optional<Tuned>& tuned, const Principal& who, bool* created) {
  const v1::Resume resume = ResumeOf(req);
  if (auto it = jobs_.find(req.job_id()); it != jobs_.end()) {
    // Before anything that could describe the job (CheckJoin's messages).
    if (auto st = CheckJobOwner(who, it->second->owner(), req.job_id());
        !st.ok()) {
      return st;
    }
    const std::shared_ptr<Job> job = it->second;
    // Resume (docs/protocol.md "Resume"): the job in memory is the job's
    // newest state (a snapshot of it on disk is as old or older).
    absl::MutexLock jl(&job->mu());
    const int64_t done = job->completed_steps();
    const int open = job->open_ranks();
    if (resume == v1::RESUME_FRESH && done > 0) {
      return HoldsMomentumError(
          job->id(), done,
          open > 0 ? absl::StrCat(open, " of its ", job->world_size(),
                                  " ranks open on this dmuond")
                   : "idle in this dmuond's memory");
    }
    if (resume == v1::RESUME_CONTINUE && done == 0)
      return NothingToContinueError(job->id(), options_.state_dir);
    if (const int64_t want = ResumeStepOf(req); want > 0 && want != done) {
      return ResumeStepError(job->id(), want, done,
                             "in this dmuond's memory, which it resumes from "
                             "while it holds the job");
    }
    if (resume != v1::RESUME_REPLACE || (open > 0 && done == 0)) {
      // Joined (REPLACE too: the other ranks of a job just started, at step
      // 1, hold nothing to discard).
      *created = false;
      return job;
    }
    if (open > 0) {
      std::string ranks;
      for (const auto& r : job->ranks())
        if (r) absl::StrAppend(&ranks, ranks.empty() ? "" : ",", r->rank());
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job->id(), "' cannot be replaced (resume=replace): rank",
          open > 1 ? "s " : " ", ranks, " of it ", open > 1 ? "are" : "is",
          " open, past completed step ", done,
          ". Close every session of the job first (stop those trainers), "
          "then open it again with resume=replace; or use another job_id"));
    }
    // Idle: its snapshot goes first (nothing changes if that fails), then
    // its memory, as the reaper drops a job (service_reap.cc).
    if (snapshots_.enabled()) {
      if (auto moved = snapshots_.Replace(job->id(), next_job_serial_);
          !moved.ok()) {
        return moved.status();
      }
    }
    job->MarkDropped();
    jobs_.erase(it);
    scheduler_->DropJob(job->serial());
    if (options_.device_transports)
      options_.device_transports->DropJob(job->serial());
  } else if (resume == v1::RESUME_REPLACE && snapshots_.enabled()) {
    const SnapshotFile* old = pending_.Find(req.job_id());
    if (auto st =
            CheckJobOwner(who, old ? old->head.header().owner() : std::string(),
                          req.job_id());
        !st.ok()) {
      return st;
    }
    if (auto moved = snapshots_.Replace(req.job_id(), next_job_serial_);
        !moved.ok()) {
      return moved.status();
    }
    pending_.Drop(req.job_id());
  }
  const SnapshotFile* pending = pending_.Find(req.job_id());
  if (pending) {
    if (auto st =
            CheckJobOwner(who, pending->head.header().owner(), req.job_id());
        !st.ok()) {
      return st;
    }
  }
  const int64_t pending_done =
      pending ? pending->head.header().completed_steps() : 0;
  if (resume == v1::RESUME_FRESH && pending_done > 0) {
    return HoldsMomentumError(
        req.job_id(), pending_done,
        absl::StrCat("in its snapshot under --state-dir ", options_.state_dir,
                     ", not loaded yet"));
  }
  if (const int64_t want = ResumeStepOf(req);
      want > 0 && pending_done > 0 && want != pending_done) {
    return ResumeStepError(req.job_id(), want, pending_done,
                           "in its snapshot, read for an open of another "
                           "rank");
  }
  if (resume == v1::RESUME_CONTINUE && pending_done <= 0) {
    absl::Status none =
        NothingToContinueError(req.job_id(), options_.state_dir);
    const std::string aside = pending_.MovedAside(req.job_id());
    if (aside.empty()) return none;
    return absl::NotFoundError(absl::StrCat(none.message(), " (", aside, ")"));
  }
  if (!tuned) {  // the job was dropped between the look and now
    tuned.emplace(table, std::vector<double>{});
    tuned->second = TuneTable(tuned->first);
  }
  const std::vector<double>& costs = tuned->second;
  std::vector<int> layers;
  for (const ParamInfo& p : tuned->first.params) layers.push_back(p.layer);
  planner::Plan plan;
  if (const std::vector<int> ok = scheduler_->Healthy();
      !ok.empty() && static_cast<int>(ok.size()) < scheduler_->executors()) {
    // New jobs avoid executors that lost their device.
    plan = planner::PlanOn(
        planner::PlanBest(costs, layers, static_cast<int>(ok.size())), ok,
        scheduler_->executors());
  } else {
    plan = planner::PlanBest(costs, layers, scheduler_->executors());
  }
  // A resumed job takes its snapshot's momentum (moved, never copied) and
  // keeps its owner; a new one is `who`'s.
  SnapshotFile resumed;
  const bool resumes = pending != nullptr;
  if (resumes) {
    if (auto st =
            CheckSnapshot(req.job_id(), tuned->first, pending->head.header());
        !st.ok()) {
      return st;
    }
    resumed = pending_.Take(req.job_id());  // `pending` is gone now
  }
  // Executors holding state start from zeros without a host copy.
  auto job = std::make_shared<Job>(req.job_id(), next_job_serial_++,
                                   req.world_size(), std::move(tuned->first),
                                   std::move(plan), scheduler_->executors(),
                                   /*host_momentum=*/!scheduler_->holds_state(),
                                   std::move(resumed.momentum));
  job->set_keeps_step_start(scheduler_->keeps_step_start());
  job->set_owner(resumes ? resumed.head.header().owner() : who.name);
  if (resumes) {
    absl::MutexLock jl(&job->mu());
    job->SetCompletedSteps(resumed.head.header().completed_steps());
  }
  *created = true;
  return job;
}

absl::StatusOr<std::unique_ptr<transport::Region>> OptimizerService::OpenRegion(
    const Job& job, bool created, const v1::OpenSessionRequest& req,
    const transport::Layout& layout, v1::OpenSessionResponse* resp) const {
  if (req.transport() == v1::TRANSPORT_SHM)
    return transport::CreateShmRegion(layout.total_bytes);
  if (IsDeviceTransport(req.transport())) {
    auto region =
        options_.device_transports->Open(job.serial(), req, layout, resp);
    if (!region.ok() && created)
      options_.device_transports->DropJob(job.serial());
    return region;
  }
  return transport::NewHeapRegion(layout.total_bytes);
}

void OptimizerService::FillOpenResponse(const Session& s,
                                        v1::OpenSessionResponse* resp) const {
  resp->set_session_id(s.id());
  resp->set_transport(s.transport());
  if (s.transport() == v1::TRANSPORT_SHM)
    resp->set_shm_name(s.region()->name());
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
