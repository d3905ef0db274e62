#include "server/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dmuon::server {

void RegionRelease::Set() {
  absl::MutexLock lock(&mu_);
  done_ = true;
}

bool RegionRelease::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

bool RegionRelease::WaitUntil(std::chrono::steady_clock::time_point t) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(&done_), DeadlineOf(t));
}

Job::Job(std::string id, uint64_t serial, int world_size, Table table,
         planner::Plan plan, int executors, bool host_momentum,
         std::vector<std::vector<float>> momentum)
    : id_(std::move(id)),
      serial_(serial),
      world_size_(world_size),
      table_(std::move(table)),
      plan_(std::move(plan)),
      host_momentum_(host_momentum),
      ranks_(world_size),
      joining_(world_size, 0),
      params_(table_.params.size()),
      compute_seconds_(executors, 0.0),
      last_step_compute_seconds_(executors, 0.0) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!momentum.empty())
      params_[i].momentum = std::move(momentum[i]);
    else if (host_momentum)
      params_[i].momentum.assign(table_.params[i].shape.elements(), 0.0f);
    // `arrived` (by rank) is sized at its first arrival (Arrive), not
    // here: world_size x parameters flags only for jobs that step.
  }
}

int Job::open_ranks() const {
  int n = 0;
  for (const auto& s : ranks_) n += s != nullptr;
  return n;
}

bool Job::Holds(const Session& s) const { return ranks_[s.rank()].get() == &s; }

bool Job::mid_step() const {
  if (params_done_ > 0) return true;
  for (const auto& p : params_)
    if (p.arrived_count > 0 || p.running) return true;
  return false;
}

bool Job::running() const {
  for (const auto& p : params_)
    if (p.running) return true;
  return false;
}

bool Job::can_roll_back() const {
  if (host_momentum_ || keeps_step_start_) return true;
  for (const auto& p : params_)
    if (p.ran) return false;
  return true;
}

std::vector<const std::vector<float>*> Job::last_complete_momentum() const {
  std::vector<const std::vector<float>*> out;
  for (const auto& p : params_)
    out.push_back(p.ran && p.has_step_start ? &p.step_start : &p.momentum);
  return out;
}

void Job::OpenRank(std::shared_ptr<Session> s) {
  SessionState& st = s->state(*this);
  st.step = completed_steps_ + 1;
  st.declared.assign(params_.size(), 0);
  st.received.assign(params_.size(), 0);
  ranks_[s->rank()] = std::move(s);
}

void Job::CloseRank(const Session& s) {
  if (Holds(s)) ranks_[s.rank()] = nullptr;
}

void Job::BeginJoin(int rank) {
  if (!joining_[rank]) ++joining_count_;
  joining_[rank] = 1;
}

void Job::EndJoin(int rank) {
  if (joining_[rank]) --joining_count_;
  joining_[rank] = 0;
}

bool Job::Break() {
  if (broken_) return false;
  broken_ = true;
  return true;
}

void Job::AbortStreams(const absl::Status& why) {
  for (auto& s : ranks_) {
    if (!s) continue;
    if (const auto& sink = s->state(*this).sink) sink->Abort(why);
  }
}

bool Job::RollBack() {
  if (!can_roll_back()) return false;
  for (auto& p : params_) {
    if (p.running) {
      p.abandoned = true;  // restored when it ends (EndParam)
      continue;
    }
    if (p.ran && p.has_step_start) {
      if (host_momentum_) {
        std::swap(p.momentum, p.step_start);
      } else {
        restores_.push_back(static_cast<int>(&p - params_.data()));
      }
    }
    p.ran = false;
    p.has_step_start = false;
    p.arrived_count = 0;
    std::fill(p.arrived.begin(), p.arrived.end(), 0);
    p.absent_count = 0;
    std::fill(p.absent.begin(), p.absent.end(), 0);
    p.has_step_momentum = false;
  }
  params_done_ = 0;
  handed_off_ = 0;
  rewind_step_ = 0;
  std::fill(compute_seconds_.begin(), compute_seconds_.end(), 0.0);
  for (auto& r : ranks_) {
    if (!r) continue;
    SessionState& st = r->state(*this);
    st.step = completed_steps_ + 1;
    st.delivered = 0;
    st.step_started = false;
    std::fill(st.declared.begin(), st.declared.end(), 0);
    std::fill(st.received.begin(), st.received.end(), 0);
  }
  return true;
}

