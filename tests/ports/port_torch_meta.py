"""Models and the rank body shared by the ported meta-device init tests.

The models follow torch's ``common_fsdp.MLP`` (test_fully_shard_init.py): two linears,
an optional buffer its own ``reset_parameters`` draws, odd widths for uneven shards.
The body runs on every gloo rank (``cp.launch``), so it lives in a module the ranks
import; the parent compares what it returns with one process's ``materialize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import cudakit.parallel as cp

SEED = 11


class MLP(nn.Module):
    """torch's test MLP: in_proj, out_proj and, if asked, a buffer reset_parameters draws."""

    def __init__(self, dim: int, *, mult: int = 2, buffer: bool = False, bias: bool = True):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * mult, bias=bias)
        self.out_proj = nn.Linear(dim * mult, dim, bias=bias)
        if buffer:
            self.register_buffer("buffer", torch.randn(dim))
            self.register_buffer("scale", torch.ones(dim), persistent=False)

    def reset_parameters(self) -> None:
        if getattr(self, "buffer", None) is not None:
            nn.init.normal_(self.buffer)
            self.scale.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(torch.relu(self.in_proj(x)))
        if getattr(self, "buffer", None) is not None:
            z = z * self.scale + self.buffer
        return z


class Stack(nn.Module):
    """MLPs in an ``nn.ModuleList`` (each its own FSDP2 unit), a norm and a head."""

    def __init__(self, dim: int, depth: int = 2, *, buffer: bool = True, bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, buffer=buffer, bias=bias) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shared_stack() -> Stack:
    """Tied parameters across blocks, a buffer held by two blocks, one module twice."""
    model = Stack(5, depth=3)
    model.layers[0].in_proj.weight = model.layers[1].in_proj.weight
    model.layers[2].in_proj.weight = model.layers[1].in_proj.weight
    model.layers[1].buffer = model.layers[2].buffer
    model.layers[2].out_proj = model.layers[0].out_proj
    return model


def _bf16_stack() -> Stack:
    return Stack(3, buffer=False).to(torch.bfloat16)


#: Each case: how the model is built (under ``torch.device("meta")`` in the ranks).
BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "dim8": lambda: Stack(8),
    "dim3": lambda: Stack(3, bias=False),
    "dim1": lambda: Stack(1),  # one row: a rank with an empty shard
    "shared": shared_stack,
    "bf16": _bf16_stack,
}


def meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return BUILDERS[name]()


def one_process(name: str) -> dict[str, torch.Tensor]:
    """The reference: the same build materialized on one process, buffers included."""
    model = cp.materialize(meta(name), "cpu", init_seed=SEED)
    return _full_state(model)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in cp.state_dict(model).items()}
    for name, buf in cp.unwrap(model).named_buffers():
        out.setdefault(name, buf.detach().clone())  # the non-persistent ones too
    return out


def _ties(model: Any) -> list[bool]:
    layers = model.layers
    return [
        layers[0].in_proj.weight is layers[1].in_proj.weight,
        layers[2].in_proj.weight is layers[1].in_proj.weight,
        layers[1].buffer is layers[2].buffer,
        layers[2].out_proj is layers[0].out_proj,
    ]


def _step(model: nn.Module, dim: int, dtype: torch.dtype = torch.float32) -> bool:
    """One training iteration runs (forward, backward, Adam step) and stays finite."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(cp.rank())
    loss = model(torch.randn(4, dim, generator=g, dtype=dtype)).float().square().mean()
    loss.backward()
    opt.step()
    return bool(torch.isfinite(loss))


def _facts(model: nn.Module) -> dict[str, Any]:
    inner = cp.unwrap(model)
    tensors = [*inner.parameters(), *inner.buffers()]
    return {
        "devices": sorted({str(t.device) for t in tensors}),
        "on_meta": [n for n, t in inner.named_parameters() if t.is_meta],
        "held": sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in inner.parameters()
        ),
        "total": sum(p.numel() for p in inner.parameters()),
    }


def build_everywhere(strategy: str) -> dict[str, Any]:
    """On every rank: each case built on meta and handed to parallelize (and, for FSDP2,
    sharded by hand then materialized); what came out, gathered, and one step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out: dict[str, Any] = {}
    with cp.process_group(timeout=120):
        for name in BUILDERS:
            options: dict[str, Any] = {}
            if name == "bf16" and strategy == "fsdp":
                options["mp_policy"] = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            model = cp.parallelize(meta(name), strategy, init_seed=SEED, **options)
            inner = cp.unwrap(model)
            facts = _facts(model)
            facts["state"] = _full_state(model)
            if name == "shared":
                facts["tied"] = _ties(inner)
            dim = inner.norm.normalized_shape[0]
            dtype = torch.bfloat16 if name == "bf16" else torch.float32
            facts["step"] = _step(model, dim, dtype)
            out[name] = facts
        torch.manual_seed(0)  # allocated, not on meta: the same ties under the wrapper
        model = cp.parallelize(shared_stack(), strategy)
        out["shared_allocated"] = {"tied": _ties(cp.unwrap(model)), "step": _step(model, 5)}
        if strategy == "fsdp":  # sharded by the user, as test_meta_device_1d_init does
            model = meta("dim3")
            with torch.device("meta"):
                for module in (*model.layers, model):
                    fully_shard(module)
            cp.materialize(model, "cpu", init_seed=SEED)
            out["by_hand"] = {**_facts(model), "state": _full_state(model)}
            out["by_hand"]["step"] = _step(model, 3, torch.float32)
    return out
