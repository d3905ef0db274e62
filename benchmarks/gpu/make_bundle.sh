#!/usr/bin/env bash
# Builds the CUDA configuration here and packs what the GPU machine needs to
# run it: binaries, plus every shared library they load that is neither part
# of the base system (glibc, libstdc++) nor CUDA's (cuBLAS/cuBLASLt come from
# the GPU machine's own toolkit or torch wheels: they are far too large to
# carry). Usage: make_bundle.sh OUT_DIR
set -euo pipefail
out=${1:?usage: make_bundle.sh OUT_DIR}
cd "$(dirname "$0")/../.."
targets=(
  //kernels/cuda:cuda_kernels_test
  //kernels/cuda:device_kernels_test
  //kernels/cuda:autotune_cuda_test
  //kernels/cuda:ns_tool
  //benchmarks:kernels_bench_cuda
  //server/cuda:cuda_executor_test
  //daemon:dmuond_cuda
  //daemon:dmuond
  //benchmarks/gpu:gpu_step
  //benchmarks/gpu:gpu_probe
)
bazel build --config=cuda "${targets[@]}" //client/python:_dmuon.so >&2
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
bins=()
for t in "${targets[@]}"; do
  path=bazel-bin/${t#//}
  path=${path/://}
  bins+=("$path")
  cp -L "$path" "$out/bin/"
done
scripts=(compare_torch.py torch_train.py torch_step.py ext_check.py targets.py)
cp benchmarks/gpu/run.sh "${scripts[@]/#/benchmarks/gpu/}" "$out/"
# The Python extension is rebuilt there for the machine's CPython (3.12 with
# torch 2.x; Debian's here is 3.11): stage its sources, headers and objects.
benchmarks/gpu/stage_ext.sh "$out" >&2
mkdir -p "$out/data"
cp benchmarks/data/llama3-8b.json "$out/data/"
# Libraries resolved by the loader here; keep the ones the GPU image lacks.
# ldd on the binaries where Bazel put them: their rpath finds the _solib_ libraries.
benchmarks/gpu/copy_libs.sh "$out/lib" "${bins[@]}"
strip --strip-debug "$out"/bin/* "$out"/lib/* 2>/dev/null || true
# The device tool carries at most 64 MiB: everything but run.sh travels as one
# xz archive (about a fifth of the size), which run.sh unpacks on the device.
# $DMUON_BUNDLE_XZ_LEVEL (default 6): ./dmuon test's rehearsal, which never
# carries the bundle anywhere, packs with 0 (several times faster).
parts=(bin lib data ext python "${scripts[@]}")
tar -C "$out" -cf - "${parts[@]}" | xz -T0 "-${DMUON_BUNDLE_XZ_LEVEL:-6}" >"$out/payload.tar.xz"
(cd "$out" && rm -rf "${parts[@]}")
du -sh "$out" >&2
