"""Every rank's peak memory before launch: :func:`estimate_memory` and :class:`MemoryEstimate`.

The model runs two training steps on fake tensors (``FakeTensorMode``: shapes and
dtypes, no data, no memory), one rank's batch, under a dispatch mode that logs every
storage created and freed (:mod:`cudakit.memory._live`). Afterwards each storage is
known for what it was: a gradient, optimizer state, or an activation or temporary.
The strategy is then laid over that log (:func:`replay`): DDP adds its gradient
buckets; FSDP2 keeps ``1/world_size`` of the parameters, gradients and optimizer
state (dim 0 padded, as ``fully_shard`` pads it) and adds the gathered parameters of
the root and of two blocks (the one running and the one prefetched).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .._blocks import repeated_blocks
from .._check import check_callable, check_choice, check_int, fail_type, fail_value
from .._units import format_bytes
from ._live import Event, LiveBytes

__all__ = ["MemoryEstimate", "estimate_memory", "largest_batch"]

EstimateStrategy = Literal["none", "ddp", "fsdp"]
_STRATEGIES = ("none", "ddp", "fsdp")
_PRECISIONS = ("fp32", "bf16", "fp16")
_FIELDS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "communication",
    "temporaries",
)


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's predicted peak memory in bytes, and what it is made of.

    >>> from cudakit.memory import MemoryEstimate
    >>> e = MemoryEstimate("ddp", 2, "none", "fp32", 100, 100, 200, 400, 100, 0)
    >>> e.peak, e.fits(1000), e.fits(899)
    (900, True, False)

    The parts are those of the moment of the peak: ``parameters`` (and buffers),
    ``gradients``, ``optimizer`` state, ``activations`` (what the forward keeps for
    the backward, and the backward's own tensors), ``communication`` (DDP's gradient
    buckets, FSDP2's gathered parameters) and ``temporaries`` (the optimizer step's).

    .. versionadded:: 0.1
    """

    #: ``"none"``, ``"ddp"`` or ``"fsdp"``.
    strategy: str
    #: The number of ranks.
    world_size: int
    #: The recompute policy, as text (``"full"``, ``"selective/2"``, ``"none"``).
    recompute: str
    #: The precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` under autocast.
    precision: str
    #: Parameters and buffers (this rank's shard under FSDP2).
    parameters: int
    #: Gradients held at the peak.
    gradients: int
    #: Optimizer state held at the peak.
    optimizer: int
    #: Activations and the backward's tensors at the peak.
    activations: int
    #: Communication buffers: DDP's buckets, FSDP2's gathered parameters.
    communication: int
    #: The optimizer step's temporaries, when the peak falls in the step.
    temporaries: int

    @property
    def peak(self) -> int:
        """The peak in bytes: the sum of the parts."""
        return sum(getattr(self, f) for f in _FIELDS)

    def fits(self, capacity: int) -> bool:
        """Whether the peak fits in ``capacity`` bytes."""
        return self.peak <= capacity

    def to_dict(self) -> dict[str, Any]:
        """The fields and the peak, for JSON."""
        return {**asdict(self), "peak": self.peak}

    def __str__(self) -> str:
        head = (
            f"estimated peak per rank: {format_bytes(self.peak)} "
            f"({self.strategy}, world size {self.world_size}, recompute {self.recompute}, "
            f"{self.precision})"
        )
        rows = [f"  {f:<14}{format_bytes(getattr(self, f)):>12}" for f in _FIELDS]
        return "\n".join([head, *rows])


# --------------------------------------------------------------------------- fake copies


def _fake_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    Runs under the active ``FakeTensorMode``; ``model`` (on the meta device or real)
    is not touched, and no data is copied.
    """
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        memo[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def _fake_batch(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return torch.empty(batch.shape, dtype=batch.dtype, device=device)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_fake_batch(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _fake_batch(v, device) for k, v in batch.items()}
    return batch


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict, else
    ``model(batch)``; a non-scalar output is summed."""
    if isinstance(batch, (list, tuple)):
        out = model(*batch)
    elif isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(batch)
    if isinstance(out, (list, tuple)):
        out = out[0]
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"estimate_memory(): the model returned {type(out).__name__}, not a tensor to "
            "run backward from. Pass loss_fn=lambda model, batch: ... returning the loss."
        )
    return loss if loss.dim() == 0 else loss.sum()


