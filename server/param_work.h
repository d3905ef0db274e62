// Internal: one parameter's step as scheduler Work: gathers the gradient
// from the ranks' regions, and hands the result to the step pipeline to
// deliver (StepPipeline::Deliver).

#ifndef DMUON_SERVER_PARAM_WORK_H_
#define DMUON_SERVER_PARAM_WORK_H_

#include <memory>
#include <string>

#include "server/job.h"
#include "server/scheduler.h"

namespace dmuon::server {

class StepPipeline;

struct ParamWork : public Work {
  ParamWork(StepPipeline& pipeline, std::shared_ptr<Job> job, int param,
            int64_t step);

  int32_t forward_order() const override;
  kernels::Shape shape() const override;
  const MuonParams* muon() const override;
  double flops() const override;
  uint64_t job_serial() const override { return job->serial(); }
  double weight() const override { return job->weight(); }
  std::string principal() const override { return job->owner(); }
  double max_share() const override { return job->max_device_share(); }
  absl::StatusOr<ComputeTask> Prepare() override;
  void Finish(absl::Status status) override;
  void Computed(double seconds) override { compute_seconds = seconds; }
  void Ran(const BatchRun& run) override;  // the step timeline's "ns"

  StepPipeline& pipeline;
  const std::shared_ptr<Job> job;
  const int param;
  const int64_t step;
  bool nonfinite = false;
  double compute_seconds = 0;  // Computed(); 0 when the compute was skipped
  DeviceIo io;  // GPU transports: where the task's gradient and update live
  // The parameter's group hyperparameters with this step's momentum, when a
  // rank sent one (GradientsReady.momentum) that differs from the group's:
  // the task's `muon` then (Prepare).
  MuonParams step_muon;
  // GPU transports: the sessions whose regions `io` points into, held from
  // Prepare until Finish so that no region is unmapped (a rank closing
  // mid-step) while the executor reads or writes it.
  std::vector<std::shared_ptr<Session>> sessions;

 private:
  // Prepare's work, which Prepare times for the step timeline ("gather").
  absl::StatusOr<ComputeTask> Gather();
};

}  // namespace dmuon::server

#endif  // DMUON_SERVER_PARAM_WORK_H_
