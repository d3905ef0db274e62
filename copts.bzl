"""Compiler flags every dmuon C++ target uses (warnings are errors), and the
macro that compiles a .cu file with nvcc."""

DMUON_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
]

# nvcc flags of every .cu file (dmuon_cuda_kernels below): Hopper machine code
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

def dmuon_cuda_kernels(name, src, hdrs, deps = [], visibility = None):
    """A cc_library of one .cu file's device code and its launchers' header.

    nvcc compiles `src` with DMUON_NVCC_FLAGS in a genrule (Bazel 4's C++
    rules do not know nvcc); the object is linked statically (a shared
    library of CUDA objects misses the static cudart's symbols at run time).
    Tagged "cuda": built only with --config=cuda.
    """
    native.genrule(
        name = name + "_obj",
        srcs = [src] + hdrs,
        outs = [name + ".o"],
        cmd = "/usr/local/cuda/bin/nvcc " + DMUON_NVCC_FLAGS +
              " -I. -c $(location " + src + ") -o $@",
        tags = ["cuda"],
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_obj"],
        hdrs = hdrs,
        copts = DMUON_COPTS,
        linkstatic = True,
        tags = ["cuda"],
        visibility = visibility,
        deps = deps + ["@local_cuda//:cudart"],
    )
