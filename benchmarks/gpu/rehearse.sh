#!/usr/bin/env bash
# ./dmuon test's "gpucheck" suite: the GPU check rehearsed on this machine
# (no GPU needed), so that a change that breaks it shows up here rather than
# on the device's first run. In order:
#   1. targets.py's unit tests (test_targets.py, synthetic $OUT files);
#   2. `./dmuon bundle` into a temporary directory (the CUDA build is
#      Bazel's cached one; xz at level 0: nothing carries it anywhere);
#   3. that bundle's run.sh --device cpu --no-pytest with the project's
#      Python (.venv): the payload unpacked as on the device, the GPU
#      binaries run to print SKIP, the torch scripts on the CPU, the
#      extension built from the staged sources by ext/build_ext.sh, imported
#      from the staged package (PYTHONPATH) and checked against an SVD
#      (ext_check.py), the targets judged ("not measured" here).
# Each unit test is a test, each run.sh step is one (its summary line: rc=0
# passes), the bundle is one, and the target lines' presence is one.
# Prints the seconds of each part and ends with "gpucheck: N passed, M failed".
#   usage: benchmarks/gpu/rehearse.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
py=$root/.venv/bin/python
work=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-gpucheck.XXXXXX")
trap 'rm -rf "$work"' EXIT
p=0 f=0 t=$SECONDS times=()

# 1. targets.py
log=$work/pytest.log
prc=0
"$py" -m pytest -q "$root/benchmarks/gpu/test_targets.py" >"$log" 2>&1 || prc=$?
cat "$log"
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?)' "$log" | tail -n 1 || true)
if [[ $summary =~ ([0-9]+)\ passed ]]; then p=$((p + BASH_REMATCH[1])); fi
n=0
for k in failed error errors; do
  if [[ $summary =~ ([0-9]+)\ $k([ ,]|$) ]]; then n=$((n + BASH_REMATCH[1])); fi
done
((n == 0 && prc != 0)) && n=1  # pytest itself failed (import, usage)
f=$((f + n))
times+=("targets $((SECONDS - t))")

# 2. the bundle
t=$SECONDS
if DMUON_BUNDLE_XZ_LEVEL=0 "$root/dmuon" bundle "$work/bundle" >"$work/bundle.log" 2>&1; then
  echo "gpucheck: bundle built ($(du -sh "$work/bundle" | cut -f1))"
  p=$((p + 1))
else
  tail -n 30 "$work/bundle.log"
  echo "gpucheck: ./dmuon bundle FAILED"
  f=$((f + 1))
fi
times+=("bundle $((SECONDS - t))")

# 3. run.sh --device cpu
t=$SECONDS
if [[ -x $work/bundle/run.sh ]]; then
  rc=0
  OUT=$work/out "$work/bundle/run.sh" --device cpu --python "$py" --no-pytest || rc=$?
  sum=$work/out/summary.txt
  # Every step's line; not the probe's, which fails here (no GPU) by design.
  steps=$(grep -vE '^probe ' "$sum" | grep -cE ' rc=[0-9]+ ' || true)
  ok=$(grep -vE '^probe ' "$sum" | grep -cE ' rc=0 ' || true)
  p=$((p + ok)) f=$((f + steps - ok))
  # A step that never ran (no time left, no extension) fails too.
  f=$((f + $(grep -cE 'not run: no time left|not run \(no extension\)' "$sum" || true)))
  if (($(grep -c '^TARGET ' "$sum" || true) == 6)); then
    p=$((p + 1))
  else
    echo "gpucheck: summary.txt lacks the 6 target lines"
    f=$((f + 1))
  fi
  if ((rc != 0 && steps == ok)); then
    echo "gpucheck: run.sh exited $rc"
    f=$((f + 1))
  fi
fi
times+=("run.sh $((SECONDS - t))")
echo "gpucheck: seconds per part: ${times[*]}"
echo "gpucheck: ${p} passed, ${f} failed"
((f == 0))
