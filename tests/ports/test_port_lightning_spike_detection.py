"""Loss-spike skipping (``autocast_step(skip_spikes=...)``) against peers' spike detectors.

Ported from Lightning's ``SpikeDetection`` (src/lightning/fabric/utilities/spike.py,
src/lightning/pytorch/callbacks/spike.py) and its tests
tests/tests_fabric/utilities/test_spike.py (test_fabric_spike_detection_integration) and
tests/tests_pytorch/callbacks/test_spike.py (test_trainer_spike_detection_integration:
losses ``1/i`` with a bad batch at index 4, ``3``/``inf``/``-inf``/``NaN``, finite_only
on and off); OLMo-core's ``SkipStepOptimizer`` (src/olmo_core/optim/skip_step_optimizer.py)
and its tests src/test/optim/skip_step_optimizer_test.py (test_skip_step_optimizer,
test_skip_step_optimizer_caches_the_live_guard_reason) and src/test/optim/adamw_test.py
(test_skipstep_adamw_equivalence: a skipped step leaves the optimizer as if it never
ran); llm-foundry's ``KillLossSpike`` (llmfoundry/callbacks/kill_loss_spike_callback.py)
and tests/callbacks/test_kill_loss_spike_callback.py (outlier_multiplier, patience).

Where cudakit deliberately differs, the tests check cudakit's documented behaviour
(docs/observe.md, "Loss spikes"), and a comment says so: cudakit skips a spike window
instead of raising (Lightning's ``TrainingSpikeException``, llm-foundry's
``LossSpikeError``) and raises only for a streak (``max_skipped``); its running
statistics decay exponentially instead of keeping a window of the last values; its test
is one-sided (a drop is never a spike; OLMo's z-score is two-sided); an inf/NaN loss is
the non-finite guard's, never a spike.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import AutocastStep, NonFiniteWarning, SpikeRule, autocast_step
from cudakit.amp.spikes import f32
from cudakit.exceptions import NonFiniteStepsError

F32_MAX = float(torch.finfo(torch.float32).max)
INF, NAN = math.inf, math.nan


# ---------------------------------------------------------------------- the rule by hand


def _level(stat: list[Any], rule: SpikeRule) -> float:
    """The threshold docs/observe.md describes: float64 statistics, rounded to float32."""
    mean, var, count = stat
    if count < rule.warmup:
        return F32_MAX
    level = -math.inf
    if rule.z is not None:
        level = mean + rule.z * math.sqrt(var)
    if rule.ratio is not None:
        level = max(level, rule.ratio * mean)
    return f32(min(level, F32_MAX))


def _learn(stat: list[Any], x: float, rule: SpikeRule) -> None:
    mean, var, count = stat
    alpha = max(1 / (count + 1), 1 - rule.decay)
    d = x - mean
    stat[:] = [mean + alpha * d, (1 - alpha) * (var + alpha * d * d), count + 1]


class ByHand:
    """The rule applied by hand to a window's statistics (float32 values as floats)."""

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self.stats: dict[str, list[Any]] = {name: [0.0, 0.0, 0] for name in rule.on}

    def judge(self, values: dict[str, float]) -> bool:
        """True for a spike (the caller checked the window is finite)."""
        return any(values[name] > _level(self.stats[name], self.rule) for name in self.rule.on)

    def learn(self, values: dict[str, float]) -> None:
        for name in self.rule.on:
            _learn(self.stats[name], values[name], self.rule)

    def state(self) -> dict[str, dict[str, Any]]:
        return {k: {"mean": m, "var": v, "count": c} for k, (m, v, c) in self.stats.items()}


def _identity(rule: SpikeRule, **options: Any) -> tuple[AutocastStep, Callable[[float], Any]]:
    """Lightning's IdentityModule: one weight reset to 1, so the loss is the value given
    and the gradient (and its norm) is that value too."""
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1e-3, fused=True)  # fused: the sync-free path applies
    options.setdefault("max_skipped", 1000)
    step = autocast_step(opt, dtype=torch.float32, skip_spikes=rule, **options)

    @step
    def fn(v: float) -> torch.Tensor:
        with torch.no_grad():
            w.fill_(1.0)
        return (w * v).sum()

    return step, fn


