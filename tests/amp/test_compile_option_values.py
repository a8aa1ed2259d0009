"""``compile=`` options with values torch.compile would reject (or misread) are refused
when the step is built, naming the option, what came and what is expected."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cudakit.amp import autocast_step


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"fullgraph": "yes"},
            TypeError,
            r"compile\['fullgraph'\]=\.\.\.\) expects True or False, got str",
        ),
        (
            {"dynamic": "auto"},
            TypeError,
            r"compile\['dynamic'\]=\.\.\.\) expects True, False or None, got str 'auto'",
        ),
        (
            {"disable": 1},
            TypeError,
            r"compile\['disable'\]=\.\.\.\) expects True or False, got int 1",
        ),
        (
            {"mode": "fast"},
            ValueError,
            r"compile\['mode'\]=\.\.\.\) expects one of 'default', .*'max-autotune'",
        ),
        ({"mode": 3}, TypeError, r"'mode'\]=\.\.\.\) expects a str or None"),
        (
            {"backend": "no-such-backend"},
            ValueError,
            r"compile\['backend'\]=\.\.\.\) expects a name from torch\.compiler\.list_backends\(\)",
        ),
        ({"backend": 3}, TypeError, r"'backend'.*a backend name or a callable"),
        ({"options": 3}, TypeError, r"'options'.*a dict of inductor options"),
        ({"options": {1: True}}, TypeError, r"'options'.*str keys"),
        (
            {"mode": "max-autotune", "options": {"max_autotune": True}},
            ValueError,
            r"mode= or options=, not both",
        ),
    ],
)
def test_a_bad_compile_option_value_is_refused(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"^autocast_step\(.*{match}"):
        autocast_step(_opt(), compile=options)


@pytest.mark.parametrize(
    "options",
    [
        {"fullgraph": True, "dynamic": None, "mode": "default", "disable": False},
        {"dynamic": False, "backend": "eager"},
        {"backend": lambda gm, example_inputs: gm, "mode": None},
        {"options": {"max_autotune": False}},
        {"mode": "reduce-overhead"},
    ],
)
def test_good_compile_options_are_kept(options: dict[str, Any]) -> None:
    step = autocast_step(_opt(), compile=options)
    assert step.compile_options == options
