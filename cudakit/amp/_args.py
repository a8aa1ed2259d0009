"""Argument checks of :func:`~cudakit.amp.autocast_step`, and its resolved configuration.

The checks particular to it: optimizers and schedulers (one or a list) and the device
type of their parameters (``compile=``'s are in :mod:`~cudakit.amp._compiling`); plain
kinds and ranges go through
:mod:`cudakit._check`. :func:`resolve_options` runs every check and decides the
precision, before the step builds anything, and returns one frozen :class:`StepConfig`
that every part of the step is handed (configuration apart from per-call state, as
torch's ``StateDictOptions`` is).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .._check import (
    check_bool,
    check_int,
    check_number,
    check_optional,
    check_type,
    fail_type,
    fail_value,
)
from ._compiling import check_compile
from .policy import (
    Capabilities,
    Precision,
    check_autocast,
    decide_precision,
    log_choice,
    parse_dtype,
    probe_capabilities,
)
from .spikes import SpikeRule, check_skip_spikes

__all__ = [
    "WATCH_OPTIONS",
    "StepConfig",
    "check_fp16_weights",
    "check_model_owns",
    "check_optimizers",
    "check_schedulers",
    "device_type_of",
    "resolve_options",
]


def _as_tuple(value: object) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_optimizers(optimizer: object) -> tuple[torch.optim.Optimizer, ...]:
    optimizers = _as_tuple(optimizer)
    if not optimizers:
        raise ValueError(
            f"autocast_step(optimizer=...) got an empty {type(optimizer).__name__} of "
            "optimizers; pass one optimizer, or a list such as [opt_matrices, opt_embeddings]."
        )
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            continue
        if isinstance(opt, type):
            raise TypeError(
                f"autocast_step(optimizer=...) got the class {opt.__name__}, not an optimizer. "
                f"Build it first: autocast_step({opt.__name__}(model.parameters(), lr=...))."
            )
        hint = ""
        if callable(opt) and not isinstance(opt, torch.nn.Module):
            hint = (
                " It looks like @autocast_step was used without arguments; write "
                "@autocast_step(optimizer, ...) above the function."
            )
        elif isinstance(opt, torch.nn.Module):
            hint = " Pass the optimizer first, and the model as model=... (for DDP no_sync)."
        fail_type(
            "autocast_step",
            "optimizer",
            "a torch.optim.Optimizer (or a list of them) as its first argument",
            opt,
            (hint or " Pass e.g. autocast_step(torch.optim.AdamW(model.parameters())).").strip(),
        )
    for opt in optimizers:
        if _needs_closure(opt):
            raise TypeError(
                f"autocast_step() cannot step {type(opt).__name__}: its step() needs a closure "
                "that re-evaluates the loss (several forward/backward passes per step), and "
                "autocast_step runs one backward per call. Call opt.step(closure) yourself, "
                "with torch.autocast inside the closure, or use an optimizer whose step() "
                "takes no closure."
            )
    if len({id(o) for o in optimizers}) != len(optimizers):
        fail_value(
            "autocast_step",
            "optimizer",
            "each optimizer once",
            optimizer,
            "It lists the same optimizer twice; each optimizer steps once per step, so list "
            "each one once, e.g. autocast_step([opt_a, opt_b]).",
        )
    _check_shared(optimizers)
    return optimizers


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _check_shared(optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Refuse a parameter held by two optimizers: both would step it, twice per step."""
    if len(optimizers) == 1:
        return
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for p in _params(opt):
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"autocast_step() got a parameter of shape {tuple(p.shape)} in optimizer "
                    f"{j} ({type(optimizers[j]).__name__}) and in optimizer {i} "
                    f"({type(opt).__name__}): both would step it, twice per step. Give each "
                    "parameter to one optimizer once (e.g. split model.named_parameters() "
                    "by name or shape)."
                )


