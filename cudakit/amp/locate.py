"""Name the first producer of an inf/NaN: replay a forward and backward with hooks.

:func:`find_nonfinite` runs a loss function once more and watches, in order:

1. its tensor arguments (``phase="input"``: the batch itself holds the value);
2. every module's inputs and outputs as the forward runs (global module hooks), so the
   first module whose output turns non-finite from finite inputs is named, or the
   enclosing module when a value turns bad in its own code between two submodules;
3. every autograd node of the graph as the backward runs (node hooks), so the first
   node whose gradients turn non-finite is named, with the module that was running
   when the forward created it (``phase="backward"``). A hook the forward registers on
   a tensor (``tensor.register_hook``) is watched too, and the module that registered
   it is named when it turns a finite gradient non-finite; a gradient that arrives
   non-finite from finite ones otherwise was changed by a hook registered before, and
   the module that consumed the tensor in the forward is named.

The backward runs as ``torch.autograd.grad`` over the graph's leaves, so no ``.grad``
changes, nothing is accumulated and no optimizer runs. The buffers (and any module
attribute the forward re-assigns) of every module called are put back, and so is every
random number generator (torch's CPU and CUDA ones, ``random``, NumPy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.modules.module as _module_hooks
from torch import nn
from torch.overrides import TorchFunctionMode

from .._check import check_callable
from .._dist import group_world_size
from ..warmup.preserve import RngState
from ._values import copy_batch, first_nonfinite

__all__ = ["NonFiniteSource", "NonFiniteWarning", "Phase", "find_nonfinite", "replay"]

#: Where the first inf/NaN appeared: a module's ``input``, its ``forward`` output, or a
#: gradient in the ``backward``.
Phase = Literal["input", "forward", "backward"]
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class NonFiniteWarning(UserWarning):
    """``autocast_step(locate_nonfinite=True)`` skipped a window: where its inf/NaN came from.

    .. versionadded:: 0.1
    """


@dataclasses.dataclass(frozen=True)
class NonFiniteSource:
    """Where the first inf/NaN of a forward and backward came from.

    >>> import torch
    >>> from cudakit.amp import NonFiniteSource
    >>> src = NonFiniteSource(
    ...     "forward", "encoder.1", "Linear", (16, 32), torch.float32
    ... )
    >>> print(src)
    forward of 'encoder.1' (Linear): a float32 tensor of shape (16, 32)

    .. versionadded:: 0.1
    """

    #: ``"input"`` (an argument of the function), ``"forward"`` or ``"backward"``.
    phase: Phase
    #: The module's qualified name in the outermost module called (``""`` for that one or
    #: for the function's own code outside any module); for ``"input"``, the argument.
    name: str
    #: The module's class name; None outside any module.
    module: str | None
    #: Shape of the first non-finite tensor.
    shape: tuple[int, ...]
    #: Its dtype.
    dtype: torch.dtype
    #: The autograd node that produced it (backward), e.g. ``"AddmmBackward0"``; else None.
    op: str | None = None
    #: Which micro-batch of the window (0-based; 0 for :func:`find_nonfinite`).
    micro_batch: int = 0

    def __str__(self) -> str:
        if self.phase == "input":
            where = f"input {self.name}"
        elif self.module is None:
            where = f"{self.phase} of the function's own code (outside any module)"
        else:
            where = f"{self.phase} of {self.name!r} ({self.module})"
        if self.op is not None:
            where += f", in {self.op}"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{where}: a {dtype} tensor of shape {self.shape}"


def find_nonfinite(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> NonFiniteSource | None:
    """Run ``fn(*args, **kwargs)`` and its backward once, and name the first inf/NaN producer.

    ``fn`` computes a loss (a tensor, ``(loss, ...)`` or ``{"loss": loss, ...}``; a
    tensor of several values is summed) by calling modules. Nothing it owns changes:
    the backward runs as ``torch.autograd.grad`` (no ``.grad`` is touched), and the
    buffers of every module called (BatchNorm statistics) and every random number
    generator are put back. Run it under your own ``torch.autocast`` to replay a
    mixed-precision step.

    >>> import torch
    >>> from cudakit.amp import find_nonfinite
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    >>> with torch.no_grad():
    ...     _ = model[1].weight.fill_(float("inf"))
    >>> src = find_nonfinite(lambda x: model(x).pow(2).mean(), torch.ones(2, 4))
    >>> src.phase, src.name, src.module
    ('forward', '1', 'Linear')

    Args:
        fn: the loss function; what it returns must depend on its modules.
        *args: its positional arguments (a tensor holding an inf/NaN is named as
            ``phase="input"``).
        **kwargs: its keyword arguments.

    Returns:
        Where the first non-finite value came from, as a ``NonFiniteSource``; None
        when the forward and backward stay finite.

    Raises:
        TypeError: ``fn`` is not callable.

    .. versionadded:: 0.1
    """
    check_callable(
        "find_nonfinite",
        "fn",
        fn,
        expected="the loss function to replay",
        fix="Pass the function that computes the loss, then its arguments: "
        "find_nonfinite(loss_fn, batch).",
    )
    return replay([(fn, args, dict(kwargs))])


def replay(
    calls: Sequence[Call],
    *,
    autocast: Callable[[], Any] | None = None,
    seed: float = 1.0,
    pause: Callable[[], Any] | None = None,
    root: nn.Module | None = None,
) -> NonFiniteSource | None:
    """Replay each call (a window's micro-batches) in order; the first source found.

    ``autocast``: a factory of the autocast context to run the forwards in; ``seed``: the
    factor the backward starts from (the loss scale over ``accumulate``); ``pause``: a
    factory of DDP's ``no_sync`` context; ``root``: the model whose qualified names
    name the modules (default: the outermost module each call runs). Under several
    ranks every call is replayed (a DDP forward may run collectives, so every rank runs
    the same number of them).
    """
    rng = RngState()
    first: NonFiniteSource | None = None
    every = group_world_size() > 1
    try:
        for index, (fn, args, kwargs) in enumerate(calls):
            found = _Replay(fn, args, kwargs, root).run(autocast, seed, pause)
            if found is not None and first is None:
                first = dataclasses.replace(found, micro_batch=index)
                if not every:
                    break
    finally:
        rng.restore()
    return first


def _modules_of(fn: Callable[..., Any]) -> list[nn.Module]:
    """The modules ``fn`` can reach by name: itself, its ``self``, its closure, its globals.

    Known before the call, they get hooks of their own from the start (their keyword
    arguments are seen); modules found otherwise are watched from their first call.
    """
    target: Any = fn
    for _ in range(4):  # functools.wraps chains (a decorated step function)
        inner = getattr(target, "__wrapped__", None)
        if inner is None:
            break
        target = inner
    if isinstance(target, functools.partial):
        target = target.func
    found: list[Any] = [target, getattr(target, "__self__", None)]
    code = getattr(target, "__code__", None)
    for cell in getattr(target, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found.append(cell.cell_contents)
    if code is not None:
        spaces = getattr(target, "__globals__", {})
        found += [spaces.get(name) for name in code.co_names]
    out: list[nn.Module] = []
    for obj in found:
        if isinstance(obj, nn.Module) and all(obj is not m for m in out):
            out.append(obj)
    return out


def _sequence_number() -> int:
    """The autograd sequence number the next node will get (a probe node takes one)."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True) * 1
    node = probe.grad_fn
    return int(node._sequence_nr()) if node is not None else -1


def _loss_of(output: object) -> torch.Tensor | None:
    """The tensor to backpropagate from: the loss among the forms a step function returns."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    elif isinstance(output, (list, tuple)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        return None
    return output if output.numel() == 1 else output.sum()


def _unwrap(root: nn.Module) -> nn.Module:
    """The module a wrapper (DDP, DataParallel, ``torch.compile``) holds, named from there."""
    for _ in range(4):
        inner = getattr(root, "_orig_mod", None)
        if not isinstance(inner, nn.Module) and type(root).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
        ):
            inner = getattr(root, "module", None)
        if not isinstance(inner, nn.Module):
            break
        root = inner
    return root


def _live(module: nn.Module) -> list[torch.Tensor]:
    return [b for b in module._buffers.values() if b is not None]


class _ModuleState:
    """A module tree's buffers and attribute slots, put back after the replay."""

    def __init__(self, root: nn.Module) -> None:
        self.saved = [
            (m, dict(vars(m)), dict(m._buffers), [b.detach().clone() for b in _live(m)])
            for m in root.modules()
        ]

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of the tree."""
        return [p for m, *_ in self.saved for p in m._parameters.values() if p is not None]

    def restore(self) -> None:
        with torch.no_grad():
            for m, attrs, buffers, copies in self.saved:
                for key in [k for k in vars(m) if k not in attrs]:
                    delattr(m, key)
                vars(m).update(attrs)
                m._buffers.clear()
                m._buffers.update(buffers)
                for buf, copy in zip(_live(m), copies, strict=True):
                    buf.copy_(copy)


class _TensorHooks(TorchFunctionMode):
    """Wraps each ``Tensor.register_hook`` of the forward: which module's hook went bad."""

    def __init__(self, replay: _Replay) -> None:
        super().__init__()
        self.replay = replay

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.Tensor.register_hook and len(args) == 2 and not kwargs:
            args = (args[0], self.replay.watch_hook(args[1]))
        return func(*args, **(kwargs or {}))


class _Replay:
    """One forward and backward of ``fn`` under hooks; the first source it meets."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        root: nn.Module | None = None,
    ):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.source: NonFiniteSource | None = None
        # (module, the autograd sequence number when it was entered)
        self.stack: list[tuple[nn.Module, int]] = []
        self.spans: list[tuple[int, int, int, nn.Module]] = []  # (first, last, depth, module)
        self.names: dict[int, str] = {}
        self.saved: list[_ModuleState] = []
        self.seen_roots: set[int] = set()
        self.hooked: set[int] = set()  # modules with hooks of their own (see _root)
        self.handles: list[Any] = []
        self.root = root  # the step's model: names from it, whichever part is called

    # ------------------------------------------------------------------ names

    def _root(self, module: nn.Module) -> None:
        """A module tree whose modules get names, saved state, and hooks of their own.

        A module's own hooks see its keyword arguments (a global pre-hook sees only the
        positional ones), and its forward hook, added last, sees the output after the
        user's forward hooks changed it. (The tree's root, found while it is called, is
        watched by the global hooks for that call.)
        """
        if id(module) in self.seen_roots or id(module) in self.names:
            return
        self.seen_roots.add(id(module))
        self.saved.append(_ModuleState(module))  # before its forward changes anything
        inner = _unwrap(module)
        self.names.setdefault(id(module), "")
        for name, sub in inner.named_modules(remove_duplicate=False):
            self.names.setdefault(id(sub), name)
        for sub in module.modules():
            if id(sub) in self.hooked:
                continue
            self.hooked.add(id(sub))
            self.handles.append(
                sub.register_forward_pre_hook(self._own_pre, with_kwargs=True, prepend=True)
            )
            self.handles.append(sub.register_forward_hook(self._own_post, with_kwargs=True))

    def _found(
        self,
        phase: Phase,
        module: nn.Module | None,
        tensor: torch.Tensor,
        op: str | None = None,
        name: str | None = None,
    ) -> None:
        if self.source is not None:
            return
        if name is None:
            name = "" if module is None else self.names.get(id(module), type(module).__name__)
        kind = None if module is None else type(module).__name__
        self.source = NonFiniteSource(phase, name, kind, tuple(tensor.shape), tensor.dtype, op)

    # ------------------------------------------------------------------ forward

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The global pre-hook: modules outside the hooked trees, and a tree's root."""
        if id(module) in self.hooked:
            return  # its own pre-hook, which sees the keyword arguments, enters it
        if not self.stack:
            self._root(module)  # hooked from now on; this call is entered here
        self._enter(module, args, {})

    def _own_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # (Never the call that rooted the module in _pre: torch takes the tuple of a
        # call's pre-hooks before it runs them. A module calling itself is entered again.)
        self._enter(module, args, kwargs)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.source is None:
            # Made bad between two modules: the enclosing one's code. An input that is
            # -inf where it is not finite is an additive attention mask, not a source.
            hit = first_nonfinite(args, "input", masks=True) or first_nonfinite(
                kwargs, "input", masks=True
            )
            if hit is not None:
                self._found("forward", self.stack[-1][0] if self.stack else None, hit[1])
        self.stack.append((module, _sequence_number()))

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        """The global forward hook: modules outside the hooked trees."""
        if id(module) not in self.hooked:
            self._leave(module, output)

    def _own_post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: object
    ) -> None:
        self._leave(module, output)

    def _leave(self, module: nn.Module, output: object) -> None:
        if self.stack and self.stack[-1][0] is module:
            _, first = self.stack.pop()
            self.spans.append((first, _sequence_number(), len(self.stack), module))
        if self.source is None:
            hit = first_nonfinite(output, "output")
            if hit is not None:
                self._found("forward", module, hit[1])

    # ------------------------------------------------------------------ backward

    def watch_hook(self, hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        """A tensor hook registered now, watched: the module running now registered it."""
        owner = self.stack[-1][0] if self.stack else None

        @functools.wraps(hook)
        def watched(grad: torch.Tensor) -> Any:
            out = hook(grad)
            if self.source is None and out is not None and first_nonfinite(grad, "grad") is None:
                hit = first_nonfinite(out, "grad")
                if hit is not None:
                    self._found("backward", owner, hit[1], "a tensor hook")
            return out

        return watched

    def _module_of(self, node: Any) -> nn.Module | None:
        seq = int(node._sequence_nr())
        best: tuple[int, nn.Module] | None = None
        for first, last, depth, module in self.spans:
            if first <= seq <= last and (best is None or depth > best[0]):
                best = (depth, module)
        return None if best is None else best[1]

    def _backward(self, loss: torch.Tensor, seed: float) -> None:
        nodes: list[Any] = []
        leaves: list[torch.Tensor] = []
        consumers: dict[Any, list[Any]] = {}
        todo, seen = [loss.grad_fn], set()
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if isinstance(variable, torch.Tensor):  # AccumulateGrad: a leaf
                leaves.append(variable)
                continue
            nodes.append(node)
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    consumers.setdefault(nxt, []).append(node)
                    todo.append(nxt)
        if not leaves:
            return
        ran: list[Any] = []

        def hook_for(node: Any) -> Callable[..., None]:
            def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
                ran.append(node)
                if self.source is not None:
                    return
                arrived = first_nonfinite(tuple(grad_outputs), "grad")
                if arrived is not None:  # finite when made, changed by a hook on the tensor
                    users = [n for n in reversed(ran) if n in consumers.get(node, ())]
                    module = self._module_of(users[0] if users else node)
                    self._found("backward", module, arrived[1], f"a hook on {node.name()}")
                    return
                made = first_nonfinite(tuple(grad_inputs), "grad")
                if made is not None:
                    self._found("backward", self._module_of(node), made[1], node.name())

            return hook

        handles = [node.register_hook(hook_for(node)) for node in nodes]
        try:
            start = loss if seed == 1.0 else loss * seed
            if not any(n.name() == "CheckpointFunctionBackward" for n in nodes):
                torch.autograd.grad(start, leaves, allow_unused=True)
            else:
                # Reentrant activation checkpointing refuses autograd.grad: a plain
                # backward, with every leaf's .grad put back afterwards.
                # (Also the parameters inside the checkpointed blocks, out of the graph's
                # sight until the backward recomputes them.)
                owned = {id(t): t for t in leaves}
                for state in self.saved:
                    owned.update((id(t), t) for t in state.parameters())
                grads = [
                    (t, t.grad, None if t.grad is None else t.grad.clone()) for t in owned.values()
                ]
                # A plain backward fires post-accumulate-grad hooks (an optimizer stepped
                # inside the backward): they are held back while it runs.
                # (Emptied in place: autograd holds the dict itself.)
                held = [
                    (hooks, dict(hooks))
                    for t in owned.values()
                    if (hooks := t._post_accumulate_grad_hooks)
                ]
                try:
                    for hooks, _ in held:
                        hooks.clear()
                    start.backward()
                finally:
                    with torch.no_grad():
                        for t, grad, copy in grads:
                            if grad is not None and copy is not None:
                                grad.copy_(copy)
                            t.grad = grad
                    for hooks, items in held:
                        hooks.update(items)
        finally:
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------ the run

    def run(
        self, autocast: Callable[[], Any] | None, seed: float, pause: Callable[[], Any] | None
    ) -> NonFiniteSource | None:
        hit = first_nonfinite(self.args, "args", masks=True) or first_nonfinite(
            self.kwargs, "kwargs", masks=True
        )
        if hit is not None:
            self._found("input", None, hit[1], name=hit[0])
            return self.source
        # The replay runs on copies of the batch's tensors: a step that changes its batch
        # in place (x.sub_(1)) does not change it a second time.
        args, kwargs = copy_batch(self.args), copy_batch(self.kwargs)
        with contextlib.ExitStack() as stack:
            stance = getattr(torch.compiler, "set_stance", None)
            if stance is not None:
                stack.enter_context(stance("force_eager"))  # the eager modules, hookable
            if pause is not None:
                stack.enter_context(pause())
            stack.enter_context(torch.enable_grad())
            stack.callback(self._restore)
            for root in [self.root] if self.root is not None else _modules_of(self.fn):
                self._root(root)
            pre = _module_hooks.register_module_forward_pre_hook(self._pre)
            post = _module_hooks.register_module_forward_hook(self._post)
            try:
                with (
                    autocast() if autocast is not None else contextlib.nullcontext(),
                    _TensorHooks(self),
                ):
                    output = self.fn(*args, **kwargs)
            finally:
                pre.remove()
                post.remove()
            loss = _loss_of(output)
            if self.source is None and loss is not None:
                if not bool(torch.isfinite(loss.detach()).all()):
                    self._found("forward", None, loss)
                else:
                    self._backward(loss, seed)
        return self.source

    def _restore(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for state in reversed(self.saved):
            state.restore()
