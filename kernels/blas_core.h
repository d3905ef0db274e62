// Which OpenBLAS kernels this process runs, and the ones the CPU could run.
//
// A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels when it loads, from
// the CPU's family and model. A model its table does not know (a newer CPU,
// or a VM that hides the model: "Intel(R) Xeon(R) Processor") gets the
// generic Prescott (SSE3) kernels even on a CPU with AVX-512: Newton–Schulz
// then runs 5–6x slower, silently. OPENBLAS_CORETYPE, read when the library
// loads, overrides the choice; dmuond sets it and starts again when the
// choice is weaker than the CPU (daemon_main.cc, UseBestBlasKernels).

#ifndef DMUON_KERNELS_BLAS_CORE_H_
#define DMUON_KERNELS_BLAS_CORE_H_

#include <optional>
#include <string>
#include <string_view>

namespace dmuon::kernels {

// What the CPU and the OS support (CPUID and XCR0, as libgcc reads them).
struct CpuFeatures {
  bool avx2_fma = false;  // AVX2 and FMA: OpenBLAS's Haswell kernels
  bool avx512 = false;    // AVX-512 F, DQ, BW, VL: its SkylakeX kernels
};
CpuFeatures HostCpuFeatures();

// The kernels the loaded OpenBLAS uses (openblas_get_corename), e.g.
// "Prescott", "Haswell", "SkylakeX".
std::string BlasCoreName();

// The OPENBLAS_CORETYPE to ask for when `core` is one of OpenBLAS's
// pre-AVX2 generic x86 cores and `cpu` supports a better one; nullopt when
// the choice stands (it is already that good, or not a generic x86 core: an
// AMD Zen, an ARM core, a choice the operator made).
std::optional<std::string> BetterBlasCore(std::string_view core,
                                          CpuFeatures cpu);

}  // namespace dmuon::kernels

#endif  // DMUON_KERNELS_BLAS_CORE_H_
