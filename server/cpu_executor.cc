// The CPU executor: momentum and the Newton–Schulz batch through
// kernels/kernels.h (OpenBLAS, fp32).

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/executor.h"

namespace dmuon::server {
namespace {

class CpuExecutor : public Executor {
 public:
  CpuExecutor(int index, int threads) : index_(index) {
    kernels::SetCpuThreads(threads);
  }
  std::string device() const override { return absl::StrCat("cpu:", index_); }
  // Compute loops over the batch (kernels::OrthogonalizeBatch on the CPU).
  bool batching_saves_time() const override { return false; }

  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    if (batch.empty()) return absl::OkStatus();
    for (const ComputeTask& t : batch) {
      if (t.device_io != nullptr || t.momentum == nullptr) {
        return absl::InternalError(
            "the CPU executor got a task with device memory or without host "
            "momentum");
      }
    }
    const kernels::Shape shape = batch[0].shape;
    const int64_t n = shape.elements();
    // In place: the momentum step writes U over the gradient, NS writes the
    // update over U. Inputs were validated (shapes at registration, finite
    // values when gathered), so nothing below can fail half-way.
    std::vector<kernels::ConstMatrixF> ins;
    std::vector<kernels::MatrixF> outs;
    std::vector<float> scales;  // the lr scale, applied as NS writes out
    for (const ComputeTask& t : batch) {
      if (t.update != t.grad) std::copy(t.grad, t.grad + n, t.update);
      const float* old = t.momentum_in ? t.momentum_in : t.momentum;
      absl::Status st = kernels::MomentumUpdate(
          absl::MakeConstSpan(t.update, n), absl::MakeConstSpan(old, n),
          absl::MakeSpan(t.momentum, n), absl::MakeSpan(t.update, n),
          t.muon->momentum, t.muon->nesterov);
      if (!st.ok()) return st;
      ins.push_back({shape, absl::MakeConstSpan(t.update, n)});
      outs.push_back({shape, absl::MakeSpan(t.update, n)});
      scales.push_back(static_cast<float>(t.lr_scale));
    }
    return kernels::OrthogonalizeBatch(ins, outs, batch[0].muon->ns, scales);
  }

 private:
  const int index_;
};

}  // namespace

std::unique_ptr<Executor> NewCpuExecutor(int index, int threads) {
  return std::make_unique<CpuExecutor>(index, threads);
}

bool SameBatchKey(const ComputeTask& a, const ComputeTask& b) {
  if (a.shape != b.shape || a.muon == nullptr || b.muon == nullptr)
    return false;
  if (a.muon == b.muon) return true;
  const kernels::NsOptions& x = a.muon->ns;
  const kernels::NsOptions& y = b.muon->ns;
  if (x.method != y.method || x.eps != y.eps ||
      x.gram_restart_after != y.gram_restart_after ||
      x.schedule.norm_safety != y.schedule.norm_safety ||
      x.schedule.steps.size() != y.schedule.steps.size()) {
    return false;
  }
  for (size_t k = 0; k < x.schedule.steps.size(); ++k) {
    const auto &p = x.schedule.steps[k], &q = y.schedule.steps[k];
    if (p.a != q.a || p.b != q.b || p.c != q.c) return false;
  }
  return true;
}

}  // namespace dmuon::server
