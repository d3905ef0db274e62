// Per-job /metrics (issue 28): each job in memory's share of the executors,
// queue wait and exposed latency, labelled by job and principal, read from
// the service at scrape time (ServiceMetrics::SetJobSource). A job dropped
// from memory is absent from the next scrape: the series are bounded by the
// jobs in memory (--max-sessions' jobs plus --max-idle-jobs idle ones).

#ifndef DMUON_DAEMON_PROMETHEUS_JOBS_H_
#define DMUON_DAEMON_PROMETHEUS_JOBS_H_

#include <functional>
#include <mutex>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/service_metrics.h"

namespace dmuon::server {

// A family of the exposition (for Collectables).
prometheus::MetricFamily MetricFamilyOf(const char* name, const char* help,
                                        prometheus::MetricType type);

class JobCollectable : public prometheus::Collectable {
 public:
  void Set(std::function<std::vector<JobMetrics>()> source);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  mutable std::mutex mu_;
  std::function<std::vector<JobMetrics>()> source_;
};

}  // namespace dmuon::server

#endif  // DMUON_DAEMON_PROMETHEUS_JOBS_H_
