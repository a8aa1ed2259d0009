"""What ``skip_spikes=`` adds to the GPU's sync-free path: the ops it dispatches per window.

On a launch-bound GPU step every op costs host time, so the rule's footprint is pinned
down here, on the CPU with the GPU's path forced: a comparison with the threshold and a
select into the skip flag per statistic, and one pack of what is posted in place of the
copy of the verdict that the step without a rule makes. No type promotion copies, and
the threshold travels as a CPU scalar tensor (no Python number wrapped on each call).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import SpikeRule, autocast_step


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched, by name (``aten.gt.Tensor`` -> ``gt.Tensor``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def _window_ops(on: Any, monkeypatch: pytest.MonkeyPatch, clip: bool = False) -> Counter[str]:
    """The ops of one steady-state window on the device path."""
    monkeypatch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rule = SpikeRule(on=on, warmup=2) if on else False
    step = autocast_step(
        opt, dtype=torch.float32, skip_spikes=rule, max_grad_norm=1.0 if clip else None
    )
    assert step._stepper.lazy

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
    for _ in range(5):  # past the rule's warm-up: finite thresholds
        train(x, y)
    with AtenOps() as counted:
        train(x, y)
    return counted.ops


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize(
    ("on", "statistics"), [("loss", 1), ("grad_norm", 1), (("loss", "grad_norm"), 2)]
)
def test_the_rule_adds_a_compare_and_a_select_per_statistic(
    on: Any, statistics: int, clip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    without = _window_ops(False, monkeypatch, clip)
    with_rule = _window_ops(on, monkeypatch, clip)
    added = with_rule - without
    removed = without - with_rule
    kernels = {op: n for op, n in added.items() if not op.startswith(("view", "empty"))}
    if "grad_norm" in on and not clip:
        # Without clipping the norm is the rule's own: what get_total_norm runs for
        # plain gradients (a norm per tensor, then the norm of the stacked norms).
        for op in ("_foreach_norm.Scalar", "stack.default", "linalg_vector_norm.default"):
            assert kernels.pop(op, 0) == 1, (op, added)
    assert kernels == {
        "gt.Tensor": statistics,
        "where.self": statistics,
        "cat.default": 1,
    }, added
    assert removed == Counter({"clone.default": 1}), removed
    assert "_to_copy.default" not in added
    assert "maximum.default" not in added


def test_the_threshold_tensor_follows_the_rule_statistics() -> None:
    """The device compares with a CPU scalar tensor that always equals the threshold."""
    from cudakit.amp.spikes import RunningStat, SpikeWatch

    watch = SpikeWatch(SpikeRule(on=("loss", "grad_norm"), z=2.0, warmup=2))
    assert [t.item() for t in watch._level_tensors] == list(watch.thresholds())
    for value in (1.0, 2.0, 1.5, 1.25):
        watch.learn([value, value * 3])
        assert [t.item() for t in watch._level_tensors] == list(watch.thresholds())
    one = SpikeWatch(SpikeRule(on="loss", z=3.0, warmup=2))
    for value in (1.0, 2.0, 1.5):
        one.learn_one(value)
        assert one._level_tensors[0].item() == one.thresholds()[0]
    one.restore({"loss": RunningStat(5.0, 4.0, 10)})
    assert one._level_tensors[0].item() == one.thresholds()[0] == 11.0
    for t in (*watch._level_tensors, *one._level_tensors):
        assert (t.device.type, t.dim(), t.dtype) == ("cpu", 0, torch.float32)


@pytest.mark.cuda
def test_cuda_spike_rule_never_synchronizes_and_skips_the_spike() -> None:
    """On a GPU: the threshold as a CPU scalar operand, no sync, the spike window skipped."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    rule = SpikeRule(on=("loss", "grad_norm"), z=3.0, warmup=3)
    step = autocast_step(opt, dtype=torch.float32, max_grad_norm=1.0, skip_spikes=rule)
    assert step._stepper.lazy

    @step
    def train(x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
        return F.mse_loss(model(x), y) * k

    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 8, generator=g).cuda(), torch.randn(8, 1, generator=g).cuda(), k)
        for k in [1.0] * 12 + [30.0] + [1.0] * 3
    ]
    train(*data[0])  # the flags, the optimizer state and the pinned buffer come first
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        results = [train(*batch) for batch in data[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [bool(r.spike) for r in results] == [i == 11 for i in range(len(results))]
    assert (step.spike_steps, step.skipped_steps) == (1, 1)


def _spike_run(step: Any, model: torch.nn.Module) -> tuple[list[bool], list[torch.Tensor]]:
    """A run with a spike at window 8; the flags and the weights after it."""
    fn = step(lambda x, y, k: F.mse_loss(model(x), y) * k)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g), k)
        for k in [1.0] * 8 + [50.0] + [1.0] * 3
    ]
    flags = [bool(fn(*b).spike) for b in data]
    return flags, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_step_keeps_its_device_threshold(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The threshold tensor the device compares with follows the copy's statistics."""
    import copy
    import pickle

    monkeypatch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
    runs = []
    for copied in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step = autocast_step(opt, dtype=torch.float32, skip_spikes=SpikeRule(z=3.0, warmup=3))
        if copied:
            twin = (model, step)
            model, step = (
                copy.deepcopy(twin) if how == "deepcopy" else pickle.loads(pickle.dumps(twin))
            )
        runs.append(_spike_run(step, model))
        assert step.spike_steps == 1
        watch = step._stepper.watch.spikes
        assert [t.item() for t in watch._level_tensors] == list(watch.thresholds())
    assert runs[0][0] == runs[1][0] == [i == 8 for i in range(12)]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)
