"""Loss-spike skipping: the rule (:class:`SpikeRule`) and its running statistics.

A window whose statistic (its loss, or its gradient norm) is an outlier against a
running mean and variance of the windows accepted before it is skipped like a
non-finite window. What runs where:

* the statistic is a device tensor built from the window (the loss across ranks rides
  on the guard's one all-reduce, see :meth:`~cudakit.amp._guard.NonFiniteGuard.combine`);
* the verdict is one comparison against a threshold the host already knows (a 0-dim
  CPU tensor the host keeps equal to it, which the kernel takes as a scalar when it is
  launched: no copy, no read), joined to the non-finite verdict by a select;
* the running statistics are Python floats on the host (float64), and learn from a
  window once its verdict is read: at once on the CPU, one window later on a GPU (where
  the statistic travels to the host with the verdict). The threshold is rounded to
  float32, the statistic's dtype, so the GPU's path and the CPU's compare the same two
  float32 numbers and agree bit for bit.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from .._check import check_choice, check_int, check_number, check_optional, describe, fail_type

__all__ = [
    "STATISTICS",
    "SpikeRule",
    "SpikeWatch",
    "Statistic",
    "check_skip_spikes",
    "f32",
    "read_float",
]

#: The statistics a rule can watch, in the order they travel.
STATISTICS = ("loss", "grad_norm")
#: A statistic a :class:`SpikeRule` watches: the window's ``loss`` or its gradient
#: norm before clipping (``grad_norm``).
Statistic = Literal["loss", "grad_norm"]
#: The largest finite float32: the threshold during warm-up (an overflow is a spike).
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


_CELL = array("f", [0.0])  # one float32: storing a Python float rounds it (to inf past max)


def f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as a Python float."""
    _CELL[0] = value
    return _CELL[0]


def read_float(t: torch.Tensor) -> float:
    """The value of a one-element float32 tensor: from memory on the CPU, else ``.item()``.

    On the CPU every op has finished when it returns, so the read waits for nothing and
    runs no torch op (the guard reads its CPU verdicts the same way).
    """
    plain = type(t) is torch.Tensor and t.is_cpu and t.dtype == torch.float32
    if plain and not torch.compiler.is_compiling():
        return float(ctypes.c_float.from_address(t.data_ptr()).value)
    return float(t.item())


_RULE_FIX = (
    "For example skip_spikes=SpikeRule(on='loss', z=6.0, warmup=20), or skip_spikes=True "
    "for those defaults."
)


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    """When a window is a loss spike: ``autocast_step(skip_spikes=SpikeRule(...))``.

    A window is a spike when its statistic ``x`` (a float32) exceeds ``mean + z * sd``
    (with ``z``) and ``ratio * mean`` (with ``ratio``): every threshold that is set, from
    the running mean and variance (``sd`` its square root, both float64) of the windows
    accepted before it, the threshold rounded to float32. During the first ``warmup``
    accepted windows only an overflow (``x = inf``) is a spike.

    >>> from cudakit.amp import SpikeRule
    >>> SpikeRule(on="grad_norm", z=4.0)
    SpikeRule(on=('grad_norm',), z=4.0, ratio=None, warmup=20, decay=0.99)

    Args:
        on: ``"loss"`` (the window's loss, averaged over its micro-batches and ranks),
            ``"grad_norm"`` (the total gradient norm before clipping), or both as a
            tuple: then a window is a spike when either is.
        z: how many standard deviations above the running mean is a spike; None
            turns the z-score test off.
        ratio: how many times the running mean is a spike (for positive statistics:
            losses such as cross-entropy, norms); None turns it off. With ``z`` too,
            a spike must pass both.
        warmup: accepted windows the statistics learn from before any window can be a
            spike (at least 2).
        decay: the running statistics' memory: each accepted window weighs
            ``max(1/n, 1 - decay)`` (n: accepted windows so far, itself included), so
            the first windows average exactly and later ones decay exponentially.

    Raises:
        TypeError, ValueError: an argument of the wrong kind or out of range, or
            neither ``z`` nor ``ratio`` set.

    .. versionadded:: 0.1
    """

    on: Statistic | tuple[Statistic, ...] = "loss"
    z: float | None = 6.0
    ratio: float | None = None
    warmup: int = 20
    decay: float = 0.99

    def __post_init__(self) -> None:
        where = "SpikeRule"
        raw = self.on if isinstance(self.on, tuple) else (self.on,)
        if not raw:
            raise ValueError(
                "SpikeRule(on=...) got an empty tuple; it expects what to watch: pass "
                "'loss', 'grad_norm' or ('loss', 'grad_norm')."
            )
        fix = "Watch 'loss', 'grad_norm' or both: on=('loss', 'grad_norm')."
        on = tuple(check_choice(where, "on", s, STATISTICS, fix=fix) for s in raw)
        if len(set(on)) != len(on):
            raise ValueError(f"SpikeRule(on=...) names a statistic twice: {raw!r}. {fix}")
        object.__setattr__(self, "on", tuple(s for s in STATISTICS if s in on))
        z = check_optional(check_number, where, "z", self.z, positive=True, fix=_RULE_FIX)
        ratio = check_optional(
            check_number,
            where,
            "ratio",
            self.ratio,
            minimum=1.0,
            fix="A spike is a window at least this many times the running mean, e.g. 3.0.",
        )
        if z is None and ratio is None:
            raise ValueError(
                "SpikeRule() got z=None and ratio=None, so no window could ever be a "
                "spike. Set z=... (standard deviations above the mean), ratio=... "
                "(times the mean), or both."
            )
        warmup = check_int(
            where,
            "warmup",
            self.warmup,
            minimum=2,
            fix="It is the number of accepted windows the statistics learn from first, "
            "e.g. warmup=20.",
        )
        decay = check_number(
            where,
            "decay",
            self.decay,
            positive=True,
            below=1,
            fix="It is the running statistics' memory, e.g. decay=0.99 (about the last 100 "
            "windows).",
        )
        object.__setattr__(self, "z", z)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "warmup", warmup)
        object.__setattr__(self, "decay", decay)


