"""Every public call refuses an argument of the right kind but a wrong value with a clear
``ValueError`` (or cudakit's own subclass of it where the docs say so), and takes the
edge inputs that are not wrong.

The refused values: negative, zero where a positive number is needed, nan, inf, empty,
an unknown choice, out of range, a state that does not fit. Each row checks the
exception class, that the message names the function and the argument, shows what came,
says what is expected and hints at the fix, and that nothing the user owns changed (see
bad_inputs.py). The last tests take edge inputs that must work: empty batches and
containers, 0-dim tensors, ``pathlib.Path`` and ``str`` paths, ``torch.device``,
``"cpu"`` and ints for devices.
"""

from __future__ import annotations

import collections
import datetime
import importlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from bad_inputs import UNSET, Bad, World, check_refused, row_id
from torch import nn

import cudakit
from cudakit import DeviceError, amp, data, parallel

warmup_pkg = importlib.import_module("cudakit.warmup")
demo = importlib.import_module("cudakit.demo")
policy = importlib.import_module("cudakit.amp.policy")

torch.set_num_threads(1)

NAN, INF = math.nan, math.inf
_Call = Callable[..., object]


def _rows(
    func: str,
    call: _Call,
    table: list[tuple[str, Any]],
    exc: type[BaseException] = ValueError,
    **extra: Any,
) -> list[Bad]:
    """Rows for ``call(world, **{arg: value})``, one per ``(arg, value)`` in ``table``."""
    return [
        Bad(func, arg, value, exc, lambda w, c=call, a=arg, v=value: c(w, **{a: v}), **extra)
        for arg, value in table
    ]


def _one(
    func: str,
    arg: str,
    value: Any,
    call: Callable[[World], object],
    exc: type[BaseException] = ValueError,
    **extra: Any,
) -> Bad:
    return Bad(func, arg, value, exc, call, **extra)


def _autocast_step(w: World, **kw: Any) -> object:
    return cudakit.autocast_step(w.optimizer, model=w.model, **kw)


def _checkpointer(w: World, **kw: Any) -> object:
    kw = {"model": w.model, "optimizer": w.optimizer, "directory": w.tmp / "ckpt", **kw}
    return cudakit.Checkpointer(**kw)


def _warmup(w: World, **kw: Any) -> object:
    kw.setdefault("loss_fn", lambda model, batch: model(batch[0]).square().mean())
    return cudakit.warmup(w.model, w.batch, **kw)


def _choose(w: World, **kw: Any) -> object:
    return cudakit.choose_strategy(**{"env": {}, "device_count": 0, "device_type": "cpu", **kw})


def _loader(w: World, **kw: Any) -> object:
    return cudakit.distributed_loader(w.dataset, **kw)


def _speed(w: World, **kw: Any) -> object:
    return cudakit.speed_report(**{"file": None, **kw})


def _mismatched_state(w: World) -> dict[str, torch.Tensor]:
    """The model's state dict with its last bias one longer: the other tensors fit."""
    state = {k: torch.full_like(v, 7.0) for k, v in w.model.state_dict().items()}
    state["2.bias"] = torch.zeros(3)
    return state


