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
  //kernels/cuda:autotune_cuda_test
  //kernels/cuda:ns_tool
  //benchmarks:kernels_bench_cuda
  //server:cuda_executor_test
  //server:dmuond_cuda
  //benchmarks/gpu:gpu_step
)
bazel build --config=cuda "${targets[@]}" >&2
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
bins=()
for t in "${targets[@]}"; do
  path=bazel-bin/${t#//}
  path=${path/://}
  bins+=("$path")
  cp -L "$path" "$out/bin/"
done
cp benchmarks/gpu/run.sh benchmarks/gpu/compare_torch.py "$out/"
mkdir -p "$out/data"
cp benchmarks/data/llama3-8b.json "$out/data/"
# Libraries resolved by the loader here; keep the ones the GPU image lacks.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcublas|libcublasLt|libnccl|libcudart)'
# ldd on the binaries where Bazel put them: their rpath finds the _solib_ libraries.
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=>/ {print $1, $3}' | while read -r name file; do
    [[ $name =~ $skip ]] && continue
    [[ -f $file ]] || { echo "make_bundle: $name not found here (needed by $(basename "$b"))" >&2; continue; }
    [[ -f $out/lib/$name ]] || cp -L "$file" "$out/lib/$name"
  done
done
strip --strip-debug "$out"/bin/* "$out"/lib/* 2>/dev/null || true
# The device tool carries at most 64 MiB: everything but run.sh travels as one
# xz archive (about a fifth of the size), which run.sh unpacks on the device.
tar -C "$out" -cf - bin lib data compare_torch.py | xz -T0 -6 >"$out/payload.tar.xz"
rm -rf "$out/bin" "$out/lib" "$out/data" "$out/compare_torch.py"
du -sh "$out" >&2
