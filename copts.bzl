"""Compiler flags every dmuon C++ target uses: warnings are errors."""

DMUON_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
]

# nvcc flags of every .cu file (compiled in a genrule): Hopper machine code
# (sm_90a) plus a PTX fallback, warnings as errors.
DMUON_NVCC_FLAGS = " ".join([
    "-std=c++17",
    "-O3",
    "-Xcompiler -fPIC",
    "-Xcompiler -Wall,-Werror",
    "-Werror all-warnings",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
])
