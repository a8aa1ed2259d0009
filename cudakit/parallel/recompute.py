"""Activation recompute as one argument: :func:`recompute` and its policy, :class:`Recompute`.

A recomputed block keeps only its inputs in the forward and runs its forward again
in the backward (``torch.utils.checkpoint``, non-reentrant, the RNG replayed), so
its activations never live all at once. The policy is a plain, checked value
(:class:`Recompute`); :func:`find_blocks` is the pure decision of which blocks it
covers; :func:`recompute` carries it out.

A block is recomputed by giving it a subclass of its own class whose ``forward``
runs the original under ``checkpoint`` (as FSDP2's ``fully_shard`` does): no wrapper
module, so ``state_dict()`` keys stay the same and a checkpoint loads with or
without recompute, and FSDP2's hooks stay on the block.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .._blocks import repeated_blocks
from .._check import check_choice, check_int, check_number, fail_type, fail_value
from ._recompute_buffers import buffer_contexts

__all__ = ["POLICIES", "Recompute", "find_blocks", "recompute", "recomputed_blocks"]

#: The policies: ``"none"`` (undo), ``"full"`` (every k-th block whole), ``"selective"``
#: (matmul outputs kept, the rest recomputed), ``"budget"`` (the compiler chooses).
POLICIES = ("none", "full", "selective", "budget")

PolicyName = Literal["none", "full", "selective", "budget"]
"""A policy's name: ``"none"``, ``"full"``, ``"selective"`` or ``"budget"``."""

BlockSpec = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool]
"""Which modules are blocks: a class, a tuple of classes, or ``(name, module) -> bool``."""

_ATTR = "_cudakit_recompute"  # the policy a recomputed block runs ("full", "selective")


def _check_blocks(func: str, blocks: object) -> BlockSpec | None:
    if blocks is None:
        return None
    if isinstance(blocks, type) and issubclass(blocks, nn.Module):
        return blocks
    if (
        isinstance(blocks, tuple)
        and blocks
        and all(isinstance(b, type) and issubclass(b, nn.Module) for b in blocks)
    ):
        return cast(tuple[type[nn.Module], ...], blocks)
    if callable(blocks) and not isinstance(blocks, type):
        return cast(Callable[[str, nn.Module], bool], blocks)
    fail_type(
        func,
        "blocks",
        "None, an nn.Module subclass, a tuple of them, or a function (name, module) -> bool",
        blocks,
        "Pass the class of the model's repeated block, e.g. blocks=TransformerBlock, or "
        "None to recompute each block of every nn.ModuleList or nn.ModuleDict.",
    )


def _check_budget(func: str, policy: str, budget: object) -> float | None:
    if policy != "budget":
        if budget is not None:
            fail_value(
                func,
                "budget",
                "None unless policy='budget'",
                budget,
                f"Pass policy='budget' to give the compiler a budget, or drop budget= "
                f"for policy={policy!r}.",
            )
        return None
    fix = "Pass the share of activation memory to keep, e.g. budget=0.5 (1.0 keeps all)."
    if budget is None:
        fail_value(func, "budget", "a number in (0, 1] with policy='budget'", budget, fix)
    return check_number(func, "budget", budget, positive=True, maximum=1.0, finite=False, fix=fix)


@dataclass(frozen=True)
class Recompute:
    """What to recompute in the backward instead of keeping it from the forward.

    >>> from cudakit.parallel import Recompute
    >>> Recompute("full", every=2)
    Recompute(policy='full', every=2, blocks=None, budget=None)

    Policies:

    * ``"full"``: every ``every``-th block runs its forward again in the backward
      (blocks ``every - 1``, ``2 * every - 1``, ...), keeping only its inputs;
    * ``"selective"``: the same blocks keep their matmul and attention outputs and
      recompute the rest (cheap element-wise ops, norms, activations);
    * ``"budget"``: no block is wrapped; ``torch.compile`` picks what to recompute
      so that at most ``budget`` (in (0, 1]) of the activation memory stays. It acts
      on compiled code only (``autocast_step(compile=True)``, ``torch.compile``);
    * ``"none"``: undo an earlier recompute.

    Args:
        policy: one of :data:`POLICIES`.
        every: recompute every k-th block (1: all of them).
        blocks: which modules are blocks: ``None`` for each module of every
            ``nn.ModuleList`` or ``nn.ModuleDict`` (the way
            ``parallelize(strategy="fsdp")`` finds its units), a class or tuple of
            classes, or a function ``(name, module) -> bool``.
        budget: with ``"budget"`` only, the share of activation memory kept.

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: an unknown policy, ``every < 1``, a budget outside (0, 1] or a
            budget without ``policy="budget"``.

    .. versionadded:: 0.1
    """

    #: One of :data:`POLICIES`.
    policy: PolicyName = "full"
    #: Recompute every k-th block.
    every: int = 1
    #: Which modules are blocks (None: each module of every ``nn.ModuleList``).
    blocks: BlockSpec | None = None
    #: With ``"budget"``: the share of activation memory kept, in (0, 1].
    budget: float | None = None

    def __post_init__(self) -> None:
        func = "Recompute"
        check_choice(
            func,
            "policy",
            self.policy,
            POLICIES,
            fix="Pass 'full' (whole blocks), 'selective' (keep matmul outputs), "
            "'budget' (with budget=..., under torch.compile) or 'none'.",
        )
        object.__setattr__(self, "every", check_int(func, "every", self.every, minimum=1))
        object.__setattr__(self, "blocks", _check_blocks(func, self.blocks))
        object.__setattr__(self, "budget", _check_budget(func, self.policy, self.budget))