def _by_hand_schedule(values: Sequence[float], rule: SpikeRule) -> tuple[list[str], ByHand]:
    """Each window's fate under the rule, for the identity model: ok, spike or nonfinite."""
    hand = ByHand(rule)
    fates = []
    for v in values:
        if not math.isfinite(v):
            fates.append("nonfinite")
            continue
        stats = {"loss": v, "grad_norm": abs(v)}  # a one-element gradient's norm: |v|, exactly
        if hand.judge(stats):
            fates.append("spike")
        else:
            hand.learn(stats)
            fates.append("ok")
    return fates, hand


def _fates(results: Sequence[Any]) -> list[str]:
    out = []
    for r in results:
        spike, skipped = bool(r.spike), bool(r.skipped)
        assert not spike or skipped  # a spike is a skip
        out.append("spike" if spike else "nonfinite" if skipped else "ok")
    return out


# ---------------------------------------------------------------------- models and data


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient: a gradient blow-up whose
    loss stays normal."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.k, None


def _mlp(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    middle: list[nn.Module] = [nn.BatchNorm1d(16)] if batchnorm else []
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), *middle, nn.Linear(16, 1))


def _batches(n: int, inject: dict[int, tuple[str, float]] | None = None) -> list[Any]:
    """Batches (x, y, kind, k): kind "loss" multiplies the loss by k, "grad" the gradient,
    "offset" adds k to the loss (its gradient unchanged: OLMo's outlier ``latest_loss``)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
        kind, k = (inject or {}).get(i, ("none", 1.0))
        out.append((x, y, kind, k))
    return out


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str, k: float) -> torch.Tensor:
    out = model(x)
    if kind in ("grad", "both"):
        out = _ScaleGrad.apply(out, k)
    loss = F.mse_loss(out.float(), y)
    if kind == "loss":
        loss = loss * k
    if kind in ("offset", "both"):
        loss = loss + k
    return loss


def _state(model: nn.Module, *opts: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for opt in opts:
        for state in opt.state.values():
            out += [torch.as_tensor(v).clone() for _, v in sorted(state.items())]
    return out


def _assert_same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item()


# ---------------------------------------------------------------------- Lightning


LIGHTNING = SpikeRule(on="loss", z=None, ratio=3.0, warmup=2, decay=0.9)
"""Lightning's defaults as a cudakit rule: rtol=2 (|x - mean| >= 2 * mean, i.e. x >= 3 *
mean upwards), window=10 (decay 0.9: the first 10 windows average exactly, then an
exponential decay instead of a sliding window), warmup=1 (cudakit's least is 2)."""


@pytest.mark.parametrize(
    ("spike_value", "fate"),
    [(3.0, "spike"), (INF, "nonfinite"), (-INF, "nonfinite"), (NAN, "nonfinite"), (1e-9, "ok")],
    ids=["spike", "inf", "-inf", "nan", "drop"],
)
def test_lightning_schedule_with_a_bad_batch_at_index_4(
    spike_value: float, fate: str, skip_on: str
) -> None:
    """Lightning: losses 1/i, batch 4 replaced; it raises TrainingSpikeException for 3 and
    inf (and for -inf/NaN with finite_only=True), and never learns from a non-finite loss.

    cudakit differs on purpose: it skips the window instead of raising, and an inf/NaN
    loss (either sign) is skipped by the non-finite guard (``skipped``, not ``spike``)
    whatever finite_only would say; a drop (Lightning's "improvement") is learnt.
    Lightning also excludes the batch before the spike; cudakit skips the spike window only.
    """
    values = [f32(1 / i) for i in range(1, 10)]
    values[4] = spike_value
    step, fn = _identity(LIGHTNING)
    results = [fn(v) for v in values]
    assert _fates(results) == ["ok"] * 4 + [fate] + ["ok"] * 4
    fates, hand = _by_hand_schedule(values, LIGHTNING)
    assert _fates(results) == fates
    assert step.state_dict()["spike_stats"] == hand.state()  # bit for bit
    skipped = fate != "ok"
    assert (step.steps, step.skipped_steps, step.spike_steps) == (
        9 - skipped,
        int(skipped),
        int(fate == "spike"),
    )


@pytest.mark.parametrize(
    ("values", "fates"),
    [
        # warm-up counts accepted windows: the NaN window teaches nothing, so 100 at index
        # 3 comes after 2 accepted windows (still warming up) and is learnt
        ([1.0, NAN, 1.0, 100.0, 1.0], ["ok", "nonfinite", "ok", "ok", "ok"]),
        # at index 4 it comes after 3 accepted windows: judged, a spike
        ([1.0, NAN, 1.0, 1.0, 100.0], ["ok", "nonfinite", "ok", "ok", "spike"]),
        # a spike teaches nothing either: the next outlier is judged against the same level
        ([1.0, 1.0, 1.0, 100.0, 100.0, 1.0], ["ok", "ok", "ok", "spike", "spike", "ok"]),
    ],
)
def test_warm_up_counts_accepted_windows_only(
    values: list[float], fates: list[str], skip_on: str
) -> None:
    rule = SpikeRule(on="loss", z=3.0, warmup=3, decay=0.9)
    step, fn = _identity(rule)
    assert _fates([fn(v) for v in values]) == fates
    assert step.state_dict()["spike_stats"] == _by_hand_schedule(values, rule)[1].state()


@pytest.mark.parametrize("window", [2, 5, 10])
def test_decay_matches_a_window_of_that_size_until_it_fills(window: int) -> None:
    """Lightning's running mean over ``window`` values: cudakit's decay 1 - 1/window gives
    the exact mean and (population) variance of the first ``window`` windows, then decays
    exponentially (a documented difference: it keeps no list of past values)."""
    values = [f32(1 + 0.25 * i * (-1) ** i) for i in range(window + 3)]
    rule = SpikeRule(on="loss", z=50.0, warmup=2, decay=1 - 1 / window)
    step, fn = _identity(rule)
    for v in values[:window]:
        fn(v)
    got = step.state_dict()["spike_stats"]["loss"]
    mean = math.fsum(values[:window]) / window
    var = math.fsum((v - mean) ** 2 for v in values[:window]) / window
    assert got["count"] == window
    assert math.isclose(got["mean"], mean, rel_tol=1e-12)
    assert math.isclose(got["var"], var, rel_tol=1e-9)
    for v in values[window:]:
        fn(v)
    assert step.state_dict()["spike_stats"] == _by_hand_schedule(values, rule)[1].state()


_VALUE = st.floats(0.01, 100.0).map(f32)
_SCHEDULE_ITEM = st.one_of(
    _VALUE,
    _VALUE.map(lambda v: f32(v * 1000)),  # a spike by a multiplier
    st.sampled_from([INF, -INF, NAN]),
)


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(_SCHEDULE_ITEM, min_size=1, max_size=16),
    on=st.sampled_from(["loss", "grad_norm", ("loss", "grad_norm")]),
    z=st.sampled_from([None, 0.5, 2.0, 6.0]),
    ratio=st.sampled_from([None, 1.0, 1.5, 3.0]),
    warmup=st.integers(2, 5),
    decay=st.sampled_from([0.5, 0.9, 0.99]),
)
def test_any_schedule_matches_the_rule_by_hand(
    values: list[float],
    on: Any,
    z: float | None,
    ratio: float | None,
    warmup: int,
    decay: float,
) -> None:
    """Lightning's test walks one schedule; this walks any, on both ways a step skips."""
    if z is None and ratio is None:
        z = 1.0
    rule = SpikeRule(on=on, z=z, ratio=ratio, warmup=warmup, decay=decay)
    fates, hand = _by_hand_schedule(values, rule)
    for path in ("host", "device"):
        with pytest.MonkeyPatch.context() as patch:
            if path == "device":
                patch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
            step, fn = _identity(rule)
        assert step._stepper.lazy == (path == "device")
        assert _fates([fn(v) for v in values]) == fates, path
        assert step.state_dict()["spike_stats"] == hand.state(), path
        assert step.spike_steps == fates.count("spike")
        assert step.skipped_steps == len(fates) - fates.count("ok")


