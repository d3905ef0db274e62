#include "kernels/blas_core.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace dmuon::kernels {
namespace {

TEST(BetterBlasCore, GenericCoresOnBetterCpus) {
  const CpuFeatures avx512{true, true}, avx2{true, false}, old{false, false};
  EXPECT_EQ(BetterBlasCore("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(BetterBlasCore("Prescott", avx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("Prescott", old), std::nullopt);
  EXPECT_EQ(BetterBlasCore("Sandybridge", avx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("NEHALEM", avx512), "SkylakeX");
}

TEST(BetterBlasCore, GoodOrForeignCoresStand) {
  const CpuFeatures avx512{true, true};
  for (const char* core :
       {"Haswell", "SkylakeX", "Cooperlake", "Zen", "neoversen1", ""}) {
    EXPECT_EQ(BetterBlasCore(core, avx512), std::nullopt) << core;
  }
}

// The library answers, and with OPENBLAS_CORETYPE set (as dmuond does when
// it starts again) it names the core asked for. (tests/daemon_test checks
// that dmuond ends up on kernels this CPU cannot better.)
TEST(BlasCoreName, NamesTheLoadedKernels) {
  const std::string name = BlasCoreName();
  EXPECT_FALSE(name.empty());
  const char* asked = std::getenv("OPENBLAS_CORETYPE");
  if (asked != nullptr) {
    EXPECT_EQ(name, asked);
  }
}

}  // namespace
}  // namespace dmuon::kernels
