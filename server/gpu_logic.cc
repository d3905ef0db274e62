#include "server/gpu_logic.h"

#include <algorithm>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/fallbacks.h"

namespace dmuon::server {

absl::StatusOr<DeviceSpec> ParseDeviceSpec(const std::string& spec) {
  DeviceSpec out;
  if (spec == "cpu") return out;
  if (spec == "auto") {
    out.kind = DeviceSpec::Kind::kAuto;
    return out;
  }
  if (spec == "cuda") {
    out.kind = DeviceSpec::Kind::kCuda;
    return out;
  }
  const auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--devices=", spec, ": ", why,
                     " (expected 'cpu', 'auto', 'cuda' or 'cuda:N[,N...]')"));
  };
  if (spec.rfind("cuda:", 0) != 0) return bad("unknown device kind");
  out.kind = DeviceSpec::Kind::kCuda;
  std::set<int> seen;
  const std::vector<std::string> parts = absl::StrSplit(spec.substr(5), ',');
  for (const std::string& part : parts) {
    int n = -1;
    if (!absl::SimpleAtoi(part, &n) || n < 0) {
      return bad(absl::StrCat("'", part, "' is not a CUDA ordinal"));
    }
    if (!seen.insert(n).second) {
      return bad(absl::StrCat("cuda:", n, " is listed twice"));
    }
    out.ordinals.push_back(n);
  }
  return out;
}

absl::StatusOr<std::vector<int>> ResolveCudaDevices(const DeviceSpec& spec,
                                                    int count,
                                                    const std::string& why) {
  std::vector<int> out;
  if (spec.kind == DeviceSpec::Kind::kCpu) return out;
  if (count <= 0) {
    if (spec.kind == DeviceSpec::Kind::kAuto) return out;
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device",
                     why.empty() ? std::string() : absl::StrCat(" (", why, ")"),
                     "; use --devices=cpu or --devices=auto"));
  }
  if (spec.ordinals.empty()) {
    for (int i = 0; i < count; ++i) out.push_back(i);
    return out;
  }
  for (int n : spec.ordinals) {
    if (n >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", n, " does not exist: this process sees ", count,
                       " GPU", count == 1 ? "" : "s", " (cuda:0",
                       count > 1 ? absl::StrCat("..cuda:", count - 1) : "",
                       "; CUDA_VISIBLE_DEVICES renumbers them)"));
    }
    out.push_back(n);
  }
  return out;
}

Fault ClassifyFault(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return Fault::kNone;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kFailedPrecondition:
      return Fault::kInput;
    case absl::StatusCode::kResourceExhausted:
      return Fault::kOutOfMemory;
    default:
      return Fault::kDevice;
  }
}

void Health::Record(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  switch (ClassifyFault(status)) {
    case Fault::kNone:
      if (!sticky_) healthy_ = true;
      break;
    case Fault::kInput:
      break;
    case Fault::kOutOfMemory:
      healthy_ = false;
      last_error_ = std::string(status.message());
      break;
    case Fault::kDevice:
      healthy_ = false;
      sticky_ = true;
      last_error_ = std::string(status.message());
      break;
  }
}

bool Health::healthy() const {
  absl::MutexLock lock(&mu_);
  return healthy_;
}

bool Health::out_of_service() const {
  absl::MutexLock lock(&mu_);
  return sticky_;
}

std::string Health::last_error() const {
  absl::MutexLock lock(&mu_);
  return last_error_;
}

std::vector<int64_t> SplitBatch(int64_t n, int64_t max_launch) {
  std::vector<int64_t> out;
  int64_t cap = 1;
  while (cap * 2 <= std::max<int64_t>(1, max_launch)) cap *= 2;
  while (n > 0) {
    while (cap > n) cap /= 2;
    out.push_back(cap);
    n -= cap;
  }
  return out;
}

bool GraphFallback::use_graphs(const std::string& key) const {
  if (!enabled_) return false;
  absl::MutexLock lock(&mu_);
  return eager_.count(key) == 0;
}

absl::Status GraphFallback::Run(
    const std::string& what, const std::string& key,
    const std::function<absl::Status(bool use_graphs)>& launch,
    const std::function<absl::Status()>& recover,
    const std::function<void(const std::string&)>& warn) {
  const bool graphs = use_graphs(key);
  absl::Status st = launch(graphs);
  if (st.ok() || !graphs) return st;
  const Fault fault = ClassifyFault(st);
  if (fault == Fault::kInput || fault == Fault::kOutOfMemory) return st;
  if (absl::Status r = recover(); !r.ok()) return r;
  if (strict_) {
    return StrictRefusal(
        kFallbackGraphEager,
        absl::StrCat(what, ": a CUDA graph failed for ", key, " (",
                     st.message(), ") and this batch would run eagerly"),
        "the batch is failed and nothing was computed eagerly (the executor "
        "stays in service); fix the cause the message names");
  }
  if (absl::Status eager = launch(false); !eager.ok()) return eager;
  const std::string cause = GraphFailureCause(st);
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    eager_.insert(key);
    first = causes_.insert(cause).second;
  }
  if (first && warn) {
    warn(absl::StrCat(what, ": a CUDA graph failed for ", key, " (",
                      st.message(),
                      "); it ran eagerly and succeeded, so launches of this "
                      "plan run eagerly from now on (slower; the executor "
                      "stays in service). Later plans that fail for this "
                      "cause fall back without this warning; Status and "
                      "/metrics count them (graph_fallbacks, and "
                      "dmuon_fallbacks_total{kind=\"graph_eager\"})."));
  }
  return absl::OkStatus();
}

uint64_t GraphFallback::fallbacks() const {
  absl::MutexLock lock(&mu_);
  return eager_.size();
}

std::string GraphKey(int64_t rows, int64_t cols, int64_t batch,
                     const std::string& method) {
  return absl::StrCat(batch, " x ", rows, "x", cols, " (", method, ")");
}

namespace {

// "dir/file.cc:123:" and the like: a source position.
bool IsSourcePosition(absl::string_view token) {
  if (!absl::ConsumeSuffix(&token, ":")) return false;
  const size_t colon = token.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == token.size())
    return false;
  for (char c : token.substr(colon + 1))
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  const absl::string_view file = token.substr(0, colon);
  for (const char* ext : {".cc", ".cu", ".h", ".cuh", ".cpp"})
    if (absl::EndsWith(file, ext)) return true;
  return false;
}

}  // namespace

std::string GraphFailureCause(const absl::Status& status) {
  std::vector<absl::string_view> kept;
  for (absl::string_view t :
       absl::StrSplit(status.message(), ' ', absl::SkipEmpty())) {
    if (!IsSourcePosition(t)) kept.push_back(t);
  }
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                      absl::StrJoin(kept, " "));
}

RowBytes RowsOf(int64_t row_begin, int64_t row_end, int64_t cols) {
  RowBytes r;
  r.offset = static_cast<uint64_t>(row_begin) * cols * sizeof(float);
  r.bytes = static_cast<uint64_t>(row_end - row_begin) * cols * sizeof(float);
  return r;
}

}  // namespace dmuon::server
