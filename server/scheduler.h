// Scheduler: one worker thread per executor, each with a ready queue ordered
// by forward order (earliest first, then arrival), so the next forward's
// first layers are served first. A worker takes the earliest ready matrix
// and every other ready one in its queue with the same shape and
// hyperparameters (up to max_batch) as one batched launch, where batching
// saves time (Executor::batching_saves_time: the CUDA executor); else one
// matrix at a time (the CPU executor), so that each update leaves as soon as
// it is computed and none waits behind later layers' same-shape matrices.
//
// Which executor a matrix goes to is the planner's decision (planner.h); the
// scheduler only runs queues.

#ifndef DMUON_SERVER_SCHEDULER_H_
#define DMUON_SERVER_SCHEDULER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/executor.h"

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
  struct Queued {
    int32_t order;
    uint64_t seq;
    std::shared_ptr<Work> work;
  };
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
  // By executor index: its ready queue (unsorted; scanned, queues are
  // short) and its counters.
  std::vector<std::vector<Queued>> queues_ ABSL_GUARDED_BY(mu_);
  std::vector<ExecutorStats> stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SCHEDULER_H_
