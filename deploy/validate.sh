#!/usr/bin/env bash
# deploy/validate.sh: offline checks of the dmuond Helm chart, its examples and
# the image recipe; what `./dmuon test` runs for deploy/. No helm binary,
# kubectl, cluster or container engine is needed: Helm itself comes from PyPI.
#
#  0. tests the tools themselves: the renderer (tools/helm/render.py: Helm
#     v4's own engine through helm-python-sdk) and the validators
#     (tools/validate/*_test.py: each check must reject what it is for);
#  1. renders and lints the chart with Helm (values.schema.json checked,
#     `helm lint --strict`, the chart's kubeVersion checked against the
#     Kubernetes version the schemas are of) for every ci/*-values.yaml
#     profile and every examples/values-*.yaml; each must render;
#  2. renders every ci/bad/*.yaml; each must fail, with the message its
#     `# expect: ...` lines give (Helm's wording; `# flags: ...` adds
#     render.py flags such as --kube-version or --skip-schema-validation);
#  3. validates every rendered object, and the example manifests, in strict
#     mode (unknown fields fail) against the Kubernetes schemas that the PyPI
#     package kubernetes-validate ships for one stated Kubernetes version and
#     the Prometheus-operator CRD schemas kept in schemas/, plus API-server and
#     cross-object rules (tools/validate/validate.py); the example Job's
#     dmuond sidecar must equal the chart's snippet;
#  4. lints values, profiles, examples and rendered manifests with yamllint;
#     values.schema.json must be valid JSON;
#  5. checks the Dockerfile (COPY sources and Bazel targets exist) and parses
#     every dmuond/dmuonctl command line of the chart and the Dockerfile with
#     the real binaries when they are built (bazel-bin/daemon/, or $DMUOND and
#     $DMUONCTL), else reports that part as skipped (tools/validate/flags.py);
#     runs ./dmuon with only what the Dockerfile copies before its
#     `RUN ./dmuon setup` (tools/validate/setup_context.py).
# Everything runs on the project's Python environment (.venv, made by
# `./dmuon setup` from python/requirements.lock: helm-python-sdk,
# kubernetes-validate, jsonschema, yamllint, PyYAML, pytest).
#
# Usage: deploy/validate.sh [-v]     (-v: print each rendered manifest's path)
# Env:   DMUON_DEPLOY_KEEP=1         keep the rendered output in deploy/.validate-out
# Last line: "deploy: N passed, N failed, N skipped"; exit status 1 on failure.
set -euo pipefail
cd "$(dirname "$0")"
DEPLOY=$PWD
ROOT=$(cd .. && pwd)
CHART=helm/dmuond
VERBOSE=0
[[ ${1:-} == -v ]] && VERBOSE=1

passed=0 failed=0 skipped=0
ok() { passed=$((passed + 1)); printf 'ok    %s\n' "$*"; }
bad() { failed=$((failed + 1)); printf 'FAIL  %s\n' "$*"; }
skip() { skipped=$((skipped + 1)); printf 'skip  %s\n' "$*"; }
log() { printf 'deploy: %s\n' "$*" >&2; }
summary() { echo "deploy: ${passed} passed, ${failed} failed, ${skipped} skipped"; }

# ---------------------------------------------------------------- prerequisites
# The project's Python environment: the validators, yamllint and pytest come
# from PyPI through python/requirements.lock, nowhere else.
PY=$ROOT/.venv/bin/python
if [[ ! -x $PY ]]; then
  bad "no Python environment at $PY: run ./dmuon setup"
  summary
  exit 1
fi
if ! pyerr=$("$PY" -c 'import helm_python, kubernetes_validate, jsonschema, yaml, yamllint, pytest' 2>&1); then
  bad "$PY lacks a package the checks need (${pyerr##*$'\n'}): run ./dmuon setup (python/requirements.in lists them)"
  summary
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1
VDIR=tools/validate
# The Kubernetes version the schemas are of; the chart is rendered for it too.
if ! KUBE_VERSION=$("$PY" "$VDIR/validate.py" --print-kubernetes-version 2>&1); then
  bad "deploy/$VDIR/validate.py does not start:"
  printf '%s\n' "$KUBE_VERSION" | sed 's/^/      /'
  summary
  exit 1
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OUT=$WORK/rendered
mkdir -p "$OUT"

