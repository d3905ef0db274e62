"""DMuon on DTensor parameters: FSDP2's fully_shard (even, uneven, a rank
holding nothing), tensor parallelism (ColwiseParallel + RowwiseParallel),
FSDP2 x TP and HSDP on 2-D meshes, FSDP2 mixed precision, and Replicate()
DTensors, in 2 or 4 gloo processes on CPU against one dmuond, checked step
by step against torch.optim.Muon (fp32 Newton-Schulz) + torch.optim.AdamW
on the same model unsharded in this process; each rank's blocks (the
routing table's runs), that DMuon makes no DTensor collective for a sharded
matrix, and the layouts DMuon refuses."""

import os
import re
import sys

import pytest
import torch

from helpers import rel_err
from ranks import launch
from torch_ref import muon_adamw_run

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fsdp_worker  # noqa: E402

TOL = 1e-5
MUON_NAMES = ("0.weight", "2.weight", "4.weight")


def run_job(mode, address, tmp_path, world=2, extra=()):
    return launch("fsdp_worker.py", mode, world, address, tmp_path, extra=extra,
                  timeout=150)[0]


def _reference(grads_of, hidden=5):
    """torch.optim.Muon (fp32 Newton-Schulz) + AdamW, unsharded, the
    gradients of each step from grads_of(model, x, y) (they land in .grad):
    the parameters after every step, the gradients of step 1 and 0.weight's
    momentum at the end."""
    steps, grads, momenta = muon_adamw_run(
        fsdp_worker.make_model(hidden), MUON_NAMES, fsdp_worker.STEPS,
        lambda model, s: grads_of(model, *fsdp_worker.batch(s)))
    return steps, grads, momenta[-1]["0.weight"]


def fp32_grads(model, x, y):
    ((model(x) - y) ** 2).mean().backward()


@pytest.fixture(scope="module")
def reference():
    """The whole batch in fp32."""
    return _reference(fp32_grads)


def bf16_grads(model, x, y, world=2):
    """What FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32) computes on `world` ranks, each its slice of the
    batch: the forward and backward in bf16 on a bf16 copy of the fp32
    parameters (the input cast to bf16, as fully_shard's
    cast_forward_inputs), each rank's bf16 gradient cast to fp32, the mean
    over the ranks in fp32 (its reduce-scatter)."""
    import copy

    n = x.shape[0] // world
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for rank in range(world):
        low = copy.deepcopy(model).to(torch.bfloat16)
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        ((low(xs.to(torch.bfloat16)) - ys) ** 2).mean().backward()
        for name, p in low.named_parameters():
            total[name] += p.grad.float()
    for name, p in model.named_parameters():
        p.grad = total[name] / world


@pytest.fixture(scope="module")
def reference_bf16():
    """The fp32 optimizers on the gradients of FSDP2's bf16 mixed precision."""
    return _reference(bf16_grads)


def check_against(reference, results):
    want_steps, want_grads, want_momentum = reference
    for rank, r in enumerate(results):
        # The gradients first: FSDP2's reduce-scatter must average (some
        # torch versions sum on gloo), or every later comparison is moot.
        for name, g in want_grads.items():
            assert rel_err(r["grads"][name], g) < TOL, (rank, "grad", name)
        for s, (got, want) in enumerate(zip(r["steps"], want_steps)):
            for name, p in want.items():
                err = rel_err(got[name], p)
                assert err < TOL, f"rank {rank} step {s + 1} {name}: {err:.2e}"
        # opt.state[p]["momentum_buffer"]: a DTensor laid out as p.
        assert rel_err(r["momentum"], want_momentum) < TOL, rank
    for name in want_steps[-1]:
        for r in results[1:]:
            assert torch.equal(results[0]["steps"][-1][name], r["steps"][-1][name])


def no_dtensor_collectives(results):
    """DMuon's own code made no DTensor.redistribute / full_tensor call
    during the steps on any rank: each rank's local gradient went as it is
    and its update came back in its local shape (SHARDING_BLOCKS)."""
    for rank, r in enumerate(results):
        assert r["dtensor_calls"] == [], (rank, r["dtensor_calls"])


def worst_step_errors(reference, results):
    """{name: the largest relative error over the steps} of rank 0."""
    worst = {}
    for got, want in zip(results[0]["steps"], reference[0]):
        for name, p in want.items():
            worst[name] = max(worst.get(name, 0.0), rel_err(got[name], p))
    return worst


