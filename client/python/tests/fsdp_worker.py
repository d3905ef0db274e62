"""One rank of a gloo job for test_fsdp: DMuon on DTensor parameters
(FSDP2 fully_shard, tensor parallelism, FSDP2 x TP, HSDP, FSDP2 mixed
precision) on a CPU mesh of 2 or 4 processes.

Writes {"steps": [{name: full parameter}] after every step, "grads":
{name: full gradient} and "placements": {name: its placements} of step 1,
"routes": {name: (sharding, handoff)}, "reasons": {name: routing reason},
"hooked": the Muon indices a backward hook handed over, "momentum":
0.weight's momentum_buffer (full) at the end, "momentum_placements": its
placements, "dtensor_calls": the DTensor.redistribute / full_tensor calls
DMuon's own code made during the steps (backward hooks and step(); not at
construction; " (in backward)" when from a hook), "rewound": the steps
DMuon rewound, "convert": dmuon.torch_param_groups' refusal, "error": str
or None} to --out."""

import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import dmuon  # noqa: E402
from dmuon.optim import DMuon  # noqa: E402
from ranks import worker_args, worker_main  # noqa: E402

STEPS = 10
BATCH = 8
# torch_ref.MUON / DM_ADAMW (test_fsdp's reference uses the same).
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adamw_lr=3e-3,
             adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_wd=0.01)


def make_model(hidden=5):
    """0.weight 5x6 (rows 3 + 2 on two ranks), 2.weight 8x5, 4.weight 1x8
    (Muon by muon=: one rank holds no rows of it); `hidden` for 5."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 8), nn.Tanh(),
                         nn.Linear(8, 1))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 1, generator=g)


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fsdp(rank, world, mp_policy=None, hidden=5):
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(hidden)
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for m in (model[0], model[2], model[4]):
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)

    def loss_of(x, y):  # each rank its half of the batch; FSDP2 averages
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        return ((model(x) - y) ** 2).mean()

    return model, loss_of


def fsdp_bf16(rank, world):
    """FSDP2 mixed precision: bf16 forward/backward, fp32 sharded parameters
    and fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return fsdp(rank, world, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32))


def tp_plan():
    """fc1 colwise (Shard(0)), fc2 rowwise (Shard(1)), the 1x8 head rowwise
    (Shard(1), its replicated input sliced). fc1's 5 rows are uneven on 2
    ranks: its output stays a DTensor (a plain local tensor would be taken
    as an even split by fc2's input)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(),
            "4": RowwiseParallel(input_layouts=Replicate())}


def tp(rank, world):
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    parallelize_module(model, mesh, tp_plan())

    def loss_of(x, y):  # every rank the whole batch
        return ((model(x) - y) ** 2).mean()

    return model, loss_of


def tp_partial(rank, world):
    """fc1 colwise and fc2 rowwise (blocks, their gradients handed off from
    the backward hooks), the 1x8 head Replicate() on a batch split over the
    same mesh dim after fc2: its gradient comes out Partial (reduced at
    step(), never from a hook). The loss is the whole batch's."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False),
                                     "2": RowwiseParallel(use_local_output=False)})
    for name in ("weight", "bias"):
        p = getattr(model[4], name)
        setattr(model[4], name, nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                               [Replicate()])))

    def loss_of(x, y):
        h = model[3](model[2](model[1](model[0](x))))  # Replicate()
        out = model[4](h.redistribute(mesh, [Shard(0)]))
        y = distribute_tensor(y, mesh, [Shard(0)])
        return ((out - y) ** 2).mean().full_tensor()

    return model, loss_of


def fsdp_tp_submesh(rank, world, diverge=False):
    """FSDP2 x TP on a (dp=2, tp=world/2) mesh with the 1x8 head not
    tensor-parallel: fully_shard on the dp sub-mesh only, so each tp
    coordinate holds a copy of it (Shard(0) over dp: dp 0 its row, dp 1
    nothing). fc1 and fc2 as in fsdp_tp. diverge: each tp rank other
    targets (a broken TP job: the head's copies get different gradients; TP's
    all-reduce keeps the head's input the same)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = make_model()
    plan = tp_plan()
    del plan["4"]
    parallelize_module(model, mesh["tp"], plan)
    for m in (model[0], model[2], model[4]):
        fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp, tp = mesh.get_coordinate()
    skew = 1.0 if diverge else 0.0  # diverge: the tp ranks' targets differ

    def loss_of(x, y):
        n = x.shape[0] // 2
        y = y[dp * n:(dp + 1) * n] + skew * tp
        return ((model(x[dp * n:(dp + 1) * n]) - y) ** 2).mean()

    return model, loss_of


def fsdp_tp(rank, world, dim=0):
    """FSDP2 x TP on a (dp=2, tp=world/2) mesh: TP inside each dp group,
    fully_shard over dp (the weights' dim `dim`: shard_placement_fn; FSDP2
    shards a dim other than 0 only evenly: hidden 4); each dp group its
    half of the batch."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = make_model(4 if dim else 5)
    parallelize_module(model, mesh["tp"], tp_plan())
    kw = {}
    if dim:
        kw["shard_placement_fn"] = lambda p: Shard(dim) if p.dim() == 2 else None
    for m in (model[0], model[2], model[4]):
        fully_shard(m, mesh=mesh["dp"], **kw)
    fully_shard(model, mesh=mesh["dp"], **kw)
    dp = mesh.get_coordinate()[0]

    def loss_of(x, y):
        n = x.shape[0] // 2
        return ((model(x[dp * n:(dp + 1) * n]) - y[dp * n:(dp + 1) * n]) ** 2).mean()

    return model, loss_of


