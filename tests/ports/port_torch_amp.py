"""What test_port_torch_grad_scaling.py shares: torch's scaling case, inf injection, checks.

PyTorch tests GradScaler with one small case (torch/testing/_internal/common_cuda.py,
``_create_scaling_case``): two ``Linear(8, 8)`` layers, four batches of 8x8 inputs and
targets, ``MSELoss``, ``lr=1.0``, and an inf written into the second layer's weight
gradient on iteration 2. Here each case holds two identical copies: one trained by a
hand-written torch loop, the other by ``autocast_step``; :func:`assert_same_training`
then compares them bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: The iteration on which torch's scaling tests write an inf into a gradient.
SKIP_ITER = 2

#: The optimizers torch's device-generic grad-scaling tests run, with the kwargs variants
#: of torch/testing/_internal/common_optimizers.py that a CPU supports (fused: Adam, AdamW,
#: SGD and Adagrad on CPU). lr is 1.0 unless a variant sets it, as in torch's case.
OPTIMIZER_VARIANTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {}),
    "SGD-foreach": (torch.optim.SGD, {"foreach": True}),
    "SGD-momentum": (torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    "SGD-momentum-foreach": (torch.optim.SGD, {"momentum": 0.9, "foreach": True}),
    "SGD-nesterov-fused": (
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "fused": True},
    ),
    "Adam": (torch.optim.Adam, {"lr": 0.1, "foreach": False}),
    "Adam-foreach": (torch.optim.Adam, {"lr": 0.1, "foreach": True}),
    "Adam-fused": (torch.optim.Adam, {"lr": 0.1, "fused": True}),
    "Adam-amsgrad-fused": (torch.optim.Adam, {"lr": 0.1, "amsgrad": True, "fused": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.1, "foreach": False}),
    "AdamW-foreach": (torch.optim.AdamW, {"lr": 0.1, "foreach": True, "amsgrad": True}),
    "AdamW-fused": (torch.optim.AdamW, {"lr": 0.1, "fused": True, "weight_decay": 0.1}),
    "AdamW-fused-maximize": (torch.optim.AdamW, {"lr": 0.1, "fused": True, "maximize": True}),
    "Adagrad-fused": (torch.optim.Adagrad, {"lr": 0.1, "fused": True}),
}


def is_fused(variant: str) -> bool:
    """Whether the variant's optimizer skips on the device (torch's fused kernels).

    A fused optimizer does so only where it declares ``_step_supports_amp_scaling``:
    torch 2.11's fused Adagrad does not, so GradScaler and cudakit both unscale its
    gradients and skip it on the host, as they do a plain optimizer.
    """
    cls, kwargs = OPTIMIZER_VARIANTS[variant]
    if not kwargs.get("fused"):
        return False
    probe = cls([nn.Parameter(torch.zeros(1))], **kwargs)
    return bool(getattr(probe, "_step_supports_amp_scaling", False))


def make_optimizer(
    variant: str, params: Iterable[torch.Tensor], **overrides: Any
) -> torch.optim.Optimizer:
    """The variant's optimizer over ``params`` (lr 1.0 unless the variant sets one)."""
    cls, kwargs = OPTIMIZER_VARIANTS[variant]
    return cls(params, **{"lr": 1.0, **kwargs, **overrides})


