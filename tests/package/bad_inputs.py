"""The machinery of the bad-input sweep (test_bad_input_kinds.py, test_bad_input_values.py).

A :class:`Bad` row is one refused call: what to call (given a fresh :class:`World`), the
exception class it must raise, and how its message must read. :func:`check_refused`
runs a row and checks the project's rule for a bad input:

* the exception class (``TypeError`` for a wrong kind, ``ValueError`` for a wrong
  value, cudakit's own classes where the docs say so);
* the message names the function (``"autocast_step("``), the argument, shows what came
  (its repr or its type's name), says what is expected and hints at the fix;
* nothing the user owns changed: weights, buffers, gradients, optimizer and scheduler
  state, the torch/Python/NumPy RNGs, the batch, the signal handlers, the files.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import cudakit

__all__ = ["UNSET", "Bad", "World", "check_refused", "row_id"]

#: A sentinel for "no value to look for in the message".
UNSET: Any = object()

#: Words of a message that point at the fix (an example, what to pass, what to use).
_FIX = re.compile(
    r"(?<!\w)(Pass|pass|e\.g\.|For example|for example|such as|Use|use|Leave|leave|Call|call|"
    r"Build|build|Set|Remove|Keep|keep the|Name|Reduce|Return|instead|Check|Launch|Wrap|wrap|"
    r"Open|open|Put|Drop|drop|Write|write|Give|Resume|Take|Swap|swap|Move|Run|Compute|Make|"
    r"Choose|Pick|Watch|Install|Save|save|Preserve|register only|Did you|did you mean|Was it|"
    r"Is the)(?!\w)|`[^`]+`"
)
#: Words of a message that say what is expected (or what to pass instead).
_EXPECTED = re.compile(
    r"\b(expects?|expected|must|takes|needs|only|is not|cannot|should|accepts?|requires?|"
    r"valid|known|one of|pass|set|not an?|start at|did you mean|below|above|beyond|"
    r"available)\b",
    re.IGNORECASE,
)

#: The signals a Checkpointer watches by default; a refused one must leave them alone.
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


@dataclasses.dataclass(frozen=True)
class Bad:
    """One refused call of the sweep.

    Attributes:
        func: how the message names the function, e.g. ``"autocast_step("``.
        arg: the argument's name as the message writes it.
        value: what was passed (its repr or type name must show), or ``UNSET``.
        exc: the exception class the call must raise.
        call: the call, given a fresh :class:`World`.
        shown: text the message must hold for the value, instead of its repr/type.
        note: a short word for the test id (``"str"``, ``"nan"``, ...).
        uses: the :class:`World` objects to build before the snapshot (``"step"``,
            ``"checkpointer"``), so that their own set-up is not taken for a change.
    """

    func: str
    arg: str
    value: Any
    exc: type[BaseException]
    call: Callable[[World], object]
    shown: str | None = None
    note: str = ""
    uses: tuple[str, ...] = ()


def row_id(row: Bad) -> str:
    """A readable test id: ``autocast_step-accumulate-str``."""
    name = row.func.rstrip("(").replace(" ", "")
    return f"{name}-{row.arg}-{row.note or _kind(row.value)}"


def _kind(value: object) -> str:
    if value is UNSET:
        return "call"
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, (bool, int, float)) and not isinstance(value, np.generic):
        return f"{type(value).__name__}{value!r}".replace("-", "neg")[:20]
    if isinstance(value, str):
        return f"str{value!r}"[:20]
    return type(value).__name__


class World:
    """What a user owns at the moment of a bad call, built afresh for every row.

    A model with a buffer (BatchNorm), an Adam optimizer that has stepped (so it has
    state), gradients from a later backward, a scheduler, a batch, and a temporary folder.
    """

    def __init__(self, tmp: Path) -> None:
        torch.manual_seed(0)
        self.tmp = tmp
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        x = torch.randn(6, 4)
        self.model(x).square().mean().backward()
        self.optimizer.step()
        self.model(x).square().mean().backward()
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1)
        self.batch = (torch.randn(6, 4), torch.randint(0, 2, (6,)))
        self.dataset = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2))

    @functools.cached_property
    def step(self) -> cudakit.AutocastStep:
        """An fp32 autocast_step over the model and optimizer."""
        return cudakit.autocast_step(self.optimizer, model=self.model, dtype="fp32")

    @functools.cached_property
    def checkpointer(self) -> cudakit.Checkpointer:
        """A Checkpointer of the model and optimizer that watches no signals."""
        return cudakit.Checkpointer(
            self.tmp / "checkpoints", model=self.model, optimizer=self.optimizer, preemption=False
        )

    def close(self) -> None:
        """Close what the world opened."""
        if "checkpointer" in vars(self):
            self.checkpointer.close()

    def loss(self) -> torch.Tensor:
        """A scalar loss of the batch through the model."""
        return self.model(self.batch[0]).square().mean()

    def snapshot(self) -> dict[str, Any]:
        """Copies of everything the user owns."""
        state: dict[str, Any] = {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "buffers": [b.clone() for b in self.model.buffers()],
            "grads": [None if p.grad is None else p.grad.clone() for p in self.model.parameters()],
            "optimizer": _clone(self.optimizer.state_dict()),
            "scheduler": _clone(self.scheduler.state_dict()),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": _clone(np.random.get_state()),
            "batch": [t.clone() for t in self.batch],
            "handlers": [signal.getsignal(s) for s in _SIGNALS],
            "files": sorted(str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*")),
        }
        if "step" in vars(self):
            step = self.step
            state["step"] = (step.position, step.steps, step.skipped_steps, step.accumulate)
        return state


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Every part of ``before`` equals its part of ``after`` (torch.equal for tensors)."""
    changed = [k for k in before if not _same(before[k], after.get(k))]
    assert not changed, f"a refused call changed what the user owns: {changed}"