# ---------------------------------------------------------------- tools
# The renderer: Helm's own engine (helm-python-sdk), tools/helm/render.py.
RENDER=("$PY" tools/helm/render.py)
# Its tests: it must refuse a bad template, a schema violation, a lint
# warning (strict), a chart whose kubeVersion excludes the version given.
# With them, the pure part of the pods play (play/pods.py: objects into
# what podman runs; play/play.sh itself runs in ./dmuon test after the image).
if "$PY" -m pytest -q -p no:cacheprovider tools/helm play/pods_test.py >"$WORK/pytest.log" 2>&1; then
  ok "tools/helm and play/pods.py tests ($(tail -1 "$WORK/pytest.log"))"
else
  bad "tools/helm and play/pods.py tests:"
  sed 's/^/      /' "$WORK/pytest.log"
fi

# The validators' own tests: each check must reject a hand-made manifest
# (unknown fields, wrong types, broken cross-object rules, unknown flags with
# fake binaries) and accept a valid one.
if "$PY" -m pytest -q -p no:cacheprovider "$VDIR" >"$WORK/pytest.log" 2>&1; then
  ok "tools/validate tests ($(tail -1 "$WORK/pytest.log"))"
else
  bad "tools/validate tests:"
  sed 's/^/      /' "$WORK/pytest.log"
fi

