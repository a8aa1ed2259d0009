"""Checkpoint state of an :class:`~cudakit.amp.AutocastStep`: validated whole, then applied.

:func:`validate` reads a state dict and returns a :class:`Restored` with every field
checked (types, ranges, shapes, the accumulate/scaler compatibility) or raises
``TypeError``/``ValueError`` naming the field. Only then does the step apply it, so
a refused state changes nothing: not the counters, not the scaler, not a ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn

import torch

from .._check import check_int, check_number, fail_type, fail_value, is_int
from .._dist import group_world_size
from ._args import StepConfig
from ._buffers import BufferSnapshot
from ._counters import StepCounters
from ._judge import WindowJudge
from ._params import StepParams
from ._window import GradSync, Stage, Window

__all__ = ["KEYS", "Restored", "StepCheckpoint", "apply", "capture", "validate"]

KEYS = (
    "accumulate",
    "position",
    "steps",
    "skipped_steps",
    "consecutive_skipped",
    "scaler",
    "grads",
    "window_losses",
)
_WHERE = "AutocastStep.load_state_dict()"
_FUNC = "AutocastStep.load_state_dict"
_AGAIN = "Pass the dict returned by AutocastStep.state_dict(), unchanged."
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class Restored(NamedTuple):
    """A checked state, ready to apply."""

    position: int
    steps: int
    skipped_steps: int
    consecutive_skipped: int
    scaler: Mapping[str, Any] | None
    grads: list[torch.Tensor | None]
    window_losses: list[torch.Tensor]
    window_weight: torch.Tensor | None


def _fail(
    field: str | tuple[str, object],
    expected: str,
    got: object,
    exc: type[Exception] = ValueError,
) -> NoReturn:
    """Raise for ``state[field]`` (or ``state[field][key]`` for a ``(field, key)`` pair)."""
    fail = fail_type if exc is TypeError else fail_value
    fail(_FUNC, f"state{_path(field)}", expected, got, _AGAIN)


def _path(field: str | tuple[str, object]) -> str:
    return f"[{field!r}]" if isinstance(field, str) else f"[{field[0]!r}][{field[1]!r}]"


def _count(state: Mapping[str, Any], field: str) -> int:
    return check_int(_FUNC, f"state{_path(field)}", state[field], minimum=0, fix=_AGAIN)


def _scalar_tensor(value: object, field: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(field, "a one-element tensor", value, TypeError)
    if value.numel() != 1 or value.is_complex():
        _fail(field, "a one-element real tensor", value)
    return value


def _real(value: torch.Tensor, field: str | tuple[str, object]) -> None:
    """Refuse a tensor on the meta device: it holds no values to restore."""
    if value.is_meta:
        path = f"[{field!r}]" if isinstance(field, str) else f"[{field[0]!r}][{field[1]!r}]"
        raise ValueError(
            f"{_WHERE}: state{path} is on the meta device, so it holds no values to "
            "restore (was the checkpoint read with torch.load(..., map_location='meta')?). "
            "Load it with map_location='cpu' (or the training device), or resume from a "
            "state taken at a window boundary (step.position == 0). Nothing was changed."
        )


def _check_scaler(
    value: object, has_scaler: bool, dtype: torch.dtype, scaling: bool
) -> Mapping[str, Any] | None:
    if (value is None) != (not has_scaler):
        raise ValueError(
            f"{_WHERE}: the checkpoint was "
            f"{'taken without' if value is None else 'taken with'} a GradScaler "
            f"but this step {'has one' if has_scaler else 'has none'} "
            f"(dtype={dtype}). Resume with the same dtype=... as the checkpointed run."
        )
    if value is None:
        return None
    if not isinstance(value, Mapping):
        _fail("scaler", "None or the dict from GradScaler.state_dict()", value, TypeError)
    if bool(value) != scaling:  # a disabled scaler's state dict is empty
        raise ValueError(
            f"{_WHERE}: the checkpoint was taken with "
            f"{'loss scaling on' if value else 'a disabled GradScaler'}, but this step's "
            f"GradScaler is {'disabled' if value else 'enabled'}. Resume with the scaler "
            "set as in the checkpointed run (GradScaler(enabled=...))."
        )
    if not value:
        return value
    for key in _SCALER_KEYS:
        if key not in value:
            _fail("scaler", f"a GradScaler state with {key!r}", value)
    _scaler_number(value, "scale", "a positive finite number", lambda x: 0 < x < math.inf)
    _scaler_number(value, "growth_factor", "a finite number > 1", lambda x: 1 < x < math.inf)
    _scaler_number(value, "backoff_factor", "a number in (0, 1)", lambda x: 0 < x < 1)
    _scaler_int(value, "growth_interval", 1)
    _scaler_int(value, "_growth_tracker", 0)
    return value


def _plain(number: object) -> object:
    """A one-element tensor's Python number (GradScaler keeps some as tensors)."""
    if isinstance(number, torch.Tensor) and number.numel() == 1 and not number.is_complex():
        return number.item()
    return number


