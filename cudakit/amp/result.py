"""What a step returns (:class:`StepResult`), what a step function may return, and what
a step shows of its window (:class:`WindowState`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from typing_extensions import ParamSpec

from .._check import check_number, fail_type

__all__ = [
    "SpikeVerdict",
    "StepResult",
    "SteppedFunction",
    "Verdict",
    "WindowState",
    "extract_loss",
    "weight_tensor",
]

P = ParamSpec("P")


class StepResult(NamedTuple):
    """What one call of an :class:`AutocastStep` did.

    No field forces a host-device synchronisation: ``stepped`` and ``skipped``
    are plain bools decided by the step itself (the non-finite guard needs one
    sync per *optimizer* step, the same one ``GradScaler.step`` makes), while
    ``loss``, ``scale`` and ``grad_norm`` stay tensors on the device; only
    ``.item()``/``float()`` on them syncs, when you choose to.

    >>> r = StepResult(torch.tensor(0.5), None, True, False, None, None)
    >>> r.stepped, float(r.loss), r.spike, r.nonfinite
    (True, 0.5, False, None)

    .. versionadded:: 0.1
    """

    #: The loss the function returned, detached (not divided by ``accumulate``).
    loss: torch.Tensor
    #: The function's original return value (``None`` for :meth:`AutocastStep.flush`).
    output: Any
    #: True when the optimizer really updated the weights on this call.
    stepped: bool
    #: True when a non-finite loss or gradient was caught and the step dropped.
    skipped: bool
    #: The loss scale (0-dim float32 tensor) this call's loss was multiplied by; None without fp16.
    scale: torch.Tensor | None
    #: Total gradient norm before clipping (0-dim tensor) on clipping steps; else None.
    grad_norm: torch.Tensor | None
    #: True when the step was skipped for a loss spike (``skip_spikes=``), with a finite
    #: loss and gradients; ``skipped`` is then True too. Read lazily on the sync-free path.
    spike: bool = False
    #: Where the first inf/NaN of a window skipped for one came from (a
    #: :class:`~cudakit.amp.NonFiniteSource`, with ``locate_nonfinite=True``); else None.
    #: On a GPU's sync-free path it is read lazily: test it with ``if result.nonfinite:``.
    nonfinite: Any = None


class SteppedFunction(Protocol[P]):
    """A loss function decorated by an :class:`AutocastStep`: each call returns a StepResult.

    .. versionadded:: 0.1
    """

    #: The :class:`AutocastStep` that runs the step (shared state).
    autocast_step: Any

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> StepResult: ...

    def flush(self) -> StepResult | None:
        """Step on a partial accumulation window; see :meth:`AutocastStep.flush`."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state; see :meth:`AutocastStep.state_dict`."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint; see :meth:`AutocastStep.load_state_dict`."""


def extract_loss(output: object, *, explicit: bool = False) -> tuple[torch.Tensor, object]:
    """The loss and its weight (None when unweighted) inside a step function's return.

    Accepted: a scalar tensor, ``(loss, ...)``, ``{"loss": loss, ...}`` and
    ``{"loss": summed_loss, "weight": count, ...}`` (a token-weighted loss).
    ``explicit``: ``output`` was passed to ``AutocastStep.backward(loss)``, which the
    messages then name, rather than returned by a decorated function.
    """
    # Fast path: a plain tensor that passes every check below (errors come from the slow path).
    if (
        type(output) is torch.Tensor
        and output.requires_grad
        and output.numel() == 1
        and output.is_floating_point()
    ):
        return output, None
    weight: object = None
    at = " in AutocastStep.backward(loss=...)" if explicit else ""
    came = (
        "AutocastStep.backward(loss=...) got"
        if explicit
        else "autocast_step: the function returned"
    )
    give = "Pass" if explicit else "Return"
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping):
        if "loss" not in output:
            raise TypeError(
                f"{came} a mapping without a 'loss' key (keys: {sorted(map(str, output))}). "
                f"{give} {{'loss': loss, ...}}, a (loss, ...) tuple, or the scalar loss tensor "
                "itself."
            )
        loss = output["loss"]
        weight = output.get("weight")
    elif isinstance(output, (tuple, list)):
        if not output:
            raise TypeError(
                f"{came} an empty {type(output).__name__}; {give.lower()} the scalar loss "
                "tensor, (loss, ...) or {'loss': loss, ...}."
            )
        loss = output[0]
    elif explicit:
        fail_type(
            "AutocastStep.backward",
            "loss",
            "the loss: a scalar tensor, a tuple or list whose first item is the loss, or a "
            "mapping with a 'loss' key",
            output,
            "Pass the loss tensor the block computed, e.g. step.backward(loss).",
        )
    else:
        raise TypeError(
            "autocast_step: the function must return the loss: a scalar tensor, a tuple or "
            f"list whose first item is the loss, or a mapping with a 'loss' key; got "
            f"{type(output).__name__}. Did you forget `return loss`?"
        )
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"autocast_step: the loss must be a torch.Tensor, got {type(loss).__name__} "
            f"{loss!r}{at}. {give} the loss tensor itself, not loss.item()."
        )
    if not loss.is_floating_point():
        raise TypeError(
            "autocast_step: the loss must be a real floating-point tensor, got dtype "
            f"{loss.dtype}{at}. "
            + (
                "A complex loss has no single direction to minimise: return its real part, "
                "its abs() or a norm."
                if loss.is_complex()
                else "An integer or bool loss has no gradient: compute it in floating point "
                "(e.g. count.float())."
            )
        )
    if loss.numel() != 1:
        raise ValueError(
            f"autocast_step: the loss must be a scalar tensor, got shape {tuple(loss.shape)}{at}. "
            "Reduce it first, e.g. loss.mean() or loss.sum()."
        )
    if not loss.requires_grad:
        raise ValueError(
            f"autocast_step: the loss does not require grad{at}, so there is nothing to "
            "backpropagate. Was it computed under torch.no_grad()/inference_mode(), from "
            "detached tensors, or with a frozen model?"
        )
    return loss, weight


def weight_tensor(weight: object, like: torch.Tensor) -> torch.Tensor:
    """A token weight as a 0-dim float32 tensor on ``like``'s device (no host sync)."""
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            raise ValueError(
                "autocast_step: the returned 'weight' must be a one-element real tensor or a "
                f"number (the count of items the summed loss covers), got a tensor of shape "
                f"{tuple(weight.shape)} and dtype {weight.dtype}. Return e.g. "
                "{'loss': loss_sum, 'weight': mask.sum()}."
            )
        return weight.detach().reshape(()).to(device=like.device, dtype=torch.float32)
    number = check_number(
        "autocast_step",
        "weight",
        weight,
        minimum=0,
        expected="a finite number >= 0 or a one-element tensor",
        fix="The 'weight' the step function returns counts the items (e.g. non-padding "
        "tokens) its summed loss covers: return e.g. {'loss': loss_sum, 'weight': mask.sum()}.",
    )
    return torch.tensor(number, dtype=torch.float32, device=like.device)


