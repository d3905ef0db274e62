"""Merging step timelines into one picture, and reading one:

    python -m dmuon.trace merge OUT.json TRAINER.json DMUOND.json [...]
    python -m dmuon.trace summary OUT.json [--matrices]
    python -m dmuon.trace stages OUT.json [OUT2.json ...]

reads Chrome trace-event files (the trainer's DMUON_TRACE, dmuond's
--trace-file, `dmuonctl trace`'s) and writes one that opens in Perfetto
(ui.perfetto.dev) or chrome://tracing with every process's tracks side by
side, each Muon matrix's events of a step linked by flow arrows in causal
order (the trainer's ready, handoff, declare; dmuond's received, queued, gather, ns,
return; the trainer's update_received, wait, apply), matched by their args
(job, step, name): a parameter's name is unique in its job, and the same on
every daemon of a pool (whose table indices, `param`, differ from the
trainer's).

`stages` answers "where does my step time go" in one table: per file (a
column each, e.g. before and after a change), the median over its steps of
each part of a step, summed over the step's matrices where it is per
matrix (see STEP_PARTS).

Files of one host share CLOCK_MONOTONIC and are merged as they are;
`--align=wall` shifts each file by its recorded wall-clock minus monotonic
offset ("otherData"), for files of several hosts (as good as their clock
sync). A file cut short (a process killed mid-write) is read up to its last
whole event. Processes whose ids collide (two hosts) are renumbered.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    """Flow events linking each (job, step, name)'s stage events in
    STAGES order (same stage: by time)."""
    chains: dict[tuple, list[dict[str, Any]]] = {}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") in ("X", "i") and a.get("stage") in STAGES and "name" in a:
            chains.setdefault((a.get("job"), a.get("step"), a["name"]), []).append(e)
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


def merge_files(out: str, inputs: Sequence[str], align_wall: bool = False) -> dict[str, Any]:
    """merge() of the trace files `inputs` (load()'s), written to `out`;
    returns the merged trace. Raises OSError or ValueError (a file missing
    or not a trace) before writing anything."""
    merged = merge([load(path) for path in inputs], align_wall=align_wall)
    with open(out, "w") as f:
        json.dump(merged, f)
    return merged


def summary(doc: dict[str, Any], matrices: bool = False) -> str:
    """Per step: the trainer's forward, backward, step() and the time it
    waited for updates, dmuond's Newton-Schulz busy time; with `matrices`,
    per matrix: when its gradient was ready, how long it queued, its NS,
    when its update was back (dmuond's `return` ended: it was in the
    client's memory; without dmuond's file, when the client saw it) and
    applied (ms from the step's first ready)."""
    events = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")]
    chains: dict[tuple, dict[str, dict[str, Any]]] = {}
    for e in events:
        a = e.get("args") or {}
        if a.get("stage") in STAGES and "name" in a:
            chains.setdefault((a.get("step"), a["name"]), {})[a["stage"]] = e
    sums = _step_sums(events)
    lines = []
    for step in sorted({k[0] for k in chains}, key=lambda s: (s is None, s)):
        part = sums.get(step, {})
        batches = {(c["ns"]["pid"], c["ns"]["args"].get("batch"))
                   for (st, _), c in chains.items() if st == step and "ns" in c}
        lines.append(f"step {step}: forward {part.get('forward', 0):.1f} ms, backward "
                     f"{part.get('backward', 0):.1f} ms, step() "
                     f"{part.get('step()', 0):.1f} ms; waited for updates "
                     f"{part.get('wait', 0):.1f} ms; dmuond NS "
                     f"{part.get('ns', 0):.1f} ms in {len(batches)} batches")
        if matrices:
            lines += _matrix_lines(sorted(
                ((p, c) for (st, p), c in chains.items() if st == step),
                key=lambda pc: pc[1].get("ready", pc[1].get("received", {})).get("ts", 0)))
    return "\n".join(lines)


def _matrix_lines(mine: list[tuple[str, dict[str, dict[str, Any]]]]) -> list[str]:
    """summary()'s lines for one step's matrices (name, {stage: event})."""
    t0 = min((c[s]["ts"] for _, c in mine for s in c), default=0)
    lines = ["  matrix (shape): ready, queued for, NS (batch size), back, applied; "
             "ms from the step's first event"]
    for _, c in mine:
        def at(stage, end=False):
            e = c.get(stage)
            if e is None:
                return "-"
            return f"{(e['ts'] + (e.get('dur', 0) if end else 0) - t0) / 1000:.1f}"
        queued = ("-" if "queued" not in c or "gather" not in c else
                  f"{(c['gather']['ts'] - c['queued']['ts']) / 1000:.1f}")
        ns = c.get("ns")
        ns_s = "-" if ns is None else (f"{ns['dur'] / 1000:.1f} "
                                       f"({ns['args'].get('batch_size')})")
        # Landed: dmuond's return's end (with the doorbell the client sees
        # an update only when it next looks: update_received).
        back = at("return", end=True) if "return" in c else at("update_received")
        any_e = next(iter(c.values()))["args"]
        lines.append(f"  {any_e.get('name')} ({any_e.get('shape')}): {at('ready')}, "
                     f"{queued}, {ns_s}, {back}, {at('apply')}")
    return lines


# The parts of a step that `stages` sums: the trainer's whole-step spans (by
# name; "check edits" and "adamw step" are inside "step()"), then the
# per-matrix stages (by args.stage) of the trainer and of dmuond.
STEP_SPANS = ("forward", "backward", "step()", "check edits", "adamw step")
MATRIX_STAGES = ("handoff", "declare", "wait", "apply", "gather", "ns", "return")
STEP_PARTS = STEP_SPANS + MATRIX_STAGES


def _step_sums(events: list[dict[str, Any]]) -> dict[Any, dict[str, float]]:
    """{step: {part: ms}} for each of STEP_PARTS a step has: its spans'
    durations summed over the step. A batch's "ns" counts once: every
    matrix of a batch has an "ns" span of the whole batch's run (its
    executor, `args.batch`), so summing them per matrix would count the
    batch's time once per matrix."""
    per_step: dict[Any, dict[str, float]] = {}
    seen_batches: set[tuple] = set()
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") != "X" or a.get("step") is None:
            continue
        part = e.get("name") if e.get("name") in STEP_SPANS else a.get("stage")
        if part not in STEP_PARTS:
            continue
        if part == "ns" and a.get("batch") is not None:
            batch = (e.get("pid"), a["step"], a.get("executor"), a["batch"])
            if batch in seen_batches:
                continue
            seen_batches.add(batch)
        parts = per_step.setdefault(a["step"], {})
        parts[part] = parts.get(part, 0.0) + e.get("dur", 0) / 1000
    return per_step


def stages(doc: dict[str, Any]) -> dict[str, float]:
    """{part: ms}: for each of STEP_PARTS, the median over the steps in
    `doc` of its time in a step (per-matrix stages summed over the step's
    matrices, a batch's Newton-Schulz once; 0 in a step without it). The
    trainer's "forward" of step N is the forward before step N's backward
    (its updates' waits and applies, with overlap_forward, are the previous
    step's)."""
    per_step = _step_sums(doc["traceEvents"])
    if not per_step:
        raise ValueError("no step's events in the trace (a DMUON_TRACE or "
                         "--trace-file of a run that stepped?)")
    return {part: statistics.median(p.get(part, 0.0) for p in per_step.values())
            for part in STEP_PARTS}


def stages_table(columns: dict[str, dict[str, float]]) -> str:
    """A markdown table: a row per part, a column per {label: stages()}."""
    lines = ["| ms per step (median) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for part in STEP_PARTS:
        side = "dmuond" if part in ("gather", "ns", "return") else "trainer"
        lines.append(f"| {side} {part} | " +
                     " | ".join(f"{c[part]:.1f}" for c in columns.values()) + " |")
    return "\n".join(lines)


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
    sm = sub.add_parser("summary", help="per step (and matrix) where the time went")
    sm.add_argument("file", help="a trace file (merged: both sides)")
    sm.add_argument("--matrices", action="store_true", help="a line per matrix too")
    st = sub.add_parser("stages", help="per part of a step, its median ms: a "
                                       "column per file (before/after)")
    st.add_argument("files", nargs="+", help="trace files (merged: both sides)")
    args = p.parse_args(argv)
    if args.command == "stages":
        try:
            print(stages_table({path: stages(load(path)) for path in args.files}))
        except (OSError, ValueError) as e:
            print(f"dmuon.trace stages: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "summary":
        try:
            print(summary(load(args.file), args.matrices))
        except (OSError, ValueError) as e:
            print(f"dmuon.trace summary: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        merged = merge_files(args.out, args.inputs, align_wall=args.align == "wall")
    except (OSError, ValueError) as e:
        print(f"dmuon.trace merge: {e}", file=sys.stderr)
        return 2
    n = sum(1 for e in merged["traceEvents"] if e.get("ph") in ("X", "i"))
    print(f"{args.out}: {n} events from {len(args.inputs)} files; open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
