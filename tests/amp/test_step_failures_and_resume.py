"""Edge cases found in review: fresh optimizer state on a skipped fused step, errors
raised while settling, checkpoints taken in any order, buffers after a mid-window
resume, a failed backward in a weighted window, flush's loss without the guard."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from cudakit.amp import autocast_step
from cudakit.exceptions import NonFiniteStepsError


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8)


@pytest.mark.parametrize("fused", [False, True])
def test_skipped_first_fused_sgd_step_leaves_no_state(fused: bool) -> None:
    m = _linear()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused)
    step = autocast_step(opt, dtype=torch.float32)
    fn = step(lambda x: m(x).pow(2).mean())
    x = torch.randn(4, 8)
    assert fn(x * float("nan")).skipped == True  # noqa: E712 (a Verdict compares as a bool)
    assert opt.state_dict()["state"] == {}  # no momentum buffer of uninitialised memory
    before = m.weight.detach().clone()
    fn(x)
    assert torch.isfinite(m.weight).all()
    ref = _linear()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref.weight.grad = None
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    torch.testing.assert_close(m.weight, ref.weight)
    assert not torch.equal(m.weight, before)


@pytest.mark.usefixtures("skip_on_device")
def test_sync_free_streak_error_closes_the_window() -> None:
    m = _linear()
    step = autocast_step(
        torch.optim.AdamW(m.parameters(), lr=0.1, fused=True), dtype=torch.float32, max_skipped=2
    )
    fn = step(lambda x: m(x).pow(2).mean())
    x = torch.randn(4, 8)
    fn(x * float("nan"))
    fn(x * float("nan"))  # the second skip in a row: raised when its verdict is read
    with pytest.raises(NonFiniteStepsError):
        fn(x * float("nan"))
    assert step.position == 0
    before = m.weight.detach().clone()
    assert fn(x).stepped == True  # noqa: E712
    assert not torch.equal(m.weight, before)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("order", ["step first", "step last"])
def test_checkpoint_in_any_order_resumes_bit_for_bit(fused: bool, order: str, skip_on: str) -> None:
    def make() -> tuple[Any, ...]:
        m = _linear()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        step = autocast_step(opt, dtype=torch.float32, scheduler=sched)
        return m, opt, sched, step, step(lambda x: m(x).pow(2).mean())

    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    m, opt, sched, step, fn = make()
    for x in xs[:3]:
        fn(x)
    parts = [("model", m), ("opt", opt), ("sched", sched)]
    parts = [("step", step), *parts] if order == "step first" else [*parts, ("step", step)]
    ckpt = copy.deepcopy({k: v.state_dict() for k, v in parts})
    for x in xs[3:]:
        fn(x)
    m2, opt2, sched2, step2, fn2 = make()
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    step2.load_state_dict(ckpt["step"])
    for x in xs[3:]:
        fn2(x)
    assert torch.equal(m.weight, m2.weight)
    assert step.steps == step2.steps == sched.last_epoch == sched2.last_epoch == 6


@pytest.mark.usefixtures("skip_on_device")
def test_sync_free_skip_puts_the_schedulers_back() -> None:
    m = _linear()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fn = autocast_step(opt, dtype=torch.float32, scheduler=sched)(lambda x: m(x).pow(2).mean())
    x = torch.randn(2, 8)
    fn(x)
    fn(x)  # two real steps
    lr = opt.param_groups[0]["lr"]
    fn(x * float("nan"))  # skipped: the optimistic scheduler step is undone once read
    fn(x)
    assert fn.autocast_step.steps == 3
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5)


def test_buffers_after_a_mid_window_resume_and_a_skip() -> None:
    def make() -> tuple[Any, ...]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        step = autocast_step(
            torch.optim.SGD(m.parameters(), lr=0.1), model=m, dtype=torch.float32, accumulate=2
        )
        return m, step, step(lambda x: m(x).pow(2).mean())

    x = torch.randn(8, 4)
    m, step, fn = make()
    fn(x)
    ckpt = copy.deepcopy({"model": m.state_dict(), "step": step.state_dict()})
    assert fn(x * float("nan")).skipped
    m2, step2, fn2 = make()
    m2.load_state_dict(ckpt["model"])
    step2.load_state_dict(ckpt["step"])
    assert fn2(x * float("nan")).skipped
    torch.testing.assert_close(m2[1].running_mean, m[1].running_mean, rtol=0, atol=0)
    assert torch.equal(m[1].running_mean, torch.zeros(4))  # as the window opened


def test_a_failed_backward_adds_no_weight() -> None:
    results = []
    for fail_first in (False, True):
        m = _linear()
        step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), accumulate=2)
        x = torch.randn(3, 8)
        if fail_first:
            used = m(x).pow(2).sum()
            used.backward(retain_graph=False)
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                step.backward({"loss": used, "weight": 100})
        for _ in range(2):
            step.backward({"loss": m(x).pow(2).sum(), "weight": 3})
        results.append(m.weight.detach().clone())
    assert torch.equal(results[0], results[1])


def test_flush_reports_the_last_loss_without_the_guard() -> None:
    m = _linear()
    step = autocast_step(
        torch.optim.SGD(m.parameters(), lr=0.1), accumulate=4, skip_nonfinite=False
    )
    r = step(lambda x: m(x).pow(2).mean())(torch.ones(2, 8))
    assert float(step.flush().loss) == float(r.loss) != 0.0  # type: ignore[union-attr]


def test_mailbox_reads_a_landed_gpu_verdict_without_waiting() -> None:
    """One window later a GPU verdict's copy has landed: query() says so, nothing waits."""
    import ctypes

    from cudakit.amp._guard import VerdictMailbox

    class Event:
        def __init__(self, done: bool) -> None:
            self.done, self.waited = done, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True

    box = VerdictMailbox()
    events = [Event(True), Event(False)]
    for value, event in zip((0.0, 1.0), events, strict=True):
        host = torch.tensor([value])
        box._posted.append((host, event, ctypes.c_float.from_address(host.data_ptr())))
    assert box.drain() == [False, True]
    assert [e.waited for e in events] == [False, True]  # only the unfinished copy waits
    assert len(box) == 0


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("16", torch.float16),
        ("32-true", torch.float32),
        ("32", torch.float32),
        ("no", torch.float32),
        ("BF16", torch.bfloat16),
    ],
)
def test_lightning_and_accelerate_precision_names(name: str, dtype: torch.dtype) -> None:
    """Code moving from Fabric ("bf16-mixed") or accelerate ("no") keeps its names."""
    m = _linear()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=name)
    assert step.dtype == dtype
    assert step.enabled == (dtype != torch.float32)
    assert (step.scaler is not None) == (dtype == torch.float16)


