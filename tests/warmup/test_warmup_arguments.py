"""warmup at the door: every bad argument refused before anything runs, both forms of
``loss_fn``, the CPU peak, and :func:`example_batch` that leaves the RNG as it was."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cudakit.exceptions import DeviceError
from cudakit.warmup import example_batch, find_batch_size, preserve_state, warmed, warmup
from cudakit.warmup._loss import loss_form


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _log_softmax_net() -> nn.Module:
    return nn.Sequential(_net(), nn.LogSoftmax(dim=1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def _state(model: nn.Module) -> dict[str, Any]:
    """Weights, buffers, grads and every RNG: what a refused call must leave unchanged."""
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "py": random.getstate(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["params"].keys() == b["params"].keys()
        and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        and all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
            for x, y in zip(a["grads"], b["grads"], strict=True)
        )
        and a["training"] == b["training"]
        and torch.equal(a["rng"], b["rng"])
        and a["py"] == b["py"]
    )


# --------------------------------------------------------------------------- loss_fn forms


def test_functional_criterion_works_like_a_loss_module() -> None:
    model = _log_softmax_net()
    before = _state(model)
    report = warmup(model, _data(), loss_fn=F.nll_loss)
    assert report.backward
    assert _same(before, _state(model))


def test_partial_of_a_functional_criterion_works() -> None:
    model = _net()
    before = _state(model)
    report = warmup(model, _data(), loss_fn=functools.partial(F.cross_entropy, label_smoothing=0.1))
    assert report.backward
    assert _same(before, _state(model))


def test_own_criterion_by_annotation_or_name() -> None:
    def by_annotation(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    def by_name(logits, target):  # type: ignore[no-untyped-def]
        return F.cross_entropy(logits, target)

    for fn in (by_annotation, by_name):
        model = _net()
        assert warmup(model, _data(), loss_fn=fn).backward


def test_step_functions_keep_working() -> None:
    model = _net()
    x, y = _data()

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    assert warmup(model, (x, y), loss_fn=step).backward
    assert warmup(model, (x, y), loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1])).backward


def _annotated_model(model: nn.Module, batch: Any) -> Any:
    return model


def _annotated_tensor(output: torch.Tensor, target: Any) -> Any:
    return output


@pytest.mark.parametrize(
    ("fn", "form"),
    [
        (F.nll_loss, "criterion"),
        (F.cross_entropy, "criterion"),
        (F.mse_loss, "criterion"),
        (functools.partial(F.cross_entropy, reduction="sum"), "criterion"),
        (nn.CrossEntropyLoss(), "criterion"),
        (_annotated_tensor, "criterion"),
        (lambda output, target: 0, "criterion"),
        (lambda logits, y: 0, "criterion"),
        (lambda pred, y: 0, "criterion"),
        (lambda out, y: 0, "criterion"),
        (_annotated_model, "function"),
        (lambda model, batch: 0, "function"),
        (lambda m, b: 0, "function"),
        (lambda *args: 0, "function"),
        (print, "function"),
    ],
)
def test_loss_form_rule(fn: Any, form: str) -> None:
    assert loss_form(fn, None) == form


def test_model_passed_as_its_own_loss_fn_is_a_step_function() -> None:
    model = nn.Linear(2, 2)
    assert loss_form(model, model) == "function"


def test_functional_criterion_needs_an_inputs_target_pair() -> None:
    model = _log_softmax_net()
    x = torch.randn(4, 4)
    before = _state(model)
    with pytest.raises(TypeError, match=r"criterion nll_loss as loss_fn.*\(inputs, target\)"):
        warmup(model, x, loss_fn=F.nll_loss)
    assert _same(before, _state(model))


def test_step_function_that_is_really_a_criterion_gets_a_note_naming_both_forms() -> None:
    def crit(a, b):  # type: ignore[no-untyped-def]
        return F.cross_entropy(a, b)  # called as crit(model, batch): torch's TypeError

    model = _net()
    before = _state(model)
    with pytest.raises(TypeError) as info:
        warmup(model, _data(), loss_fn=crit)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "loss_fn(model(inputs), target)" in notes
    assert "loss_fn(model, batch)" in notes
    assert _same(before, _state(model))


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"amp": torch.float64},
            ValueError,
            r"warmup\(amp=\.\.\.\) expects torch\.bfloat16 or torch\.float16, got dtype "
            r"torch\.float64\..*Use torch\.bfloat16 or torch\.float16",
        ),
        (
            {"amp": torch.float8_e4m3fn},
            ValueError,
            r"warmup\(amp=\.\.\.\) expects torch\.bfloat16 or torch\.float16, got dtype "
            r"torch\.float8_e4m3fn.*only",
        ),
        ({"amp": torch.complex64}, ValueError, r"torch\.complex64 is not a floating-point"),
        ({"amp": "bf16"}, TypeError, r"warmup\(amp=\.\.\.\) expects an autocast_step"),
        ({"steps": "2"}, TypeError, r"warmup\(steps=\.\.\.\) expects an int >= 1, got str"),
        (
            {"loss_fn": "mse"},
            TypeError,
            r"loss_fn=\.\.\.\) expects a function called as.*two forms",
        ),
        ({"optimizer": "sgd"}, TypeError, r"Optimizer or None, got str"),
        ({"extra": 1}, TypeError, r"extra=\.\.\.\) expects a tuple"),
        ({"reserve": "lots"}, ValueError, r"reserve=\.\.\.\) expects a size such as '12GiB'"),
        ({"device": "gpu"}, DeviceError, r"did you mean"),
    ],
)
def test_bad_arguments_change_nothing(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    model = _net()
    model(torch.randn(4, 4)).sum().backward()  # grads the user owns
    before = _state(model)
    with pytest.raises(exc, match=match):
        warmup(model, _data(), **{"loss_fn": nn.CrossEntropyLoss(), **kwargs})
    assert _same(before, _state(model))


def test_a_generator_is_not_a_batch_and_is_not_consumed() -> None:
    model = _net()
    x, y = _data()
    taken: list[int] = []

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        taken.append(1)
        yield x, y

    gen = batches()
    before = _state(model)
    with pytest.raises(
        TypeError,
        match=r"warmup\(example_batch=\.\.\.\) expects one batch .*got generator.*"
        r"cudakit\.warmup\.example_batch\(loader\)",
    ):
        warmup(model, gen, loss_fn=nn.CrossEntropyLoss())
    assert taken == []
    assert _same(before, _state(model))


def test_a_loader_is_not_a_batch() -> None:
    model = _net()
    loader = DataLoader(TensorDataset(*_data()), batch_size=4, shuffle=True)
    before = _state(model)
    with pytest.raises(TypeError, match=r"expects one batch.*got DataLoader.*example_batch"):
        warmup(model, loader, loss_fn=nn.CrossEntropyLoss())
    assert _same(before, _state(model))


def test_a_meta_model_is_a_device_error() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(
        DeviceError, match=r"warmup\(model=\.\.\.\).*meta device \(weight, bias\).*to_empty"
    ):
        warmup(model, torch.randn(2, 4))
    assert model.weight.is_meta


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"extra": "sched"}, TypeError, r"preserve_state\(extra=\.\.\.\) expects a tuple"),
        ({"model": nn.LazyLinear(2)}, ValueError, r"lazy parameters"),
    ],
)
def test_preserve_state_errors_name_the_function(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        preserve_state(**kwargs)


def test_warmed_bad_steps_and_find_batch_size_bad_trial() -> None:
    with pytest.raises(TypeError, match=r"warmed\(steps=\.\.\.\) expects an int >= 1, got str"):
        warmed(model=nn.Linear(1, 1), steps="2")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"trial_fn=\.\.\.\) expects a function of the batch size"):
        find_batch_size("trial")  # type: ignore[call-overload]


# --------------------------------------------------------------------------- CPU memory


def test_cpu_report_has_the_peak_memory_report_measures() -> None:
    model = _net()
    report = warmup(model, _data(), loss_fn=nn.CrossEntropyLoss())
    assert report.peak_allocated is not None
    assert report.peak_allocated > 0
    assert "peak RSS of the process in one step" in str(report)
    assert "not measured" not in str(report).splitlines()[2]


# --------------------------------------------------------------------------- example_batch


def _loader(**kwargs: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(32.0)), batch_size=4, shuffle=True, **kwargs)


def _epoch(loader: DataLoader[Any]) -> list[list[float]]:
    return [b[0].tolist() for b in loader]


def test_example_batch_leaves_the_global_rng_as_it_was() -> None:
    loader = _loader()
    torch.manual_seed(7)
    random.seed(7)
    rng, py = torch.get_rng_state(), random.getstate()
    (x,) = example_batch(loader)
    assert x.shape == (4,)
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py


def test_warmup_with_example_batch_leaves_the_run_unchanged_end_to_end() -> None:
    def run(with_warmup: bool) -> tuple[list[list[float]], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        loader = _loader()
        if with_warmup:
            batch = example_batch(loader)
            warmup(model, batch[0][:, None], loss_fn=lambda m, x: m(x).mean())
        order = _epoch(loader)
        return order, model(torch.ones(1, 1)).detach()

    assert run(True)[0] == run(False)[0]
    assert torch.equal(run(True)[1], run(False)[1])


def test_next_iter_would_have_changed_the_run() -> None:
    """The friction example_batch removes: next(iter(loader)) moves the global RNG."""
    torch.manual_seed(0)
    loader = _loader()
    next(iter(loader))
    moved = _epoch(loader)
    torch.manual_seed(0)
    assert _epoch(_loader()) != moved


def test_example_batch_restores_the_loaders_own_generator() -> None:
    g = torch.Generator().manual_seed(3)
    loader = _loader(generator=g)
    state = g.get_state()
    example_batch(loader)
    assert torch.equal(g.get_state(), state)


def test_example_batch_takes_a_list_too() -> None:
    assert example_batch([1, 2]) == 1


@pytest.mark.parametrize(
    ("loader", "exc", "match"),
    [
        (
            iter([1, 2]),
            TypeError,
            r"example_batch\(loader=\.\.\.\) expects a re-iterable loader.*got list_iterator"
            r".*pass the DataLoader",
        ),
        (3, TypeError, r"example_batch\(loader=\.\.\.\) expects a DataLoader.*got int 3"),
        ([], ValueError, r"yields at least one batch, got list \[\].*drop_last"),
    ],
)
def test_example_batch_errors(loader: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        example_batch(loader)


def test_example_batch_does_not_consume_a_generator() -> None:
    items = iter(range(3))
    with pytest.raises(TypeError):
        example_batch(items)
    assert next(items) == 0


def test_models_are_not_copied_by_example_batch() -> None:
    model = _net()
    twin = copy.deepcopy(model)
    example_batch(_loader())
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"model": "net"},
            TypeError,
            r"^warmed\(model=\.\.\.\) expects a torch\.nn\.Module, got str 'net'\. Pass the module",
        ),
        (
            {"model": nn.Linear(1, 1), "optimizer": "sgd"},
            TypeError,
            r"^warmed\(optimizer=\.\.\.\) expects a torch\.optim\.Optimizer or None, got str 'sgd'",
        ),
        (
            {"model": nn.Linear(1, 1), "extra": 3},
            TypeError,
            r"^warmed\(extra=\.\.\.\) expects a tuple",
        ),
        (
            {"model": nn.LazyLinear(1)},
            ValueError,
            r"^warmed\(\) got a model with uninitialized lazy",
        ),
    ],
)
def test_warmed_errors_name_warmed(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        warmed(**kwargs)


def test_a_refused_warmed_changes_nothing() -> None:
    model = _net()
    before = _state(model)
    with pytest.raises(ValueError, match=r"warmed\(steps=\.\.\.\) expects an int >= 1, got int 0"):
        warmed(model=model, steps=0)
    assert _same(before, _state(model))


@pytest.mark.parametrize(
    ("spec", "exc", "match"),
    [
        ("lots", ValueError, r"^warmup\(reserve=\.\.\.\) expects a size.*got str 'lots'.*\"80%\""),
        ([1], TypeError, r"^warmup\(reserve=\.\.\.\) expects bytes.*got list \[1\]\. Pass bytes"),
        (
            2.0,
            ValueError,
            r"^warmup\(reserve=\.\.\.\) expects a finite number in \(0, 1\], got float 2\.0\. "
            r"A float",
        ),
    ],
)
def test_reserve_errors_name_warmup_and_change_nothing(
    spec: Any, exc: type[Exception], match: str
) -> None:
    model = _net()
    before = _state(model)
    with pytest.raises(exc, match=match):
        warmup(model, _data(), loss_fn=nn.CrossEntropyLoss(), reserve=spec)
    assert _same(before, _state(model))


def test_steps_error_shows_the_value_and_the_fix() -> None:
    with pytest.raises(
        TypeError, match=r"warmup\(steps=\.\.\.\) expects an int >= 1, got float 2\.5\. .*steps=2"
    ):
        warmup(nn.Linear(1, 1), torch.ones(1), steps=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"start": "32"},
            TypeError,
            r"start=\.\.\.\) expects an int >= 1, got str '32'\. .*e\.g\. start=32",
        ),
        (
            {"upper": 0},
            ValueError,
            r"upper=\.\.\.\) expects an int >= 1, got int 0\. Batch sizes count samples",
        ),
    ],
)
def test_find_batch_size_errors_say_the_fix(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    calls: list[int] = []
    with pytest.raises(exc, match=match):
        find_batch_size(calls.append, **kwargs)
    assert calls == []  # refused before any trial ran


def test_a_criterion_that_fails_gets_a_note_saying_how_it_was_called() -> None:
    def crit(output: torch.Tensor, target: Any) -> torch.Tensor:
        return output.no_such_method()  # type: ignore[attr-defined,no-any-return]

    with pytest.raises(AttributeError) as info:
        warmup(_net(), _data(), loss_fn=crit)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "This one was called as loss_fn(model(inputs), target)." in notes


# ----------------------------------------- example_batch with persistent workers


def _first_epoch(take_example: bool, wrap: bool = False) -> list[int]:
    from torch.utils.data import DataLoader, TensorDataset

    from cudakit.warmup import example_batch

    torch.manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.arange(32)),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
    )
    source: Any = loader
    if wrap:
        from cudakit import prefetch

        source = prefetch(loader, "cpu")
    if take_example:
        example_batch(source)
    order = [int(i) for (batch,) in source for i in batch]
    second = [int(i) for (batch,) in source for i in batch]
    return order + second


def test_example_batch_leaves_a_persistent_workers_loader_as_it_was() -> None:
    # The iterator example_batch made would be reused by the first epoch, which then
    # skips the draw of the workers' base seed and shuffles differently.
    assert _first_epoch(take_example=True) == _first_epoch(take_example=False)


def test_example_batch_through_prefetch_leaves_a_persistent_loader_as_it_was() -> None:
    assert _first_epoch(take_example=True, wrap=True) == _first_epoch(take_example=False, wrap=True)