ROWS: list[Any] = [
    # ----------------------------------------------------------------- autocast_step
    *_rows(
        "autocast_step(",
        _autocast_step,
        [
            ("dtype", "float16x"),
            ("dtype", torch.int32),
            ("max_grad_norm", -1.0),
            ("max_grad_norm", 0),
            ("max_grad_norm", NAN),
            ("max_grad_norm", INF),
            ("accumulate", 0),
            ("accumulate", -1),
            ("max_skipped", 0),
            ("max_skipped", -1),
            ("skip_spikes", "maybe"),
        ],
    ),
    _one(
        "autocast_step(",
        "compile",
        {"mode": "bogus"},
        lambda w: _autocast_step(w, compile={"mode": "bogus"}),
        shown="'bogus'",
        note="unknown-mode",
    ),
    _one(
        "autocast_step(",
        "compile",
        {"bad": 1},
        lambda w: _autocast_step(w, compile={"bad": 1}),
        shown="['bad']",
        note="unknown-option",
    ),
    _one("autocast_step(", "optimizer", [], lambda w: cudakit.autocast_step([]), shown="list"),
    _one(
        "autocast_step(",
        "optimizer",
        UNSET,
        lambda w: cudakit.autocast_step([w.optimizer, w.optimizer]),
        note="twice",
    ),
    *[
        _one(
            "AutocastStep.backward(",
            "loss",
            UNSET,
            lambda w, make=make: w.step.backward(make(w)),
            uses=("step",),
            note=note,
        )
        for note, make in (
            ("not-scalar", lambda w: w.model[0].weight * 2),
            ("no-grad", lambda w: torch.tensor(1.0)),
        )
    ],
    *[
        _one(
            "AutocastStep.accumulate = ",
            "accumulate",
            v,
            lambda w, v=v: setattr(w.step, "accumulate", v),
            uses=("step",),
        )
        for v in (0, -2)
    ],
    _one(
        "AutocastStep.max_skipped = ",
        "max_skipped",
        0,
        lambda w: setattr(w.step, "max_skipped", 0),
        uses=("step",),
    ),
    *[
        _one(
            "AutocastStep.load_state_dict(",
            "state",
            v,
            lambda w, v=v: w.step.load_state_dict(v),
            uses=("step",),
            shown="missing",
            note=note,
        )
        for note, v in (("empty", {}), ("unknown-keys", {"bogus": 1}))
    ],
    *[
        _one(
            "AutocastStep.load_state_dict(",
            f"state['{key}']",
            bad,
            lambda w, key=key, bad=bad: w.step.load_state_dict({**w.step.state_dict(), key: bad}),
            uses=("step",),
            note=f"{key}-{bad}",
        )
        for key, bad in (("accumulate", 0), ("position", -1), ("steps", -1), ("skipped_steps", -3))
    ],
    *_rows(
        "SpikeRule(",
        lambda w, **kw: amp.SpikeRule(**kw),
        [
            ("on", "bogus"),
            ("z", -1.0),
            ("z", 0),
            ("z", NAN),
            ("ratio", 0.5),
            ("ratio", INF),
            ("warmup", -1),
            ("warmup", 1),
            ("decay", 1.5),
            ("decay", 0),
            ("decay", 1.0),
            ("decay", NAN),
        ],
    ),
    _one("SpikeRule(", "on", (), lambda w: amp.SpikeRule(on=()), shown="empty", note="empty"),
    _one(
        "SpikeRule(", "z", None, lambda w: amp.SpikeRule(z=None, ratio=None), note="and-ratio-None"
    ),
    # ---------------------------------------------------------- cudakit.amp.policy
    *[
        _one(
            "decide_precision(",
            arg,
            v,
            lambda w, a=arg, v=v: policy.decide_precision(
                **{
                    "requested": None,
                    "device_type": "cpu",
                    "enabled": True,
                    "user_scaler": False,
                    "caps": policy.Capabilities(),
                    a: v,
                }
            ),
            note=note,
        )
        for arg, v, note in (
            ("requested", torch.int8, "int8"),
            ("requested", torch.float64, "float64"),
            ("device_type", "gpu", "gpu"),
        )
    ],
    _one("probe_capabilities(", "device_type", "gpu", lambda w: policy.probe_capabilities("gpu")),
    _one(
        "check_autocast(",
        "device_type",
        "gpu",
        lambda w: policy.check_autocast("gpu", torch.bfloat16, True),
    ),
    _one(
        "autocast_step(",
        "dtype",
        torch.int32,
        lambda w: policy.check_autocast("cpu", torch.int32, True),
        note="check_autocast-int32",
    ),
    *[
        _one(
            "autocast_step(",
            "dtype",
            v,
            lambda w, v=v: policy.parse_dtype(v),
            note=f"parse_dtype-{v}",
        )
        for v in ("bf17", torch.int32, "bf16-true")
    ],
    # ------------------------------------------------------------------ Checkpointer
    *_rows(
        "Checkpointer(",
        _checkpointer,
        [
            ("directory", ""),
            ("keep", 0),
            ("keep", -1),
            ("every", 0),
            ("exit_code", -1),
            ("exit_code", 256),
            ("preemption", "bogus"),
            ("preemption", ["KILL"]),
            ("preemption", "SIGSTOP"),
        ],
    ),
    _one(
        "Checkpointer(",
        "model",
        {"a.b": nn.Linear(1, 1)},
        lambda w: _checkpointer(w, model={"a.b": w.model}),
        shown="'a.b'",
        note="dotted-name",
    ),
    _one(
        "Checkpointer(",
        "step",
        UNSET,
        lambda w: _checkpointer(w, step=[w.step, w.step]),
        note="twice",
        uses=("step",),
    ),
    _one(
        "Checkpointer.epochs(",
        "stop",
        -1,
        lambda w: list(w.checkpointer.epochs(-1)),
        uses=("checkpointer",),
    ),
    _one(
        "Checkpointer.load(", "path", "", lambda w: w.checkpointer.load(""), uses=("checkpointer",)
    ),
    _one("find_latest(", "directory", "", lambda w: cudakit.find_latest("")),
    # ------------------------------------------------------------------ speed_report
    *_rows(
        "speed_report(",
        _speed,
        [
            ("samples", -1),
            ("samples", NAN),
            ("samples", INF),
            ("tokens", -1),
            ("tokens", NAN),
            ("flops", -1),
            ("flops", INF),
            ("accumulate", 0),
            ("accumulate", -1),
            ("every", 0),
            ("every", -1),
            ("window", 0),
            ("dtype", "bf17"),
            ("dtype", torch.int32),
            ("peak_tflops", 0),
            ("peak_tflops", -1),
            ("peak_tflops", NAN),
            ("peak_tflops", INF),
        ],
    ),
    *_rows(
        "speed_report(",
        _speed,
        [("device", "gpu"), ("device", -1), ("device", "cuda:x")],
        exc=DeviceError,
    ),
    *[
        _one(
            "speed_report(",
            arg,
            v,
            lambda w, a=arg, v=v: cudakit.speed_report(file=None).measure(**{a: v}),
            shown=shown,
            note=f"measure-{note}",
        )
        for arg, v, shown, note in (
            ("samples", -1, "-1", "neg"),
            ("tokens", NAN, "nan", "nan"),
            ("samples", torch.tensor([3, 4]), "shape (2,)", "tensor"),
        )
    ],
    # ----------------------------------------------------------------- memory_report
    *_rows(
        "memory_report(",
        lambda w, **kw: cudakit.memory_report(**{"file": None, **kw}),
        [("every", 0), ("every", -1), ("stacks", "py"), ("record_history", "")],
    ),
    _one(
        "memory_report(",
        "stacks",
        "all",
        lambda w: cudakit.memory_report(file=None, stacks="all"),
        note="without-record_history",
    ),
    *_rows(
        "memory_report(",
        lambda w, **kw: cudakit.memory_report(**{"file": None, **kw}),
        [("device", "gpu"), ("device", -1), ("device", "ALL")],
        exc=DeviceError,
    ),
    *[
        _one(
            "memory_snapshot(", "device", v, lambda w, v=v: cudakit.memory_snapshot(v), DeviceError
        )
        for v in ("gpu", -1)
    ],
    *[
        _one(
            "MemoryReport.from_json(",
            "text",
            v,
            lambda w, v=v: cudakit.MemoryReport.from_json(v),
            shown=shown,
            note=note,
        )
        for v, shown, note in (
            ("{", "not JSON", "not-json"),
            (b'{"label": "\xff"}', "not UTF-8", "not-utf8"),
        )
    ],
    _one(
        "MemoryReport.from_dict(",
        "data",
        {},
        lambda w: cudakit.MemoryReport.from_dict({}),
        shown="missing",
    ),
    _one(
        "MemoryReport.from_dict(",  # from_json reads the text, from_dict the fields
        "data",
        UNSET,
        lambda w: cudakit.MemoryReport.from_json('{"label": "x"}'),
        shown="is missing",
        note="from_json-missing-fields",
    ),
    _one(
        "DeviceInfo.to_json(",
        "indent",
        -1,
        lambda w: cudakit.device_info().to_json(indent=-1),
    ),
    # ------------------------------------------------------------------- parallel
    *_rows(
        "parallelize(",
        lambda w, **kw: cudakit.parallelize(w.model, **kw),
        [
            ("strategy", "fsdp2"),
            ("strategy", "DP"),
            ("backend", "mpi2"),
            ("backend", ""),
            ("timeout", 0),
            ("timeout", -1),
            ("timeout", INF),
            ("timeout", NAN),
        ],
    ),
    *[
        _one(
            "parallelize(",
            "timeout",
            v,
            lambda w, v=v: cudakit.parallelize(w.model, timeout=v),
            note=f"timedelta-{v.days}-days",
        )
        for v in (datetime.timedelta(0), datetime.timedelta(days=400))
    ],
    *_rows(
        "parallelize(",
        lambda w, **kw: cudakit.parallelize(w.model, **kw),
        [("device", -1), ("device", "gpu")],
        exc=DeviceError,
    ),
    *_rows(
        "process_group(",
        lambda w, **kw: cudakit.process_group(**kw),
        [("backend", "bogus"), ("timeout", -1), ("timeout", 0)],
    ),
    _one(
        "process_group(",
        "device",
        "gpu",
        lambda w: cudakit.process_group(device="gpu"),
        DeviceError,
    ),
    *_rows(
        "choose_strategy(",
        _choose,
        [
            ("strategy", "bogus"),
            ("device_count", -1),
            ("device_type", "gpu"),
            ("device_type", ""),
            ("group_world_size", 0),
        ],
    ),
    *_rows(
        "distributed_loader(",
        _loader,
        [
            ("batch_size", 0),
            ("batch_size", -1),
            ("num_workers", -1),
            ("seed", 2**64),
        ],
    ),
    *[
        _one(
            "distributed_loader(",
            arg,
            v,
            lambda w, a=arg, v=v: _loader(w, **{a: v}),
            note=f"{arg}-DataLoader",
        )
        for arg, v in (("prefetch_factor", 0), ("timeout", -1), ("persistent_workers", True))
    ],
    _one(
        "distributed_loader(",
        "drop_last",
        True,
        lambda w: _loader(w, batch_size=None, drop_last=True),
        note="without-batch_size",
    ),
    _one(
        "DistributedLoader.set_epoch(",
        "epoch",
        -1,
        lambda w: cudakit.distributed_loader(w.dataset).set_epoch(-1),
    ),
    *_rows(
        "launch(",
        lambda w, **kw: cudakit.launch(print, **{"nprocs": 1, **kw}),
        [
            ("nprocs", 0),
            ("nprocs", -1),
            ("timeout", 0),
            ("timeout", -1),
            ("timeout", NAN),
            ("timeout", INF),
            ("start_method", "thread"),
        ],
    ),
    _one(
        "load_state_dict(",
        "state",
        UNSET,
        lambda w: parallel.load_state_dict(w.model, _mismatched_state(w)),
        note="one-shape-differs",
    ),
    _one(
        "load_state_dict(",
        "state",
        UNSET,
        lambda w: parallel.load_state_dict(w.model, {"0.weight": torch.zeros(8, 4)}),
        note="missing-keys",
    ),
    _one(
        "load_state_dict(",
        "state",
        UNSET,
        lambda w: parallel.load_state_dict(
            w.model, {**w.model.state_dict(), "extra.weight": torch.zeros(1)}
        ),
        note="unexpected-key",
    ),
    _one(
        "load_state_dict(",
        "state",
        UNSET,
        lambda w: parallel.load_state_dict(w.model, _mismatched_state(w), strict=False),
        note="shape-not-strict",
    ),
    # ------------------------------------------------------------- device and data
    *[
        _one("resolve_device(", "spec", v, lambda w, v=v: cudakit.resolve_device(v), DeviceError)
        for v in ("gpu", "cuda:x", -1, "CPU", "xla")
    ],
    *_rows(
        "on_device(",
        lambda w, **kw: cudakit.on_device(w.batch, **kw),
        [("device", "gpu"), ("device", -1)],
        exc=DeviceError,
    ),
    *[
        _one(
            "register_container(",
            "cls",
            c,
            lambda w, c=c: cudakit.register_container(c),
            note=c.__name__,
        )
        for c in (list, dict, torch.Tensor)
    ],
    _one(
        "loader_kwargs(",
        "num_workers",
        -1,
        lambda w: cudakit.loader_kwargs(num_workers=-1),
    ),
    _one(
        "loader_kwargs(",
        "persistent_workers",
        True,
        lambda w: cudakit.loader_kwargs(num_workers=0, persistent_workers=True),
        note="without-workers",
    ),
    _one("loader_kwargs(", "device", "gpu", lambda w: cudakit.loader_kwargs("gpu"), DeviceError),
    *[
        _one("prefetch(", "depth", v, lambda w, v=v: cudakit.prefetch([w.batch], depth=v))
        for v in (0, -1)
    ],
    _one(
        "prefetch(",
        "device",
        "gpu",
        lambda w: cudakit.prefetch([w.batch], device="gpu"),
        DeviceError,
    ),
    _one(
        "set_epoch(",
        "epoch",
        -1,
        lambda w: cudakit.prefetch([w.batch]).set_epoch(-1),
    ),
    _one(
        "Prefetcher(",
        "depth",
        0,
        lambda w: data.Prefetcher([w.batch], torch.device("cpu"), 0),
    ),
    # -------------------------------------------------------------------- warm-up
    *_rows(
        "warmup(",
        _warmup,
        [
            ("steps", 0),
            ("steps", -1),
            ("reserve", -1),
            ("reserve", 0),
            ("reserve", NAN),
            ("reserve", INF),
            ("reserve", 2.0),
            ("reserve", "lots"),
            ("reserve", "0%"),
            ("reserve", "150%"),
            ("reserve", "-5GB"),
        ],
    ),
    _one("warmup(", "device", "gpu", lambda w: _warmup(w, device="gpu"), DeviceError),
    _one("warmup(", "device", "meta", lambda w: _warmup(w, device="meta"), DeviceError),
    _one(
        "warmup(",
        "model",
        None,
        lambda w: cudakit.warmup(None, w.batch),
        shown="no model",
        note="None-with-a-batch",
    ),
    _one(
        "warmup(",
        "loss_fn",
        UNSET,
        lambda w: cudakit.warmup(w.model, w.batch, loss_fn=lambda model, batch: model(batch[0])),
        shown="shape (6, 2)",
        note="not-scalar",
    ),
    *_rows(
        "find_batch_size(",
        lambda w, **kw: cudakit.find_batch_size(lambda n: None, **kw),
        [
            ("start", 0),
            ("start", -1),
            ("lower", 0),
            ("upper", 0),
            ("multiple_of", 0),
            ("margin", -0.1),
            ("margin", 1.0),
            ("margin", NAN),
        ],
    ),
    _one(
        "find_batch_size(",
        "upper",
        4,
        lambda w: cudakit.find_batch_size(lambda n: None, lower=8, upper=4),
        note="below-lower",
    ),
    _one("warmed(", "steps", 0, lambda w: cudakit.warmed(model=w.model, steps=0)),
    _one(
        "preserve_state(",
        "model",
        UNSET,
        lambda w: cudakit.preserve_state(nn.LazyLinear(2)),
        note="lazy",
    ),
    _one("example_batch(", "loader", [], lambda w: warmup_pkg.example_batch([])),
    # ------------------------------------------------------------------------ demo
    *_rows(
        "make_dataset(",
        lambda w, **kw: demo.make_dataset(**{"n": 4, **kw}),
        # split: a ValueError for any bad value, its tested contract (tests/cli).
        [
            ("n", 0),
            ("n", -1),
            ("seed", 2**63),
            ("split", "bogus"),
            ("split", 3),
        ],
    ),
    *_rows("make_model(", lambda w, **kw: demo.make_model(**kw), [("width", 0), ("width", -1)]),
]


