// Autotuner: measures the candidate methods for a (device, shape, batch,
// dtype, schedule) once, picks the fastest that passes an accuracy check,
// and caches the choice on disk so later processes skip the measurement.
//
// The measurement itself belongs to a backend (CPU here, CUDA in
// kernels/cuda); the tuner only decides and remembers. Thread-safe.
//
// Cache file: JSON, {"version": 1, "entries": {key: {"method": "gram",
// "seconds": {"direct": s, "gram": s}, "error": {...}}}}, written
// atomically (temporary file, fsync, rename). A missing or unreadable file is
// an empty cache (the reason is kept in load_status()); a corrupt entry is
// ignored and re-measured.

#ifndef DMUON_KERNELS_AUTOTUNE_H_
#define DMUON_KERNELS_AUTOTUNE_H_

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernels.h"

namespace dmuon::kernels {

struct TuneKey {
  std::string device;  // "cpu:<model>x<threads>", "cuda:<name>", ...
  Shape shape;
  int64_t batch = 1;
  std::string dtype = "f32";
  std::string schedule;  // name and step count, e.g. "classic/5"
  std::string ToString() const;
};

struct Measurement {
  double seconds = 0;  // median time of one call for the whole batch
  double error = 0;    // relative Frobenius distance to the reference
};

struct TuneResult {
  Method method = Method::kDirect;
  std::map<std::string, Measurement> candidates;  // by MethodName
  bool from_cache = false;
};

class Autotuner {
 public:
  // `cache_path` empty: in memory only.
  explicit Autotuner(std::string cache_path);

  using MeasureFn = std::function<absl::StatusOr<Measurement>(Method)>;

  // The cached result for `key`, or: measure kDirect and kGram with
  // `measure`, choose the fastest whose error <= `tolerance` (kDirect when
  // none passes), store, and persist. A failed measurement of one candidate
  // excludes it; if every candidate fails, the first error is returned.
  absl::StatusOr<TuneResult> Choose(const TuneKey& key,
                                    const MeasureFn& measure, double tolerance);

  std::optional<TuneResult> Lookup(const TuneKey& key) const;
  absl::Status load_status() const { return load_status_; }

 private:
  absl::Status Load();
  absl::Status SaveLocked() const;

  const std::string path_;
  absl::Status load_status_;
  mutable std::mutex mu_;
  std::map<std::string, TuneResult> entries_;
};

// CPU backend: times OrthogonalizeBatch on `batch` random matrices of
// `shape` (median of `reps` runs after one warm-up) and measures the error
// against the fp64 path of the direct method on the same inputs.
Autotuner::MeasureFn CpuMeasure(Shape shape, int64_t batch,
                                const NsOptions& options, int reps = 3);
// "cpu:<threads>t", the threads OpenBLAS uses now (CpuThreads): a choice
// measured with 2 threads is not reused by a daemon given 1 (--cpu-threads,
// or the cores it may use), whatever the machine's core count.
std::string CpuDeviceName();

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_AUTOTUNE_H_
