"""Checkpoint save and load time, and the time a background save blocks the loop.

Run ``python benchmarks/bench_checkpoint.py`` (``--quick`` for a smoke run with a small
model; ``--device cuda`` with the model on the GPU, where a background save's staging is
a device-to-host copy; ``--fsdp`` adds the FSDP2 memory measurement over 2 processes).
One process; the variants take turns in a rotating order for ``--rounds`` rounds, so
machine noise hits them alike; the table shows the median wall time and its ratio to
``torch.save`` of the full state dicts (goals: a synchronous ``Checkpointer.save()``
within 1.1x, a background save blocking the loop at most 10 % of a synchronous one). Each
variant's timed save is its second, right after a first (a loop saves again and again;
a background save's host buffers exist by then). The
load of ``Checkpointer(trust_pickles=True)``, which reads with pickle's full loader,
is the reference of the safe reader's; the parts the safe reader changes are also timed
alone, repeated, and their sum compared with the load (goal: at most 2 % of it).

The model is ~100M parameters (24 linear layers of 2048x2048, fp32) with AdamW state
(1.2 GB in all). Every variant makes its file durable (``os.fsync``), as DCP does, so
the comparison is like for like; each writes a new directory, removed afterwards.
accelerate's ``save_state``/``load_state`` join when accelerate is installed (the
``bench`` extra).

A small model follows (a GPT of 2 layers, width 64, ~135k parameters, on one thread):
one save against the hand-written loop's own (``torch.save`` to a temporary file made
durable, then renamed; goal: at most 1.5x), and a 60-step loop saving every 5 steps
against that loop (goal: at most 1.02x), with accelerate's ``save_state`` where present.

``--fsdp``: 2 gloo processes shard the model with FSDP2; each measures, with
``memory_report``, its resident-memory peak during ``Checkpointer.save()`` above what it
held before, against its own shard (parameters and optimizer state), then times a
``Checkpointer`` save and load against DCP's own ``save``/``load`` written by hand, in
interleaved rounds.

``--small``: only the small model's part (a save's fixed cost and the loop), in about
a minute.

``--stop``: only the cost of agreeing on a stop signal across ranks, which every window
boundary pays under a process group (one asynchronous all-reduce of a few flags on a
gloo group, read at the next boundary).
2 gloo processes train a DDP model through ``Checkpointer.batches()``, ``preemption=False``
and ``True`` taking turns; the agreement itself is timed inside the run, and its time per
window is printed as a ratio of the window's (goal: at most 1 %), beside the ratio of the
two loops' window times (as noisy as the machine).

``--json PATH`` writes the figures, the machine and the date as the data file of
``docs/figures/bench_checkpoint.json`` (``--figure`` is the same option): the medians,
and with ``--fsdp`` each rank's memory figures. ``python scripts/make_figures.py`` redraws
the chart from it and ``python scripts/bench_tables.py`` the table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report

import cudakit


def make(
    width: int, layers: int, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def variants(model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path) -> dict[str, Any]:
    counter = [0]

    def fresh() -> Path:
        counter[0] += 1
        path = root / f"run{counter[0]}"
        path.mkdir()
        return path

    def torch_save() -> dict[str, float]:
        path = fresh() / "state.pt"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)  # the first
        _fsync(path)
        path = path.with_name("again.pt")
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        _fsync(path)
        saved = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loaded = time.perf_counter() - t0
        shutil.rmtree(path.parent)
        return {"save": saved, "load": loaded}

    def checkpointer(background: bool, trust: bool = False) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            path = fresh()
            ckpt = cudakit.Checkpointer(
                path, model=model, optimizer=opt, async_save=background, preemption=False,
                trust_pickles=trust,
            )  # fmt: skip
            # A loop saves again and again: time a save right after the first (for the
            # background save, its host buffers are made then), the same for both; the
            # second is a checkpoint of its own (the saves name it), replacing nothing.
            ckpt.save()
            ckpt.wait()
            t0 = time.perf_counter()
            ckpt.save()
            blocked = time.perf_counter() - t0
            ckpt.wait()
            saved = time.perf_counter() - t0
            t0 = time.perf_counter()
            ckpt.resume()
            loaded = time.perf_counter() - t0
            ckpt.close()
            shutil.rmtree(path)
            out = {"save": saved, "load": loaded}
            if background:
                out["blocked"] = blocked
            return out

        return run

    found: dict[str, Any] = {
        "torch.save": torch_save,
        "Checkpointer": checkpointer(False),
        "Checkpointer async": checkpointer(True),
        "Checkpointer, full pickle": checkpointer(False, trust=True),
    }
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return found

    def accelerate_state() -> dict[str, float]:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        m, o = acc.prepare(model, opt)
        path = fresh()
        acc.save_state(str(path / "first"))  # the first save, as every variant's
        for f in (path / "first").rglob("*"):
            if f.is_file():
                _fsync(f)
        path = path / "again"
        t0 = time.perf_counter()
        acc.save_state(str(path))
        for f in path.rglob("*"):
            if f.is_file():
                _fsync(f)
        saved = time.perf_counter() - t0
        t0 = time.perf_counter()
        acc.load_state(str(path))
        loaded = time.perf_counter() - t0
        shutil.rmtree(path.parent)
        del m, o
        return {"save": saved, "load": loaded}

    found["accelerate save_state"] = accelerate_state
    return found


def restarts(width: int, layers: int, device: str, root: Path, rounds: int) -> dict[str, float]:
    """A restarted run's resume: each variant loads a checkpoint it wrote before into a
    new model and optimizer (no state yet), in a new process, as a restarted run does
    (in one process, memory the previous round freed makes a load look cheaper than a
    restart finds it); median seconds of each, in turns. The time is taken in the child,
    from the new model's existence to the end of the load (imports included)."""
    model, opt = make(width, layers, device)
    root.mkdir()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, root / "state.pt")
    ckpt = cudakit.Checkpointer(root / "ckpt", model=model, optimizer=opt, preemption=False)
    ckpt.save()
    ckpt.close()
    names = ["torch.load", "Checkpointer"]
    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        acc.prepare(model, opt)
        acc.save_state(str(root / "acc"))
        names.append("accelerate load_state")
    except ImportError:
        pass
    del model, opt
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            command = [sys.executable, __file__, "--restart", name, str(root)]
            command += [str(width), str(layers), device]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            times[name].append(float(done.stdout.split()[-1]))
    return {name: statistics.median(v) for name, v in times.items()}


