"""recompute()'s refusals: each names the argument, what came, what is expected, the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel import Recompute, recompute, recomputed_blocks


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.ModuleList(nn.Linear(2, 2) for _ in range(3)))


def test_unknown_policy() -> None:
    with pytest.raises(
        ValueError, match=r"recompute\(policy=\.\.\.\) expects one of 'none'.*'sel'.*'selective'"
    ):
        recompute(_net(), "sel")


def test_unknown_policy_in_parallelize() -> None:
    model = _net()
    with pytest.raises(
        ValueError, match=r"parallelize\(recompute=\.\.\.\).*'everything'.*recompute='full'"
    ):
        cp.parallelize(model, device="cpu", recompute="everything")
    assert recomputed_blocks(model) == []


def test_policy_of_wrong_kind() -> None:
    with pytest.raises(TypeError, match=r"recompute\(policy=\.\.\.\).*got int 3"):
        recompute(_net(), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parallelize\(recompute=\.\.\.\).*got bool True"):
        cp.parallelize(_net(), device="cpu", recompute=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [0, -2])
def test_every_below_one(k: int) -> None:
    with pytest.raises(
        ValueError, match=rf"recompute\(every=\.\.\.\) expects an int >= 1, got int {k}"
    ):
        recompute(_net(), "full", every=k)


@pytest.mark.parametrize("budget", [0, 0.0, 1.5, -1, float("nan")])
def test_budget_outside_zero_one(budget: float) -> None:
    with pytest.raises(
        ValueError, match=r"budget=\.\.\.\) expects a number in \(0, 1\].*budget=0.5"
    ):
        Recompute("budget", budget=budget)


def test_budget_missing_or_misplaced() -> None:
    with pytest.raises(
        ValueError, match=r"expects a number in \(0, 1\] with policy='budget', got NoneType"
    ):
        recompute(_net(), "budget")
    with pytest.raises(ValueError, match=r"None unless policy='budget'.*Pass policy='budget'"):
        recompute(_net(), "full", budget=0.5)
    with pytest.raises(TypeError, match=r"budget=\.\.\.\) expects a number in \(0, 1\], got str"):
        recompute(_net(), "budget", budget="half")  # type: ignore[arg-type]


def test_block_class_the_model_lacks_changes_nothing() -> None:
    model = _net()
    with pytest.raises(
        ValueError,
        match=r"recompute\(blocks=\.\.\.\).*Conv2d.*its module classes are: Linear, ModuleList",
    ):
        recompute(model, "full", blocks=nn.Conv2d)
    assert recomputed_blocks(model) == []


def test_no_module_list_names_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"Linear has no nn.ModuleList or nn.ModuleDict.*Pass blocks=TheBlockClass"
    ):
        recompute(nn.Linear(2, 2), "full")


def test_blocks_of_wrong_kind() -> None:
    with pytest.raises(
        TypeError, match=r"recompute\(blocks=\.\.\.\).*got str 'Linear'.*blocks=TransformerBlock"
    ):
        recompute(_net(), "full", blocks="Linear")  # type: ignore[arg-type]


def test_model_of_wrong_kind() -> None:
    with pytest.raises(
        TypeError, match=r"recompute\(model=\.\.\.\) expects an nn.Module, got dict"
    ):
        recompute({}, "full")  # type: ignore[arg-type]


def test_spec_and_keywords_together() -> None:
    with pytest.raises(ValueError, match=r"Put every, blocks and budget inside the Recompute"):
        recompute(_net(), Recompute("full"), every=2)


def test_refused_parallelize_leaves_no_recompute() -> None:
    model = _net()
    with pytest.raises(TypeError):
        cp.parallelize(model, device="cpu", recompute="full", bogus_option=1)
    assert recomputed_blocks(model) == []
    assert isinstance(model[1][0], nn.Linear)
    assert type(model[1][0]) is nn.Linear
    assert torch.is_tensor(model[0].weight)
