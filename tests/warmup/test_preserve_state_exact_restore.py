"""An extra that defines ``_cudakit_restore`` (the ``ExactRestore`` protocol) is put back
with it; any other extra with its ``load_state_dict``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cudakit import autocast_step
from cudakit.warmup import preserve_state
from cudakit.warmup.preserve import ExactRestore


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.calls: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calls.append("load_state_dict")
        self.n = state["n"]


class Exact(Counter):
    def _cudakit_restore(self, state: Mapping[str, Any]) -> None:
        self.calls.append("_cudakit_restore")
        self.n = state["n"]


def test_an_exact_extra_is_restored_through_its_protocol_method() -> None:
    plain, exact = Counter(), Exact()
    assert isinstance(exact, ExactRestore)
    assert not isinstance(plain, ExactRestore)
    with preserve_state(extra=[plain, exact]):
        plain.n = exact.n = 5
    assert (plain.n, exact.n) == (0, 0)
    assert plain.calls == ["load_state_dict"]
    assert exact.calls == ["_cudakit_restore"]


def test_an_autocast_step_follows_the_protocol() -> None:
    model = torch.nn.Linear(2, 2)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(step, ExactRestore)
