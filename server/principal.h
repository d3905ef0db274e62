// Who calls the service, as the gRPC adapter authenticated it (an auth token
// or an mTLS client certificate; docs/security.md). server/ never sees
// tokens or certificates, only this: an opaque name, and whether the caller
// may act on every job (an operator).
//
// Job ownership: a job belongs to the principal that created it (its name
// is stored on the job and in its snapshots). Another principal's
// OpenSession, GetState or SetState on that job is PERMISSION_DENIED, with a
// message that names neither the owner nor anything of the job's table. The
// anonymous principal (empty name: no auth configured) and an operator
// (any_job) may use every job; an unowned job (created anonymously) may be
// used by every principal.

#ifndef DMUON_SERVER_PRINCIPAL_H_
#define DMUON_SERVER_PRINCIPAL_H_

#include <string>

#include "absl/status/status.h"
#include "server/quota.h"

namespace dmuon::server {

struct Principal {
  std::string name;      // empty: anonymous (no auth)
  bool any_job = false;  // an operator: every job is its own
  // Where the call came from (the adapter's peer string, e.g.
  // "ipv4:10.0.0.7:41234"): for messages only, never for a decision.
  std::string peer = "";
  // Its jobs' share of the executors against other backlogged jobs
  // (scheduler.h): the token file's `weight=` (daemon/auth.h), else 1.
  double weight = 1;
  // Its jobs' quotas (quota.h): the token file's or the quotas file's
  // `max_jobs=`, `max_state_bytes=` and `max_device_share=`, else none.
  Quotas quotas = Quotas{};
};

// OK when `who` may use job `job_id` owned by `owner`, else
// PERMISSION_DENIED naming only the job id.
inline absl::Status CheckJobOwner(const Principal& who,
                                  const std::string& owner,
                                  const std::string& job_id) {
  if (who.name.empty() || who.any_job || owner.empty() || owner == who.name)
    return absl::OkStatus();
  return absl::PermissionDeniedError(
      "job '" + job_id +
      "' belongs to another principal; choose another job id (or ask an "
      "operator)");
}

// Whether `who` may see that the job owned by `owner` exists (Status).
inline bool MaySeeJob(const Principal& who, const std::string& owner) {
  return CheckJobOwner(who, owner, "").ok();
}

}  // namespace dmuon::server

#endif  // DMUON_SERVER_PRINCIPAL_H_
