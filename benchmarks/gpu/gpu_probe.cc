// The GPU check's first step (run.sh): can this process use a GPU through
// the CUDA runtime the bundle's binaries link statically? Prints the
// runtime's and the driver's CUDA versions and every device the runtime
// sees with its compute mode, then makes real calls on device 0: a
// kernels::cuda Context (stream, cuBLASLt handle, workspace), a 1024^3 bf16
// GEMM on random operands checked on the host, and one Newton-Schulz call
// checked against the CPU fp32 path.
//
// Exit 0 and a last line "PROBE OK: ..." (with device 0's compute mode:
// "exclusive-process" or "prohibited" would refuse dmuond_cuda's context
// beside the trainer's) when all of that worked; else exit
// 1 and a last line "PROBE FAIL: <why>" (no driver, a driver too old for
// this runtime, no device, a failed call or a wrong result). The probe does
// not decide whether a GPU should be here: run.sh does, from nvidia-smi.
//   usage: gpu_probe [--device=N]

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/gpu/gpu_tool.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/kernels.h"

namespace dmuon::bench {
namespace {

namespace cu = kernels::cuda;

std::string Version(int v) {
  return v <= 0 ? "none" : absl::StrCat(v / 1000, ".", (v % 1000) / 10);
}

// cudaDevAttrComputeMode in words (cudaDeviceProp::computeMode is gone in
// CUDA 13; the attribute remains).
std::string ComputeMode(int device) {
  int mode = -1;
  if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device) !=
      cudaSuccess)
    return "unknown";
  switch (mode) {
    case cudaComputeModeDefault:
      return "default";
    case cudaComputeModeExclusiveProcess:
      return "exclusive-process";
    case cudaComputeModeProhibited:
      return "prohibited";
    default:
      return absl::StrCat("mode ", mode);
  }
}

int Fail(const std::string& why) {
  std::printf("PROBE FAIL: %s\n", why.c_str());
  return 1;
}

// C = A B^T in bf16 (1024^3) vs the host product of the same bf16 values
// (as Download returns them) at 64 sampled entries.
absl::Status CheckGemm(cu::Context& ctx) {
  const int64_t n = 1024;
  std::vector<float> a(n * n), b(n * n);
  FillRandom(1, absl::MakeSpan(a));
  FillRandom(2, absl::MakeSpan(b));
  DeviceBuffers buf{&ctx, {}};
  auto da = buf.Get(n * n * 2), db = buf.Get(n * n * 2),
       dc = buf.Get(n * n * 2);
  for (auto* p : {&da, &db, &dc})
    if (!p->ok()) return p->status();
  if (auto st = ctx.Upload(a.data(), n * n, *da, cu::DType::kBF16); !st.ok())
    return st;
  if (auto st = ctx.Upload(b.data(), n * n, *db, cu::DType::kBF16); !st.ok())
    return st;
  if (auto st = ctx.Gemm(*da, *db, *dc, cu::DType::kBF16, n, n, n, 1); !st.ok())
    return st;
  if (auto st = ctx.Synchronize(); !st.ok()) return st;
  std::vector<float> ra(n * n), rb(n * n), c(n * n);
  for (auto [src, dst] : {std::pair<void*, float*>{*da, ra.data()},
                          std::pair<void*, float*>{*db, rb.data()},
                          std::pair<void*, float*>{*dc, c.data()}}) {
    if (auto st = ctx.Download(src, cu::DType::kBF16, n * n, dst); !st.ok())
      return st;
  }
  double worst = 0;
  for (int s = 0; s < 64; ++s) {
    const int64_t i = (s * 389) % n, j = (s * 617 + 5) % n;
    double want = 0, scale = 0;
    for (int64_t k = 0; k < n; ++k) {
      want += double(ra[i * n + k]) * rb[j * n + k];
      scale += std::fabs(double(ra[i * n + k]) * rb[j * n + k]);
    }
    // bf16 output: 2^-8 relative, of the sum of magnitudes at worst.
    worst = std::max(worst, std::fabs(c[i * n + j] - want) / scale);
  }
  if (!(worst < 1e-2)) {
    return absl::InternalError(absl::StrFormat(
        "bf16 GEMM 1024^3: sampled entries off by %.2e of their magnitude",
        worst));
  }
  return absl::OkStatus();
}

