"""autocast_step's arguments and settable attributes at their edges: classes passed for
instances, a scheduler listed twice, the max_skipped and accumulate setters, NumPy
integers, a GradScaler checkpoint checked whole, a call refused before it clears
the gradients, and ``compile=`` options with values torch.compile would reject (or
misread), refused when the step is built."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudakit import autocast_step

torch.set_num_threads(1)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)
    ]


# ------------------------------------------------------------ classes for instances


def test_an_optimizer_class_is_refused_with_how_to_build_it() -> None:
    with pytest.raises(
        TypeError, match=r"got the class SGD, not an optimizer.*SGD\(model\.parameters\(\)"
    ):
        autocast_step(torch.optim.SGD)  # type: ignore[arg-type]


def test_a_scheduler_class_is_refused_before_anything_steps() -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"autocast_step\(scheduler=\.\.\.\) got the class StepLR, not a scheduler"
    ):
        autocast_step(opt, scheduler=torch.optim.lr_scheduler.StepLR)


def test_an_optimizer_passed_as_scheduler_is_refused() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"autocast_step\(scheduler=\.\.\.\) got an optimizer \(SGD\)"
    ):
        autocast_step(opt, scheduler=opt)


def test_the_same_scheduler_twice_is_refused() -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with pytest.raises(ValueError, match=r"the same scheduler twice"):
        autocast_step(opt, scheduler=[sched, sched])
    assert sched.last_epoch == 0


def test_a_scaler_class_is_refused() -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"autocast_step\(scaler=\.\.\.\) got the class GradScaler"):
        autocast_step(opt, dtype=torch.float16, scaler=torch.amp.GradScaler)  # type: ignore[arg-type]


# ------------------------------------------------------------------ max_skipped


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), ("5", TypeError), (2.0, TypeError), (True, TypeError)],
)
def test_max_skipped_setter_checks_like_the_constructor(value: Any, error: type[Exception]) -> None:
    step = autocast_step(torch.optim.SGD(_net().parameters(), lr=0.1))
    before = step.max_skipped
    with pytest.raises(error, match=r"^AutocastStep\.max_skipped = \.\.\. expects an int >= 1"):
        step.max_skipped = value
    assert step.max_skipped == before


def test_max_skipped_setter_takes_ints_and_none_for_the_default() -> None:
    step = autocast_step(torch.optim.SGD(_net().parameters(), lr=0.1), dtype="fp32")
    default = step.max_skipped
    step.max_skipped = 3
    assert step.max_skipped == 3
    step.max_skipped = np.int64(4)  # type: ignore[assignment]
    assert step.max_skipped == 4
    assert type(step.max_skipped) is int
    step.max_skipped = None  # type: ignore[assignment]
    assert step.max_skipped == default


# -------------------------------------------------------------------- accumulate


def test_numpy_integers_are_taken_as_ints() -> None:
    step = autocast_step(torch.optim.SGD(_net().parameters(), lr=0.1), accumulate=np.int64(2))
    assert step.accumulate == 2
    assert type(step.accumulate) is int


def _hand_written(
    schedule: list[int], batches: list[Any], partial: int = 0
) -> dict[str, torch.Tensor]:
    """A hand-written fp32 loop whose accumulation changes between windows; a last
    window of ``partial`` micro-steps is stepped as documented for flush(): the losses
    divided by the window's accumulate, the gradients then rescaled by accumulate/k."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    it = iter(batches)
    for k in schedule:
        opt.zero_grad()
        for _ in range(k):
            x, y = next(it)
            (F.cross_entropy(net(x), y) / k).backward()
        opt.step()
    if partial:
        k = schedule[-1]
        opt.zero_grad()
        for _ in range(partial):
            x, y = next(it)
            (F.cross_entropy(net(x), y) / k).backward()
        for p in net.parameters():
            assert p.grad is not None
            p.grad.mul_(k / partial)
        opt.step()
    return net.state_dict()


def test_accumulate_can_change_between_windows_bit_for_bit() -> None:
    schedule = [2, 2, 4, 1, 3]
    batches = _batches(sum(schedule))
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype="fp32", accumulate=2)

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x), y)

    it = iter(batches)
    for k in schedule:
        step.accumulate = k  # as Lightning's GradientAccumulationScheduler, per epoch
        results = [train(*next(it)) for _ in range(k)]
        assert [r.stepped for r in results] == [False] * (k - 1) + [True]
    assert step.steps == len(schedule)
    ref = _hand_written(schedule, batches)
    assert all(torch.equal(ref[k], v) for k, v in net.state_dict().items())