def restart_child(name: str, root: Path, width: int, layers: int, device: str) -> float:
    """One restarted run's resume (:func:`restarts`), in this new process: its seconds."""
    torch.manual_seed(1)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    o = torch.optim.AdamW(m.to(device).parameters(), lr=1e-4)  # no state yet
    t0 = time.perf_counter()
    if name == "torch.load":
        state = torch.load(root / "state.pt", weights_only=True)
        m.load_state_dict(state["model"])
        o.load_state_dict(state["optim"])
    elif name == "Checkpointer":
        again = cudakit.Checkpointer(
            root / "ckpt", model=m, optimizer=o, preemption=False, file=None
        )
        again.resume()
        again.close()
    else:
        from accelerate import Accelerator

        fresh = Accelerator(cpu=True)
        fresh.prepare(m, o)
        fresh.load_state(str(root / "acc"))
    return time.perf_counter() - t0


def reader_cost(model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path) -> dict[str, Any]:
    """What the safe reader adds to a resume, each part timed alone (median of repeats,
    so the noise of a whole load does not drown it): DCP's metadata (read twice: by the
    checks and by DCP), the rank file, and the values DCP pickles, each read safely and
    with pickle's full loader."""
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from cudakit.checkpoint import _safe_dcp as safe_dcp
    from cudakit.checkpoint import _safe_load as safe_load

    ckpt = cudakit.Checkpointer(root / "reader", model=model, optimizer=opt, preemption=False)
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    metadata = FileSystemReader(str(path)).read_metadata()
    blobs = []
    for index, info in metadata.storage_data.items():
        if not hasattr(metadata.state_dict_metadata[index.fqn], "size"):
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blobs.append(f.read(info.length))

    def values(safe: bool) -> None:
        for blob in blobs:
            if safe:
                with safe_load.allowed_globals():
                    torch.load(io.BytesIO(blob), weights_only=True)
            else:
                torch.load(io.BytesIO(blob), weights_only=False)

    host = path / "rank-00000.pt"
    parts: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
        "metadata": (
            lambda: safe_dcp.dcp_reader(path).read_metadata(),
            lambda: FileSystemReader(str(path)).read_metadata(),
            2,
        ),
        "rank file": (
            lambda: safe_load.load_host(host, trust=False),
            lambda: torch.load(host, weights_only=False, map_location="cpu"),
            1,
        ),
        "pickled values": (lambda: values(True), lambda: values(False), 1),
    }
    out: dict[str, Any] = {"values": len(blobs)}
    for name, (safe, full, times) in parts.items():
        runs: dict[str, list[float]] = {"safe": [], "full": []}
        for _ in range(15):
            for kind, fn in (("safe", safe), ("full", full)):
                t0 = time.perf_counter()
                fn()
                runs[kind].append(time.perf_counter() - t0)
        out[name] = {k: statistics.median(v) * times for k, v in runs.items()}
    shutil.rmtree(path.parent)
    return out


