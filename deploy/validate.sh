#!/usr/bin/env bash
# deploy/validate.sh: offline checks of the dmuond Helm chart, its examples and
# the image recipe; what `./dmuon test` runs for deploy/. No helm, kubectl,
# cluster or container engine is needed (none can be installed here):
#
#  0. tests the tools themselves: the renderer (tools/render: Go
#     text/template + sprig + Helm's functions) and the validators
#     (tools/validate/*_test.py: each check must reject what it is for);
#  1. renders the chart, values.schema.json checked, in strict mode (no
#     reference to a missing value, as `helm lint --strict`) for every
#     ci/*-values.yaml profile and every examples/values-*.yaml, for the
#     Kubernetes version the schemas are of; each must render;
#  2. renders every ci/bad/*.yaml; each must fail, with the message its
#     `# expect: ...` line gives (`# flags: ...` adds renderer flags);
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
#     $DMUONCTL), else reports that part as skipped (tools/validate/flags.py).
# Steps 0 and 3-5 run on the project's Python environment (.venv, made by
# `./dmuon setup` from python/requirements.lock: kubernetes-validate,
# jsonschema, yamllint, PyYAML, pytest).
#
# Usage: deploy/validate.sh [-v]     (-v: print each rendered manifest's path)
# Env:   DMUON_DEPLOY_NO_INSTALL=1   never apt-get install missing packages
#        DMUON_DEPLOY_KEEP=1         keep the rendered output in deploy/.validate-out
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
GO=/usr/lib/go-1.19/bin/go
GOSRC=/usr/share/gocode/src
# what must exist -> the Debian package that provides it (see packages.txt)
declare -A NEED=(
  ["$GO"]=golang-1.19-go
  ["$GOSRC/github.com/Masterminds/sprig"]=golang-github-masterminds-sprig-dev
  ["$GOSRC/gopkg.in/yaml.v2"]=golang-gopkg-yaml.v2-dev
  ["$GOSRC/gopkg.in/yaml.v3"]=golang-gopkg-yaml.v3-dev
  ["$GOSRC/github.com/xeipuuv/gojsonschema"]=golang-github-xeipuuv-gojsonschema-dev
)
missing=()
for what in "${!NEED[@]}"; do
  pkg=${NEED[$what]}
  grep -qx "$pkg" packages.txt || { bad "packages.txt does not list $pkg"; }
  [[ -e $what ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  if [[ $(id -u) == 0 && -z ${DMUON_DEPLOY_NO_INSTALL:-} ]]; then
    log "installing ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  else
    bad "missing Debian packages: ${missing[*]} (apt-get install ${missing[*]})"
    summary
    exit 1
  fi
fi

# The project's Python environment: the validators, yamllint and pytest come
# from PyPI through python/requirements.lock, nowhere else.
PY=$ROOT/.venv/bin/python
if [[ ! -x $PY ]]; then
  bad "no Python environment at $PY: run ./dmuon setup"
  summary
  exit 1
fi
if ! pyerr=$("$PY" -c 'import kubernetes_validate, jsonschema, yaml, yamllint, pytest' 2>&1); then
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
# The renderer: GOPATH mode against Debian's Go libraries; Go's build cache
# makes this about a second when warm.
export GOCACHE=${GOCACHE:-${XDG_CACHE_HOME:-${HOME:-$WORK}/.cache}/go-build}
if ! GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS='' "$GO" build -o "$WORK/render" ./tools/render \
  >"$WORK/go.log" 2>&1; then
  bad "building tools/render:"
  sed 's/^/      /' "$WORK/go.log"
  summary
  exit 1
fi
RENDER=$WORK/render
# The renderer's own tests (Helm semantics: values coalescing, float64
# numbers, tpl/include/required/fail, error messages, kubeVersion).
if GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS='' "$GO" test ./tools/render >"$WORK/gotest.log" 2>&1; then
  ok "tools/render tests"
else
  bad "tools/render tests:"
  sed 's/^/      /' "$WORK/gotest.log"
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

# ---------------------------------------------------------------- 1. good profiles
# Renderer flags from a profile's "# flags: ..." line.
flags_of() { sed -n 's/^# flags: //p' "$1" | head -1; }

rendered=()
for f in "$CHART"/ci/*.yaml examples/values-*.yaml; do
  name=$(basename "$f" .yaml)
  [[ $f == examples/* ]] && name=example-$name
  # shellcheck disable=SC2046
  if "$RENDER" "$CHART" --strict --kube-version "v$KUBE_VERSION.0" -f "$f" $(flags_of "$f") \
    -o "$OUT/$name.yaml" --notes "$OUT/$name.NOTES.txt" 2>"$WORK/err"; then
    n=$(grep -c '^---$' "$OUT/$name.yaml" || true)
    ok "render $f ($n objects)"
    rendered+=("$OUT/$name.yaml")
    ((VERBOSE)) && echo "      -> $OUT/$name.yaml"
  else
    bad "render $f:"
    sed 's/^/      /' "$WORK/err"
  fi
done

# ---------------------------------------------------------------- 2. bad profiles
for f in "$CHART"/ci/bad/*.yaml; do
  mapfile -t expects < <(sed -n 's/^# expect: //p' "$f")
  if ((${#expects[@]} == 0)); then
    bad "$f has no '# expect: <message>' line"
    continue
  fi
  # shellcheck disable=SC2046
  if "$RENDER" "$CHART" --kube-version "v$KUBE_VERSION.0" -f "$f" $(flags_of "$f") -o /dev/null 2>"$WORK/err"; then
    bad "$f rendered, but must fail with: ${expects[0]}"
    continue
  fi
  miss=()
  for e in "${expects[@]}"; do grep -qF -- "$e" "$WORK/err" || miss+=("$e"); done
  if ((${#miss[@]})); then
    bad "$f failed for another reason than '${miss[0]}':"
    sed 's/^/      /' "$WORK/err"
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