def test_a_spike_is_not_replayed_as_a_nonfinite_window(skip_on: str) -> None:
    """Lightning's finite_only: a non-finite loss is its own case. With
    ``locate_nonfinite=True`` only the NaN window is replayed and named (one warning);
    the spike window is skipped quietly, with ``nonfinite`` None."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=2, locate_nonfinite=True,
        skip_spikes=SpikeRule(on="loss", z=4.0, warmup=3),
    )  # fmt: skip
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    data = _batches(24, {13: ("loss", 100.0), 19: ("loss", NAN)})

    def run() -> tuple[list[Any], list[bool]]:
        results = [fn(*b) for b in data][1::2]
        return results, [bool(r.nonfinite) for r in results]  # (read lazily on the device)

    with pytest.warns(NonFiniteWarning, match="skipped a window for an inf/NaN") as record:
        results, located = run()
    assert len(record) == 1
    assert _fates(results) == ["ok"] * 6 + ["spike", "ok", "ok", "nonfinite", "ok", "ok"]
    assert located == [i == 9 for i in range(12)]


@pytest.mark.parametrize("kind", ["z", "ratio"])
def test_a_value_equal_to_the_threshold_is_not_a_spike(kind: str, skip_on: str) -> None:
    """llm-foundry flags ``loss >= multiplier * mean``; cudakit's test is strict
    (``x > level``, documented), so the threshold itself passes and the next float32 above
    it does not."""
    if kind == "z":  # 1 then 3: mean 2, population variance 1, so 2 + 2 * 1 = 4
        rule, warm, level = SpikeRule(on="loss", z=2.0, warmup=2, decay=0.5), [1.0, 3.0], 4.0
    else:  # mean 1, ratio 2
        rule, warm, level = SpikeRule(on="loss", z=None, ratio=2.0, warmup=2), [1.0, 1.0], 2.0
    above = torch.tensor(level).nextafter(torch.tensor(INF)).item()  # the next float32
    step, fn = _identity(rule)
    for v in warm:
        fn(v)
    state = step.state_dict()
    assert not bool(fn(level).skipped)
    step.load_state_dict(state)  # back to the same statistics
    assert bool(fn(above).spike)


# ---------------------------------------------------------------------- OLMo-core


@pytest.mark.parametrize("on", ["loss", "grad_norm", ("loss", "grad_norm")], ids=str)
@pytest.mark.parametrize("inject", ["offset", "grad", "both"])
def test_olmo_which_statistic_was_the_outlier(inject: str, on: Any, skip_on: str) -> None:
    """OLMo's guard reasons (loss outside, gradient norm outside, both): a loss outlier
    whose gradients are normal (OLMo sets ``latest_loss=1e9``; here an offset), a gradient
    blow-up whose loss is normal, and both. Only the watched statistic skips; the normal
    window after it steps, and the outlier teaches the statistics nothing."""
    rule = SpikeRule(on=on, z=6.0, warmup=5, decay=0.9)
    watched = rule.on
    expected = (inject in ("offset", "both") and "loss" in watched) or (
        inject in ("grad", "both") and "grad_norm" in watched
    )
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = autocast_step(opt, model=model, dtype=torch.float32, skip_spikes=rule)
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    data = _batches(12, {8: (inject, 1e6)})
    results = [fn(*b) for b in data[:8]]
    before = step.state_dict()["spike_stats"]
    results.append(fn(*data[8]))
    if expected:
        assert step.state_dict()["spike_stats"] == before
    results += [fn(*b) for b in data[9:]]
    assert [bool(r.spike) for r in results] == [i == 8 and expected for i in range(12)]
    assert [bool(r.skipped) for r in results] == [i == 8 and expected for i in range(12)]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw-fused-amsgrad": lambda p: torch.optim.AdamW(
        p, lr=1e-2, weight_decay=0.1, fused=True, amsgrad=True
    ),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.7, 0.95), foreach=True),
    "adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
}


@pytest.mark.parametrize("inject", ["loss", "grad"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_spike_is_a_step_that_never_ran(name: str, inject: str, skip_on: str) -> None:
    """OLMo's SkipStepAdamW equivalence: the run with a skipped spike equals, bit for bit,
    a plain loop that never saw that batch: weights, optimizer state, BatchNorm buffers,
    the scheduler and its learning rate."""
    data = _batches(10, {6: (inject, 1000.0)})
    rule = SpikeRule(on=("loss", "grad_norm"), z=6.0, warmup=4)

    model = _mlp(batchnorm=True)
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = autocast_step(opt, model=model, dtype=torch.float32, scheduler=sched, skip_spikes=rule)
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    assert [bool(fn(*b).spike) for b in data] == [i == 6 for i in range(10)]

    ref = _mlp(batchnorm=True)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for i, (x, y, _, _) in enumerate(data):
        if i == 6:
            continue
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    _assert_same(_state(model, opt), _state(ref, ref_opt))
    assert sched.state_dict() == ref_sched.state_dict()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_several_optimizers_skip_a_spike_together(skip_on: str) -> None:
    """One spike verdict for a step over two optimizers (a fused AdamW and a momentum
    SGD): both skip, and the gradient norm watched is the one over all their parameters."""

    def build(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        a = torch.optim.AdamW(model[0].parameters(), lr=1e-2, fused=True)
        b = torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.9)
        return a, b

    data = _batches(10, {7: ("grad", 1000.0)})
    model = _mlp()
    opts = build(model)
    step = autocast_step(
        list(opts), model=model, dtype=torch.float32, max_grad_norm=1.0,
        skip_spikes=SpikeRule(on="grad_norm", z=6.0, warmup=4),
    )  # fmt: skip
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    assert [bool(fn(*b).spike) for b in data] == [i == 7 for i in range(10)]

    ref = _mlp()
    ref_opts = build(ref)
    for i, (x, y, _, _) in enumerate(data):
        if i == 7:
            continue
        for o in ref_opts:
            o.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        for o in ref_opts:
            o.step()
    _assert_same(_state(model, *opts), _state(ref, *ref_opts))


# ---------------------------------------------------------------------- the rule in a real loop


def _hand_loop(
    data: Sequence[Any],
    rule: SpikeRule,
    *,
    accumulate: int,
    clip: float | None,
    flush: bool,
) -> tuple[list[str], list[torch.Tensor], dict[str, Any]]:
    """A plain fp32 loop with accumulation and clipping that applies the rule by hand:
    the window's loss is the mean of its micro-batch losses, its norm the one clipping
    computes; a partial last window (``flush``) steps on its mean (grads times N / k)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    params = list(model.parameters())
    hand = ByHand(rule)
    fates = []
    windows = [data[i : i + accumulate] for i in range(0, len(data), accumulate)]
    if not flush and len(windows[-1]) < accumulate:
        windows.pop()
    for window in windows:
        opt.zero_grad()
        losses = []
        for x, y, kind, k in window:
            loss = _loss(model, x, y, kind, k)
            (loss / accumulate).backward()
            losses.append(loss.detach())
        if len(window) < accumulate:
            for p in params:
                p.grad.mul_(accumulate / len(window))
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        mean = total / len(losses) if len(losses) > 1 else total
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        finite = all(bool(torch.isfinite(t).all()) for t in [*losses, *(p.grad for p in params)])
        stats = {"loss": mean.item(), "grad_norm": norm.item()}
        if not finite:
            fates.append("nonfinite")
        elif hand.judge(stats):
            fates.append("spike")
        else:
            opt.step()
            hand.learn(stats)
            fates.append("ok")
    return fates, _state(model, opt), hand.state()


