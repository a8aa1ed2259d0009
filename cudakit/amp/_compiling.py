"""``compile=`` of :func:`~cudakit.amp.autocast_step`: its options checked as
``torch.compile`` takes them, and the step's code compiled with them (the forward under
autocast; the judge's check and clipping)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch

from .._check import check_bool, check_callable, check_optional, fail_type, fail_value

__all__ = ["captures_cuda_graphs", "check_compile", "compile_fn", "compile_forward"]


_COMPILE_OPTIONS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options", "disable"})
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Backends every torch has: no need to import dynamo to list them.
_KNOWN_BACKENDS = frozenset({"inductor", "eager", "aot_eager", "cudagraphs"})


def _compile_fail(
    error: type[Exception], key: str, expected: str, value: object, fix: str
) -> NoReturn:
    fail = fail_type if error is TypeError else fail_value
    fail("autocast_step", f"compile[{key!r}]", expected, value, fix)


def _check_compile_values(options: Mapping[str, Any]) -> None:
    """The values of ``compile=``'s options, as torch.compile takes them."""
    for key in ("fullgraph", "disable"):
        if key in options:
            check_bool("autocast_step", f"compile[{key!r}]", options[key], fix=f"Pass {key}=True.")
    dynamic = options.get("dynamic")
    check_optional(
        check_bool,
        "autocast_step",
        "compile['dynamic']",
        dynamic,
        expected="True, False or None",
        fix="None (the default) lets torch.compile mark a size dynamic once it changes.",
    )
    mode = options.get("mode")
    if mode is not None:
        expected = (
            "a str or None"
            if not isinstance(mode, str)
            else "one of " + ", ".join(repr(m) for m in _COMPILE_MODES)
        )
        if mode not in _COMPILE_MODES:
            error = TypeError if not isinstance(mode, str) else ValueError
            _compile_fail(
                error, "mode", expected, mode, "For example compile={'mode': 'max-autotune'}."
            )
    backend = options.get("backend")
    if backend is not None:
        if isinstance(backend, str):
            known = _KNOWN_BACKENDS
            if backend not in known:
                known = frozenset(torch.compiler.list_backends(exclude_tags=()))
            if backend not in known:
                _compile_fail(
                    ValueError,
                    "backend",
                    "a name from torch.compiler.list_backends()",
                    backend,
                    f"Known here: {sorted(known)}.",
                )
        else:
            check_callable(
                "autocast_step",
                "compile['backend']",
                backend,
                expected="a backend name or a callable",
                fix="For example 'inductor'.",
            )
    inductor = options.get("options")
    if inductor is not None:
        if not isinstance(inductor, Mapping) or not all(isinstance(k, str) for k in inductor):
            _compile_fail(
                TypeError,
                "options",
                "a dict of inductor options with str keys, or None",
                inductor,
                "For example compile={'options': {'max_autotune': True}}.",
            )
        if mode is not None:
            raise ValueError(
                f"autocast_step(compile=...) got mode={mode!r} and options=...; torch.compile "
                "takes mode= or options=, not both. Put the settings in options=, or drop it."
            )


def check_compile(value: object) -> dict[str, Any] | None:
    """``compile=``: False, True (torch.compile's defaults) or a mapping of its options."""
    if value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - _COMPILE_OPTIONS)
        if unknown:
            raise ValueError(
                f"autocast_step(compile=...) got options torch.compile does not take: "
                f"{unknown}; expected some of {sorted(_COMPILE_OPTIONS)}, e.g. "
                "compile={'mode': 'max-autotune'}."
            )
        _check_compile_values(value)
        return dict(value)
    fail_type(
        "autocast_step",
        "compile",
        "True, False or a dict of torch.compile options",
        value,
        "For example: compile=True or compile={'mode': 'reduce-overhead'}.",
    )


def compile_fn(
    fn: Callable[..., Any], options: Mapping[str, Any], **forced: Any
) -> Callable[..., Any]:
    return torch.compile(fn, **{**options, **forced})


def captures_cuda_graphs(options: Mapping[str, Any]) -> bool:
    """Whether ``torch.compile`` options capture the compiled code in CUDA graphs."""
    inductor = options.get("options") or {}
    return options.get("mode") in ("reduce-overhead", "max-autotune") or bool(
        inductor.get("triton.cudagraphs")
    )


def compile_forward(
    func: Callable[..., Any],
    options: Mapping[str, Any],
    device_type: str,
    dtype: torch.dtype,
    enabled: bool,
) -> Callable[..., Any]:
    """``func`` under autocast, compiled: autocast inside the graph, no step object traced."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return func(*args, **kwargs)

    return compile_fn(functools.wraps(func)(forward), options)