def check_skip_spikes(value: object) -> SpikeRule | None:
    """``skip_spikes=``: False/None (off), True (the default rule), a statistic, a rule."""
    if value is None or value is False:
        return None
    if value is True:
        return SpikeRule()
    if isinstance(value, SpikeRule):
        return value
    if isinstance(value, str):
        if value not in STATISTICS:
            raise ValueError(
                f"autocast_step(skip_spikes=...) got {value!r}; a statistic is 'loss' or "
                "'grad_norm'. Or pass True, or a SpikeRule(...)."
            )
        return SpikeRule(on=value)  # type: ignore[arg-type]
    fail_type(
        "autocast_step",
        "skip_spikes",
        "True, False, 'loss', 'grad_norm' or a cudakit.amp.SpikeRule",
        value,
        _RULE_FIX,
    )


class RunningStat:
    """Mean and variance of the accepted windows' statistic (Python floats: float64)."""

    __slots__ = ("count", "level", "mean", "var")

    def __init__(self, mean: float = 0.0, var: float = 0.0, count: int = 0) -> None:
        self.mean = mean
        self.var = var
        self.count = count  # accepted windows learnt from
        self.level = FLOAT32_MAX  # the threshold, kept current by :meth:`update`

    def update(self, rule: SpikeRule) -> None:
        """Compute :attr:`level`: the float32 value above which a window is a spike.

        ``mean + z * sqrt(var)`` and ``ratio * mean`` (the larger of those set), capped at
        float32's largest finite value (that value itself during warm-up), then rounded
        to the nearest float32: the statistic is a float32, and the device compares it
        with this very number.
        """
        if self.count < rule.warmup:
            self.level = FLOAT32_MAX
            return
        level = -math.inf
        if rule.z is not None:
            level = self.mean + rule.z * math.sqrt(self.var)
        if rule.ratio is not None:
            level = max(level, rule.ratio * self.mean)
        self.level = f32(min(level, FLOAT32_MAX))

    def learn(self, x: float, rule: SpikeRule) -> None:
        """Take an accepted window's ``x``: Finch's exponentially weighted update.

        ``a = max(1/n, 1 - decay)`` (n: accepted windows, this one included),
        ``d = x - mean``, ``mean += a * d``, ``var = (1 - a) * (var + a * d * d)``; then
        :meth:`update` (inlined here: this runs once per optimizer step).
        """
        count = self.count + 1
        alpha = 1.0 / count
        if alpha < 1.0 - rule.decay:
            alpha = 1.0 - rule.decay
        d = x - self.mean
        ad = alpha * d
        self.mean = mean = self.mean + ad
        self.var = var = (1.0 - alpha) * (self.var + ad * d)
        self.count = count
        if count < rule.warmup or rule.ratio is not None:
            self.update(rule)
            return
        level = mean + rule.z * math.sqrt(var)  # type: ignore[operator]  # z is set
        _CELL[0] = level if level < FLOAT32_MAX else FLOAT32_MAX
        self.level = _CELL[0]


