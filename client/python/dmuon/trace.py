"""Merging step timelines into one picture:

    python -m dmuon.trace merge OUT.json TRAINER.json DMUOND.json [...]

reads Chrome trace-event files (the trainer's DMUON_TRACE, dmuond's
--trace-file, `dmuonctl trace`'s) and writes one that opens in Perfetto
(ui.perfetto.dev) or chrome://tracing with every process's tracks side by
side, each Muon matrix's events of a step linked by flow arrows in causal
order (the trainer's ready, handoff, declare; dmuond's received, queued, gather, ns,
return; the trainer's update_received, wait, apply), matched by their args
(job, step, param).

Files of one host share CLOCK_MONOTONIC and are merged as they are;
`--align=wall` shifts each file by its recorded wall-clock minus monotonic
offset ("otherData"), for files of several hosts (as good as their clock
sync). A file cut short (a process killed mid-write) is read up to its last
whole event. Processes whose ids collide (two hosts) are renumbered.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

# A matrix's stages in causal order, across the trainer and dmuond.
STAGES = ("ready", "handoff", "declare", "received", "queued", "gather", "ns", "return",
          "update_received", "wait", "apply")


def load(path: str) -> dict[str, Any]:
    """A trace file as {"traceEvents": [...], "otherData": {...}}; the JSON
    array form and a file cut short after its last whole event are read too."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = _repair(text, path)
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents array)")
    doc.setdefault("otherData", {})
    return doc


def _repair(text: str, path: str) -> Any:
    """The events of a file whose end is missing: cut after the last "}"
    that closes a whole event, then close the array and the object."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a Chrome trace (no '[')")
    end = len(text)
    while True:
        end = text.rfind("}", start, end)
        if end < 0:
            return {"traceEvents": []}
        try:
            events = json.loads(text[start:end + 1] + "]")
            return {"traceEvents": events, "otherData": {"truncated": True}}
        except json.JSONDecodeError:
            continue


def _flows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flow events linking each (job, step, param)'s stage events in
    STAGES order (same stage: by time)."""
    chains: dict[tuple, list[dict[str, Any]]] = {}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") in ("X", "i") and a.get("stage") in STAGES and "param" in a:
            chains.setdefault((a.get("job"), a.get("step"), a["param"]), []).append(e)
    out = []
    for n, key in enumerate(sorted(chains, key=str)):
        chain = sorted(chains[key], key=lambda e: (STAGES.index(e["args"]["stage"]), e["ts"]))
        if len(chain) < 2:
            continue
        for k, e in enumerate(chain):
            ph = "s" if k == 0 else "f" if k == len(chain) - 1 else "t"
            flow = {"ph": ph, "id": n + 1, "cat": "matrix", "name": f"step {key[1]}",
                    "pid": e["pid"], "tid": e["tid"], "ts": e["ts"]}
            if ph != "s":
                flow["bp"] = "e"  # bound to the slice enclosing ts
            out.append(flow)
    return out


def merge(docs: Sequence[dict[str, Any]], align_wall: bool = False) -> dict[str, Any]:
    """One trace of `docs` (load()'s): events, thread and process names,
    and flows linking each matrix's stages."""
    events: list[dict[str, Any]] = []
    used: set[int] = set()
    base = None
    for doc in docs:
        other = doc.get("otherData", {})
        shift = 0.0
        if align_wall:
            offset = other.get("wall_minus_monotonic_us")
            if offset is None:
                raise ValueError("--align=wall: a file has no wall_minus_monotonic_us")
            base = offset if base is None else base
            shift = float(offset - base)
        pids: dict[Any, int] = {}
        for e in doc["traceEvents"]:
            e = dict(e)
            pid = e.get("pid", 0)
            if pid not in pids:
                new = pid
                while new in used:  # another file's process: renumbered
                    new += 1_000_000
                pids[pid] = new
                used.add(new)
            e["pid"] = pids[pid]
            if "ts" in e and shift:
                e["ts"] = e["ts"] + shift
            events.append(e)
    events += _flows(events)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"merged": [d.get("otherData", {}) for d in docs]}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmuon.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge trace files into one")
    m.add_argument("out", help="the merged file to write")
    m.add_argument("inputs", nargs="+", help="trace files (trainer, dmuond, ...)")
    m.add_argument("--align", choices=("monotonic", "wall"), default="monotonic",
                   help="monotonic: one host's files as they are (default); wall: "
                        "shift each by its wall-clock offset (several hosts)")
    args = p.parse_args(argv)
    try:
        docs = [load(path) for path in args.inputs]
        merged = merge(docs, align_wall=args.align == "wall")
    except (OSError, ValueError) as e:
        print(f"dmuon.trace merge: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(merged, f)
    n = sum(1 for e in merged["traceEvents"] if e.get("ph") in ("X", "i"))
    print(f"{args.out}: {n} events from {len(docs)} files; open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
