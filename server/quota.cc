#include "server/quota.h"

#include "absl/strings/str_cat.h"

namespace dmuon::server {

absl::Status CheckQuota(const std::string& name, const Quotas& quotas,
                        const QuotaUse& use, uint64_t want_bytes) {
  if (quotas.max_jobs > 0 && use.jobs >= quotas.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "principal '", name, "' is at its quota of ", quotas.max_jobs,
        " jobs (max_jobs); close or drop one of its jobs first (idle jobs "
        "count until --job-retention-seconds drops them)"));
  }
  if (quotas.max_state_bytes > 0 &&
      use.state_bytes + want_bytes > quotas.max_state_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "principal '", name, "' would hold ", use.state_bytes + want_bytes,
        " bytes of momentum with this job of ", want_bytes,
        ", over its quota of ", quotas.max_state_bytes,
        " bytes (max_state_bytes); its jobs hold ", use.state_bytes));
  }
  return absl::OkStatus();
}

}  // namespace dmuon::server