class SpikeWatch:
    """A rule, the running statistics it keeps, and the statistic tensors of a window."""

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self.on: tuple[str, ...] = tuple(rule.on)
        self.stats: dict[str, RunningStat] = {}
        self._order: list[RunningStat] = []
        self._levels: tuple[float, ...] = ()
        # The thresholds again, as 0-dim float32 CPU tensors that the device test takes
        # as a scalar operand (read when the kernel is launched: cheaper than a Python
        # number, which torch wraps into a tensor on every call), kept equal to
        # _levels by writing their memory (no op).
        self._level_tensors: list[torch.Tensor] = []
        self._level_cells: list[ctypes.c_float] = []
        self._ones: dict[int | str, torch.Tensor] = {}
        self._bind_levels()
        self.restore({})

    def _bind_levels(self) -> None:
        """Fresh threshold tensors, and the cells that write them (after a copy too)."""
        self._level_tensors = [torch.zeros((), dtype=torch.float32) for _ in self.on]
        self._level_cells = [ctypes.c_float.from_address(t.data_ptr()) for t in self._level_tensors]
        self._ones = {}

    def __getstate__(self) -> dict[str, Any]:
        # A ctypes cell is copied (and pickled) by value, no longer aimed at its
        # tensor: a copy makes its own tensors and cells (and never shares them).
        state = dict(self.__dict__)
        for name in ("_level_tensors", "_level_cells", "_ones"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind_levels()
        self._set_levels()

    # ------------------------------------------------------------------ decisions

    def thresholds(self) -> tuple[float, ...]:
        """The current threshold of every watched statistic, in :attr:`on` order."""
        return self._levels

    @staticmethod
    def is_spike(values: Sequence[float], thresholds: Sequence[float]) -> bool:
        """Whether any statistic exceeds its threshold (the same test the device runs)."""
        return any(x > level for x, level in zip(values, thresholds, strict=True))

    def learn_one(self, x: float) -> None:
        """:meth:`learn` for a rule that watches one statistic."""
        if len(self._order) != 1:
            self.learn([x])  # (refused: one value for several statistics)
            return
        stat = self._order[0]
        stat.learn(x, self.rule)
        self._levels = (stat.level,)
        self._level_cells[0].value = stat.level

    def learn(self, values: Sequence[float]) -> None:
        """An accepted window: every statistic learns its value."""
        rule = self.rule
        if len(values) == 1:  # the common case, without a loop
            self.learn_one(values[0])
            return
        for stat, x in zip(self._order, values, strict=True):
            stat.learn(x, rule)
        self._set_levels()

    def restore(self, stats: Mapping[str, RunningStat]) -> None:
        """Take checkpointed statistics (fresh ones for a statistic they lack)."""
        self.stats = {name: stats.get(name) or RunningStat() for name in self.on}
        self._order = [self.stats[name] for name in self.on]
        for stat in self._order:
            stat.update(self.rule)
        self._set_levels()

    def _set_levels(self) -> None:
        self._levels = tuple(stat.level for stat in self._order)
        for cell, level in zip(self._level_cells, self._levels, strict=True):
            cell.value = level  # a float32 already: stored exactly

    def judge(
        self, verdict: torch.Tensor, values: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[float, ...]]:
        """The spike test on the device, with no host read.

        ``verdict`` is the window's non-finite verdict (a 1-element float32 tensor, 0 or
        1), ``values`` the watched statistics (1-element float32 tensors) in :attr:`on`
        order. Returns the skip flag (1 for a non-finite window or a spike, else 0: a
        fresh tensor, as the fused optimizers take ``found_inf``), the tensor to post
        (the verdict, then the statistics) and the thresholds the device compared with.

        Two small ops per statistic (a comparison with the threshold, a select into
        the flag) and one to pack what is posted: the step without a rule makes one
        copy of the verdict in its place.
        """
        if verdict.is_cuda or verdict.is_cpu:
            # A CPU scalar tensor is a launch argument on the CPU and on CUDA (no copy).
            key: int | str = verdict.get_device()  # -1 for the CPU, else the CUDA index
            levels: Sequence[torch.Tensor | float] = self._level_tensors
        else:  # another accelerator: the thresholds as Python numbers
            key, levels = str(verdict.device), self._levels
        one = self._ones.get(key)
        if one is None:
            one = self._ones[key] = torch.ones(1, dtype=torch.float32, device=verdict.device)
        if verdict.dim() != 1:
            verdict = verdict.reshape(1)
        skip = verdict
        packed = [verdict]
        for x, level in zip(values, levels, strict=True):
            if x.dtype is not torch.float32:  # compared in float32, as the host does
                x = x.float()
            if x.is_cpu != verdict.is_cpu or x.get_device() != verdict.get_device():
                x = x.to(verdict.device)
            skip = torch.where(torch.gt(x, level), one, skip)
            packed.append(x.view(1))
        return skip, torch.cat(packed), self._levels

    # ------------------------------------------------------------------ statistics

    @staticmethod
    def local_loss(losses: Sequence[torch.Tensor], weighted: bool) -> torch.Tensor:
        """This rank's share of the window's loss: sum (token-weighted) or mean of its losses.

        Summed in order, in float32: ``((l0 + l1) + l2) / n``.
        """
        total = losses[0] if losses[0].dtype == torch.float32 else losses[0].float()
        if len(losses) > 1:
            for loss in losses[1:]:
                total = total + loss.float()
            if not weighted:
                total = total / len(losses)
        return total

    @staticmethod
    def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        """The total 2-norm of ``grads``, as clipping computes it (a sharded norm made whole).

        Plain dense gradients of one device and dtype take what ``get_total_norm`` runs for
        them (the same two ops, bit for bit) without its grouping; others the call.
        """
        if grads and all(type(g) is torch.Tensor and not g.is_sparse for g in grads):
            first = grads[0]
            if all(g.device == first.device and g.dtype == first.dtype for g in grads):
                norms = torch._foreach_norm(grads, 2.0)
                total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), 2.0)
                return total.float()
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        full = getattr(norm, "full_tensor", None)
        if callable(full):  # FSDP2: a DTensor norm, reduced across ranks
            norm = full()
        return norm.float().reshape(())

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, dict[str, Any]]:
        """The running statistics (plain numbers) for ``AutocastStep.state_dict()``."""
        return {
            name: {"mean": s.mean, "var": s.var, "count": s.count} for name, s in self.stats.items()
        }


