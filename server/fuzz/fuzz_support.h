// What the fuzz harnesses share: a service on executors that do no
// Newton–Schulz (the harnesses drive the request handling, not the kernels,
// and must run thousands of inputs a second), and quiet protobuf parsing.

#ifndef DMUON_SERVER_FUZZ_FUZZ_SUPPORT_H_
#define DMUON_SERVER_FUZZ_FUZZ_SUPPORT_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "server/executor.h"
#include "server/scheduler.h"
#include "server/service.h"

namespace dmuon::server::fuzz {

// Momentum accumulates the gradient; the update is lr_scale times it.
class FastExecutor final : public Executor {
 public:
  std::string device() const override { return "fuzz"; }
  absl::Status Compute(absl::Span<const ComputeTask> batch) override {
    for (const ComputeTask& t : batch) {
      const int64_t n = t.shape.elements();
      for (int64_t i = 0; i < n; ++i) {
        const float g = t.grad[i];
        const float* old = t.momentum_in ? t.momentum_in : t.momentum;
        const float m = old ? old[i] + g : g;
        if (t.momentum) t.momentum[i] = m;
        t.update[i] = static_cast<float>(t.lr_scale) * m;
      }
    }
    return absl::OkStatus();
  }
};

// A service with `executors` FastExecutors and no metrics.
inline std::unique_ptr<OptimizerService> NewFastService(ServiceOptions options,
                                                        int executors) {
  std::vector<std::unique_ptr<Executor>> ex;
  for (int i = 0; i < executors; ++i) {
    ex.push_back(std::make_unique<FastExecutor>());
  }
  return std::make_unique<OptimizerService>(
      std::move(options), std::make_unique<Scheduler>(std::move(ex), 4),
      /*metrics=*/nullptr);
}

// Protobuf logs every invalid UTF-8 string it parses: noise in a fuzzer.
inline void SilenceProtobufLogs() {
  static const bool done = [] {
    google::protobuf::SetLogHandler(+[](google::protobuf::LogLevel, const char*,
                                        int, const std::string&) {});
    return true;
  }();
  (void)done;
}

}  // namespace dmuon::server::fuzz

#endif  // DMUON_SERVER_FUZZ_FUZZ_SUPPORT_H_
