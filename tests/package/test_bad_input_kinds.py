"""Every public call refuses an argument of the wrong kind with a clear ``TypeError``.

One row per argument and wrong kind: a str, float or bool where an int is expected
(``True`` as a count is a mistake), None where it is not allowed, a list where a module
or tensor is expected, a class where an instance is. Each row checks the exception
class, that the message names the function and the argument, shows what came, says what
is expected and hints at the fix, and that nothing the user owns changed (see
bad_inputs.py). NumPy integers are ints: the last tables check that they are taken
wherever an int is.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bad_inputs import UNSET, Bad, World, check_refused, row_id
from torch import nn

import cudakit
from cudakit import amp, checkpoint, data, device, memory, parallel, speed

warmup_pkg = importlib.import_module("cudakit.warmup")
oom = importlib.import_module("cudakit._oom")
policy = importlib.import_module("cudakit.amp.policy")
info = importlib.import_module("cudakit.info")
demo = importlib.import_module("cudakit.demo")

torch.set_num_threads(1)

_Call = Callable[..., object]


def _rows(func: str, call: _Call, table: list[tuple[str, Any]], **extra: Any) -> list[Bad]:
    """Rows for ``call(world, **{arg: value})``, one per ``(arg, value)`` in ``table``."""
    return [
        Bad(func, arg, value, TypeError, lambda w, c=call, a=arg, v=value: c(w, **{a: v}), **extra)
        for arg, value in table
    ]


def _one(func: str, arg: str, value: Any, call: Callable[[World], object], **extra: Any) -> Bad:
    return Bad(func, arg, value, TypeError, call, **extra)


def _autocast_step(w: World, **kw: Any) -> object:
    kw.setdefault("model", w.model)
    return cudakit.autocast_step(w.optimizer, **kw)


def _checkpointer(w: World, **kw: Any) -> object:
    kw.setdefault("model", w.model)
    kw.setdefault("optimizer", w.optimizer)
    kw.setdefault("directory", w.tmp / "ckpt")
    return cudakit.Checkpointer(**kw)


def _warmup(w: World, **kw: Any) -> object:
    kw.setdefault("loss_fn", lambda model, batch: model(batch[0]).square().mean())
    return cudakit.warmup(w.model, w.batch, **kw)


def _find_batch_size(w: World, **kw: Any) -> object:
    return cudakit.find_batch_size(lambda n: None, **kw)


def _choose(w: World, **kw: Any) -> object:
    kw = {"env": {}, "device_count": 0, "device_type": "cpu", **kw}
    return cudakit.choose_strategy(**kw)


def _loader(w: World, **kw: Any) -> object:
    return cudakit.distributed_loader(w.dataset, **kw)


def _launch(w: World, **kw: Any) -> object:
    kw = {"nprocs": 1, **kw}
    return cudakit.launch(print, **kw)


def _preserve(w: World, **kw: Any) -> object:
    kw = {"model": w.model, "optimizer": w.optimizer, **kw}
    with cudakit.preserve_state(**kw):
        pass
    return None


def _memory_reporter(w: World) -> Any:
    return cudakit.memory_report("block", file=None)


def _speed(w: World, **kw: Any) -> object:
    return cudakit.speed_report(**{"file": None, **kw})


_STREAM = io.StringIO()

ROWS: list[Bad] = [
    # ----------------------------------------------------------------- autocast_step
    *_rows(
        "autocast_step(",
        _autocast_step,
        [
            ("model", "model"),
            ("model", [nn.Linear(1, 1)]),
            ("dtype", 16),
            ("dtype", None),
            ("enabled", "yes"),
            ("enabled", 1),
            ("enabled", None),
            ("scaler", "fp16"),
            ("max_grad_norm", "1.0"),
            ("max_grad_norm", True),
            ("accumulate", "4"),
            ("accumulate", 4.0),
            ("accumulate", True),
            ("accumulate", None),
            ("scheduler", 3),
            ("skip_nonfinite", "no"),
            ("skip_nonfinite", None),
            ("max_skipped", 2.5),
            ("max_skipped", True),
            ("max_skipped", "3"),
            ("compile", "yes"),
            ("compile", 1),
            ("compile", None),
            ("skip_spikes", 1),
            ("skip_spikes", 2.5),
            ("locate_nonfinite", "yes"),
            ("locate_nonfinite", 1),
        ],
    ),
    *[
        _one("autocast_step(", "optimizer", v, lambda w, v=v: cudakit.autocast_step(v))
        for v in (None, "adam", 3, nn.Linear(1, 1))
    ],
    *[
        _one(
            "autocast_step(",
            "optimizer",
            v,
            lambda w, v=v: amp.AutocastStep(v),
            note=f"class-{type(v).__name__}",
        )
        for v in (None, "adam")
    ],
    *[
        _one(
            "AutocastStep.backward(",
            "loss",
            v,
            lambda w, v=v: w.step.backward(v),
            uses=("step",),
            shown=shown,
        )
        for v, shown in (
            (3, None),
            ("loss", None),
            (None, None),
            (1.5, None),
            ([1.0], "float 1.0"),  # the loss inside the list
            (torch.tensor(1), "torch.int64"),
        )
    ],
    *[
        _one(
            "AutocastStep.load_state_dict(",
            "state",
            v,
            lambda w, v=v: w.step.load_state_dict(v),
            uses=("step",),
        )
        for v in (None, 3, [], "state")
    ],
    *[
        _one(
            "AutocastStep.load_state_dict(",
            f"state['{key}']",
            bad,
            lambda w, key=key, bad=bad: w.step.load_state_dict({**w.step.state_dict(), key: bad}),
            uses=("step",),
            note=f"{key}-{type(bad).__name__}",
        )
        for key, bad in (
            ("accumulate", "2"),
            ("position", 1.5),
            ("steps", True),
            ("window_losses", 3),
            ("window_weight", "w"),
            ("window_buffers", "x"),
            ("window_buffers", [1, 2]),
            ("spike_stats", 3),
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
        for v in ("2", True, 2.0)
    ],
    *[
        _one(
            "AutocastStep.max_skipped = ",
            "max_skipped",
            v,
            lambda w, v=v: setattr(w.step, "max_skipped", v),
            uses=("step",),
        )
        for v in ("2", True, 2.0)
    ],
    *_rows(
        "SpikeRule(",
        lambda w, **kw: amp.SpikeRule(**kw),
        [
            ("on", 3),
            ("z", "6"),
            ("z", True),
            ("ratio", "2"),
            ("warmup", 1.5),
            ("warmup", True),
            ("decay", "0.9"),
        ],
    ),
    *[
        _one("find_nonfinite(", "fn", v, lambda w, v=v: amp.find_nonfinite(v))
        for v in (3, None, "loss")
    ],
    _one("Verdict(", "flag", "x", lambda w: amp.Verdict("x", skipped=False)),  # type: ignore[arg-type]
    _one(
        "Verdict(",
        "skipped",
        "no",
        lambda w: amp.Verdict(torch.tensor(False), skipped="no"),  # type: ignore[arg-type]
    ),
    # ---------------------------------------------------------- cudakit.amp.policy
    *_rows(
        "decide_precision(",
        lambda w, **kw: policy.decide_precision(
            **{
                "requested": None,
                "device_type": "cpu",
                "enabled": True,
                "user_scaler": False,
                "caps": policy.Capabilities(),
                **kw,
            }
        ),
        [
            ("requested", "bf16"),
            ("device_type", 3),
            ("enabled", "y"),
            ("user_scaler", 1),
            ("caps", None),
            ("caps", {"cuda_bf16": True}),
        ],
    ),
    *[
        _one("probe_capabilities(", "device_type", v, lambda w, v=v: policy.probe_capabilities(v))
        for v in (3, None)
    ],
    *_rows(
        "check_autocast(",
        lambda w, **kw: policy.check_autocast(
            **{"device_type": "cpu", "dtype": torch.bfloat16, "enabled": True, **kw}
        ),
        [("device_type", 3), ("dtype", "bf16"), ("enabled", "yes")],
    ),
    *_rows(
        "log_choice(",
        lambda w, **kw: policy.log_choice(
            **{
                "device_type": "cpu",
                "precision": policy.decide_precision(
                    None, "cpu", enabled=True, user_scaler=False, caps=policy.Capabilities()
                ),
                **kw,
            }
        ),
        [("device_type", 3), ("precision", 3)],
    ),
    *[
        _one(
            "autocast_step(",
            "dtype",
            v,
            lambda w, v=v: policy.parse_dtype(v),
            note=f"parse_dtype-{type(v).__name__}",
        )
        for v in (3, None)
    ],
    # ------------------------------------------------------------------ Checkpointer
    *_rows(
        "Checkpointer(",
        _checkpointer,
        [
            ("directory", 3),
            ("directory", None),
            ("directory", b"ckpt"),
            ("directory", ["ckpt"]),
            ("model", "model"),
            ("model", [nn.Linear(1, 1)]),
            ("optimizer", "adam"),
            ("optimizer", nn.Linear(1, 1)),
            ("scheduler", 3),
            ("scheduler", torch.optim.lr_scheduler.StepLR),
            ("loader", 3),
            ("loader", iter([1, 2])),
            ("loader", "data/train"),
            ("extra", 3),
            ("extra", "ema"),
            ("extra", [3]),
            ("step", 3),
            ("keep", "2"),
            ("keep", 1.5),
            ("keep", True),
            ("every", True),
            ("every", 2.0),
            ("async_save", "yes"),
            ("async_save", None),
            ("async_save", 1),
            ("preemption", 3),
            ("preemption", None),
            ("exit_code", 1.0),
            ("exit_code", True),
            ("exit_code", "1"),
            ("requeue", "yes"),
            ("requeue", None),
            ("requeue", 1),
            ("safe_globals", "Config"),
            ("safe_globals", 3),
            ("safe_globals", [3]),
            ("trust_pickles", "yes"),
            ("trust_pickles", None),
        ],
    ),
    *[
        _one(
            "Checkpointer.load(",
            "path",
            v,
            lambda w, v=v: w.checkpointer.load(v),
            uses=("checkpointer",),
        )
        for v in (3, None, b"ckpt")
    ],
    *[
        _one(
            "Checkpointer.epochs(",
            "stop",
            v,
            # A generator: its checks run at the first next(), which `for` makes at once.
            lambda w, v=v: list(w.checkpointer.epochs(v)),
            uses=("checkpointer",),
        )
        for v in ("3", 1.5, True, None)
    ],
    *[
        _one(
            "Checkpointer.batches(",
            "loader",
            v,
            lambda w, v=v: next(iter(w.checkpointer.batches(v))),
            uses=("checkpointer",),
        )
        for v in (3, iter([1]), "data/train")
    ],
    *[
        _one("find_latest(", "directory", v, lambda w, v=v: cudakit.find_latest(v))
        for v in (3, None, b"ckpt")
    ],
    # ------------------------------------------------------------------ speed_report
    *_rows(
        "speed_report(",
        _speed,
        [
            ("label", 3),
            ("samples", "64"),
            ("samples", [1]),
            ("samples", True),
            ("tokens", True),
            ("tokens", "n"),
            ("flops", "x"),
            ("flops", True),
            ("accumulate", "2"),
            ("accumulate", True),
            ("accumulate", 1.5),
            ("step", 3),
            ("dtype", 16),
            ("peak_tflops", "1"),
            ("peak_tflops", True),
            ("device", 2.5),
            ("device", True),
            ("every", 1.5),
            ("every", True),
            ("window", None),
            ("window", 1.5),
            ("window", True),
            ("file", "stderr"),
            ("file", 3),
            ("file", io.BytesIO()),
            ("log", "x"),
            ("log", 3),
            ("log", True),
            ("combine", "yes"),
            ("combine", None),
            ("combine", 1),
        ],
    ),
    *[
        _one(
            "speed_report(",
            arg,
            v,
            lambda w, a=arg, v=v: cudakit.speed_report(file=None).measure(**{a: v}),
            note=f"measure-{type(v).__name__}",
        )
        for arg, v in (("samples", "x"), ("tokens", True), ("samples", [3]))
    ],
    *_rows(
        "count_flops(",
        lambda w, fn=lambda: None, **kw: speed.count_flops(fn, **kw),
        [("fn", 3), ("model", 3), ("optimizer", 3), ("extra", 3)],
    ),
    _one("lookup_peak(", "name", 3, lambda w: speed.lookup_peak(3, "bf16")),  # type: ignore[arg-type]
    _one("lookup_peak(", "dtype", 3, lambda w: speed.lookup_peak("NVIDIA H100", 3)),
    # ----------------------------------------------------------------- memory_report
    *_rows(
        "memory_report(",
        lambda w, **kw: cudakit.memory_report(**{"file": None, **kw}),
        [
            ("label", 3),
            ("device", 1.5),
            ("device", True),
            ("file", "x"),
            ("file", 3),
            ("file", io.BytesIO()),
            ("log", "x"),
            ("log", 3),
            ("log", True),
            ("every", 1.5),
            ("every", True),
            ("every", "10"),
            ("record_history", 3),
            ("record_history", b"x"),
            ("stacks", 3),
            ("stacks", None),
        ],
    ),
    *[
        _one("memory_snapshot(", "device", v, lambda w, v=v: cudakit.memory_snapshot(v))
        for v in (1.5, True, [0])
    ],
    *[
        _one("MemoryReport.from_json(", "text", v, lambda w, v=v: cudakit.MemoryReport.from_json(v))
        for v in (3, None)
    ],
    *[
        _one("MemoryReport.from_dict(", "data", v, lambda w, v=v: cudakit.MemoryReport.from_dict(v))
        for v in (3, None, [])
    ],
    *[
        _one("MemoryMeter.clone(", "label", v, lambda w, v=v: _memory_reporter(w).clone(v))
        for v in (3, b"x")
    ],
    *[
        _one(
            "DeviceInfo.to_json(",
            "indent",
            v,
            lambda w, v=v: cudakit.device_info().to_json(indent=v),
        )
        for v in (1.5, True, "  ")
    ],
    *[
        _one("device_info(", "init_cuda", v, lambda w, v=v: cudakit.device_info(init_cuda=v))
        for v in ("no", 1, None)
    ],
    # ------------------------------------------------------------------- parallel
    *_rows(
        "parallelize(",
        lambda w, **kw: cudakit.parallelize(w.model, **kw),
        [
            ("strategy", None),
            ("strategy", 2),
            ("device", True),
            ("device", 1.5),
            ("backend", 3),
            ("timeout", "10"),
            ("timeout", True),
            ("find_unused_parameters", "yes"),
        ],
    ),
    *[
        _one("parallelize(", "model", v, lambda w, v=v: cudakit.parallelize(v))
        for v in (3, None, [nn.Linear(1, 1)])
    ],
    _one("parallelize(", "recompute", 3, lambda w: cudakit.parallelize(w.model, recompute=3)),
    *_rows(
        "recompute(",
        lambda w, **kw: parallel.recompute(w.model, **kw),
        [("policy", 3), ("policy", None), ("every", "2"), ("every", True), ("blocks", "Linear")],
    ),
    _one(
        "recompute(",
        "budget",
        "half",
        lambda w: parallel.recompute(w.model, "budget", budget="half"),
    ),
    *[_one("recompute(", "model", v, lambda w, v=v: parallel.recompute(v)) for v in (3, None)],
    *_rows(
        "Recompute(",
        lambda w, **kw: parallel.Recompute(**kw),
        [("policy", 3), ("every", 1.5), ("blocks", 3)],
    ),
    _one("recomputed_blocks(", "model", [], lambda w: parallel.recomputed_blocks([])),
    *_rows(
        "estimate_memory(",
        lambda w, **kw: memory.estimate_memory(w.model, w.batch[0], **kw),
        [("strategy", 3), ("world_size", "2"), ("precision", 16), ("optimizer", 3)],
    ),
    _one("estimate_memory(", "model", 3, lambda w: memory.estimate_memory(3, w.batch[0])),
    _one(
        "largest_batch(",
        "capacity",
        "1GB",
        lambda w: memory.largest_batch(w.model, w.batch[0], "1GB"),
    ),
    _one("estimate_memory(", "batch", "x", lambda w: memory.estimate_memory(w.model, "x")),
    *_rows(
        "process_group(",
        lambda w, **kw: cudakit.process_group(**kw),
        [("backend", 3), ("timeout", "x"), ("timeout", True), ("device", 1.5)],
    ),
    *_rows(
        "choose_strategy(",
        _choose,
        [
            ("strategy", 3),
            ("env", None),
            ("env", []),
            ("device_count", True),
            ("device_count", "2"),
            ("device_count", 2.0),
            ("device_type", None),
            ("group_world_size", True),
            ("group_world_size", 1.0),
        ],
    ),
    *_rows(
        "distributed_loader(",
        _loader,
        [
            ("batch_size", True),
            ("batch_size", "8"),
            ("batch_size", 2.0),
            ("shuffle", "no"),
            ("seed", True),
            ("seed", 1.0),
            ("seed", "a"),
            ("drop_last", 1),
            ("num_workers", "2"),
            ("num_workers", True),
            ("pin_memory", "yes"),
            ("collate_fn", 3),
        ],
    ),
    _one(
        "choose_strategy(",
        "env",
        {"RANK": 0},
        lambda w: _choose(w, env={"RANK": 0}),
        shown="int 0",
    ),
    *[
        _one("distributed_loader(", "dataset", v, lambda w, v=v: cudakit.distributed_loader(v))
        for v in (3, None)
    ],
    *[
        _one(
            "DistributedLoader.set_epoch(",
            "epoch",
            v,
            lambda w, v=v: cudakit.distributed_loader(w.dataset).set_epoch(v),
        )
        for v in ("1", True, 1.5, None)
    ],
    *_rows(
        "launch(",
        _launch,
        [
            ("nprocs", True),
            ("nprocs", "2"),
            ("nprocs", 1.0),
            ("timeout", "5"),
            ("timeout", True),
            ("start_method", 3),
        ],
    ),
    _one("launch(", "fn", 3, lambda w: cudakit.launch(3, nprocs=1)),  # type: ignore[arg-type]
    *[
        _one("is_main_process(", "local", v, lambda w, v=v: cudakit.is_main_process(local=v))
        for v in ("yes", 1, None)
    ],
    *[
        _one("main_process_first(", "local", v, lambda w, v=v: cudakit.main_process_first(local=v))
        for v in ("yes", 1, None)
    ],
    *[
        _one(f"{name}(", "model", v, lambda w, f=f, v=v: f(v))
        for name, f in (("unwrap", cudakit.unwrap), ("state_dict", parallel.state_dict))
        for v in (3, None, [nn.Linear(1, 1)])
    ],
    _one("load_state_dict(", "model", 3, lambda w: parallel.load_state_dict(3, {})),  # type: ignore[arg-type]
    _one("load_state_dict(", "state", 3, lambda w: parallel.load_state_dict(w.model, 3)),  # type: ignore[arg-type]
    _one(
        "load_state_dict(",
        "strict",
        "yes",
        lambda w: parallel.load_state_dict(w.model, w.model.state_dict(), strict="yes"),  # type: ignore[arg-type]
    ),
    *[
        _one("materialize(", "model", v, lambda w, v=v: parallel.materialize(v, "cpu"))
        for v in (3, None)
    ],
    *[
        _one("materialize(", arg, v, lambda w, a=arg, v=v: parallel.materialize(w.model, **{a: v}))
        for arg, v in (("init", "normal"), ("init", 3), ("init_seed", 1.5), ("init_seed", True))
    ],
    *[
        _one(f"{name}(", "model", v, lambda w, f=f, v=v: f(v, w.tmp))
        for name, f in (
            ("load_pretrained", parallel.load_pretrained),
            ("save_pretrained", parallel.save_pretrained),
        )
        for v in (3, None)
    ],
    *[
        _one(f"{name}(", "path", v, lambda w, f=f, v=v: f(w.model, v))
        for name, f in (
            ("load_pretrained", parallel.load_pretrained),
            ("save_pretrained", parallel.save_pretrained),
        )
        for v in (3, None)
    ],
    *[
        _one(
            "load_pretrained(",
            a,
            v,
            lambda w, a=a, v=v: parallel.load_pretrained(w.model, w.tmp, **{a: v}),
        )
        for a, v in (("strict", "yes"), ("dtype", "bf16"), ("prefix", 1))
    ],
    *[
        _one(
            "save_pretrained(",
            a,
            v,
            lambda w, a=a, v=v: parallel.save_pretrained(w.model, w.tmp, **{a: v}),
        )
        for a, v in (("max_shard_size", 1.5), ("dtype", "bf16"))
    ],
    *[_one("read_env(", "env", v, lambda w, v=v: parallel.read_env(v)) for v in (3, [])],
    _one("read_env(", "env", {"RANK": 0}, lambda w: parallel.read_env({"RANK": 0}), shown="int 0"),
    # -------------------------------------------------------------- device and data
    *[
        _one("resolve_device(", "spec", v, lambda w, v=v: cudakit.resolve_device(v))
        for v in (True, 1.5, [0], b"cpu")
    ],
    *_rows(
        "on_device(",
        lambda w, **kw: cudakit.on_device(w.batch, **kw),
        [("device", True), ("device", 1.5), ("non_blocking", "yes"), ("non_blocking", 1)],
    ),
    _one(
        "on_device(",
        "obj",
        UNSET,
        lambda w: cudakit.on_device(t for t in w.batch),
        shown="generator",
        note="generator",
    ),
    _one(
        "on_device(",
        "obj",
        UNSET,
        lambda w: cudakit.on_device({"x": iter(w.batch)}),
        shown="tuple_iterator",
        note="iterator",
    ),
    *[
        _one("register_container(", "cls", v, lambda w, v=v: cudakit.register_container(v))
        for v in (3, "Batch")
    ],
    *[
        _one(
            "register_container(",
            arg,
            3,
            lambda w, a=arg: cudakit.register_container(type("Box", (), {}), **{a: 3}),
        )
        for arg in ("flatten", "unflatten")
    ],
    *_rows(
        "loader_kwargs(",
        lambda w, **kw: cudakit.loader_kwargs(**kw),
        [
            ("device", True),
            ("num_workers", True),
            ("num_workers", 1.5),
            ("num_workers", "2"),
            ("pin_memory", "yes"),
            ("pin_memory", 1),
            ("persistent_workers", "x"),
            ("persistent_workers", 1),
        ],
    ),
    *_rows(
        "prefetch(",
        lambda w, **kw: cudakit.prefetch(**{"loader": [w.batch], **kw}),
        [
            ("loader", 3),
            ("loader", None),
            ("loader", "abc"),
            ("depth", True),
            ("depth", 1.5),
            ("depth", "2"),
            ("device", 1.5),
        ],
    ),
    *[
        _one(
            "set_epoch(",
            "epoch",
            v,
            lambda w, v=v: cudakit.prefetch([w.batch]).set_epoch(v),
        )
        for v in ("1", True, None)
    ],
    *[
        _one(
            "Prefetcher(",
            arg,
            v,
            lambda w, a=arg, v=v: data.Prefetcher(
                **{"loader": [w.batch], "device": torch.device("cpu"), "depth": 2, a: v}
            ),
        )
        for arg, v in (("depth", "2"), ("depth", True), ("device", 1.5), ("loader", 3))
    ],
    # -------------------------------------------------------------------- warm-up
    *_rows(
        "warmup(",
        _warmup,
        [
            ("steps", True),
            ("steps", 1.5),
            ("steps", None),
            ("optimizer", nn.Linear(1, 1)),
            ("optimizer", [1]),
            ("amp", 3),
            ("amp", True),
            ("extra", 3),
            ("extra", "sched"),
            ("reserve", True),
            ("reserve", [1]),
            ("device", True),
            ("loss_fn", 3),
        ],
    ),
    _one("warmup(", "extra", [3], lambda w: _warmup(w, extra=[3]), shown="int"),
    *[
        _one("warmup(", "model", v, lambda w, v=v: cudakit.warmup(v, w.batch))
        for v in (3, [nn.Linear(4, 2)])
    ],
    _one(
        "warmup(",
        "loss_fn",
        UNSET,
        lambda w: cudakit.warmup(w.model, w.batch, loss_fn=lambda batch: 0),
        note="one-parameter-function",
    ),
    *_rows(
        "find_batch_size(",
        _find_batch_size,
        [
            ("start", True),
            ("start", 1.5),
            ("lower", True),
            ("upper", True),
            ("upper", 64.0),
            ("multiple_of", True),
            ("margin", "x"),
            ("margin", True),
        ],
    ),
    _one("find_batch_size(", "trial_fn", 3, lambda w: cudakit.find_batch_size(3)),  # type: ignore[call-overload]
    *_rows(
        "warmed(",
        lambda w, **kw: cudakit.warmed(**{"model": w.model, **kw}),
        [("model", 3), ("optimizer", 3), ("extra", 3), ("steps", True), ("steps", 1.5)],
    ),
    *_rows(
        "preserve_state(",
        _preserve,
        [
            ("model", 3),
            ("model", [nn.Linear(1, 1)]),
            ("optimizer", 3),
            ("optimizer", nn.Linear(1, 1)),
            ("extra", 3),
        ],
    ),
    _one("preserve_state(", "extra", [3], lambda w: _preserve(w, extra=[3]), shown="int"),
    _one(
        "preserve_state(",
        "extra",
        (torch.optim.lr_scheduler.StepLR,),
        lambda w: _preserve(w, extra=(torch.optim.lr_scheduler.StepLR,)),
        shown="StepLR",
    ),
    *[
        _one("example_batch(", "loader", v, lambda w, v=v: warmup_pkg.example_batch(v))
        for v in (3, "data/train", torch.ones(3), {"train": [1]}, None)
    ],
    *[
        _one("is_oom_error(", "exc", v, lambda w, v=v: oom.is_oom_error(v))
        for v in (3, "CUDA out of memory", None)
    ],
    # ------------------------------------------------------------------------ demo
    *_rows(
        "make_dataset(",
        lambda w, **kw: demo.make_dataset(**{"n": 4, **kw}),
        # split: a ValueError for any bad value, its tested contract (tests/cli).
        [("n", True), ("n", "4"), ("seed", "x"), ("seed", True), ("seed", 1.5)],
    ),
    *_rows(
        "make_model(",
        lambda w, **kw: demo.make_model(**kw),
        [("width", "16"), ("width", True), ("width", 16.0)],
    ),
    *[_one("main(", "argv", v, lambda w, v=v: demo.main(v)) for v in ("--epochs 1", 3)],
]


def _row_ids(rows: list[Any]) -> list[str]:
    return [row_id(r.values[0] if hasattr(r, "values") else r) for r in rows]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


@pytest.mark.parametrize("row", ROWS, ids=_row_ids(ROWS))
def test_a_wrong_kind_is_a_clear_type_error_that_changes_nothing(row: Bad, world: World) -> None:
    check_refused(row, world)


def test_the_ids_are_unique() -> None:
    ids = _row_ids(ROWS)
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


# ------------------------------------------------------------ NumPy ints are ints


_NP = np.int64

ACCEPTED: list[tuple[str, Callable[[World], object]]] = [
    ("autocast_step-accumulate", lambda w: _autocast_step(w, accumulate=_NP(2))),
    ("autocast_step-max_skipped", lambda w: _autocast_step(w, max_skipped=_NP(3))),
    ("SpikeRule-warmup", lambda w: amp.SpikeRule(warmup=_NP(5), z=np.float64(3.0))),
    ("SpikeRule-z-float32", lambda w: amp.SpikeRule(z=np.float32(3.0))),
    (
        "autocast_step-max_grad_norm-float32",
        lambda w: _autocast_step(w, max_grad_norm=np.float32(1)),
    ),
    ("Checkpointer-keep-every", lambda w: _checkpointer(w, keep=_NP(2), every=_NP(3)).close()),
    ("Checkpointer-exit_code", lambda w: _checkpointer(w, exit_code=_NP(0)).close()),
    ("Checkpointer.epochs-stop", lambda w: list(w.checkpointer.epochs(_NP(2)))),
    ("speed_report-counts", lambda w: _speed(w, accumulate=_NP(2), every=_NP(5), window=_NP(3))),
    ("speed_report-peak_tflops-float32", lambda w: _speed(w, peak_tflops=np.float32(100))),
    ("memory_report-every", lambda w: cudakit.memory_report(file=None, every=_NP(2))),
    ("choose_strategy-counts", lambda w: _choose(w, device_count=_NP(1), group_world_size=_NP(1))),
    ("distributed_loader-batch_size-seed", lambda w: _loader(w, batch_size=_NP(2), seed=_NP(3))),
    (
        "DistributedLoader.set_epoch",
        lambda w: cudakit.distributed_loader(w.dataset).set_epoch(_NP(2)),
    ),
    ("launch-nprocs-timeout", lambda w: _launch_door_only(nprocs=_NP(1), timeout=_NP(5))),
    ("parallelize-timeout-int64", lambda w: cudakit.parallelize(w.model, timeout=_NP(30))),
    ("parallelize-timeout-float32", lambda w: cudakit.parallelize(w.model, timeout=np.float32(30))),
    ("loader_kwargs-num_workers", lambda w: cudakit.loader_kwargs(num_workers=_NP(0))),
    ("prefetch-depth", lambda w: list(cudakit.prefetch([w.batch], depth=_NP(1)))),
    ("Prefetcher.set_epoch", lambda w: cudakit.prefetch([w.batch]).set_epoch(_NP(1))),
    ("warmup-steps", lambda w: _warmup(w, steps=_NP(1))),
    ("warmup-reserve", lambda w: _reserve_ignored(lambda: cudakit.warmup(reserve=_NP(1024)))),
    ("warmed-steps", lambda w: cudakit.warmed(model=w.model, steps=_NP(2))),
    (
        "find_batch_size-counts",
        lambda w: cudakit.find_batch_size(
            lambda n: None, start=_NP(2), lower=_NP(1), upper=_NP(8), multiple_of=_NP(2)
        ),
    ),
    (
        "find_batch_size-margin-float32",
        lambda w: _find_batch_size(w, upper=8, margin=np.float32(0.25)),
    ),
    ("make_dataset-n", lambda w: demo.make_dataset(_NP(4))),
    ("make_model-width", lambda w: demo.make_model(_NP(8))),
]


def _launch_door_only(**kw: Any) -> None:
    """launch()'s checks only: a lambda cannot be pickled, which is checked last, so
    that refusal says every other argument was taken."""
    with pytest.raises(TypeError, match="cannot be pickled"):
        cudakit.launch(lambda: None, **kw)


def _reserve_ignored(call: Callable[[], object]) -> object:
    with pytest.warns(cudakit.ReserveIgnoredWarning):
        return call()


@pytest.mark.parametrize("call", [c for _, c in ACCEPTED], ids=[i for i, _ in ACCEPTED])
def test_numpy_numbers_are_taken_where_numbers_are(
    call: Callable[[World], object], world: World
) -> None:
    call(world)


def test_the_sweep_covers_every_public_callable() -> None:
    """Each public function and class of the packages has at least one row (or is a
    record or constant that takes no user input)."""
    covered = {row_id(r.values[0] if hasattr(r, "values") else r).split("-")[0] for r in ROWS}
    covered = {c.split(".")[0] for c in covered}
    # Checked through the rows of the function that makes them (their messages name it).
    covered |= {"AutocastStep", "SpeedMeter", "parse_dtype"}
    records = {
        # Results and records cudakit builds and returns; their fields are not user input.
        "CudaDeviceInfo", "DeviceInfo", "MemoryReport", "MemorySnapshot", "Position",
        "StepResult", "WarmupReport", "NonFiniteSource", "DevicePeak", "FlopCount", "Peak",
        "SpeedFigures", "SpeedSummary", "DeviceMemory", "DistributedEnv", "LoadResult",
        "PretrainedLoad",
        "MemoryEstimate",
        "ProcessGroupInfo", "DemoSummary", "EpochStats", "LoaderKwargs", "WatchOptions",
        # Types, protocols and constants.
        "DeviceLike", "Count", "CountSpec", "FlopSpec", "LogTarget", "ReserveSpec", "Phase",
        "Statistic", "Strategy", "StrategyRequest", "SteppedFunction", "SpeedReported",
        "MemoryReported", "WarmedDecorator", "FindBatchSizeDecorator", "OnDeviceDecorator",
        "SizedIterable", "SizedPrefetcher", "Stderr", "STDERR", "PEAKS", "MAX_AUTO_WORKERS",
        "LaunchError", "MemoryReserveError", "ReserveIgnoredWarning", "__version__",
        "Capabilities", "Precision", "DTYPE_ALIASES",
        # No arguments.
        "rank", "local_rank", "world_size", "cpu_native_bf16", "cpu_native_fp16",
    }  # fmt: skip
    missing = []
    packages = (cudakit, amp, checkpoint, speed, memory, parallel, device, data, warmup_pkg)
    for module in (*packages, policy, demo, info):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            if name in records or name in covered:
                continue
            missing.append(f"{module.__name__}.{name}")
    assert not missing, missing