@pytest.mark.parametrize("name", ["bf16-true", "16-true", "64-true"])
def test_true_low_precision_names_are_refused_with_the_fix(name: str) -> None:
    m = _linear()
    before = m.weight.detach().clone()
    with pytest.raises(ValueError, match=r"weights held in that precision.*'bf16-mixed'"):
        autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=name)
    assert torch.equal(m.weight, before)


def test_closure_optimizers_are_refused_at_construction() -> None:
    m = _linear()
    with pytest.raises(TypeError, match=r"cannot step LBFGS: its step\(\) needs a closure"):
        autocast_step(torch.optim.LBFGS(m.parameters()), dtype=torch.float32)
    with pytest.raises(TypeError, match="cannot step LBFGS"):  # in a list as well
        autocast_step(
            [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.LBFGS(_linear().parameters())]
        )
    assert m.weight.grad is None  # nothing ran


def test_complex_parameters_are_guarded() -> None:
    """The fused check takes real dtypes only: complex gradients are checked as real pairs."""
    from cudakit.amp._guard import NonFiniteGuard

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    q = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p, q], lr=0.1)  # (torch's fused optimizers refuse complex)
    step = autocast_step(opt, dtype=torch.float32)
    fn = step(lambda scale: (p * p.conj()).real.sum() * scale + q.sum())
    assert fn(1.0).stepped
    before = (p.detach().clone(), q.detach().clone())
    assert fn(float("nan")).skipped
    assert torch.equal(p, before[0])
    assert torch.equal(q, before[1])
    assert step.skipped_steps == 1
    # The imaginary part alone, through the guard itself.
    guard = NonFiniteGuard()
    bad = torch.tensor([1 + 0j, complex(0.0, float("inf"))], dtype=torch.complex64)
    found = guard.check([torch.ones(2), bad])
    assert found is not None
    assert NonFiniteGuard.read(found)


def test_lazily_conjugated_complex_gradients_are_guarded() -> None:
    """Autograd can leave a complex gradient as a conjugate view: checked all the same."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    c = torch.randn(3, dtype=torch.complex64)
    step = autocast_step(torch.optim.SGD([p], lr=0.1), dtype=torch.float32)
    fn = step(lambda scale: (p.conj() * c).real.sum() * scale)
    assert fn(1.0).stepped
    assert p.grad is not None
    before = p.detach().clone()
    assert fn(float("inf")).skipped
    assert torch.equal(p, before)


@pytest.mark.usefixtures("skip_on_device")
def test_a_late_streak_error_drops_its_window_and_restores_the_buffers() -> None:
    """On the GPU's path the streak error is read one window later: that window's batch is
    dropped (not stepped) and its BatchNorm update put back."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    step = autocast_step(opt, model=m, dtype=torch.float32, max_skipped=2)
    fn = step(lambda x: m(x).pow(2).mean())
    x = torch.randn(8, 4)
    fn(x)
    fn(x * float("nan"))
    fn(x * float("nan"))  # the second skip in a row: its verdict is still pending
    stats = m[1].running_mean.clone()
    weights = m[0].weight.detach().clone()
    with pytest.raises(NonFiniteStepsError):
        fn(x * 3)
    assert torch.equal(m[1].running_mean, stats)  # the dropped batch left no statistics
    assert torch.equal(m[0].weight, weights)
    assert step.position == 0
    assert (step.steps, step.skipped_steps) == (1, 2)
    assert fn(x).stepped == True  # noqa: E712  (training goes on)
