"""speed_report, count_flops and the peak table against peers' throughput and MFU suites.

Ported from Lightning Fabric tests_fabric/utilities/test_throughput.py (test_measure_flops,
test_get_available_flops, test_get_available_flops_cuda_mapping_exists, test_throughput,
test_throughput_monitor: fake times, a rolling window, MFU against a given peak),
Lightning tests_pytorch/callbacks/test_throughput_monitor.py
(test_throughput_monitor_fit, test_throughput_monitor_fit_with_validation,
test_throughput_monitor_fit_gradient_accumulation, test_throughput_monitor_fit_no_length_fn),
composer tests/callbacks/test_speed_monitor.py (test_speed_monitor: a line per window of
steps over two epochs), torchtitan's MFU bookkeeping (tokens per second, FLOPs per token,
MFU against a device peak), and torch test/test_flop_counter.py (the FLOP formulas of
linear layers, convolutions, transposed convolutions and scaled_dot_product_attention).

Time is faked by a clock the test moves (the meter's clock is replaced, as
tests/speed/test_speed_no_host_sync.py replaces it), so every rate is exact; the
device name is faked through ``cudakit.speed._probes`` as tests/speed/test_peak_table.py
does. What tests/speed/ already checks is not repeated here.
"""

from __future__ import annotations

import io
import math
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit.speed._probes as probes
import cudakit.speed._recorder as recorder_mod
from cudakit.amp import autocast_step
from cudakit.speed import count_flops, lookup_peak, speed_report


class FakeClock:
    """The meter's clock read from ``now``, which the test moves: exact, known times."""

    def __init__(self) -> None:
        self.now = 0.0

    def start(self) -> float:
        return self.now

    def stop(self, start: float) -> float:
        return self.now - start

    @staticmethod
    def ready(mark: float) -> bool:
        return True

    @staticmethod
    def seconds(mark: float) -> float:
        return mark


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(recorder_mod, "clock_for", lambda device: fake)
    return fake


def _device_named(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: name)


# ---------------------------------------------------------------- FLOPs against formulas


def test_linear_on_token_batches_counts_every_token_and_the_batch_gradient() -> None:
    # Lightning's measure_flops: forward alone < forward and backward, and here exact.
    torch.manual_seed(0)
    n, s, a, b = 3, 5, 32, 2
    model = nn.Linear(a, b, bias=False)
    x = torch.randn(n, s, a)
    count = count_flops(lambda x: model(x).sum(), x, model=model)
    assert count.forward == 2 * n * s * a * b
    assert count.total == 2 * count.forward  # the weight's gradient; the batch needs none
    # A batch that requires grad (adversarial training): its gradient is counted too.
    xg = x.clone().requires_grad_()
    assert count_flops(lambda x: model(x).sum(), xg, model=model).total == 3 * count.forward


def test_frozen_layers_need_no_weight_gradient() -> None:
    torch.manual_seed(0)
    n, a, b, c, d = 4, 8, 16, 12, 3
    x, y = torch.randn(n, a), torch.randint(0, d, (n,))
    l1, l2, l3 = 2 * n * a * b, 2 * n * b * c, 2 * n * c * d  # each layer's forward

    def stack(frozen: tuple[int, ...]) -> nn.Sequential:
        model = nn.Sequential(
            nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d)
        )
        for i in frozen:
            model[i].requires_grad_(False)
        return model

    def total(model: nn.Module) -> int:
        return count_flops(lambda x, y: F.cross_entropy(model(x), y), x, y, model=model).total

    # The first layer frozen: no gradient for its weight, none for its input either.
    assert total(stack((0,))) == (l1 + l2 + l3) + (l2 + l3) + l3
    # The middle layer frozen: its input's gradient still flows to the first layer.
    assert total(stack((2,))) == (l1 + l2 + l3) + (l1 + l3) + (l2 + l3)
    # Everything but the head frozen: the "6 x parameters" rule would count 3x.
    assert total(stack((0, 2))) == (l1 + l2 + l3) + l3
    frozen = stack((0, 1, 2, 3, 4))
    with pytest.raises(TypeError, match=r"count_flops\(fn\) runs backward from the loss"):
        total(frozen)  # nothing requires grad: no loss to run backward from