def as_recompute(func: str, arg: str, value: object) -> Recompute | None:
    """``value`` as a :class:`Recompute` (a policy name is one), None for None."""
    if value is None or isinstance(value, Recompute):
        return value
    if isinstance(value, str):
        try:
            return Recompute(cast(PolicyName, value))
        except ValueError:
            pass
        fail_value(
            func,
            arg,
            f"one of {', '.join(map(repr, POLICIES))} or a cudakit.parallel.Recompute",
            value,
            f"Pass e.g. {arg}='full', or {arg}=Recompute('full', every=2) for every second block.",
        )
    fail_type(
        func,
        arg,
        "None, a policy name or a cudakit.parallel.Recompute",
        value,
        f"Pass e.g. {arg}='full' or {arg}=Recompute('selective').",
    )


# --------------------------------------------------------------------------- which blocks


def _is_block(spec: BlockSpec | None, name: str, module: nn.Module, listed: set[int]) -> bool:
    if spec is None:
        return id(module) in listed
    if isinstance(spec, (type, tuple)):
        return isinstance(module, spec)
    return bool(spec(name, module))


def _original_class(module: nn.Module) -> type[nn.Module]:
    cls = type(module)
    return cast(type[nn.Module], getattr(cls, "_cudakit_original", cls))


def find_blocks(model: nn.Module, spec: Recompute) -> list[tuple[str, nn.Module]]:
    """The blocks ``spec`` recomputes in ``model``, in order; a pure decision, nothing changes.

    >>> import torch
    >>> from cudakit.parallel import Recompute
    >>> from cudakit.parallel.recompute import find_blocks
    >>> net = torch.nn.Sequential(
    ...     torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4)))
    >>> [name for name, _ in find_blocks(net, Recompute("full", every=2))]
    ['0.1', '0.3']

    Only the outermost match counts: a block inside another block is left alone.

    Raises:
        ValueError: the model has no block the spec names (no ``nn.ModuleList`` or
            ``nn.ModuleDict``, or no module of the given class), with the classes it
            does have.
    """
    func = "recompute"
    listed = {id(m) for m in repeated_blocks(model)}
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if module is model and spec.blocks is None:
            continue
        if _is_block(spec.blocks, name, module, listed):
            found.append((name, module))
            inside.append(name)
    if not found:
        kinds = sorted({_original_class(m).__name__ for m in model.modules() if m is not model})
        shown = ", ".join(kinds[:8]) + (", ..." if len(kinds) > 8 else "") or "none"
        if spec.blocks is None:
            fail_value(
                func,
                "blocks",
                "an nn.ModuleList or nn.ModuleDict of repeated blocks in the model (or blocks=...)",
                spec.blocks,
                f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict; its module "
                "classes are: "
                f"{shown}. Pass blocks=TheBlockClass, or a function (name, module) -> bool.",
            )
        fail_value(
            func,
            "blocks",
            f"a block kind that {type(model).__name__} has",
            spec.blocks,
            f"No module matched; its module classes are: {shown}. Pass one of these "
            "(blocks=TheClass), or a function (name, module) -> bool.",
        )
    k = spec.every
    return [b for i, b in enumerate(found) if i % k == k - 1]