def _row_ids(rows: list[Any]) -> list[str]:
    return [row_id(r.values[0] if hasattr(r, "values") else r) for r in rows]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


@pytest.mark.parametrize("row", ROWS, ids=_row_ids(ROWS))
def test_a_wrong_value_is_a_clear_value_error_that_changes_nothing(row: Bad, world: World) -> None:
    check_refused(row, world)


def test_the_ids_are_unique() -> None:
    ids = _row_ids(ROWS)
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_a_refused_state_dict_is_a_runtime_error_too_as_torchs_is(world: World) -> None:
    with pytest.raises(RuntimeError, match=r"size mismatch for 2\.bias"):
        parallel.load_state_dict(world.model, _mismatched_state(world))


def test_a_state_dict_that_fits_still_loads_and_reports_its_keys(world: World) -> None:
    source = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    result = parallel.load_state_dict(world.model, source.state_dict())
    assert result == parallel.LoadResult([], [])
    for mine, theirs in zip(
        world.model.state_dict().values(), source.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs)
    partial = {"0.weight": torch.ones(8, 4)}
    result = parallel.load_state_dict(world.model, partial, strict=False)
    assert "0.bias" in result.missing_keys
    assert torch.equal(world.model[0].weight, torch.ones(8, 4))


# ------------------------------------------------------- edge inputs that must work


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize(
    "batch",
    [
        [],
        {},
        (),
        collections.OrderedDict(),
        collections.defaultdict(list),
        Pair(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
        torch.tensor(3.0),
        torch.zeros(0, 3),
        {"scalar": torch.tensor(1), "empty": torch.empty(0), "n": np.int64(2), "s": "text"},
        np.float32(1.5),
        None,
    ],
    ids=[
        "list",
        "dict",
        "tuple",
        "OrderedDict",
        "defaultdict",
        "namedtuple-empty-rows",
        "0-dim",
        "0-rows",
        "mixed",
        "numpy-scalar",
        "None",
    ],
)
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "auto", None])
def test_on_device_takes_empty_and_0_dim_batches(batch: Any, device: Any) -> None:
    moved = cudakit.on_device(batch, device=device)
    assert type(moved) is type(batch)
    if isinstance(batch, torch.Tensor):
        assert torch.equal(moved, batch)
        assert moved.shape == batch.shape


