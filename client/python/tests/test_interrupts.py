"""KeyboardInterrupt and exceptions anywhere in backward or step() leave
DMuon usable, and the steps after them equal torch.optim.Muon (fp32
Newton–Schulz) + AdamW doing the same thing (client/python/README.md,
"Interrupts and exceptions"): a step interrupted before it commits is
rolled back, one interrupted after it is completed."""

import contextlib
import os
import signal

import pytest
import torch
from torch import nn

from dmuon import _handoff, _recovery
from dmuon.optim import DMuon
from helpers import MLP, loss_of, mlp_batch
from torch_ref import DM_ADAMW, MUON, ADAMW, assert_same, fp32_muon, pair

pytestmark = pytest.mark.timeout(60)
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Boom(Exception):
    pass


def _optimizers(monkeypatch, ref, dm, address, **kw):
    mats = [p for p in ref.parameters() if p.dim() == 2]
    others = [p for p in ref.parameters() if p.dim() != 2]
    muon = fp32_muon(monkeypatch)(mats, **MUON)
    adamw = torch.optim.AdamW(others, **ADAMW)
    return (muon, adamw), DMuon(dm, **MUON, **DM_ADAMW, server=address, **kw)


class Injector:
    """Raises `exc` once, the first time it is armed and called."""

    def __init__(self, exc):
        self.exc, self.armed = exc, False

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            raise self.exc


def _hook(model, where, inject):
    """Installs `inject` at `where`; returns a function to call on the loss
    (for the loss-gradient hook) or None."""
    if where == "forward hook fc2":
        model.fc2.register_forward_hook(lambda m, i, o: inject())
    elif where == "backward hook fc3 (before any hand-off)":
        model.fc3.register_full_backward_pre_hook(lambda m, go: inject())
    elif where == "backward hook fc2 (mid-way)":
        model.fc2.register_full_backward_hook(lambda m, gi, go: inject())
    elif where == "grad hook fc1.weight (after all)":
        model.fc1.weight.register_hook(lambda g: inject())
    elif where == "grad hook fc2.bias":
        model.fc2.bias.register_hook(lambda g: inject())
    elif where == "grad hook on the loss":
        return lambda loss: loss.register_hook(lambda g: inject())
    return None


WHERE = ["forward hook fc2", "backward hook fc3 (before any hand-off)",
         "backward hook fc2 (mid-way)", "grad hook fc1.weight (after all)",
         "grad hook fc2.bias", "grad hook on the loss"]


@pytest.mark.parametrize("then,exc", [("zero_grad", KeyboardInterrupt), ("again", Boom)],
                         ids=["ctrl-c,zero_grad", "exception,again"])
@pytest.mark.parametrize("where", WHERE)
def test_interrupted_backward_is_rolled_back(monkeypatch, daemon, where, then, exc):
    """At step 2 the backward raises at `where`; the loop catches it and
    either zero_grads and goes on, or runs the batch again on top of the
    partial gradients. torch's optimizers see the same .grad at step()."""
    ref, dm = pair(MLP, seed=3)
    (muon, adamw), opt = _optimizers(monkeypatch, ref, dm, daemon.address)
    injectors, on_loss = [], []
    for model in (ref, dm):
        inj = Injector(exc())
        injectors.append(inj)
        on_loss.append(_hook(model, where, inj))
    for step in range(5):
        for k, (model, stepper) in enumerate(
                ((ref, lambda: (muon.step(), adamw.step())), (dm, opt.step))):
            zero = (lambda: (muon.zero_grad(), adamw.zero_grad())) if k == 0 else opt.zero_grad
            batch = mlp_batch(step)
            if step == 2:
                injectors[k].armed = True
                with pytest.raises(exc):
                    loss = loss_of(model, batch)
                    if on_loss[k]:
                        on_loss[k](loss)
                    loss.backward()
                assert not injectors[k].armed
                if then == "zero_grad":
                    zero()
            loss_of(model, batch).backward()
            stepper()
            zero()
        assert_same(ref, dm, step)
    # Still a normal optimizer: a checkpoint, then on.
    assert opt.state_dict()["dmuon"]["completed_steps"] == 5
    opt.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, Boom], ids=["ctrl-c", "exception"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_interrupted_before_commit_is_rolled_back(monkeypatch, daemon, exc, overlap):
    """An interrupt in step() before it commits (here: as AdamW begins)
    leaves the step undone: parameters, AdamW and dmuond's momentum as
    before; calling step() again takes it whole."""
    ref, dm = pair(MLP, seed=4)
    (muon, adamw), opt = _optimizers(monkeypatch, ref, dm, daemon.address, overlap=overlap)
    real = opt._adamw.step
    inj = Injector(exc())
    monkeypatch.setattr(opt._adamw, "step", lambda *a, **k: (inj(), real(*a, **k))[1])
    for step in range(4):
        loss_of(ref, mlp_batch(step)).backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
        loss_of(dm, mlp_batch(step)).backward()
        if step == 1:
            before = [p.detach().clone() for p in dm.parameters()]
            inj.armed = True
            with pytest.raises(exc):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, dm.parameters()))
        opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)
    assert opt.stats["voided_steps"] == 1
    opt.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, Boom], ids=["ctrl-c", "exception"])