def test_accumulate_cannot_change_mid_window_and_is_checked() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype="fp32", accumulate=2)
    ((x, y),) = _batches(1)
    step(lambda: F.cross_entropy(net(x), y))()
    with pytest.raises(ValueError, match=r"accumulate.*between windows.*1 of 2 micro-steps"):
        step.accumulate = 4
    assert step.accumulate == 2
    assert step.position == 1
    with pytest.raises(TypeError, match=r"^AutocastStep\.accumulate = \.\.\. expects an int >= 1"):
        step.accumulate = 2.0  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^AutocastStep\.accumulate = \.\.\. expects an int >= 1"):
        step.accumulate = 0
    step.flush()
    step.accumulate = 4
    assert step.accumulate == 4


# ------------------------------------------------------------ scaler checkpoints


def _fp16_step() -> Any:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    ((x, y),) = _batches(1)
    step(lambda: F.cross_entropy(net(x), y))()
    return step


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("_growth_tracker", None, ValueError, r"a GradScaler state with '_growth_tracker'"),
        (
            "_growth_tracker",
            "3",
            TypeError,
            r"\['scaler'\]\['_growth_tracker'\]=\.\.\.\) expects an int >= 0",
        ),
        (
            "_growth_tracker",
            1.5,
            TypeError,
            r"\['scaler'\]\['_growth_tracker'\]=\.\.\.\) expects an int >= 0",
        ),
        (
            "_growth_tracker",
            -5,
            ValueError,
            r"\['scaler'\]\['_growth_tracker'\]=\.\.\.\) expects an int >= 0",
        ),
        (
            "growth_factor",
            0.5,
            ValueError,
            r"\['scaler'\]\['growth_factor'\]=\.\.\.\) expects a finite number > 1",
        ),
        (
            "backoff_factor",
            3.0,
            ValueError,
            r"\['scaler'\]\['backoff_factor'\]=\.\.\.\) expects a number in \(0, 1\)",
        ),
        (
            "growth_interval",
            2.5,
            TypeError,
            r"\['scaler'\]\['growth_interval'\]=\.\.\.\) expects an int >= 1",
        ),
        (
            "growth_interval",
            0,
            ValueError,
            r"\['scaler'\]\['growth_interval'\]=\.\.\.\) expects an int >= 1",
        ),
    ],
)
def test_a_scaler_state_is_checked_whole_before_anything_changes(
    key: str, value: Any, error: type[Exception], match: str
) -> None:
    step = _fp16_step()
    state = step.state_dict()
    scaler_before = copy.deepcopy(step.scaler.state_dict())
    bad = copy.deepcopy(state)
    bad["scaler"]["scale"] = 4.0  # would be applied first if the check came late
    if value is None:
        del bad["scaler"][key]
    else:
        bad["scaler"][key] = value
    with pytest.raises(error, match=match):
        step.load_state_dict(bad)
    assert step.scaler.state_dict() == scaler_before


def test_a_scaler_state_with_tensor_numbers_loads() -> None:
    step = _fp16_step()
    state = step.state_dict()
    state["scaler"]["_growth_tracker"] = torch.tensor(2, dtype=torch.int32)
    step.load_state_dict(state)
    assert step.scaler.state_dict()["_growth_tracker"] == 2


@pytest.mark.parametrize("weight", [float("nan"), -1.0, float("inf")])
def test_a_checkpointed_window_weight_must_be_a_finite_count(weight: float) -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype="fp32", accumulate=2)
    ((x, y),) = _batches(1)
    step(lambda: {"loss": F.cross_entropy(net(x), y, reduction="sum"), "weight": 5})()
    state = step.state_dict()
    state["window_weight"] = torch.tensor(weight)
    grads = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(
        ValueError, match=r"\['window_weight'\]=\.\.\.\) expects a finite count >= 0"
    ):
        step.load_state_dict(state)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))


# ------------------------------------------------- a refused call keeps the grads


def test_a_call_under_no_grad_is_refused_before_the_gradients_are_cleared() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ((x, y),) = _batches(1)
    train = autocast_step(opt, dtype="fp32")(lambda: F.cross_entropy(net(x), y))
    train()
    grads = [p.grad.clone() for p in net.parameters()]
    weights = copy.deepcopy(net.state_dict())
    for ctx in (torch.no_grad, torch.inference_mode):
        with (
            ctx(),
            pytest.raises(ValueError, match=r"gradients are disabled.*does not require grad"),
        ):
            train()
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
    assert train().stepped


# ------------------------------------------------------------- a disabled GradScaler


