"""No silent fallbacks (docs/design.md "Fallbacks"), with real dmuond
processes: each of DMuon's kinds provoked and counted in
opt.stats["fallbacks"], warned once, and refused by strict=True; dmuond's
count of the rewinds it performed in `dmuonctl status`, /metrics and its log
(one line). host_staging needs CUDA parameters, so its host-side logic is
driven here with a stand-in client (the GPU run: test_gpu_transports.py)."""

import json
import os
import subprocess
import urllib.request
import warnings

import pytest
import torch
from torch import nn

import dmuon
from dmuon import _fallbacks, _session
from dmuon.optim import DMuon
from helpers import MLP, loss_of, mlp_batch, max_rel_err
from ranks import free_port

pytestmark = pytest.mark.timeout(90)
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CTL = os.path.join(ROOT, "bazel-bin", "daemon", "dmuonctl")
ZERO = {k: 0 for k in _fallbacks.KINDS}


def _fallback_warnings(caught, kind):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and f"fallback '{kind}'" in str(w.message)]


def _train(model, opt, steps, edit=None, backwards=1, seed=0):
    for s in range(steps):
        x, y = mlp_batch(seed + s, n=32)
        for k in range(backwards):
            (loss_of(model, (x[k::backwards], y[k::backwards])) / backwards).backward()
        if edit is not None:
            edit(model)
        opt.step()
        opt.zero_grad()


def _clip(model):
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # clips every step


def _daemon_counts(d, metrics_port):
    """dmuond's fallback counts from dmuonctl status --json, checked equal
    to the text table's line and to /metrics."""
    out = subprocess.run([CTL, f"--server={d.address}", "--json", "status"],
                         check=True, capture_output=True, text=True).stdout
    counts = {k: int(v) for k, v in json.loads(out)["fallbacks"].items()}
    text = subprocess.run([CTL, f"--server={d.address}", "status"], check=True,
                          capture_output=True, text=True).stdout
    line = "FALLBACKS" + "".join(f"  {k}={v}" for k, v in sorted(counts.items()))
    assert line in text, text
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
        metrics = r.read().decode()
    for k, v in counts.items():
        assert f'dmuon_fallbacks_total{{kind="{k}"}} {v}' in metrics, metrics
    return counts


@pytest.mark.parametrize("strict_daemon", [False, True])
def test_redo_counted_warned_once_and_dmuond_counts_its_rewinds(strict_daemon):
    """Clipping after backward: every step redone (rewound and handed off
    again). DMuon counts "redo" and warns once; dmuond counts a "rewind" per
    step, logs it once, and, with --strict, still rewinds (the client asked:
    refusing would leave weights and momentum a step apart)."""
    port = free_port()
    flags = [f"--metrics-port={port}"] + (["--strict"] if strict_daemon else [])
    with dmuon.LocalDaemon(flags=flags, stop_grace=1.0) as d:
        assert _daemon_counts(d, port) == {"graph_eager": 0, "rewind": 0,
                                           "unhealthy_executor": 0}
        torch.manual_seed(1)
        model, ref = MLP(), MLP()
        ref.load_state_dict(model.state_dict())
        steps = 2 + int(torch.randint(0, 3, ()).item())
        opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(server=d.address))
        # The oracle: gradients handed off at step(), after the edit (no redo).
        o_ref = DMuon(ref, lr=0.02, daemon_options=dmuon.DaemonOptions(server=d.address),
                      overlap_options=dmuon.OverlapOptions(backward=False))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, opt, steps, edit=_clip)
        _train(ref, o_ref, steps, edit=_clip)
        assert max_rel_err(model, ref) < 1e-5
        assert opt.stats["fallbacks"] == dict(ZERO, redo=steps)
        assert o_ref.stats["fallbacks"] == ZERO
        said = _fallback_warnings(caught, "redo")
        assert len(said) == 1, said
        assert "changed after it was handed to dmuond" in said[0], said
        assert _daemon_counts(d, port)["rewind"] == steps
        opt.close()
        o_ref.close()
        with open(d.log_path) as f:
            lines = [ln for ln in f if "fallback rewind:" in ln]
        assert len(lines) == 1, lines
        assert "rewound its completed step" in lines[0], lines


