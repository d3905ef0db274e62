"""Schema validation of Kubernetes objects, unknown fields included.

Built-in kinds are validated by the PyPI package kubernetes-validate in its
strict mode, against the schemas of KUBERNETES_VERSION that it ships
(`additionalProperties: false` everywhere: an unknown field fails, as with
`kubectl apply --validate=strict`).

Prometheus-operator kinds (monitoring.coreos.com: ServiceMonitor,
PodMonitor) have no schema on PyPI: their CRDs' openAPIV3Schema is kept in
deploy/schemas/ (see SOURCE.md there) and validated with jsonschema after
load_crd_schema() has made it as strict as the API server: a field the
schema does not declare is pruned by the API server and reported by
`kubectl --validate=strict`, so it fails here; the object's metadata is
checked against the Kubernetes ObjectMeta schema, as the API server does.

Messages read "<field path>: <problem>", e.g.
"spec.template.spec.containers[0].bogus: unknown field".
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from manifests import Obj, field_path

# Validated against the chart's floor (Chart.yaml: kubeVersion >=1.29.0-0):
# Kubernetes only adds fields within an API version, so what validates
# strictly against 1.29 is accepted by every later release the chart
# supports, while a field introduced after 1.29 fails here.
KUBERNETES_VERSION = "1.29"

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number", type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON type name of a parsed YAML value."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


# ------------------------------------------------------------------ messages

def format_error(err: jsonschema.ValidationError) -> list[str]:
    """One message per problem a jsonschema error stands for; an
    additionalProperties error gives one "unknown field" per extra key."""
    path = list(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = set(err.schema.get("properties", {}))
        patterns = list(err.schema.get("patternProperties", {}))
        extra = [k for k in err.instance
                 if k not in known and not any(re.search(p, k) for p in patterns)]
        return [f"{field_path([*path, k])}: unknown field" for k in extra]
    if err.validator == "type":
        want = err.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return [f"{field_path(path)}: must be {want}, got {json_type(err.instance)}"
                f"{'' if isinstance(err.instance, (dict, list)) else f' {json.dumps(err.instance)}'}"]
    msg = err.message if len(err.message) <= 200 else err.message[:197] + "..."
    return [f"{field_path(path)}: {msg}"]


def _messages(errors: Iterator[jsonschema.ValidationError]) -> list[str]:
    out: list[str] = []
    for err in sorted(errors, key=lambda e: [str(p) for p in e.absolute_path]):
        for m in format_error(err):
            if m not in out:
                out.append(m)
    return out


# ------------------------------------------------------------------ built-in kinds

def _all_kubernetes_errors(obj: Obj, schema_version: str) -> list[str]:
    """Every error of obj against kubernetes-validate's strict schema for
    schema_version, with the validator that kubernetes_validate.validate()
    builds (it stops at the first); raises if the package layout changed."""
    full = next(v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == schema_version)
    folder = f"kubernetes-json-schema/v{full}-local-strict"
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    schema = kv_utils.schema_contents(f"{folder}/{obj['kind'].lower()}-{api}.json", full)
    defs = kv_utils.schema_contents(f"{folder}/_definitions.json", full)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return _messages(validator.iter_errors(obj))


def kubernetes_errors(obj: Obj, version: str = KUBERNETES_VERSION) -> list[str] | None:
    """Problems of a built-in object against Kubernetes `version`'s strict
    schema ([] when it validates); None when kubernetes-validate has no
    schema for its apiVersion and kind."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
        return []
    except kubernetes_validate.SchemaNotFoundError:
        return None
    except kubernetes_validate.ValidationError as first:
        try:
            found = _all_kubernetes_errors(obj, first.version)
        except Exception:  # noqa: BLE001 - fall back to the library's own report
            found = []
        return found or format_error(first)


# ------------------------------------------------------------------ CRD kinds

