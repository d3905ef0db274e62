"""One point of `./dmuon bench overlap`: a model and a number of tokens per
step, every optimizer trained on the same trainer cores, the critical-path
bound from the same point's measured layer and Newton-Schulz times, and the
losses against fp32-NS torch.optim.Muon's.
"""

from __future__ import annotations

import dataclasses

import bound
import ns_times
import optimizers
import processes


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every point shares: cores, steps."""

    trainer_cpus: str  # as given (trainer.py parses it)
    daemon_cpus: list[int]
    warmup: int
    steps: int
    ns_repeats: int = 5
    # --trace DIR: each DMuon run's step timeline (trainer and dmuond,
    # merged) as DIR/<model>-<tokens>-<optimizer>[-pair].json; None: off.
    trace_dir: str | None = None
    # torch.optim.Muon's bf16 Newton-Schulz slower than its fp32 one by more
    # than this (ns_times.py's probe: torch emulates bf16 products on this
    # CPU) and "muon-bf16" is skipped, its reason in the point's "skipped";
    # None (--optimizers names muon-bf16): run whatever it costs.
    bf16_skip_ratio: float | None = 4.0

    def daemon_cpus_text(self) -> str:
        return ",".join(map(str, self.daemon_cpus))


def _simulated_trainer(profile: dict, ns_seconds: dict) -> bound.Trainer:
    tasks = [(m["segment"], ns_seconds[ns_times.shape_key(m["shape"])])
             for m in profile["matrices"]]
    return bound.Trainer(profile["forward_s"], profile["backward_s"],
                         profile["after_backward_s"], tasks)


def _args(setup: Setup, model: str, tokens: int, **kw) -> list[str]:
    return processes.trainer_args(model, tokens, setup.trainer_cpus, setup.warmup,
                                  setup.steps, **kw)


def _trainers(setup: Setup, model: str, tokens: int, kind: str, count: int) -> list[dict]:
    """`count` trainers of `kind` at once (a daemon of their own for DMuon,
    whose timeline gives each run's "dmuond_ns_seconds": its Newton-Schulz
    per shape as it ran; the trainers' too with --trace)."""
    dmuon = kind in optimizers.DMUON_KINDS
    trace = processes.Trace(setup.trace_dir, f"{model}-{tokens}-{kind}"
                            + ("-pair" if count > 1 else "")) if dmuon else None
    daemon = processes.start_daemon(setup.daemon_cpus, trace) if dmuon else None
    try:
        try:
            server = daemon.address if daemon else None
            started = [processes.start("trainer.py",
                                       _args(setup, model, tokens, optimizer=kind,
                                             server=server),
                                       trace.trainer_env(k) if trace else None)
                       for k in range(count)]
            runs = [processes.wait(s, f"{model} {tokens} tokens, {kind}") for s in started]
        finally:
            if daemon:
                daemon.stop()  # also writes out its timeline
        if trace:
            ns = ns_times.from_trace(trace.daemon_doc(), after_step=setup.warmup)
            for run in runs:
                run["dmuond_ns_seconds"] = ns
        return runs
    finally:
        if trace:
            trace.close(count)


def _summary(run: dict) -> dict:
    return {k: run[k] for k in ("iteration_ms", "periods_ms", "final_loss", "losses",
                                "dmuond_ns_seconds", "per_step") if k in run}


def measure(setup: Setup, model: str, tokens: int, kinds: list[str],
            pair_kinds: list[str] = (), log=print) -> dict:
    """The point's figures (see benchmarks/README.md, "Overlap"). Its own
    Newton-Schulz times, measured next to its runs (a load that changes
    during a sweep changes both)."""
    prof = processes.run_trainer(_args(setup, model, tokens, mode="profile"),
                                 f"{model} {tokens} tokens, profile")
    shapes = sorted({tuple(m["shape"]) for m in prof["matrices"]})
    ns_run = processes.ns_times(setup.daemon_cpus_text(), [list(s) for s in shapes],
                                setup.ns_repeats)
    trainer = _simulated_trainer(prof, ns_run["seconds"])
    ns_torch = sum(ns_run["torch_fp32_seconds"][ns_times.shape_key(m["shape"])]
                   for m in prof["matrices"])
    devices = len(setup.daemon_cpus)
    one = bound.simulate([trainer], devices)
    fb = sum(trainer.forward_s) + sum(trainer.backward_s)
    ns = sum(s for _, s in trainer.tasks)
    out = {
        "model": model, "tokens": tokens,
        "forward_backward_ms": 1000 * fb, "ns_ms": 1000 * ns, "ns_over_fb": ns / fb,
        "after_backward_ms": 1000 * trainer.after_backward_s,
        "profile_iteration_ms": prof["iteration_ms"],
        "profile_per_step": prof.get("per_step"),
        "bound_ms": 1000 * one.iteration_s[0],
        "profile": {k: prof[k] for k in ("forward_s", "backward_s", "after_backward_s",
                                         "matrices")},
        "ns_seconds": ns_run["seconds"],
        "torch_fp32_ns_seconds": ns_run["torch_fp32_seconds"],
        "torch_fp32_ns_ms": 1000 * ns_torch, "openblas_core": ns_run["openblas_core"],
        "torch_bf16_probe": ns_run.get("torch_bf16_probe"),
        "results": {},
    }
    log(f"{model}, {tokens} tokens/step: forward+backward {1000 * fb:.0f} ms, NS "
        f"{1000 * ns:.0f} ms ({ns / fb:.2f}x; OpenBLAS {ns_run['openblas_core']}; "
        f"torch's fp32 NS on that core {1000 * ns_torch:.0f} ms), bound "
        f"{out['bound_ms']:.0f} ms (with free updates {1000 * trainer.work():.0f} ms; "
        f"profiled {prof['iteration_ms']:.0f} ms)")
    skipped = _skipped(setup, ns_run.get("torch_bf16_probe"), kinds)
    if skipped:
        out["skipped"] = skipped
    for kind, why in skipped.items():
        log(f"  {optimizers.LABELS[kind]:<40} skipped: {why}")
    for kind in (k for k in kinds if k not in skipped):
        run = _trainers(setup, model, tokens, kind, 1)[0]
        out["results"][kind] = _summary(run)
        log(f"  {optimizers.LABELS[kind]:<40} {run['iteration_ms']:7.0f} ms")
    _ratios(out["results"], out["bound_ms"])
    _in_run_bounds(out["results"], prof, devices)
    if pair_kinds:
        out["pair"] = _pair(setup, model, tokens, pair_kinds, trainer, log)
    return out


def _in_run_bounds(results: dict, prof: dict, devices: int) -> None:
    """Each DMuon run's bound again with the Newton-Schulz times dmuond took
    in that run (its "dmuond_ns_seconds") in place of the kernel timing's:
    "bound_in_run_ms" and "vs_bound_in_run". The kernel timing runs beside
    the runs, not during them, and on a shared machine the same kernels
    drift by 20 % or more between minutes; this bound moves with the run.
    It is not the issue's bound (the daemon's own slowness counts in it, and
    its spans hold the momentum pass too): both are reported."""
    for r in results.values():
        ns = r.get("dmuond_ns_seconds")
        if not ns or any(ns_times.shape_key(m["shape"]) not in ns
                         for m in prof["matrices"]):
            continue
        sim = bound.simulate([_simulated_trainer(prof, ns)], devices)
        r["bound_in_run_ms"] = 1000 * sim.iteration_s[0]
        r["vs_bound_in_run"] = r["iteration_ms"] / r["bound_in_run_ms"]


def _skipped(setup: Setup, probe: dict | None, kinds: list[str]) -> dict:
    """{kind: why} for the runs this point leaves out: muon-bf16 where
    torch's bf16 Newton-Schulz is emulated (Setup.bf16_skip_ratio)."""
    limit = setup.bf16_skip_ratio
    if "muon-bf16" not in kinds or limit is None or not probe or probe["ratio"] <= limit:
        return {}
    return {"muon-bf16": (
        f"torch's bf16 Newton-Schulz of a {probe['shape']} matrix takes "
        f"{1000 * probe['seconds']:.0f} ms on one core against "
        f"{1000 * probe['fp32_seconds']:.1f} ms in fp32 ({probe['ratio']:.0f}x: this CPU "
        "has no native bf16 matrix products); --optimizers muon-bf16 runs it anyway")}


def _pair(setup: Setup, model: str, tokens: int, kinds: list[str],
          trainer: bound.Trainer, log) -> dict:
    """Two trainers at once on the trainer cores, one dmuond: their
    iterations, and the pair's bound (both simulated sharing the cores)."""
    sim = bound.simulate([trainer, trainer], len(setup.daemon_cpus))
    out = {"bound_ms": [1000 * s for s in sim.iteration_s], "results": {}}
    log(f"  two trainers sharing the trainer cores and one daemon: bound "
        f"{max(out['bound_ms']):.0f} ms each")
    for kind in kinds:
        runs = _trainers(setup, model, tokens, kind, 2)
        out["results"][kind] = [_summary(r) for r in runs]
        log(f"  2 x {optimizers.LABELS[kind]:<36} "
            + " ".join(f"{r['iteration_ms']:7.0f}" for r in runs) + " ms")
    return out


def _ratios(results: dict, bound_ms: float) -> None:
    """Each result's iteration against the bound and AdamW's; its final
    loss against fp32-NS torch Muon's (relative)."""
    adamw = results.get("adamw", {}).get("iteration_ms")
    ref = results.get("muon-fp32", {}).get("final_loss")
    for kind, r in results.items():
        r["vs_bound"] = r["iteration_ms"] / bound_ms
        if adamw:
            r["vs_adamw"] = r["iteration_ms"] / adamw
        if ref is not None and kind not in ("adamw", "muon-fp32"):
            r["loss_rel_diff_vs_muon_fp32"] = abs(r["final_loss"] - ref) / abs(ref)
