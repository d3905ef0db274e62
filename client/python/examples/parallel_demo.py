# torchrun --nproc-per-node=4 examples/parallel_demo.py fsdp|tp|fsdp_tp|hsdp   (CPU, gloo)
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from dmuon import RoutingOptions
from dmuon.optim import DMuon

dist.init_process_group("gloo")
kind, world, rank = sys.argv[1], dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)  # every rank builds the same model
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(),
                      nn.Linear(64, 10))
tp_plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # fc1 Shard(0), fc2 Shard(1)
shard_mesh = None
if kind == "fsdp":  # FSDP2: every weight Shard(0) on a 1-D mesh; each rank its data
    shard_mesh, data = init_device_mesh("cpu", (world,)), rank
elif kind == "tp":  # TP: fc1 Shard(0), fc2 Shard(1); every rank the same data
    parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan)
    data = 0
elif kind == "fsdp_tp":  # 2-D: fc1 (_StridedShard(0), Shard(0)), fc2 (Shard(0), Shard(1))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan)
    shard_mesh, data = mesh["dp"], mesh.get_coordinate()[0]  # data per dp group
elif kind == "hsdp":  # 2-D (replicate, shard): every weight (Replicate(), Shard(0))
    shard_mesh = init_device_mesh("cpu", (2, world // 2),
                                  mesh_dim_names=("replicate", "shard"))
    data = rank
if shard_mesh is not None:
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
# After fully_shard / parallelize_module: DMuon sees the DTensor parameters.
opt = DMuon(model, lr=0.02, weight_decay=0.01,
            routing_options=RoutingOptions(adamw=[model[4]]), verbose=True)
torch.manual_seed(1 + data)  # one batch per data shard, fitted over the steps
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for step in range(10):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0 and step in (0, 9):
        print(f"step {step + 1}: loss {loss.item():.4f}")
opt.close()
dist.destroy_process_group()