class WindowState(Protocol):
    """What :attr:`AutocastStep.window` shows: the accumulation window being filled, as
    cudakit's own parts (``speed_report``, ``Checkpointer``) read it, once bound.

    .. versionadded:: 0.1
    """

    @property
    def position(self) -> int:
        """Micro-steps taken in the window (0 between windows)."""
        ...

    @property
    def backwarded(self) -> Callable[[], torch.Tensor | None] | None:
        """After the window's last micro-step: reads a gradient that a ``zero_grad()``
        before the step would take away (None before)."""
        ...


class Verdict:
    """``StepResult.stepped``/``skipped`` of a sync-free step: a bool read when you ask.

    The verdict stays a device tensor until ``bool()``, ``==`` or ``repr()`` reads it;
    that read waits for the step's kernels, as ``.item()`` would, so a loop that never
    reads it never waits.

    >>> v = Verdict(torch.zeros(1), skipped=True)
    >>> bool(v), v == False, v, int(v), sum([v, v])
    (False, True, False, 0, 0)

    .. versionadded:: 0.1
    """

    __slots__ = ("_flag", "_skipped", "_value")

    def __init__(self, flag: torch.Tensor, *, skipped: bool) -> None:
        if not _verdict_inputs(flag, skipped):
            _refuse_verdict(type(self).__name__, flag, skipped)
        self._flag = flag
        self._skipped = skipped
        self._value: bool | None = None

    def __bool__(self) -> bool:
        if self._value is None:
            self._value = self._read()
        return self._value

    def _read(self) -> bool:
        found = bool(self._flag.item() > 0)
        return found if self._skipped else not found

    def __eq__(self, other: object) -> bool:
        return bool(self) == other

    def __int__(self) -> int:
        return int(bool(self))

    __index__ = __int__

    def __add__(self, other: object) -> Any:
        return int(self) + other  # type: ignore[operator]

    def __radd__(self, other: object) -> Any:
        return other + int(self)  # type: ignore[operator]

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return repr(bool(self))


def _verdict_inputs(flag: object, skipped: object) -> bool:
    return isinstance(flag, torch.Tensor) and type(skipped) is bool


def _refuse_verdict(name: str, flag: object, skipped: object) -> None:
    if not isinstance(flag, torch.Tensor):
        fail_type(
            name,
            "flag",
            "a one-element tensor (positive where the step found inf/NaN)",
            flag,
            f"Pass e.g. {name}(torch.zeros(1), skipped=True).",
        )
    fail_type(name, "skipped", "True or False", skipped, "Pass skipped=True or skipped=False.")


class SpikeVerdict(Verdict):
    """``StepResult.spike`` of a sync-free step: read when you ask, like :class:`Verdict`.

    ``flag`` holds the window's non-finite verdict, then the statistics a spike rule
    watched; ``thresholds`` are the levels they were compared with.
    """

    __slots__ = ("_thresholds",)

    def __init__(self, flag: torch.Tensor, thresholds: tuple[float, ...]) -> None:
        super().__init__(flag, skipped=True)
        self._thresholds = thresholds

    def _read(self) -> bool:
        found, *values = self._flag.tolist()
        return not found > 0 and any(x > t for x, t in zip(values, self._thresholds, strict=True))
