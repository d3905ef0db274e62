#!/usr/bin/env bash
# The GPU check: runs on a machine with one H200, the CUDA driver, python3
# with torch, nothing else installed and no network. It builds nothing but
# the Python extension's four pybind11 files (for the machine's CPython; the
# rest comes prebuilt): it takes the bundle made here by `./dmuon bundle`
# (carried to the machine), runs every GPU test, the kernel benchmark, a
# comparison with torch's own Muon orthogonalization, the CUDA executor's
# tests, a dmuond_cuda smoke step over CUDA IPC (every update checked against
# the CPU path), the Llama-3-8B optimizer step through dmuond_cuda timed
# against its flop floor, DMuon training a small transformer on CUDA in
# lockstep with torch.optim.Muon (timed against it and fused AdamW), and the
# Python client's tests on the machine's torch; writes results under $OUT,
# and prints a short table. Budget: 8 minutes — every step's timeout is
# capped by what is left of them.
#   usage (on the device, from the repository root):  bundle/run.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
py=$(command -v python3)
# make_bundle.sh packs binaries, libraries and data into payload.tar.xz.
if [[ -f $here/payload.tar.xz ]]; then
  unpacked=${TMPDIR:-/tmp}/dmuon-bundle.$$
  rm -rf "$unpacked" && mkdir -p "$unpacked"
  trap 'rm -rf "$unpacked"' EXIT
  "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$here/payload.tar.xz" "$unpacked" || { echo "cannot unpack the payload"; exit 1; }
  here=$unpacked
fi

# cuBLAS/cuBLASLt and NCCL: the machine's toolkit, else the torch wheels'
# nvidia/ tree.
libdirs=$("$py" - <<'PY'
import glob, os, site
dirs = set()
roots = ["/usr/local/cuda/lib64"] + site.getsitepackages()
for r in roots:
    for lib in ("libcublasLt.so*", "libnccl.so*"):
        for f in glob.glob(os.path.join(r, "**", lib), recursive=True):
            dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
echo "cuBLAS and NCCL from: $libdirs"
export LD_LIBRARY_PATH="$here/lib:$libdirs:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

have_gpu=1
if ! nvidia-smi -L >/dev/null 2>&1; then
  have_gpu=0
  echo "no GPU here (nvidia-smi -L failed): every step below skips with its reason"
fi

# Seconds for a step: at most $1, and never past the 8-minute deadline.
deadline=$((SECONDS + 480))
cap() {
  local left=$((deadline - SECONDS))
  ((left < 10)) && left=10
  echo $(($1 < left ? $1 : left))
}

status=0
summary=()
step() {  # step NAME CAP CMD...: runs CMD under its capped timeout
  local name=$1 limit
  limit=$(cap "$2")
  shift 2
  echo "== $name (timeout ${limit}s)"
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" || rc=$?
  ((rc == 0)) || status=1
  summary+=("$(printf '%-34s rc=%-3d %4ds' "$name" "$rc" $((SECONDS - t0)))")
}

step "GPU kernel tests" 150 bash -c \
  "'$here/bin/cuda_kernels_test' --gtest_output='json:$OUT/gpu-tests.json' 2>&1 | tail -n 40; exit \${PIPESTATUS[0]}"

step "CUDA autotuner test" 45 bash -c \
  "'$here/bin/autotune_cuda_test' 2>&1 | tail -n 10; exit \${PIPESTATUS[0]}"

step "CUDA executor tests" 90 bash -c \
  "'$here/bin/cuda_executor_test' --gtest_output='json:$OUT/executor-tests.json' 2>&1 | tail -n 30; exit \${PIPESTATUS[0]}"

# dmuond_cuda on cuda:0, a trainer rank on the same GPU over CUDA IPC, as a
# one-rank NCCL job, and over shm (the executor's host path); every update and
# the momentum vs the CPU fp32 path.
step "dmuond_cuda smoke step" 90 "$here/bin/gpu_step" \
  --dmuond="$here/bin/dmuond_cuda" --devices=cuda:0 \
  --shapes=256x512*3,512x256*2,384x384*4,96x1000 --steps=3 \
  --out="$OUT/smoke.json"

# Llama-3-8B's 224 matrices (random gradients) through dmuond_cuda over CUDA
# IPC: 28 GB of fp32 gradients, 28 GB of momentum on the GPU.
step "Llama-3-8B step via dmuond_cuda" 150 "$here/bin/gpu_step" \
  --dmuond="$here/bin/dmuond_cuda" --devices=cuda:0 --max_batch=8 \
  --table="$here/data/llama3-8b.json" --check=false --steps=3 \
  --out="$OUT/llama3-8b-step.json"

# The Python client on this machine's CPython and torch: the extension is
# compiled here from the staged sources (stage_ext.sh; no GPU needed), DMuon
# trains a small transformer on CUDA through dmuond_cuda (cuda_ipc) in
# lockstep with torch.optim.Muon, and the client's test suite runs on this
# torch (CPU dmuond: the torch 2.x hooks, DDP, state_dict paths).
step "Python extension ($("$py" -V 2>&1))" 120 \
  "$here/ext/build_ext.sh" "$here" "$here/ext/built" "$py"
export DMUON_EXTENSION_DIR=$here/ext/built PYTHONPATH=$here/python
if ((have_gpu)); then
  step "torch.optim.Muon comparison" 120 "$py" "$here/compare_torch.py" \
    --tool "$here/bin/ns_tool" --out "$OUT/torch-compare.json"
  step "DMuon on CUDA vs torch.optim.Muon" 150 "$py" "$here/torch_train.py" \
    --dmuond "$here/bin/dmuond_cuda" --out "$OUT/torch-train.json"
else
  for s in "torch.optim.Muon comparison" "DMuon on CUDA vs torch.optim.Muon"; do
    echo "== $s: SKIP (no GPU)"
    summary+=("$(printf '%-34s skipped (no GPU)' "$s")")
  done
fi
step "pytest on this torch (CPU dmuond)" 150 env DMUON_DMUOND="$here/bin/dmuond" \
  "$py" -m pytest -q -p no:cacheprovider "$here/python/tests" \
  --junitxml="$OUT/pytest.xml"

step "kernels benchmark" 240 bash -c \
  "'$here/bin/kernels_bench_cuda' --out='$OUT/kernels-gpu.json' > '$OUT/kernels-gpu.txt' 2>&1"
tail -n 30 "$OUT/kernels-gpu.txt" 2>/dev/null

echo
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit $status
