// The launchers of ns_kernels.h (momentum, cast) and elementwise_kernels.h
// called directly, each against a CPU reference. Every one of these kernels
// rounds each operation separately (no FMA contraction), so the tolerance is
// zero: the device must match the reference bit for bit. Every test skips,
// saying why, when no CUDA device exists.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "kernels/cuda/elementwise_kernels.h"
#include "kernels/cuda/ns_kernels.h"
#include "kernels/cuda/testing/accuracy.h"
#include "kernels/cuda/testing/gpu.h"
#include "kernels/cuda/testing/host_interpreter.h"
#include "kernels/testing/momentum_reference.h"

namespace dmuon::kernels::cuda::device {
namespace {

using accuracy::Random;

// v rounded to bf16 (nearest, ties to even), as a float.
float RoundBf16(float v) {
  return static_cast<float>(plan::RoundTo(v, plan::Format::kBF16));
}

// The bf16 bits of a float that bf16 represents exactly, and back.
uint16_t Bf16Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

class DeviceKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { DMUON_SKIP_WITHOUT_GPU(); }
  void TearDown() override {
    for (void* p : owned_) EXPECT_EQ(cudaFree(p), cudaSuccess);
  }

  void* Alloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    owned_.push_back(p);
    return p;
  }
  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    T* d = static_cast<T*>(Alloc(host.size() * sizeof(T)));
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    return d;
  }
  // Waits for the launches, then copies n elements back.
  template <typename T>
  std::vector<T> FromDevice(const T* d, size_t n) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

  std::vector<void*> owned_;
};

// The device momentum step with fp32 or bf16 momentum and fp32 or bf16
// update, against kernels/testing's reference rounding the momentum as it is
// stored (fp32: the reference is MomentumUpdate's arithmetic exactly).
TEST_F(DeviceKernelsTest, MomentumMatchesReference) {
  const int64_t n = 10007;  // not a multiple of the block
  const std::vector<float> grad = Random(n, 21);
  std::vector<float> mom0 = Random(n, 22);
  for (Elem mt : {Elem::kF32, Elem::kBF16}) {
    const bool bf16_mom = mt == Elem::kBF16;
    std::vector<float> start = mom0;
    if (bf16_mom)
      for (float& x : start) x = RoundBf16(x);
    for (Elem ut : {Elem::kF32, Elem::kBF16}) {
      for (bool nesterov : {true, false}) {
        for (double mu : {0.95, 0.5, 0.0}) {
          SCOPED_TRACE(::testing::Message()
                       << "momentum " << (bf16_mom ? "bf16" : "fp32")
                       << " update " << (ut == Elem::kBF16 ? "bf16" : "fp32")
                       << " nesterov " << nesterov << " mu " << mu);
          std::vector<float> want_mom = start, want_upd(n);
          kernels::testing::MomentumReference(
              grad, absl::MakeSpan(want_mom), absl::MakeSpan(want_upd), mu,
              nesterov, [&](float v) { return bf16_mom ? RoundBf16(v) : v; });
          if (ut == Elem::kBF16)
            for (float& x : want_upd) x = RoundBf16(x);

          float* d_grad = ToDevice(grad);
          void* d_mom;
          if (bf16_mom) {
            std::vector<uint16_t> bits(n);
            for (int64_t i = 0; i < n; ++i) bits[i] = Bf16Bits(start[i]);
            d_mom = ToDevice(bits);
          } else {
            d_mom = ToDevice(start);
          }
          // An fp32 update overwrites the gradient, as the executor does.
          void* d_upd = ut == Elem::kF32 ? static_cast<void*>(d_grad)
                                         : Alloc(n * sizeof(uint16_t));
          ASSERT_EQ(LaunchMomentum(d_grad, d_mom, mt, d_upd, ut, n,
                                   static_cast<float>(1.0 - mu),
                                   static_cast<float>(mu), nesterov, nullptr),
                    cudaSuccess);

          std::vector<float> got_mom(n), got_upd(n);
          if (bf16_mom) {
            const auto bits = FromDevice(static_cast<uint16_t*>(d_mom), n);
            for (int64_t i = 0; i < n; ++i) got_mom[i] = FromBf16Bits(bits[i]);
          } else {
            got_mom = FromDevice(static_cast<float*>(d_mom), n);
          }
          if (ut == Elem::kBF16) {
            const auto bits = FromDevice(static_cast<uint16_t*>(d_upd), n);
            for (int64_t i = 0; i < n; ++i) got_upd[i] = FromBf16Bits(bits[i]);
          } else {
            got_upd = FromDevice(static_cast<float*>(d_upd), n);
          }
          EXPECT_EQ(got_mom, want_mom);
          EXPECT_EQ(got_upd, want_upd);
        }
      }
    }
  }
}

