// Batching is a property of the declaration, not of thread timing: the
// same-shape matrices a GradientsReady declares go to their executor as one
// batch at every step (up to --max-batch), never split because a worker
// woke up while the declaration was still being queued (Scheduler::SubmitAll).

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/executor.h"
#include "server/scheduler.h"
#include "server/service.h"
#include "server/testing/service_harness.h"

namespace dmuon::server::testing {
namespace {

// A CPU executor that records the size of every batch it is given.
class BatchRecorder : public Executor {
 public:
  // `as_inner`: batching_saves_time() is the inner executor's; else the
  // default (a batching device).
  explicit BatchRecorder(std::unique_ptr<Executor> inner, bool as_inner = false)
      : inner_(std::move(inner)), as_inner_(as_inner) {}
  std::string device() const override { return inner_->device(); }
  bool batching_saves_time() const override {
    return as_inner_ ? inner_->batching_saves_time() : true;
  }
  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    {
      absl::MutexLock lock(&mu_);
      sizes_.push_back(static_cast<int>(batch.size()));
    }
    return inner_->Compute(batch);
  }
  std::vector<int> sizes() const {
    absl::MutexLock lock(&mu_);
    return sizes_;
  }

 private:
  std::unique_ptr<Executor> inner_;
  const bool as_inner_;
  mutable absl::Mutex mu_;
  std::vector<int> sizes_ ABSL_GUARDED_BY(mu_);
};

// Trains `params` same-shape matrices for `steps` steps through a service
// whose one executor is `recorder`'s, each update checked against the fp64
// reference; returns the batch sizes the executor was given.
std::vector<int> BatchesOfSteps(std::unique_ptr<BatchRecorder> rec, int params,
                                int steps) {
  BatchRecorder* recorder = rec.get();
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::move(rec));
  OptimizerService svc(ServiceOptions{},
                       std::make_unique<Scheduler>(std::move(ex), params),
                       nullptr);
  std::vector<Param> ps;
  for (int i = 0; i < params; ++i)
    ps.push_back(
        {"layer" + std::to_string(i) + ".w", 24, 40, v1::SHARDING_REPLICATED});
  Rank r;
  EXPECT_TRUE(
      r.Open(svc, Request("batches", 0, 1, v1::TRANSPORT_SHM, ps)).ok());
  std::mt19937_64 rng(std::random_device{}());
  std::vector<Reference> ref(ps.size());
  for (int step = 1; step <= steps; ++step) {
    const auto grads = RandomGradients(ps, rng);
    EXPECT_TRUE(r.Send(svc, step, grads).ok());
    const auto msgs = r.sink->WaitStep(step);
    if (msgs.empty() || !msgs.back().has_step_complete()) {
      ADD_FAILURE() << "step " << step << " did not complete";
      break;
    }
    // The batched updates are still each matrix's own (fp64 reference).
    for (int i = 0; i < params; ++i) {
      const std::vector<double> g(grads[i].begin(), grads[i].end());
      const auto want = ref[i].Step(g, {ps[i].rows, ps[i].cols});
      EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4)
          << "parameter " << i << " at step " << step;
    }
  }
  return recorder->sizes();
}

TEST(Batching, EveryStepBatchesADeclarationWhole) {
  constexpr int kParams = 8, kSteps = 60;
  const std::vector<int> sizes = BatchesOfSteps(
      std::make_unique<BatchRecorder>(NewCpuExecutor(0, 1)), kParams, kSteps);
  ASSERT_EQ(sizes.size(), static_cast<size_t>(kSteps))
      << "a declaration of " << kParams
      << " same-shape matrices was split into several batches";
  for (size_t k = 0; k < sizes.size(); ++k)
    EXPECT_EQ(sizes[k], kParams) << "batch " << k;
}

// The CPU executor only loops over a batch: it gets one matrix at a time,
// so each update leaves when it is computed, not when its batch ends (the
// next forward's first matrix never waits behind later layers' ones).
TEST(Batching, TheCpuExecutorRunsOneMatrixAtATime) {
  constexpr int kParams = 8, kSteps = 5;
  const std::vector<int> sizes = BatchesOfSteps(
      std::make_unique<BatchRecorder>(NewCpuExecutor(0, 1), true), kParams,
      kSteps);
  EXPECT_EQ(sizes, std::vector<int>(kParams * kSteps, 1));
}

}  // namespace
}  // namespace dmuon::server::testing