def two_layers() -> nn.Sequential:
    """torch's scaling model: ``Linear(8, 8)`` twice."""
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def scaling_data(batches: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """torch's scaling data: ``batches`` pairs of 8x8 inputs and targets."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(batches)
    ]


def grad_scaler(**overrides: Any) -> torch.amp.GradScaler:
    """torch's test scaler on the CPU: a modest initial scale, an unrealistic growth factor.

    ``init_scale=128``, ``growth_factor=2`` and ``growth_interval=1``, so every unskipped
    step doubles the scale and errors in the growth handling are magnified.
    """
    settings: dict[str, Any] = {"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1}
    return torch.amp.GradScaler("cpu", **{**settings, **overrides})


class Clock:
    """The iteration both loops are on, read by :func:`inject_inf`'s hooks."""

    def __init__(self) -> None:
        self.now = -1


def inject_inf(params: Iterable[torch.Tensor], clock: Clock, at: Iterable[int]) -> None:
    """On the iterations ``at``, make each of ``params``' gradients inf (a tensor hook).

    torch's tests fill ``model[1].weight.grad`` with inf after the backward; a hook does
    the same inside the backward, so a step that runs the backward itself sees it too.
    Sparse gradients get one inf value.
    """
    bad = frozenset(at)

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if clock.now not in bad:
            return None
        if grad.is_sparse:
            grad = grad.coalesce()
            values = grad.values().clone()
            values.view(-1)[0] = float("inf")
            return torch.sparse_coo_tensor(
                grad.indices(), values, grad.shape, check_invariants=True
            )
        return torch.full_like(grad, float("inf"))

    for p in params:
        p.register_hook(hook)


@dataclass
class Pair:
    """One model twice: ``ref`` for the hand-written torch loop, ``ours`` for autocast_step."""

    ref: nn.Module
    ours: nn.Module
    ref_opt: torch.optim.Optimizer
    ours_opt: torch.optim.Optimizer
    clock: Clock = field(default_factory=Clock)


def make_pair(
    variant: str,
    *,
    model: Callable[[], nn.Module] = two_layers,
    inf_at: Iterable[int] = (),
    inf_param: Callable[[nn.Module], torch.Tensor] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Pair:
    """Two identical models and optimizers; infs injected into ``inf_param`` on ``inf_at``.

    ``inf_param`` picks the parameter (default: torch's ``model[1].weight``).
    """
    torch.manual_seed(seed)
    ref = model()
    ours = copy.deepcopy(ref)
    pair = Pair(
        ref,
        ours,
        make_optimizer(variant, ref.parameters(), **overrides),
        make_optimizer(variant, ours.parameters(), **overrides),
    )
    pick = inf_param or (lambda m: m[1].weight)  # type: ignore[index]
    inject_inf([pick(ref), pick(ours)], pair.clock, inf_at)
    return pair


def finite_grads(*models: nn.Module) -> bool:
    """Whether every gradient of ``models`` is finite (sparse ones coalesced)."""
    for m in models:
        for p in m.parameters():
            g = p.grad
            if g is None:
                continue
            values = g.coalesce().values() if g.is_sparse else g
            if not bool(torch.isfinite(values).all()):
                return False
    return True


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.is_sparse or b.is_sparse:
        return a.is_sparse and b.is_sparse and torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


def assert_same_training(
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    ours: nn.Module,
    ours_opt: torch.optim.Optimizer,
    *,
    grads: bool = True,
    where: str = "",
) -> None:
    """Weights, gradients (``grads=True``) and optimizer state equal bit for bit."""
    names = [n for n, _ in ref.named_parameters()]
    for name, p, q in zip(names, ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p, q), f"{where}: weight {name} differs"
        if grads:
            assert _same(p.grad, q.grad), f"{where}: gradient of {name} differs"
        ref_state, our_state = ref_opt.state.get(p, {}), ours_opt.state.get(q, {})
        if _fresh(ref_state) and _fresh(our_state):
            continue  # no state, or the zeros a skipped first fused step leaves: the same
        assert ref_state.keys() == our_state.keys(), f"{where}: state keys of {name}"
        for key, value in ref_state.items():
            mine = our_state[key]
            if isinstance(value, torch.Tensor):
                assert _same(value, mine), f"{where}: optimizer state {key!r} of {name} differs"
            else:
                assert value == mine, f"{where}: optimizer state {key!r} of {name} differs"
    for g, h in zip(ref_opt.param_groups, ours_opt.param_groups, strict=True):
        assert _same_group(g, h), f"{where}: param group hyper-parameters differ"


def _fresh(state: dict[str, Any]) -> bool:
    """No state yet, or only zeros: what a fused Adam, AdamW or Adagrad whose first step
    was skipped through ``found_inf`` leaves (its step count undone). The next real step
    starts from zeros either way."""
    return all(isinstance(v, torch.Tensor) and not bool(v.any()) for v in state.values())


def _same_group(g: dict[str, Any], h: dict[str, Any]) -> bool:
    for key, value in g.items():
        if key == "params":
            continue
        other = h[key]
        if isinstance(value, torch.Tensor):
            if not torch.equal(value, other):
                return False
        elif value != other:
            return False
    return True


def assert_same_pair(pair: Pair, *, grads: bool = True, where: str = "") -> None:
    """:func:`assert_same_training` over a :class:`Pair`."""
    assert_same_training(pair.ref, pair.ref_opt, pair.ours, pair.ours_opt, grads=grads, where=where)


def assert_same_scaler(ref: torch.amp.GradScaler, ours: torch.amp.GradScaler) -> None:
    """The scale, the growth tracker and the scaler's settings equal bit for bit.

    A scaler fresh from pickle makes its scale tensor at its first use: then the state
    dicts (the scale as a Python float, exact for a float32) are compared alone.
    """
    assert ref.state_dict() == ours.state_dict()
    if ref._scale is not None and ours._scale is not None:
        assert torch.equal(ref._scale, ours._scale)
        assert torch.equal(ref._growth_tracker, ours._growth_tracker)  # type: ignore[arg-type]
