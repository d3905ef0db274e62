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
a final loss's difference from torch's: the largest), the rounds' ratios
listed beside it ("*_rounds"), and every round whole under "rounds".
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


def _median_of(records: list[dict], key: str) -> tuple[float, list[float]] | None:
    values = [r[key] for r in records if key in r]
    if len(values) != len(records):
        return None  # not in every round: left out rather than half-summarized
    return statistics.median(values), values


def _result(records: list[dict]) -> dict:
    """One optimizer's rounds as one result (the first round's losses and
    periods stay as they were: the same batches and weights each round)."""
    out = dict(records[0])
    for key in _RESULT_MEDIANS:
        got = _median_of(records, key)
        if got is not None:
            out[key], out[key + "_rounds"] = got
    diffs = [r["loss_rel_diff_vs_muon_fp32"] for r in records
             if "loss_rel_diff_vs_muon_fp32" in r]
    if diffs:
        out["loss_rel_diff_vs_muon_fp32"] = max(diffs)
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


def combine(rounds: list[dict]) -> dict:
    """The point measured by `rounds` (each measure()'s output for the same
    model and tokens, with the same optimizers), as the module docstring
    says. One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    first = rounds[0]
    for r in rounds[1:]:
        if (r["model"], r["tokens"]) != (first["model"], first["tokens"]) or \
                set(r["results"]) != set(first["results"]):
            raise ValueError("rounds.combine: the rounds are not of one point "
                             f"({first['model']} {first['tokens']} vs {r['model']} "
                             f"{r['tokens']}, or other optimizers)")
    out = {k: v for k, v in first.items() if k not in ("results", "pair")}
    for key in _POINT_MEDIANS:
        got = _median_of(rounds, key)
        if got is not None:
            out[key], out[key + "_rounds"] = got
    out["results"] = {kind: _result([r["results"][kind] for r in rounds])
                      for kind in first["results"]}
    if all("pair" in r for r in rounds):
        out["pair"] = _pair([r["pair"] for r in rounds])
    out["rounds"] = rounds
    return out