@pytest.mark.parametrize(
    ("conv", "shape"),
    [
        (nn.Conv1d(4, 6, 3, stride=2), (2, 4, 11)),
        (nn.Conv2d(3, 5, (3, 2), dilation=2, bias=False), (2, 3, 9, 7)),
        (nn.Conv3d(2, 4, 2, padding=1), (1, 2, 3, 4, 5)),
        (nn.ConvTranspose2d(4, 3, 3, stride=2), (2, 4, 5, 5)),
    ],
    ids=["conv1d-stride", "conv2d-dilation", "conv3d-padding", "conv-transpose2d"],
)
def test_convolutions_match_the_formula(conv: nn.Module, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    count = count_flops(lambda x: conv(x).sum(), x, model=conv)
    out = conv(x)
    weight = conv.weight  # (c_out, c_in, *k); (c_in, c_out, *k) when transposed
    transposed = isinstance(conv, nn.ConvTranspose2d)
    positions = math.prod((x if transposed else out).shape[2:])
    macs = shape[0] * positions * weight.shape[0] * weight.shape[1] * math.prod(weight.shape[2:])
    assert count.forward == 2 * macs
    assert count.total == 2 * count.forward  # the weight's gradient only


def test_grouped_convolution_forward() -> None:
    conv = nn.Conv2d(8, 12, 3, groups=4, padding=1)
    x = torch.randn(2, 8, 6, 6)
    count = count_flops(lambda x: conv(x).sum(), x, model=conv)
    assert count.forward == 2 * 2 * 36 * 12 * (8 // 4) * 9  # each output sees c_in / groups


@pytest.mark.parametrize(
    ("sq", "sk", "dv", "causal", "backward"),
    [
        # The fused kernel: its backward recomputes the scores, then four matmuls. torch's
        # formula counts 2.5x the forward; cudakit keeps the model FLOPs (2x, as the math
        # path) and counts the recomputed scores apart, so MFU does not move with the kernel.
        (5, 7, 8, False, 2.5),
        (5, 5, 8, True, 2.5),  # causal attention counted as full, as torch does
        # A value width other than the key's runs the math path (two bmm): each bmm's
        # backward is two matmuls of its size.
        (5, 7, 4, False, 2.0),
    ],
    ids=["cross", "causal", "math-path"],
)
def test_scaled_dot_product_attention_matches_the_formula(
    sq: int, sk: int, dv: int, causal: bool, backward: float
) -> None:
    torch.manual_seed(0)
    b, h, d = 2, 3, 8
    qkv = nn.ParameterList(
        [torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, dv)]
    )

    def loss(scale: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv
        return F.scaled_dot_product_attention(q * scale, k, v, is_causal=causal).sum()

    count = count_flops(loss, torch.tensor(1.0), model=qkv)
    forward = 2 * b * h * sq * sk * d + 2 * b * h * sq * sk * dv  # q @ k^T, then p @ v
    assert count.forward == forward
    assert count.backward == 2 * forward  # model FLOPs, whatever the kernel
    assert count.hardware - forward == backward * forward  # torch's formula, recompute in


def test_embeddings_cost_no_flops_a_tied_head_does() -> None:
    torch.manual_seed(0)
    n, s, vocab, d = 2, 6, 50, 8
    tokens = torch.randint(0, vocab, (n, s))
    embedding = nn.Embedding(vocab, d)
    lookup = count_flops(lambda t: embedding(t).square().mean(), tokens, model=embedding)
    assert (lookup.forward, lookup.total) == (0, 0)  # a gather and a scatter: no FLOPs

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(t))

    lm = TinyLM()
    count = count_flops(
        lambda t: F.cross_entropy(lm(t).flatten(0, 1), t.flatten()), tokens, model=lm
    )
    head = 2 * n * s * d * vocab
    # The head's weight gradient and its input's (the embedding's output needs one).
    assert (count.forward, count.total) == (head, 3 * head)


def test_a_model_on_the_meta_device_is_counted_without_memory() -> None:
    # Lightning measures FLOPs of a model built on the meta device.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        x = torch.randn(2, 32)
    count = count_flops(lambda x: model(x).sum(), x, model=model)
    forward = 2 * 2 * (32 * 32 + 32 * 2)
    assert (count.forward, count.total) == (forward, 2 * forward + 2 * 2 * 32 * 2)


# ---------------------------------------------------------------- count_flops leaves no trace


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = [(k, _bits(v)) for k, v in model.state_dict().items()]
    out += [
        (p.requires_grad, None if p.grad is None else _bits(p.grad)) for p in model.parameters()
    ]
    for state in opt.state.values():
        out += [_bits(v) if isinstance(v, torch.Tensor) else v for v in state.values()]
    out += [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out += [m.training for m in model.modules()]
    return out


def test_counting_leaves_every_bit_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.Dropout(0.3), nn.Flatten(), nn.Linear(4 * 6, 1)
    )
    model[0].requires_grad_(False)  # a frozen layer stays frozen
    opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9, nesterov=True
    )
    x = torch.randn(5, 2, 8)
    model(x).sum().backward()
    opt.step()
    with torch.no_grad():  # values torch.equal calls unequal to themselves, or equal to 0.0
        model[4].weight[0, 0] = float("nan")
        model[4].weight[0, 1] = -0.0
    model[4].bias.grad = None  # a gradient that is None stays None
    model.eval()  # and the mode stays as it was
    before = _snapshot(model, opt)
    rngs = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()
    batch = _bits(x)

    def step(x: torch.Tensor) -> torch.Tensor:
        model.train()
        model[0].requires_grad_(True)
        random.random()
        np.random.rand()
        loss = model(x).nan_to_num().square().mean()
        loss.backward()
        opt.step()
        return loss.detach().requires_grad_()

    assert count_flops(step, x, model=model, optimizer=opt).total > 0
    assert _snapshot(model, opt) == before
    assert torch.get_rng_state().equal(rngs[0])
    assert random.getstate() == rngs[1]
    assert np.random.get_state()[1].tobytes() == rngs[2]
    assert _bits(x) == batch


