// Executors: one per optimizer device. An executor turns gathered gradients
// into updates, lr_scale * NS(momentum step(G)), for a batch of same-shape
// matrices with the same Muon hyperparameters. The CPU executor runs the
// kernels library's OpenBLAS path; the CUDA executor (cuda_executor.h) runs
// the kernels' CUDA path on one GPU.
//
// State. The CPU executor works on the host momentum buffer of each task.
// An executor whose holds_state() is true (CUDA) keeps momentum in its own
// memory instead, keyed by ComputeTask::state: on the first Compute for a key
// it initializes its copy from `momentum` (zeros when null) and from then on
// its copy is the truth. The service copies it out with ReadState before it
// reads the host buffers (GetState, snapshots), in with WriteState after it
// writes them (SetState), and forgets a job with DropJob. The hooks may be
// called from any thread, concurrently with Compute on the worker thread.
//
// Device I/O. A task whose `device_io` is set (GPU transports) reads its
// gradient from, and writes its update to, device memory directly; only an
// executor whose reads_device_memory() is true may receive one.

#ifndef DMUON_SERVER_EXECUTOR_H_
#define DMUON_SERVER_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"
#include "server/shard_map.h"
#include "server/table.h"

namespace dmuon::server {

// One job parameter's optimizer state. `job` is the job's serial number in
// this daemon (never reused, so a job recreated under the same id never sees
// an old job's state).
struct StateKey {
  uint64_t job = 0;
  int32_t param = -1;
  bool operator<(const StateKey& o) const {
    return std::tie(job, param) < std::tie(o.job, o.param);
  }
  bool operator==(const StateKey& o) const {
    return job == o.job && param == o.param;
  }
};

// One rank's share of a task in device memory (fp32, row-major, addresses
// valid in this process). The gradient holds rows [row_begin, row_end) of
// the matrix (kBlocks: the elements `map` names, a local tensor of
// map.local_rows() x map.local_cols()); the update receives the same.
struct DevicePart {
  int device = -1;  // CUDA ordinal (in this process) of both buffers
  // Null (kMean only): the rank has no gradient this step (declared absent);
  // it counts as zeros in the mean and still receives the update.
  const float* grad = nullptr;
  float* update = nullptr;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  // A cudaEvent_t recorded by the writer after the gradient was written;
  // the executor's stream waits on it before reading. Null: none.
  void* ready_event = nullptr;
  ShardMap map;  // kBlocks only
};

// How the parts combine into the gradient (the Sharding modes):
//   kFirst: part 0's whole gradient (replicated);
//   kRows:  each part's rows (row-sharded; the parts tile the matrix);
//   kMean:  the mean of the parts' whole gradients, summed in part order
//           then scaled by 1/parts in fp32 (unreduced), as the host does;
//   kBlocks: each part's map (SHARDING_BLOCKS): an element held by several
//           parts is taken from the first (lowest rank) of them; a part
//           with an empty map (holding nothing) has no gradient to read.
enum class Gather { kFirst, kRows, kMean, kBlocks };

struct DeviceIo {
  Gather gather = Gather::kFirst;
  std::vector<DevicePart> parts;  // rank order
};

// One matrix's work. Host I/O (device_io null): `grad` is the whole gathered
// fp32 gradient, `update` receives lr_scale * NS(U); both are
// shape.elements() long and `update` may alias `grad`. Device I/O: grad and
// update are unused; every part's update rows are written instead.
// `momentum` is the job's host fp32 state for the matrix (updated in place
// by executors that do not hold state; the initial value for those that do,
// where null means zeros). Executors that do not hold state read the
// momentum as of the last completed step from `momentum_in` when it is set
// and write the new one to `momentum` (Job::SaveStepStart keeps the old one
// where it was for a rollback instead of copying it); null: `momentum`
// holds it and is updated in place.
struct ComputeTask {
  const float* grad = nullptr;
  float* momentum = nullptr;
  const float* momentum_in = nullptr;
  float* update = nullptr;
  kernels::Shape shape;
  const MuonParams* muon = nullptr;
  double lr_scale = 1.0;
  StateKey state;
  const DeviceIo* device_io = nullptr;
  // Device I/O only (the host checked host gradients already): set to true
  // when the gathered gradient has a NaN/Inf. That task is then skipped —
  // momentum untouched, zero update written — and the others still run.
  bool* nonfinite = nullptr;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string device() const = 0;
  // Every task of `batch` has the same shape and hyperparameters. Inputs are
  // finite (host I/O) and shapes valid (the caller checked), so a failure is
  // internal or a device fault (out of memory, a lost device); momentum may
  // then have advanced for some tasks of the batch.
  virtual absl::Status Compute(absl::Span<const ComputeTask> batch) = 0;
  // Whether Compute runs k same-shape matrices in less time than k calls of
  // one (the CUDA executor: one launch, one graph). A batch's updates leave
  // together when it ends; an executor that only loops over the batch (the
  // CPU executor) gains nothing from it and would hold the next forward's
  // first update behind later layers' matrices, so the scheduler gives it
  // one matrix at a time, in forward order (scheduler.h).
  virtual bool batching_saves_time() const { return true; }