@pytest.mark.parametrize(("accumulate", "clip"), [(3, None), (4, 0.5)])
@pytest.mark.parametrize("on", ["loss", "grad_norm", ("loss", "grad_norm")], ids=str)
def test_accumulated_windows_and_a_partial_last_one_match_the_hand_loop(
    on: Any, accumulate: int, clip: float | None, skip_on: str
) -> None:
    """A spike in one micro-batch of a window, a NaN in another window, and a partial
    last window (``flush()``) holding a gradient blow-up: decisions, weights and statistics
    equal a hand-written loop's, bit for bit."""
    n = accumulate * 9 + 2
    inject = {
        accumulate * 5 + 1: ("loss", 50.0),
        accumulate * 3: ("loss", NAN),
        n - 1: ("grad", 1000.0),
    }
    data = _batches(n, inject)
    rule = SpikeRule(on=on, z=4.0, warmup=3, decay=0.9)
    want = _hand_loop(data, rule, accumulate=accumulate, clip=clip, flush=True)

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=accumulate, max_grad_norm=clip,
        skip_spikes=rule,
    )  # fmt: skip
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    results = [fn(*b) for b in data][accumulate - 1 :: accumulate]
    results.append(fn.flush())
    assert _fates(results) == want[0]
    last = "spike" if "grad_norm" in rule.on else "ok"  # the blow-up: norm only, loss normal
    assert want[0] == ["ok"] * 3 + ["nonfinite", "ok", "spike"] + ["ok"] * 3 + [last]
    _assert_same(_state(model, opt), want[1])
    assert step.state_dict()["spike_stats"] == want[2]


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_fp16_with_a_grad_scaler_matches_the_hand_loop(
    fused: bool, clip: float | None, skip_on: str
) -> None:
    """GradScaler fp16 on the CPU: the gradient norm watched is the unscaled one, a spike
    does not back the scale off (it grows on schedule), and everything matches a
    hand-written torch.autocast + GradScaler loop that applies the rule, bit for bit.
    With clipping, the norm watched is the one clipping computes (before it clips)."""
    rule = SpikeRule(on=("loss", "grad_norm"), z=4.0, warmup=3, decay=0.8)
    data = _batches(14, {6: ("loss", 30.0), 9: ("grad", 30.0), 11: ("loss", INF)})

    def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=3)

    model, opt, scaler = make()
    step = autocast_step(
        opt, model=model, dtype=torch.float16, scaler=scaler, max_grad_norm=clip,
        skip_spikes=rule,
    )  # fmt: skip
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    got = _fates([fn(*b) for b in data])

    ref, ref_opt, ref_scaler = make()
    hand = ByHand(rule)
    want = []
    for x, y, kind, k in data:
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(ref, x, y, kind, k)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        flags = ref_scaler._per_optimizer_states[id(ref_opt)]["found_inf_per_device"]
        finite = bool(torch.isfinite(loss)) and not any(f.item() for f in flags.values())
        stats = {"loss": loss.detach().float().item(), "grad_norm": _norm(ref)}
        if finite and clip is not None:
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
        if not finite or hand.judge(stats):
            want.append("spike" if finite else "nonfinite")
            ref_scaler.update()  # no step: only the scale moves
            continue
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        hand.learn(stats)
        want.append("ok")
    assert got == want
    assert got[6] == got[9] == "spike"
    assert got[11] == "nonfinite"
    _assert_same(_state(model, opt), _state(ref, ref_opt))
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert step.state_dict()["spike_stats"] == hand.state()