def test_counting_puts_back_a_generator_the_step_draws_from() -> None:
    # A torch.Generator that fn draws from (noise, augmentation) hides in fn's closure,
    # where no walk finds it: it goes in extra=, which once refused it (no state_dict).
    model = nn.Linear(4, 1)
    g = torch.Generator().manual_seed(0)
    saved = g.get_state()
    count_flops(
        lambda x: model(x + torch.randn(x.shape, generator=g)).sum(),
        torch.ones(2, 4),
        model=model,
        extra=(g,),
    )
    assert torch.equal(g.get_state(), saved)


def test_counting_leaves_no_gradient_on_a_batch_that_requires_grad() -> None:
    # Regression: a batch that requires grad was handed back with the .grad the counted
    # backward put there.
    model = nn.Linear(4, 1)
    x = torch.ones(2, 4, requires_grad=True)
    count_flops(lambda x: model(x).sum(), x, model=model)
    assert x.grad is None


# ---------------------------------------------------------------- figures with known times


def _steps(meter: Any, clock: FakeClock, seconds: list[float]) -> None:
    """One call per entry of ``seconds``, each taking that long on the fake clock."""
    for s in seconds:
        with meter:
            clock.now += s


def test_throughput_figures_from_known_times(clock: FakeClock) -> None:
    # Lightning test_throughput: samples/s, items (tokens)/s, FLOP/s and MFU from known times.
    meter = speed_report(samples=2, tokens=8, flops=3e12, peak_tflops=12.0, window=1, file=None)
    _steps(meter, clock, [2.0, 0.5])
    recent, total = meter.recent, meter.total
    assert (recent.steps, recent.seconds, total.steps, total.seconds) == (1, 0.5, 2, 2.5)
    assert (meter.step_time, meter.samples_per_s, meter.tokens_per_s) == (0.5, 4.0, 16.0)
    assert (meter.tflops, meter.mfu) == (6.0, 0.5)
    assert (total.samples_per_s, total.tokens_per_s, total.tflops) == (1.6, 6.4, 2.4)
    assert total.mfu == pytest.approx(0.2)
    assert (recent.peak_tflops, recent.peak_source, recent.mfu_reason) == (
        12.0,
        "given, fp32: peak_tflops=",
        None,
    )
    # Without a peak: FLOP/s still, no MFU (Lightning's "flops without available").
    bare = speed_report(flops=3e12, window=1, file=None)
    _steps(bare, clock, [2.0, 0.5])
    assert (bare.tflops, bare.mfu) == (6.0, None)


