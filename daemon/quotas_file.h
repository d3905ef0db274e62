// A principal's weight and quotas (issue 28): the `key=value` options of a
// token file line (auth.h) and the lines of --quotas-file, parsed alike,
// and the quotas file itself.
//
// --quotas-file: one `<principal> [weight=W] [max_jobs=N]
// [max_state_bytes=B] [max_device_share=S]` per line; blank lines and lines
// starting with '#' are skipped; a principal at most once. `<principal>` is
// a name as the authenticator gives it: a token file's name (or its
// "token-..." default) or an mTLS identity ("uri:...", "dns:...",
// "cn:..."). What a line gives overrides the token file's value of that
// option for that principal; what it leaves out stays the token file's
// (or the default). Re-read on SIGHUP: a file that fails to parse keeps the
// one in force (dmuond logs why, naming the line).

#ifndef DMUON_DAEMON_QUOTAS_FILE_H_
#define DMUON_DAEMON_QUOTAS_FILE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/principal.h"

namespace dmuon::server {

inline constexpr double kMinWeight = 0.01;
inline constexpr double kMaxWeight = 1000;
inline constexpr double kMinDeviceShare = 0.01;

// The options one line sets (unset: left as they are).
struct PrincipalLimits {
  std::optional<double> weight;  // [kMinWeight, kMaxWeight]
  std::optional<int64_t> max_jobs;
  std::optional<uint64_t> max_state_bytes;
  std::optional<double> max_device_share;  // [kMinDeviceShare, 1]
  // Sets what this gives on `p` (weight, quotas).
  void ApplyTo(Principal* p) const;
  bool operator==(const PrincipalLimits& o) const {
    return weight == o.weight && max_jobs == o.max_jobs &&
           max_state_bytes == o.max_state_bytes &&
           max_device_share == o.max_device_share;
  }
};

// One `key=value` option of line `line` into `out`: weight=<w>,
// max_jobs=<n>, max_state_bytes=<n> (n >= 1), max_device_share=<s>.
// INVALID_ARGUMENT "line <n>: ..." naming the option.
absl::Status ParseLimitOption(absl::string_view field, int line,
                              PrincipalLimits* out);

// The quotas file's text, by principal. Errors name the line.
absl::StatusOr<std::map<std::string, PrincipalLimits>> ParseQuotas(
    const std::string& text);

// --quotas-file, read at start and on SIGHUP. Thread-safe.
class QuotasFile {
 public:
  // Reads `path`; an unreadable or malformed file is INVALID_ARGUMENT
  // "--quotas-file=<path>: line <n>: ...".
  static absl::StatusOr<std::unique_ptr<QuotasFile>> Create(std::string path);

  // Re-reads the file; on an error the lines stay as they were. Returns
  // the number of principals now.
  absl::StatusOr<size_t> Reload() ABSL_LOCKS_EXCLUDED(mu_);
  // Overrides `p`'s weight and quotas with its line's, if it has one.
  void ApplyTo(Principal* p) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit QuotasFile(std::string path) : path_(std::move(path)) {}
  const std::string path_;
  mutable absl::Mutex mu_;
  std::map<std::string, PrincipalLimits> lines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_QUOTAS_FILE_H_