Job::Arrival Job::Arrive(int rank, int param, bool absent) {
  ParamState& p = params_[param];
  rewind_step_ = 0;  // the next step's SaveStepStart reuses step_start
  if (p.arrived.empty()) p.arrived.assign(world_size_, 0);
  if (p.absent.empty()) p.absent.assign(world_size_, 0);
  p.arrived[rank] = 1;
  p.absent[rank] = absent;
  p.absent_count += absent;
  if (++p.arrived_count == world_size_ && open_ranks() == world_size_) {
    p.running = true;
    if (++handed_off_ == num_params())
      last_hand_off_ = std::chrono::steady_clock::now();
    // Every rank absent: nothing is computed and the momentum is not
    // touched, so the parameter does not count as `ran`.
    if (p.absent_count == world_size_) return Arrival::kAbsent;
    p.ran = true;
    return Arrival::kRun;
  }
  return Arrival::kWaiting;
}

int Job::AbsentDisagrees(int rank, int param, bool absent) const {
  if (table_.params[param].sharding == v1::SHARDING_UNREDUCED) return -1;
  const ParamState& p = params_[param];
  for (size_t r = 0; r < p.arrived.size(); ++r) {
    if (static_cast<int>(r) != rank && p.arrived[r] &&
        static_cast<bool>(p.absent[r]) != absent)
      return static_cast<int>(r);
  }
  return -1;
}

void Job::SaveStepStart(int param) {
  if (!host_momentum_) {
    // The executor copies it itself, in the Compute that follows.
    if (keeps_step_start_) running_param(param).has_step_start = true;
    return;
  }
  // No copy: the buffers trade places, and the step reads the old momentum
  // from step_start and writes the new one over the other buffer, whatever
  // it held (ComputeTask::momentum_in, set by ParamWork::Gather).
  ParamState& p = running_param(param);
  std::swap(p.momentum, p.step_start);
  p.momentum.resize(p.step_start.size());
  p.has_step_start = true;
}

bool Job::EndParam(int param) {
  ParamState& p = params_[param];
  p.running = false;
  p.arrived_count = 0;
  std::fill(p.arrived.begin(), p.arrived.end(), 0);
  p.absent_count = 0;
  std::fill(p.absent.begin(), p.absent.end(), 0);
  p.has_step_momentum = false;
  if (!p.abandoned) return true;
  p.abandoned = false;
  p.ran = false;
  if (p.has_step_start) {
    if (host_momentum_) {
      std::swap(p.momentum, p.step_start);
    } else {
      restores_.push_back(param);
    }
  }
  p.has_step_start = false;
  return false;
}

void Job::AddComputeSeconds(int param, double seconds) {
  if (const size_t e = static_cast<size_t>(plan_.executor_of[param]);
      e < compute_seconds_.size()) {
    compute_seconds_[e] += seconds;
  }
}

bool Job::FinishParam(int64_t step,
                      std::chrono::steady_clock::time_point delivered) {
  if (++params_done_ < static_cast<int>(params_.size())) return false;
  params_done_ = 0;
  if (handed_off_ == num_params()) {
    exposed_.Add(
        std::chrono::duration<double>(delivered - last_hand_off_).count());
  }
  handed_off_ = 0;
  completed_steps_ = step;
  for (auto& p : params_) {
    p.prev_ran = host_momentum_ && p.ran && p.has_step_start;
    p.ran = p.has_step_start = false;
  }
  rewind_step_ = host_momentum_ ? step : 0;
  last_step_compute_seconds_ = compute_seconds_;
  std::fill(compute_seconds_.begin(), compute_seconds_.end(), 0.0);
  return true;
}