def test_time_between_calls_is_not_counted(clock: FakeClock) -> None:
    # Lightning test_throughput_monitor_fit_with_validation: validation between training
    # steps is not training time. Here: what runs outside the measured calls.
    meter = speed_report(samples=1, file=None)
    _steps(meter, clock, [7.0])
    clock.now += 2.0  # validation, data loading, checkpointing...
    _steps(meter, clock, [6.0])
    assert (meter.total.seconds, meter.total.step_time) == (13.0, 6.5)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156.0),
        ("NVIDIA A100-SXM4-40GB", torch.float32, 19.5),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, 1979.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),  # Lightning: 1.513e15 / 2
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA GeForce RTX 4090", "tf32", 82.6),
        ("NVIDIA B200", "bf16", 2250.0),
    ],
)
def test_mfu_against_a_faked_device(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, name: str, dtype: Any, peak: float
) -> None:
    _device_named(monkeypatch, name)
    meter = speed_report(flops=peak * 1e12, dtype=dtype, file=None)
    _steps(meter, clock, [4.0, 4.0])  # a quarter of the peak's FLOPs each second
    assert meter.tflops == peak / 4
    assert meter.mfu == 0.25
    assert meter.recent.peak_tflops == peak
    assert str(meter.recent.peak_source).startswith(f"{meter.peak.model}, {meter.peak.dtype}: ")


def test_mfu_dtype_comes_from_the_decorated_step(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    _device_named(monkeypatch, "NVIDIA H100 80GB HBM3")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)

    @speed_report(flops=989.5e12, file=None)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        clock.now += 2.0
        return model(x).float().square().mean()

    train(torch.ones(2, 4))
    meter = train.speed_report
    assert (meter.peak.dtype, meter.recent.peak_tflops, meter.mfu) == ("bf16", 989.5, 0.5)


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H800",
        "NVIDIA H20",
        "NVIDIA A800-SXM4-80GB",
        "NVIDIA A10G",  # the cloud A10 variant: no datasheet
        "NVIDIA A100X",
        "NVIDIA GH200 480GB",
        "NVIDIA L40S-MIG-1g.12gb",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "NVIDIA RTX 6000 Ada Generation",
        "NVIDIA GeForce RTX 4080",
        "NVIDIA B100",
        "AMD Instinct MI300X",
        "CocoNut",  # Lightning's unknown device
        "h100-hbm2e",  # Lightning's lower-case names: a PCIe or an NVL board
    ],
)
def test_unknown_devices_never_borrow_a_peak(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, name: str
) -> None:
    _device_named(monkeypatch, name)
    meter = speed_report(flops=1e12, dtype="bf16", file=None)
    _steps(meter, clock, [1.0])
    assert (meter.tflops, meter.mfu, meter.recent.peak_tflops) == (1.0, None, None)
    assert f"{name!r}" in str(meter.mfu_reason)
    assert "pass peak_tflops=..." in str(meter.mfu_reason)
    assert meter.peak.tflops is None


@pytest.mark.parametrize(
    ("name", "model"),
    [("h100-hbm3", "H100 SXM"), ("h100-pcie", "H100 PCIe"), ("a100", "A100")],
)
def test_lightning_lower_case_names(name: str, model: str) -> None:
    assert lookup_peak(name, torch.float32).model == model


