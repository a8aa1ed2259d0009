"""``skip_spikes=`` under ``compile=True`` on the GPU's sync-free path: the spike test is
judged inside the compiled region with the non-finite check and the clipping, so the
rule adds no eager op of its own; the thresholds change every window without a
recompile. Run on the CPU with the GPU's path forced (inductor compiles for the CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import cudakit.amp.watch as amp_watch
from cudakit.amp import SpikeRule, autocast_step

pytestmark = [
    # Inductor's own import of torch.jit trips this in torch 2.13; not cudakit's.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture
def counters() -> Any:
    """Dynamo's counters (graph breaks, graphs compiled), from a clean slate."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


def _data(n: int) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        k = float("nan") if i == 5 else 30.0 if i == 15 else 1.0
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        out.append((x, y, torch.tensor(k)))  # a tensor: no graph per factor
    return out


def _run(on: Any, compiled: bool) -> tuple[list[tuple[bool, bool]], Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt,
        dtype=torch.float32,
        max_grad_norm=1.0,
        skip_spikes=SpikeRule(on=on, z=3.0, warmup=3),
        compile={"fullgraph": True} if compiled else False,
    )
    assert step._stepper.lazy
    fn = step(lambda x, y, k: F.mse_loss(model(x), y) * k)
    results = [fn(*batch) for batch in _data(24)]
    flags = [(bool(r.skipped), bool(r.spike)) for r in results]
    return flags, step, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("on", ["loss", "grad_norm", ("loss", "grad_norm")])
def test_the_rule_is_judged_inside_the_compiled_region(
    on: Any, counters: Any, skip_on_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager_flags, eager, eager_weights = _run(on, compiled=False)

    def no_eager_judge(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the spike test ran eagerly under compile=True")

    monkeypatch.setattr(amp_watch.Watch, "judge_device", no_eager_judge)
    flags, step, weights = _run(on, compiled=True)
    assert flags == eager_flags
    assert flags[5] == (True, False)  # the NaN: non-finite, not a spike
    assert (step.steps, step.skipped_steps, step.spike_steps) == (
        eager.steps,
        eager.skipped_steps,
        eager.spike_steps,
    )
    assert step.spike_steps >= 1
    stats, eager_stats = step.state_dict()["spike_stats"], eager.state_dict()["spike_stats"]
    for name, stat in stats.items():
        assert stat["count"] == eager_stats[name]["count"]
        assert stat["mean"] == pytest.approx(eager_stats[name]["mean"], rel=1e-5)
    for a, b in zip(weights, eager_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    # The forward, and the region: dynamo compiles it for the first threshold, then
    # once with the threshold as an input; the thresholds of the later windows, new
    # every window, compile nothing more.
    assert counters["stats"]["unique_graphs"] <= 3


def test_the_fused_region_needs_floats_dynamo_does_not_specialize(
    skip_on_device: None,
) -> None:
    """Where dynamo would compile a graph per threshold, the test stays eager."""
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with dynamo_config.patch(specialize_float=True):
        step = autocast_step(
            opt, dtype=torch.float32, max_grad_norm=1.0, skip_spikes=True, compile=True
        )
    assert step._stepper.judge._compiled_judge is None
    assert step._stepper.judge._compiled_check is not None


@pytest.mark.cuda
def test_cuda_compiled_region_judges_without_a_sync() -> None:
    """On a GPU: the region with the float thresholds compiles, skips the spike, never syncs."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt,
        dtype=torch.float32,
        max_grad_norm=1.0,
        skip_spikes=SpikeRule(on=("loss", "grad_norm"), z=3.0, warmup=3),
        compile=True,
    )
    assert step._stepper.judge._compiled_judge is not None
    fn = step(lambda x, y, k: F.mse_loss(model(x), y) * k)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(8, 8, generator=g).cuda(),
            torch.randn(8, 1, generator=g).cuda(),
            torch.tensor(30.0 if i == 18 else 1.0).cuda(),
        )
        for i in range(24)
    ]
    results = [fn(*batch) for batch in data[:10]]  # compiled by now (twice at most)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        results += [fn(*batch) for batch in data[10:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [bool(r.spike) for r in results] == [i == 18 for i in range(24)]
    assert (step.spike_steps, step.skipped_steps) == (1, 1)


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "reduce-overhead"},
        {"mode": "max-autotune"},
        {"options": {"triton.cudagraphs": True}},
    ],
    ids=["reduce-overhead", "max-autotune", "triton-graphs"],
)
def test_the_test_stays_eager_where_the_region_is_captured_in_graphs(
    options: dict[str, Any], skip_on_device: None
) -> None:
    """CUDA graphs take tensors as inputs: a float threshold there stays out of the region."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt, dtype=torch.float32, max_grad_norm=1.0, skip_spikes=True, compile=options
    )
    assert step._stepper.judge._compiled_judge is None
    assert step._stepper.judge._compiled_check is not None
