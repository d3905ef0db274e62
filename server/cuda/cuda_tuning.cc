// The autotuner's CUDA backend (cuda_tuning.h).

#include "server/cuda/cuda_tuning.h"

#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/autotune_cuda.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dmuon::server {
namespace {

namespace cu = kernels::cuda;

// A Context on the first of `ordinals` that opens and is named `name`.
absl::StatusOr<std::unique_ptr<cu::Context>> OpenNamed(
    const std::vector<int>& ordinals, const std::string& name) {
  std::string tried;
  for (int d : ordinals) {
    auto ctx = cu::Context::Create(d);
    if (ctx.ok() && cu::CudaDeviceName(**ctx) == name) return ctx;
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", "cuda:", d, ": ",
                    ctx.ok() ? cu::CudaDeviceName(**ctx)
                             : std::string(ctx.status().message()));
  }
  return absl::UnavailableError(
      absl::StrCat("no GPU to measure on for the autotuner: ", name,
                   " wanted (", tried, ")"));
}

}  // namespace

absl::StatusOr<Tuning> NewCudaTuning(const std::vector<std::string>& devices,
                                     const CudaExecutorOptions& options) {
  std::vector<int> ordinals;
  for (const std::string& d : devices) {
    int n = -1;
    if (!absl::StartsWith(d, "cuda:") || !absl::SimpleAtoi(d.substr(5), &n) ||
        n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("executor device '", d, "' is not cuda:<ordinal>"));
    }
    ordinals.push_back(n);
  }
  std::string name, tried;
  for (int d : ordinals) {
    auto ctx = cu::Context::Create(d);
    if (ctx.ok()) {
      name = cu::CudaDeviceName(**ctx);
      break;
    }
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", "cuda:", d, ": ",
                    ctx.status().message());
  }
  if (name.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no GPU to measure on for the autotuner",
        ordinals.empty() ? " (no CUDA executors)" : absl::StrCat(": ", tried)));
  }
  Tuning t;
  t.device = name;
  t.dtype = "bf16/f16";  // direct in bf16, Gram in fp16 (ExecutorNsOptions)
  t.tolerance = kCudaTuneTolerance;
  t.measure = [ordinals, name, options](kernels::Shape shape, int64_t batch,
                                        const kernels::NsOptions& ns) {
    // Shared by the copies of the function, freed with the last one.
    auto ctx = std::make_shared<std::unique_ptr<cu::Context>>();
    return kernels::Autotuner::MeasureFn(
        [ordinals, name, options, shape, batch, ns,
         ctx](kernels::Method method) -> absl::StatusOr<kernels::Measurement> {
          if (*ctx == nullptr) {
            auto c = OpenNamed(ordinals, name);
            if (!c.ok()) return c.status();
            *ctx = *std::move(c);
          }
          kernels::NsOptions o = ns;
          o.method = method;
          return cu::CudaMeasure(ctx->get(), shape, batch,
                                 ExecutorNsOptions(o, options))(method);
        });
  };
  return t;
}

}  // namespace dmuon::server
