#include "kernels/blas_core.h"

#include <array>

#include "absl/strings/ascii.h"

extern "C" char* openblas_get_corename(void);

namespace dmuon::kernels {

CpuFeatures HostCpuFeatures() {
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return f;
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name == nullptr ? "" : name;
}

std::optional<std::string> BetterBlasCore(std::string_view core,
                                          CpuFeatures cpu) {
  // OpenBLAS's x86 cores older than Haswell: what it falls back to for a
  // model it does not know. Sandybridge (AVX) is among them: an AVX2 CPU
  // runs Haswell's kernels faster.
  static constexpr std::array<std::string_view, 11> kGeneric = {
      "katmai", "coppermine", "northwood", "prescott", "banias",     "core2",
      "penryn", "dunnington", "nehalem",   "atom",     "sandybridge"};
  const std::string lower = absl::AsciiStrToLower(std::string(core));
  bool generic = false;
  for (std::string_view g : kGeneric) generic = generic || lower == g;
  if (!generic) return std::nullopt;
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return std::nullopt;
}

}  // namespace dmuon::kernels