def test_the_amp_recipes_switch_turns_both_off() -> None:
    # torch's AMP recipe: GradScaler(enabled=use_amp) with autocast(enabled=use_amp).
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    use_amp = False
    step = autocast_step(
        opt,
        dtype=torch.float16,
        enabled=use_amp,
        scaler=torch.amp.GradScaler("cpu", enabled=use_amp),
    )
    assert (step.dtype, step.enabled, step.scaler) == (torch.float32, False, None)
    ((x, y),) = _batches(1)
    assert step(lambda: F.cross_entropy(net(x), y))().stepped


@pytest.mark.parametrize("dtype", ["auto", "bf16", "fp32"])
def test_a_disabled_scaler_is_as_no_scaler_outside_fp16(dtype: str) -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    plain = autocast_step(opt, dtype=dtype)
    step = autocast_step(opt, dtype=dtype, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert step.dtype == plain.dtype
    assert step.scaler is None


def test_a_disabled_scaler_with_fp16_turns_loss_scaling_off() -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = autocast_step(opt, dtype=torch.float16, scaler=scaler)
    assert step.dtype == torch.float16
    assert step.scaler is scaler


def test_an_enabled_scaler_with_autocast_off_is_refused() -> None:
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"enabled=False.*GradScaler\(enabled=False\)"):
        autocast_step(opt, enabled=False, scaler=torch.amp.GradScaler("cpu"))


# ------------------------------------------ accumulate inside a window's micro-step


