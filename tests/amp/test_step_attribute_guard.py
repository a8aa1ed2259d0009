"""Setting an attribute the step does not have (a typo) or one fixed when it was built
raises AttributeError with a hint, instead of being accepted and ignored; the settable
attributes (``accumulate``, ``max_skipped``) still work."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cudakit.amp import autocast_step

torch.set_num_threads(1)


def _step() -> Any:
    m = torch.nn.Linear(2, 1)
    return autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float32)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("accumulation", r"did you mean 'accumulate'\?"),
        ("max_skip", r"did you mean 'max_skipped'\?"),
        ("grad_clip", r"the settable attributes are accumulate and max_skipped"),
    ],
)
def test_a_misspelled_attribute_is_an_attribute_error(name: str, hint: str) -> None:
    step = _step()
    with pytest.raises(
        AttributeError, match=rf"AutocastStep has no attribute {name!r} to set; {hint}"
    ):
        setattr(step, name, 4)
    assert not hasattr(step, name)


@pytest.mark.parametrize(
    ("name", "value", "fix"),
    [
        ("dtype", torch.float16, r"autocast_step\(\.\.\., dtype=\.\.\.\)"),
        ("scheduler", None, r"autocast_step\(\.\.\., scheduler=\.\.\.\).*load_state_dict"),
        ("optimizer", None, r"autocast_step\(\.\.\., optimizer=\.\.\.\)|autocast_step\(optimizer"),
        ("max_grad_norm", 1.0, r"max_grad_norm=\.\.\."),
        ("position", 0, r"the step keeps it itself"),
        ("steps", 3, r"the step keeps it itself"),
    ],
)
def test_a_read_only_attribute_is_an_attribute_error(name: str, value: Any, fix: str) -> None:
    step = _step()
    before = getattr(step, name)
    with pytest.raises(AttributeError, match=rf"AutocastStep\.{name} is read-only.*{fix}"):
        setattr(step, name, value)
    assert getattr(step, name) == before


def test_a_scheduler_set_after_the_step_was_built_is_refused() -> None:
    step = _step()
    sched = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1)
    with pytest.raises(AttributeError, match=r"AutocastStep\.scheduler is read-only"):
        step.scheduler = sched
    assert step.schedulers == ()


def test_deleting_an_attribute_is_refused() -> None:
    step = _step()
    with pytest.raises(AttributeError, match=r"AutocastStep\.dtype is read-only"):
        del step.dtype
    assert step.dtype == torch.float32


def test_the_settable_attributes_still_work() -> None:
    step = _step()
    step.accumulate = 3
    step.max_skipped = 5
    assert (step.accumulate, step.max_skipped) == (3, 5)
    with pytest.raises(TypeError, match=r"AutocastStep\.accumulate"):
        step.accumulate = "4"