// Direct NS (bf16) of a 256x512 random matrix vs the CPU fp32 path.
absl::Status CheckNs(cu::Context& ctx) {
  const kernels::Shape shape{256, 512};
  const int64_t e = shape.elements();
  std::vector<float> in(e), want(e), got(e);
  FillRandom(3, absl::MakeSpan(in));
  if (auto st = kernels::Orthogonalize({shape, absl::MakeConstSpan(in)},
                                       {shape, absl::MakeSpan(want)});
      !st.ok())
    return st;
  DeviceBuffers buf{&ctx, {}};
  auto di = buf.Get(e * 4), dout = buf.Get(e * 4);
  for (auto* p : {&di, &dout})
    if (!p->ok()) return p->status();
  if (auto st = ctx.Upload(in.data(), e, *di, cu::DType::kF32); !st.ok())
    return st;
  cu::CudaNsOptions o;
  if (auto st = ctx.Orthogonalize(
          {*di, cu::DType::kF32, shape, 1, size_t(e * 4)},
          {*dout, cu::DType::kF32, shape, 1, size_t(e * 4)}, o);
      !st.ok())
    return st;
  if (auto st = ctx.Synchronize(); !st.ok()) return st;
  if (auto st = ctx.Download(*dout, cu::DType::kF32, e, got.data()); !st.ok())
    return st;
  const double err = RelativeError(got, want);
  if (!(err < 3e-2)) {
    return absl::InternalError(absl::StrFormat(
        "Newton-Schulz 256x512 (bf16) vs the CPU fp32 path: relative error "
        "%.2e (bound 3e-2)",
        err));
  }
  std::printf("Newton-Schulz 256x512 bf16 vs CPU fp32: rel err %.2e\n", err);
  return absl::OkStatus();
}

int Run(int device) {
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  std::printf(
      "CUDA runtime %s (static, in every binary); the driver supports "
      "CUDA %s\n",
      Version(runtime).c_str(), Version(driver).c_str());
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    std::string why = absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(e),
                                   " (", cudaGetErrorString(e), ")");
    if (driver == 0) {
      absl::StrAppend(&why, "; no CUDA driver (libcuda.so.1) is loaded here");
    } else if (driver < runtime) {
      absl::StrAppend(&why, "; the driver supports CUDA ", Version(driver),
                      ", older than this runtime's ", Version(runtime),
                      ": a newer driver is needed");
    }
    return Fail(why);
  }
  if (count == 0) return Fail("the CUDA runtime sees no device");
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p;
    std::memset(&p, 0, sizeof(p));
    if (const cudaError_t e = cudaGetDeviceProperties(&p, d);
        e != cudaSuccess) {
      return Fail(absl::StrCat("cudaGetDeviceProperties(", d,
                               "): ", cudaGetErrorString(e)));
    }
    std::printf("device %d: %s, sm_%d%d, %d SMs, %.1f GiB, compute mode %s\n",
                d, p.name, p.major, p.minor, p.multiProcessorCount,
                p.totalGlobalMem / double(1 << 30), ComputeMode(d).c_str());
  }
  if (device < 0 || device >= count)
    return Fail(absl::StrCat("--device=", device, ": ", count, " devices"));
  auto ctx = cu::Context::Create(device);
  if (!ctx.ok())
    return Fail(absl::StrCat("Context: ", ctx.status().ToString()));
  size_t free_b = 0, total_b = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
      e != cudaSuccess) {
    return Fail(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(e)));
  }
  std::printf("device %d memory: %.1f GiB free of %.1f GiB\n", device,
              free_b / double(1 << 30), total_b / double(1 << 30));
  if (auto st = CheckGemm(**ctx); !st.ok())
    return Fail(absl::StrCat("GEMM: ", st.ToString()));
  if (auto st = CheckNs(**ctx); !st.ok())
    return Fail(absl::StrCat("NS: ", st.ToString()));
  std::printf(
      "PROBE OK: %s, compute mode %s, CUDA runtime %s, driver's CUDA %s\n",
      (*ctx)->DeviceDescription().c_str(), ComputeMode(device).c_str(),
      Version(runtime).c_str(), Version(driver).c_str());
  return 0;
}

}  // namespace
}  // namespace dmuon::bench

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int device = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--device=", 9) == 0) {
      device = std::atoi(argv[i] + 9);
    } else {
      std::fprintf(stderr, "usage: gpu_probe [--device=N]\n");
      return 2;
    }
  }
  return dmuon::bench::Run(device);
}