# -- a small model: a save's fixed cost, and a loop that saves every 5 steps ----------


def tiny_gpt(
    width: int = 64, layers: int = 2, vocab: int = 256, context: int = 32
) -> torch.nn.Module:
    """A GPT-style model: token and position embeddings, ``layers`` pre-norm blocks of
    causal attention and an MLP, a final norm and the head."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(width)
            self.attn = torch.nn.MultiheadAttention(width, 4, batch_first=True)
            self.ln2 = torch.nn.LayerNorm(width)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, width)
            self.pos = torch.nn.Embedding(context, width)
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(layers)])
            self.ln = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return GPT()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    opt.step()


def _atomic_save(state: dict[str, Any], path: Path) -> None:
    """The hand-written loop's save: a temporary file made durable, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    _fsync(tmp)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hand_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }


def _accelerate_save(acc: Any, path: Path) -> None:
    acc.save_state(str(path))
    for f in path.rglob("*"):
        if f.is_file():
            _fsync(f)


def small_saves(root: Path, repeats: int) -> dict[str, float]:
    """The median time of one save of the small model with AdamW state, each variant in
    turn: ``torch.save`` made durable and renamed (the hand-written loop's), a
    ``Checkpointer.save()`` (``keep=2``), a background one until written, accelerate's
    ``save_state`` made durable."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, torch.randint(0, 256, (8, 33)))
    root.mkdir()
    ckpts = {
        background: cudakit.Checkpointer(
            root / f"ckpt-{background}",
            model=model,
            optimizer=opt,
            keep=2,
            async_save=background,
            preemption=False,
        )
        for background in (False, True)
    }
    count = [0]

    def torch_save() -> None:
        count[0] += 1
        _atomic_save(_hand_state(model, opt, count[0]), root / "hand.pt")

    def checkpointer(background: bool) -> Callable[[], None]:
        def run() -> None:
            ckpt = ckpts[background]
            ckpt.maybe_save()  # one batch further: a new checkpoint, not the same again
            ckpt.save()
            ckpt.wait()

        return run

    variants = {
        "torch.save": torch_save,
        "Checkpointer": checkpointer(False),
        "Checkpointer async": checkpointer(True),
    }
    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        acc.prepare(model, opt)
        variants["accelerate save_state"] = lambda: _accelerate_save(acc, root / "acc")
    except ImportError:
        pass
    for fn in variants.values():  # warm: the first save makes what later ones reuse
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    for ckpt in ckpts.values():
        ckpt.close()
    return {name: statistics.median(v) for name, v in times.items()}


def small_loops(root: Path, rounds: int, steps: int = 60, every: int = 5) -> dict[str, float]:
    """The median time of a training loop of ``steps`` steps on the small model that
    saves every ``every`` steps: hand-written with its own atomic saves, with a
    ``Checkpointer(every=5)`` (``maybe_save()`` after each step), in the background, with
    accelerate's ``save_state``; and the same loop saving nothing."""
    batches = [torch.randint(0, 256, (8, 33)) for _ in range(steps)]

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
        torch.manual_seed(0)
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        path = root / f"loop{time.perf_counter_ns()}"
        path.mkdir(parents=True)
        return model, opt, path

    def plain() -> float:
        model, opt, _ = fresh()
        t0 = time.perf_counter()
        for batch in batches:
            _train_step(model, opt, batch)
        return time.perf_counter() - t0

    def hand() -> float:
        model, opt, path = fresh()
        t0 = time.perf_counter()
        for i, batch in enumerate(batches, 1):
            _train_step(model, opt, batch)
            if i % every == 0:
                _atomic_save(_hand_state(model, opt, i), path / "last.pt")
        return time.perf_counter() - t0

    def checkpointer(background: bool) -> Callable[[], float]:
        def run() -> float:
            model, opt, path = fresh()
            t0 = time.perf_counter()
            ckpt = cudakit.Checkpointer(
                path, model=model, optimizer=opt, every=every, keep=2,
                async_save=background, preemption=False,
            )  # fmt: skip
            ckpt.resume()
            for batch in batches:
                _train_step(model, opt, batch)
                ckpt.maybe_save()
            ckpt.close()
            return time.perf_counter() - t0

        return run

    variants: dict[str, Callable[[], float]] = {
        "no saves": plain,
        "hand-written": hand,
        "Checkpointer": checkpointer(False),
        "Checkpointer async": checkpointer(True),
    }
    try:
        from accelerate import Accelerator

        def accelerate_loop() -> float:
            model, opt, path = fresh()
            t0 = time.perf_counter()
            acc = Accelerator(cpu=True)
            model, opt = acc.prepare(model, opt)
            for i, batch in enumerate(batches, 1):
                _train_step(model, opt, batch)
                if i % every == 0:
                    _accelerate_save(acc, path / "acc")
            return time.perf_counter() - t0

        variants["accelerate save_state"] = accelerate_loop
    except ImportError:
        pass
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            took = variants[name]()
            if r:  # the first round warms up
                times[name].append(took)
    return {name: statistics.median(v) for name, v in times.items()}