// fp32 -> bf16 rounds to nearest, ties to even (the momentum state's way in)
// and bf16 -> fp32 is exact (its way out).
TEST_F(DeviceKernelsTest, CastToAndFromBf16) {
  std::vector<float> in = Random(5000, 23);
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1e-40f,
                  -1e-40f, 3e38f, inf, -inf})
    in.push_back(x);
  const int64_t n = static_cast<int64_t>(in.size());
  const float* d_in = ToDevice(in);
  uint16_t* d_bf16 = static_cast<uint16_t*>(Alloc(n * sizeof(uint16_t)));
  float* d_back = static_cast<float*>(Alloc(n * sizeof(float)));
  ASSERT_EQ(LaunchCast(d_in, Elem::kF32, d_bf16, Elem::kBF16, n, nullptr),
            cudaSuccess);
  ASSERT_EQ(LaunchCast(d_bf16, Elem::kBF16, d_back, Elem::kF32, n, nullptr),
            cudaSuccess);
  const std::vector<uint16_t> bits = FromDevice(d_bf16, n);
  const std::vector<float> back = FromDevice(d_back, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(FromBf16Bits(bits[i]), RoundBf16(in[i])) << "in " << in[i];
    ASSERT_EQ(back[i], FromBf16Bits(bits[i])) << "in " << in[i];
  }
}

TEST_F(DeviceKernelsTest, ScaleAndAccumulateAreFp32Exact) {
  const int64_t n = 70001;
  const std::vector<float> a = Random(n, 24), b = Random(n, 25);
  const float scale = 0.3f;
  std::vector<float> want_scaled(n), want_sum(n);
  for (int64_t i = 0; i < n; ++i) {
    want_scaled[i] = a[i] * scale;
    want_sum[i] = b[i] + a[i];
  }
  const float* d_a = ToDevice(a);
  float* d_scaled = static_cast<float*>(Alloc(n * sizeof(float)));
  float* d_acc = ToDevice(b);
  ASSERT_EQ(LaunchScale(d_a, d_scaled, n, scale, nullptr), cudaSuccess);
  ASSERT_EQ(LaunchAccumulate(d_a, d_acc, n, nullptr), cudaSuccess);
  EXPECT_EQ(FromDevice(d_scaled, n), want_scaled);
  EXPECT_EQ(FromDevice(d_acc, n), want_sum);
  // In place.
  ASSERT_EQ(LaunchScale(d_acc, d_acc, n, scale, nullptr), cudaSuccess);
  for (float& x : want_sum) x *= scale;
  EXPECT_EQ(FromDevice(d_acc, n), want_sum);
}

// The flag is set by a NaN or Inf anywhere (first, middle, last element)
// and never cleared.
TEST_F(DeviceKernelsTest, FlagNonFiniteSetsButNeverClears) {
  const int64_t n = 300001;  // several blocks' strides
  const std::vector<float> clean = Random(n, 26);
  int* d_flag = static_cast<int*>(Alloc(sizeof(int)));
  const auto flag_after = [&](const std::vector<float>& v, int start) {
    EXPECT_EQ(cudaMemcpy(d_flag, &start, sizeof(int), cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(LaunchFlagNonFinite(ToDevice(v), n, d_flag, nullptr),
              cudaSuccess);
    return FromDevice(d_flag, 1)[0];
  };
  EXPECT_EQ(flag_after(clean, 0), 0);
  EXPECT_EQ(flag_after(clean, 1), 1);
  for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> v = clean;
      v[at] = bad;
      EXPECT_EQ(flag_after(v, 0), 1) << "at " << at << " value " << bad;
    }
  }
}

}  // namespace
}  // namespace dmuon::kernels::cuda::device
