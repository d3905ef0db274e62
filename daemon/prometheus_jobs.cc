#include "daemon/prometheus_jobs.h"

#include <utility>

namespace dmuon::server {

prometheus::MetricFamily MetricFamilyOf(const char* name, const char* help,
                                        prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void JobCollectable::Set(std::function<std::vector<JobMetrics>()> source) {
  std::lock_guard<std::mutex> lock(mu_);
  source_ = std::move(source);
}

std::vector<prometheus::MetricFamily> JobCollectable::Collect() const {
  std::vector<JobMetrics> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (source_) jobs = source_();
  }
  using prometheus::MetricType;
  auto seconds = MetricFamilyOf(
      "dmuon_job_device_seconds_total",
      "Seconds the executors spent on the job's batches", MetricType::Counter);
  auto share = MetricFamilyOf(
      "dmuon_job_device_share",
      "The job's share of the executor seconds spent on the jobs in memory",
      MetricType::Gauge);
  auto weight = MetricFamilyOf("dmuon_job_weight",
                               "The job's weight in sharing the executors (its "
                               "principal's weight=)",
                               MetricType::Gauge);
  auto cap =
      MetricFamilyOf("dmuon_job_max_device_share",
                     "Its principal's cap on its jobs' share of an executor "
                     "under contention (max_device_share=; 1: none)",
                     MetricType::Gauge);
  auto wait_mean =
      MetricFamilyOf("dmuon_job_queue_wait_mean_seconds",
                     "Mean wait of the job's matrices from ready to taken "
                     "by an executor",
                     MetricType::Gauge);
  auto wait_max =
      MetricFamilyOf("dmuon_job_queue_wait_max_seconds",
                     "Longest wait of one of the job's matrices from "
                     "ready to taken by an executor",
                     MetricType::Gauge);
  auto exposed = MetricFamilyOf(
      "dmuon_job_exposed_latency_seconds",
      "Per completed step, the step's last gradient hand-off to its last "
      "update delivered: the wait a trainer cannot overlap (quantiles over "
      "the job's last 1024 steps)",
      MetricType::Summary);
  for (const JobMetrics& j : jobs) {
    prometheus::ClientMetric m;
    m.label = {{"job", j.job_id}, {"principal", j.principal}};
    m.counter.value = j.device_seconds;
    seconds.metric.push_back(m);
    prometheus::ClientMetric g;
    g.label = m.label;
    for (auto [family, value] : {std::pair{&share, j.device_share},
                                 {&weight, j.weight},
                                 {&cap, j.max_device_share},
                                 {&wait_mean, j.queue_wait_mean_seconds},
                                 {&wait_max, j.queue_wait_max_seconds}}) {
      g.gauge.value = value;
      family->metric.push_back(g);
    }
    prometheus::ClientMetric s;
    s.label = m.label;
    s.summary.sample_count = j.exposed.count;
    s.summary.sample_sum = j.exposed.sum;
    if (j.exposed.count > 0) {
      s.summary.quantile = {
          {0.5, j.exposed.p50}, {0.9, j.exposed.p90}, {0.99, j.exposed.p99}};
    }
    exposed.metric.push_back(s);
  }
  return {seconds, share, weight, cap, wait_mean, wait_max, exposed};
}

}  // namespace dmuon::server