class _PausableNet(nn.Module):
    """A model with DDP's no_sync(), recording whether sync was paused at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.paused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def no_sync(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def paused() -> Any:
            self.paused = True
            try:
                yield
            finally:
                self.paused = False

        return paused()


def test_accumulate_cannot_change_inside_a_micro_step() -> None:
    model = _PausableNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype="fp32", accumulate=2)
    ((x, y),) = _batches(1)
    with step:
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(ValueError, match=r"inside `with step:` or the step function"):
            step.accumulate = 1
    assert step.backward(loss).stepped is False
    assert step.accumulate == 2

    def inside() -> torch.Tensor:
        step.accumulate = 1
        return F.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match=r"inside `with step:` or the step function"):
        step(inside)()
    assert step.accumulate == 2


def test_sync_pauses_after_accumulate_goes_from_one_to_several() -> None:
    model = _PausableNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype="fp32", accumulate=1)
    ((x, y),) = _batches(1)
    seen: list[bool] = []

    @step
    def train() -> torch.Tensor:
        seen.append(model.paused)
        return F.cross_entropy(model(x), y)

    train()
    step.accumulate = 3
    for _ in range(3):
        train()
    assert seen == [False, True, True, False]  # only the closing micro-step syncs


# ----------------------------------------------------------- preserve_state


def test_preserve_state_puts_accumulate_back_and_everything_else() -> None:
    from cudakit import preserve_state

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype="fp32", accumulate=2)
    train = step(lambda x, y: F.cross_entropy(net(x), y))
    batches = _batches(4)
    train(*batches[0])  # mid-window when the block opens
    weights = copy.deepcopy(net.state_dict())
    with preserve_state(net, opt, extra=(step,)):
        train(*batches[1])  # closes the window
        step.accumulate = 4
        train(*batches[2])
    assert step.accumulate == 2
    assert step.position == 1
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


# --------------------------------------------------- disabled scaler checkpoints


def test_a_scaled_checkpoint_into_a_step_whose_scaler_is_disabled_is_refused() -> None:
    state = _fp16_step().state_dict()
    opt = torch.optim.SGD(_net().parameters(), lr=0.1)
    off = autocast_step(opt, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(
        ValueError, match=r"taken with loss scaling on, but this step's GradScaler is disabled"
    ):
        off.load_state_dict(state)
    on = _fp16_step()
    with pytest.raises(ValueError, match=r"taken with a disabled GradScaler, but this step's"):
        on.load_state_dict(off.state_dict())


# --------------------------------------------- property: any accumulation schedule


@given(
    schedule=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    flush_last=st.integers(0, 3),
)
@settings(max_examples=25)
def test_any_accumulation_schedule_matches_the_hand_written_loop(
    schedule: list[int], flush_last: int
) -> None:
    """accumulate set at every window boundary, a partial window flushed at the end."""
    partial = min(flush_last, schedule[-1] - 1)  # micro-steps of an unfinished last window
    batches = _batches(sum(schedule) + partial)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = autocast_step(opt, dtype="fp32", accumulate=schedule[0])
    train = step(lambda x, y: F.cross_entropy(net(x), y))
    it = iter(batches)
    for k in schedule:
        step.accumulate = k
        for _ in range(k):
            train(*next(it))
    for _ in range(partial):
        train(*next(it))
    if partial:
        assert train.flush().stepped
    ref = _hand_written(schedule, batches, partial=partial)
    assert all(torch.equal(ref[k], v) for k, v in net.state_dict().items())
    assert step.steps == len(schedule) + (1 if partial else 0)


def test_accumulate_cannot_change_between_the_block_and_its_backward() -> None:
    model = _PausableNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype="fp32", accumulate=2)
    ((x, y),) = _batches(1)
    with step:  # this micro-step will not step: sync paused for its forward
        loss = F.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match=r"between the block and its step\.backward\(\)"):
        step.accumulate = 1
    assert step.backward(loss).stepped is False
    step.accumulate = 2  # unchanged value: always fine
    with pytest.raises(RuntimeError, match="boom"), step:
        raise RuntimeError("boom")
    with pytest.raises(ValueError, match=r"only between windows: this window holds 1 of 2"):
        step.accumulate = 3  # the abandoned block no longer blocks; the window does


def test_preserve_state_keeps_the_blocks_own_exception() -> None:
    from cudakit import preserve_state

    class Broken:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise RuntimeError("cannot restore")

    net = _net()
    weights = copy.deepcopy(net.state_dict())

    def interrupted() -> None:
        with preserve_state(net, extra=(Broken(),)):
            with torch.no_grad():
                net[0].weight.add_(1)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        interrupted()
    assert any("cannot restore" in note for note in getattr(info.value, "__notes__", []))
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
    clean = preserve_state(net, extra=(Broken(),))
    with pytest.raises(RuntimeError, match="cannot restore"), clean:
        pass  # a clean exit: the restore's error is raised


# --------------------------------------------------------------- compile= options


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (
            {"fullgraph": "yes"},
            TypeError,
            r"compile\['fullgraph'\]=\.\.\.\) expects True or False, got str",
        ),
        (
            {"dynamic": "auto"},
            TypeError,
            r"compile\['dynamic'\]=\.\.\.\) expects True, False or None, got str 'auto'",
        ),
        (
            {"disable": 1},
            TypeError,
            r"compile\['disable'\]=\.\.\.\) expects True or False, got int 1",
        ),
        (
            {"mode": "fast"},
            ValueError,
            r"compile\['mode'\]=\.\.\.\) expects one of 'default', .*'max-autotune'",
        ),
        ({"mode": 3}, TypeError, r"'mode'\]=\.\.\.\) expects a str or None"),
        (
            {"backend": "no-such-backend"},
            ValueError,
            r"compile\['backend'\]=\.\.\.\) expects a name from torch\.compiler\.list_backends\(\)",
        ),
        ({"backend": 3}, TypeError, r"'backend'.*a backend name or a callable"),
        ({"options": 3}, TypeError, r"'options'.*a dict of inductor options"),
        ({"options": {1: True}}, TypeError, r"'options'.*str keys"),
        (
            {"mode": "max-autotune", "options": {"max_autotune": True}},
            ValueError,
            r"mode= or options=, not both",
        ),
    ],
)
def test_a_bad_compile_option_value_is_refused(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"^autocast_step\(.*{match}"):
        autocast_step(_opt(), compile=options)


@pytest.mark.parametrize(
    "options",
    [
        {"fullgraph": True, "dynamic": None, "mode": "default", "disable": False},
        {"dynamic": False, "backend": "eager"},
        {"backend": lambda gm, example_inputs: gm, "mode": None},
        {"options": {"max_autotune": False}},
        {"mode": "reduce-overhead"},
    ],
)
def test_good_compile_options_are_kept(options: dict[str, Any]) -> None:
    step = autocast_step(_opt(), compile=options)
    assert step.compile_options == options


def test_autocast_step_and_autocast_step_s_class_take_the_same_options() -> None:
    """One list of options: the documented signature, the class's ``**options`` type and
    the checks that read them (their defaults too) agree."""
    import inspect

    from cudakit.amp._args import resolve_options
    from cudakit.amp.step import StepOptions

    def keywords(func: Any) -> dict[str, Any]:
        params = inspect.signature(func).parameters.values()
        return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}

    documented = keywords(autocast_step)
    assert set(StepOptions.__annotations__) == set(documented)
    checked = keywords(resolve_options)
    watching = {"skip_spikes", "locate_nonfinite"}  # (read from ``**watch``, checked last)
    assert checked == {k: v for k, v in documented.items() if k not in watching}
