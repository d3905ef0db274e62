// Scheduler: one worker thread per executor, each with a ready queue per
// job. Between jobs a worker shares the executor by weight; within a job it
// takes the earliest ready matrix by forward order (then arrival), so the
// next forward's first layers are served first, and every other ready one
// of that job with the same shape and hyperparameters (up to max_batch) as
// one batched launch, where batching saves time
// (Executor::batching_saves_time: the CUDA executor); else one matrix at a
// time (the CPU executor), so that each update leaves as soon as it is
// computed and none waits behind later layers' same-shape matrices.
//
// Sharing rule (weighted fair queuing on predicted cost, the virtual-time
// form of deficit round robin): each job on an executor has a virtual time,
// the predicted cost it was served (Work::flops(), the planner's cost)
// divided by its weight (Work::weight(), its principal's, default 1). The
// worker serves one batch of the backlogged job with the least virtual
// time (ties: the one served least recently), then charges the job the
// batch's cost. A job that becomes backlogged starts at the least virtual
// time of the jobs backlogged then, or at the start tag of the batch taken
// last (its job's virtual time before that batch was charged) when that is
// less: start-time fair queuing; never before its own virtual time, so a
// job whose next matrix comes while its own batch runs keeps that batch's
// charge. No credit is saved while idle and none lost, but a job arriving
// during another's batch counts as having arrived when that batch started.
// So backlogged jobs get the executor's time in proportion to their
// weights (as far as the predicted cost follows the time), interleaved per
// batch, and:
//
//   Bound: a job that becomes backlogged runs its first batch right after
//   the batch in flight, and then runs up to w / w_j times that batch's
//   predicted cost of its own work before job j's next batch. So a job of
//   weight w whose step costs s <= (w / w_j) * (the batch in flight's cost)
//   waits at most that one batch of another job's work, however many
//   batches its step takes (the small-tenant bound, tests/
//   small_tenant_test.cc). In general it waits at most the batch in flight
//   plus, per other backlogged job j, w_j / w * s and one batch of j.
//
// Principal cap (share_cap.h, a principal's `max_device_share=`): the
// weight a job is charged with is its weight scaled so that the backlogged
// jobs of one principal together get at most its cap of the executor's time
// while another principal's jobs are backlogged there (recomputed at each
// pick over the jobs backlogged then). Work-conserving: a principal alone
// uses the whole executor. The bound above holds with these weights.
//
// A batch never mixes jobs: each job is charged exactly its own launch, and
// a small job's batch is never lengthened by another job's matrices. (The
// price: two jobs with equal shapes are no longer batched together.)
//
// Which executor a matrix goes to is the planner's decision (planner.h); the
// scheduler only runs queues.

#ifndef DMUON_SERVER_SCHEDULER_H_
#define DMUON_SERVER_SCHEDULER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/executor.h"
#include "server/ready_queue.h"

namespace dmuon::server {

// One batched Executor::Compute as a worker ran it (Work::Ran): what the
// step timeline shows of it (server/step_trace.h).
struct BatchRun {
  int executor = 0;    // the worker's executor index
  uint64_t batch = 0;  // the scheduler's count of batches run before it
  int size = 0;        // matrices in the Compute
  // TraceNowNs() (base/trace.h: CLOCK_MONOTONIC) just before and after the
  // Compute call.
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// One matrix ready to run. Prepare() gathers the gradient and returns the
// task (an error, e.g. a non-finite gradient, skips the compute); Finish()
// delivers the result or the error. All three run on the worker thread:
// Computed(), when the task reached Executor::Compute, just before Finish().
class Work {
 public:
  virtual ~Work() = default;
  virtual int32_t forward_order() const = 0;
  virtual kernels::Shape shape() const = 0;
  virtual const MuonParams* muon() const = 0;
  virtual double flops() const = 0;
  // The job it belongs to (its serial) and the job's weight (> 0): the
  // unit of fair sharing (above). One job's works all give one weight.
  virtual uint64_t job_serial() const { return 0; }
  virtual double weight() const { return 1; }
  // Its principal (the job's owner; empty: anonymous) and that principal's
  // cap on its jobs' combined share of an executor under contention, in
  // (0, 1] (1: none). One job's works all give the same.
  virtual std::string principal() const { return ""; }
  virtual double max_share() const { return 1; }
  virtual absl::StatusOr<ComputeTask> Prepare() = 0;
  virtual void Finish(absl::Status status) = 0;
  // This matrix's share of its batch's Executor::Compute wall time: the
  // batch's seconds divided evenly among the batch's matrices (they have
  // one shape and one set of hyperparameters, so one cost).
  virtual void Computed(double seconds) {}
  // The batch it ran in, when it reached Executor::Compute: called just
  // before Computed().
  virtual void Ran(const BatchRun& run) {}
};

struct ExecutorStats {
  std::string device;
  double busy_seconds = 0;
  int queue_depth = 0;
  uint64_t matrices = 0;
  double flops = 0;
  bool healthy = true;           // Executor::healthy() when read
  uint64_t memory_bytes = 0;     // Executor::memory_bytes() when read
  std::string last_error;        // Executor::last_error() when read
  uint64_t graph_fallbacks = 0;  // Executor::graph_fallbacks() when read
  // Per-step load over the open jobs (ExecutorStatus in dmuon.proto): the
  // service fills these in; Scheduler::Stats() leaves them 0.
  double predicted_step_seconds = 0;
  double measured_step_seconds = 0;
};

// One job's use of one executor, from the scheduler's own accounting.
struct JobShareStats {
  uint64_t job = 0;
  double weight = 1;
  double busy_seconds = 0;  // its batches' Prepare+Compute+Finish time
  double cost = 0;          // predicted cost served (sum of Work::flops())
  uint64_t batches = 0;
  uint64_t matrices = 0;
  int queue_depth = 0;
  // Queue wait: from Submit until the matrix's batch was taken.
  double wait_seconds = 0;       // summed over its matrices
  double max_wait_seconds = 0;   // the longest
  double max_batch_seconds = 0;  // its longest batch (busy time)
};

class Scheduler {
 public:
  Scheduler(std::vector<std::unique_ptr<Executor>> executors, int max_batch);
  ~Scheduler();  // Shutdown()