def _scaler_number(
    state: Mapping[str, Any], key: str, expected: str, ok: Callable[[float], bool]
) -> None:
    number = _plain(state[key])
    arg = f"state{_path(('scaler', key))}"
    value = check_number(_FUNC, arg, number, finite=False, expected=expected, fix=_AGAIN)
    if not ok(value):
        _fail(("scaler", key), expected, state[key])


def _scaler_int(state: Mapping[str, Any], key: str, minimum: int) -> None:
    arg = f"state{_path(('scaler', key))}"
    check_int(_FUNC, arg, _plain(state[key]), minimum=minimum, fix=_AGAIN)


def validate(
    state: object,
    *,
    accumulate: int,
    has_scaler: bool,
    dtype: torch.dtype,
    params: Sequence[torch.Tensor],
    scaling: bool = True,
) -> Restored:
    """Check a whole state against the step it is loaded into; raise before any change."""
    if not isinstance(state, Mapping):
        fail_type(
            "AutocastStep.load_state_dict",
            "state",
            "the dict from AutocastStep.state_dict()",
            state,
            "Pass the dict that state_dict() returned (e.g. checkpoint['step']).",
        )
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ValueError(
            f"AutocastStep.load_state_dict(state=...): the state is missing {missing}; pass "
            "the dict returned by AutocastStep.state_dict()."
        )
    saved_accumulate = check_int(
        _FUNC, "state['accumulate']", state["accumulate"], minimum=1, fix=_AGAIN
    )
    position = _count(state, "position")
    if position >= saved_accumulate:
        _fail("position", f"an int from 0 to accumulate - 1 = {saved_accumulate - 1}", position)
    if position and saved_accumulate != accumulate:
        raise ValueError(
            f"load_state_dict(): the checkpoint was taken mid-window with accumulate="
            f"{saved_accumulate}, but this step has accumulate={accumulate}. "
            "Resume with the same accumulate=..., or checkpoint right after an optimizer step."
        )
    steps = _count(state, "steps")
    skipped = _count(state, "skipped_steps")
    consecutive = _count(state, "consecutive_skipped")
    if consecutive > skipped:
        _fail("consecutive_skipped", f"at most skipped_steps={skipped}", consecutive)
    scaler = _check_scaler(state["scaler"], has_scaler, dtype, scaling)

    raw_grads = state["grads"]
    if not isinstance(raw_grads, (list, tuple)):
        _fail("grads", "a list of tensors or None", raw_grads, TypeError)
    grads = list(raw_grads)
    if position and len(grads) != len(params):
        raise ValueError(
            f"load_state_dict(): the checkpoint holds gradients for {len(grads)} "
            f"parameters but the optimizer has {len(params)}; resume with the same model "
            "and optimizer."
        )
    for i, (p, g) in enumerate(zip(params, grads, strict=False)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            _fail(("grads", i), "a tensor or None", g, TypeError)
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(
                f"load_state_dict(): a checkpointed gradient has shape {tuple(g.shape)} "
                f"but its parameter has shape {tuple(p.shape)}; resume with the same model."
            )
        if not g.is_floating_point():
            _fail(("grads", i), f"a floating-point tensor like its parameter ({p.dtype})", g)
        if position:
            _real(g, ("grads", i))

    raw_losses = state["window_losses"]
    if not isinstance(raw_losses, (list, tuple)):
        _fail("window_losses", "a list of one-element tensors", raw_losses, TypeError)
    losses = [_scalar_tensor(t, "window_losses") for t in raw_losses]
    if len(losses) > position:
        _fail("window_losses", f"at most position={position} losses", raw_losses)
    for i, t in enumerate(losses):
        _real(t, ("window_losses", i))
    weight = state.get("window_weight")
    if weight is not None:
        weight = _scalar_tensor(weight, "window_weight")
        _real(weight, "window_weight")
        if not bool(torch.isfinite(weight).all() & (weight >= 0).all()):
            _fail("window_weight", "a finite count >= 0 (the window's summed weights)", weight)
    saved_buffers = state.get("window_buffers")  # their shapes are checked against the model
    if saved_buffers is not None and not (
        isinstance(saved_buffers, (list, tuple))
        and all(isinstance(t, torch.Tensor) for t in saved_buffers)
    ):
        _fail("window_buffers", "a list of tensors or None", saved_buffers, TypeError)
    if saved_buffers is not None and position:
        for i, t in enumerate(saved_buffers):
            _real(t, ("window_buffers", i))
    return Restored(
        position=position,
        steps=steps,
        skipped_steps=skipped,
        consecutive_skipped=consecutive,
        scaler=scaler,
        grads=grads if position else [],
        window_losses=losses,
        window_weight=weight if position else None,
    )


def capture(
    *,
    accumulate: int,
    window: Window,
    counters: StepCounters,
    scaler: torch.amp.GradScaler | None,
    params: list[torch.Tensor],
    buffers: BufferSnapshot | None,
) -> dict[str, Any]:
    """The step's state dict: mid-window, the gradients so far (cloned) come with it."""
    grads: list[torch.Tensor | None] = []
    if window.position:
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    return {
        "accumulate": accumulate,
        "position": window.position,
        "steps": counters.steps,
        "skipped_steps": counters.skipped,
        "consecutive_skipped": counters.consecutive,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "grads": grads,
        "window_losses": [t.clone() for t in window.losses],
        "window_weight": None if window.weight is None else window.weight.clone(),
        # The buffers as the window opened, for a skip after resuming mid-window.
        "window_buffers": (buffers.copies() if buffers is not None and window.position else None),
    }


def apply(
    restored: Restored,
    *,
    window: Window,
    counters: StepCounters,
    scaler: torch.amp.GradScaler | None,
    params: list[torch.Tensor],
    buffers: BufferSnapshot | None,
    saved_buffers: list[torch.Tensor] | None,
    sync_active: bool,
) -> None:
    """Apply a state :func:`validate` accepted (``saved_buffers`` checked by the snapshot)."""
    if scaler is not None and restored.scaler is not None:
        scaler.load_state_dict(dict(restored.scaler))
    if restored.position:
        for p, g in zip(params, restored.grads, strict=False):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True)
    window.clear()
    window.position = restored.position
    if restored.position:  # mid-window: the restored gradients count
        # Mid-window gradients were accumulated without gradient sync: flush() syncs them.
        window.stage = Stage.UNSYNCED if sync_active else Stage.OPEN
    window.losses.extend(torch.as_tensor(t).detach().clone() for t in restored.window_losses)
    window.last_loss = window.losses[-1] if window.losses else None
    if restored.window_weight is not None:
        window.weight = restored.window_weight.detach().to(torch.float32).clone()
        window.weighted = True
    elif restored.position:
        window.weighted = False
    if buffers is not None:
        buffers.forget()
        if saved_buffers is not None:
            buffers.load(saved_buffers)
    counters.steps = restored.steps
    counters.skipped = restored.skipped_steps
    counters.consecutive = restored.consecutive_skipped


