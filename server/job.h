// Internal to the service: the state of a job and of its sessions.
// Everything mutable is guarded by Job::mu.

#ifndef DMUON_SERVER_JOB_H_
#define DMUON_SERVER_JOB_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "proto/dmuon.pb.h"
#include "server/service.h"
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
  void Set() {
    {
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
    }
    cv_.notify_all();
  }
  bool done() const {
    std::lock_guard<std::mutex> l(mu_);
    return done_;
  }
  // Whether it was set by `t`.
  bool WaitUntil(std::chrono::steady_clock::time_point t) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_until(l, t, [&] { return done_; });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

struct Session {
  Session() = default;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  // The region first (cuda_ipc: its mapping closed), then the release.
  ~Session() {
    region.reset();
    release->Set();
  }

  std::string id;
  std::weak_ptr<Job> job;
  int rank = 0;
  v1::Transport transport = v1::TRANSPORT_INLINE;
  std::unique_ptr<transport::Region> region;
  transport::Layout layout;
  std::vector<RowRange> rows;  // by parameter
  std::chrono::steady_clock::time_point opened =
      std::chrono::steady_clock::now();

  // Guarded by the job's mu.
  int64_t step = 1;                // the step in progress or next
  std::vector<uint8_t> declared;   // by parameter, this step
  std::vector<uint64_t> received;  // inline gradient bytes, this step
  int delivered = 0;               // updates delivered this step
  bool step_started = false;
  std::chrono::steady_clock::time_point step_t0;
  std::shared_ptr<StepSink> sink;
  bool closed = false;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  const std::shared_ptr<RegionRelease> release =
      std::make_shared<RegionRelease>();
};

struct ParamState {
  // Whole matrix, fp32. With executors that hold state (executor.h) this is
  // a mirror, filled only when state is read or written (empty: never
  // materialized, i.e. zeros or the executor's copy).
  std::vector<float> momentum;
  std::vector<float> work;       // gathered gradient, then the update
  std::vector<uint8_t> arrived;  // by rank, this step
  int arrived_count = 0;
  bool running = false;
};

struct Job {
  std::string id;
  uint64_t serial = 0;  // unique in this daemon: the executors' StateKey::job
  int world_size = 1;
  Table table;
  planner::Plan plan;

  std::mutex mu;
  std::vector<std::shared_ptr<Session>> ranks;  // null until that rank opens
  std::vector<ParamState> params;
  int64_t completed_steps = 0;
  int params_done = 0;  // parameters finished in the step in progress
  // By executor index (plan.predicted_load's size): seconds of
  // Executor::Compute spent on this job's matrices (Work::Computed) in the
  // step in progress, and in the last completed step (all zeros until one
  // completes).
  std::vector<double> compute_seconds;
  std::vector<double> last_step_compute_seconds;
  bool broken = false;  // a rank left mid-step: the job can no longer step
  // When the job, without an open rank, is dropped (ReapIdleJobs): set when
  // its last rank closes (max() until then); meaningless while a rank is
  // open, which is what cancels the drop (the next last close sets a new
  // time). Changed only with the service's mu_ held too, so that a scan of
  // jobs_ under mu_ sees it settled.
  std::chrono::steady_clock::time_point drop_at =
      std::chrono::steady_clock::time_point::max();
  // Dropped by the reaper: no longer in jobs_, its executors' state released
  // (nothing may read it: SnapshotAll skips the job).
  bool dropped = false;

  int open_ranks() const {
    int n = 0;
    for (const auto& s : ranks) n += s != nullptr;
    return n;
  }
  // Counts in the executors' per-step load (Status): a rank is open and
  // the job can still step.
  bool open() const { return !broken && open_ranks() > 0; }
  bool mid_step() const {
    if (params_done > 0) return true;
    for (const auto& p : params)
      if (p.arrived_count > 0 || p.running) return true;
    return false;
  }
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_JOB_H_
