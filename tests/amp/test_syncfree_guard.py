"""The sync-free guarded step (fused optimizers skip on the device) and compile=True."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import autocast_step
from cudakit.exceptions import NonFiniteStepsError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            *[m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.GELU())],
            torch.nn.LayerNorm(32),
        )
        self.head = torch.nn.Linear(32, 1)
        self.bn = torch.nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.body(x)))  # type: ignore[no-any-return]


def _make(seed: int = 0) -> tuple[MLP, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    return model, opt, sched


def _data(n: int, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def _loss(model: MLP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host: item, bool, tolist."""

    NAMES = ("item", "__bool__", "tolist")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_fused_optimizer_makes_the_step_sync_free() -> None:
    _, opt, _ = _make()
    assert autocast_step(opt).sync_free
    plain = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    assert not autocast_step(plain).sync_free
    assert not autocast_step(opt, skip_nonfinite=False, dtype=torch.float32).sync_free


@pytest.mark.parametrize("dtype", DTYPES)
def test_sync_free_step_bit_identical_to_hand_written(dtype: torch.dtype, skip_on: str) -> None:
    data = _data(6)
    model, opt, sched = _make()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=dtype == torch.float16)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
    expected = _state(model, opt)

    model2, opt2, sched2 = _make()
    scaler2 = torch.amp.GradScaler("cpu", init_scale=256.0) if dtype == torch.float16 else None
    step = autocast_step(
        opt2, model=model2, dtype=dtype, scaler=scaler2, max_grad_norm=1.0, scheduler=sched2
    )
    fn = step(lambda x, y: _loss(model2, x, y))
    for x, y in data:
        fn(x, y)
    assert step.steps == 6  # reading settles the last verdict and steps the scheduler
    got = _state(model2, opt2)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert sched2.last_epoch == sched.last_epoch


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_host_reads_in_twenty_guarded_steps(dtype: torch.dtype, skip_on: str) -> None:
    model, opt, sched = _make()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if dtype == torch.float16 else None
    step = autocast_step(
        opt,
        model=model,
        dtype=dtype,
        scaler=scaler,
        accumulate=2,
        max_grad_norm=1.0,
        scheduler=sched,
    )
    fn = step(lambda x, y: _loss(model, x, y))
    data = _data(20, nan_at=7)
    with HostReads() as reads:
        results = [fn(x, y) for x, y in data]
        weighted = step(lambda x, y: {"loss": _loss(model, x, y) * 16, "weight": 16})
        results += [weighted(x, y) for x, y in data[:4]]
    assert reads.calls == []
    assert step._stepper.lazy == (skip_on == "device")
    # Read (lazily on the device path) afterwards: the window of the NaN batch (calls 6-7)
    # was skipped.
    assert step.skipped_steps == 1
    assert step.steps == 11
    assert sched.last_epoch == 11  # the scheduler stepped on real steps only
    assert [bool(r.skipped) for r in results].count(True) == 1


def test_nan_step_leaves_weights_state_and_buffers_untouched(skip_on: str) -> None:
    model, opt, _ = _make()
    step = autocast_step(opt, model=model, dtype=torch.float32)
    fn = step(lambda x, y: _loss(model, x, y))
    good, bad = _data(2, nan_at=1)
    fn(*good)
    before = _state(model, opt)
    r = fn(*bad)
    assert r.skipped == True  # noqa: E712  (a lazily read verdict compares as a bool)
    assert not r.stepped
    for a, b in zip(_state(model, opt), before, strict=True):
        assert torch.equal(a, b)
    assert step.skipped_steps == 1


def test_streak_error_is_raised_when_the_verdict_is_read(skip_on: str) -> None:
    model, opt, _ = _make()
    step = autocast_step(opt, dtype=torch.float32, max_skipped=2)
    fn = step(lambda x, y: _loss(model, x, y) * float("nan"))
    x, y = _data(1)[0]
    fn(x, y)
    if skip_on == "device":
        fn(x, y)  # the second skip: raised when its verdict is read, one step later
    with pytest.raises(NonFiniteStepsError, match="2 optimizer steps in a row"):
        fn(x, y)


def test_compile_errors() -> None:
    _, opt, _ = _make()
    with pytest.raises(TypeError, match="compile=...\\) expects True, False or a dict"):
        autocast_step(opt, compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="options torch.compile does not take: \\['bogus'\\]"):
        autocast_step(opt, compile={"bogus": 1})


