#include "kernels/autotune.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dmuon::kernels {
namespace {

using json = nlohmann::json;

constexpr int kCacheVersion = 1;

json ToJson(const TuneResult& r) {
  json j;
  j["method"] = std::string(MethodName(r.method));
  for (const auto& [name, m] : r.candidates) {
    j["seconds"][name] = m.seconds;
    j["error"][name] = m.error;
  }
  return j;
}

std::optional<TuneResult> FromJson(const json& j) {
  if (!j.is_object() || !j.contains("method") || !j["method"].is_string()) {
    return std::nullopt;
  }
  auto method = ParseMethod(j["method"].get<std::string>());
  if (!method.ok() || *method == Method::kAuto) return std::nullopt;
  TuneResult r;
  r.method = *method;
  if (j.contains("seconds") && j["seconds"].is_object()) {
    for (auto& [name, s] : j["seconds"].items()) {
      if (!s.is_number()) return std::nullopt;
      r.candidates[name].seconds = s.get<double>();
      if (j.contains("error") && j["error"].contains(name) &&
          j["error"][name].is_number()) {
        r.candidates[name].error = j["error"][name].get<double>();
      }
    }
  }
  r.from_cache = true;
  return r;
}

}  // namespace

std::string TuneKey::ToString() const {
  return absl::StrCat(device, "|", shape.rows, "x", shape.cols, "|b", batch,
                      "|", dtype, "|", schedule);
}

Autotuner::Autotuner(std::string cache_path) : path_(std::move(cache_path)) {
  if (!path_.empty()) load_status_ = Load();
}

absl::Status Autotuner::Load() {
  std::ifstream in(path_);
  if (!in)
    return absl::NotFoundError(absl::StrCat("no autotune cache at ", path_));
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(
        absl::StrCat("autotune cache ", path_, " is not valid JSON; ignored"));
  }
  if (j.value("version", 0) != kCacheVersion || !j.contains("entries") ||
      !j["entries"].is_object()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "autotune cache ", path_, " has another version; ignored"));
  }
  for (auto& [key, value] : j["entries"].items()) {
    if (auto r = FromJson(value)) entries_[key] = *r;
  }
  return absl::OkStatus();
}

absl::Status Autotuner::SaveLocked() const {
  if (path_.empty()) return absl::OkStatus();
  json j;
  j["version"] = kCacheVersion;
  j["entries"] = json::object();
  for (const auto& [key, r] : entries_) j["entries"][key] = ToJson(r);
  const std::string data = j.dump(1);
  const std::string tmp = absl::StrCat(path_, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write autotune cache ", tmp));
  }
  const bool ok = ::write(fd, data.data(), data.size()) ==
                      static_cast<ssize_t>(data.size()) &&
                  ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot write autotune cache ", path_));
  }
  return absl::OkStatus();
}

std::optional<TuneResult> Autotuner::Lookup(const TuneKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key.ToString());
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<TuneResult> Autotuner::Choose(const TuneKey& key,
                                             const MeasureFn& measure,
                                             double tolerance) {
  if (auto hit = Lookup(key)) return *hit;
  TuneResult r;
  absl::Status first_error;
  double best = INFINITY;
  bool any = false;
  for (Method m : {Method::kDirect, Method::kGram}) {
    absl::StatusOr<Measurement> got = measure(m);
    if (!got.ok()) {
      if (first_error.ok()) first_error = got.status();
      continue;
    }
    any = true;
    r.candidates[std::string(MethodName(m))] = *got;
    if (got->error <= tolerance && got->seconds < best) {
      best = got->seconds;
      r.method = m;
    }
  }
  if (!any) return first_error;
  std::lock_guard<std::mutex> lock(mu_);
  entries_[key.ToString()] = r;
  // A cache that cannot be written costs a re-measurement next time, not a
  // wrong answer: the choice is returned regardless.
  (void)SaveLocked();
  return r;
}

std::string CpuDeviceName() { return absl::StrCat("cpu:", CpuThreads(), "t"); }

Autotuner::MeasureFn CpuMeasure(Shape shape, int64_t batch,
                                const NsOptions& options, int reps) {
  return [=](Method method) -> absl::StatusOr<Measurement> {
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> d;
    const int64_t e = shape.elements();
    std::vector<float> in(e * batch), out(e * batch);
    for (float& x : in) x = d(rng);
    std::vector<ConstMatrixF> ins;
    std::vector<MatrixF> outs;
    for (int64_t i = 0; i < batch; ++i) {
      ins.push_back({shape, absl::MakeConstSpan(in.data() + i * e, e)});
      outs.push_back({shape, absl::MakeSpan(out.data() + i * e, e)});
    }
    NsOptions o = options;
    o.method = method;
    std::vector<double> times;
    for (int r = 0; r <= std::max(reps, 1); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status st = OrthogonalizeBatch(ins, outs, o); !st.ok())
        return st;
      const std::chrono::duration<double> dt =
          std::chrono::steady_clock::now() - t0;
      if (r > 0) times.push_back(dt.count());  // run 0 warms up
    }
    std::sort(times.begin(), times.end());
    // Accuracy against the fp64 direct method on the first matrix.
    std::vector<double> in64(in.begin(), in.begin() + e), ref(e);
    NsOptions ro = options;
    ro.method = Method::kDirect;
    if (absl::Status st = Orthogonalize(
            ConstMatrixD{shape, in64}, MatrixD{shape, absl::MakeSpan(ref)}, ro);
        !st.ok()) {
      return st;
    }
    double num = 0, den = 0;
    for (int64_t i = 0; i < e; ++i) {
      num += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    Measurement m;
    m.seconds = times[times.size() / 2];
    m.error =
        std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
    return m;
  };
}

}  // namespace dmuon::kernels