# ---------------------------------------------------------------------- checkpoints


def _run_with_resume(
    resume_at: int | None, data: Sequence[Any], rule: SpikeRule
) -> tuple[list[str], list[torch.Tensor], dict[str, Any], tuple[int, int, int]]:
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, AutocastStep]:
        model = _mlp(seed, batchnorm=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        step = autocast_step(
            opt, model=model, dtype=torch.float32, accumulate=3, max_grad_norm=1.0,
            skip_spikes=rule,
        )  # fmt: skip
        return model, opt, step

    model, opt, step = build(0)
    fates = []
    for i, batch in enumerate(data):
        if i == resume_at:  # a real checkpoint: through bytes, loaded with weights_only
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step.state_dict()},
                buffer,
            )
            buffer.seek(0)
            ckpt = torch.load(buffer, weights_only=True)
            model, opt, step = build(5)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            step.load_state_dict(ckpt["step"])
        m = model
        result = step(lambda x, y, kind, k, m=m: _loss(m, x, y, kind, k))(*batch)
        if i % 3 == 2:
            fates.append(result)
    counts = (step.steps, step.skipped_steps, step.spike_steps)
    return _fates(fates), _state(model, opt), step.state_dict()["spike_stats"], counts


@pytest.mark.parametrize("resume_at", [13, 14, 16, 19, 20])
def test_resume_mid_run_continues_bit_for_bit(resume_at: int, skip_on: str) -> None:
    """Lightning's SpikeDetection.state_dict()/load_state_dict(): a run resumed from a
    checkpoint (mid-window too: 13 and 16 are a window's second micro-step, 14 and 19 its
    third, with a spike in the window being resumed) takes the same decisions, bit for bit."""
    data = _batches(30, {14: ("loss", 40.0), 19: ("grad", 1000.0), 25: ("loss", NAN)})
    rule = SpikeRule(on=("loss", "grad_norm"), z=4.0, warmup=3, decay=0.9)
    full = _run_with_resume(None, data, rule)
    assert full[0][4] == full[0][6] == "spike"
    assert full[0][8] == "nonfinite"
    resumed = _run_with_resume(resume_at, data, rule)
    assert resumed[0] == full[0]
    _assert_same(resumed[1], full[1])
    assert resumed[2] == full[2]
    assert resumed[3] == full[3]