@pytest.fixture
def counters() -> Any:
    """Dynamo's counters (graph breaks, graphs compiled), from a clean slate."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


# Inductor's own import of torch.jit trips this in torch 2.13; not cudakit's.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_true_fullgraph_no_recompiles_and_matches_eager(
    skip_on: str, counters: Any
) -> None:
    data = _data(20, nan_at=9)
    results = {}
    for compiled in (False, True):
        model, opt, sched = _make()
        # Adam moves each weight by about lr per step whatever the gradient's size, so a
        # bf16 rounding that flips a tiny gradient's sign costs up to 2 * lr per step.
        sched.base_lrs = [1e-3]
        opt.param_groups[0]["lr"] = 1e-3
        step = autocast_step(
            opt,
            model=model,
            dtype=torch.bfloat16,
            accumulate=2,
            max_grad_norm=1.0,
            scheduler=sched,
            compile={"fullgraph": True} if compiled else False,
        )
        fn = step(lambda x, y, m=model: _loss(m, x, y))
        out = [fn(x, y) for x, y in data]
        assert step.skipped_steps == 1
        assert [bool(r.skipped) for r in out].count(True) == 1
        results[compiled] = [p.detach().clone() for p in model.parameters()]
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 2  # window positions: one graph each at most
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)  # 10 steps of at most 2 * lr


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_guarded_steps_never_synchronize(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    step = autocast_step(
        opt, model=model, dtype=dtype, max_grad_norm=1.0, accumulate=2, scheduler=sched
    )
    assert step.sync_free
    fn = step(lambda x, y: _loss(model, x, y))
    data = [(x.cuda(), y.cuda()) for x, y in _data(21, nan_at=9)]
    # One whole window first: the flags, the optimizer state and the mailbox's pinned
    # host buffer are made there (allocating pinned memory may synchronise).
    fn(*data[0])
    fn(*data[1])
    try:
        with warnings.catch_warnings():
            # torch warns that the mode is a prototype (an error under filterwarnings):
            # the mode is set by then, so it is set inside the try that resets it.
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        for x, y in data[2:]:
            fn(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.skipped_steps >= 1  # the NaN window (fp16 may also skip while scaling)


def test_verdicts_behave_as_bools(skip_on: str) -> None:
    model, opt, _ = _make()
    fn = autocast_step(opt, dtype=torch.float32)(lambda x, y: _loss(model, x, y))
    results = [fn(x, y) for x, y in _data(4, nan_at=2)]
    assert sum(r.skipped for r in results) == 1
    assert [int(r.stepped) for r in results] == [1, 1, 0, 1]
    assert [r.skipped for r in results] == [False, False, True, False]
    assert f"{results[2].skipped}" == "True"
    assert not results[0].skipped


def test_cpu_skips_on_the_host_and_the_gpu_path_on_the_device(skip_on: str) -> None:
    """On the CPU a bad step never reaches the optimizer; the GPU's path hands it found_inf."""
    model, opt, _ = _make()
    calls: list[object] = []
    real_step = opt.step

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(getattr(opt, "found_inf", None))
        return real_step(*args, **kwargs)

    opt.step = spy  # type: ignore[method-assign]
    step = autocast_step(opt, model=model, dtype=torch.float32)
    fn = step(lambda x, y: _loss(model, x, y))
    good, bad = _data(2, nan_at=1)
    fn(*good)
    fn(*bad)
    assert step.skipped_steps == 1
    assert step.sync_free
    if skip_on == "host":
        assert not step._stepper.lazy
        assert calls == [None]  # the bad step never ran the optimizer
    else:
        assert step._stepper.lazy
        assert len(calls) == 2
        assert all(isinstance(f, torch.Tensor) for f in calls)


def test_read_memory_reads_cpu_verdicts_without_a_torch_op() -> None:
    from cudakit.amp._guard import NonFiniteGuard

    flags = torch.tensor([0.0, 1.0, 0.0])
    with HostReads() as reads:
        got = [NonFiniteGuard.read_memory(flags[i : i + 1]) for i in range(3)]
    assert got == [False, True, False]  # views with an offset read their own element
    assert reads.calls == []
    # Anything else falls back to .item(): other dtypes, 0-dim float64.
    with HostReads() as reads:
        assert NonFiniteGuard.read_memory(torch.tensor(2.0, dtype=torch.float64))
        assert not NonFiniteGuard.read_memory(torch.zeros(1, dtype=torch.int32))
    assert reads.calls == ["item", "item"]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("clip", [None, 1.0])