# --------------------------------------------------------------------------- the trace


@dataclass
class _Trace:
    """What two fake steps left: the event log and what each storage id was."""

    events: list[Event]
    base: int  # parameters and buffers, alive throughout
    grads: dict[int, int]  # storage id -> index of its parameter
    states: dict[int, int | None]  # storage id -> parameter index if shaped like it
    sizes: list[int]  # per parameter: bytes
    shards: list[int]  # per parameter: bytes of one FSDP2 shard (dim 0 padded)
    units: list[int]  # FSDP2 units (blocks): parameter bytes each
    root: int  # parameter bytes of the root unit (all but the blocks)
    trainable: int  # bytes of the parameters that require grad


def _shard_bytes(p: torch.Tensor, world: int) -> int:
    if p.dim() == 0:
        return p.element_size()
    rows = math.ceil(p.shape[0] / world)
    return rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()


def _units(model: nn.Module) -> tuple[list[int], int]:
    """FSDP2's units as ``parallelize(strategy="fsdp")`` makes them: block bytes, root bytes."""
    blocks: list[int] = []
    seen: set[int] = set()
    for block in repeated_blocks(model):
        params = [p for p in block.parameters() if id(p) not in seen]
        if any(p.requires_grad for p in params):
            blocks.append(sum(p.numel() * p.element_size() for p in params))
            seen.update(id(p) for p in params)
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in seen)
    return blocks, root


def _trace(
    model: nn.Module,
    batch: Any,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    precision: str,
    device: torch.device,
    world: int,
) -> _Trace:
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    base = sum(t.numel() * t.element_size() for t in (*params, *model.buffers()))
    live = LiveBytes()
    for t in (*params, *model.buffers()):
        live.known(t)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    grads: dict[int, int] = {}  # each step's gradients are storages of their own
    with live:
        fake = _fake_batch(batch, device)
        optimizer = make_optimizer([p for p in params if p.requires_grad])
        for _ in range(2):  # the second step holds the optimizer state from the start
            optimizer.zero_grad(set_to_none=True)
            live.phase = "forward"
            autocast = (
                torch.autocast(device.type, dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            )
            with autocast:
                loss = loss_fn(model, fake)
            live.phase = "backward"
            loss.backward()
            del loss
            live.phase = "step"
            optimizer.step()
            grads.update(
                (i, index[id(p)])
                for p in params
                if p.grad is not None and (i := live.ident(p.grad)) is not None
            )
        states: dict[int, int | None] = {}
        for p, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor) and (i := live.ident(value)) is not None:
                    same = value.shape == p.shape
                    states[i] = index[id(p)] if same and id(p) in index else None
        events = list(live.events)
    blocks, root = _units(model)
    return _Trace(
        events=events,
        base=base,
        grads=grads,
        states=states,
        sizes=[p.numel() * p.element_size() for p in params],
        shards=[_shard_bytes(p, world) for p in params],
        units=blocks,
        root=root,
        trainable=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
    )


# --------------------------------------------------------------------------- strategies


