#!/usr/bin/env bash
# The GPU check: runs on a machine with one H200, the CUDA driver, python3
# with torch, nothing else installed and no network. It builds nothing: it
# takes the bundle made here by `./dmuon bundle` (carried to the machine),
# runs every GPU test, the kernel benchmark, and a comparison with torch's
# own Muon orthogonalization, writes results under $OUT, and prints a short
# table. Budget: well inside 8 minutes.
#   usage (on the device, from the repository root):  bundle/run.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
py=$(command -v python3)

# cuBLAS/cuBLASLt: the machine's toolkit, else the torch wheels' nvidia/ tree.
libdirs=$("$py" - <<'PY'
import glob, os, site
dirs = set()
roots = ["/usr/local/cuda/lib64"] + site.getsitepackages()
for r in roots:
    for f in glob.glob(os.path.join(r, "**", "libcublasLt.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
echo "cuBLAS from: $libdirs"
export LD_LIBRARY_PATH="$here/lib:$libdirs:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

status=0
echo "== GPU tests"
timeout 240 "$here/bin/cuda_kernels_test" --gtest_output="json:$OUT/gpu-tests.json" \
  2>&1 | tail -n 40 || status=1

echo "== torch.optim.Muon comparison"
timeout 120 "$py" "$here/compare_torch.py" --tool "$here/bin/ns_tool" \
  --out "$OUT/torch-compare.json" || status=1

echo "== kernels benchmark"
timeout 240 "$here/bin/kernels_bench_cuda" --out="$OUT/kernels-gpu.json" \
  > "$OUT/kernels-gpu.txt" 2>&1 || status=1
tail -n 30 "$OUT/kernels-gpu.txt"
exit $status
