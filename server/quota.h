// Per-principal quotas (issue 28): how many jobs and how many bytes of
// momentum the jobs a principal owns may hold in this daemon, and the share
// of an executor's time they may take under contention. They come
// with the principal (Principal::quotas; the token file's `max_jobs=` and
// `max_state_bytes=`, daemon/auth.h) and are checked when a job is created
// (a new job or a resumed snapshot; joining a job is not creating one).
// Idle jobs and jobs being opened count: what the daemon holds for them.
//
// A job counts against its owner. An operator creating a job owned by
// another principal (a snapshot it resumes) is not held to the owner's
// quotas: dmuond knows a principal's quotas only from its own calls.

#ifndef DMUON_SERVER_QUOTA_H_
#define DMUON_SERVER_QUOTA_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace dmuon::server {

struct Quotas {
  int64_t max_jobs = 0;          // 0: no quota
  uint64_t max_state_bytes = 0;  // fp32 momentum bytes; 0: no quota
  // Its jobs' combined share of an executor's time while another
  // principal's jobs are backlogged there, in [0.01, 1]; 1: no quota. Not
  // checked at admission: the scheduler holds it (share_cap.h).
  double max_device_share = 1;
  bool operator==(const Quotas& o) const {
    return max_jobs == o.max_jobs && max_state_bytes == o.max_state_bytes &&
           max_device_share == o.max_device_share;
  }
};

// What a principal's jobs hold now (created or being created).
struct QuotaUse {
  int64_t jobs = 0;
  uint64_t state_bytes = 0;
};

// OK when principal `name` holding `use` may create a job of `want_bytes`
// of momentum, else RESOURCE_EXHAUSTED naming the quota, e.g. "principal
// 'team-a' is at its quota of 2 jobs (max_jobs)".
absl::Status CheckQuota(const std::string& name, const Quotas& quotas,
                        const QuotaUse& use, uint64_t want_bytes);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_QUOTA_H_