def check_model_owns(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer none of whose parameters is in ``model`` (a stray optimizer).

    ``model``'s forward never gives it gradients, and under DDP or FSDP2 they would not
    be reduced across ranks either.
    """
    mine = {id(p) for p in model.parameters()}
    for i, opt in enumerate(optimizers):
        if not any(id(p) in mine for p in _params(opt)):
            raise ValueError(
                f"autocast_step(model=...): optimizer {i} ({type(opt).__name__}) has none of "
                f"the model's parameters, so the {type(model).__name__}'s forward never gives "
                "it gradients (and under DDP or FSDP2 nothing would reduce them across ranks). "
                "Pass the outer module that holds every optimizer's parameters as model=, or "
                "leave that optimizer out and step it yourself."
            )


def check_fp16_weights(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse float16 parameters when a GradScaler unscales their gradients."""
    half = sum(p.dtype == torch.float16 for opt in optimizers for p in _params(opt))
    if half:
        raise ValueError(
            f"autocast_step(dtype=torch.float16): {half} of the optimizer's parameters are "
            "float16 (model.half()?), and loss scaling cannot unscale float16 gradients "
            "(torch: 'Attempting to unscale FP16 gradients'). Mixed precision keeps float32 "
            "master weights and runs the compute in float16 under autocast: drop "
            "model.half(). To train float16 weights as they are, pass "
            "scaler=torch.amp.GradScaler(enabled=False) (no loss scaling)."
        )


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` has a required ``closure`` argument (LBFGS)."""
    try:
        params = inspect.signature(opt.step).parameters
    except (TypeError, ValueError):  # a builtin or an odd callable: assume it does not
        return False
    closure = params.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_schedulers(
    scheduler: object, optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[Any, ...]:
    if scheduler is None:
        return ()
    schedulers = _as_tuple(scheduler)
    for s in schedulers:
        if isinstance(s, type):
            raise TypeError(
                f"autocast_step(scheduler=...) got the class {s.__name__}, not a scheduler. "
                f"Build it on the optimizer first: scheduler={s.__name__}(optimizer, ...)."
            )
        if isinstance(s, torch.optim.Optimizer):
            raise TypeError(
                f"autocast_step(scheduler=...) got an optimizer ({type(s).__name__}), which "
                "would be stepped twice. Pass optimizers as the first argument "
                "(autocast_step([opt_a, opt_b])) and learning-rate schedulers as scheduler=."
            )
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "autocast_step(scheduler=ReduceLROnPlateau) cannot work: it steps on a "
                "validation metric, not once per optimizer step. Leave it out and call "
                "scheduler.step(val_loss) after each validation."
            )
        if not callable(getattr(s, "step", None)):
            fail_type(
                "autocast_step",
                "scheduler",
                "a learning-rate scheduler with a step() method (or a list of them)",
                s,
                "Pass e.g. scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000).",
            )
        owner = getattr(s, "optimizer", None)
        if isinstance(owner, torch.optim.Optimizer) and all(owner is not o for o in optimizers):
            raise ValueError(
                f"autocast_step(scheduler=...) got a {type(s).__name__} of an optimizer this "
                "step does not step; pass that optimizer too (autocast_step([opt_a, opt_b], "
                "scheduler=[sched_a, sched_b])), or drive that scheduler yourself."
            )
    if len({id(s) for s in schedulers}) != len(schedulers):
        raise ValueError(
            "autocast_step(scheduler=...) got the same scheduler twice in its list; it would "
            "step twice per optimizer step, so list each one once."
        )
    return schedulers


def device_type_of(params: Sequence[torch.Tensor]) -> str:
    types = {p.device.type for p in params}
    if not types:
        raise ValueError(
            "autocast_step() got an optimizer with no parameters, so there is nothing to "
            "train. Build it from the model's parameters, e.g. "
            "torch.optim.AdamW(model.parameters()), before wrapping it."
        )
    if len(types) == 1:
        return types.pop()
    return sorted(types - {"cpu"})[0]


#: The watching keywords of :class:`~cudakit.amp.AutocastStep` (``**watch``).
WATCH_OPTIONS = ("skip_spikes", "locate_nonfinite")

#: Default ``max_skipped``: fp16's scaler may legitimately skip a run of early
#: steps while it lowers an over-large initial scale (2**16 halves to 1 in 16 steps);
#: bf16 and fp32 have no scale to adjust, so a streak of bad steps means trouble.
_DEFAULT_MAX_SKIPPED_FP16 = 20
_DEFAULT_MAX_SKIPPED = 10


@dataclasses.dataclass(frozen=True, eq=False)
class StepConfig:
    """The checked, resolved configuration of one :func:`~cudakit.amp.autocast_step`.

    Made once by :func:`resolve_options` and handed, as it is, to every part of the
    step; what changes while the step runs (``accumulate``, ``max_skipped``) lives in
    the part that owns it, which starts from the value here.
    """

    #: The optimizers the step steps, in order, and the schedulers (as given, and as a tuple).
    optimizers: tuple[torch.optim.Optimizer, ...]
    scheduler: Any
    schedulers: tuple[Any, ...]
    model: torch.nn.Module | None
    #: The GradScaler in use (fp16 only), else None; ``scaling``: it is enabled.
    scaler: torch.amp.GradScaler | None
    scaling: bool
    precision: Precision
    device_type: str
    max_grad_norm: float | None
    accumulate: int
    skip_nonfinite: bool
    #: ``max_skipped=`` with its default applied, and that default (for ``None`` later).
    max_skipped: int
    default_max_skipped: int
    compile_options: dict[str, Any] | None
    skip_spikes: SpikeRule | None
    locate_nonfinite: bool

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (``torch.float32`` when autocast is off)."""
        return self.precision.dtype

    @property
    def enabled(self) -> bool:
        """Whether autocast is on."""
        return self.precision.autocast

    @property
    def guarded(self) -> bool:
        """Whether a window's verdict is checked (the non-finite guard or the scaler's)."""
        return self.skip_nonfinite or self.scaling


#: What ``accumulate=`` is, for its error messages.
ACCUMULATE_FIX = (
    "It is the number of micro-batches whose gradients are summed before each "
    "optimizer step (1 = step on every call)."
)
#: What ``max_skipped=`` is, for its error messages.
MAX_SKIPPED_FIX = (
    "It is the number of consecutive skipped steps that raise NonFiniteStepsError; "
    "None for the default; pass sys.maxsize to never raise."
)


def check_accumulate(func: str, value: object) -> int:
    """``accumulate=`` as an int >= 1."""
    return check_int(func, "accumulate", value, minimum=1, fix=ACCUMULATE_FIX)


def check_max_skipped(func: str, value: object) -> int | None:
    """``max_skipped=`` as an int >= 1, or None for the default."""
    return check_optional(check_int, func, "max_skipped", value, minimum=1, fix=MAX_SKIPPED_FIX)


_NO_CAPS = Capabilities()


def resolve_options(
    optimizer: object,
    *,
    model: object = None,
    dtype: torch.dtype | str = "auto",
    enabled: bool = True,
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    accumulate: int = 1,
    scheduler: object = None,
    skip_nonfinite: bool = True,
    max_skipped: int | None = None,
    compile: object = False,
    **watch: Any,
) -> StepConfig:
    """Check every argument of :func:`~cudakit.amp.autocast_step` and decide the precision.

    The defaults are :func:`~cudakit.amp.autocast_step`'s. Raises
    ``TypeError``/``ValueError`` naming the argument before anything is built; makes the
    GradScaler fp16 needs and logs an automatic precision choice once. ``watch`` holds
    the watching keywords (:data:`WATCH_OPTIONS`) and any unknown one, checked last.
    """
    where = "autocast_step"
    optimizers = check_optimizers(optimizer)
    check_bool(where, "enabled", enabled)
    check_bool(where, "skip_nonfinite", skip_nonfinite)
    accumulate = check_accumulate(where, accumulate)
    clip = check_optional(
        check_number,
        where,
        "max_grad_norm",
        max_grad_norm,
        positive=True,
        fix="For example max_grad_norm=1.0; None turns clipping off.",
    )
    max_skipped = check_max_skipped(where, max_skipped)
    if model is not None:
        model = check_type(
            "autocast_step",
            "model",
            model,
            torch.nn.Module,
            expected="the torch.nn.Module being trained (usually the DDP or FSDP2 wrapper)",
            fix="Pass model=model, or leave it out.",
        )
        check_model_owns(model, optimizers)
    schedulers = check_schedulers(scheduler, optimizers)
    compile_options = check_compile(compile)
    if isinstance(scaler, type):
        raise TypeError(
            f"autocast_step(scaler=...) got the class {scaler.__name__}, not a GradScaler. "
            "Build it first: scaler=torch.amp.GradScaler('cuda'), or leave scaler= out and "
            "one is made for float16."
        )
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        fail_type(
            "autocast_step",
            "scaler",
            "a torch.amp.GradScaler",
            scaler,
            "Pass scaler=torch.amp.GradScaler('cuda'), or leave scaler= out and one is made "
            "for float16.",
        )
    requested = parse_dtype(dtype)
    device_type = device_type_of(
        [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    )
    # A disabled GradScaler (torch's recipe: GradScaler(enabled=use_amp)) is as no
    # scaler=, except that with float16 it turns loss scaling off.
    is_enabled = getattr(scaler, "is_enabled", None)
    disabled = callable(is_enabled) and not is_enabled()
    if scaler is not None:
        scaler_device = getattr(scaler, "_device", device_type)
        if torch.device(scaler_device).type != device_type:
            raise ValueError(
                f"autocast_step(scaler=...) is a GradScaler for {scaler_device!r}, but the "
                f"optimizer's parameters are on {device_type!r}. Create it as "
                f"torch.amp.GradScaler({device_type!r})."
            )
    precision = decide_precision(
        requested,
        device_type,
        enabled=enabled,
        user_scaler=scaler is not None and not disabled,
        caps=probe_capabilities(device_type) if requested is None and enabled else _NO_CAPS,
    )
    if disabled and precision.dtype != torch.float16:
        scaler = None
    if scaler is not None and precision.dtype != torch.float16:
        if not enabled:
            raise ValueError(
                "autocast_step(scaler=...) got an enabled GradScaler with enabled=False "
                "(autocast off, float32): loss scaling is only for float16. Pass "
                "GradScaler(enabled=False) too (torch's recipe switches both with one "
                "flag), or drop scaler=...."
            )
        raise ValueError(
            f"autocast_step(scaler=...) was given with dtype={precision.dtype}; loss "
            "scaling is only for float16 (bfloat16 has float32's range and needs none). "
            "Drop scaler=..., or pass dtype=torch.float16."
        )
    check_autocast(device_type, precision.dtype, precision.autocast)
    if precision.scaler and not disabled:
        check_fp16_weights(optimizers)
    if precision.scaler and scaler is None:
        scaler = torch.amp.GradScaler(device_type)
    if requested is None:
        log_choice(device_type, precision)

    rule, locate = _check_watch(watch, skip_nonfinite)
    default_max_skipped = (
        _DEFAULT_MAX_SKIPPED_FP16 if precision.dtype == torch.float16 else _DEFAULT_MAX_SKIPPED
    )
    return StepConfig(
        optimizers=optimizers,
        scheduler=scheduler,
        schedulers=schedulers,
        model=model,
        scaler=scaler,
        scaling=scaler is not None and scaler.is_enabled(),
        precision=precision,
        device_type=device_type,
        max_grad_norm=clip,
        accumulate=accumulate,
        skip_nonfinite=skip_nonfinite,
        max_skipped=max_skipped if max_skipped is not None else default_max_skipped,
        default_max_skipped=default_max_skipped,
        compile_options=compile_options,
        skip_spikes=rule,
        locate_nonfinite=locate,
    )


def _check_watch(options: dict[str, Any], skip_nonfinite: bool) -> tuple[SpikeRule | None, bool]:
    """``skip_spikes=`` and ``locate_nonfinite=``, which need ``skip_nonfinite=True``."""
    unknown = sorted(set(options) - set(WATCH_OPTIONS))
    if unknown:
        raise TypeError(
            f"AutocastStep() got an unexpected keyword argument {unknown[0]!r}; the "
            "options are those of cudakit.amp.autocast_step() (skip_spikes=..., "
            "locate_nonfinite=..., max_grad_norm=..., ...)."
        )
    rule = check_skip_spikes(options.get("skip_spikes"))
    locate = check_bool("autocast_step", "locate_nonfinite", options.get("locate_nonfinite", False))
    if rule is not None and not skip_nonfinite:
        raise ValueError(
            "autocast_step(skip_spikes=...) needs skip_nonfinite=True: a window is judged "
            "a spike only once its loss and gradients are known to be finite, and an "
            "inf/NaN must never reach the running statistics. Drop skip_nonfinite=False."
        )
    if locate and not skip_nonfinite:
        raise ValueError(
            "autocast_step(locate_nonfinite=True) needs skip_nonfinite=True: it replays "
            "the windows the non-finite guard skips. Drop skip_nonfinite=False."
        )
    return rule, locate