def hsdp(rank, world):
    """HSDP: fully_shard on a 2-D (replicate=2, shard=world/2) mesh; each
    rank its quarter of the batch."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for m in (model[0], model[2], model[4]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def loss_of(x, y):
        n = x.shape[0] // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        return ((model(x) - y) ** 2).mean()

    return model, loss_of


def replicate(model, mesh):
    """Every parameter of make_model() a Replicate() DTensor on `mesh`."""
    for m in (model[0], model[2], model[4]):
        for name in ("weight", "bias"):
            p = getattr(m, name)
            setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                            [Replicate()])))


def dp(rank, world):
    """Replicate() parameters, the batch a Shard(0) DTensor: the weights'
    gradients come out Partial (DMuon reduces them)."""
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    replicate(model, mesh)
    n = BATCH // world

    def loss_of(x, y):
        x = DTensor.from_local(x[rank * n:(rank + 1) * n], mesh, [Shard(0)])
        y = DTensor.from_local(y[rank * n:(rank + 1) * n], mesh, [Shard(0)])
        return ((model(x) - y) ** 2).mean().full_tensor()

    return model, loss_of


def dp_submesh(rank, world, diverge=False):
    """dp() on the dp sub-mesh of a (dp=2, tp=world/2) mesh: Replicate()
    parameters, one copy per tp coordinate, the batch Shard(0) over dp (the
    weights' gradients Partial over dp). diverge: each tp rank other
    targets (the copies' gradients differ)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["dp"]
    model = make_model()
    replicate(model, mesh)
    dp, n = mesh.get_local_rank(), BATCH // 2
    skew = float(rank % (world // 2)) if diverge else 0.0

    def loss_of(x, y):
        x = DTensor.from_local(x[dp * n:(dp + 1) * n], mesh, [Shard(0)])
        y = DTensor.from_local(y[dp * n:(dp + 1) * n] + skew, mesh, [Shard(0)])
        return ((model(x) - y) ** 2).mean().full_tensor()

    return model, loss_of


def dp_blocks(rank, world):
    """Data parallel over a Replicate() mesh dim without FSDP2: fc1's and
    fc2's weights (Replicate(), Shard(0)) on a (dp=world, tp=1) mesh, every
    other parameter Replicate(), the batch Shard(0) over dp: the weights'
    gradients come out (Partial(), Shard(0)), so DMuon reduces them at
    step() (not from the hooks)."""
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    model = make_model()
    for m in (model[0], model[2], model[4]):
        for name in ("weight", "bias"):
            p = getattr(m, name)
            pl = [Replicate(), Shard(0) if name == "weight" and m is not model[4]
                  else Replicate()]
            setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
    n = BATCH // world

    def loss_of(x, y):
        x = DTensor.from_local(x[rank * n:(rank + 1) * n], mesh, [Shard(0), Replicate()])
        y = DTensor.from_local(y[rank * n:(rank + 1) * n], mesh, [Shard(0), Replicate()])
        return ((model(x) - y) ** 2).mean().full_tensor()

    return model, loss_of


def refuse(args, rank, world):
    """The DTensor layouts DMuon refuses: the error of each."""
    from torch.distributed.tensor import Partial

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    errors = {}
    # A mesh with ranks outside DMuon's group: each rank a group of its own.
    groups = [dist.new_group([r]) for r in range(world)]
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for name in ("weight", "bias"):
        p = getattr(model[2], name)
        setattr(model[2], name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    try:
        DMuon(model, server=args.server, muon=["4.weight"], process_group=groups[rank],
              **HYPER)
    except ValueError as e:
        errors["outside"] = str(e)
    # Sub-meshes that are not copies partitioning the group: every rank has
    # 2.weight on a mesh of rank 0 alone.
    alone = DeviceMesh("cpu", [0])
    model = make_model()
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), alone,
                                                     [Shard(0)]))
    try:
        DMuon(model, server=args.server, muon=["4.weight"], **HYPER)
    except ValueError as e:
        errors["copies"] = str(e)
    # A Partial parameter (not reduced).
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    model[2].weight = nn.Parameter(DTensor.from_local(model[2].weight.detach() / world,
                                                      mesh, [Partial()]))
    try:
        DMuon(model, server=args.server, muon=["4.weight"], **HYPER)
    except ValueError as e:
        errors["partial"] = str(e)
    return {"errors": errors}


class DTensorCalls:
    """Counts DTensor.redistribute and DTensor.full_tensor calls made from
    DMuon's own code (a frame of the dmuon package) while `on`, each as
    "module: name", with " (in backward)" when made from a backward hook."""

    def __init__(self):
        self.on, self.calls = False, []
        for name in ("redistribute", "full_tensor"):
            setattr(DTensor, name, self._wrap(name, getattr(DTensor, name)))

    def _wrap(self, name, fn):
        def counted(t, *a, **kw):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.on and caller.split(".")[0] == "dmuon":
                hook = torch._C._current_graph_task_id() != -1
                self.calls.append(f"{caller}: {name}" + (" (in backward)" if hook else ""))
            return fn(t, *a, **kw)
        return counted


def train(args, rank, world):
    make = {"fsdp": fsdp, "fsdp_accum": fsdp, "fsdp_resume": fsdp, "tp": tp,
            "dp": dp, "dp_blocks": dp_blocks, "fsdp_tp": fsdp_tp, "hsdp": hsdp,
            "fsdp_bf16": fsdp_bf16, "tp_partial_accum": tp_partial,
            "fsdp_tp_submesh": fsdp_tp_submesh, "dp_submesh": dp_submesh,
            "dp_submesh_diverge": lambda rank, world: dp_submesh(rank, world, True),
            "fsdp_tp_submesh_diverge": lambda rank, world: fsdp_tp_submesh(
                rank, world, diverge=True),
            "fsdp_tp_dim1": lambda rank, world: fsdp_tp(rank, world, dim=1),
            "fsdp_uneven": lambda rank, world: fsdp(rank, world, hidden=7)}[args.mode]
    model, loss_of = make(rank, world)
    counter = DTensorCalls()
    opt = DMuon(model, server=args.server, muon=["4.weight"], overlap=args.overlap,
                **HYPER)
    routes = {r["name"]: (r["sharding"], r["handoff"]) for r in opt.routing
              if r["route"] == "muon"}
    reasons = {r["name"]: r["reason"] for r in opt.routing if r["route"] == "muon"}
    hooked = []  # Muon indices handed over by a backward hook
    on_grad = opt._handoff.on_grad

    def counted(i):
        on_grad(i)
        if opt._handoff.handed[i]:  # handed off by the hook (not left to step())
            hooked.append(i)

    opt._handoff.on_grad = counted
    steps, grads, placements = [], None, None
    counter.on = True
    for s in range(STEPS):
        if args.mode == "fsdp_resume" and s == STEPS // 2:
            # A checkpoint (through torch.save) into a new DMuon (a new job).
            counter.on = False  # the momentum's layout: not a step's
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            opt.close()
            opt = DMuon(model, server=args.server, muon=["4.weight"], **HYPER)
            buf.seek(0)
            opt.load_state_dict(torch.load(buf, weights_only=False))
            counter.on = True
        if args.mode == "tp_partial_accum":  # two micro-batches, both synced
            x, y = batch(s)
            for i in (0, 1):
                (loss_of(x[i::2], y[i::2]) / 2).backward()
        elif args.mode == "fsdp_accum":  # two micro-batches, one reduce-scatter
            x, y = batch(s)
            halves = [(x[i::2], y[i::2]) for i in (0, 1)]
            model.set_requires_gradient_sync(False)
            (loss_of(*halves[0]) / 2).backward()
            model.set_requires_gradient_sync(True)
            (loss_of(*halves[1]) / 2).backward()
        else:
            loss_of(*batch(s)).backward()
        if s == 0:
            counter.on = False
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            placements = {n: str(getattr(p.grad, "placements", None))
                          for n, p in model.named_parameters()}
            counter.on = True
        opt.step()
        opt.zero_grad()
        steps.append({n: full(p) for n, p in model.named_parameters()})
    counter.on = False
    mb = opt.state[model[0].weight]["momentum_buffer"]
    momentum = full(mb)
    rewound = opt.stats.get("rewound_steps", 0)
    try:
        dmuon.torch_param_groups(opt)
        convert = None
    except NotImplementedError as e:
        convert = str(e)
    opt.close()
    return {"steps": steps, "grads": grads, "routes": routes, "momentum": momentum,
            "hooked": sorted(set(hooked)), "placements": placements, "reasons": reasons,
            "momentum_placements": str(getattr(mb, "placements", None)),
            "dtensor_calls": counter.calls, "rewound": rewound, "convert": convert}


def main():
    ap = worker_args()
    ap.add_argument("--overlap", type=int, default=1)
    args = ap.parse_args()
    args.overlap = bool(args.overlap)
    fn = refuse if args.mode == "refuse" else train
    worker_main(args, lambda a: fn(a, a.rank, a.world))


if __name__ == "__main__":
    main()