@pytest.mark.parametrize("overlap_forward", [False, True], ids=["step", "overlap_forward"])
@pytest.mark.parametrize("mode", [False, True], ids=["native", "function-mode"])
def test_interrupted_after_commit_is_completed(monkeypatch, daemon, exc, overlap_forward,
                                               mode):
    """An interrupt while the updates are applied (in step(), or in the next
    forward's pre-hooks with overlap_forward) is completed by the next call:
    each parameter's update lands exactly once. Plain tensors are written by
    one native call (a Ctrl-C lands after it); under a TorchFunctionMode
    (`mode`: torch.device("cpu") as a context), whose Python code could
    take a Ctrl-C between torch's two ops, by the deferred_sigint path."""
    ref, dm = pair(MLP, seed=5)
    (muon, adamw), opt = _optimizers(monkeypatch, ref, dm, daemon.address,
                                     overlap_forward=overlap_forward)
    real = opt._handoff.apply
    calls = {"n": 0, "at": None}

    def apply(i):
        calls["n"] += 1
        if calls["at"] is not None and calls["n"] == calls["at"]:
            # as the parameter's update is written: a Ctrl-C inside the write
            # is raised at its end, an error after it
            monkeypatch.setattr(opt._handoff, "write", write_then_raise)
        real(i)

    real_write = opt._handoff.write
    real_native = opt._handoff.apply_update
    paths = []  # the write path the Ctrl-C came in

    @contextlib.contextmanager
    def sigint_inside():
        paths.append("deferred_sigint")
        with _recovery.deferred_sigint():
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C as the write starts
            yield

    def native_then_sigint(*args):
        paths.append("native")
        real_native(*args)
        signal.raise_signal(signal.SIGINT)  # came during the call: raised after

    def write_then_raise(i, p, u, lr, wd):
        monkeypatch.setattr(opt._handoff, "write", real_write)
        if exc is KeyboardInterrupt:
            # Python's own handler, whatever this process inherited (a
            # background job starts with SIGINT ignored).
            saved = signal.signal(signal.SIGINT, signal.default_int_handler)
            monkeypatch.setattr(_handoff, "deferred_sigint", sigint_inside)
            monkeypatch.setattr(opt._handoff, "apply_update", native_then_sigint)
            try:
                real_write(i, p, u, lr, wd)  # raises at its end, p written
            finally:
                monkeypatch.setattr(_handoff, "deferred_sigint",
                                    _recovery.deferred_sigint)
                monkeypatch.setattr(opt._handoff, "apply_update", real_native)
                signal.signal(signal.SIGINT, saved)
        else:
            real_write(i, p, u, lr, wd)
            raise exc()

    monkeypatch.setattr(opt._handoff, "apply", apply)
    with torch.device("cpu") if mode else contextlib.nullcontext():
        for step in range(4):
            loss_of(ref, mlp_batch(step)).backward()
            muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
            if overlap_forward and step == 3:  # step 2's updates, in this forward
                calls["n"], calls["at"] = 0, 2
                with pytest.raises(exc):  # in fc2's pre-hook, fc2.weight written
                    loss_of(dm, mlp_batch(step))
            loss_of(dm, mlp_batch(step)).backward()
            if not overlap_forward and step == 2:
                calls["n"], calls["at"] = 0, 2
                with pytest.raises(exc):
                    opt.step()
            else:
                opt.step()
            calls["at"] = None
            opt.zero_grad()
            if overlap_forward and step == 2:
                continue  # its updates: in step 3's forward
            opt.synchronize()
            assert_same(ref, dm, step)
    opt.close()
    want = ["deferred_sigint" if mode else "native"] if exc is KeyboardInterrupt else []
    assert paths == want


def test_apply_update_is_whole_when_ctrl_c_comes_during_it():
    """_dmuon.apply_update, DMuon's write of an update: a SIGINT sent while
    it runs (from another thread, a few ms into a ~50 ms call) is raised
    after it, with the parameter fully updated, bit for bit as torch's two
    ops give, and marked applied; never half-way. Where the signal lands
    depends on timing, so the check is the invariant, which holds wherever
    it lands: untouched and not marked, or updated and marked."""
    import threading
    import time

    from dmuon import _native

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    p0 = torch.randn(4096, 4096, generator=g)
    u = torch.randn(4096, 4096, generator=g)
    want = p0.clone().mul_(1 - 0.02 * 0.1).add_(u, alpha=-0.02)
    p, applied = p0.clone(), [False]
    start = threading.Event()

    def ctrl_c():
        start.wait()
        time.sleep(0.003)
        os.kill(os.getpid(), signal.SIGINT)

    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=ctrl_c)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            start.set()
            _native.load().apply_update(p, u, 1 - 0.02 * 0.1, -0.02, applied, 0)
            time.sleep(1)  # the signal, if the call was faster than it
    finally:
        t.join()
        signal.signal(signal.SIGINT, saved)
    if applied[0]:
        assert torch.equal(p.view(torch.int32), want.view(torch.int32))
    else:
        assert torch.equal(p.view(torch.int32), p0.view(torch.int32))
    with pytest.raises(IndexError, match="applied"):
        _native.load().apply_update(p, u, None, -0.02, applied, 1)


