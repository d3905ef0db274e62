// A principal's device-time share quota (issue 28, `max_device_share=`):
// the weights the scheduler (scheduler.h) charges its backlogged jobs with,
// so that each principal's jobs together take no more than its cap of an
// executor's time while jobs of other principals are backlogged there.
//
// Rule (water-filling over the backlogged principals of one executor):
// each principal p's jobs claim the share W_p / W of the executor (W_p: its
// backlogged jobs' weights summed, W: every backlogged job's). A principal
// whose claim exceeds its cap c_p is held at c_p, and what it gives up goes
// to the others in proportion to their weights, again capped, until no
// claim exceeds its cap. Work-conserving: the executor never idles while a
// job is ready, so a principal alone (or among principals whose caps are
// all reached: caps summing to under 1) takes the rest, in proportion to
// the caps. A job's weight is then scaled by s_p / (W_p / W), s_p its
// principal's share: unchanged when no cap binds, and the ratio between
// one principal's jobs is always their weights'.

#ifndef DMUON_SERVER_SHARE_CAP_H_
#define DMUON_SERVER_SHARE_CAP_H_

#include <string>
#include <vector>

namespace dmuon::server {

// One backlogged job's claim on an executor.
struct ShareClaim {
  const std::string* principal = nullptr;  // its owner (empty: anonymous)
  double weight = 1;                       // > 0
  double max_share = 1;                    // its principal's cap, (0, 1]
};

// The weight each of `claims` is charged with (same order), by the rule
// above. A principal's cap is the least max_share among its claims.
std::vector<double> CappedWeights(const std::vector<ShareClaim>& claims);

}  // namespace dmuon::server

#endif  // DMUON_SERVER_SHARE_CAP_H_
