"""`./dmuon bench overlap --rounds N`: one point measured N times in a row,
each round complete (the profiling pass, the kernel timing, every
optimizer's run, the bound), combined into one point.

Why: on a shared machine one run of a point spreads by 10-25 % (the same
kernels on the same core drift between minutes), more than the 5 % the
targets resolve. A round's ratios (an optimizer's iteration against that
round's bound and AdamW's) are measured minutes apart at most, so the
drift between rounds cancels in them; the point's ratio is the median of
its rounds' ratios (paired), not the ratio of two medians.

combine(rounds) -> the point: every field the report and the plot read,
as the median over the rounds (a ratio: the median of the rounds' ratios;
a final loss's difference from torch's: the largest; each per-step count
of faults and switches: the median), the rounds' ratios listed beside it
("*_rounds"), and every round whole under "rounds". A figure some rounds
lack is left out of the point (the rounds keep it); so is an optimizer
some rounds skipped (muon-bf16's skip is decided by a timing each round),
named under "skipped".
"""

from __future__ import annotations

import statistics

# A point's own figures, each the median over the rounds.
_POINT_MEDIANS = ("forward_backward_ms", "ns_ms", "ns_over_fb", "after_backward_ms",
                  "profile_iteration_ms", "bound_ms", "torch_fp32_ns_ms")
# An optimizer's figures: the median over the rounds, and the list as
# "<name>_rounds" (the ratios are each round's own, so paired).
_RESULT_MEDIANS = ("iteration_ms", "vs_bound", "vs_adamw", "bound_in_run_ms",
                   "vs_bound_in_run")


def _set_median(out: dict, records: list[dict], key: str) -> None:
    """out[key] <- the median of the records' (and the list beside it), or
    no out[key] at all when some record lacks it: left out rather than
    one round's figure passed off as the point's."""
    values = [r[key] for r in records if key in r]
    if len(values) != len(records):
        out.pop(key, None)
        out.pop(key + "_rounds", None)
        return
    out[key], out[key + "_rounds"] = statistics.median(values), values


def _counts(records: list[dict]) -> dict | None:
    """The per-step counts (faults, switches): each one's median."""
    if not all(records):
        return None
    return {k: statistics.median(r[k] for r in records) for k in records[0]}


def _result(records: list[dict]) -> dict:
    """One optimizer's rounds as one result (the first round's losses and
    periods stay as they were: the same batches and weights each round)."""
    out = dict(records[0])
    for key in _RESULT_MEDIANS:
        _set_median(out, records, key)
    diffs = [r["loss_rel_diff_vs_muon_fp32"] for r in records
             if "loss_rel_diff_vs_muon_fp32" in r]
    if len(diffs) == len(records):
        out["loss_rel_diff_vs_muon_fp32"] = max(diffs)
    else:
        out.pop("loss_rel_diff_vs_muon_fp32", None)
    steps = _counts([r.get("per_step") for r in records])
    if steps is None:
        out.pop("per_step", None)
    else:
        out["per_step"] = steps
    return out


def _pair(pairs: list[dict]) -> dict:
    """The two-trainer runs: each trainer's median iteration; per kind the
    slower trainer against the pair's bound, per round ("vs_bound_rounds")
    and their median ("vs_bound")."""
    out = {"bound_ms": [statistics.median(p["bound_ms"][k] for p in pairs)
                        for k in range(len(pairs[0]["bound_ms"]))],
           "results": {}, "vs_bound": {}, "vs_bound_rounds": {}}
    for kind in pairs[0]["results"]:
        runs = [p["results"][kind] for p in pairs]
        out["results"][kind] = [_result([r[k] for r in runs]) for k in range(len(runs[0]))]
        worst = [max(t["iteration_ms"] for t in r) / max(p["bound_ms"])
                 for r, p in zip(runs, pairs)]
        out["vs_bound"][kind] = statistics.median(worst)
        out["vs_bound_rounds"][kind] = worst
    return out


def _skipped(rounds: list[dict], kinds: list[str]) -> dict:
    """{kind: why} for the optimizers not measured in every round."""
    out = {}
    for r in rounds:
        for kind, why in r.get("skipped", {}).items():
            out.setdefault(kind, why)
    for kind in {k for r in rounds for k in r["results"]} - set(kinds):
        n = sum(kind in r["results"] for r in rounds)
        why = out.get(kind, "skipped in the others")
        out[kind] = f"measured in {n} of {len(rounds)} rounds only ({why})"
    return out


def combine(rounds: list[dict]) -> dict:
    """The point measured by `rounds` (each measure()'s output for the same
    model and tokens), as the module docstring says. One round is returned
    as it is."""
    if len(rounds) == 1:
        return rounds[0]
    first = rounds[0]
    for r in rounds[1:]:
        if (r["model"], r["tokens"]) != (first["model"], first["tokens"]):
            raise ValueError("rounds.combine: the rounds are not of one point "
                             f"({first['model']} {first['tokens']} vs {r['model']} "
                             f"{r['tokens']})")
    out = {k: v for k, v in first.items() if k not in ("results", "pair", "skipped")}
    for key in _POINT_MEDIANS:
        _set_median(out, rounds, key)
    out["profile_per_step"] = _counts([r.get("profile_per_step") for r in rounds])
    kinds = [k for k in first["results"] if all(k in r["results"] for r in rounds)]
    out["results"] = {kind: _result([r["results"][kind] for r in rounds])
                      for kind in kinds}
    skipped = _skipped(rounds, kinds)
    if skipped:
        out["skipped"] = skipped
    if all("pair" in r for r in rounds):
        out["pair"] = _pair([r["pair"] for r in rounds])
    out["rounds"] = rounds
    return out
