"""rounds.combine: a point measured several times becomes one point whose
ratios are the medians of its rounds' own (paired) ratios, on fresh
random rounds checked against statistics.median of what each round says."""

import os
import random
import statistics
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import rounds  # noqa: E402


def _round(rng, model="gpt-4l-384", tokens=1024, pair=True):
    """One measure() output's shape, with random times; ratios as
    point._ratios computes them."""
    bound = rng.uniform(300, 600)
    res = {}
    adamw = rng.uniform(300, 600)
    for kind, it in (("adamw", adamw), ("muon-fp32", rng.uniform(600, 1200)),
                     ("dmuon-forward", rng.uniform(300, 700))):
        res[kind] = {"iteration_ms": it, "vs_bound": it / bound, "vs_adamw": it / adamw,
                     "periods_ms": [it], "losses": [3.0, 2.0], "final_loss": 2.0}
    res["dmuon-forward"]["loss_rel_diff_vs_muon_fp32"] = rng.uniform(0, 1e-7)
    res["dmuon-forward"]["bound_in_run_ms"] = b = rng.uniform(300, 600)
    res["dmuon-forward"]["vs_bound_in_run"] = res["dmuon-forward"]["iteration_ms"] / b
    out = {"model": model, "tokens": tokens, "bound_ms": bound,
           "forward_backward_ms": rng.uniform(200, 400), "ns_ms": rng.uniform(200, 400),
           "ns_over_fb": rng.uniform(0.5, 2), "after_backward_ms": rng.uniform(1, 5),
           "profile_iteration_ms": rng.uniform(300, 500), "torch_fp32_ns_ms": 1.0,
           "profile": {"matrices": []}, "results": res}
    if pair:
        pb = [rng.uniform(500, 900), rng.uniform(500, 900)]
        out["pair"] = {"bound_ms": pb, "results": {
            k: [{"iteration_ms": rng.uniform(500, 1000), "final_loss": 2.0},
                {"iteration_ms": rng.uniform(500, 1000), "final_loss": 2.0}]
            for k in ("adamw", "dmuon-forward")}}
    return out


@pytest.mark.parametrize("seed", range(20))
def test_ratios_are_medians_of_each_rounds_own(seed):
    rng = random.Random(seed)
    n = rng.choice((2, 3, 5))
    rs = [_round(rng) for _ in range(n)]
    p = rounds.combine(rs)
    assert p["rounds"] == rs and (p["model"], p["tokens"]) == ("gpt-4l-384", 1024)
    assert p["bound_ms"] == statistics.median(r["bound_ms"] for r in rs)
    assert p["bound_ms_rounds"] == [r["bound_ms"] for r in rs]
    for kind in ("adamw", "muon-fp32", "dmuon-forward"):
        got = p["results"][kind]
        for key in ("iteration_ms", "vs_bound", "vs_adamw"):
            each = [r["results"][kind][key] for r in rs]
            assert got[key] == statistics.median(each) and got[key + "_rounds"] == each
        # Paired: each round's iteration over that round's bound.
        assert got["vs_bound_rounds"] == [r["results"][kind]["iteration_ms"] / r["bound_ms"]
                                          for r in rs]
    d = p["results"]["dmuon-forward"]
    assert d["loss_rel_diff_vs_muon_fp32"] == max(
        r["results"]["dmuon-forward"]["loss_rel_diff_vs_muon_fp32"] for r in rs)
    assert d["vs_bound_in_run"] == statistics.median(
        r["results"]["dmuon-forward"]["vs_bound_in_run"] for r in rs)
    assert "vs_bound_in_run" not in p["results"]["adamw"]
    # The pair: the slower trainer against the pair's bound, per round.
    for kind in ("adamw", "dmuon-forward"):
        each = [max(t["iteration_ms"] for t in r["pair"]["results"][kind])
                / max(r["pair"]["bound_ms"]) for r in rs]
        assert p["pair"]["vs_bound_rounds"][kind] == each
        assert p["pair"]["vs_bound"][kind] == statistics.median(each)
        for k in range(2):
            assert p["pair"]["results"][kind][k]["iteration_ms"] == statistics.median(
                r["pair"]["results"][kind][k]["iteration_ms"] for r in rs)


def test_the_median_of_ratios_is_not_the_ratio_of_medians():
    # Round 2's machine is slow for everything; its ratio is still 1.0.
    rs = [_round(random.Random(k), pair=False) for k in range(3)]
    for r, (it, b) in zip(rs, ((110, 100), (400, 400), (120, 100))):
        r["bound_ms"] = b
        r["results"]["dmuon-forward"].update(iteration_ms=it, vs_bound=it / b)
    got = rounds.combine(rs)["results"]["dmuon-forward"]
    assert got["vs_bound"] == pytest.approx(1.1)
    assert got["iteration_ms"] / statistics.median([100, 400, 100]) == pytest.approx(1.2)


def test_one_round_is_the_point_itself():
    r = _round(random.Random(0))
    assert rounds.combine([r]) is r


def test_rounds_of_different_points_are_refused():
    rng = random.Random(1)
    with pytest.raises(ValueError, match="not of one point"):
        rounds.combine([_round(rng), _round(rng, tokens=384)])


def test_what_some_rounds_lack_is_left_out_and_named():
    rng = random.Random(2)
    rs = [_round(rng, pair=False) for _ in range(3)]
    # muon-fp32 skipped in one round (as muon-bf16's timed skip can be).
    del rs[1]["results"]["muon-fp32"]
    rs[1]["skipped"] = {"muon-fp32": "too slow here"}
    # One round without the bound with dmuond's own Newton-Schulz.
    del rs[2]["results"]["dmuon-forward"]["vs_bound_in_run"]
    del rs[2]["results"]["dmuon-forward"]["bound_in_run_ms"]
    p = rounds.combine(rs)
    assert set(p["results"]) == {"adamw", "dmuon-forward"}
    assert p["skipped"]["muon-fp32"] == "measured in 2 of 3 rounds only (too slow here)"
    d = p["results"]["dmuon-forward"]
    for key in ("vs_bound_in_run", "bound_in_run_ms"):
        assert key not in d and key + "_rounds" not in d
    assert "vs_bound_rounds" in d  # the rest stays


def test_per_step_counts_are_medians():
    rng = random.Random(3)
    rs = [_round(rng, pair=False) for _ in range(3)]
    for r, faults in zip(rs, (5.0, 900.0, 7.0)):
        r["profile_per_step"] = {"minor_faults": faults, "voluntary_switches": 1.0}
        for x in r["results"].values():
            x["per_step"] = {"minor_faults": faults + 1, "voluntary_switches": 2.0}
    p = rounds.combine(rs)
    assert p["profile_per_step"] == {"minor_faults": 7.0, "voluntary_switches": 1.0}
    assert p["results"]["adamw"]["per_step"] == {"minor_faults": 8.0,
                                                 "voluntary_switches": 2.0}


def test_rounds_flag_is_checked():
    import run

    assert run.parse_args(["--rounds=3", "--no-pair"])[0].rounds == 3
    with pytest.raises(SystemExit):
        run.parse_args(["--rounds=0"])