def test_prefetch_takes_an_empty_loader_and_0_dim_batches() -> None:
    assert list(cudakit.prefetch([], device="cpu")) == []
    (got,) = cudakit.prefetch([torch.tensor(2.0)], device=torch.device("cpu"))
    assert got.shape == ()
    assert got.item() == 2.0


@pytest.mark.parametrize("as_path", [str, Path], ids=["str", "Path"])
def test_checkpoint_paths_may_be_str_or_pathlib(
    as_path: Callable[[Any], Any], world: World
) -> None:
    root = as_path(world.tmp / "run")
    assert cudakit.find_latest(root) is None  # no such folder yet: nothing to resume
    ckpt = cudakit.Checkpointer(
        root, model=world.model, optimizer=world.optimizer, preemption=False
    )
    try:
        saved = ckpt.save()
        ckpt.wait()
    finally:
        ckpt.close()
    assert saved is not None
    assert cudakit.find_latest(root) == saved
    again = cudakit.Checkpointer(
        root, model=world.model, optimizer=world.optimizer, preemption=False
    )
    try:
        assert again.load(as_path(saved)).batch == 0
    finally:
        again.close()


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu"), "cpu:0", "auto", None])
def test_a_device_may_be_given_as_str_torch_device_or_none(spec: Any) -> None:
    expected = (
        torch.device("cpu") if not torch.cuda.is_available() or spec not in ("auto", None) else None
    )
    got = cudakit.resolve_device(spec)
    if expected is not None:
        assert got == expected
    assert cudakit.memory_snapshot(spec).device == str(got)
    assert cudakit.loader_kwargs(spec)["num_workers"] >= 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the int is a CUDA index")