# ---------------------------------------------------------------- 1, 2. render
# Every profile is one line of one render.py --batch run (Helm's library
# loads once): the good profiles into $OUT, the bad ones to /dev/null.
# Renderer flags come from a profile's "# flags: ..." line.
flags_of() { sed -n 's/^# flags: //p' "$1" | head -1; }
good=("$CHART"/ci/*.yaml examples/values-*.yaml)
bads=("$CHART"/ci/bad/*.yaml)
JOBS=$WORK/jobs
mkdir -p "$JOBS"
job=0
for f in "${good[@]}" "${bads[@]}"; do
  job=$((job + 1))
  name=$(basename "$f" .yaml)
  [[ $f == examples/* ]] && name=example-$name
  to=(-o "$OUT/$name.yaml" --notes "$OUT/$name.NOTES.txt")
  [[ $f == */ci/bad/* ]] && to=(-o /dev/null)
  printf '%q ' "$CHART" --kube-version "v$KUBE_VERSION.0" -f "$f" "${to[@]}"
  printf '%s\n' "$(flags_of "$f")"
done >"$WORK/jobs.txt"
if ! "${RENDER[@]}" --batch "$JOBS" <"$WORK/jobs.txt" >"$WORK/batch.log" 2>&1; then
  bad "render.py --batch:"
  sed 's/^/      /' "$WORK/batch.log"
fi
rc_of() { cat "$JOBS/$1.rc" 2>/dev/null || echo missing; }

rendered=()
job=0
for f in "${good[@]}"; do
  job=$((job + 1))
  name=$(basename "$f" .yaml)
  [[ $f == examples/* ]] && name=example-$name
  if [[ $(rc_of $job) == 0 ]]; then
    n=$(grep -c '^---$' "$OUT/$name.yaml" || true)
    ok "render $f ($n objects)"
    rendered+=("$OUT/$name.yaml")
    ((VERBOSE)) && echo "      -> $OUT/$name.yaml"
  else
    bad "render $f:"
    sed 's/^/      /' "$JOBS/$job.err"
  fi
done

for f in "${bads[@]}"; do
  job=$((job + 1))
  mapfile -t expects < <(sed -n 's/^# expect: //p' "$f")
  if ((${#expects[@]} == 0)); then
    bad "$f has no '# expect: <message>' line"
    continue
  fi
  if [[ $(rc_of $job) == 0 ]]; then
    bad "$f rendered, but must fail with: ${expects[0]}"
    continue
  fi
  miss=()
  for e in "${expects[@]}"; do grep -qF -- "$e" "$JOBS/$job.err" || miss+=("$e"); done
  if ((${#miss[@]})); then
    bad "$f failed for another reason than '${miss[0]}':"
    sed 's/^/      /' "$JOBS/$job.err"
  else
    ok "rejects $(basename "$f"): ${expects[0]}"
  fi
done

# ---------------------------------------------------------------- 3. schemas
manifests=()
for f in examples/*.yaml; do
  [[ $(basename "$f") == values-* ]] || manifests+=("$f")
done
if ((${#rendered[@]} + ${#manifests[@]})); then
  compare=()
  [[ -f $OUT/example-values-sidecar.yaml && -f examples/training-job.yaml ]] &&
    compare=(--compare-sidecar "$OUT/example-values-sidecar.yaml" examples/training-job.yaml)
  if "$PY" "$VDIR/validate.py" "${compare[@]}" "${rendered[@]}" "${manifests[@]}" >"$WORK/validate.log" 2>&1; then
    ok "schemas: $(tail -1 "$WORK/validate.log")"
    ((VERBOSE)) && sed 's/^/      /' "$WORK/validate.log"
  else
    bad "schemas:"
    sed "s#$OUT/#rendered/#g; s/^/      /" "$WORK/validate.log"
  fi
fi

# ---------------------------------------------------------------- 4. yamllint
lint=("$CHART/Chart.yaml" "$CHART/values.yaml" "$CHART/ci" examples .yamllint "${rendered[@]}")
if "$PY" -m yamllint -s -f parsable -c .yamllint "${lint[@]}" >"$WORK/lint.log" 2>&1; then
  ok "yamllint: chart values, ci profiles, examples and ${#rendered[@]} rendered manifests"
else
  bad "yamllint:"
  sed "s#$OUT/#rendered/#g; s/^/      /" "$WORK/lint.log"
fi
if "$PY" -c 'import json, sys; json.load(open(sys.argv[1], encoding="utf-8"))' "$CHART/values.schema.json" \
  2>"$WORK/err"; then
  ok "values.schema.json is valid JSON"
else
  bad "values.schema.json: $(tail -1 "$WORK/err")"
fi

# The limits in values.yaml are the daemon's defaults (daemon/config.cc's
# ABSL_FLAGs, whose defaults are server/limits.h's constants), so that the chart changes nothing unless a value is set.
if "$PY" - "$CHART/values.yaml" "$ROOT/daemon/config.cc" "$ROOT/server/limits.h" \
  >"$WORK/limits.log" 2>&1 <<'PYEOF'
import re, sys, yaml
values = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))["daemon"]
src = re.sub(r"\s+", " ", open(sys.argv[2], encoding="utf-8").read())
limits = dict(re.findall(r"constexpr \w+ (k\w+) = ([^;]+);",
                         open(sys.argv[3], encoding="utf-8").read()))
keys = {"maxWorldSize": "max_world_size", "maxJobParameters": "max_job_parameters",
        "maxJobElements": "max_job_elements", "maxStateBytes": "max_state_bytes",
        "maxNsSteps": "max_ns_steps", "maxJobIdBytes": "max_job_id_bytes",
        "maxIdleJobs": "max_idle_jobs", "attachTimeoutSeconds": "attach_timeout_seconds",
        "jobRetentionSeconds": "job_retention_seconds",
        "maxStepQueueBytes": "max_step_queue_bytes"}
bad = []
for key, flag in keys.items():
    m = re.search(r"ABSL_FLAG\(\s*\w+, " + flag + r", ([^,]+),", src)
    if not m:
        bad.append(f"--{flag.replace('_', '-')}: no ABSL_FLAG in daemon/config.cc")
        continue
    expr = m.group(1).strip()
    # A flag's default may be a server/limits.h constant (written once).
    expr = limits.get(expr.split("::")[-1], expr)
    expr = re.sub(r"int64_t\{(\d+)\}", r"\1", expr)
    default = eval(expr, {"__builtins__": {}})  # literals and shifts only
    if values.get(key) != default:
        bad.append(f"daemon.{key} is {values.get(key)!r}, the daemon's default is {default}")
print("\n".join(bad) if bad else f"{len(keys)} limits")
sys.exit(1 if bad else 0)
PYEOF
then
  ok "values.yaml limits are the daemon's defaults ($(tail -1 "$WORK/limits.log"))"
else
  bad "values.yaml limits differ from daemon/config.cc:"
  sed 's/^/      /' "$WORK/limits.log"
fi

# ---------------------------------------------------------------- 5. image and flags
DMUOND=${DMUOND:-$ROOT/bazel-bin/daemon/dmuond}
DMUONCTL=${DMUONCTL:-$ROOT/bazel-bin/daemon/dmuonctl}
"$PY" "$VDIR/flags.py" --root "$ROOT" --dockerfile docker/Dockerfile \
  --dmuond "$DMUOND" --dmuonctl "$DMUONCTL" "${rendered[@]}" >"$WORK/flags.log" 2>&1 || true
while IFS= read -r line; do
  case $line in
    "ok "*) ok "${line#ok }" ;;
    "FAIL "*) bad "${line#FAIL }" ;;
    "skip "*) skip "${line#skip }" ;;
    "  "*) printf '      %s\n' "${line#  }" ;;
    flags:*) ;;
    *) bad "flags.py: $line" ;;
  esac
done <"$WORK/flags.log"

if [[ -n ${DMUON_DEPLOY_KEEP:-} ]]; then
  rm -rf "$DEPLOY/.validate-out"
  cp -r "$OUT" "$DEPLOY/.validate-out"
  log "rendered manifests kept in deploy/.validate-out"
fi
summary
((failed == 0))