def check_message(row: Bad, text: str) -> None:
    """The message names the function and the argument, shows the value, says what is
    expected and hints at the fix."""
    assert row.func in text, f"the message does not name {row.func!r}: {text}"
    assert re.search(rf"(?<![\w]){re.escape(row.arg)}(?![\w])", text), (
        f"the message does not name the argument {row.arg!r}: {text}"
    )
    if row.shown is not None:
        assert row.shown in text, f"the message does not show {row.shown!r}: {text}"
    elif row.value is not UNSET:
        value = row.value
        shown = [type(value).__name__, repr(value)[:24]]
        if isinstance(value, (float, np.floating)):
            shown.append(str(value))
        assert any(s in text for s in shown), f"the message does not show {shown}: {text}"
    assert _EXPECTED.search(text), f"the message does not say what is expected: {text}"
    example = re.search(rf"(?<!\w){re.escape(row.arg)}=(?!\.\.\.)\S", text)
    assert _FIX.search(text) or example, f"the message does not hint at the fix: {text}"


def check_refused(row: Bad, world: World) -> None:
    """Run ``row``: the right exception, a clear message, and nothing changed."""
    for name in row.uses:
        getattr(world, name)  # built first: its set-up is no change, its counters are checked
    before = world.snapshot()
    try:
        row.call(world)
    except Exception as exc:  # the class is checked next
        error = exc
    else:
        pytest.fail(f"{row_id(row)}: the call was accepted; expected {row.exc.__name__}")
    assert isinstance(error, row.exc), (
        f"expected {row.exc.__name__}, got {type(error).__name__}: {error}"
    )
    if row.exc is ValueError:
        assert not isinstance(error, TypeError), f"a wrong value raised a TypeError: {error}"
    if row.exc is TypeError:
        assert not isinstance(error, ValueError), f"a wrong kind raised a ValueError: {error}"
    check_message(row, str(error))
    assert_unchanged(before, world.snapshot())
