"""The GPU check's training run: a small GPT-style transformer on CUDA,
trained with dmuon.optim.DMuon (through dmuond_cuda over CUDA IPC) in
lockstep with torch.optim.Muon (torch's own, bf16 Newton-Schulz) and with
the fp32 Muon of char_gpt.py, from one initialization on the same batches;
then each optimizer timed on its own, torch.optim.AdamW(fused=True) too.

Per step it records the relative distance ||W_dmuon - W_ref|| / ||W_ref||
over the Muon matrices, and the losses. Pass: DMuon stays within bf16
tolerance of torch.optim.Muon at every step (--tol, default 2e-2 relative;
torch's NS runs in bf16) and closer to the fp32 reference than that.

--out is rewritten after every lockstep step and every timing phase (and
with "error" when something raises), so a crash or a timeout keeps what was
measured; "done" is true once the run ended.

  python3 torch_train.py --dmuond bin/dmuond_cuda --out OUT/train.json
(python/ of the bundle on PYTHONPATH and $DMUON_EXTENSION_DIR set: run.sh)
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in (os.path.join(_HERE, "python"),  # the bundle
           os.path.join(_HERE, "..", "..", "client", "python")):  # a checkout
    if os.path.isdir(os.path.join(_d, "examples")):
        sys.path[:0] = [_d, os.path.join(_d, "examples")]
        break
import char_gpt  # noqa: E402

MUON, ADAMW = char_gpt.MUON, char_gpt.ADAMW
KINDS = ("dmuon", "torch_muon", "fp32_muon")  # trained in lockstep
TIMED = ("adamw_fused", "torch_muon", "dmuon")


def build(kind, model, flags):
    """The optimizers of one run (char_gpt's, plus torch's own two)."""
    if kind == "adamw_fused":
        return [torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)]
    if kind == "torch_muon":
        mats = model.matrices()
        ids = {id(p) for p in mats}
        others = [p for p in model.parameters() if id(p) not in ids]
        return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(others, **ADAMW)]
    if kind == "fp32_muon":
        return [char_gpt.make_optimizer("muon", model)]
    if kind == "dmuon":
        return [char_gpt.make_optimizer("dmuon", model, daemon_flags=flags)]
    raise ValueError(kind)


def fresh(corpus, args):
    torch.manual_seed(0)
    return char_gpt.GPT(corpus.vocab, d=args.width, layers=args.layers).to(args.device)


def sync(args):
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def one_step(model, opts, x, y):
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    return loss.item()


@torch.no_grad()
def distance(a, b):
    num = sum(float((p - q).float().norm() ** 2) for p, q in zip(a, b)) ** 0.5
    den = sum(float(q.float().norm() ** 2) for q in b) ** 0.5
    return num / max(den, 1e-30)


def save(result, path):
    """Writes `result` whole through a temporary and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def lockstep(corpus, args, flags, result):
    """Trains KINDS from one initialization on the same batches; appends each
    step's row to result["steps"] and saves it."""
    models = {k: fresh(corpus, args) for k in KINDS}
    opts = {k: build(k, models[k], flags) for k in KINDS}
    result["transport"] = opts["dmuon"][0].transport
    rows = result.setdefault("steps", [])
    try:
        for s in range(args.steps):
            x, y = corpus.batch(s, batch=args.batch)
            losses = {k: one_step(models[k], opts[k], x, y) for k in KINDS}
            mats = {k: models[k].matrices() for k in KINDS}
            rows.append(dict(
                step=s + 1, loss=losses,
                vs_torch_muon=distance(mats["dmuon"], mats["torch_muon"]),
                vs_fp32=distance(mats["dmuon"], mats["fp32_muon"]),
                torch_vs_fp32=distance(mats["torch_muon"], mats["fp32_muon"])))
            result["worst"] = max(r["vs_torch_muon"] for r in rows)
            result["worst_vs_fp32"] = max(r["vs_fp32"] for r in rows)
            result["worst_torch_vs_fp32"] = max(r["torch_vs_fp32"] for r in rows)
            save(result, args.out)
    finally:
        opts["dmuon"][0].close()


def timed(kind, corpus, args, flags):
    """Median step() and iteration times of `kind` trained on its own."""
    model = fresh(corpus, args)
    opts = build(kind, model, flags)
    try:
        return timed_steps(model, opts, corpus, args)
    finally:
        if kind == "dmuon":
            opts[0].close()


def timed_steps(model, opts, corpus, args):
    step_t, iter_t = [], []
    for s in range(args.warmup + args.timed):
        x, y = corpus.batch(s, batch=args.batch)
        sync(args)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        sync(args)
        t1 = time.perf_counter()
        for o in opts:
            o.step()
        sync(args)
        t2 = time.perf_counter()
        for o in opts:
            o.zero_grad()
        if s >= args.warmup:
            step_t.append(t2 - t1)
            iter_t.append(t2 - t0)
    return dict(step_ms=1e3 * statistics.median(step_t),
                iter_ms=1e3 * statistics.median(iter_t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dmuond", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timed", type=int, default=20)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a rehearsal of this script (DMuon through a CPU dmuond)")
    args = ap.parse_args()
    os.environ["DMUON_DMUOND"] = args.dmuond
    flags = ["--devices=cuda:0"] if args.device.startswith("cuda") else []
    # Debian's GPL-3 text, else any text this machine surely has (the
    # GPU image need not ship /usr/share/common-licenses).
    text = next(p for p in (char_gpt.CORPUS, os.__file__, __file__) if os.path.isfile(p))
    corpus = char_gpt.Corpus(path=text, device=args.device)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    result = dict(torch=torch.__version__, gpu=gpu, device=args.device, corpus=text,
                  model=dict(width=args.width, layers=args.layers, batch=args.batch,
                             block=64), tolerance=args.tol, reference="vs_torch_muon",
                  done=False)
    save(result, args.out)
    try:
        lockstep(corpus, args, flags, result)
        worst = result["worst"]
        print(f"torch {torch.__version__}, transport {result['transport']}; {args.steps} "
              f"lockstep steps: worst relative distance to torch.optim.Muon {worst:.2e} "
              f"(tolerance {args.tol:.0e}), to fp32 Muon {result['worst_vs_fp32']:.2e}; "
              f"torch.optim.Muon to fp32 {result['worst_torch_vs_fp32']:.2e}")
        t = result["timing"] = {}
        for k in TIMED:
            t[k] = timed(k, corpus, args, flags)
            save(result, args.out)
    except Exception:
        result["error"] = traceback.format_exc()
        result["done"] = True
        save(result, args.out)
        raise
    ok = worst <= args.tol
    result.update({"pass": ok, "done": True})
    save(result, args.out)
    print(f"{'optimizer':<14}{'step() ms':>10}{'iter ms':>10}")
    for k, v in t.items():
        print(f"{k:<14}{v['step_ms']:>10.2f}{v['iter_ms']:>10.2f}")
    print(f"DMuon step / AdamW: {t['dmuon']['step_ms'] / t['adamw_fused']['step_ms']:.2f}x;"
          f" torch_muon / DMuon: {t['torch_muon']['step_ms'] / t['dmuon']['step_ms']:.2f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