@pytest.mark.parametrize("overlap", [1, 0])
def test_fsdp2_fully_shard_equals_unsharded_torch(daemon, reference, tmp_path, overlap):
    """fully_shard of every Linear and the root: 0.weight's 5 rows are 3 + 2,
    4.weight's 1 row leaves rank 1 none (it sends and receives nothing)."""
    results = run_job("fsdp", daemon.address, tmp_path, extra=[f"--overlap={overlap}"])
    check_against(reference, results)
    no_dtensor_collectives(results)
    hand = "hook" if overlap else "step"
    for r in results:
        assert set(r["routes"].values()) == {("blocks", hand)}, r["routes"]
    # FSDP2 runs post-accumulate-grad hooks on its sharded parameters after
    # the reduce-scatter: every matrix leaves during backward.
    assert results[0]["hooked"] == ([0, 1, 2] if overlap else [])
    assert results[0]["placements"]["0.weight"] == "(Shard(dim=0),)"
    reasons = [r["reasons"] for r in results]
    assert "rows [0, 3) x cols [0, 6) here" in reasons[0]["0.weight"], reasons[0]
    assert "rows [3, 5) x cols [0, 6) here" in reasons[1]["0.weight"], reasons[1]
    assert "rows [0, 1) x cols [0, 8) here" in reasons[0]["4.weight"], reasons[0]
    assert "nothing here" in reasons[1]["4.weight"], reasons[1]
    # Conversion to torch.optim.Muon is refused by name (torch's Muon cannot
    # step the uneven head's shards); DCP is the way.
    assert "0.weight is a DTensor" in results[0]["convert"], results[0]["convert"]
    assert "DCP" in results[0]["convert"], results[0]["convert"]


def test_fsdp2_uneven_rows_on_4_ranks(daemon, tmp_path):
    """fully_shard on 4 ranks, hidden 7: 0.weight's 7 rows are 2 + 2 + 2 + 1,
    2.weight 8x7 is 2 rows each, the head's 1 row is rank 0's alone (ranks
    1-3 hold nothing of it: 0x0 slots); 10 steps, overlapped."""
    results = run_job("fsdp_uneven", daemon.address, tmp_path, world=4)
    check_against(_reference(fp32_grads, hidden=7), results)
    no_dtensor_collectives(results)
    for r in results:
        assert set(r["routes"].values()) == {("blocks", "hook")}, r["routes"]
    rows = ("[0, 2)", "[2, 4)", "[4, 6)", "[6, 7)")
    for rank, r in enumerate(results):
        assert f"rows {rows[rank]} x cols [0, 6) here" in r["reasons"]["0.weight"], (
            rank, r["reasons"])
        head = "rows [0, 1) x cols [0, 8) here" if rank == 0 else "nothing here"
        assert head in r["reasons"]["4.weight"], (rank, r["reasons"])


def test_fsdp2_accumulation_without_gradient_sync(daemon, reference, tmp_path):
    """Two micro-batches, the first with set_requires_gradient_sync(False):
    FSDP2 reduce-scatters (and runs the hooks) once, in the last backward."""
    results = run_job("fsdp_accum", daemon.address, tmp_path)
    check_against(reference, results)
    no_dtensor_collectives(results)
    assert results[0]["hooked"] == [0, 1, 2]


def test_fsdp2_checkpoint_into_a_new_optimizer(daemon, reference, tmp_path):
    """state_dict() after 5 steps (AdamW's DTensor state, dmuond's whole
    matrices) through torch.save into a new DMuon, 5 more steps."""
    results = run_job("fsdp_resume", daemon.address, tmp_path)
    check_against(reference, results)


@pytest.mark.parametrize("overlap", [1, 0])
def test_tensor_parallel_colwise_and_rowwise(daemon, reference, tmp_path, overlap):
    """fc1 ColwiseParallel (Shard(0): rows 3 + 2), fc2 RowwiseParallel
    (Shard(1): columns 3 + 2 of every row), the 1x8 head RowwiseParallel
    (columns 4 + 4 of its one row): each rank's local shard as blocks, no
    DTensor collective of DMuon's, every matrix from a backward hook."""
    results = run_job("tp", daemon.address, tmp_path, extra=[f"--overlap={overlap}"])
    check_against(reference, results)
    no_dtensor_collectives(results)
    r = results[0]
    assert r["placements"]["2.weight"] == "(Shard(dim=1),)", r["placements"]
    hand = "hook" if overlap else "step"
    assert set(r["routes"].values()) == {("blocks", hand)}, r["routes"]
    assert r["hooked"] == ([0, 1, 2] if overlap else [])
    reasons = [x["reasons"] for x in results]
    assert "rows [0, 3) x cols [0, 6) here" in reasons[0]["0.weight"], reasons[0]
    assert "rows [3, 5) x cols [0, 6) here" in reasons[1]["0.weight"], reasons[1]
    assert "(Shard(dim=1)), rows [0, 8) x cols [0, 3) here" in reasons[0]["2.weight"]
    assert "rows [0, 8) x cols [3, 5) here" in reasons[1]["2.weight"], reasons[1]
    assert "rows [0, 1) x cols [4, 8) here" in reasons[1]["4.weight"], reasons[1]
    assert results[1]["momentum_placements"] == "(Shard(dim=0),)"