def replay(trace: _Trace, strategy: str, world: int) -> dict[str, int]:
    """The parts of one rank's peak under ``strategy``, from the trace's event log."""
    fsdp = strategy == "fsdp"

    def scaled(param: int | None, size: int) -> int:
        if not fsdp or param is None:
            return size
        return size * trace.shards[param] // max(trace.sizes[param], 1)

    parameters = trace.base
    if fsdp:
        parameters = trace.base - sum(trace.sizes) + sum(trace.shards)
    # FSDP2 gathers the root's parameters for the whole forward and backward, a block's
    # and the next one's (prefetched) at a time; in the backward a block's unsharded
    # gradients wait for their reduce-scatter.
    largest = max(trace.units, default=0)
    gathered = {"forward": trace.root + 2 * largest, "backward": trace.root + 3 * largest}
    comm_fixed = trace.trainable if strategy == "ddp" else 0  # DDP's gradient buckets
    sizes: dict[int, int] = {}
    grads = opt = rest = 0
    best = dict.fromkeys(_FIELDS, 0)
    best_total = -1
    for ident, delta, phase in trace.events:
        if delta > 0:
            sizes[ident] = delta
        if ident in trace.grads:
            grads += scaled(trace.grads[ident], delta)
        elif ident in trace.states:
            opt += scaled(trace.states[ident], delta)
        else:
            rest += delta
        in_step = phase == "step"
        comm = comm_fixed + (gathered.get(phase, 0) if fsdp else 0)
        total = parameters + grads + opt + rest + comm
        if total > best_total:
            best_total = total
            best = {
                "parameters": parameters,
                "gradients": grads,
                "optimizer": opt,
                "activations": 0 if in_step else rest,
                "communication": comm,
                "temporaries": rest if in_step else 0,
            }
    return best


# --------------------------------------------------------------------------- the call


def _check_model(func: str, model: object) -> Callable[[], nn.Module] | nn.Module:
    if isinstance(model, nn.Module):
        return model
    if callable(model) and not isinstance(model, type(torch.optim.Optimizer)):
        return cast(Callable[[], nn.Module], model)
    fail_type(
        func,
        "model",
        "an nn.Module (on the meta device is best) or a function that builds one",
        model,
        "Pass the model, e.g. built under `with torch.device('meta'):`, or its factory.",
    )


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)