def check_state(value: object) -> dict[str, RunningStat]:
    """``state['spike_stats']`` checked whole: running statistics by name."""
    where = "AutocastStep.load_state_dict()"
    again = "Pass the dict returned by AutocastStep.state_dict(), unchanged."
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}: state['spike_stats'] must be a dict of running statistics, got "
            f"{describe(value)}. {again}"
        )
    out: dict[str, RunningStat] = {}
    for name, entry in value.items():
        if name not in STATISTICS:
            raise ValueError(
                f"{where}: state['spike_stats'] holds {name!r}; expected 'loss' or "
                f"'grad_norm'. {again}"
            )
        if not isinstance(entry, Mapping) or set(entry) != {"mean", "var", "count"}:
            raise ValueError(
                f"{where}: state['spike_stats'][{name!r}] must be a dict with 'mean', 'var' "
                f"and 'count', got {describe(entry)}. {again}"
            )
        mean, var, count = entry["mean"], entry["var"], entry["count"]
        func, path = "AutocastStep.load_state_dict", f"state['spike_stats'][{name!r}]"
        for key, number in (("mean", mean), ("var", var)):
            low = 0.0 if key == "var" else None
            check_number(func, f"{path}[{key!r}]", number, minimum=low, fix=again)
        count = check_int(func, f"{path}['count']", count, minimum=0, fix=again)
        out[name] = RunningStat(float(mean), float(var), count)
    return out