def test_second_backward_counts_a_rewind(daemon):
    """Two backwards before step() (accumulation without no_sync): the first
    step's hand-off is rewound once, counted as "rewind" (not "redo")."""
    torch.manual_seed(2)
    model = MLP()
    opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(server=daemon.address))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, 3, backwards=2)
    assert opt.stats["fallbacks"] == dict(ZERO, rewind=1)
    assert opt.stats["rewound_steps"] == 1
    assert len(_fallback_warnings(caught, "rewind")) == 1
    opt.close()


def test_strict_refuses_redo_and_rewind_and_leaves_the_weights(daemon):
    torch.manual_seed(3)
    model = MLP()
    opt = DMuon(model, lr=0.02, daemon_options=dmuon.DaemonOptions(server=daemon.address),
                strict=True)
    _train(model, opt, 1)  # a plain step takes no fallback
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = mlp_batch(7, n=32)
    loss_of(model, (x, y)).backward()
    _clip(model)
    with pytest.raises(RuntimeError, match=r"strict=True\) refuses the fallback 'redo'.*"
                       r"OverlapOptions\(backward=False\)"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # the step was voided
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"refuses the fallback 'rewind'.*no_sync"):
        _train(model, opt, 1, backwards=2)
    assert opt.stats["fallbacks"] == ZERO
    opt.close()


def test_private_daemon_counted_and_refused_when_strict(daemon, monkeypatch):
    monkeypatch.delenv(_session.ENV, raising=False)
    model = nn.Linear(8, 8, bias=False)
    with pytest.raises(RuntimeError, match=r"'private_daemon'.*DMUON_SERVER"):
        DMuon(model, lr=0.02, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DMuon(model, lr=0.02)
    assert opt._handoff.link.daemon is not None
    assert opt.stats["fallbacks"] == dict(ZERO, private_daemon=1)
    assert len(_fallback_warnings(caught, "private_daemon")) == 1
    opt.close()
    # $DMUON_SERVER set: no fallback, strict or not.
    monkeypatch.setenv(_session.ENV, daemon.address)
    opt = DMuon(model, lr=0.02, strict=True)
    assert opt._handoff.link.daemon is None
    assert opt.stats["fallbacks"] == ZERO
    opt.close()


class _StandInClient:
    """What _session._open calls of a Client, recorded (no daemon)."""

    def __init__(self):
        self.opened = []

    def open_session(self, job_id, table, groups, **kw):
        self.opened.append(kw["transport"])
        return "session"


def test_host_staging_of_cuda_parameters_is_a_fallback():
    """CUDA parameters with transport="auto" and a pool of daemons are staged
    through host memory: counted (the loud warning is warn_cuda_staged's),
    and refused under strict before any session opens."""
    cuda = torch.device("cuda", 0)
    pool = ["127.0.0.1:1", "127.0.0.1:2"]
    stats = {}
    client = _StandInClient()
    got = _session._open(client, pool, "j", [], [], 0, 1, "auto", cuda,
                         fallback=_fallbacks.Fallbacks(stats).take)
    assert got[0] == "session" and got[1] is None and "host memory" in got[2]
    assert client.opened == ["auto"]
    assert stats["fallbacks"] == dict(ZERO, host_staging=1)
    strict = _fallbacks.Fallbacks({}, strict=True)
    with pytest.raises(RuntimeError, match=r"'host_staging'.*dmuond_cuda"):
        _session._open(client, pool, "j", [], [], 0, 1, "auto", cuda,
                       fallback=strict.take)
    assert client.opened == ["auto"]  # nothing opened


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be a bool"):
        DMuon(nn.Linear(4, 4), strict=1)