def test_a_device_without_the_dtype_gives_no_mfu(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    _device_named(monkeypatch, "NVIDIA A100-SXM4-80GB")
    meter = speed_report(flops=1e12, dtype="fp8", file=None)
    _steps(meter, clock, [1.0])
    assert meter.mfu is None
    assert "A100 has no fp8 Tensor Core rate" in str(meter.mfu_reason)
    given = speed_report(flops=1e12, dtype="fp8", peak_tflops=4.0, file=None)  # the fix
    _steps(given, clock, [1.0])
    assert given.mfu == 0.25


# ---------------------------------------------------------------- the rolling window


def test_rolling_window_after_more_steps_than_it_holds(clock: FakeClock) -> None:
    # Lightning ThroughputMonitor(window_size=4) over five updates; here six steps.
    meter = speed_report(samples=3, tokens=6, flops=1e12, peak_tflops=2.0, window=4, file=None)
    _steps(meter, clock, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    recent, total = meter.recent, meter.total
    assert (recent.steps, recent.calls, recent.seconds, recent.samples) == (4, 4, 18.0, 12.0)
    assert (total.steps, total.calls, total.seconds, total.samples) == (6, 6, 21.0, 18.0)
    assert (recent.step_time, total.step_time) == (4.5, 3.5)
    assert (recent.tflops, recent.mfu) == pytest.approx((4 / 18, 4 / 18 / 2.0))
    assert (total.tflops, total.mfu) == pytest.approx((6 / 21, 6 / 21 / 2.0))


def test_window_of_one_follows_the_last_step(clock: FakeClock) -> None:
    meter = speed_report(samples=len, window=1, file=None)
    for n, s in [(4, 1.0), (8, 1.0), (2, 0.25)]:
        with meter.measure(list(range(n))):
            clock.now += s
        assert meter.samples_per_s == n / s


# ---------------------------------------------------------------- accumulation


def test_gradient_accumulation_over_epochs_with_a_short_last_window(clock: FakeClock) -> None:
    # Lightning test_throughput_monitor_fit_gradient_accumulation: 5 batches an epoch,
    # accumulate_grad_batches=2, two epochs: windows of 2, 2 and 1 calls each epoch.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.01), model=model, accumulate=2)

    @speed_report(samples=len, tokens=lambda b: 2 * len(b), flops=10e12, window=4, file=None)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0
        return model(x).square().mean()

    for _ in range(2):
        for _ in range(5):
            train(torch.ones(3, 4))
        step.flush()  # the epoch's last, short window
    meter = train.speed_report
    assert (meter.calls, meter.steps, step.steps) == (10, 6, 6)
    recent, total = meter.recent, meter.total
    assert (total.seconds, total.samples, total.tokens, total.flops) == (10.0, 30.0, 60.0, 100e12)
    assert total.step_time == 10 / 6
    # The window: the last four optimizer steps, of 1 + 2 + 2 + 1 calls.
    assert (recent.steps, recent.calls, recent.seconds, recent.samples) == (4, 6, 6.0, 18.0)
    assert (recent.samples_per_s, recent.tokens_per_s, recent.tflops) == (3.0, 6.0, 10.0)


def test_a_changing_accumulate_is_followed_with_its_times(clock: FakeClock) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.01), model=model, accumulate=1)
    meter = speed_report(samples=len, step=step, window=2, file=None)
    times = iter([1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 0.5])
    for accumulate, calls in [(1, 2), (3, 3), (2, 2)]:
        step.accumulate = accumulate
        for _ in range(calls):
            x = torch.ones(2, 4)
            with meter.measure(x):
                with step:
                    loss = model(x).square().mean()
                step.backward(loss)
                clock.now += next(times)
    assert (meter.steps, meter.calls) == (4, 7)  # windows of 1, 1, 3 and 2 calls
    assert (meter.recent.seconds, meter.recent.calls) == (10.5, 5)
    assert meter.total.seconds == 12.5
    assert meter.recent.step_time == 5.25


def test_accumulate_counts_calls_not_steps_for_the_rates(clock: FakeClock) -> None:
    meter = speed_report(samples=4, flops=1e12, peak_tflops=1.0, accumulate=4, file=None)
    _steps(meter, clock, [0.25] * 8)
    assert (meter.steps, meter.calls, meter.step_time) == (2, 8, 1.0)
    assert (meter.samples_per_s, meter.tflops, meter.mfu) == (16.0, 4.0, 4.0)
    assert "MFU 400.0% (above 100%: is dtype= the one the step runs in?)" in meter.recent.summary()


# ---------------------------------------------------------------- batch sizes and lengths


def test_last_small_batch_keeps_samples_per_second(clock: FakeClock) -> None:
    model = nn.Linear(8, 8)
    flops = count_flops(lambda x: model(x).sum(), torch.randn(32, 8), model=model)
    meter = speed_report(samples=len, flops=flops, file=None)
    for n in [32, 32, 32, 8]:  # an epoch of 104 samples, batch size 32
        with meter.measure(torch.randn(n, 8)):
            clock.now += n / 64  # 64 samples a second
    total = meter.total
    assert (total.samples, total.seconds, total.samples_per_s) == (104.0, 1.625, 64.0)
    assert total.flops == 104 * flops.total / 32
    assert total.tflops == 64 * flops.total / 32 / 1e12


