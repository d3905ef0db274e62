#!/usr/bin/env python3
"""Extracts the OpenAPI v3 schema of a CustomResourceDefinition into a JSON
file that schema_check.py loads (deploy/schemas/; see its SOURCE.md).

    .venv/bin/python deploy/tools/validate/extract_crd_schema.py [--out DIR] CRD.yaml...

For each version of each CRD it writes DIR/<group>_<Kind>_<version>.json
(e.g. monitoring.coreos.com_ServiceMonitor_v1.json): the version's spec.versions[].schema.openAPIV3Schema,
unchanged (descriptions included), as JSON. Nothing is adapted here: the
strictness validate.py adds (unknown fields fail, as the API server prunes
and `kubectl --validate=strict` reports them) is applied when the schema is
loaded, so the files stay comparable with upstream. Prints each file
written with the sha256 of its source.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import yaml

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "schemas"


def extract(crd_file: Path, out_dir: Path) -> list[Path]:
    """Writes one JSON schema per version of the CRD in crd_file."""
    raw = crd_file.read_bytes()
    docs = [d for d in yaml.safe_load_all(raw) if d]
    written: list[Path] = []
    for crd in docs:
        if crd.get("kind") != "CustomResourceDefinition":
            raise ValueError(f"{crd_file}: a {crd.get('kind')} is not a CustomResourceDefinition")
        spec = crd["spec"]
        group, kind = spec["group"], spec["names"]["kind"]
        for version in spec["versions"]:
            schema = version.get("schema", {}).get("openAPIV3Schema")
            if not isinstance(schema, dict):
                raise ValueError(f"{crd_file}: {kind} {version['name']} has no openAPIV3Schema")
            out = out_dir / f"{group}_{kind}_{version['name']}.json"
            out.write_text(json.dumps(schema, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(out)
            print(f"{out}: {group}/{version['name']} {kind} from {crd_file} "
                  f"(sha256 {hashlib.sha256(raw).hexdigest()})")
    return written


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: deploy/schemas)")
    ap.add_argument("crds", nargs="+", type=Path, help="CustomResourceDefinition YAML files")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for f in args.crds:
            extract(f, args.out)
    except (OSError, KeyError, ValueError, yaml.YAMLError) as e:
        print(f"extract_crd_schema: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