class _CtrlCAfterHandOff:
    """The real session, with a SIGINT raised as its `at`-th hand_off()
    returns: what a Ctrl-C arriving during the native call gives (Python
    raises it after the call: the entry copied, declared and marked handed
    by then)."""

    def __init__(self, real, at):
        self._real, self._at, self.calls = real, at, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def hand_off(self, *args):
        out = self._real.hand_off(*args)
        self.calls += 1
        if self.calls == self._at:
            signal.raise_signal(signal.SIGINT)
        return out


def test_ctrl_c_during_the_native_hand_off_is_rolled_back(monkeypatch, daemon):
    """A Ctrl-C during backward's second hand-off (Session.hand_off: copy,
    declaration and `handed` in one call) interrupts that backward; its
    step is rolled back like any interrupted backward's, and after
    zero_grad() the loop equals torch's optimizers, which never saw it."""
    ref, dm = pair(MLP, seed=7)
    (muon, adamw), opt = _optimizers(monkeypatch, ref, dm, daemon.address)
    link = opt._handoff.link
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for step in range(4):
            loss_of(ref, mlp_batch(step)).backward()
            muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
            if step == 2:
                proxy = link.session = _CtrlCAfterHandOff(link.session, at=2)
                with pytest.raises(KeyboardInterrupt):
                    loss_of(dm, mlp_batch(step)).backward()
                assert proxy.calls == 2 and sum(opt._handoff.handed) == 2
                if link.session is proxy:
                    link.session = proxy._real
                opt.zero_grad()
            loss_of(dm, mlp_batch(step)).backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            assert_same(ref, dm, step)
    finally:
        signal.signal(signal.SIGINT, saved)
    assert opt.stats["voided_steps"] == 1
    opt.close()


def test_stored_handoff_error_rolls_back_and_the_loop_goes_on(monkeypatch, daemon):
    """A hand-off error inside backward (stored, raised by step()) used to
    leave the step's gradients with dmuond and every later backward failing
    with the same error; now that step is rolled back."""
    ref, dm = pair(MLP, seed=6)
    (muon, adamw), opt = _optimizers(monkeypatch, ref, dm, daemon.address)
    for step in range(4):
        loss_of(ref, mlp_batch(step)).backward()
        if step != 1:
            muon.step(), adamw.step()
        muon.zero_grad(), adamw.zero_grad()
        loss_of(dm, mlp_batch(step)).backward()
        if step == 1:
            opt._handoff.error = RuntimeError("injected hand-off failure")
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
        assert_same(ref, dm, step)
    opt.close()


TRAINER = """
import os, signal, sys, time, torch
# Python's Ctrl-C handler, as in a terminal, even when this test runs in a
# background job (which starts its children with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, %r)
from dmuon.optim import DMuon
# One intra-op thread: a SIGINT that lands in an MKL gemm's OpenMP barrier
# hangs plain torch too (torch 2.15, libgomp), with or without DMuon.
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
opt = DMuon(model, lr=0.02)
d = opt._handoff.link.daemon
print(d.pid, flush=True)
interrupted, step = 0, 0
while interrupted < 3 or step < 5:
    try:
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            print("ready", flush=True)
    except KeyboardInterrupt:
        interrupted += 1
        step = 0
        assert d.alive(), "the private dmuond got the SIGINT"
        print("interrupted", flush=True)
        sd = opt.state_dict()  # a checkpoint on Ctrl-C, whatever was cut short
sd = opt.state_dict()
print("done", d.alive(), sd["dmuon"]["completed_steps"] > 0,
      opt.stats.get("voided_steps", 0) >= 0, flush=True)
opt.close()
""" % PKG


def test_ctrl_c_to_the_process_group_anywhere_in_the_loop():
    """SIGINT to the trainer's process group (what Ctrl-C sends), three
    times at random points of the loop (each once it trains again): the trainer sees KeyboardInterrupt
    each time, the private dmuond (its own session) survives, and the loop
    goes on (state_dict() right away, then steps)."""
    import signal
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        int(p.stdout.readline())
        assert p.stdout.readline().strip() == "ready"
        for k in range(3):
            os.killpg(p.pid, signal.SIGINT)
            assert p.stdout.readline().strip() == "interrupted"
            if k < 2:  # training again (3 steps) before the next one
                assert p.stdout.readline().strip() == "ready"
        out, err = p.communicate(timeout=40)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert out.split()[-3:] == ["True", "True", "True"], (out, err)
