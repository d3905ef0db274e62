// OpenSession, step by step: validate the request (service_open_request.cc),
// read the job's snapshot and tune a new job's table, admit the open under
// the service's lock (cheap checks and reservations: service_admit.cc),
// then the heavy per-job work with no lock held (a new job's momentum
// allocated and zero-filled or its snapshot's moved in, the shard cover
// check, the region), and publish the session under the lock again.
// Another job's Step, Status and opens never wait for that work.

#include <sys/random.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
// (shard_map.h CheckCover; replicas allowed). `ranks` are the job's
// sessions by rank, every one open but `rank`'s, whose shards are `shards`.
// Reads only what is constant (the table, the sessions' shards): it runs
// with none of the service's locks held, O(elements / blocks) for
// SHARDING_BLOCKS.
absl::Status CheckShardCover(
    const Table& table, int rank, const std::vector<ShardMap>& shards,
    const std::vector<std::shared_ptr<Session>>& ranks) {
  int64_t budget = kCoverBudget;  // for the whole table (shard_map.h)
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamInfo& p = table.params[i];
    std::vector<const ShardMap*> held;
    for (size_t k = 0; k < ranks.size(); ++k) {
      held.push_back(static_cast<int>(k) == rank ? &shards[i]
                                                 : &ranks[k]->shards()[i]);
    }
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

// Whether the open of `rank` completes the job: every other of `ranks` is
// open, so the cover check runs.
bool CompletesJob(const std::vector<std::shared_ptr<Session>>& ranks,
                  int rank) {
  for (size_t k = 0; k < ranks.size(); ++k)
    if (static_cast<int>(k) != rank && !ranks[k]) return false;
  return true;
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

absl::Status OptimizerService::AdmitWithSnapshot(
    const v1::OpenSessionRequest& req, const Principal& who, const Table& table,
    OpenAdmission* a) {
  // Another open of the id is making its job: wait until it is published
  // (this rank joins it) or abandoned (this one makes it).
  auto not_made = [this, &req] {
    mu_.AssertHeld();
    return creating_.count(req.job_id()) == 0;
  };
  for (int reads = 0;; ++reads) {
    if (options_.heavy_work_hook)
      options_.heavy_work_hook(req.job_id(), "admit");
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&not_made));
      // A snapshot of the id that came back to disk since this open read
      // (an open that took it was abandoned, or the reaper dropped the job)
      // is read before the job is made: never a job from zero, or of
      // another owner, over its own snapshot.
      // (resume=replace discards it anyway, unread when it cannot be read.)
      if (jobs_.count(req.job_id()) > 0 || !pending_.unread(req.job_id()) ||
          ResumeOf(req) == v1::RESUME_REPLACE || ResumesAtMarkLocked(req)) {
        if (auto st = CheckCapacityLocked(req, table); !st.ok()) return st;
        return AdmitLocked(req, table, who, a);
      }
    }
    if (reads == 8) {
      return absl::UnavailableError(absl::StrCat(
          "job '", req.job_id(),
          "' is being opened and dropped by other sessions meanwhile; open "
          "it again"));
    }
    if (auto st = LoadPendingSnapshot(req.job_id(), who, ResumeStepOf(req));
        !st.ok() &&
        !(ResumeOf(req) == v1::RESUME_REPLACE && absl::IsDataLoss(st))) {
      return st;
    }
  }
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

  // Declared before every lock below: what the open lets go of (a job or
  // a session made for nothing) is let go of without mu_.
  Graveyard gone(this);
  OpenAdmission a;
  if (auto st = AdmitWithSnapshot(req, who, table, &a); !st.ok()) return st;
  if (a.replaced) {
    Graveyard old(this);
    old.Bury(std::move(a.replaced), /*drop_state=*/true);
  }
  // The heavy work, with none of the service's locks held; a failure gives
  // back what was admitted.
  v1::OpenSessionResponse resp;
  std::shared_ptr<Session> s;
  absl::Status failed = MakeSession(req, who, table, tuned, std::move(shards),
                                    std::move(layout), &a, &s, &resp);
  if (failed.ok()) {
    // Rebuilt: the old job is let go of without mu_.
    if (a.replaced) gone.Bury(std::move(a.replaced), /*drop_state=*/true);
    return resp;
  }
  if (s && s->transport() == v1::TRANSPORT_SHM && s->region())
    (void)transport::UnlinkShm(s->region()->name());
  gone.Bury(std::move(s));
  absl::MutexLock lock(&mu_);
  AbandonLocked(req, &a, gone);
  return failed;
}

absl::Status OptimizerService::MakeSession(
    const v1::OpenSessionRequest& req, const Principal& who, const Table& table,
    std::optional<Tuned>& tuned, std::vector<ShardMap> shards,
    transport::Layout layout, OpenAdmission* a, std::shared_ptr<Session>* s,
    v1::OpenSessionResponse* resp) {
  if (a->created) {
    if (auto st = TakeUnhealthyFallback(req.job_id()); !st.ok()) return st;
    if (a->rebuilt) {
      if (auto st = LoadRebuildState(req, a); !st.ok()) return st;
    }
    BuildJob(req, table, tuned, a);
  }
  const std::string& id = req.job_id();
  if (CompletesJob(a->ranks, req.rank())) {
    if (options_.heavy_work_hook) options_.heavy_work_hook(id, "cover");
    if (auto st =
            CheckShardCover(a->job->table(), req.rank(), shards, a->ranks);
        !st.ok()) {
      return st;
    }
  }
  auto region = OpenRegion(*a, req, layout, resp);
  if (!region.ok()) return region.status();
  *s = std::make_shared<Session>(
      RandomToken(), a->job, req.rank(), req.transport(), std::move(layout),
      std::move(shards), *std::move(region), who.peer);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto published = PublishLocked(*s, a, resp);
      if (!published.ok()) return published.status();
      if (*published) return absl::OkStatus();
    }
    // Another rank of the job closed and reopened meanwhile: its shards
    // are checked again (PublishLocked updated a->ranks).
    if (options_.heavy_work_hook) options_.heavy_work_hook(id, "cover");
    if (auto st = CheckShardCover(a->job->table(), req.rank(), (*s)->shards(),
                                  a->ranks);
        !st.ok()) {
      return st;
    }
  }
}