@pytest.mark.parametrize("spec", [0, np.int64(0)], ids=["int", "numpy-int"])
def test_an_int_device_is_a_cuda_index_refused_without_cuda(spec: Any) -> None:
    with pytest.raises(DeviceError, match=r"^resolve_device\(spec=.*CUDA is not available"):
        cudakit.resolve_device(spec)


def test_speed_and_memory_reports_take_counts_of_zero_and_empty_batches() -> None:
    meter = cudakit.speed_report(file=None, samples=len, every=None)
    with meter.measure(torch.zeros(0, 3)):
        pass
    with meter.measure([], samples=0, tokens=np.int64(0)):
        pass
    assert meter.calls == 2
    reporter = cudakit.memory_report("empty", file=None, device=torch.device("cpu"))
    with reporter:
        pass
    assert reporter.calls == 1


def test_warmup_takes_a_numpy_batch_size_search_and_0_dim_loss() -> None:
    model = nn.Linear(1, 1)
    report = cudakit.warmup(
        model, torch.ones(2, 1), loss_fn=lambda m, x: m(x).sum(), steps=np.int64(1)
    )
    assert report.steps == 1
    size = cudakit.find_batch_size(
        lambda n: (
            None if n <= 8 else (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
        ),
        start=np.int64(2),
        upper=np.int64(64),
    )
    assert size == 8
    assert type(size) is int