# --------------------------------------------------------------------------- the forward


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _saved_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _saved_ops() -> frozenset[Any]:
    """The ops whose outputs a selective block keeps: matmuls and attention."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


# What a Hugging Face layer calls the cache it writes (its own checkpointing drops it).
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def _hf_checkpointing(block: nn.Module) -> bool:
    """Whether transformers' own checkpointing is on for ``block`` (a
    ``GradientCheckpointingLayer`` after ``model.activation_checkpointing_enable()``)."""
    return getattr(block, "gradient_checkpointing", False) is True


_POSITIONS: dict[type[nn.Module], dict[str, int]] = {}


def _positions(cls: type[nn.Module]) -> dict[str, int]:
    """Where ``cls.forward`` takes ``use_cache`` and the cache as positional arguments
    (GPT2Model hands its blocks the cache so), after ``self``; found once per class."""
    found = _POSITIONS.get(cls)
    if found is None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):  # no signature to read: keywords only
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = ("use_cache", *_CACHE_KWARGS)
        found = {
            p.name: i for i, p in enumerate(params) if p.kind in positional and p.name in names
        }
        _POSITIONS[cls] = found
    return found


def _on(value: object) -> bool:
    return value is not None and value is not False


def _without_cache(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Hugging Face layer's arguments with its KV cache off, as its own checkpointing
    does: the recompute would write the cache a second time."""
    if not hasattr(type(block), "gradient_checkpointing"):  # not a transformers layer
        return args, kwargs
    off: dict[str, Any] = {"use_cache": False}  # a cache off is None (an empty one is falsy)
    if not getattr(block, "_can_checkpoint_with_cache", False):
        off.update(dict.fromkeys(_CACHE_KWARGS))
    out, listed = dict(kwargs), list(args)
    for name, i in _positions(_original_class(block)).items():
        if name in off and i < len(listed) and _on(listed[i]):
            listed[i] = off[name]
    for name, value in off.items():
        if _on(out.get(name)):
            out[name] = value
    return tuple(listed), out


def _eager_context(block: nn.Module, policy: str) -> tuple[Any, Any]:
    """checkpoint's ``context_fn`` outside ``torch.compile``: the policy's contexts, the
    forward's watching which buffers it writes, the recompute's on copies of those."""
    forward, again = (
        _selective_context() if policy == "selective" else (nullcontext(), nullcontext())
    )
    return buffer_contexts(block, forward, again)


class _RecomputedForward(nn.Module):
    """The base of every recomputed block's class: ``forward`` under ``checkpoint``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        inner = super().forward
        policy = getattr(self, _ATTR, "full")
        if policy == "none":  # undone after a wrapper changed the class again
            return inner(*args, **kwargs)
        if self.training and torch.is_grad_enabled():
            if _hf_checkpointing(self):
                raise RuntimeError(
                    f"{_original_class(self).__name__} would be recomputed twice: by "
                    "cudakit's recompute and by transformers' activation checkpointing, "
                    "switched on after it. Call model.activation_checkpointing_disable(), "
                    "or cudakit.parallel.recompute(model, 'none') to keep transformers' own."
                )
            args, kwargs = _without_cache(self, args, kwargs)
        # The keywords are bound here: checkpoint() would take its own (debug=,
        # preserve_rng_state=, ...) out of them, and the block would never see them.
        run = functools.partial(inner, **kwargs) if kwargs else inner
        if torch.compiler.is_compiling():  # one traced graph writes each buffer once
            if policy == "selective":
                return checkpoint(run, *args, use_reentrant=False, context_fn=_selective_context)
            return checkpoint(run, *args, use_reentrant=False)
        context = functools.partial(_eager_context, self, policy)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the block's own class (the recomputed one is made at run time, so
        pickle cannot find it by name) and made recomputed again when loaded."""
        original = type(self)._cudakit_original  # type: ignore[attr-defined]
        if _CLASSES.get(original) is not type(self):  # a wrapper's class on top: its rules
            return super().__reduce_ex__(protocol)
        state = self.__getstate__()  # type: ignore[no-untyped-call]  # the class's own
        return _unpickle_recomputed, (original,), state


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _unpickle_recomputed(original: type[nn.Module]) -> nn.Module:
    """A bare recomputed instance of ``original`` for pickle to fill in."""
    made = _recomputed_class(original)
    return made.__new__(made)


def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    made = _CLASSES.get(cls)
    if made is None:
        made = type(
            f"Recomputed{cls.__name__}",
            (_RecomputedForward, cls),
            {"_cudakit_original": cls, "__module__": cls.__module__},
        )
        _CLASSES[cls] = made
    return made


def _undo(model: nn.Module) -> None:
    for module in model.modules():
        if not isinstance(module, _RecomputedForward):
            continue
        original = type(module)._cudakit_original  # type: ignore[attr-defined]
        if _CLASSES.get(original) is type(module):
            module.__class__ = original
            module.__dict__.pop(_ATTR, None)
        else:  # a wrapper (fully_shard) made a class of its own on top: switch it off
            setattr(module, _ATTR, "none")


def recomputed_blocks(model: nn.Module) -> list[str]:
    """The names of ``model``'s blocks that recompute their activations now.

    >>> import torch, cudakit.parallel as cp
    >>> net = torch.nn.Sequential(
    ...     torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2)))
    >>> cp.recomputed_blocks(cp.recompute(net, "full"))
    ['0.0', '0.1']

    .. versionadded:: 0.1
    """
    if not isinstance(model, nn.Module):
        fail_type("recomputed_blocks", "model", "an nn.Module", model, "Pass the model.")
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, _RecomputedForward) and getattr(m, _ATTR, "full") != "none"
    ]