def test_a_resumed_step_applies_its_own_rule_to_the_saved_statistics(skip_on: str) -> None:
    """Lightning's load_state_dict() restores the detector's settings (warmup, rtol...)
    with its running mean. cudakit's checkpoint holds the statistics only: the rule is the
    resumed step's own (documented), a statistic the checkpoint lacks starts fresh, and
    decisions follow the new rule over the saved numbers, as by hand."""
    before = [1.0, 1.25, 0.875, 1.125, 1.0, 0.9375]
    after = [1.5, 1.0, 1.0625, 1.0, 3.0, 1.0]
    old = SpikeRule(on="loss", z=6.0, warmup=3, decay=0.9)
    new = SpikeRule(on=("loss", "grad_norm"), z=1.0, warmup=3, decay=0.9)
    step, fn = _identity(old)
    for v in before:
        fn(v)
    state = copy.deepcopy(step.state_dict())
    resumed, fn = _identity(new)
    resumed.load_state_dict(state)
    hand = ByHand(new)
    hand.stats["loss"] = list(_by_hand_schedule(before, old)[1].stats["loss"])
    fates = []
    for v in after:
        values = {"loss": v, "grad_norm": abs(v)}
        spike = hand.judge(values)
        if not spike:
            hand.learn(values)
        fates.append("spike" if spike else "ok")
    assert fates[0] == fates[4] == "spike"  # the loss rule is warm at once
    assert _fates([fn(v) for v in after]) == fates
    assert resumed.state_dict()["spike_stats"] == hand.state()