absl::Status Job::CheckRewind(int64_t step) const {
  if (!host_momentum_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " of job '", id_,
        "' cannot be rewound: this daemon's executors hold the momentum in "
        "device memory and keep no copy from before a step (rewinding needs "
        "CPU executors); hand gradients off after editing them instead "
        "(DMuon: overlap=False)"));
  }
  if (mid_step()) {
    std::string started;
    for (const auto& r : ranks_) {
      if (r && r->state(*this).step_started)
        absl::StrAppend(&started, started.empty() ? "" : ", ", r->rank());
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "rewind of step ", step, " of job '", id_, "' after gradients of step ",
        completed_steps_ + 1, " arrived",
        started.empty() ? "" : absl::StrCat(" (from rank ", started, ")"),
        ": only the last completed step can be rewound, before the next one "
        "starts",
        world_size_ > 1 ? " (every rank must rewind it, or none)" : ""));
  }
  if (state_readers_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rewind of step ", step, " of job '", id_,
        "' while a GetState is reading its state: rewind once it has ended"));
  }
  if (step != completed_steps_ || rewind_step_ != step || step < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " of job '", id_,
        "' cannot be rewound: the last completed step is ", completed_steps_,
        rewind_step_ == completed_steps_ && rewind_step_ > 0
            ? ""
            : " (and it cannot be rewound either: already rewound, or its "
              "state was set or restored since)"));
  }
  return absl::OkStatus();
}

void Job::DoRewind(int64_t step) {
  for (auto& p : params_) {
    if (p.prev_ran) std::swap(p.momentum, p.step_start);
    p.prev_ran = false;
  }
  rewind_step_ = 0;
  completed_steps_ = step - 1;
  for (auto& r : ranks_) {
    if (!r) continue;
    SessionState& st = r->state(*this);
    st.step = step;
    st.delivered = 0;
    st.step_started = false;
    std::fill(st.declared.begin(), st.declared.end(), 0);
    std::fill(st.received.begin(), st.received.end(), 0);
  }
}

absl::Status Job::Rewind(int64_t step) {
  if (host_momentum_ && world_size_ != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " of job '", id_,
                     "' cannot be rewound alone: the job has ", world_size_,
                     " ranks (AskRewind)"));
  }
  if (auto e = CheckRewind(step); !e.ok()) return e;
  DoRewind(step);
  return absl::OkStatus();
}

std::string Job::RewindRanks(bool asked) const {
  std::string out;
  for (int r = 0; r < world_size_; ++r) {
    const bool did = r < static_cast<int>(rewind_asked_.size()) &&
                     rewind_asked_[r] && rewind_asked_step_ != 0;
    if (did == asked) absl::StrAppend(&out, out.empty() ? "" : ", ", r);
  }
  return out;
}

void Job::EndRewindRound(absl::Status why) {
  if (rewind_asked_count_ == 0) return;
  rewind_result_ = std::move(why);
  ++rewind_round_;
  rewind_asked_count_ = 0;
  rewind_asked_step_ = 0;
  std::fill(rewind_asked_.begin(), rewind_asked_.end(), 0);
}