def estimate_memory(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    *,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    strategy: str = "none",
    world_size: int = 1,
    precision: str = "fp32",
    recompute: Any = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
) -> MemoryEstimate:
    """Predict one rank's peak memory for a training step, without allocating it.

    >>> import torch, cudakit.memory as cm
    >>> with torch.device("meta"):  # no memory, however large
    ...     layers = (torch.nn.Linear(4096, 4096) for _ in range(8))
    ...     net = torch.nn.Sequential(*layers)
    >>> batch = torch.empty(64, 4096, device="meta")
    >>> e = cm.estimate_memory(net, batch, strategy="ddp", world_size=8)
    >>> round(e.parameters / 2**20), round(e.optimizer / 2**20)  # MiB
    (512, 1024)

    Two steps of training run on fake tensors (shapes and dtypes, no data): the
    forward (``loss_fn(model, batch)``, under autocast for ``"bf16"``/``"fp16"``),
    the backward and ``optimizer.step()``. Every tensor they create is counted
    while it lives; the peak and what it holds come from that log, with the
    strategy laid over it: DDP's gradient buckets; FSDP2's shards and gathered
    parameters (the units of ``parallelize(strategy="fsdp")``). The model is not
    changed: a copy of it (fake, on the CPU) runs.

    Args:
        model: the model (best built on the meta device) or a function building it.
        batch: one rank's batch: tensors (meta ones are fine) in tuples, lists,
            dicts; only their shapes and dtypes count.
        optimizer: a function from parameters to an optimizer (default
            ``torch.optim.AdamW``), e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
        strategy: ``"none"``, ``"ddp"`` or ``"fsdp"``.
        world_size: the number of ranks (1 for ``"none"``).
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` for autocast.
        recompute: a recompute policy, as ``parallelize(recompute=...)`` takes it.
        loss_fn: ``(model, batch) -> loss``; default ``model(batch)`` (unpacking a
            tuple or dict), summed.

    Returns:
        One rank's peak and its parts, a ``MemoryEstimate`` (every rank holds
        the same).

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: an unknown strategy or precision, a world size the strategy
            cannot run (``"none"`` with more than one rank), a bad recompute
            policy, or a batch the model refuses (its own error, named).

    .. versionadded:: 0.1
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..parallel.recompute import apply_recompute, as_recompute, describe_spec, plan_recompute

    func = "estimate_memory"
    source = _check_model(func, model)
    strategy = check_choice(
        func, "strategy", strategy, _STRATEGIES, fix="Pass 'none', 'ddp' or 'fsdp'."
    )
    world = check_int(func, "world_size", world_size, minimum=1)
    if strategy == "none" and world > 1:
        fail_value(
            func,
            "world_size",
            "1 with strategy='none'",
            world_size,
            f"strategy='none' runs one process; pass strategy='ddp' or 'fsdp' for "
            f"{world} ranks, or world_size=1.",
        )
    precision = check_choice(func, "precision", precision, _PRECISIONS)
    spec = as_recompute(func, "recompute", recompute)
    if optimizer is not None:
        check_callable(
            func,
            "optimizer",
            optimizer,
            expected="a function from parameters to an optimizer",
            fix="Pass e.g. optimizer=torch.optim.AdamW (the class, not an instance).",
        )
    if loss_fn is not None:
        check_callable(func, "loss_fn", loss_fn, expected="a function (model, batch) -> loss")
    if not any(True for _ in _tensors(batch)):
        fail_type(
            func,
            "batch",
            "tensors (meta ones are fine) in tuples, lists or dicts",
            batch,
            "Pass one rank's batch, e.g. torch.empty(8, 512, device='meta').",
        )
    make_opt = optimizer or cast(Any, torch.optim.AdamW)
    device = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        net = source() if not isinstance(source, nn.Module) else None
        net = _fake_copy(net if net is not None else cast(nn.Module, source), device)
        if spec is not None:
            apply_recompute(net, spec, plan_recompute(func, net, spec))
        try:
            trace = _trace(net, batch, make_opt, loss_fn or _default_loss, precision, device, world)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ValueError(
                f"{func}(batch=...): the {type(net).__name__} refused the batch "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0]}). Pass a batch "
                "of the shapes and dtypes its forward takes, or loss_fn=... to call it."
            ) from exc
    parts = replay(trace, strategy, world)
    return MemoryEstimate(
        strategy=strategy,
        world_size=world,
        recompute=describe_spec(spec),
        precision=precision,
        **parts,
    )


def _resized(batch: Any, size: int) -> Any:
    """``batch`` with dim 0 of every tensor set to ``size`` (meta tensors: no memory)."""
    if isinstance(batch, torch.Tensor):
        return torch.empty((size, *batch.shape[1:]), dtype=batch.dtype, device="meta")
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_resized(b, size) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_resized(b, size) for b in batch)
    if isinstance(batch, dict):
        return {k: _resized(v, size) for k, v in batch.items()}
    return batch


def largest_batch(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    capacity: int,
    *,
    limit: int = 1 << 16,
    **options: Any,
) -> tuple[int, MemoryEstimate | None]:
    """The largest batch per rank whose estimated peak fits ``capacity`` bytes.

    >>> import torch, cudakit.memory as cm
    >>> with torch.device("meta"):
    ...     net = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(),
    ...                               torch.nn.Linear(4096, 256))
    >>> size, est = cm.largest_batch(net, torch.empty(1, 256), 64 * 2**20)
    >>> size, est.fits(64 * 2**20)
    (751, True)

    ``batch`` is one example (its dim 0 is the batch); the search doubles the size,
    then bisects, each step one :func:`estimate_memory` with ``options`` (strategy,
    world size, precision, recompute, optimizer, ``loss_fn``).

    Returns:
        ``(size, estimate)``; ``(0, None)`` when not even one sample fits.

    Raises:
        TypeError, ValueError: as :func:`estimate_memory`; ``capacity`` or ``limit``
            not a positive int.

    .. versionadded:: 0.1
    """
    capacity = check_int("largest_batch", "capacity", capacity, minimum=1)
    limit = check_int("largest_batch", "limit", limit, minimum=1)

    def at(size: int) -> MemoryEstimate:
        return estimate_memory(model, _resized(batch, size), **options)

    first = at(1)
    if not first.fits(capacity):
        return 0, None
    good, best = 1, first
    bad = None
    while bad is None and good < limit:
        size = min(2 * good, limit)
        est = at(size)
        if est.fits(capacity):
            good, best = size, est
        else:
            bad = size
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        est = at(mid)
        if est.fits(capacity):
            good, best = mid, est
        else:
            bad = mid
    return good, best
