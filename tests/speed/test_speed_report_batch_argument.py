"""Which argument a decorated function's batch is, and what a count that fails does.

A decorated method's first argument is ``self`` (or ``cls``), not the batch: the meter
counts the argument after it. The counts are taken before the call, so a count that
fails raises before the step runs, with a note that names the meter and the argument.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cudakit.amp import autocast_step
from cudakit.speed import speed_report


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.seen: list[int] = []

    @speed_report(samples=len, tokens=lambda b: b.numel(), file=None)
    def step(self, batch: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(batch))
        return self.model(batch).sum()


def test_a_method_counts_its_batch_not_self() -> None:
    trainer = Trainer()
    for n in (8, 8, 3):
        trainer.step(torch.randn(n, 4))
    meter = Trainer.step.speed_report
    assert (meter.calls, meter.steps) == (3, 3)
    assert (meter.total.samples, meter.total.tokens) == (19.0, 76.0)
    assert trainer.seen == [8, 8, 3]


def test_a_method_with_the_batch_as_a_keyword() -> None:
    class Loop:
        @speed_report(samples=len, file=None)
        def step(self, batch: list[int]) -> int:
            return len(batch)

    loop = Loop()
    assert loop.step(batch=[1, 2, 3]) == 3
    assert Loop.step.speed_report.total.samples == 3.0


def test_a_classmethod_counts_its_batch_not_cls() -> None:
    class Loop:
        @classmethod
        @speed_report(samples=len, file=None)
        def step(cls, batch: list[int]) -> int:
            return len(batch)

    assert Loop.step([1, 2]) == 2
    assert Loop.step.speed_report.total.samples == 2.0


def test_a_method_above_an_autocast_step_method() -> None:
    class Loop:
        def __init__(self) -> None:
            torch.manual_seed(0)
            self.model = nn.Linear(4, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.train_step = autocast_step(self.optimizer, model=self.model, accumulate=2)(
                self._loss
            )

        def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.model(x), y)

        @speed_report(samples=len, file=None)
        def step(self, x: torch.Tensor, y: torch.Tensor) -> Any:
            return self.train_step(x, y)

    loop = Loop()
    for _ in range(4):
        loop.step(torch.randn(5, 4), torch.randn(5, 2))
    meter = Loop.step.speed_report
    assert (meter.calls, meter.steps, meter.total.samples) == (4, 2, 20.0)


def test_a_plain_function_still_counts_its_first_argument() -> None:
    @speed_report(samples=len, file=None)
    def step(self_like: list[int], other: int) -> int:  # not named self: the batch
        return other

    step([1, 2, 3, 4], 0)
    assert step.speed_report.total.samples == 4.0


def test_a_count_that_fails_raises_before_the_step_runs() -> None:
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []

    @speed_report(samples=len, file=None)
    def step(batch: Any) -> None:
        calls.append(1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    with pytest.raises(TypeError, match="has no len") as info:
        step(object())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "speed_report(samples=len)" in notes
    assert "an object" in notes or "object" in notes
    assert "step" in notes
    assert calls == []  # the step did not run
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    meter = step.speed_report
    assert meter.calls == 0


def test_a_failing_count_function_is_named_in_the_note() -> None:
    def broken(batch: Any) -> int:
        raise KeyError("attention_mask")

    meter = speed_report(samples=4, tokens=broken, file=None)
    with pytest.raises(KeyError) as info, meter.measure({"input_ids": None}):
        raise AssertionError("the block must not run")  # pragma: no cover
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "speed_report(tokens=broken)" in notes
    assert meter.calls == 0
    with meter.measure({"attention_mask": None}, tokens=3):
        pass
    assert meter.calls == 1


def test_count_flops_of_a_method_takes_the_batch_after_self() -> None:
    from cudakit.speed import count_flops

    class Net:
        def __init__(self) -> None:
            self.model = nn.Linear(4, 2)

        def loss(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x).sum()

    net = Net()
    x = torch.randn(6, 4)
    bound = count_flops(net.loss, x, model=net.model)
    unbound = count_flops(Net.loss, net, x, model=net.model)
    assert bound.example is x
    assert unbound.example is x
    assert unbound.total == bound.total


def test_samples_len_of_a_dict_batch_is_refused_with_the_fix() -> None:
    meter = speed_report(samples=len, file=None)
    batch = {"input_ids": torch.zeros(8, 16), "attention_mask": torch.ones(8, 16)}
    with pytest.raises(ValueError, match="2 keys") as info, meter.measure(batch):
        raise AssertionError("the block must not run")  # pragma: no cover
    message = str(info.value)
    assert "speed_report(samples=len) counts the 2 keys of a dict, not its samples" in message
    assert "samples=lambda batch: len(batch['input_ids'])" in message
    assert meter.calls == 0


def test_samples_len_of_an_inputs_targets_pair_warns_with_the_fix() -> None:
    @speed_report(samples=len, file=None)
    def step(batch: Any) -> None:
        pass

    with pytest.warns(UserWarning, match=r"counts the 2 items of a tuple of tensors with 8 rows"):
        step((torch.zeros(8, 3), torch.zeros(8)))
    with pytest.warns(UserWarning, match=r"samples=lambda batch: len\(batch\[0\]\)"):
        step([torch.zeros(4, 3), torch.zeros(4)])
    assert step.speed_report.total.samples == 4.0  # what len counts, as asked


def test_a_list_of_images_counts_its_images() -> None:
    """A detection model's batch: a list of images (3, H, W), each a sample."""
    meter = speed_report(samples=lambda batch: len(batch), file=None)
    with meter.measure([torch.zeros(3, 5, 5), torch.zeros(3, 7, 6)]):
        pass
    assert meter.total.samples == 2.0


@pytest.mark.parametrize(
    ("batch", "samples"),
    [
        ([1, 2, 3], 3),  # a list of samples
        (["a", "b"], 2),
        ((torch.zeros(8, 3), torch.zeros(5)), 2),  # tensors of different lengths: items
        ([torch.zeros(3, 4, 4), torch.zeros(3, 5, 5), torch.zeros(3, 6, 6)], 3),  # rows == len
        ({"ids": [1, 2]}, 1),  # no tensor in the dict
        (torch.zeros(6, 2), 6),
    ],
)
def test_samples_len_counts_the_items_where_they_are_samples(batch: Any, samples: int) -> None:
    meter = speed_report(samples=len, file=None)
    with meter.measure(batch):
        pass
    assert meter.total.samples == samples


def test_samples_len_of_a_dict_example_batch_is_refused_at_the_door() -> None:
    from cudakit.speed import FlopCount

    example = {"input_ids": torch.zeros(4, 8)}
    with pytest.raises(ValueError, match="counts the 1 key of a dict"):
        speed_report(samples=len, flops=FlopCount(100, 40, example), file=None)
    meter = speed_report(
        samples=lambda b: len(b["input_ids"]), flops=FlopCount(100, 40, example), file=None
    )
    with meter.measure({"input_ids": torch.zeros(2, 8)}):
        pass
    assert (meter.total.samples, meter.total.flops) == (2.0, 50.0)