def test_attention_flops_of_any_length_by_a_function() -> None:
    # The docs' exact rule for sequences of varying length, against count_flops.
    torch.manual_seed(0)
    d, heads = 8, 2
    layer = nn.TransformerEncoderLayer(d, heads, 16, dropout=0.0, batch_first=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return layer(x).square().mean()

    def counted(n: int, s: int) -> int:
        return count_flops(loss, torch.randn(n, s, d), model=layer).total

    # Two lengths give the per-token and per-token-pair costs (the cost is exact in both).
    pair = (counted(1, 4) * 2 - counted(1, 2) * 4) // (2 * 16 - 4 * 4)
    token = (counted(1, 2) - pair * 4) // 2
    meter = speed_report(
        tokens=lambda b: b.shape[0] * b.shape[1],
        flops=lambda b: token * b.shape[0] * b.shape[1] + pair * b.shape[0] * b.shape[1] ** 2,
        file=None,
    )
    shapes = [(2, 5), (3, 7), (1, 12)]
    for n, s in shapes:
        with meter.measure(torch.randn(n, s, d)):
            pass
    assert meter.total.flops == sum(counted(n, s) for n, s in shapes)
    # A FlopCount scaled by tokens is exact only where the length does not change.
    scaled = speed_report(
        tokens=lambda b: b.shape[0] * b.shape[1],
        flops=count_flops(loss, torch.randn(2, 5, d), model=layer),
        file=None,
    )
    with scaled.measure(torch.randn(4, 5, d)):
        pass
    assert scaled.total.flops == counted(4, 5)


def test_tokens_as_tensors_scale_the_flops(clock: FakeClock) -> None:
    # torchtitan counts tokens per second; a padded batch counts its attention mask.
    model = nn.Linear(4, 4)
    example = {"x": torch.randn(2, 3, 4), "mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    flops = count_flops(lambda b: model(b["x"]).sum(), example, model=model)
    meter = speed_report(
        samples=lambda b: b["x"].shape[0],
        tokens=lambda b: b["mask"].sum(),
        flops=flops,
        peak_tflops=1.0,
        file=None,
    )
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1], [1, 1, 1]])]
    for mask in masks:
        with meter.measure({"x": torch.randn(2, 3, 4), "mask": mask}):
            clock.now += 0.5
    with meter.measure(samples=1, tokens=torch.tensor([4.0])):  # shape (1,), a float
        clock.now += 1.0
    total = meter.total
    assert (total.samples, total.tokens, total.seconds) == (5.0, 13.0, 2.0)
    assert total.tokens_per_s == 6.5
    assert total.flops == flops.total * 13 / 5


def test_a_negative_tensor_count_is_refused_when_read(clock: FakeClock) -> None:
    meter = speed_report(tokens=lambda b: b.sum(), file=None)
    with meter.measure(torch.tensor([1, -3])):
        clock.now += 1.0
    with pytest.raises(ValueError, match=r"speed_report\(tokens=...\) gave -2.0 for a call"):
        meter.total  # noqa: B018


# ---------------------------------------------------------------- the line


def test_the_line_with_known_times(clock: FakeClock) -> None:
    # Lightning test_throughput_monitor: window_size=4 over five steps of a second each.
    out = io.StringIO()
    meter = speed_report(
        "train",
        samples=3,
        tokens=6,
        flops=10e12,
        peak_tflops=100.0,
        every=5,
        window=4,
        file=out,
    )
    _steps(meter, clock, [1.5, 1.0, 1.0, 1.0, 1.0])
    assert out.getvalue() == (
        "speed_report 'train' cpu step 5: 1.00 s/step, 3.00 samples/s, 6.00 tokens/s, "
        "10.0 TFLOP/s, MFU 10.0% [last 4 steps]; all 5 steps: 1.10 s/step, 2.73 samples/s, "
        "5.45 tokens/s, 9.09 TFLOP/s, MFU 9.1% (peak 100 TFLOP/s, given, fp32: peak_tflops=)\n"
    )


def test_a_line_every_n_steps_and_at_flush(clock: FakeClock) -> None:
    # composer test_speed_monitor: one line per interval of optimizer steps, not per call.
    lines: list[str] = []
    meter = speed_report(samples=2, accumulate=2, every=3, log=lines.append)
    _steps(meter, clock, [0.5] * 20)  # ten optimizer steps
    assert [line.split(":")[0] for line in lines] == [
        "speed_report cpu step 3",
        "speed_report cpu step 6",
        "speed_report cpu step 9",
    ]
    assert all("1.00 s/step, 4.00 samples/s" in line for line in lines)
    meter.flush()
    assert lines[-1].startswith("speed_report cpu step 10: ")
    assert "[last 10 steps]" in lines[-1]
    meter.flush()  # nothing new
    assert len(lines) == 4
    assert meter.last_line == lines[-1]


