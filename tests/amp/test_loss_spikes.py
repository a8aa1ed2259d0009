"""Loss-spike skipping (``autocast_step(skip_spikes=...)``): the rule against a hand-written
loop, bit for bit, on both ways a sync-free step skips; no host reads; checkpoints; errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import AutocastStep, SpikeRule, autocast_step
from cudakit.amp.spikes import f32
from cudakit.exceptions import NonFiniteStepsError

F32_MAX = float(torch.finfo(torch.float32).max)


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host: item, bool, tolist."""

    NAMES = ("item", "__bool__", "tolist")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    return model, opt, sched


def _data(n: int, spikes: set[int] = frozenset(), nan: set[int] = frozenset()) -> list[Any]:
    """Micro-batches (x, y, k): the loss is multiplied by k (30 on a spike, NaN on ``nan``)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        k = float("nan") if i in nan else 30.0 if i in spikes else 1.0
        out.append((x, y, k))
    return out


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
    return F.mse_loss(model(x), y) * k


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _hand_written(
    data: list[Any], rule: SpikeRule, accumulate: int, clip: float | None
) -> tuple[list[torch.Tensor], list[bool], int, dict[str, Any]]:
    """The rule applied by hand: float64 statistics, the threshold compared in float32."""
    model, opt, sched = _make()
    params = list(model.parameters())
    stats = {s: [0.0, 0.0, 0] for s in rule.on}
    skipped = []
    for start in range(0, len(data), accumulate):
        window = data[start : start + accumulate]
        buffers = [b.clone() for b in model.buffers()]
        opt.zero_grad()
        losses = []
        for x, y, k in window:
            loss = _loss(model, x, y, k)
            (loss / accumulate).backward()
            losses.append(loss.detach())
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        values = {"loss": total / len(losses) if len(losses) > 1 else total}
        grads = [p.grad for p in params]
        nonfinite = not all(bool(torch.isfinite(t).all()) for t in [*losses, *grads])
        if clip is not None:
            values["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            values["grad_norm"] = torch.nn.utils.get_total_norm(grads)
        spike = False
        if not nonfinite:
            for name in rule.on:
                mean, var, count = stats[name]
                level = F32_MAX
                if count >= rule.warmup:
                    level = min(mean + rule.z * math.sqrt(var), F32_MAX)
                spike = spike or bool(values[name] > torch.tensor(level, dtype=torch.float32))
        if nonfinite or spike:
            skipped.append(True)
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
            continue
        skipped.append(False)
        opt.step()
        sched.step()
        for name in rule.on:
            mean, var, count = stats[name]
            alpha = max(1 / (count + 1), 1 - rule.decay)
            d = values[name].item() - mean
            stats[name] = [mean + alpha * d, (1 - alpha) * (var + alpha * d * d), count + 1]
    state = {k: {"mean": v[0], "var": v[1], "count": v[2]} for k, v in stats.items()}
    return _state(model, opt), skipped, sched.last_epoch, state


def _with_step(
    data: list[Any], rule: SpikeRule, accumulate: int, clip: float | None
) -> tuple[list[torch.Tensor], list[bool], int, dict[str, Any], AutocastStep]:
    model, opt, sched = _make()
    step = autocast_step(
        opt,
        model=model,
        dtype=torch.float32,
        accumulate=accumulate,
        max_grad_norm=clip,
        scheduler=sched,
        skip_spikes=rule,
    )
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    results = [fn(*batch) for batch in data]
    skipped = [bool(r.skipped) for r in results[accumulate - 1 :: accumulate]]
    return _state(model, opt), skipped, sched.last_epoch, step.state_dict()["spike_stats"], step


RULES = [
    SpikeRule(on="loss", z=3.0, warmup=4, decay=0.9),
    SpikeRule(on="grad_norm", z=3.0, warmup=4, decay=0.9),
    SpikeRule(on=("loss", "grad_norm"), z=2.0, warmup=3, decay=0.8),
]


@pytest.mark.parametrize("rule", RULES, ids=["loss", "grad_norm", "both"])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, 0.5)])
def test_skips_exactly_as_a_hand_written_loop(
    rule: SpikeRule, accumulate: int, clip: float | None, skip_on: str
) -> None:
    data = _data(12 * accumulate, spikes={7 * accumulate}, nan={4 * accumulate})
    want = _hand_written(data, rule, accumulate, clip)
    got = _with_step(data, rule, accumulate, clip)
    assert got[1] == want[1]
    assert want[1][7]
    assert want[1][4]
    for a, b in zip(got[0], want[0], strict=True):
        assert torch.equal(a, b)
    assert got[2] == want[2]  # the scheduler stepped on accepted windows only
    assert got[3] == want[3]  # the running statistics, bit for bit
    step = got[4]
    assert (step.steps, step.skipped_steps) == (10, 2)
    assert step.spike_steps == sum(want[1]) - 1


@settings(max_examples=8, deadline=None)
@given(
    spikes=st.sets(st.integers(3, 11), max_size=3),
    nan=st.sets(st.integers(0, 11), max_size=2),
    z=st.sampled_from([1.5, 3.0]),
    ratio=st.sampled_from([None, 1.2]),
)
def test_host_and_device_paths_judge_alike(
    spikes: set[int], nan: set[int], z: float, ratio: float | None
) -> None:
    """The CPU's host-side judgement and the GPU's on-device one agree, window by window."""
    rule = SpikeRule(on=("loss", "grad_norm"), z=z, ratio=ratio, warmup=2, decay=0.9)
    data = _data(12, spikes=spikes, nan=nan)
    runs = []
    for path in ("host", "device"):
        with pytest.MonkeyPatch.context() as patch:
            if path == "device":
                patch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
            model, opt, _ = _make()
            step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes=rule)
        assert step._stepper.lazy == (path == "device")
        fn = step(lambda x, y, k, m=model: _loss(m, x, y, k))
        results = [fn(*b) for b in data]
        flags = [(bool(r.skipped), bool(r.spike)) for r in results]
        runs.append((flags, _state(model, opt), step.state_dict()["spike_stats"]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert runs[0][2] == runs[1][2]


def test_the_spike_flag_and_counters(skip_on: str) -> None:
    model, opt, _ = _make()
    step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes=RULES[0])
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    results = [fn(*b) for b in _data(10, spikes={6}, nan={2})]
    assert [bool(r.spike) for r in results] == [i == 6 for i in range(10)]
    assert [bool(r.skipped) for r in results] == [i in (2, 6) for i in range(10)]
    assert results[6].spike == True  # noqa: E712  (lazily read on the device path)
    assert (step.steps, step.skipped_steps, step.spike_steps) == (8, 2, 1)
    assert step.skip_spikes == RULES[0]


def test_no_host_reads_per_step_on_the_sync_free_path(skip_on: str) -> None:
    model, opt, sched = _make()
    step = autocast_step(
        opt,
        model=model,
        dtype=torch.float32,
        accumulate=2,
        max_grad_norm=1.0,
        scheduler=sched,
        skip_spikes=SpikeRule(on=("loss", "grad_norm"), z=3.0, warmup=3),
    )
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    data = _data(24, spikes={15}, nan={5})
    with HostReads() as reads:
        results = [fn(*b) for b in data]
    assert reads.calls == []
    assert step._stepper.lazy == (skip_on == "device")
    assert (step.skipped_steps, step.spike_steps) == (2, 1)
    assert [bool(r.spike) for r in results].count(True) == 1


def test_token_weighted_windows_watch_the_weighted_loss(skip_on: str) -> None:
    """The statistic of a token-weighted window is its summed loss over its total weight."""
    model, opt, _ = _make()
    step = autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=2, skip_spikes=SpikeRule(warmup=2)
    )
    data = _data(2)
    ref, _, _ = _make()  # the same weights: the first window's loss, by hand
    sums = [(ref(x) - y).pow(2).squeeze(-1)[:5].sum().detach() for x, y, _ in data]
    expected = (sums[0] + sums[1]) / torch.tensor(10.0)

    @step
    def weighted(x: torch.Tensor, y: torch.Tensor, k: float) -> dict[str, Any]:
        per = (model(x) - y).pow(2).squeeze(-1) * k
        return {"loss": per[:5].sum(), "weight": 5}

    for batch in data:
        weighted(*batch)
    stats = step.state_dict()["spike_stats"]["loss"]
    assert stats == {"mean": expected.item(), "var": 0.0, "count": 1}


def test_fp16_with_a_scaler_skips_spikes_on_both_paths(skip_on: str) -> None:
    model, opt, _ = _make()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    step = autocast_step(opt, model=model, dtype=torch.float16, scaler=scaler, skip_spikes=RULES[0])
    fn = step(lambda x, y, k: _loss(model, x, y, k).float())
    results = [fn(*b) for b in _data(10, spikes={7})]
    assert [bool(r.spike) for r in results] == [i == 7 for i in range(10)]
    assert step.spike_steps == 1
    assert scaler.get_scale() == 256.0  # a spike is no overflow: the scale does not back off


def test_an_overflowing_statistic_is_a_spike_even_in_warm_up(skip_on: str) -> None:
    model, opt, _ = _make()
    step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes="grad_norm")
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    x, y, _ = _data(1)[0]
    before = [t.clone() for t in model.state_dict().values()]
    r = fn(x, y, 1e30)  # finite loss and gradients, but their norm overflows float32
    assert r.spike == True  # noqa: E712
    for a, b in zip(model.state_dict().values(), before, strict=True):
        assert torch.equal(a, b)
    # (a fused optimizer skipped on the device still makes its state: a fresh one)
    assert all(not v.any() for s in opt.state.values() for k, v in s.items() if k != "step")


# ---------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_resumes_bit_for_bit(skip_on: str) -> None:
    rule = RULES[2]
    data = _data(16, spikes={9, 13}, nan={3})
    full = _with_step(data, rule, 1, 0.5)

    model, opt, sched = _make()
    step = autocast_step(
        opt, model=model, dtype=torch.float32, max_grad_norm=0.5, scheduler=sched,
        skip_spikes=rule,
    )  # fmt: skip
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    for batch in data[:8]:
        fn(*batch)
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "step": step.state_dict()}  # fmt: skip
    ckpt = {k: _clone(v) for k, v in ckpt.items()}
    assert ckpt["step"]["spike_steps"] == 0
    assert ckpt["step"]["spike_stats"]["loss"]["count"] == 7

    model2, opt2, sched2 = _make(seed=5)
    step2 = autocast_step(
        opt2, model=model2, dtype=torch.float32, max_grad_norm=0.5, scheduler=sched2,
        skip_spikes=rule,
    )  # fmt: skip
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    step2.load_state_dict(ckpt["step"])
    fn2 = step2(lambda x, y, k: _loss(model2, x, y, k))
    for batch in data[8:]:
        fn2(*batch)
    for a, b in zip(_state(model2, opt2), full[0], strict=True):
        assert torch.equal(a, b)
    assert step2.state_dict()["spike_stats"] == full[3]
    assert (step2.spike_steps, step2.skipped_steps) == (full[4].spike_steps, 3)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def test_a_checkpoint_from_before_spikes_still_loads() -> None:
    model, opt, _ = _make()
    old = autocast_step(opt, dtype=torch.float32).state_dict()
    for key in ("spike_steps", "consecutive_spikes", "spike_stats"):
        del old[key]
    step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes=True)
    step.load_state_dict(old)
    assert step.spike_steps == 0
    assert step.state_dict()["spike_stats"] == {"loss": {"mean": 0.0, "var": 0.0, "count": 0}}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"spike_steps": -1}, ValueError, r"state\['spike_steps'\]=\.\.\.\) expects an int >= 0"),
        ({"spike_steps": "1"}, TypeError, r"state\['spike_steps'\]=\.\.\.\) expects an int >= 0"),
        ({"spike_steps": 5}, ValueError, "must not exceed the skipped steps"),
        ({"consecutive_spikes": 2}, ValueError, "must not exceed the skipped steps"),
        ({"spike_stats": []}, TypeError, "must be a dict of running statistics"),
        ({"spike_stats": {"lost": {}}}, ValueError, "holds 'lost'; expected 'loss'"),
        ({"spike_stats": {"loss": {"mean": 1.0}}}, ValueError, "with 'mean', 'var' and 'count'"),
        (
            {"spike_stats": {"loss": {"mean": "1", "var": 0.0, "count": 1}}},
            TypeError,
            r"\['mean'\]=\.\.\.\) expects a finite number",
        ),
        (
            {"spike_stats": {"loss": {"mean": 1.0, "var": -1.0, "count": 1}}},
            ValueError,
            r"\['var'\]=\.\.\.\) expects a finite number >= 0",
        ),
        (
            {"spike_stats": {"loss": {"mean": math.nan, "var": 0.0, "count": 1}}},
            ValueError,
            r"\['mean'\]=\.\.\.\) expects a finite number",
        ),
        (
            {"spike_stats": {"loss": {"mean": 1.0, "var": 0.0, "count": -2}}},
            ValueError,
            r"\['count'\]=\.\.\.\) expects an int >= 0",
        ),
    ],
)
def test_impossible_spike_state_is_refused_and_changes_nothing(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    model, opt, _ = _make()
    step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes=RULES[0])
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    for batch in _data(6, spikes={5}):
        fn(*batch)
    before = step.state_dict()
    with pytest.raises(error, match=match):
        step.load_state_dict({**before, **change})
    after = step.state_dict()
    assert after["spike_stats"] == before["spike_stats"]
    assert (after["steps"], after["spike_steps"]) == (before["steps"], before["spike_steps"])


# ---------------------------------------------------------------------- streaks and errors


def test_a_streak_of_spikes_raises_naming_the_spike_rule() -> None:
    model, opt, _ = _make()
    step = autocast_step(
        opt, model=model, dtype=torch.float32, max_skipped=3,
        skip_spikes=SpikeRule(warmup=2, z=1.0),
    )  # fmt: skip
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    data = _data(3)
    for batch in data[:2]:
        fn(*batch)
    x, y, _ = data[2]
    fn(x, y, 1000.0)
    fn(x, y, 1000.0)
    with pytest.raises(NonFiniteStepsError, match="every window's loss was a spike.*SpikeRule"):
        fn(x, y, 1000.0)


def test_a_mixed_streak_names_both_causes() -> None:
    model, opt, _ = _make()
    step = autocast_step(
        opt, model=model, dtype=torch.float32, max_skipped=2,
        skip_spikes=SpikeRule(warmup=2, z=1.0),
    )  # fmt: skip
    fn = step(lambda x, y, k: _loss(model, x, y, k))
    data = _data(3)
    for batch in data[:2]:
        fn(*batch)
    x, y, _ = data[2]
    fn(x, y, 1000.0)
    with pytest.raises(NonFiniteStepsError, match=r"\(1 of them loss spikes.*inf/NaN"):
        fn(x, y, float("nan"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on": ()}, ValueError, r"SpikeRule\(on=...\) got an empty tuple"),
        ({"on": "loss_norm"}, ValueError, r"SpikeRule\(on=...\) expects one of 'loss'"),
        ({"on": 1}, TypeError, r"SpikeRule\(on=...\) expects one of 'loss', 'grad_norm'"),
        ({"on": ("loss", "loss")}, ValueError, "names a statistic twice"),
        ({"z": 0}, ValueError, r"SpikeRule\(z=...\) expects a positive finite number"),
        ({"z": "6"}, TypeError, r"SpikeRule\(z=...\) expects a positive finite number"),
        ({"z": math.inf}, ValueError, r"SpikeRule\(z=...\) expects a positive finite"),
        ({"ratio": 0.5}, ValueError, r"SpikeRule\(ratio=...\) expects a finite number >= 1"),
        ({"ratio": True}, TypeError, r"SpikeRule\(ratio=...\) expects a finite number"),
        ({"z": None}, ValueError, "z=None and ratio=None, so no window could ever be"),
        ({"warmup": 1}, ValueError, r"SpikeRule\(warmup=...\) expects an int >= 2"),
        ({"warmup": 2.0}, TypeError, r"SpikeRule\(warmup=...\) expects an int >= 2"),
        ({"decay": 1.0}, ValueError, r"SpikeRule\(decay=...\) expects a finite number in \(0, 1\)"),
        ({"decay": 0}, ValueError, r"SpikeRule\(decay=...\) expects a finite number in \(0, 1\)"),
        ({"decay": "0.9"}, TypeError, r"SpikeRule\(decay=...\) expects a finite number"),
    ],
)
def test_spike_rule_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SpikeRule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"skip_spikes": 3}, TypeError, r"skip_spikes=...\) expects True, False, 'loss'"),
        ({"skip_spikes": "norm"}, ValueError, r"skip_spikes=...\) got 'norm'; a statistic"),
        ({"skip_spikes": {"z": 3}}, TypeError, r"expects True, False, 'loss', 'grad_norm' or"),
        (
            {"skip_spikes": True, "skip_nonfinite": False},
            ValueError,
            r"skip_spikes=...\) needs skip_nonfinite=True",
        ),
        ({"locate_nonfinite": 1}, TypeError, r"locate_nonfinite=...\) expects True or False"),
        (
            {"locate_nonfinite": True, "skip_nonfinite": False},
            ValueError,
            r"locate_nonfinite=True\) needs skip_nonfinite=True",
        ),
    ],
)
def test_step_argument_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    model, opt, _ = _make()
    with pytest.raises(error, match=match):
        autocast_step(opt, model=model, dtype=torch.float32, **kwargs)


def test_an_unknown_keyword_of_the_step_class_is_refused() -> None:
    _, opt, _ = _make()
    with pytest.raises(TypeError, match="unexpected keyword argument 'skip_spike'"):
        AutocastStep(opt, skip_spike=True)  # type: ignore[call-arg]


def test_off_by_default_and_the_float32_rounding_helper() -> None:
    _, opt, _ = _make()
    step = autocast_step(opt)
    assert step.skip_spikes is None
    assert step.spike_steps == 0
    assert not step.locate_nonfinite
    assert f32(0.1) == torch.tensor(0.1, dtype=torch.float32).item()
    assert f32(1e300) == math.inf
