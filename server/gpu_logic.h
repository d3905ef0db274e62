// Plain C++ logic of the CUDA executors (cuda_executor.h), tested on the CPU:
// the --devices spec, the health rules, how a batch is cut into launches, and
// the fallback from CUDA graphs to eager launches.

#ifndef DMUON_SERVER_GPU_LOGIC_H_
#define DMUON_SERVER_GPU_LOGIC_H_

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace dmuon::server {

// --devices: "cpu", "auto" (every GPU, else the CPU), "cuda" (every GPU) or
// "cuda:0,1" (those CUDA ordinals, as this process numbers them).
struct DeviceSpec {
  enum class Kind { kCpu, kAuto, kCuda };
  Kind kind = Kind::kCpu;
  std::vector<int> ordinals;  // kCuda: the listed ones; empty: every GPU
};
// INVALID_ARGUMENT naming the spec and what is wrong (unknown kind, a
// non-number or negative ordinal, a duplicate, an empty list).
absl::StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& spec);

// The CUDA ordinals to run executors on, given `count` usable GPUs (count < 0:
// the CUDA runtime failed, `why` says how). kAuto: every GPU, or none (the
// caller falls back to the CPU). kCuda: FAILED_PRECONDITION when there is no
// GPU (with `why`) or an ordinal is >= count.
absl::StatusOr<std::vector<int>> ResolveCudaDevices(const DeviceSpec& spec,
                                                    int count,
                                                    const std::string& why);

// How a failed batch counts against its executor.
enum class Fault {
  kNone,  // OK
  // INVALID_ARGUMENT: the input; UNIMPLEMENTED: a shape no cuBLASLt
  // algorithm takes (kernels/cuda/lt_matmul.h); FAILED_PRECONDITION: a
  // fallback that --strict refused (fallbacks.h; no CUDA error maps to it,
  // base/cuda_status.h): the batch, not the device.
  kInput,
  kOutOfMemory,  // RESOURCE_EXHAUSTED: unhealthy until a batch succeeds
  kDevice,       // anything else from CUDA: unhealthy for good
};
Fault ClassifyFault(const absl::Status& status);

// An executor's health, thread-safe. Healthy until a device fault; an
// out-of-memory clears with the next successful batch, any other device
// error never does (the CUDA context is unusable after a sticky error such
// as a lost device or an illegal address).
class Health {
 public:
  void Record(const absl::Status& status);
  bool healthy() const;
  // A fault that no later batch can clear.
  bool out_of_service() const;
  std::string last_error() const;

 private:
  mutable absl::Mutex mu_;
  bool healthy_ ABSL_GUARDED_BY(mu_) = true;
  bool sticky_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

// Cuts a batch of `n` same-shape matrices into launches whose sizes are
// powers of two no larger than `max_launch` (largest first), so an executor
// builds kernel plans for at most log2(max_launch) + 1 batch sizes per shape
// instead of one per size. n <= 0: none.
std::vector<int64_t> SplitBatch(int64_t n, int64_t max_launch);

// CUDA graphs with an eager fallback. Newton–Schulz launches replay a CUDA
// graph per plan (kernels/cuda/plan.h: a plan's first run for a buffer pair
// executes directly, the second captures, later ones replay). A capture can
// fail where the same work runs fine eagerly (a driver, library call or
// process setting that refuses capture or instantiation); that must not take
// the executor out of service. One GraphFallback per executor decides, per
// plan key (GraphKey), whether launches use graphs. Thread-safe.
//
// strict (dmuond --strict): the eager retry is refused instead. After a
// graph failure that is not an input error or out of memory, `recover` runs
// and Run returns FAILED_PRECONDITION naming the fallback kind graph_eager
// (fallbacks.h), the key and the cause; nothing runs eagerly, nothing is
// counted, and the key keeps trying graphs.
class GraphFallback {
 public:
  explicit GraphFallback(bool use_graphs, bool strict = false)
      : enabled_(use_graphs), strict_(strict) {}

  // Whether launches of `key` replay graphs now.
  bool use_graphs(const std::string& key) const;

  // Runs launch(use_graphs(key)). When that fails with graphs on, and the
  // status is neither an input error (INVALID_ARGUMENT) nor out of memory
  // (RESOURCE_EXHAUSTED), the graph path is suspect: `recover` runs (it
  // clears the device's non-sticky error state and any capture left open;
  // its failure is returned as it is), then launch(false). When the eager
  // launch succeeds, `key` stays eager from then on, the fallback is counted
  // and `warn` gets a message naming `what`, the key and the cause — once
  // per cause (GraphFailureCause) for the executor's life, however many keys
  // hit it — and OK is returned. When it fails too, its status is returned
  // (a device fault, for Health to judge).
  //
  // `launch` must leave its input intact when it fails on the graph path (a
  // failed capture or graph launch executes nothing), so running it again
  // eagerly computes the same result.
  absl::Status Run(const std::string& what, const std::string& key,
                   const std::function<absl::Status(bool use_graphs)>& launch,
                   const std::function<absl::Status()>& recover,
                   const std::function<void(const std::string&)>& warn);

  // Plan keys that fell back to eager launches (each counted once).
  uint64_t fallbacks() const;

 private:
  const bool enabled_;
  const bool strict_;
  mutable absl::Mutex mu_;  // not held while `launch` or `recover` runs
  std::set<std::string> eager_ ABSL_GUARDED_BY(mu_);  // keys that fell back
  // Causes already warned about.
  std::set<std::string> causes_ ABSL_GUARDED_BY(mu_);
};

// The plan key of a Newton–Schulz launch: what the kernels cache a plan (and
// its graphs) by, as far as the executor chooses it.
std::string GraphKey(int64_t rows, int64_t cols, int64_t batch,
                     const std::string& method);

// A failure's cause for "warn once per cause": the status code and message
// without "file.cc:123: " source positions, so one CUDA error met by several
// plans (whose messages differ only there) is one cause.
std::string GraphFailureCause(const absl::Status& status);

// Byte ranges of one rank's rows when rows [row_begin, row_end) of a
// rows x cols fp32 matrix are gathered (or scattered) contiguously.
struct RowBytes {
  uint64_t offset = 0;  // into the whole matrix
  uint64_t bytes = 0;
};
RowBytes RowsOf(int64_t row_begin, int64_t row_end, int64_t cols);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_GPU_LOGIC_H_