def test_a_window_flushed_at_a_log_step_writes_its_line(clock: FakeClock) -> None:
    # Regression: every=3 over epochs whose last window is short and closed by
    # step.flush() wrote no line (the flushed window never checked the log interval).
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.01), model=model, accumulate=2)
    lines: list[str] = []

    @speed_report(samples=len, every=3, log=lines.append)
    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0
        return model(x).square().mean()

    for _ in range(2):
        for _ in range(5):
            train(torch.ones(3, 4))
        step.flush()
    train(torch.ones(3, 4))  # the next epoch's first call sees the flushed window
    assert train.speed_report.steps == 6
    assert [line.split(":")[0] for line in lines] == [
        "speed_report 'train' cpu step 3",
        "speed_report 'train' cpu step 6",
    ]


def test_the_line_says_why_there_is_no_mfu(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    _device_named(monkeypatch, "NVIDIA H800")
    lines: list[str] = []
    meter = speed_report(flops=2e12, dtype="bf16", every=1, log=lines.append)
    _steps(meter, clock, [2.0])
    assert lines == [
        "speed_report cpu step 1: 2.00 s/step, 1.00 TFLOP/s [last 1 steps]; MFU n/a: no "
        "entry of the peak table matches the device 'NVIDIA H800'; pass peak_tflops=... "
        "(its dense peak for bf16)"
    ]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": True}, TypeError, r"speed_report\(every=...\) expects an int >= 1, got bool"),
        ({"window": 2.0}, TypeError, r"speed_report\(window=...\) expects an int >= 1"),
        ({"accumulate": True}, TypeError, r"speed_report\(accumulate=...\) expects an int"),
        ({"peak_tflops": True}, TypeError, r"speed_report\(peak_tflops=...\) expects a positive"),
        ({"peak_tflops": -1.0}, ValueError, r"speed_report\(peak_tflops=...\) expects a positive"),
        (
            {"peak_tflops": float("nan")},
            ValueError,
            r"speed_report\(peak_tflops=...\) expects a positive",
        ),
        ({"flops": -1}, ValueError, r"speed_report\(flops=...\) expects a number >= 0"),
        ({"flops": True}, TypeError, r"speed_report\(flops=...\) expects a number >= 0"),
        ({"flops": float("inf")}, ValueError, r"speed_report\(flops=...\) expects a number"),
        ({"samples": float("inf")}, ValueError, r"speed_report\(samples=...\) expects a number"),
        ({"dtype": torch.float64}, ValueError, r"speed_report\(dtype=...\) expects a floating"),
        ({"dtype": "fp64"}, ValueError, r"speed_report\(dtype=...\) expects a floating"),
    ],
)
def test_more_argument_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        speed_report(**kwargs)


def test_flops_function_values_are_checked() -> None:
    meter = speed_report(flops=lambda b: -1.0, file=None)
    with (
        pytest.raises(ValueError, match=r"speed_report\(flops=...\) expects a finite number >= 0"),
        meter.measure([1]),
    ):
        pass
    assert meter.calls == 0


def test_an_infinite_count_for_a_call_is_refused() -> None:
    # Regression: an infinite count for one call was taken, and every rate after it
    # was inf for good (the specs and the example batch's counts were checked).
    meter = speed_report(tokens=1, file=None)
    with pytest.raises(ValueError, match=r"speed_report\(tokens=...\) expects a"):
        meter.measure(tokens=float("inf"))


def test_an_infinite_tensor_count_is_refused_when_read() -> None:
    # Regression: the same for a tensor count, checked when it is read.
    meter = speed_report(tokens=lambda b: b, file=None)
    with meter.measure(torch.tensor(float("inf"))):
        pass
    with pytest.raises(ValueError, match=r"speed_report\(tokens=...\) gave inf for a call"):
        meter.total  # noqa: B018


@pytest.mark.parametrize("name", [None, 123, b"NVIDIA H100 PCIe"])
def test_lookup_peak_refuses_a_name_that_is_not_a_string(name: Any) -> None:
    # Regression: a name that is not a str raised AttributeError from name.upper().
    with pytest.raises(TypeError, match=r"lookup_peak\(name=...\)"):
        lookup_peak(name, "bf16")


def test_lookup_peak_of_a_dtype_without_figures_says_so() -> None:
    peak = lookup_peak("NVIDIA H100 PCIe", torch.float64)
    assert peak.tflops is None
    assert "no figures for torch.float64" in str(peak.reason)
