"""preserve_state misused: a class in extra= (not an object made from it) and __exit__
without __enter__ are clear errors, raised before anything is saved or changed."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from cudakit.amp import AutocastStep
from cudakit.warmup import preserve_state, warmup


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("cls", [StepLR, AutocastStep, torch.amp.GradScaler])
def test_a_class_in_extra_is_refused_by_name(cls: type) -> None:
    model, opt = _model_and_optimizer()
    with pytest.raises(
        TypeError,
        match=rf"^preserve_state\(extra=\.\.\.\) expects objects, not classes, got type "
        rf"<class '[\w.]*{cls.__name__}'>\. Pass the {cls.__name__} you train with, "
        rf"e\.g\. extra=\(obj,\) where obj = {cls.__name__}\(\.\.\.\)\.$",
    ):
        preserve_state(model, opt, extra=(cls,))


def test_warmup_refuses_a_class_in_extra_too() -> None:
    model, opt = _model_and_optimizer()
    with pytest.raises(TypeError, match=r"^warmup\(extra=\.\.\.\) expects objects, not classes"):
        warmup(model, torch.ones(1, 2), optimizer=opt, extra=(StepLR,))


def test_exit_without_enter_is_a_runtime_error() -> None:
    model, opt = _model_and_optimizer()
    guard = preserve_state(model, opt)
    with pytest.raises(
        RuntimeError,
        match=r"^preserve_state\.__exit__\(\) was called without __enter__\(\): nothing was "
        r"saved, so nothing can be put back\. Use `with preserve_state\(model, optimizer\):`",
    ):
        guard.__exit__(None, None, None)


def test_exit_after_the_matching_exit_is_a_runtime_error() -> None:
    model, opt = _model_and_optimizer()
    guard = preserve_state(model, opt)
    with guard:
        pass
    with pytest.raises(RuntimeError, match=r"called without __enter__"):
        guard.__exit__(None, None, None)