class StepCheckpoint:
    """The checkpoint part of an :class:`~cudakit.amp.AutocastStep`: its state, saved and loaded.

    Holds the parts the state covers: the window, the counters, the scaler, the
    buffer snapshot, the parameters, the judge (whose unread verdicts a save settles and
    a load forgets) and the gradient sync (a mid-window state is refused under FSDP2 and
    multi-rank DDP).
    """

    def __init__(
        self,
        config: StepConfig,
        window: Window,
        counters: StepCounters,
        buffers: BufferSnapshot | None,
        params: StepParams,
        judge: WindowJudge,
        sync: GradSync,
    ) -> None:
        self._scaler = config.scaler
        self._scaling = config.scaling
        self._dtype = config.dtype
        self._window = window
        self._counters = counters
        self._buffers = buffers
        self._params = params
        self._judge = judge
        self._sync = sync

    def save(self) -> dict[str, Any]:
        """The step's state dict (``AutocastStep.state_dict``)."""
        self._judge.settle()
        window = self._window
        if window.position and self._sync.kind == "fsdp":
            raise RuntimeError(
                f"AutocastStep.state_dict() mid-window ({window.position} of "
                f"{window.accumulate} micro-steps) under FSDP2: the window's gradients live "
                "inside FSDP2 (unsharded, not yet reduce-scattered), not in .grad, so they "
                "cannot be checkpointed (preserve_state(extra=(step,)) and warmup(amp=step) "
                "take this state too). Take it after the window's optimizer step "
                "(step.position == 0), or call step.flush() first."
            )
        if window.position and _ddp_ranks(self._sync):
            raise RuntimeError(
                f"AutocastStep.state_dict() mid-window ({window.position} of "
                f"{window.accumulate} micro-steps) under DDP: the window's micro-steps ran "
                "without gradient sync, so each rank holds its own gradients, and the usual "
                "save on rank 0 would lose the others' (preserve_state(extra=(step,)) and "
                "warmup(amp=step) take this state too). Checkpoint at a window boundary "
                "(step.position == 0), or call step.flush() first."
            )
        state = capture(
            accumulate=window.accumulate,
            window=window,
            counters=self._counters,
            scaler=self._scaler,
            params=self._params.params(),
            buffers=self._buffers,
        )
        state.update(self._judge.watch.state(self._counters))  # loss spikes (skip_spikes=)
        return state

    def load(self, state: Mapping[str, Any]) -> None:
        """Check ``state`` whole, then apply it (``AutocastStep.load_state_dict``)."""
        params = self._params.params()
        restored = validate(
            state,
            accumulate=self._window.accumulate,
            has_scaler=self._scaler is not None,
            dtype=self._dtype,
            params=params,
            scaling=self._scaling,
        )
        if restored.position and self._sync.kind == "fsdp":
            raise ValueError(
                f"{_WHERE}: the state is mid-window (position {restored.position}), but this "
                "step trains an FSDP2 model, whose accumulated gradients cannot be restored. "
                "Resume from a checkpoint taken at a window boundary (step.position == 0)."
            )
        if restored.position and _ddp_ranks(self._sync):
            raise ValueError(
                f"{_WHERE}: the state is mid-window (position {restored.position}), but this "
                "step trains a DDP model on several ranks, where each rank's window holds its "
                "own unsynced gradients; one saved state cannot stand for all of them. Resume "
                "from a checkpoint taken at a window boundary (step.position == 0)."
            )
        saved_buffers = state.get("window_buffers")
        buffers = self._buffers
        checked = (
            buffers.check(saved_buffers)
            if buffers is not None and saved_buffers is not None and restored.position
            else None
        )
        watch = self._judge.watch
        apply_watch = watch.check_state(state)  # loss spikes; older checkpoints lack them
        self._judge.forget_pending()  # verdicts of windows the checkpoint replaces
        apply(
            restored,
            window=self._window,
            counters=self._counters,
            scaler=self._scaler,
            params=params,
            buffers=buffers,
            saved_buffers=checked,
            sync_active=self._sync.active,
        )
        apply_watch(self._counters)

    def restore_exact(self, state: Mapping[str, Any]) -> None:
        """:meth:`load` with the state's ``accumulate`` too (``preserve_state``'s restore).

        A warm-up block may close a window and change ``accumulate``; putting the step back
        exactly takes the saved value as well, which a resume does not (there the step's own
        ``accumulate`` wins at a window boundary).
        """
        window = self._window
        # Micro-steps of an FSDP2 step that ran without gradient sync left their gradients
        # inside FSDP2, which a state cannot put back.
        leaked = self._sync.kind == "fsdp" and window.stage is Stage.UNSYNCED
        saved = state.get("accumulate") if isinstance(state, Mapping) else None
        previous = window.accumulate
        if is_int(saved) and saved >= 1:
            window.accumulate = int(saved)
        try:
            self.load(state)
        except BaseException:
            window.accumulate = previous
            raise
        if leaked:
            raise RuntimeError(
                "preserve_state(): the block ran micro-steps of an FSDP2 autocast_step "
                "without finishing their window; FSDP2 keeps their gradients inside itself, "
                "where nothing can put them back, so they would be added to the next window. "
                "End the block's windows (a full window, or step.flush()), or run the "
                "warm-up with warmup(model, batch, ...) instead."
            )


def _ddp_ranks(sync: GradSync) -> bool:
    """Whether the step trains a DDP model across more than one rank."""
    return sync.kind == "ddp" and group_world_size() > 1
