// The CPU pool the scaling validation runs: dmuond processes, a GPT-2-like
// table, each shape's device time measured in-process, and trainer ranks
// (threads) that hand gradients over as an emulated backward produces them
// and wait per layer in an emulated forward.

#ifndef DMUON_BENCHMARKS_SCALING_CPU_POOL_H_
#define DMUON_BENCHMARKS_SCALING_CPU_POOL_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"

namespace dmuon::scaling {

using Clock = std::chrono::steady_clock;
using ShapeKey = std::pair<int64_t, int64_t>;  // rows, cols

double Since(Clock::time_point t0);

// GPT-2-small's layers (c_attn, c_proj, c_fc, c_proj), dimensions divided by
// `scale`, unreduced gradients (the owner reduces them), forward order 4l+j.
std::vector<ParamSpec> ValidationTable(int scale, int layers);

// Sorted samples of what the daemon's worker does for one matrix of `world`
// unreduced ranks, on this thread's BLAS settings, each with the heap laid
// out differently (see cpu_pool.cc).
absl::StatusOr<std::vector<double>> DeviceSeconds(ShapeKey shape, int world,
                                                  int reps);

// DeviceSeconds on `threads` threads at once: each thread's samples.
absl::StatusOr<std::vector<std::vector<double>>> DeviceSecondsAtOnce(
    ShapeKey shape, int world, int reps, int threads);

// `world` ranks (threads, each its own Client::ConnectPool over `addresses`)
// run a warm-up and `steps` steps of job `job`: backward hands layer l's
// gradients over (L - l) * bwd_layer after the step's start, forward waits
// for layer l's updates, then sleeps fwd_layer. Returns each timed step's
// end (seconds after its start), the latest rank's.
absl::StatusOr<std::vector<double>> RunSteps(
    const std::vector<std::string>& addresses, const std::string& job,
    const std::vector<ParamSpec>& table, int world, int steps, double bwd_layer,
    double fwd_layer);

// Median round trip of a tiny matrix through the daemon at `address`.
absl::StatusOr<double> RoundTrip(const std::string& address);

}  // namespace dmuon::scaling

#endif  // DMUON_BENCHMARKS_SCALING_CPU_POOL_H_
