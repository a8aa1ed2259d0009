"""autocast_step for the way people train: GANs, several optimizers, token-weighted
losses, native precision, schedules with flush(), and checkpoints refused whole."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cudakit.amp import autocast_step
from cudakit.amp.policy import Capabilities, cpu_native_bf16, decide_precision

DTYPES = [torch.float32, torch.bfloat16]


def _state(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for m in modules for t in m.state_dict().values()]


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x, y), (x - y).abs().max()


# ----------------------------------------------------------------------------- GAN


def _gan(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    return gen, disc, opt_g, opt_d


def _gan_data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _d_loss(disc: Any, gen: Any, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    fake = gen(z).detach()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(z), 1)
    return F.binary_cross_entropy_with_logits(
        disc(real).float(), ones
    ) + F.binary_cross_entropy_with_logits(disc(fake).float(), zeros)


def _g_loss(disc: Any, gen: Any, z: torch.Tensor) -> torch.Tensor:
    # Backward through disc as well: it fills the discriminator's .grad.
    return F.binary_cross_entropy_with_logits(disc(gen(z)).float(), torch.ones(len(z), 1))


def _hand_written_gan(
    data: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> list[torch.Tensor]:
    """The GAN loop as torch teaches it: zero_grad before each backward."""
    gen, disc, opt_g, opt_d = _gan()
    on = dtype != torch.float32
    for real, z in data:
        opt_d.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=on):
            loss_d = _d_loss(disc, gen, real, z)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=on):
            loss_g = _g_loss(disc, gen, z)
        loss_g.backward()
        opt_g.step()
    return _state(gen, disc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gan_two_steps_bit_identical_to_hand_written(dtype: torch.dtype) -> None:
    data = _gan_data(5)
    expected = _hand_written_gan(data, dtype)

    gen2, disc2, opt_g2, opt_d2 = _gan()

    @autocast_step(opt_d2, dtype=dtype)
    def d_step(real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return _d_loss(disc2, gen2, real, z)

    @autocast_step(opt_g2, dtype=dtype)
    def g_step(z: torch.Tensor) -> torch.Tensor:
        return _g_loss(disc2, gen2, z)

    for real, z in data:
        assert d_step(real, z).stepped
        assert g_step(z).stepped
    _assert_bitwise(_state(gen2, disc2), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gan_explicit_form_bit_identical(dtype: torch.dtype) -> None:
    data = _gan_data(5)
    expected = _hand_written_gan(data, dtype)
    gen2, disc2, opt_g2, opt_d2 = _gan()
    d_step = autocast_step(opt_d2, dtype=dtype)
    g_step = autocast_step(opt_g2, dtype=dtype)
    for real, z in data:
        with d_step:
            loss = _d_loss(disc2, gen2, real, z)
        d_step.backward(loss)
        with g_step:
            loss = _g_loss(disc2, gen2, z)
        g_step.backward(loss)
    _assert_bitwise(_state(gen2, disc2), expected)


def test_gradients_readable_after_step_until_next_window() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float32)
    fn = step(lambda x: model(x).sum())
    fn(torch.ones(2, 3))
    first = model.weight.grad.clone()  # type: ignore[union-attr]
    fn(torch.ones(2, 3) * 2)
    # Not accumulated onto the previous window's gradient: cleared when the window opened.
    torch.testing.assert_close(model.weight.grad, first * 2, rtol=0, atol=0)


# ----------------------------------------------------------------------------- several optimizers


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mat = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.mat(self.emb(idx)))))  # type: ignore[no-any-return]


def _two(seed: int = 0) -> tuple[Two, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Two()
    opt_a = torch.optim.SGD([m.mat.weight, m.head.weight], lr=0.05, momentum=0.9)
    opt_b = torch.optim.AdamW(
        [m.emb.weight, m.mat.bias, m.head.bias, *m.norm.parameters()], lr=1e-2
    )
    return m, opt_a, opt_b


def _tokens(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 10, (4, 5), generator=g), torch.randn(4, 5, 1, generator=g))
            for _ in range(n)]  # fmt: skip


def _two_loss(m: Two, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(m(idx).float(), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_optimizers_bit_identical_to_hand_written(dtype: torch.dtype) -> None:
    data = _tokens(6)
    m, opt_a, opt_b = _two()
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=dtype == torch.float16)
    for idx, y in data:
        opt_a.zero_grad()
        opt_b.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = _two_loss(m, idx, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt_a)
        scaler.unscale_(opt_b)
        # The union of the optimizers' parameters, in their order.
        union = [p for o in (opt_a, opt_b) for g in o.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(union, 1.0)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        sched_a.step()
        sched_b.step()
    expected = _state(m)

    m2, opt_a2, opt_b2 = _two()
    sa = torch.optim.lr_scheduler.StepLR(opt_a2, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.LambdaLR(opt_b2, lambda s: 1 / (1 + s))
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1024.0) if dtype == torch.float16 else None
    step = autocast_step(
        [opt_a2, opt_b2], dtype=dtype, scaler=scaler2, max_grad_norm=1.0, scheduler=[sa, sb]
    )
    fn = step(lambda idx, y: _two_loss(m2, idx, y))
    for idx, y in data:
        assert fn(idx, y).stepped
    _assert_bitwise(_state(m2), expected)
    assert step.steps == 6
    assert sa.last_epoch == sb.last_epoch == 6
    assert step.optimizers == (opt_a2, opt_b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_optimizers_injected_inf_skips_both(dtype: torch.dtype) -> None:
    m, opt_a, opt_b = _two()
    step = autocast_step([opt_a, opt_b], dtype=dtype, max_skipped=5)
    (idx, y), = _tokens(1)  # fmt: skip
    before = _state(m)
    states = (copy.deepcopy(opt_a.state_dict()), copy.deepcopy(opt_b.state_dict()))

    @step
    def fn(idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Only the embedding (optimizer b) sees an inf gradient.
        return _two_loss(m, idx, y) + m.emb.weight.sum() * float("inf")

    r = fn(idx, y)
    assert r.skipped
    assert not r.stepped
    _assert_bitwise(_state(m), before)
    assert opt_a.state_dict()["state"] == states[0]["state"] == {}
    assert opt_b.state_dict()["state"] == states[1]["state"] == {}
    assert step.skipped_steps == 1


def test_several_optimizers_bad_arguments() -> None:
    _m, opt_a, opt_b = _two()
    with pytest.raises(ValueError, match="empty list of optimizers"):
        autocast_step([])
    with pytest.raises(TypeError, match="Optimizer \\(or a list of them\\).*got str"):
        autocast_step([opt_a, "adam"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="same optimizer twice"):
        autocast_step([opt_a, opt_a])
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    stray = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(ValueError, match="an optimizer this step does not step"):
        autocast_step([opt_a, opt_b], scheduler=[stray])
    with pytest.raises(TypeError, match="step\\(\\) method \\(or a list of them\\), got int"):
        autocast_step([opt_a, opt_b], scheduler=[3])


# ----------------------------------------------------------------------------- token-weighted


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    idx = torch.randint(0, 10, (7, 6), generator=g)
    y = torch.randn(7, 6, 1, generator=g)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 1])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    return idx, y, mask


def _summed(m: Two, idx: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = (m(idx).float() - y).pow(2).squeeze(-1)
    return (per_token * mask).sum()


@pytest.mark.parametrize("split", [[1, 6], [3, 2, 2], [5, 1, 1], [2, 2, 2, 1]])
def test_token_weighted_window_equals_full_batch_mean(split: list[int]) -> None:
    idx, y, mask = _padded_batch()
    ref, opt_a, _opt_b = _two()
    opt_a.param_groups[0]["momentum"] = 0.0
    loss = _summed(ref, idx, y, mask) / mask.sum()
    loss.backward()
    expected = {n: p.grad.clone() for n, p in ref.named_parameters()}  # type: ignore[union-attr]

    m, _a, _b = _two()
    seen: dict[str, torch.Tensor] = {}

    class Spy(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            for n, p in m.named_parameters():
                seen[n] = p.grad.clone()  # type: ignore[union-attr]
            return None

    spy = Spy(m.parameters(), lr=0.0)
    step = autocast_step(spy, dtype=torch.float32, accumulate=len(split))
    fn = step(lambda i, t, k: {"loss": _summed(m, i, t, k), "weight": k.sum()})
    start = 0
    results = []
    for n in split:
        results.append(fn(idx[start : start + n], y[start : start + n], mask[start : start + n]))
        start += n
    assert [r.stepped for r in results] == [False] * (len(split) - 1) + [True]
    for n, g in expected.items():
        torch.testing.assert_close(seen[n], g, rtol=0, atol=1e-6)


def test_token_weighted_with_number_weights_and_flush() -> None:
    idx, y, mask = _padded_batch()
    ref, _, _ = _two()
    (_summed(ref, idx[:3], y[:3], mask[:3]) / mask[:3].sum()).backward()
    m, _, _ = _two()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.0), dtype=torch.float32, accumulate=4)
    for lo, hi in [(0, 1), (1, 3)]:
        k = mask[lo:hi]
        r = step(lambda i, t, k: {"loss": _summed(m, i, t, k), "weight": int(k.sum())})(
            idx[lo:hi], y[lo:hi], k
        )
        assert not r.stepped
    assert step.flush().stepped  # type: ignore[union-attr]
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_token_weighted_errors() -> None:
    m, _opt_a, _ = _two()
    idx, y, mask = _padded_batch()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), accumulate=2)
    fn = step(lambda w: {"loss": _summed(m, idx, y, mask), "weight": w})
    with pytest.raises(
        TypeError,
        match=r"autocast_step\(weight=\.\.\.\) expects a finite number >= 0 or a one-element "
        r"tensor, got str",
    ):
        fn("12")
    with pytest.raises(
        ValueError,
        match=r"weight=\.\.\.\) expects a finite number >= 0 .*, got int -1\. The 'weight'",
    ):
        fn(-1)
    with pytest.raises(ValueError, match="one-element real tensor"):
        fn(torch.ones(3))
    assert step.position == 0
    fn(3)
    plain = step(lambda: _summed(m, idx, y, mask))
    with pytest.raises(ValueError, match="every micro-step must return"):
        plain()
    assert step.position == 1


# ----------------------------------------------------------------------------- precision


CAPS = [Capabilities(*bits) for bits in itertools.product([False, True], repeat=3)]


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "mps", "xpu"])
@pytest.mark.parametrize("caps", CAPS)
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("user_scaler", [True, False])
@pytest.mark.parametrize("requested", [None, torch.bfloat16, torch.float16, torch.float32])
def test_precision_decision_every_combination(
    device_type: str,
    caps: Capabilities,
    enabled: bool,
    user_scaler: bool,
    requested: torch.dtype | None,
) -> None:
    p = decide_precision(
        requested, device_type, enabled=enabled, user_scaler=user_scaler, caps=caps
    )
    assert p.autocast == (p.dtype != torch.float32)
    assert p.scaler == (p.dtype == torch.float16)
    if not enabled:
        assert p.dtype == torch.float32
    elif requested is not None:
        assert p.dtype == requested  # an explicit dtype is always honoured
    elif user_scaler:
        assert p.dtype == torch.float16
    elif device_type == "cuda":
        assert p.dtype == (torch.bfloat16 if caps.cuda_bf16 else torch.float16)
    elif device_type == "cpu":
        # Never an emulated precision: bf16 only where the CPU runs it natively.
        assert p.dtype == (torch.bfloat16 if caps.cpu_bf16 else torch.float32)
        assert p.reason
    elif device_type == "mps":
        assert p.dtype == torch.float16
    else:
        assert p.dtype == torch.bfloat16


def test_auto_on_this_cpu(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="cudakit.amp")
    step = autocast_step(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    if cpu_native_bf16():
        assert step.dtype == torch.bfloat16
    else:
        assert step.dtype == torch.float32
        assert not step.enabled
    explicit = autocast_step(
        torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), dtype=torch.bfloat16
    )
    assert explicit.dtype == torch.bfloat16
    assert explicit.enabled


def test_lstm_trains_with_auto_dtype() -> None:
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 8, batch_first=True)
    step = autocast_step(torch.optim.Adam(lstm.parameters(), lr=1e-3))
    r = step(lambda x: lstm(x)[0].float().pow(2).mean())(torch.randn(2, 3, 4))
    assert r.stepped


# ----------------------------------------------------------------------------- schedules + flush


def test_flush_with_overrunning_schedule_keeps_counters_consistent() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_batches, accumulate = 7, 2
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=n_batches // accumulate
    )
    step = autocast_step(opt, dtype=torch.float32, accumulate=accumulate, scheduler=sched)
    fn = step(lambda x: model(x).pow(2).mean())
    for _ in range(n_batches):
        fn(torch.ones(2, 3))
    assert step.steps == 3
    with pytest.raises(ValueError, match="Tried to step 4 times"):
        step.flush()
    assert step.steps == sched.last_epoch == 4
    assert step.position == 0
    # Sized as documented (ceil), the same run flushes cleanly.
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(
        opt2, max_lr=0.1, total_steps=math.ceil(n_batches / accumulate)
    )
    step2 = autocast_step(opt2, dtype=torch.float32, accumulate=accumulate, scheduler=sched2)
    fn2 = step2(lambda x: model(x).pow(2).mean())
    for _ in range(n_batches):
        fn2(torch.ones(2, 3))
    assert step2.flush().stepped  # type: ignore[union-attr]
    assert step2.steps == sched2.last_epoch == 4


# ----------------------------------------------------------------------------- checkpoints


def _mid_window() -> tuple[Any, torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float32, accumulate=2
    )
    step(lambda: model(torch.ones(2, 3)).pow(2).mean())()
    return step, model, step.state_dict()


def _fingerprint(step: Any, model: torch.nn.Module) -> tuple[Any, ...]:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    st = step.state_dict()
    return (st["position"], st["steps"], st["skipped_steps"], st["consecutive_skipped"],
            [t.item() for t in st["window_losses"]], grads)  # fmt: skip


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if a[:5] != b[:5]:
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[5], b[5], strict=True)
    )


BAD_FIELDS = [
    (
        "position",
        -1,
        ValueError,
        "state\\['position'\\]=\\.\\.\\.\\) expects an int >= 0, got int -1",
    ),
    ("position", 5, ValueError, "state\\['position'\\]=\\.\\.\\.\\) expects an int from 0 to"),
    (
        "position",
        "1",
        TypeError,
        "state\\['position'\\]=\\.\\.\\.\\) expects an int >= 0, got str '1'",
    ),
    ("position", True, TypeError, "state\\['position'\\]"),
    ("accumulate", 0, ValueError, "state\\['accumulate'\\]=\\.\\.\\.\\) expects an int >= 1"),
    ("steps", "x", TypeError, "state\\['steps'\\]=\\.\\.\\.\\) expects an int >= 0, got str 'x'"),
    ("consecutive_skipped", math.nan, TypeError, "state\\['consecutive_skipped'\\]"),
    ("consecutive_skipped", 3, ValueError, "at most skipped_steps=0"),
    ("grads", [torch.zeros(5, 5), None], ValueError, "has shape \\(5, 5\\) but its parameter"),
    (
        "grads",
        ["g", None],
        TypeError,
        "state\\['grads'\\]\\[0\\]=\\.\\.\\.\\) expects a tensor or None",
    ),
    ("grads", [torch.zeros(2, 3, dtype=torch.long), None], ValueError, "floating-point"),
    ("grads", "nope", TypeError, "state\\['grads'\\]=\\.\\.\\.\\) expects a list"),
    (
        "window_losses",
        ["a"],
        TypeError,
        "state\\['window_losses'\\]=\\.\\.\\.\\) expects a one-element",
    ),
    ("window_losses", [torch.ones(()), torch.ones(())], ValueError, "at most position=1"),
    ("scaler", {"scale": 1.0}, ValueError, "taken with a GradScaler but this step has none"),
]


@pytest.mark.parametrize(("field", "value", "exc", "match"), BAD_FIELDS)
def test_impossible_checkpoint_fields_change_nothing(
    field: str, value: Any, exc: type, match: str
) -> None:
    _step, _model, state = _mid_window()
    # A second step whose state differs, so a partial apply would show.
    fresh, fresh_model, _ = _mid_window()
    fresh(lambda: fresh_model(torch.ones(2, 3)).pow(2).mean())()  # steps to 1, position 0
    before = _fingerprint(fresh, fresh_model)
    bad = dict(state)
    bad[field] = value
    with pytest.raises(exc, match=match):
        fresh.load_state_dict(bad)
    assert _same(_fingerprint(fresh, fresh_model), before)


def _mid_window_with_buffers() -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        dtype=torch.float32,
        accumulate=2,
    )
    step(lambda: model(torch.ones(2, 3)).pow(2).mean())()
    return step, model


def _on_meta(value: Any) -> Any:
    """``value`` with every tensor on the meta device, as ``torch.load(map_location="meta")``."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, list):
        return [_on_meta(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("field", "where"),
    [
        (None, r"state\['grads'\]\[0\]"),  # the whole state, through torch.load
        ("grads", r"state\['grads'\]\[0\]"),
        ("window_losses", r"state\['window_losses'\]\[0\]"),
        ("window_buffers", r"state\['window_buffers'\]\[0\]"),
        ("window_weight", r"state\['window_weight'\]"),
    ],
)
def test_a_mid_window_state_on_the_meta_device_is_refused_and_changes_nothing(
    field: str | None, where: str
) -> None:
    import io

    step, _model = _mid_window_with_buffers()
    state = step.state_dict()
    if field is None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        bad = torch.load(buffer, map_location="meta")
    else:
        bad = dict(state)
        bad[field] = _on_meta(state[field] if field != "window_weight" else torch.ones(()))
    fresh, fresh_model = _mid_window_with_buffers()
    fresh(lambda: fresh_model(torch.ones(2, 3)).pow(2).mean())()  # steps to 1, position 0
    before = _fingerprint(fresh, fresh_model)
    buffers = [b.clone() for b in fresh_model.buffers()]
    saved = fresh.state_dict()
    with pytest.raises(ValueError, match=rf"AutocastStep\.load_state_dict\(\): {where} is on "
                       r"the meta device.*map_location=.*cpu"):  # fmt: skip
        fresh.load_state_dict(bad)
    assert _same(_fingerprint(fresh, fresh_model), before)
    assert all(torch.equal(a, b) for a, b in zip(buffers, fresh_model.buffers(), strict=True))
    after = fresh.state_dict()
    assert after.keys() == saved.keys()
    assert all(torch.equal(a, b) for a, b in zip(after["window_losses"], saved["window_losses"],
                                                 strict=True))  # fmt: skip
    # The same state with real tensors (map_location="cpu") loads.
    fresh.load_state_dict(state)
    assert fresh.position == 1


_JUNK = st.one_of(
    st.none(),
    st.integers(-3, 7),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.booleans(),
    st.lists(st.none(), max_size=3),
    st.just([torch.ones(())]),
    st.just([torch.zeros(2, 3), torch.zeros(2)]),
    st.just({"scale": 2.0}),
)


@given(field=st.sampled_from(["accumulate", "position", "steps", "skipped_steps",
                              "consecutive_skipped", "scaler", "grads", "window_losses"]),
       value=_JUNK)  # fmt: skip
def test_property_corrupted_state_loads_whole_or_changes_nothing(field: str, value: Any) -> None:
    _step, _model, state = _mid_window()
    fresh, fresh_model, _ = _mid_window()
    fresh(lambda: fresh_model(torch.ones(2, 3)).pow(2).mean())()
    before = _fingerprint(fresh, fresh_model)
    bad = dict(state)
    bad[field] = value
    try:
        fresh.load_state_dict(bad)
    except (TypeError, ValueError):
        assert _same(_fingerprint(fresh, fresh_model), before)
    else:  # accepted: it must have been a consistent state, and applied whole
        after = fresh.state_dict()
        assert 0 <= after["position"] < 2
        assert after["consecutive_skipped"] <= after["skipped_steps"]


def test_cpu_without_native_bf16_gets_float32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import cudakit.amp._args as options_module
    import cudakit.amp.policy as policy

    # An AVX2-only CPU: oneDNN reports no native bf16 or fp16.
    monkeypatch.setattr(options_module, "probe_capabilities", lambda device_type: Capabilities())
    monkeypatch.setattr(policy, "_logged", set())
    caplog.set_level(logging.INFO, logger="cudakit.amp")
    for _ in range(2):
        step = autocast_step(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
        assert step.dtype == torch.float32
        assert not step.enabled
        assert step.scaler is None
    logged = [r.getMessage() for r in caplog.records if r.name == "cudakit.amp"]
    assert len(logged) == 1  # once, not per step
    assert "no native bf16" in logged[0]
    # An LSTM, which oneDNN refuses in emulated bf16, trains.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 8, batch_first=True)
    lstm_step = autocast_step(torch.optim.Adam(lstm.parameters(), lr=1e-3))
    assert lstm_step(lambda x: lstm(x)[0].pow(2).mean())(torch.randn(2, 3, 4)).stepped


def test_probe_reads_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudakit.amp.policy import probe_capabilities

    caps = probe_capabilities("cpu")
    assert caps.cpu_bf16 == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not caps.cuda_bf16
    assert probe_capabilities("meta") == Capabilities()
