"""How one warm-up pass computes its loss: the model call, the two forms of ``loss_fn``.

``loss_fn`` comes in two forms, told apart by :func:`loss_form` before anything runs:

* a **criterion**, called as in a training loop, ``loss_fn(model(inputs), target)`` on
  ``example_batch=(inputs, target)``: any ``nn.Module`` (``nn.CrossEntropyLoss()``)
  other than the model, a function of ``torch.nn.functional`` (``F.nll_loss``), or a
  function whose first parameter is annotated as a ``torch.Tensor`` or named like a
  model output (``input``, ``output``, ``logits``, ``pred``, ...);
* a **step function** ``loss_fn(model, batch)`` that runs the forward pass itself:
  every other callable (its first parameter annotated as an ``nn.Module``, named
  ``model``, or anything else).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import torch
from torch import nn

__all__ = ["OUTPUT_NAMES", "LossForm", "call_model", "describe_forms", "loss_form", "loss_of"]

LossForm = Literal["criterion", "function"]

#: First-parameter names that make a plain function a criterion ``loss_fn(output, target)``.
OUTPUT_NAMES: Final = frozenset(
    {
        "input",
        "inputs",
        "output",
        "outputs",
        "out",
        "logits",
        "pred",
        "preds",
        "prediction",
        "predictions",
        "y_pred",
        "y_hat",
        "scores",
    }
)
_TENSOR_NAMES: Final = frozenset({"Tensor", "torch.Tensor"})
_POSITIONAL: Final = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _first_parameter(fn: Callable[..., Any]) -> inspect.Parameter | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[0] if params and params[0].kind in _POSITIONAL else None


def _is_tensor_annotation(annotation: object) -> bool:
    if isinstance(annotation, str):
        return annotation in _TENSOR_NAMES
    return isinstance(annotation, type) and issubclass(annotation, torch.Tensor)


def loss_form(loss_fn: Callable[..., Any], model: nn.Module | None) -> LossForm:
    """``"criterion"`` for ``loss_fn(model(inputs), target)``, else ``"function"`` (pure).

    >>> import torch.nn.functional as F
    >>> loss_form(F.nll_loss, None), loss_form(lambda model, batch: 0, None)
    ('criterion', 'function')
    """
    if isinstance(loss_fn, nn.Module):
        return "function" if loss_fn is model else "criterion"
    inner = loss_fn.func if isinstance(loss_fn, functools.partial) else inspect.unwrap(loss_fn)
    if str(getattr(inner, "__module__", "")).startswith("torch.nn.functional"):
        return "criterion"
    first = _first_parameter(loss_fn)
    if first is None:
        return "function"
    if _is_tensor_annotation(first.annotation):
        return "criterion"
    if first.annotation is inspect.Parameter.empty and first.name in OUTPUT_NAMES:
        return "criterion"
    return "function"


def describe_forms() -> str:
    """The sentence naming both forms of ``loss_fn``, for messages."""
    return (
        "warmup() calls loss_fn in one of two forms: a criterion, loss_fn(model(inputs), "
        "target) on example_batch=(inputs, target) (a loss module such as "
        "nn.CrossEntropyLoss(), a torch.nn.functional loss such as F.nll_loss, or a "
        "function whose first parameter is annotated torch.Tensor or named output/logits/"
        "pred); or a step function loss_fn(model, batch) returning the loss (any other "
        "callable)."
    )


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def loss_of(out: Any, explicit: bool) -> torch.Tensor | None:
    """The scalar loss to backpropagate from a model or loss_fn output, if there is one.

    ``explicit``: the output is a loss by contract (``loss_fn``'s result, or a ``.loss``
    field), so a non-scalar tensor that requires grad is a mistake, not logits.
    """
    if not isinstance(out, torch.Tensor):
        out = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        explicit = True
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return None
    if out.ndim == 0:
        return out
    if explicit:
        raise ValueError(
            f"warmup() got a loss of shape {tuple(out.shape)} that requires grad; backward "
            "needs a scalar. Reduce it in loss_fn (e.g. `.mean()`), or run backward inside "
            "loss_fn and return None."
        )
    return None