# ---------------------------------------------------------------------- llm-foundry


def test_llm_foundry_patience_is_max_skipped(skip_on: str) -> None:
    """llm-foundry's KillLossSpike: a loss at least ``outlier_multiplier`` times the running
    mean is an outlier; an accepted loss resets the count; more than ``patience`` (4)
    outliers in a row stop the run. cudakit skips each outlier window (llm-foundry trains
    on them) and stops with NonFiniteStepsError at ``max_skipped`` (5) skips in a row,
    naming the spike rule; on the sync-free GPU path the error comes when the verdict is
    read (the next call, or a counter). The weights are the last good ones."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = autocast_step(
        opt, model=model, dtype=torch.float32, max_skipped=5,
        skip_spikes=SpikeRule(on="loss", z=None, ratio=2.0, warmup=4, decay=0.99),
    )  # fmt: skip
    fn = step(lambda x, y, kind, k: _loss(model, x, y, kind, k))
    x, y, _, _ = _batches(1)[0]
    for _ in range(4):
        fn(x, y, "none", 1.0)
    for _ in range(4):
        assert bool(fn(x, y, "loss", 50.0).spike)
    assert not bool(fn(x, y, "none", 1.0).skipped)  # resets the streak
    good = _state(model, opt)
    for _ in range(4):
        assert bool(fn(x, y, "loss", 50.0).spike)
    streak = "every window's loss was a spike.*SpikeRule"
    if skip_on == "host":
        with pytest.raises(NonFiniteStepsError, match=streak):
            fn(x, y, "loss", 50.0)
    else:
        fn(x, y, "loss", 50.0)  # skipped on the device, its verdict read later
        with pytest.raises(NonFiniteStepsError, match=streak):
            _ = step.steps
    _assert_same(_state(model, opt), good)
    assert step.spike_steps == 9


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"z": -1.0}, ValueError, r"SpikeRule\(z=...\) expects a positive finite number"),
        ({"z": NAN}, ValueError, r"SpikeRule\(z=...\) expects a positive finite number"),
        ({"ratio": INF}, ValueError, r"SpikeRule\(ratio=...\) expects a finite number >= 1"),
        ({"ratio": NAN}, ValueError, r"SpikeRule\(ratio=...\) expects a finite number >= 1"),
        ({"warmup": True}, TypeError, r"SpikeRule\(warmup=...\) expects an int >= 2"),
        ({"decay": NAN}, ValueError, r"SpikeRule\(decay=...\) expects a finite number"),
        (
            {"decay": -0.5},
            ValueError,
            r"SpikeRule\(decay=...\) expects a finite number in \(0, 1\)",
        ),
        ({"decay": True}, TypeError, r"SpikeRule\(decay=...\) expects a finite number"),
        ({"on": None}, TypeError, r"SpikeRule\(on=...\) expects one of 'loss', 'grad_norm'"),
        ({"on": ["loss"]}, TypeError, r"SpikeRule\(on=...\).*on=\('loss', 'grad_norm'\)"),
        ({"on": ("loss", "norm")}, ValueError, r"SpikeRule\(on=...\) expects one of 'loss'"),
    ],
)
def test_spike_rule_refuses_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        SpikeRule(**kwargs)


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, TypeError), (1, TypeError), (("loss", "grad_norm"), TypeError), (SpikeRule, TypeError),
     ("Loss", ValueError), ("", ValueError)],
    ids=["0", "1", "tuple", "the-class", "Loss", "empty"],
)  # fmt: skip
def test_skip_spikes_refuses_bad_values(value: Any, error: type[Exception]) -> None:
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(error, match=r"autocast_step\(skip_spikes=\.\.\.\)"):
        autocast_step(opt, dtype=torch.float32, skip_spikes=value)


# ---------------------------------------------------------------------- edges the port found


def test_a_spike_window_keeps_its_gradients_as_clipping_left_them() -> None:
    """docs/precision.md: a skipped window's gradients stay for inspection until the next
    window clears them; with ``max_grad_norm`` they are as clipping left them (the norm
    clipping takes is the guard, taken before the verdict), as OLMo-core's clip-then-skip
    does too: the spike's 1000x gradient, clipped to norm 1."""
    lin = nn.Linear(1, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    step = autocast_step(
        torch.optim.SGD(lin.parameters(), lr=0.0), dtype=torch.float32, max_grad_norm=1.0,
        skip_spikes=SpikeRule(on="loss", z=1.0, warmup=2),
    )  # fmt: skip
    fn = step(lambda k: lin(torch.ones(1, 1)).sum() * k)
    fn(1.0)
    fn(1.0)
    result = fn(1000.0)
    assert bool(result.spike)
    grads = torch.cat([lin.weight.grad.flatten(), lin.bias.grad.flatten()])
    assert torch.allclose(grads.norm(), torch.tensor(1.0), atol=1e-6)
    assert torch.allclose(grads, torch.tensor([1000.0, 1000.0]) / (1000.0 * 2**0.5))


def test_a_wrong_kind_of_spike_count_in_a_checkpoint_is_a_type_error() -> None:
    """STYLE.md: a wrong kind raises TypeError, a wrong value ValueError (as
    ``state['spike_steps']=True`` and ``state['spike_stats'][...]['mean']=True`` do).
    Regression: ``state['spike_stats'][name]['count']`` of the wrong kind (a bool, a
    float) raised ValueError.

    Repro::

        step = autocast_step(opt, dtype=torch.float32, skip_spikes=True)
        state = step.state_dict()
        state["spike_stats"] = {"loss": {"mean": 1.0, "var": 0.0, "count": 2.0}}
        step.load_state_dict(state)   # ValueError; expected TypeError

    Cause: cudakit/amp/spikes.py, check_state(): one ValueError for the count's kind and
    value alike.
    """
    lin = nn.Linear(2, 1)
    step = autocast_step(
        torch.optim.SGD(lin.parameters(), lr=0.1), dtype=torch.float32, skip_spikes=True
    )
    state = step.state_dict()
    for count in (2.0, True):
        bad = copy.deepcopy(state)
        bad["spike_stats"] = {"loss": {"mean": 1.0, "var": 0.0, "count": count}}
        with pytest.raises(TypeError, match=r"state\['spike_stats'\]\['loss'\]\['count'\]"):
            step.load_state_dict(bad)