def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: Obj) -> Iterator[jsonschema.ValidationError]:
    """x-kubernetes-list-type: map: no two items with the same key fields."""
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen: dict[str, int] = {}
    for i, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = json.dumps([item.get(k) for k in keys])
        if key in seen:
            yield jsonschema.ValidationError(
                f"items [{seen[key]}] and [{i}] have the same {', '.join(keys)} (a list-map key)")
        seen.setdefault(key, i)


# OpenAPI v3.0 schemas (CRDs) are closest to JSON Schema draft 4 (boolean
# exclusiveMinimum); the list-map keyword is the API server's.
CrdValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _list_map_keys})


def strict_openapi(node: Any, root: bool = True) -> Any:
    """A copy of a CRD's structural schema that rejects what the API server
    prunes: an object node without x-kubernetes-preserve-unknown-fields and
    without additionalProperties gets additionalProperties: false. Also
    nullable: true allows null, x-kubernetes-int-or-string is an integer or
    a string, and x-kubernetes-list-type: set means unique items. The root's
    metadata is left open: check_object_meta() validates it."""
    if not isinstance(node, dict):
        return node
    out = copy.copy(node)
    for key in ("properties", "patternProperties"):
        if isinstance(node.get(key), dict):
            out[key] = {k: (v if root and k == "metadata" and key == "properties" else strict_openapi(v, False))
                        for k, v in node[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = strict_openapi(node[key], False)
    for key in ("anyOf", "allOf", "oneOf"):
        if isinstance(node.get(key), list):
            out[key] = [strict_openapi(v, False) for v in node[key]]
    is_object = node.get("type") == "object" or "properties" in node
    if is_object and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") is True and isinstance(node.get("type"), str):
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


CRD_FILE = re.compile(r"^(?P<group>[a-z0-9.-]+)_(?P<kind>[A-Za-z0-9]+)_(?P<version>v[a-z0-9]+)\.json$")


def load_crd_schemas(folder: Path = SCHEMA_DIR) -> dict[tuple[str, str], Any]:
    """{(apiVersion, kind): validator} for every <group>_<Kind>_<version>.json
    in folder (written by extract_crd_schema.py)."""
    out: dict[tuple[str, str], Any] = {}
    for f in sorted(folder.glob("*.json")):
        m = CRD_FILE.match(f.name)
        if not m:
            raise ValueError(f"{f}: not named <group>_<Kind>_<version>.json")
        schema = strict_openapi(json.loads(f.read_text(encoding="utf-8")))
        CrdValidator.check_schema(schema)
        out[(f"{m['group']}/{m['version']}", m["kind"])] = CrdValidator(schema)
    return out


def check_object_meta(obj: Obj, version: str = KUBERNETES_VERSION) -> list[str]:
    """metadata of a custom resource against Kubernetes' ObjectMeta (strict),
    as the API server validates it: checked as the metadata of a ConfigMap."""
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    return kubernetes_errors(probe, version) or []


# ------------------------------------------------------------------ entry point

class SchemaChecker:
    """Validates objects of any kind this tool has a schema for."""

    def __init__(self, version: str = KUBERNETES_VERSION, crd_folder: Path = SCHEMA_DIR) -> None:
        self.version = version
        self.crds = load_crd_schemas(crd_folder)

    def errors(self, obj: Obj) -> list[str]:
        """Problems of obj against its schema ([] when it validates)."""
        api, kind = obj.get("apiVersion"), obj.get("kind")
        if not isinstance(api, str) or not isinstance(kind, str) or not re.fullmatch(r"[A-Za-z0-9]+", kind):
            return [f"apiVersion and kind must be strings (got {json.dumps(api)}, {json.dumps(kind)})"]
        crd = self.crds.get((api, kind))
        if crd is not None:
            return _messages(crd.iter_errors(obj)) + check_object_meta(obj, self.version)
        if api.split("/")[0].endswith("coreos.com"):
            found = None  # never fall through to a Kubernetes schema of the same name
        else:
            found = kubernetes_errors(obj, self.version)
        if found is None:
            return [f"no schema for apiVersion {api} kind {kind} (Kubernetes {self.version}, "
                    f"or deploy/schemas/ for custom resources)"]
        return found
