"""What one call counts: its samples, tokens and FLOPs, from the batch or as given.

``samples=`` and ``tokens=`` are a number per call or a function of the batch;
``flops=`` is a number per call, a function of the batch, or a :class:`FlopCount`,
which is scaled to each batch (the rule is in :class:`CallCounter`). Values may be
one-element tensors (``mask.sum()``): they are kept as they are and read on the
host only when the figures are, so counting never waits for the device.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from .._check import check_number, describe, fail_type, fail_value
from .flops import FlopCount

__all__ = ["CallCounter", "Count", "CountSpec", "FlopSpec", "check_count", "check_spec"]

#: A count as a call gives it: a number, or a one-element tensor read later.
Count = int | float | torch.Tensor
#: ``samples=`` / ``tokens=``: a number per call, or a function of the batch.
CountSpec = int | float | Callable[[Any], Count] | None
#: ``flops=``: a number per call, a function of the batch, or a counted example.
FlopSpec = int | float | Callable[[Any], Count] | FlopCount | None

_FIX: Final = {
    "samples": "For example: samples=len, or samples=64.",
    "tokens": "For example: tokens=lambda batch: batch['attention_mask'].sum().",
    "flops": "For example: flops=count_flops(loss_fn, example, model=model).",
}


def check_spec(func: str, arg: str, value: object) -> Any:
    """``samples=``/``tokens=``/``flops=`` at the door: None, a number >= 0, or a callable."""
    if value is None or callable(value) or (arg == "flops" and isinstance(value, FlopCount)):
        return value
    expected = "a number >= 0 per call, a function of the batch, or None"
    if arg == "flops":
        expected = "a number >= 0 per call, a function of the batch, a FlopCount, or None"
    check_number(func, arg, value, minimum=0, expected=expected, fix=_FIX[arg])
    return value


def check_count(arg: str, value: object) -> Count:
    """A value a call gave for ``arg``: a number >= 0 or a one-element real tensor."""
    kind = type(value)
    if kind is bool:
        pass  # refused below: True is not a count
    elif kind is int:
        if value >= 0:  # type: ignore[operator]
            return value  # type: ignore[return-value]
    elif kind is float:
        if 0 <= value < math.inf:  # type: ignore[operator]
            return value  # type: ignore[return-value]
    elif isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
            return value
        raise ValueError(
            f"speed_report({arg}=...) got a tensor of shape {tuple(value.shape)} and dtype "
            f"{value.dtype} for one call; it expects one number (a one-element real tensor "
            f"is read later, without waiting). Reduce it first, e.g. mask.sum()."
        )
    elif isinstance(value, numbers.Real):
        value = float(value)
        if 0 <= value < math.inf:
            return value
    if kind is bool or not isinstance(value, numbers.Real):
        fail_type(
            "speed_report",
            arg,
            "a number >= 0 or a one-element tensor for each call",
            value,
            _FIX[arg],
        )
    fail_value("speed_report", arg, "a finite number >= 0 for each call", value, _FIX[arg])


def _number(arg: str, value: object, where: str) -> float:
    """A count of the example batch, read now (setup, not the hot path)."""
    value = check_count(arg, value)
    number = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"speed_report({arg}=...) gave {number!r} for {where}; it expects a finite "
            f"number >= 0. {_FIX[arg]}"
        )
    return number


def length(batch: Any) -> int:
    """``samples=len`` of a batch that is not a tensor: ``len(batch)``, where it counts samples.

    ``len`` of a dict of tensors counts its keys, never its samples: refused with the
    fix. ``len`` of an ``(inputs, targets)`` pair counts 2, but a short list of tensors
    may also be a list of samples: a warning with the fix.
    """
    n = len(batch)
    if isinstance(batch, Mapping):
        tensors = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim()]
        if tensors:
            keys = "key" if n == 1 else "keys"
            raise ValueError(
                f"speed_report(samples=len) counts the {n} {keys} of a "
                f"{type(batch).__name__}, not its samples. Count the rows of one of its "
                f"tensors: samples=lambda batch: len(batch[{tensors[0]!r}])."
            )
    elif isinstance(batch, (tuple, list)) and 2 <= n <= 4:
        # An (inputs, targets) pair also looks like a list of a few samples (images a
        # detection model takes as they are): a warning, not a refusal.
        sizes = {t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None for t in batch}
        if len(sizes) == 1 and None not in sizes and sizes != {n}:
            warnings.warn(
                f"speed_report(samples=len) counts the {n} items of a "
                f"{type(batch).__name__} of tensors with {sizes.pop()} rows each. If the "
                "batch is (inputs, targets), count the rows: samples=lambda batch: "
                "len(batch[0]); if its items are the samples, samples=lambda batch: "
                "len(batch) says so without this warning.",
                UserWarning,
                stacklevel=5,
            )
    return n


def _function(spec: object) -> Callable[[Any], Any] | None:
    return spec if callable(spec) and not isinstance(spec, FlopCount) else None


def _constant(spec: object) -> int | float:
    """A number spec as a plain int or float (NumPy's too); 0 for None or a function."""
    if spec is None or callable(spec) or isinstance(spec, FlopCount):
        return 0
    number = float(spec)  # type: ignore[arg-type]
    return int(number) if number.is_integer() else number


class CallCounter:
    """How a call's samples, tokens and FLOPs come from its batch.

    The FLOPs of a call are, in this order:

    * ``flops=`` a function: its value for the call's batch;
    * ``flops=`` a number: that number for every call;
    * ``flops=`` a :class:`FlopCount` counted on an example batch: scaled by tokens
      when ``tokens=`` is given (``total * tokens(batch) / tokens(example)``), else
      by samples when ``samples=`` is given, else the same for every call.

    Scaling by tokens is exact for the linear layers and approximate for attention,
    whose cost grows with the square of the sequence length; give ``flops=`` a
    function for an exact figure on batches of varying length.
    """

    def __init__(self, samples: CountSpec, tokens: CountSpec, flops: FlopSpec) -> None:
        self.samples = samples
        self.tokens = tokens
        self.flops = flops
        #: Whether a call's figures need its batch (a function among the specs).
        self.needs_batch = any(
            callable(v) and not isinstance(v, FlopCount) for v in (samples, tokens, flops)
        )
        # The hot path's view: a function of the batch, or a constant (0 when not counted).
        self._samples_fn = _function(samples)
        self._tokens_fn = _function(tokens)
        self._flops_fn = _function(flops)
        self._samples = _constant(samples)
        self._tokens = _constant(tokens)
        #: FLOPs per unit of ``unit`` ("tokens", "samples", "call"), or None (a function).
        self.unit: str | None = None
        self.per_unit = 0.0
        if isinstance(flops, FlopCount):
            self.unit, self.per_unit = self._scale(flops)
        elif flops is not None and not callable(flops):
            self.unit, self.per_unit = "call", float(flops)

    def _scale(self, flops: FlopCount) -> tuple[str, float]:
        for arg, spec in (("tokens", self.tokens), ("samples", self.samples)):
            if spec is None:
                continue
            example = flops.example
            value = (length(example) if spec is len else spec(example)) if callable(spec) else spec
            units = _number(arg, value, "the FlopCount's example batch")
            if units == 0:
                raise ValueError(
                    f"speed_report(flops=...) scales the counted FLOPs by {arg}, but {arg} "
                    f"of the FlopCount's example batch is 0. Count the FLOPs on a batch "
                    f"with {arg} in it."
                )
            return arg, flops.total / units
        return "call", float(flops.total)

    def count(
        self, batch: Any, samples: Count | None = None, tokens: Count | None = None
    ) -> tuple[Count, Count, Count]:
        """(samples, tokens, FLOPs) of one call; 0 for a figure not configured.

        ``samples``/``tokens`` given (already checked) replace what the specs say.
        """
        if samples is None:
            fn = self._samples_fn
            if fn is None:
                samples = self._samples
            else:
                # samples=len of a tensor: its first size, without Tensor.__len__'s
                # Python checks (a few microseconds a call in a training loop).
                shape = batch.shape if fn is len and type(batch) is torch.Tensor else None
                samples = shape[0] if shape else length(batch) if fn is len else fn(batch)
                if type(samples) is not int or samples < 0:
                    samples = check_count("samples", samples)
        if tokens is None:
            fn = self._tokens_fn
            if fn is None:
                tokens = self._tokens
            else:
                tokens = fn(batch)
                if type(tokens) is not int or tokens < 0:
                    tokens = check_count("tokens", tokens)
        fn = self._flops_fn
        return samples, tokens, 0 if fn is None else check_count("flops", fn(batch))

    def of_batch(self) -> Callable[[Any], tuple[Count, Count, Count]]:
        """:meth:`count` of a batch alone, made for these specs: the meter's hot path.

        ``samples=len`` with constant tokens and FLOPs (the common case) gets a function
        of its own, the same numbers without :meth:`count`'s branches; others get
        :meth:`count` itself.
        """
        if self._samples_fn is not len or self._tokens_fn or self._flops_fn:
            return self.count
        tokens = self._tokens

        def counts(batch: Any) -> tuple[Count, Count, Count]:
            shape = batch.shape if type(batch) is torch.Tensor else None
            samples: Count = shape[0] if shape else length(batch)
            if type(samples) is not int or samples < 0:
                samples = check_count("samples", samples)
            return samples, tokens, 0

        return counts

    def missing(self, samples: Count | None, tokens: Count | None) -> list[str]:
        """The specs that need the batch, given these counts: ``["samples=len", ...]``."""
        out = []
        for name, spec, given in (
            ("samples", self.samples, samples),
            ("tokens", self.tokens, tokens),
            ("flops", self.flops, None),
        ):
            if callable(spec) and not isinstance(spec, FlopCount) and given is None:
                out.append(f"{name}={getattr(spec, '__name__', 'a function')}")
        return out

    def explain(
        self, exc: BaseException, batch: Any, where: str, given: tuple[Count | None, ...] = ()
    ) -> None:
        """Note on ``exc``, raised while counting ``batch`` (``where`` it came from)."""
        specs = ", ".join(self.missing(*(given or (None, None))))
        exc.add_note(
            f"cudakit.speed_report({specs}) could not count {where}, {describe(batch)}. "
            "Each function is given the batch and returns a number >= 0 or a one-element "
            "tensor; or give a block its counts: `with meter.measure(samples=..., "
            "tokens=...):`.",
        )

    def flops_of(self, calls: int, samples: float, tokens: float, raw: float) -> float:
        """The FLOPs of ``calls`` calls that counted ``samples``, ``tokens`` and ``raw`` in all."""
        if self.unit is None:
            return raw
        if self.unit == "tokens":
            return self.per_unit * tokens
        if self.unit == "samples":
            return self.per_unit * samples
        return self.per_unit * calls

    @property
    def has_flops(self) -> bool:
        """Whether FLOPs are counted at all."""
        return self.flops is not None