def test_fsdp2_x_tensor_parallel_2d_mesh(daemon, reference, tmp_path):
    """FSDP2 x TP on a (dp=2, tp=2) mesh of 4 ranks: fc1's weight is
    (_StridedShard(dim=0, sf=2), Shard(0)) (rows 2 + 1 + 1 + 1, not in rank
    order), fc2's (Shard(0), Shard(1)) (a block of rows by a block of
    columns), the head's (Shard(0), Shard(1)) 1x8 (dp 1 holds none of it):
    each rank's local shard as blocks, all from FSDP2's hooks, no DTensor
    collective of DMuon's."""
    results = run_job("fsdp_tp", daemon.address, tmp_path, world=4)
    check_against(reference, results)
    no_dtensor_collectives(results)
    r = results[0]
    assert r["placements"]["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert r["placements"]["2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert r["momentum_placements"] == r["placements"]["0.weight"]
    assert set(r["routes"].values()) == {("blocks", "hook")}, r["routes"]
    assert r["hooked"] == [0, 1, 2]  # FSDP2 ran the hooks after its reduce-scatter
    reasons = [x["reasons"] for x in results]
    # rank 1 (dp 0, tp 1) holds row 3 of fc1: TP's second half, FSDP2's first row
    assert "rows [3, 4) x cols [0, 6) here" in reasons[1]["0.weight"], reasons[1]
    # fc2 8x5: dp 0 rows [0, 4), tp 1 columns [3, 5)
    assert ("(Shard(dim=0), Shard(dim=1)), rows [0, 4) x cols [3, 5) here"
            in reasons[1]["2.weight"]), reasons[1]
    assert "rows [4, 8) x cols [0, 3) here" in reasons[2]["2.weight"], reasons[2]
    assert "nothing here" in reasons[2]["4.weight"], reasons[2]


def test_fsdp2_x_tensor_parallel_strided_columns(daemon, tmp_path):
    """FSDP2 x TP with fully_shard on the weights' columns
    (shard_placement_fn: Shard(1); hidden 4, as FSDP2 shards columns only
    evenly): fc2's weight 8x4 is (_StridedShard(dim=1, sf=2), Shard(1)) (one
    column each, not in rank order), fc1's (Shard(1), Shard(0)), the head's
    (_StridedShard(dim=1, sf=2), Shard(1)) 1x8: each rank's blocks, no
    DTensor collective of DMuon's."""
    results = run_job("fsdp_tp_dim1", daemon.address, tmp_path, world=4)
    check_against(_reference(fp32_grads, hidden=4), results)
    no_dtensor_collectives(results)
    r = results[0]
    assert r["placements"]["2.weight"] == "(_StridedShard(dim=1, sf=2), Shard(dim=1))"
    assert r["placements"]["4.weight"] == "(_StridedShard(dim=1, sf=2), Shard(dim=1))"
    assert r["placements"]["0.weight"] == "(Shard(dim=1), Shard(dim=0))"
    assert set(r["routes"].values()) == {("blocks", "hook")}, r["routes"]
    # rank (dp, tp): TP's half of the columns, then FSDP2's half of it
    for rank, cols in enumerate(("[0, 1)", "[2, 3)", "[1, 2)", "[3, 4)")):
        assert f"rows [0, 8) x cols {cols} here" in results[rank]["reasons"]["2.weight"], (
            rank, results[rank]["reasons"])
    assert r["momentum_placements"] == r["placements"]["0.weight"]


def test_hsdp_2d_mesh(daemon, reference, tmp_path):
    """HSDP: fully_shard on a (replicate=2, shard=2) mesh of 4 ranks, every
    weight (Replicate(), Shard(0)): each replica sends its shard's rows as
    they are (5 rows: shards 3 + 2) from FSDP2's hooks (after its
    all-reduce), dmuond reads the lowest rank's and returns every replica
    its rows; the head's 1 row is shard 0's (shard 1 holds nothing)."""
    results = run_job("hsdp", daemon.address, tmp_path, world=4)
    check_against(reference, results)
    no_dtensor_collectives(results)
    r = results[0]
    assert r["placements"]["0.weight"] == "(Replicate(), Shard(dim=0))"
    assert set(r["routes"].values()) == {("blocks", "hook")}, r["routes"]
    assert r["hooked"] == [0, 1, 2]
    # rank (replicate, shard): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    for rank, rows in enumerate(("[0, 3)", "[3, 5)", "[0, 3)", "[3, 5)")):
        assert f"rows {rows} x cols [0, 6) here" in results[rank]["reasons"]["0.weight"], (
            rank, results[rank]["reasons"])
        head = "nothing here" if rank % 2 else "rows [0, 1) x cols [0, 8) here"
        assert head in results[rank]["reasons"]["4.weight"], (rank, results[rank]["reasons"])


def test_fsdp2_x_tp_head_on_the_dp_sub_mesh(daemon, reference, tmp_path):
    """FSDP2 x TP on a (dp=2, tp=2) mesh with the 1x8 head not
    tensor-parallel: fully_shard on the dp sub-mesh alone (ranks {0, 2} and
    {1, 3}, a copy per tp coordinate). The copies partition DMuon's group:
    the head goes as blocks from FSDP2's hooks, rank 0's row is read (rank
    1's copy equals it) and both copies get the update."""
    results = run_job("fsdp_tp_submesh", daemon.address, tmp_path, world=4)
    check_against(reference, results)
    no_dtensor_collectives(results)
    assert set(results[0]["routes"].values()) == {("blocks", "hook")}, results[0]["routes"]
    assert results[0]["hooked"] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["placements"]["4.weight"] == "(Shard(dim=0),)", (rank, r["placements"])
        # rank = 2 * dp + tp: dp 0 (ranks 0 and 1) holds the row
        head = "nothing here" if rank >= 2 else "rows [0, 1) x cols [0, 8) here"
        assert head in r["reasons"]["4.weight"], (rank, r["reasons"])


def test_replicated_on_the_dp_sub_mesh(daemon, reference, tmp_path):
    """Replicate() parameters on the dp sub-mesh of a (dp=2, tp=2) mesh (a
    copy per tp coordinate), the batch split over dp: Partial gradients,
    reduced at step() within each copy; rank 0's reduced gradient goes to
    dmuond (replicated) and every rank gets the update. At the first
    step() the copies' gradients are compared (reduced too), and agree."""
    results = run_job("dp_submesh", daemon.address, tmp_path, world=4)
    check_against(reference, results)
    r = results[0]
    assert set(r["routes"].values()) == {("replicated", "step")}, r["routes"]
    assert r["placements"]["2.weight"] == "(Partial(sum),)", r["placements"]


def test_sub_mesh_copies_with_different_gradients_are_refused(daemon, tmp_path):
    """The same layout with each tp rank fed a different input: the head's
    two copies get different gradients, which dmuond would not see (it
    reads the lowest rank's). The first step() raises on every rank, naming
    the parameter and the ranks, and takes no step."""
    results = launch("fsdp_worker.py", "fsdp_tp_submesh_diverge", 4, daemon.address,
                     tmp_path, timeout=150, check=False)[0]
    for rank, r in enumerate(results):
        err = r["error"] or ""
        assert err.startswith("RuntimeError: DMuon: the copies of 4.weight on a sub-mesh "
                              "have different gradients: ranks 0 and 1 hold"), (rank, err)
        assert "No step was taken" in err, (rank, err)
    # All-Replicate() copies with Partial gradients: compared once reduced.
    results = launch("fsdp_worker.py", "dp_submesh_diverge", 4, daemon.address,
                     tmp_path, timeout=150, check=False)[0]
    for rank, r in enumerate(results):
        err = r["error"] or ""
        assert "the copies of 0.weight on a sub-mesh have different gradients: ranks 0 " \
               "and 1 hold the same elements" in err, (rank, err)


@pytest.mark.parametrize("case, error", [
    ("same", None),
    ("tiny", None),  # 1e-6 relative: GPU reductions may differ so
    ("other", "ranks 0 and 1 hold the same elements"),
    ("absent", "with norm"),  # rank 1 has no gradient (None) for it
    ("elsewhere", None),  # rank 1 holds other rows: not compared
    ("whole", "ranks 0 and 1 hold the same elements"),  # all-Replicate() copies
])
def test_copies_differ(monkeypatch, case, error):
    """_dtensor.copies_differ on two ranks (the all_gather_object replaced
    by this rank's report and a second rank's, built the same way)."""
    from types import SimpleNamespace

    from dmuon import _dtensor

    def route(grad, rows=((0, 2),), whole=False):
        info = _dtensor.Info(("Shard(dim=0)",), None, None if whole else list(rows),
                             None if whole else [(0, 3)], copies=True)
        return SimpleNamespace(name="w", param=SimpleNamespace(grad=grad), dtensor=info)

    g = torch.randn(2, 3, generator=torch.Generator().manual_seed(7))
    whole = case == "whole"
    theirs = {"same": g.clone(), "tiny": g * (1 + 1e-6), "other": g * 1.5, "absent": None,
              "elsewhere": g * 2, "whole": g + 1}[case]
    rows = ((2, 4),) if case == "elsewhere" else ((0, 2),)

    def report(r):  # what copies_differ sends for route r
        sent = []
        monkeypatch.setattr(_dtensor._ddp, "gather",
                            lambda mine, pg, world: sent.append(mine) or [])
        _dtensor.copies_differ([r], None, 2)
        return sent[0]

    mine = route(g, whole=whole)
    reports = [report(mine), report(route(theirs, rows, whole))]
    monkeypatch.setattr(_dtensor._ddp, "gather", lambda m, pg, world: reports)
    got = _dtensor.copies_differ([mine], None, 2)
    if error is None:
        assert got is None, got
    else:
        assert got is not None and error in got and "copies of w" in got, got


@pytest.mark.parametrize("meshes, error", [
    ([[0, 1, 2, 3]] * 4, None),  # the group's mesh
    ([[0, 2], [1, 3], [0, 2], [1, 3]], None),  # FSDP2 x TP's dp copies
    ([[0], [1], [2], [3]], None),  # each rank alone
    ([[0, 1], [0, 1], [2], [2, 3]], "1 rank(s) (3) have it on a mesh of 2 ranks"),
    ([[0, 1], [0, 1], [2, 3], [1, 2, 3]], "1 rank(s) (2) have it on a mesh of 2 ranks"),
    ("shape", "rank 2's Muon DTensor parameters (names, shapes, placements) are not"),
    ("refusal", "its local shard is wrong (refused on rank 3)"),
])
def test_sub_mesh_reports_check(meshes, error):
    """_dtensor._check_reports on what 4 ranks report (_report of each): the
    meshes must be the group's or partition it, the tables the same, and a
    refusal on one rank is raised on every rank (here: rank 0)."""
    from types import SimpleNamespace

    from dmuon import _dtensor

    def route(ranks, shape=(4, 4)):
        mesh = SimpleNamespace(mesh=torch.tensor(ranks), ndim=1, shape=(len(ranks),))
        param = SimpleNamespace(shape=shape, placements=("Shard(dim=0)",), device_mesh=mesh)
        return SimpleNamespace(name="w", param=param, dtensor=SimpleNamespace(
            mesh=mesh, placements=param.placements, refusal=None, copies=False))

    grid = meshes if isinstance(meshes, list) else [[0, 2], [1, 3], [0, 2], [1, 3]]
    reports = [_dtensor._report([route(m)], None) for m in grid]
    if meshes == "shape":
        reports[2] = _dtensor._report([route(grid[2], shape=(4, 5))], None)
    if meshes == "refusal":
        reports[3] = _dtensor._report([route(grid[3])], "its local shard is wrong")
    dts = [route(grid[0])]
    if error is None:
        _dtensor._check_reports(dts, [0, 1, 2, 3], reports)
        # Copies (compared at the first step) unless on the group's mesh.
        assert dts[0].dtensor.copies == (grid[0] != [0, 1, 2, 3]), grid
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            _dtensor._check_reports(dts, [0, 1, 2, 3], reports)


# FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) against
# the fp32 reference: the forward and backward run in bf16 (unit roundoff
# u = 2^-8 = 3.9e-3), so step 1's gradients differ from fp32 ones by up to
# 6.6e-3 relative (1.7 u; measured: 3.1e-3 for 0.weight, 6.6e-3 for
# 2.weight), and each step adds its own such difference to the update's
# direction: the parameters drift apart about linearly with the steps,
# 1.4e-3 .. 2.4e-3 after step 1 and 1.4e-3 .. 9.0e-3 after step 10
# (4.weight .. 2.weight). That is the bf16 compute's own deviation, the same
# for the unsharded bf16 compute (reference_bf16), which DMuon matches to
# 1e-5; the bound against fp32 is 2e-2 for 10 steps (about 2x the measured
# 9.0e-3).
BF16_VS_FP32 = 2e-2


def test_fsdp2_bf16_mixed_precision(daemon, reference, reference_bf16, tmp_path):
    """fp32 sharded parameters, bf16 compute, fp32 reduction: DMuon gets the
    fp32 reduced gradient. Against the same bf16 compute unsharded
    (bf16_grads: the fp32 optimizers on it) to 1e-5 relative per matrix at
    every step, and against the fp32 reference to BF16_VS_FP32."""
    results = run_job("fsdp_bf16", daemon.address, tmp_path)
    check_against(reference_bf16, results)
    worst = worst_step_errors(reference, results)
    print("bf16 vs fp32 reference, worst relative error per parameter:", worst)
    assert max(worst.values()) < BF16_VS_FP32, worst
    assert max(worst.values()) > 1e-5, worst  # the bf16 compute is real


def test_partial_gradients_are_reduced(daemon, reference, tmp_path):
    """Replicate() parameters fed a Shard(0) batch: their gradients come out
    Partial and are all-reduced before they go to dmuond."""
    results = run_job("dp", daemon.address, tmp_path)
    check_against(reference, results)
    assert set(results[0]["routes"].values()) == {("replicated", "step")}
    assert results[0]["placements"]["2.weight"].startswith("(Partial("), results[0]
    # The one DTensor collective of DMuon's: reducing a Partial gradient.
    assert results[0]["dtensor_calls"], results[0]
    assert {c.split(": ")[1] for c in results[0]["dtensor_calls"]} == {"redistribute"}


def test_partial_gradients_of_blocks_go_at_step(daemon, reference, tmp_path):
    """(Replicate(), Shard(0)) weights on a (dp=2, tp=1) mesh fed a batch
    sharded over dp, without FSDP2: blocks whose gradients come out
    (Partial(), Shard(0)). The hooks leave them to step(), which reduces
    them (DTensor.redistribute) in table order on every rank."""
    results = run_job("dp_blocks", daemon.address, tmp_path)
    check_against(reference, results)
    r = results[0]
    assert r["placements"]["2.weight"].startswith("(Partial("), r["placements"]
    assert r["routes"]["0.weight"] == r["routes"]["2.weight"] == ("blocks", "hook")
    assert r["hooked"] == []  # every hook left its matrix to step()
    assert {c.split(": ")[1] for c in r["dtensor_calls"]} == {"redistribute"}, r


def test_rewind_with_a_partial_gradient_makes_no_collective_in_a_hook(
        daemon, reference, tmp_path):
    """Two backward passes per step, both synced: fc1's and fc2's gradients
    (blocks) went from the first backward's hooks, so the second one's hooks
    rewind dmuond's step. The head's Partial gradient is not handed yet: the
    rewind declares it absent rather than reduce it inside a hook, and
    step() reduces it as usual. The numbers are the whole batch's."""
    results = run_job("tp_partial_accum", daemon.address, tmp_path)
    check_against(reference, results)
    for rank, r in enumerate(results):
        assert r["placements"]["4.weight"] == "(Partial(sum),)", (rank, r["placements"])
        assert r["routes"]["0.weight"] == r["routes"]["2.weight"] == ("blocks", "hook")
        # The first step is rewound; after it, several backward passes per
        # step make DMuon hand gradients off at step() (no more rewinds).
        assert r["rewound"] == 1, (rank, r["rewound"])
        calls = r["dtensor_calls"]
        assert calls and all(c.endswith(": redistribute") for c in calls), (rank, calls)


def test_refused_layouts(daemon, tmp_path):
    """A mesh with ranks outside DMuon's process group, sub-meshes that are
    not copies partitioning the group, and a Partial parameter are refused
    at construction, naming the parameter."""
    results = run_job("refuse", daemon.address, tmp_path)
    for rank, r in enumerate(results):
        outside, copies, partial = (r["errors"][k] for k in ("outside", "copies", "partial"))
        assert "2.weight" in outside and f"[{1 - rank}] are not in DMuon's process group" \
            in outside, outside
        assert "2.weight" in copies, copies
        assert "rank 1 has it on a mesh of ranks [0], which does not hold" in copies, copies
        assert "2.weight" in partial and "Partial" in partial, partial