def fsdp_worker(rank: int, port: int, width: int, layers: int, out: str, rounds: int) -> None:
    import datetime

    import cudakit.parallel as cp
    from cudakit import memory_report

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    with cudakit.process_group(timeout=datetime.timedelta(seconds=300)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        model = cp.parallelize(net, "fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        shard = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[operator]
        shard += sum(
            v.to_local().numel() * 4 if hasattr(v, "to_local") else v.numel() * 4
            for s in opt.state.values()
            for v in s.values()
        )
        ckpt = cudakit.Checkpointer(
            Path(out) / "ckpt", model=model, optimizer=opt, preemption=False
        )
        with memory_report(file=None) as rep:
            ckpt.save()
        ckpt.close()
        import dataclasses

        figures = dataclasses.asdict(rep.figures())
        timed = fsdp_times(model, opt, Path(out), rounds)
        result = {"rank": rank, "shard_bytes": shard, "figures": figures, "times": timed}
        with open(Path(out) / f"rank{rank}.json", "w") as f:
            json.dump(result, f, default=str)


def fsdp_times(model: Any, opt: Any, out: Path, rounds: int) -> dict[str, dict[str, float]]:
    """Median save and load wall times on this rank (each ended by a barrier) of a
    Checkpointer and of DCP's own ``save``/``load`` with ``get_state_dict`` and
    ``set_state_dict`` written by hand, durable files both, in interleaved rounds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def by_hand(path: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        writer = dcp.FileSystemWriter(str(path), sync_files=True)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        dist.barrier()
        saved = time.perf_counter() - t0
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        dist.barrier()
        return saved, time.perf_counter() - t0

    def checkpointer(path: Path) -> tuple[float, float]:
        ckpt = cudakit.Checkpointer(path, model=model, optimizer=opt, preemption=False)
        t0 = time.perf_counter()
        written = ckpt.save()
        dist.barrier()
        saved = time.perf_counter() - t0
        assert written is not None
        t0 = time.perf_counter()
        ckpt.load(written)
        dist.barrier()
        loaded = time.perf_counter() - t0
        ckpt.close()
        return saved, loaded

    variants = {"DCP by hand": by_hand, "Checkpointer": checkpointer}
    names = list(variants)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            path = out / f"timed-{r}-{names.index(name)}"
            dist.barrier()
            saved, loaded = variants[name](path)
            times[name]["save"].append(saved)
            times[name]["load"].append(loaded)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


def fsdp_memory(width: int, layers: int, rounds: int) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_ckpt_fsdp")
    try:
        mp.start_processes(fsdp_worker, args=(port, width, layers, out, rounds), nprocs=2,
                           start_method="spawn")  # fmt: skip
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stop_worker(rank: int, port: int, sizes: tuple[int, int, int, int, int], out: str) -> None:
    """One rank of ``--stop``: windows of a DDP model, with and without the agreement."""
    import datetime

    import torch.nn.functional as F

    import cudakit.parallel as cp
    from cudakit.checkpoint import _preemption as preemption

    width, layers, accumulate, windows, rounds = sizes
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    polls: list[float] = []
    poll = preemption.StopAgreement.poll

    def timed(self: Any, seen: Any) -> bool:
        t0 = time.perf_counter()
        try:
            return poll(self, seen)
        finally:
            polls.append(time.perf_counter() - t0)

    preemption.StopAgreement.poll = timed  # type: ignore[method-assign]
    with cudakit.process_group(timeout=datetime.timedelta(seconds=300)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        model = cp.parallelize(net, "ddp", device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=accumulate)
        train_step = step(lambda x: F.mse_loss(model(x), x))
        batches = [torch.randn(32, width) for _ in range(accumulate * windows)]
        per_window: dict[str, list[float]] = {"preemption=False": [], "preemption=True": []}
        agreement: list[float] = []
        names = list(per_window)
        for r in range(rounds + 1):  # round 0 warms up
            for name in names[r % 2 :] + names[: r % 2]:
                root = tempfile.mkdtemp(prefix="bench_stop") if rank == 0 else ""
                box = [root]
                torch.distributed.broadcast_object_list(box, src=0)
                ckpt = cudakit.Checkpointer(
                    box[0], step=step, loader=batches, preemption=name.endswith("True")
                )
                polls.clear()
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for _ in ckpt.epochs(1):
                    for x in ckpt.batches():
                        train_step(x)
                elapsed = time.perf_counter() - t0
                ckpt.close()
                torch.distributed.barrier()
                if rank == 0:
                    shutil.rmtree(box[0], ignore_errors=True)
                if r:
                    per_window[name].append(elapsed / windows)
                    if name.endswith("True"):
                        agreement.append(sum(polls) / len(polls))
        # One round alone: back-to-back polls (each waits for the one before it).
        stop = preemption.StopAgreement(torch.distributed.new_group(backend="gloo"))
        alone = []
        for _ in range(5):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(200):
                poll(stop, ())
            alone.append((time.perf_counter() - t0) / 200)
        result = {
            "rank": rank,
            "window_s": {k: statistics.median(v) for k, v in per_window.items()},
            "in_loop_s": statistics.median(agreement),
            "agreement_s": statistics.median(alone),
        }
        with open(Path(out) / f"stop{rank}.json", "w") as f:
            json.dump(result, f)


def stop_cost(quick: bool, rounds: int | None) -> dict[str, Any]:
    """``--stop``: 2 ranks; returns rank 0's figures (and prints them)."""
    import socket

    import torch.multiprocessing as mp

    width, layers, accumulate, windows = (128, 2, 2, 4) if quick else (1024, 4, 4, 8)
    rounds = rounds or (1 if quick else 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_ckpt_stop")
    sizes = (width, layers, accumulate, windows, rounds)
    try:
        mp.start_processes(stop_worker, args=(port, sizes, out), nprocs=2, start_method="spawn")
        ranks = [json.loads((Path(out) / f"stop{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(
        f"bench_checkpoint --stop: 2 gloo ranks, DDP MLP {layers}x{width}, batch 32, "
        f"accumulate={accumulate}, {windows} windows a run, {rounds} round(s), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"{'rank':>4} {'window off ms':>14} {'window on ms':>13} {'on / off':>9} "
          f"{'round us':>9} {'in loop us':>11} {'of a window':>12}")  # fmt: skip
    for item in ranks:
        off, on = item["window_s"]["preemption=False"], item["window_s"]["preemption=True"]
        cost = item["in_loop_s"]
        item["on_over_off"] = on / off
        item["agreement_of_window"] = cost / off
        print(
            f"{item['rank']:>4} {off * 1e3:14.2f} {on * 1e3:13.2f} {on / off:9.3f} "
            f"{item['agreement_s'] * 1e6:9.1f} {cost * 1e6:11.1f} {cost / off:12.3%}"
        )
    print(
        "(round: one all-reduce alone, polls back to back; in loop: what the poll at each "
        "boundary costs the loop: it reads the round started a window before and starts "
        "the next; of a window: in loop / window off)"
    )
    worst = max(item["agreement_of_window"] for item in ranks)
    print(f"the stop agreement costs at most {worst:.3%} of a window (goal <= 1 %)")
    return {"ranks": ranks, "sizes": sizes}


def figure_data(
    result: dict[str, Any], settings: str, argv: list[str] | None, load: float
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_checkpoint.json: the chart's rows
    (median seconds), and the rest of ``result`` (parameters, rounds, FSDP figures)."""
    rows = []
    for name, med in result["table"].items():
        for series in ("save", "load"):
            rows.append({"group": name, "series": series, "value": round(med[series], 3)})
    blocked = result["table"]["Checkpointer async"]["blocked"]
    rows.append({"group": "async: loop blocked", "series": "save", "value": round(blocked, 3)})
    extra = {k: v for k, v in result.items() if k != "table"}
    return _report.record(
        "benchmarks/bench_checkpoint.py",
        title=f"Checkpointer: save and load of {result['params'] / 1e6:.1f}M parameters with "
        "AdamW state",
        settings=settings,
        argv=argv,
        load_before=load,
        peers=("accelerate",),
        unit="seconds",
        **extra,
        rows=rows,
    )


def small_part(quick: bool, directory: str | None) -> dict[str, Any]:
    """The small model's figures (one save, the loop), printed as ratios."""
    small_root = Path(tempfile.mkdtemp(prefix="bench_ckpt_small", dir=directory))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model's step: on a shared machine, more spin
    try:
        saves = small_saves(small_root / "saves", repeats=5 if quick else 25)
        loops = small_loops(small_root / "loops", rounds=1 if quick else 5)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(small_root, ignore_errors=True)
    small_params = sum(p.numel() for p in tiny_gpt().parameters())
    print(
        f"\nsmall model ({small_params / 1e3:.0f}k parameters + AdamW state, one thread), "
        "one save (median; goal: Checkpointer at most 1.5x torch.save):"
    )
    for name, value in saves.items():
        print(f"  {name:24} {value * 1e3:7.1f} ms {value / saves['torch.save']:6.2f}x")
    print(
        "a 60-step loop saving every 5 steps (median; goal: Checkpointer at most 1.02x "
        "the hand-written loop with its own atomic saves):"
    )
    for name, value in loops.items():
        print(f"  {name:24} {value:7.3f} s {value / loops['hand-written']:7.3f}x")
    return {"params": small_params, "save": saves, "loop": loops}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, one round")
    parser.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--fsdp", action="store_true", help="also FSDP2 memory over 2 ranks")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--stop", action="store_true", help="only the per-window cost of agreeing on a stop"
    )
    parser.add_argument(
        "--small", action="store_true", help="only the small model: one save, and the loop"
    )
    parser.add_argument(
        "--json",
        "--figure",
        dest="json",
        default=None,
        metavar="PATH",
        help="also write the data file (docs/figures/bench_checkpoint.json)",
    )
    parser.add_argument("--restart", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restart:  # (a child of restarts())
        name, root, width, layers, device = args.restart
        print(restart_child(name, Path(root), int(width), int(layers), device))
        return
    if args.stop:
        stop_cost(args.quick, args.rounds)
        return
    if args.small:
        if args.json:
            parser.error("--json writes the whole run's figures: leave out --small")
        print(
            f"bench_checkpoint --small: torch {torch.__version__}, {platform.machine()}, "
            f"{os.cpu_count()} CPUs, load average {_report.load_average()}"
        )
        small_part(args.quick, args.dir)
        return
    load = _report.load_average()
    width, layers = (256, 4) if args.quick else (2048, 24)
    rounds = args.rounds or (1 if args.quick else 3)
    model, opt = make(width, layers, args.device)
    params = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt", dir=args.dir))
    print(
        f"bench_checkpoint: {params / 1e6:.1f}M parameters + AdamW state, torch "
        f"{torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, model on "
        f"{args.device}, {rounds} round(s), "
        f"writing to {root}"
    )
    impls = variants(model, opt, root)
    names = list(impls)
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                for key, value in impls[name]().items():
                    times[name].setdefault(key, []).append(value)
        cost = reader_cost(model, opt, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {k: statistics.median(v) for k, v in times["torch.save"].items()}
    print(f"\n{'implementation':24} {'save s':>8} {'x torch':>8} {'load s':>8} {'x torch':>8}")
    table: dict[str, Any] = {}
    for name in names:
        med = {k: statistics.median(v) for k, v in times[name].items()}
        table[name] = med
        print(
            f"{name:24} {med['save']:8.3f} {med['save'] / base['save']:8.2f} "
            f"{med['load']:8.3f} {med['load'] / base['load']:8.2f}"
        )
    asynchronous = table["Checkpointer async"]
    blocked_ratio = asynchronous["blocked"] / table["Checkpointer"]["save"]
    print(
        f"\nbackground save: the loop was blocked {asynchronous['blocked']:.3f} s, "
        f"{blocked_ratio:.1%} of a synchronous Checkpointer.save() (goal <= 10 %)"
    )
    safe, full = table["Checkpointer"]["load"], table["Checkpointer, full pickle"]["load"]
    added = sum(v["safe"] - v["full"] for k, v in cost.items() if k != "values")
    print(
        f"safe reader: load {safe:.3f} s against {full:.3f} s with pickle's full loader "
        f"(trust_pickles=True; whole loads, as noisy as the machine: {safe / full - 1:+.1%});"
        f" its own parts timed alone add {added * 1e3:.1f} ms, {added / full:+.2%} of the "
        "load (goal <= +2 %):"
    )
    for name, value in cost.items():
        if name != "values":
            print(
                f"  {name:16} safe {value['safe'] * 1e3:7.2f} ms, full pickle "
                f"{value['full'] * 1e3:7.2f} ms"
            )
    print(f"  ({cost['values']} values pickled by DCP; the metadata is read twice)")
    result: dict[str, Any] = {"params": params, "rounds": rounds, "table": table}
    result["async_blocked_ratio"] = blocked_ratio
    result["safe_reader"] = {"parts": cost, "added_s": added, "of_load": added / full}
    restart_root = Path(tempfile.mkdtemp(prefix="bench_restart", dir=args.dir)) / "run"
    try:
        restart = restarts(width, layers, args.device, restart_root, rounds)
    finally:
        shutil.rmtree(restart_root.parent, ignore_errors=True)
    result["restart"] = restart
    print(
        "a restarted run's resume (a new model and optimizer): "
        + ", ".join(f"{name} {value:.3f} s" for name, value in restart.items())
    )
    result["small"] = small_part(args.quick, args.dir)
    if args.fsdp:
        ranks = fsdp_memory(width, layers, rounds)
        result["fsdp"] = ranks
        for item in ranks:
            fig = item["figures"]
            extra = fig["peak_allocated"] - fig["allocated_before"]
            item["extra_peak_bytes"] = extra
            print(
                f"FSDP2 rank {item['rank']}: own shard {item['shard_bytes'] / 2**20:.0f} MiB; "
                f"extra resident peak during save {extra / 2**20:.0f} MiB "
                f"({extra / item['shard_bytes']:.2f}x the shard; memory_report)"
            )
        timed = ranks[0]["times"]
        mine, theirs = timed["Checkpointer"], timed["DCP by hand"]
        print(
            f"FSDP2, 2 ranks, rank 0 (median of {rounds}): save {mine['save']:.3f} s against "
            f"{theirs['save']:.3f} s for DCP by hand ({mine['save'] / theirs['save']:.2f}x), "
            f"load {mine['load']:.3f} s against {theirs['load']:.3f} s "
            f"({mine['load'] / theirs['load']:.2f}x)"
        )
    if args.json:
        settings = f"model on {args.device}, {rounds} round(s), median wall time"
        data = json.loads(json.dumps(figure_data(result, settings, argv, load), default=str))
        _report.write(args.json, data)


if __name__ == "__main__":
    main()
