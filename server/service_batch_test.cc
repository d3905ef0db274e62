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
  explicit BatchRecorder(std::unique_ptr<Executor> inner)
      : inner_(std::move(inner)) {}
  std::string device() const override { return inner_->device(); }
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
  mutable absl::Mutex mu_;
  std::vector<int> sizes_ ABSL_GUARDED_BY(mu_);
};

TEST(Batching, EveryStepBatchesADeclarationWhole) {
  constexpr int kParams = 8, kSteps = 60;
  auto rec = std::make_unique<BatchRecorder>(NewCpuExecutor(0, 1));
  BatchRecorder* recorder = rec.get();
  std::vector<std::unique_ptr<Executor>> ex;
  ex.push_back(std::move(rec));
  OptimizerService svc(ServiceOptions{},
                       std::make_unique<Scheduler>(std::move(ex), kParams),
                       nullptr);
  std::vector<Param> params;
  for (int i = 0; i < kParams; ++i)
    params.push_back(
        {"layer" + std::to_string(i) + ".w", 24, 40, v1::SHARDING_REPLICATED});
  Rank r;
  ASSERT_TRUE(
      r.Open(svc, Request("batches", 0, 1, v1::TRANSPORT_SHM, params)).ok());
  std::mt19937_64 rng(std::random_device{}());
  std::vector<Reference> ref(params.size());
  for (int step = 1; step <= kSteps; ++step) {
    const auto grads = RandomGradients(params, rng);
    ASSERT_TRUE(r.Send(svc, step, grads).ok());
    const auto msgs = r.sink->WaitStep(step);
    ASSERT_FALSE(msgs.empty());
    ASSERT_TRUE(msgs.back().has_step_complete()) << "step " << step;
    // The batched updates are still each matrix's own (fp64 reference).
    for (int i = 0; i < kParams; ++i) {
      const std::vector<double> g(grads[i].begin(), grads[i].end());
      const auto want = ref[i].Step(g, {params[i].rows, params[i].cols});
      EXPECT_LT(RelErr(r.Update(i, msgs), want), 1e-4)
          << "parameter " << i << " at step " << step;
    }
  }
  const std::vector<int> sizes = recorder->sizes();
  ASSERT_EQ(sizes.size(), static_cast<size_t>(kSteps))
      << "a declaration of " << kParams
      << " same-shape matrices was split into several batches";
  for (size_t k = 0; k < sizes.size(); ++k)
    EXPECT_EQ(sizes[k], kParams) << "batch " << k;
}

}  // namespace
}  // namespace dmuon::server::testing