  int executors() const { return static_cast<int>(workers_.size()); }
  // Queues `work` on executor `index` (taken modulo the executor count).
  void Submit(int index, std::shared_ptr<Work> work);
  // Queues every (executor index, work) pair at once, under one lock: no
  // worker sees a part of them, so a declaration's same-shape matrices are
  // batched alike at every step, however the threads interleave.
  void SubmitAll(std::vector<std::pair<int, std::shared_ptr<Work>>> works);
  std::vector<ExecutorStats> Stats() const;
  // Per job, its use of executor `index` (modulo the count), by job.
  std::vector<JobShareStats> JobStats(int index) const;
  // Per job serial, its use of every executor summed (queue_depth summed,
  // max_wait_seconds the largest).
  std::map<uint64_t, JobShareStats> JobTotals() const;
  // Indices of the executors that are healthy now (Executor::healthy()).
  std::vector<int> Healthy() const;

  // Executor state hooks (executor.h), forwarded to executor `index` (modulo
  // the count); DropJob goes to every executor. Thread-safe.
  bool holds_state() const { return holds_state_; }
  bool reads_device_memory() const { return reads_device_memory_; }
  absl::Status ReadState(int index, const StateKey& key,
                         absl::Span<float> host);
  absl::Status WriteState(int index, const StateKey& key,
                          absl::Span<const float> host);
  // Every executor that holds state keeps a step-start copy (and at least
  // one holds state): a mid-step job of such executors can be rolled back.
  bool keeps_step_start() const { return keeps_step_start_; }
  absl::Status RestoreStepStart(int index, const StateKey& key);
  absl::Status ReadStepStart(int index, const StateKey& key,
                             absl::Span<float> host);
  void DropJob(uint64_t job);
  // Runs what is queued, then stops the workers. Idempotent.
  void Shutdown();

 private:
  using Queued = ReadyQueue::Entry;
  // One job on one executor: its ready queue (ready_queue.h), its virtual
  // time and counters.
  struct JobQueue {
    ReadyQueue ready;
    double vtime = 0;        // cost served / weight, see the sharing rule
    std::string principal;   // Work::principal()
    double max_share = 1;    // Work::max_share()
    uint64_t last_pick = 0;  // the worker's pick count when last served
    bool dropped = false;    // DropJob came while matrices were queued
    JobShareStats stats;
  };
  struct Lane {
    std::map<uint64_t, JobQueue> jobs;  // by job serial
    uint64_t picks = 0;
    int depth = 0;  // ready matrices over all jobs
    // The start tag of the batch taken last: its job's virtual time before
    // the batch was charged (see the sharing rule).
    double last_start = 0;
  };
  // Takes the next batch of an executor's lane (sharing rule above), at
  // most `max_batch` matrices; sets `job` to its job's serial.
  std::vector<Queued> PickBatch(Lane& lane, int max_batch, uint64_t& job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The weight job `job` of `lane` is charged with now: its weight under
  // its principal's cap against the lane's backlogged jobs (share_cap.h).
  static double ChargedWeight(const Lane& lane, uint64_t job);
  // After a batch: executor `index`'s counters and job `job`'s busy time.
  void Account(size_t index, uint64_t job, double busy, size_t matrices,
               double flops) ABSL_LOCKS_EXCLUDED(mu_);
  // An executor and its thread: fixed once the constructor returns.
  struct Worker {
    std::unique_ptr<Executor> executor;
    std::thread thread;
  };
  void Loop(size_t index) ABSL_LOCKS_EXCLUDED(mu_);

  Executor& executor(int index) const {
    return *workers_[static_cast<size_t>(index) % workers_.size()].executor;
  }

  const int max_batch_;
  bool holds_state_ = false;          // any executor holds state
  bool keeps_step_start_ = false;     // see keeps_step_start()
  bool reads_device_memory_ = false;  // every executor reads device memory
  std::vector<Worker> workers_;       // by executor index
  // Never held while a Work or an Executor runs.
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t batches_ ABSL_GUARDED_BY(mu_) = 0;  // BatchRun::batch
  // By executor index: its jobs' ready queues and its counters.
  std::vector<Lane> lanes_ ABSL_GUARDED_BY(mu_);
  std::vector<ExecutorStats> stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SCHEDULER_H_
