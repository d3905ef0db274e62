#include "daemon/quotas_file.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "daemon/operator_file.h"

namespace dmuon::server {
namespace {

// A number in [lo, hi] (NaN is not).
bool InRange(absl::string_view v, double lo, double hi, double* out) {
  return absl::SimpleAtod(v, out) && *out >= lo && *out <= hi;
}

// One line of the quotas file: `<principal> key=value...`.
absl::Status ParseLine(absl::string_view text, int n,
                       std::map<std::string, PrincipalLimits>* out) {
  std::vector<absl::string_view> f =
      absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  if (absl::StrContains(f[0], '=')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "line ", n, ": expected '<principal> [weight=<w>] [max_jobs=<n>] ",
        "[max_state_bytes=<n>] [max_device_share=<s>]', got '", f[0],
        "' first"));
  }
  PrincipalLimits limits;
  for (size_t i = 1; i < f.size(); ++i) {
    if (auto st = ParseLimitOption(f[i], n, &limits); !st.ok()) return st;
  }
  if (!out->emplace(std::string(f[0]), limits).second) {
    return absl::InvalidArgumentError(absl::StrCat(
        "line ", n, ": principal '", f[0], "' again (one line each)"));
  }
  return absl::OkStatus();
}

}  // namespace

void PrincipalLimits::ApplyTo(Principal* p) const {
  if (weight) p->weight = *weight;
  if (max_jobs) p->quotas.max_jobs = *max_jobs;
  if (max_state_bytes) p->quotas.max_state_bytes = *max_state_bytes;
  if (max_device_share) p->quotas.max_device_share = *max_device_share;
}

absl::Status ParseLimitOption(absl::string_view field, int line,
                              PrincipalLimits* out) {
  const std::pair<absl::string_view, absl::string_view> kv =
      absl::StrSplit(field, absl::MaxSplits('=', 1));
  const absl::string_view key = kv.first, v = kv.second;
  double x = 0;
  if (key == "weight") {
    if (!InRange(v, kMinWeight, kMaxWeight, &x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line, ": weight '", v, "' is not a number in [",
                       kMinWeight, ", ", kMaxWeight, "]"));
    }
    out->weight = x;
    return absl::OkStatus();
  }
  if (key == "max_device_share") {
    if (!InRange(v, kMinDeviceShare, 1, &x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line, ": max_device_share '", v,
                       "' is not a number in [", kMinDeviceShare, ", 1]"));
    }
    out->max_device_share = x;
    return absl::OkStatus();
  }
  if (key == "max_jobs" || key == "max_state_bytes") {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(v, &n) || n == 0 ||
        (key == "max_jobs" && n > (1u << 30))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line, ": ", key, " '", v, "' is not a positive integer"));
    }
    if (key == "max_jobs") {
      out->max_jobs = static_cast<int64_t>(n);
    } else {
      out->max_state_bytes = n;
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("line ", line, ": unknown option '", key,
                   "' (weight, max_jobs, max_state_bytes, max_device_share)"));
}

absl::StatusOr<std::map<std::string, PrincipalLimits>> ParseQuotas(
    const std::string& text) {
  std::map<std::string, PrincipalLimits> out;
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++n;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    if (auto st = ParseLine(line, n, &out); !st.ok()) return st;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<QuotasFile>> QuotasFile::Create(
    std::string path) {
  std::unique_ptr<QuotasFile> q(new QuotasFile(std::move(path)));
  if (auto n = q->Reload(); !n.ok()) return n.status();
  return q;
}

absl::StatusOr<size_t> QuotasFile::Reload() {
  const std::string what = "--quotas-file=" + path_;
  auto text = ReadOperatorFile(path_, kMaxTokenFileBytes, what);
  if (!text.ok()) return text.status();
  auto lines = ParseQuotas(*text);
  if (!lines.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", lines.status().message()));
  }
  absl::MutexLock l(&mu_);
  lines_ = *std::move(lines);
  return lines_.size();
}

void QuotasFile::ApplyTo(Principal* p) const {
  absl::MutexLock l(&mu_);
  auto it = lines_.find(p->name);
  if (it != lines_.end()) it->second.ApplyTo(p);
}

}  // namespace dmuon::server