absl::Status OptimizerService::TakeUnhealthyFallback(
    const std::string& job_id) {
  const std::vector<int> ok = scheduler_->Healthy();
  if (ok.empty() || static_cast<int>(ok.size()) == scheduler_->executors())
    return absl::OkStatus();  // none lost, or none left: planned on all
  std::vector<std::string> lost;
  for (const ExecutorStats& e : scheduler_->Stats())
    if (!e.healthy) lost.push_back(e.device + " (" + e.last_error + ")");
  return fallbacks_.Take(
      kFallbackUnhealthyExecutor,
      absl::StrCat("new job '", job_id, "' planned on ", ok.size(), " of ",
                   scheduler_->executors(), " executors, around the unhealthy ",
                   absl::StrJoin(lost, ", ")),
      "no job was made; replace the device and restart dmuond, or open the "
      "job on another daemon");
}

void OptimizerService::BuildJob(const v1::OpenSessionRequest& req,
                                const Table& table, std::optional<Tuned>& tuned,
                                OpenAdmission* a) {
  if (!tuned) {  // the job was dropped between the look and the admission
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
  // Executors holding state start from zeros without a host copy.
  // A resumed job takes its snapshot's momentum (moved, never copied: it
  // never holds it twice).
  auto job = std::make_shared<Job>(
      req.job_id(), a->serial, req.world_size(), std::move(tuned->first),
      std::move(plan), scheduler_->executors(),
      /*host_momentum=*/!scheduler_->holds_state(),
      a->snapshot ? std::move(a->snapshot->momentum)
                  : std::vector<std::vector<float>>{});
  job->set_keeps_step_start(scheduler_->keeps_step_start());
  job->set_owner(a->owner);
  job->set_weight(a->weight);
  job->set_max_device_share(a->max_device_share);
  if (a->snapshot) {
    absl::MutexLock jl(&job->mu());  // not published: nobody waits for it
    job->SetCompletedSteps(a->snapshot->head.header().completed_steps());
    a->snapshot.reset();
  }
  a->job = std::move(job);
  if (options_.heavy_work_hook)
    options_.heavy_work_hook(req.job_id(), "momentum");
}

absl::StatusOr<std::unique_ptr<transport::Region>> OptimizerService::OpenRegion(
    const OpenAdmission& a, const v1::OpenSessionRequest& req,
    const transport::Layout& layout, v1::OpenSessionResponse* resp) const {
  if (req.transport() == v1::TRANSPORT_SHM) {
    return transport::CreateShmRegion(
        layout.total_bytes,
        req.doorbell() ? static_cast<int>(layout.slots.size()) : -1,
        req.doorbell_waiters());
  }
  if (IsDeviceTransport(req.transport())) {
    // A new job's transport state goes with it if the open fails
    // (AbandonLocked); the rank is this open's alone (Job::BeginJoin).
    return options_.device_transports->Open(a.job->serial(), req, layout, resp);
  }
  return transport::NewHeapRegion(layout.total_bytes);
}

absl::StatusOr<bool> OptimizerService::PublishLocked(
    const std::shared_ptr<Session>& s, OpenAdmission* a,
    v1::OpenSessionResponse* resp) {
  if (auto st = CheckSessionsLocked(); !st.ok()) return st;
  if (a->rebuilt) {
    if (auto st = PublishRebuildLocked(a); !st.ok()) return st;
  }
  Job& job = *a->job;
  absl::MutexLock jl(&job.mu());
  if (!a->created) {
    // A rank that left mid-step broke it while this one opened (a broken
    // job without an open rank is dropped: CloseLocked).
    if (job.broken() || job.dropped()) {
      return absl::AbortedError(absl::StrCat(
          "job '", job.id(), "' broke while rank ", s->rank(),
          " opened (a rank left mid-step); close every rank and start it "
          "again, restoring state from a checkpoint"));
    }
    if (job.ranks() != a->ranks) {
      a->ranks = job.ranks();
      if (CompletesJob(a->ranks, s->rank())) return false;
    }
    job.EndJoin(s->rank());
  }
  job.OpenRank(s);
  if (a->created) {
    creating_.erase(job.id());
    creating_bytes_ -= a->reserved;
    a->reserved = 0;
    jobs_[job.id()] = a->job;
    // A new run of the id (at step 1): the old run's marks go.
    if (job.completed_steps() == 0) DropMarks(job.id());
    // Starts from zero although a snapshot of the id was found: say why.
    if (std::string aside = pending_.TakeMovedAside(job.id()); !aside.empty())
      resp->set_notice(absl::StrCat("job '", job.id(),
                                    "' starts from zero "
                                    "momentum at step 1: ",
                                    aside));
  }
  sessions_[s->id()] = s;
  attach_reaper_.Kick();  // its attach deadline
  metrics_->SetSessions(static_cast<int>(sessions_.size()));
  metrics_->SetJobs(static_cast<int>(jobs_.size()));
  resp->set_next_step(s->state(job).step);
  FillOpenResponse(*s, resp);
  return true;
}

}  // namespace dmuon::server