  // See the header comment. The defaults are those of an executor working on
  // host state (CPU): nothing to copy.
  virtual bool holds_state() const { return false; }
  // Copies the executor's state for `key` into `host` (shape.elements()
  // floats); leaves `host` as it is when the executor has none for `key`.
  virtual absl::Status ReadState(const StateKey& key, absl::Span<float> host) {
    return absl::OkStatus();
  }
  // Replaces the executor's state for `key` with `host` if it has one (if
  // not, the first Compute reads the host buffer anyway).
  virtual absl::Status WriteState(const StateKey& key,
                                  absl::Span<const float> host) {
    return absl::OkStatus();
  }
  // Frees every state of job serial `job`.
  virtual void DropJob(uint64_t job) {}

  // Step-start copies (executors that hold state). When keeps_step_start()
  // is true, every Compute first copies each task's state, as it is before
  // that Compute changes it (also for a task then skipped as non-finite), to
  // a second buffer of the key: its "step start" (the momentum as of the
  // job's last completed step while the parameter's step is incomplete).
  // RestoreStepStart puts it back as the state (a rolled-back step);
  // ReadStepStart copies it into `host` like ReadState (a snapshot mid-step).
  // Both leave everything as it is when the executor has no state for `key`,
  // and are called only while no Compute of `key` is in progress.
  virtual bool keeps_step_start() const { return false; }
  virtual absl::Status RestoreStepStart(const StateKey& key) {
    return absl::UnimplementedError("this executor keeps no step-start copy");
  }
  virtual absl::Status ReadStepStart(const StateKey& key,
                                     absl::Span<float> host) {
    return absl::UnimplementedError("this executor keeps no step-start copy");
  }
  virtual bool reads_device_memory() const { return false; }

  // Health and memory, for Status and /metrics; cheap and thread-safe.
  // Unhealthy: the last batch failed on a device fault (out of memory until
  // a later batch succeeds; any other device error for good).
  virtual bool healthy() const { return true; }
  virtual std::string last_error() const { return ""; }
  // Device memory the executor holds (state pool, staging, kernel plans).
  virtual uint64_t memory_bytes() const { return 0; }
  // The total memory of the device the executor keeps its state in (its
  // GPU's); 0 when it keeps state in host memory. dmuond sizes the default
  // --max-state-bytes from it (daemon/config.h DefaultStateBytes).
  virtual uint64_t device_memory_capacity() const { return 0; }
  // Kernel plans whose CUDA graph failed and that run eagerly instead
  // (gpu_logic.h GraphFallback); the executor stays in service.
  virtual uint64_t graph_fallbacks() const { return 0; }
};

// `threads` OpenBLAS threads for this executor's products (0: all cores).
std::unique_ptr<Executor> NewCpuExecutor(int index, int threads);

// True when two tasks can share one batched launch.
bool SameBatchKey(const ComputeTask& a, const ComputeTask& b);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_EXECUTOR_H_
