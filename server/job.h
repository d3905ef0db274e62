// Internal to the service: the state of a job and of its sessions, and the
// transitions of a step (a rank opens, a gradient arrives, a parameter's
// step ends, the job's step completes, the job breaks).
//
// Locks: a Job's mu() guards everything mutable of the job and of its
// sessions (Session::state). The service takes its own mu_ before a job's
// mu(), never after (service.h); the leaf locks (the reaper's, StepStats',
// a StepSink's, a transport's) come after both.

#ifndef DMUON_SERVER_JOB_H_
#define DMUON_SERVER_JOB_H_

#include <cassert>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "planner/planner.h"
#include "proto/dmuon.pb.h"
#include "server/deadline_thread.h"
#include "server/latency_window.h"
#include "server/limits.h"
#include "server/step_sink.h"
#include "server/table.h"
#include "transport/transport.h"

namespace dmuon::server {

// cuda_ipc and nccl: the session's region is GPU memory (Region::device()).
inline bool IsDeviceTransport(v1::Transport t) {
  return t == v1::TRANSPORT_CUDA_IPC || t == v1::TRANSPORT_NCCL;
}

// Set once a session's region is gone: destroyed with the Session, i.e. when
// nothing holds the session any more — neither the service's tables nor a
// step computation reading or writing the region (ParamWork holds the
// sessions of its GPU I/O until it finishes). What CloseSession waits for.
class RegionRelease {
 public:
  void Set() ABSL_LOCKS_EXCLUDED(mu_);
  bool done() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether it was set by `t`.
  bool WaitUntil(std::chrono::steady_clock::time_point t)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

class Session;

// What a session does in the step in progress. Guarded by its job's mu()
// (reached only through Session::state, which requires it).
struct SessionState {
  int64_t step = 1;                // the step in progress or next
  std::vector<uint8_t> declared;   // by parameter, this step
  std::vector<uint64_t> received;  // inline gradient bytes, this step
  int delivered = 0;               // updates delivered this step
  bool step_started = false;       // a gradient of `step` came in
  std::chrono::steady_clock::time_point step_t0;  // when the first did
  std::shared_ptr<StepSink> sink;                 // null until Attach
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  // Announcements through the region's doorbell so far (their
  // serial: transport/doorbell.h).
  uint32_t doorbell_serial = 0;
};

struct ParamState {
  // Whole matrix, fp32. With executors that hold state (executor.h) this is
  // a mirror, filled only when state is read or written (empty: never
  // materialized, i.e. zeros or the executor's copy).
  std::vector<float> momentum;
  std::vector<float> work;       // gathered gradient, then the update
  std::vector<uint8_t> arrived;  // by rank, this step
  int arrived_count = 0;
  // By rank, this step: the rank declared the parameter absent (no
  // gradient: GradientsReady.absent_param_ids). Sized with `arrived`.
  std::vector<uint8_t> absent;
  int absent_count = 0;
  // This step's momentum (beta): GradientsReady.momentum of the first rank
  // that declared the parameter present, or its group's when that rank sent
  // none (protocol minor 2); the other ranks must declare the same value.
  // Meaningful while `has_step_momentum`, cleared with the arrivals.
  double step_momentum = 0;
  bool has_step_momentum = false;
  bool running = false;  // submitted: `momentum` and `work` are the step's
  // Submitted in the step in progress (running, or ended): its momentum has
  // advanced (or will) past the job's last completed step. Cleared when the
  // step completes or is rolled back.
  bool ran = false;
  // The step in progress was rolled back while this parameter ran: its
  // result is discarded and its momentum restored when it ends (EndParam).
  bool abandoned = false;
  // Host momentum only (Job::host_momentum()): `momentum` as of the last
  // completed step, moved here (buffers swapped, not copied) before the
  // step's computation writes the new momentum into `momentum`
  // (Job::SaveStepStart, from ParamWork::Prepare), meaningful while
  // `has_step_start` (only with `ran`: a computation that failed before
  // that point left the momentum untouched). What a rollback restores and
  // what a snapshot of a job stuck mid-step holds; while it is meaningful,
  // `momentum` is the step's own (stale until the computation writes it),
  // which no reader sees: they read last_complete_momentum(), or wait for
  // the step's end (GetState, Mark).
  // Executors that keep a step-start copy (Job::keeps_step_start()):
  // `has_step_start` says the executor was given the step's task, so its
  // own copy holds that momentum (Executor::RestoreStepStart restores it);
  // `step_start` is filled only by a snapshot mid-step (PullState).
  std::vector<float> step_start;
  bool has_step_start = false;
  // Host momentum only: the last completed step computed this parameter and
  // `step_start` still holds its momentum from before that step (until the
  // next step's first arrival). What Job::Rewind restores.
  bool prev_ran = false;
};

class Job {
 public:
  // `executors`: the scheduler's count (the measured load's size).
  // `host_momentum`: start every parameter's momentum as host zeros (false:
  // the executors hold state and start from zeros themselves).
  // `momentum` (a snapshot's, one per parameter of the table's sizes; empty:
  // none) is moved in instead of those zeros: a resumed job never holds its
  // momentum twice.
  Job(std::string id, uint64_t serial, int world_size, Table table,
      planner::Plan plan, int executors, bool host_momentum,
      std::vector<std::vector<float>> momentum = {});
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Constant for the job's life: read without the lock.
  const std::string& id() const { return id_; }
  // The momentum lives in the host buffers (ParamState::momentum), not in
  // executors that hold state.
  bool host_momentum() const { return host_momentum_; }
  // Unique in this daemon: the executors' StateKey::job.
  uint64_t serial() const { return serial_; }
  int world_size() const { return world_size_; }
  const Table& table() const { return table_; }
  const planner::Plan& plan() const { return plan_; }
  int num_params() const { return static_cast<int>(table_.params.size()); }
  // The principal that created the job (principal.h; empty: unowned). Set
  // once, before the job is published in the service's jobs; constant
  // after, so read without the lock.
  const std::string& owner() const { return owner_; }
  void set_owner(std::string owner) { owner_ = std::move(owner); }
  // Its share of the executors against other backlogged jobs (scheduler.h):
  // the weight of the principal that made it, as of then. Set once, like
  // the owner, before the job is published.
  double weight() const { return weight_; }
  void set_weight(double weight) { weight_ = weight; }
  // Its principal's cap on its jobs' share of an executor under contention
  // (quota.h Quotas::max_device_share, share_cap.h), as of its creation,
  // like the weight; 1: none.
  double max_device_share() const { return max_device_share_; }
  void set_max_device_share(double s) { max_device_share_ = s; }
  // The executors hold the momentum and keep a step-start copy of it
  // (Executor::keeps_step_start): the job can be rolled back mid-step. Set
  // once, like the owner, before the job is published.
  bool keeps_step_start() const { return keeps_step_start_; }
  void set_keeps_step_start(bool keeps) { keeps_step_start_ = keeps; }

  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // --- Ranks.
  // By rank; null until that rank opens and after it closes.
  const std::vector<std::shared_ptr<Session>>& ranks() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ranks_;
  }
  int open_ranks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `s` is its rank's open session (false once it closed).
  bool Holds(const Session& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts in the executors' per-step load (Status): a rank is open and
  // the job can still step.
  bool open() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !broken_ && open_ranks() > 0;
  }
  // Some parameter of the step in progress arrived, runs or is done (or a
  // rolled-back step's computation has not ended yet).
  bool mid_step() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Some parameter's computation is in progress (submitted, not ended).
  bool running() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the state as of the last completed step can be had mid-step:
  // every parameter that ran in the step in progress kept a pre-step copy
  // (host momentum, or executors that keep a step-start copy). False with
  // executors that hold state without such a copy (momentum advanced in
  // place) once a parameter ran.
  bool can_roll_back() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Momentum as of the last completed step, by parameter (the pre-step copy
  // where the parameter ran this step). Requires can_roll_back() and no
  // parameter running().
  std::vector<const std::vector<float>*> last_complete_momentum() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts `s` (of this job, its rank free) on its rank, starting at the
  // job's next step.
  void OpenRank(std::shared_ptr<Session> s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `s` off its rank (a no-op when it is not there).
  void CloseRank(const Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens in flight (service_open.cc): a rank admitted by OpenSession
  // whose session is not on its rank yet (its cover check and region are
  // made without the service's lock). Its rank is taken meanwhile (another
  // open of it is refused), and the job counts as open: the reaper does
  // not drop it, resume=replace does not replace it. Changed with the
  // service's mu_ held too, like drop_at().
  bool joining(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return joining_[rank] != 0;
  }
  int joining() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return joining_count_;
  }
  void BeginJoin(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndJoin(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- Breaking: a rank left mid-step, a step or a transfer failed, or
  // state was half written. A broken job never steps again.
  bool broken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return broken_; }
  // Returns false when it was broken already.
  bool Break() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every open rank's Step stream with `why`.
  void AbortStreams(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank left mid-step: the step in progress is voided instead of breaking
  // the job. Every parameter's momentum goes back to the last completed step
  // (running ones when their computation ends: EndParam), arrivals and the
  // step's counters are cleared, and every open rank's step state restarts
  // at completed_steps() + 1. False (nothing changed) when !can_roll_back().
  // With keeps_step_start(), the executors' copies are restored by the
  // caller: see TakeStepStartRestores.
  bool RollBack() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // keeps_step_start(): the parameters whose executor state must be put
  // back to its step-start copy (Executor::RestoreStepStart), queued by
  // RollBack (parameters not running) and by EndParam returning false (a
  // rolled-back parameter whose computation ended). The caller restores
  // them before it releases the lock (RestoreStepStarts, job_state.h).
  std::vector<int> TakeStepStartRestores() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::move(restores_);
  }

  // --- A step.
  // What an arrival leads to.
  enum class Arrival {
    kWaiting,  // other ranks have not declared it yet (or one is closed)
    kRun,      // the step runs: the caller submits it (ParamWork)
    kAbsent,   // every rank declared it absent: nothing is computed, the
               // caller delivers it as absent (StepPipeline::Deliver)
  };
  // Rank `rank`'s gradient of `param` has arrived (`absent`: the rank has
  // none this step). The one rule of when a parameter's step runs: when
  // that was the last rank's and every rank is open. It is then running
  // (also when absent: until its Deliver ends it) and the caller submits
  // or delivers it once the lock is released. Absent only when every rank
  // said so (SHARDING_UNREDUCED: an absent rank otherwise counts as zeros;
  // the other shardings must agree, AbsentDisagrees).
  Arrival Arrive(int rank, int param, bool absent = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `rank` declaring `param` absent (or present) disagrees with a
  // rank that declared it already this step: the other rank's index, or -1.
  // SHARDING_REPLICATED, SHARDING_ROWS and SHARDING_BLOCKS must agree.
  int AbsentDisagrees(int rank, int param, bool absent) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Host momentum: keeps the parameter's momentum as its step_start before
  // its computation changes it, without the lock (the parameter is running:
  // its momentum is the step's own, see running_param): step_start and
  // momentum trade buffers, and `momentum` holds nothing meaningful until
  // the computation, which must read step_start (ComputeTask::momentum_in),
  // writes it. No-op otherwise.
  void SaveStepStart(int param);
  // The parameter's step ended (delivered or failed): no longer running,
  // its arrivals cleared for the next step. False when its step was rolled
  // back meanwhile (RollBack): the result is to be discarded (its momentum
  // is restored here).
  bool EndParam(int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `seconds` of Executor::Compute (Work::Computed) on `param`'s
  // executor in the step in progress.
  void AddComputeSeconds(int param, double seconds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A parameter's update of `step` went to every rank (`delivered`: read
  // just before it was announced to the first). True when it was the
  // step's last: the step is complete (completed_steps() == step), its
  // measured load is the last step's, and its exposed latency ends at
  // `delivered`.
  bool FinishParam(int64_t step,
                   std::chrono::steady_clock::time_point delivered)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rewind (protocol minor 1): undoes the last completed step `step`, after
  // its step_complete and before any arrival of the next one. Every
  // parameter's momentum goes back to before `step` (its pre-step copy) and
  // every open rank's next step is `step` again. FAILED_PRECONDITION (the
  // job unchanged) with executors that hold state (no pre-step copy), more
  // than one rank (see AskRewind), mid-step, or a step other than the last
  // completed one.
  absl::Status Rewind(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rewind of a job of several ranks: `rank` asks to undo `step`. The step
  // is undone (as Rewind) only when every rank has asked; until then the
  // asks are recorded (per job, for that step) and the caller waits for the
  // round's outcome (AwaitRewind). The same refusals as Rewind, but for the
  // number of ranks; a refusal with asks pending fails their round too.
  absl::Status AskRewind(int rank, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits, after an AskRewind that did not complete its round, until every
  // rank asked (OK: rewound), the round failed (its error), or
  // `s` closed, a rank closed or the job broke (ABORTED naming the ranks
  // that had not asked).
  absl::Status AwaitRewind(const Session& s, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A message of the next step from `rank` while other ranks asked to
  // rewind: FAILED_PRECONDITION naming the ranks, which also ends the
  // waiting ranks' round (the job's state untouched: still after `step`).
  // OK when no rewind is pending or `rank` is not the cause.
  absl::Status CheckNoRewindPending(int rank, int64_t next_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ranks whose AskRewind waits for the others (none: empty), and the
  // step they asked to rewind, for Status.
  std::vector<int> RewindWaiting(int64_t* step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- State.
  ParamState& param(int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return params_[i];
  }
  const ParamState& param(int i) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return params_[i];
  }
  // The parameter's state while it runs (ParamState::running), without the
  // lock: from its submission until its EndParam nothing else reads or
  // writes its momentum and work (state is read and written only between
  // steps, when no parameter runs), so they are the step's own.
  ParamState& running_param(int i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    assert(params_[i].running);
    return params_[i];
  }
  int64_t completed_steps() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_steps_;
  }
  // State was set (SetState, or a snapshot when the job was made): every
  // open rank's next step is `completed + 1`.
  void SetCompletedSteps(int64_t completed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // By executor index (plan().predicted_load's size): seconds of
  // Executor::Compute spent on this job's matrices in the last completed
  // step (all zeros until one completes).
  const std::vector<double>& last_step_compute_seconds() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return last_step_compute_seconds_;
  }
  // Exposed latency (docs/design.md "Exposed latency"), per completed step:
  // from the step's last hand-off (the Arrive that made its last parameter
  // run or absent on every rank) to its completion (FinishParam), over the
  // last kExposedWindow steps. A rolled-back step is not measured.
  static constexpr size_t kExposedWindow = 1024;
  const LatencyWindow& exposed_latency() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return exposed_;
  }

  // --- Idle drop (service_reap.cc).
  // When the job, without an open rank, is dropped: set when its last rank
  // closes (max() until then); meaningless while a rank is open, which is
  // what cancels the drop (the next last close sets a new time). Changed
  // only with the service's mu_ held too, so that a scan of its jobs under
  // that lock sees it settled.
  std::chrono::steady_clock::time_point drop_at() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return drop_at_;
  }
  void set_drop_at(std::chrono::steady_clock::time_point t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    drop_at_ = t;
  }
  // Dropped by the reaper: no longer in the service's jobs, its executors'
  // state released (nothing may read it: SnapshotAll skips the job).
  bool dropped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return dropped_; }
  void MarkDropped() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { dropped_ = true; }

  // --- GetState readers (state.cc, StateReader). While one is open the job
  // stays at the step boundary it was opened at: a parameter whose
  // gradients have all arrived (Arrive said it runs) is deferred by
  // SubmitParams instead of submitted, and the last reader to go submits
  // the deferred ones. Nothing else changes momentum meanwhile (SetState
  // is refused).
  int state_readers() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_readers_;
  }
  void AddStateReader() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++state_readers_; }
  // Returns the deferred (step, parameter) pairs when it was the last.
  std::vector<std::pair<int64_t, int>> RemoveStateReader()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (--state_readers_ > 0) return {};
    return std::move(deferred_);
  }
  void Defer(int64_t step, int param) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    deferred_.emplace_back(step, param);
  }

 private:
  const std::string id_;
  const uint64_t serial_;
  const int world_size_;
  const Table table_;
  const planner::Plan plan_;
  const bool host_momentum_;
  std::string owner_;              // set before publication (owner())
  double weight_ = 1;              // set before publication (weight())
  double max_device_share_ = 1;    // the same (max_device_share())
  bool keeps_step_start_ = false;  // set before publication

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Session>> ranks_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> joining_ ABSL_GUARDED_BY(mu_);  // by rank
  int joining_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<ParamState> params_ ABSL_GUARDED_BY(mu_);
  int64_t completed_steps_ ABSL_GUARDED_BY(mu_) = 0;
  // Parameters finished in the step in progress.
  int params_done_ ABSL_GUARDED_BY(mu_) = 0;
  // The completed step Rewind can undo (0: none): set when a step completes
  // with host momentum, cleared by the next step's first arrival, a
  // rollback, state being set, or a rewind.
  int64_t rewind_step_ ABSL_GUARDED_BY(mu_) = 0;
  // Several ranks (AskRewind): by rank, who asked to rewind
  // `rewind_asked_step_` (0: no ask pending); each round's outcome bumps
  // `rewind_round_` and sets `rewind_result_` for the ranks that wait.
  std::vector<uint8_t> rewind_asked_ ABSL_GUARDED_BY(mu_);
  int rewind_asked_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rewind_asked_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rewind_round_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status rewind_result_ ABSL_GUARDED_BY(mu_);
  // Ends the pending round (if any) with `why`.
  void EndRewindRound(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ranks (not) in rewind_asked_, as "0, 2".
  std::string RewindRanks(bool asked) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rewind's checks but for the number of ranks; its undoing.
  absl::Status CheckRewind(int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DoRewind(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // By executor: Compute seconds of the step in progress (AddComputeSeconds),
  // and of the last completed one.
  std::vector<double> compute_seconds_ ABSL_GUARDED_BY(mu_);
  std::vector<double> last_step_compute_seconds_ ABSL_GUARDED_BY(mu_);
  // Parameters of the step in progress whose gradients every rank handed
  // off (Arrive said kRun or kAbsent), and when the last of them did.
  int handed_off_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point last_hand_off_ ABSL_GUARDED_BY(mu_);
  LatencyWindow exposed_ ABSL_GUARDED_BY(mu_){kExposedWindow};
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point drop_at_ ABSL_GUARDED_BY(mu_) =
      std::chrono::steady_clock::time_point::max();
  bool dropped_ ABSL_GUARDED_BY(mu_) = false;
  int state_readers_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> restores_ ABSL_GUARDED_BY(mu_);  // TakeStepStartRestores
  std::vector<std::pair<int64_t, int>> deferred_ ABSL_GUARDED_BY(mu_);
};

// One rank of a job. Its identity, layout and region are fixed when it is
// made (before it is published in the service's tables), so they are read
// without a lock; what changes with the steps is its SessionState, guarded
// by the job's mu().
class Session {
 public:
  Session(std::string id, std::shared_ptr<Job> job, int rank,
          v1::Transport transport, transport::Layout layout,
          std::vector<ShardMap> shards,
          std::unique_ptr<transport::Region> region, std::string peer = "");
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  // The region first (cuda_ipc: its mapping closed), then the release.
  ~Session();

  const std::string& id() const { return id_; }
  std::shared_ptr<Job> job() const { return job_.lock(); }
  int rank() const { return rank_; }
  v1::Transport transport() const { return transport_; }
  const transport::Layout& layout() const { return layout_; }
  // The elements of each parameter this rank holds, by parameter.
  const std::vector<ShardMap>& shards() const { return shards_; }
  std::chrono::steady_clock::time_point opened() const { return opened_; }
  // Where its OpenSession came from (Principal::peer; "" when unknown).
  const std::string& peer() const { return peer_; }
  // Null only after TakeRegion.
  transport::Region* region() const { return region_.get(); }
  // Takes the region away before the session ends (the service's
  // destructor ends GPU regions' transport threads while it is whole).
  std::unique_ptr<transport::Region> TakeRegion() { return std::move(region_); }
  const std::shared_ptr<RegionRelease>& release() const { return release_; }

  // The session's step state. `job` must be this session's job: clang's
  // analysis cannot name the mutex of an object reached through a
  // weak_ptr in ABSL_GUARDED_BY (clang-14), so the field is reached only
  // through this accessor, which requires the job's lock held.
  SessionState& state(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
    assert(job_raw_ == &job);
    return state_;
  }
  const SessionState& state(const Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu()) {
    assert(job_raw_ == &job);
    return state_;
  }

 private:
  const std::string id_;
  const std::weak_ptr<Job> job_;
  const Job* const job_raw_;  // for state()'s check only
  const int rank_;
  const v1::Transport transport_;
  const transport::Layout layout_;
  const std::vector<ShardMap> shards_;
  const std::string peer_;
  const std::chrono::steady_clock::time_point opened_ =
      std::chrono::steady_clock::now();
  std::unique_ptr<transport::Region> region_;
  const std::shared_ptr<RegionRelease> release_ =
      std::make_shared<RegionRelease>();
  SessionState state_;  // guarded by job_'s mu(): see state()
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_JOB_H_
