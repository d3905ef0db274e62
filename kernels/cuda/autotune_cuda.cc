#include "kernels/cuda/autotune_cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dmuon::kernels::cuda {

std::string CudaDeviceName(const Context& ctx) {
  return absl::StrCat("cuda:", ctx.DeviceDescription());
}

Autotuner::MeasureFn CudaMeasure(Context* ctx, Shape shape, int64_t batch,
                                 const CudaNsOptions& options, int reps) {
  return [=](Method method) -> absl::StatusOr<Measurement> {
    const int64_t e = shape.elements();
    std::vector<float> host(e * batch);
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> d;
    for (float& x : host) x = d(rng);
    const size_t bytes = e * batch * DTypeBytes(options.compute);
    auto in = ctx->Allocate(bytes);
    if (!in.ok()) return in.status();
    auto out = ctx->Allocate(bytes);
    if (!out.ok()) {
      (void)ctx->Free(*in);
      return out.status();
    }
    auto release = [&] {
      (void)ctx->Free(*in);
      (void)ctx->Free(*out);
    };
    CudaNsOptions o = options;
    o.ns.method = method;
    const DeviceBatch bin{*in, o.compute, shape, batch, bytes};
    const DeviceBatch bout{*out, o.compute, shape, batch, bytes};
    absl::Status st = ctx->Upload(host.data(), e * batch, *in, o.compute);
    std::vector<double> times;
    for (int r = 0; st.ok() && r <= std::max(reps, 1); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      st = ctx->Orthogonalize(bin, bout, o);
      if (st.ok()) st = ctx->Synchronize();
      if (r > 0) {
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count());
      }
    }
    std::vector<float> got(e);
    if (st.ok()) st = ctx->Download(*out, o.compute, e, got.data());
    release();
    if (!st.ok()) return st;
    // Error of the first matrix against the CPU fp32 direct method.
    std::vector<float> ref(e);
    NsOptions ro = options.ns;
    ro.method = Method::kDirect;
    st = Orthogonalize(ConstMatrixF{shape, absl::MakeConstSpan(host.data(), e)},
                       MatrixF{shape, absl::MakeSpan(ref)}, ro);
    if (!st.ok()) return st;
    double num = 0, den = 0;
    for (int64_t i = 0; i < e; ++i) {
      num += double(got[i] - ref[i]) * (got[i] - ref[i]);
      den += double(ref[i]) * ref[i];
    }
    std::sort(times.begin(), times.end());
    Measurement m;
    m.seconds = times[times.size() / 2];
    m.error =
        std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
    return m;
  };
}

}  // namespace dmuon::kernels::cuda
