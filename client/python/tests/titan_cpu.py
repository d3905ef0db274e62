"""torchtitan 0.3.0's Trainer on the CPU with gloo, for test_torchtitan: the
accommodations a GPU-less gloo job needs, a tiny debug llama, and data
made here (torchtitan's debug configs read tests/assets/ of its source
tree, which the wheel does not ship). None of it is dmuon's: both sides of
every comparison (DMuon, and torch.optim.Muon + AdamW through torchtitan's
own OptimizersContainer) run under the same accommodations.

Importing this module applies them (before torchtitan is imported: it
picks its device at import):
- its device: torchtitan.tools.utils takes the first available
  accelerator, else "cuda"; here "cpu" (torch.cpu is then its
  device_module: set_device, device_count, current_device, synchronize).
- barrier(device_ids=...) (torchtitan's set_pg_timeouts after step 1):
  gloo's barrier takes no device_ids; they are dropped.
- FSDP2's gradient division: torchtitan sets gradient_divide_factor 1.0
  (it normalizes the loss by the global token count itself), which FSDP2
  runs as a PREMUL_SUM reduce-scatter; gloo has no PREMUL_SUM, so FSDP2 is
  also told to reduce with SUM and divide itself (by 1.0: the same sum).
- the device memory monitor (torch.cuda's memory statistics, which
  torch.cpu lacks): one that reports none.
- Trainer.train()'s 2 s sleep on rank 0 at the end ("for other ranks to
  complete"): skipped, 2 s of every job.
"""

import dataclasses
import time

import torch
import torch.distributed as dist

torch._utils._get_available_device_type = lambda: "cpu"

from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan import trainer  # noqa: E402
from torchtitan.components import metrics  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.distributed import fsdp  # noqa: E402

SEQ_LEN = 16
BATCH = 2  # per rank
VOCAB = 256

_barrier = dist.barrier


def _gloo_barrier(*args, device_ids=None, **kwargs):
    return _barrier(*args, **kwargs)


def _sum_reduction(model):
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


class _NoMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


class _TimeWithoutSleep:
    """The time module for torchtitan.trainer, whose sleep returns at once."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        pass


dist.barrier = _gloo_barrier
trainer.time = _TimeWithoutSleep()
fsdp.disable_fsdp_gradient_division = _sum_reduction
metrics.build_device_memory_monitor = _NoMemoryMonitor


def tiny_llama():
    """torchtitan's llama3 "debugmodel" ModelSpec with a smaller model (dim
    64, 2 layers, 4 heads, vocab 256) and SDPA attention (FlexAttention has
    no CPU backward). The layers come from torchtitan's own builder, so the
    module tree and FQNs are the debug model's."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers,
                                          _output_linear_init, model_registry)
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads = 64, 4
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=heads, hidden_dim=4 * dim,
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ_LEN, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    model = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=_output_linear_init(dim)),
        layers=layers)
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return dataclasses.replace(model_registry("debugmodel"), flavor="tiny", model=model)


class Tokenizer(BaseTokenizer):
    """A stand-in: the data below is token ids already."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config, *, tokenizer_path=None):
        super().__init__()
        self.eos_id = 0

    def encode(self, text, **kwargs):
        return [b % VOCAB for b in text.encode()]

    def decode(self, ids, **kwargs):
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self):
        return VOCAB


class RandomTokens(IterableDataset, Stateful):
    """Sample i of data-parallel rank r: SEQ_LEN + 1 tokens of torch.randint
    seeded by (r, i); input the first SEQ_LEN, labels the last SEQ_LEN. Its
    state is the count of samples taken, so torchtitan's checkpoint of the
    dataloader resumes it where it was."""

    def __init__(self, rank):
        self.rank, self.sample = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(10_000 * self.rank + self.sample)
            self.sample += 1
            t = torch.randint(VOCAB, (SEQ_LEN + 1,), generator=g)
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self):
        return {"sample": self.sample}

    def load_state_dict(self, state_dict):
        self.sample = state_dict["sample"]


class Loader(ParallelAwareDataloader):
    """torchtitan's data-parallel stateful dataloader over RandomTokens."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                 local_batch_size, snapshot_every_n_steps=None):
        super().__init__(RandomTokens(dp_rank), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, batch_size=local_batch_size)