absl::Status Job::AskRewind(int rank, int64_t step) {
  if (auto e = CheckRewind(step); !e.ok()) {
    // A rank refused while others wait: their round cannot complete.
    if (rewind_asked_count_ > 0) {
      EndRewindRound(absl::FailedPreconditionError(
          absl::StrCat("rewind of step ", rewind_asked_step_, " of job '", id_,
                       "' failed: rank ", rank, "'s rewind was refused (",
                       e.message(), ")")));
    }
    return e;
  }
  if (rewind_asked_.size() != static_cast<size_t>(world_size_))
    rewind_asked_.assign(world_size_, 0);
  if (rewind_asked_count_ > 0 && rewind_asked_step_ != step) {
    // Not reachable while CheckRewind holds (one rewindable step), but a
    // stale round must not count towards this one.
    EndRewindRound(absl::FailedPreconditionError(absl::StrCat(
        "rewind of step ", rewind_asked_step_, " of job '", id_,
        "' abandoned: rank ", rank, " asked to rewind step ", step)));
  }
  if (rewind_asked_[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " asked twice to rewind step ", step,
                     " of job '", id_, "'"));
  }
  rewind_asked_[rank] = 1;
  rewind_asked_step_ = step;
  if (++rewind_asked_count_ < world_size_) return absl::OkStatus();
  DoRewind(step);
  EndRewindRound(absl::OkStatus());
  return absl::OkStatus();
}

absl::Status Job::AwaitRewind(const Session& s, int64_t step) {
  if (rewind_asked_count_ == 0) return absl::OkStatus();  // round complete
  const uint64_t round = rewind_round_;
  auto settled = [this, &s, round] {
    mu_.AssertHeld();
    return rewind_round_ != round || !Holds(s) || broken_ ||
           open_ranks() < world_size_;
  };
  mu_.Await(absl::Condition(&settled));
  if (rewind_round_ != round) return rewind_result_;
  const std::string missing = RewindRanks(/*asked=*/false);
  absl::Status why = absl::AbortedError(
      absl::StrCat("rewind of step ", step, " of job '", id_,
                   "': ", broken_ ? "the job broke" : "a rank closed",
                   " while rank ", s.rank(), " waited for rank ", missing,
                   " to ask for it too; the step is not rewound"));
  EndRewindRound(why);
  return why;
}

std::vector<int> Job::RewindWaiting(int64_t* step) const {
  std::vector<int> ranks;
  *step = rewind_asked_count_ > 0 ? rewind_asked_step_ : 0;
  if (rewind_asked_count_ == 0) return ranks;
  for (size_t r = 0; r < rewind_asked_.size(); ++r)
    if (rewind_asked_[r]) ranks.push_back(static_cast<int>(r));
  return ranks;
}

absl::Status Job::CheckNoRewindPending(int rank, int64_t next_step) {
  if (rewind_asked_count_ == 0 ||
      (rank < static_cast<int>(rewind_asked_.size()) && rewind_asked_[rank]))
    return absl::OkStatus();
  absl::Status why = absl::FailedPreconditionError(absl::StrCat(
      "ranks disagree on rewinding step ", rewind_asked_step_, " of job '", id_,
      "': rank ", RewindRanks(/*asked=*/true), " asked to rewind it but rank ",
      rank, " sent gradients of step ", next_step,
      " instead; every rank must rewind a step, or none (the job stays after "
      "step ",
      rewind_asked_step_, ", not rewound)"));
  EndRewindRound(why);
  return why;
}

void Job::SetCompletedSteps(int64_t completed) {
  rewind_step_ = 0;
  EndRewindRound(absl::FailedPreconditionError(
      absl::StrCat("rewind of step ", rewind_asked_step_, " of job '", id_,
                   "' abandoned: the job's state was set meanwhile")));
  completed_steps_ = completed;
  for (auto& r : ranks_)
    if (r) r->state(*this).step = completed_steps_ + 1;
}

Session::Session(std::string id, std::shared_ptr<Job> job, int rank,
                 v1::Transport transport, transport::Layout layout,
                 std::vector<ShardMap> shards,
                 std::unique_ptr<transport::Region> region, std::string peer)
    : id_(std::move(id)),
      job_(job),
      job_raw_(job.get()),
      rank_(rank),
      transport_(transport),
      layout_(std::move(layout)),
      shards_(std::move(shards)),
      peer_(std::move(peer)),
      region_(std::move(region)) {}

Session::~Session() {
  region_.reset();
  release_->Set();
}

}  // namespace dmuon::server