def apply_recompute(model: nn.Module, spec: Recompute, blocks: list[tuple[str, nn.Module]]) -> None:
    """Carry out ``spec`` on the ``blocks`` :func:`find_blocks` chose (after every check)."""
    _undo(model)
    if spec.policy == "budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = cast(float, spec.budget)
        return
    if spec.policy == "none":
        return
    for _name, block in blocks:
        if not isinstance(block, _RecomputedForward):
            block.__class__ = _recomputed_class(type(block))
        setattr(block, _ATTR, spec.policy)


def plan_recompute(func: str, model: nn.Module, spec: Recompute) -> list[tuple[str, nn.Module]]:
    """The blocks to recompute, every check done; ``[]`` for a policy that wraps none."""
    if spec.policy in ("none", "budget"):
        return []
    try:
        blocks = find_blocks(model, spec)
    except ValueError as exc:
        raise ValueError(str(exc).replace("recompute(", f"{func}(", 1)) from None
    twice = [name for name, block in blocks if _hf_checkpointing(block)]
    if twice:
        raise ValueError(
            f"{func}() would recompute {len(twice)} block(s) twice: transformers' own "
            f"activation checkpointing is on for {', '.join(map(repr, twice[:4]))}"
            + (" ..." if len(twice) > 4 else "")
            + " (model.activation_checkpointing_enable(), formerly "
            "gradient_checkpointing_enable()). Call model.activation_checkpointing_disable() "
            "first, or keep transformers' and leave cudakit's recompute off."
        )
    return blocks


def recompute(
    model: nn.Module,
    policy: str | Recompute = "full",
    *,
    every: int = 1,
    blocks: BlockSpec | None = None,
    budget: float | None = None,
) -> nn.Module:
    """Recompute the activations of ``model``'s blocks in the backward; return the model.

    >>> import torch, cudakit.parallel as cp
    >>> net = torch.nn.Sequential(
    ...     torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4)))
    >>> keys = list(net.state_dict())
    >>> net = cp.recompute(net, "full", every=2)
    >>> cp.recomputed_blocks(net)
    ['0.1', '0.3']
    >>> list(net.state_dict()) == keys  # no wrapper, no renamed keys
    True

    The model changes in place: each chosen block's class becomes a subclass of its
    own (``RecomputedLinear`` here) whose forward runs under non-reentrant
    ``torch.utils.checkpoint`` with the RNG replayed, so gradients equal those
    without recompute bit for bit. Apply it before ``fully_shard``, DDP or
    ``torch.compile`` (``parallelize(model, recompute=...)`` does). A second call
    replaces the first; ``policy="none"`` undoes it. See :class:`Recompute` for the
    policies.

    Args:
        model: the module to train.
        policy: a policy name or a :class:`Recompute` (then no other keyword).
        every: recompute every k-th block.
        blocks: which modules are blocks (default: each module of every
            ``nn.ModuleList`` or ``nn.ModuleDict``), a class, a tuple of classes, or a predicate.
        budget: with ``policy="budget"``, the share of activation memory kept.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: an unknown policy, ``every < 1``, a budget outside (0, 1], or no
            block found (the message lists the model's module classes). Nothing has
            changed then.

    .. versionadded:: 0.1
    """
    func = "recompute"
    if not isinstance(model, nn.Module):
        fail_type(func, "model", "an nn.Module", model, "Pass the model: recompute(model, 'full').")
    if isinstance(policy, Recompute):
        if (every, blocks, budget) != (1, None, None):
            fail_value(
                func,
                "policy",
                "a policy name when every=, blocks= or budget= is given",
                policy,
                "Put every, blocks and budget inside the Recompute(...) instead.",
            )
        spec = policy
    elif isinstance(policy, str):
        try:
            spec = Recompute(cast(PolicyName, policy), every=every, blocks=blocks, budget=budget)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("Recompute(", "recompute(", 1)) from None
    else:
        fail_type(
            func,
            "policy",
            f"one of {', '.join(map(repr, POLICIES))} or a Recompute",
            policy,
            "Pass e.g. policy='full'.",
        )
    chosen = plan_recompute(func, model, spec)
    apply_recompute(model, spec, chosen)
    return model


def describe_spec(spec: Recompute | None) -> str:
    """A short text of a policy for logs and tables: ``full/2``, ``budget 0.5``, ``none``."""
    if spec is None or spec.policy == "none":
        return "none"
    if spec.policy == "budget":
        return f"budget {spec.budget:g}"
    return spec.policy if spec.every == 1 else f"{spec.policy}/{spec.every}"