def test_compile_true_compiles_the_check_only_on_the_gpus_path(
    skip_on: str, clip: float | None, counters: Any
) -> None:
    """The CPU keeps the eager check (its compiled region measured slower); the GPU's
    sync-free path compiles the check with the clipping."""
    data = _data(6, nan_at=3)
    results = {}
    for compiled in (False, True):
        model, opt, _ = _make()
        opt.param_groups[0]["lr"] = 1e-4
        step = autocast_step(
            opt, model=model, dtype=torch.float32, max_grad_norm=clip, compile=compiled
        )
        has_region = step._stepper.judge._compiled_check is not None
        assert has_region == (compiled and skip_on == "device" and clip is not None)
        calls = []
        if has_region:
            region = step._stepper.judge._compiled_check

            def counted(*args: Any, _region: Any = region, _calls: Any = calls) -> Any:
                _calls.append(1)
                return _region(*args)

            step._stepper.judge._compiled_check = counted
        fn = step(lambda x, y, m=model: _loss(m, x, y))
        out = [fn(x, y) for x, y in data]
        if has_region:  # used on every window but the first (which reads at once)
            assert len(calls) >= len(data) - 2
        assert [bool(r.skipped) for r in out] == [False, False, False, True, False, False]
        results[compiled] = [p.detach().clone() for p in model.parameters()]
    assert dict(counters["graph_break"]) == {}
    # Inductor's forward sums in another order: a tiny gradient whose sign flips moves
    # an Adam weight by up to 2 * lr per step (5 real steps).
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * 1e-4 * 5)


def test_compile_with_the_explicit_form_warns_once() -> None:
    x, y = _data(1)[0]
    for use_block in (True, False):
        model, opt, _ = _make()
        step = autocast_step(opt, dtype=torch.float32, compile=True)
        if use_block:
            with step:
                loss = _loss(model, x, y)
        else:  # backward() on a loss computed outside any `with step:`
            loss = _loss(model, x, y)
        with pytest.warns(UserWarning, match=r"compiles the decorated loss function"):
            result = step.backward(loss)
        assert result.stepped
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with step:
                loss = _loss(model, x, y)
            step.backward(loss)
        assert not [w for w in caught if "compile" in str(w.message)]  # once per step


def _run_path(
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    accumulate: int,
    clip: float | None,
    bad: set[int],
    n: int,
) -> tuple[
    list[torch.Tensor], dict[int, dict[str, torch.Tensor]], tuple[int, int], int, list[bool]
]:
    with monkeypatch.context() as patch:
        if path == "device":
            patch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
        model, opt, sched = _make()
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if dtype == torch.float16 else None
        step = autocast_step(
            opt,
            model=model,
            dtype=dtype,
            scaler=scaler,
            accumulate=accumulate,
            max_grad_norm=clip,
            scheduler=sched,
        )
    assert step._stepper.lazy == (path == "device")
    fn = step(lambda x, y: _loss(model, x, y))
    skipped = []
    for i, (x, y) in enumerate(_data(n)):
        r = fn(x * float("nan") if i in bad else x, y)
        skipped.append(bool(r.skipped))
    counts = (step.steps, step.skipped_steps)
    weights = [t.detach().clone() for t in model.state_dict().values()]
    index = {p: i for i, p in enumerate(model.parameters())}
    states = {index[p]: {k: v.clone() for k, v in st_.items()} for p, st_ in opt.state.items()}
    return weights, states, counts, sched.last_epoch, skipped


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    accumulate=st.integers(1, 3),
    clip=st.sampled_from([None, 1.0]),
    bad=st.sets(st.integers(0, 7), max_size=3),
)
def test_host_and_device_paths_train_alike(
    dtype: torch.dtype, accumulate: int, clip: float | None, bad: set[int]
) -> None:
    """The CPU's host-side skip and the GPU's found_inf path leave identical state."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        host = _run_path("host", monkeypatch, dtype, accumulate, clip, bad, 8)
        device = _run_path("device", monkeypatch, dtype, accumulate, clip, bad, 8)
    for a, b in zip(host[0], device[0], strict=True):
        # (a partial last window may hold a NaN batch's BatchNorm statistics, on both)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for i, state in device[1].items():
        if i in host[1]:
            assert all(torch.equal(v, host[1][i][k]) for k, v in state.items())
        else:  # a fused step skipped on the device still makes its state: a fresh one
            assert all(not v.any() for v in state.values())
    assert host[1].keys() <= device[1].keys()
    assert host[2:] == device[2:]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_mailbox_reads_its_own_buffers(how: str) -> None:
    """The cells that read posted verdicts point at the copy's buffers, not the original's."""
    import copy
    import pickle

    from cudakit.amp._guard import VerdictMailbox

    box = VerdictMailbox()
    box.post(torch.tensor([0.0, 2.5]))
    assert box.drain_values() == [(0.0, 2.5)]  # its buffer is free for the next post
    box.post(torch.tensor([1.0, 4.0]))
    twin = copy.deepcopy(box) if how == "deepcopy" else pickle.loads(pickle.dumps(box))
    assert twin.drain_values() == [(1.0, 4.0)]
    for value in (0.5, 7.0):
        twin.post(torch.tensor([0.0, value]))
        assert twin.drain_values() == [(0.0, value)]
        twin.post(torch.tensor([3.0]))
        assert twin.drain() == [True]
    assert box.drain_values() == [(1.0, 4.0)]  # the original is untouched
