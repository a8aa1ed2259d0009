"""Stop a training run at each point of its saves, resume it, and compare: the driver of
``test_kill_at_any_point_of_a_save.py``.

    python fault_points.py MODE WORKDIR

runs MODE's training once as the reference, recording every file-system step its saves
take: each ``torch.save`` and ``os.fsync`` (a file written), each ``os.replace`` and
``os.rename``, each ``os.unlink`` and ``os.rmdir`` (a removal, file by file).

* At every step, before and after it, the run directory is copied: what a process
  stopped there leaves on disk (the files the OS has; nothing in the process's memory
  survives a kill, nor does a copy see it). Each copy is then resumed: the resume must
  load a checkpoint at least as new as the newest one published before that step, and
  load exactly what the reference wrote under that name.
* At a few steps (the renames and removals of a replacement, a rotation), a fresh run
  is really stopped with ``os._exit`` there (under 2 ranks: rank 1 SIGKILLed while rank 0
  is at that step, with or without rank 0), then run again until it finishes: its
  weights and optimizer state must equal the reference's bit for bit.

Every run is a ``fork`` of this process (torch imported once, one thread), so the steps
come in the same order each time. The report goes to ``WORKDIR/report.json``. Modes:

* ``sync``, ``async``: ``epochs()``/``batches()``, ``every=2``, ``keep=2``, an explicit
  ``save()`` twice at one position, and a SIGTERM (a preemption's stop and its save);
* ``own``: a loop with its own data calling ``save()`` itself, ``keep=2``;
* ``ranks``, ``peer``: 2 ranks over gloo (DDP), ``every=2``, ``keep=2``; rank 1 is
  SIGKILLed at rank 0's step, and rank 0 with it (``ranks``) or not (``peer``: it goes
  on until it fails).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's cudakit

import torch
import torch.nn.functional as F

import cudakit

KILLED = 99
_NAME = re.compile(r"^ckpt-(\d{10})$")


class Points:
    """Counts the file-system steps of a process; stops it at step ``kill_at``, or calls
    ``at(n, when)`` around each step."""

    def __init__(
        self,
        kill_at: int | None,
        when: str,
        die: Callable[[], None],
        at: Callable[[int, str, str, str], None] | None = None,
    ) -> None:
        self.kill_at, self.when, self.die, self.at = kill_at, when, die, at
        self.trace: list[tuple[str, str]] = []
        self._real: dict[tuple[Any, str], Any] = {}
        self._inside = False

    def install(self) -> None:
        for owner, name in ((os, "fsync"), (os, "replace"), (os, "rename"), (os, "unlink"),
                            (os, "rmdir"), (torch, "save")):  # fmt: skip
            real = getattr(owner, name)
            self._real[(owner, name)] = real
            setattr(owner, name, self._wrap(name, real))

    def uninstall(self) -> None:
        for (owner, name), real in self._real.items():
            setattr(owner, name, real)
        self._real.clear()

    def _wrap(self, kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self._inside or (kind == "save" and not isinstance(args[1], str | os.PathLike)):
                return real(*args, **kwargs)  # (DCP pickling into memory: no file)
            what = ""
            if kind in ("replace", "rename"):
                what = Path(str(args[1])).name
            elif kind in ("unlink", "rmdir", "save"):
                what = Path(str(args[0] if kind != "save" else args[1])).name
            self.trace.append((kind, what))
            n = len(self.trace)
            self._around(n, "before", kind, what)
            result = real(*args, **kwargs)
            self._around(n, "after", kind, what)
            return result

        return step

    def _around(self, n: int, when: str, kind: str, what: str) -> None:
        if n == self.kill_at and when == self.when:
            self.die()
        if self.at is not None:
            self._inside = True
            try:
                self.at(n, when, kind, what)
            finally:
                self._inside = False


def _die() -> None:
    os._exit(KILLED)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def _build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32)
    return model, opt, step


def _data(n: int = 12) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
    )


def train_loop(directory: Path, points: Points | None, background: bool) -> dict[str, Any]:
    """``epochs()``/``batches()``: 2 epochs of 4 batches, every 2 steps, keep 2, the
    same position saved twice (batch 5), a SIGTERM at batch 7 (saved, stopped)."""
    model, opt, step = _build()
    train_step = step(lambda x, y: F.mse_loss(model(x), y))
    loader = torch.utils.data.DataLoader(_data(), batch_size=3, shuffle=True)
    ckpt = cudakit.Checkpointer(
        directory, step=step, loader=loader, every=2, keep=2, async_save=background,
        preemption=True, requeue=False,
    )  # fmt: skip
    _resume(ckpt, directory, points)
    marker = directory.parent / "sigterm-sent"
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches():
            train_step(x, y)
            if ckpt.position.total == 5:
                ckpt.save()
                ckpt.save()  # the same position saved twice
            if ckpt.position.total == 7 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGTERM)  # saved and stopped at the boundary
    ckpt.close()
    return {"state": _state(model, opt)}


def own_loop(directory: Path, points: Points | None) -> dict[str, Any]:
    """A loop with its own data that calls ``save()`` itself (every 2 steps, twice at
    step 4), ``keep=2``; it continues from the optimizer steps the position holds."""
    model, opt, step = _build()
    train_step = step(lambda x, y: F.mse_loss(model(x), y))
    data = _data(8)
    ckpt = cudakit.Checkpointer(directory, step=step, keep=2, preemption=False)
    _resume(ckpt, directory, points)
    for i in range(ckpt.position.windows, 8):  # the optimizer steps taken so far
        train_step(*data[i : i + 1])
        if i % 2 == 1:
            ckpt.save()
        if i == 3:
            ckpt.save()  # the same position saved twice
    ckpt.close()
    return {"state": _state(model, opt)}


def _resume(ckpt: Any, directory: Path, points: Points | None) -> None:
    ckpt.resume()
    where = "-" if ckpt.resumed_from is None else ckpt.resumed_from.name
    if points is not None:  # (None: rank 1, whose resume is rank 0's)
        with open(directory.parent / "resumed.txt", "a") as f:
            f.write(where + "\n")
        points.install()  # (the first run's steps only: its resume found nothing)


def rank_loop(directory: Path, points: Points | None, rank: int) -> dict[str, Any]:
    """2 ranks, DDP over gloo: ``batches()``, every 2 steps, keep 2."""
    model, opt, step = _build()
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32)
    train_step = step(lambda x, y: F.mse_loss(model(x), y))
    loader = cudakit.distributed_loader(_data(), batch_size=2, seed=3)
    ckpt = cudakit.Checkpointer(
        directory, step=step, loader=loader, every=2, keep=2, preemption=False
    )
    _resume(ckpt, directory, points if rank == 0 else None)
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches():
            train_step(x, y)
    ckpt.close()
    return {"state": _state(model.module, opt)}


# ---------------------------------------------------------------------- runs


def _child(body: Callable[[], dict[str, Any]], out: Path) -> None:
    """In a forked child: run ``body``, write what it returned, exit with its status."""
    code = 0
    try:
        result = body()
        torch.save(result, out)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        print(f"run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _fork(body: Callable[[], dict[str, Any]], out: Path) -> int:
    pid = os.fork()
    if pid == 0:
        _child(body, out)
    return pid


def _wait(pid: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.01)


def _read_trace(trace_file: Path) -> list[tuple[str, str]] | None:
    if not trace_file.exists():
        return None
    trace = [(str(k), str(w)) for k, w in json.loads(trace_file.read_text())]
    trace_file.unlink()
    return trace


def one_process(
    mode: str,
    directory: Path,
    kill: tuple[int, str] | None,
    out: Path,
    at: Callable[[int, str, str, str], None] | None = None,
) -> tuple[int, list[tuple[str, str]] | None]:
    """One attempt of ``mode`` in a forked child; returns its status and its steps."""
    trace_file = out.with_suffix(".trace")

    def body() -> dict[str, Any]:
        points = Points(kill[0] if kill else None, kill[1] if kill else "", _die, at)
        try:
            if mode == "own":
                return own_loop(directory, points)
            return train_loop(directory, points, background=mode == "async")
        finally:
            points.uninstall()
            trace_file.write_text(json.dumps(points.trace))

    rc = _wait(_fork(body, out))
    return rc, _read_trace(trace_file)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_ranks(
    directory: Path, kill: tuple[int, str] | None, peer_only: bool, out: Path
) -> tuple[int, list[tuple[str, str]] | None]:
    """One attempt on 2 ranks (forked, gloo); rank 0 counts the steps and stops."""
    port = _free_port()
    trace_file = out.with_suffix(".trace")
    pids: list[int] = []

    def body(rank: int) -> dict[str, Any]:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        peer = pids[0] if rank == 0 else 0

        def die() -> None:
            os.kill(peer, signal.SIGKILL)  # rank 1, killed while rank 0 is at this step
            if not peer_only:
                os._exit(KILLED)

        points = Points(kill[0] if kill else None, kill[1] if kill else "", die)
        try:
            result = rank_loop(directory, points, rank)
        finally:
            points.uninstall()
            if rank == 0:
                trace_file.write_text(json.dumps(points.trace))
        dist.destroy_process_group()
        return result if rank == 0 else {}

    pids.append(_fork(lambda: body(1), out.with_suffix(".rank1")))
    pid0 = _fork(lambda: body(0), out)
    rc = _wait(pid0, timeout=90)
    _wait(pids[0], timeout=10)
    return rc, _read_trace(trace_file)


def attempt(
    mode: str,
    directory: Path,
    kill: tuple[int, str] | None,
    out: Path,
    at: Callable[[int, str, str, str], None] | None = None,
) -> tuple[int, list[tuple[str, str]] | None]:
    if mode in ("ranks", "peer"):
        return two_ranks(directory, kill, mode == "peer", out)
    return one_process(mode, directory, kill, out, at)


def until_done(mode: str, directory: Path, out: Path) -> tuple[dict[str, Any], list[int]]:
    """Attempts without stops until one finishes (a SIGTERM's stop asks for another)."""
    codes = []
    for _ in range(4):
        rc, _ = attempt(mode, directory, None, out)
        codes.append(rc)
        if rc == 0:
            return torch.load(out, weights_only=False), codes
    raise RuntimeError(f"{mode}: no attempt finished: {codes}")


def published_before(trace: list[tuple[str, str]], n: int, when: str) -> int:
    """The newest checkpoint number made visible before step ``n`` (or at it, after)."""
    newest = -1
    for i, (kind, what) in enumerate(trace, start=1):
        if i > n or (i == n and when == "before"):
            break
        match = _NAME.match(what)
        if kind in ("replace", "rename") and match:
            newest = max(newest, int(match.group(1)))
    return newest


def kill_points(trace: list[tuple[str, str]], mode: str) -> list[tuple[int, str]]:
    """Where a run is really stopped: in the middle of replacing a checkpoint of the same
    name (its predecessor renamed aside) and of removing one (``keep=``); under 2 ranks,
    around rank 0's rename of a checkpoint into place and a removal."""
    found: list[tuple[int, str]] = []
    if mode in ("ranks", "peer"):  # the second checkpoint's rename (one is complete)
        publish = [n for n, (k, w) in enumerate(trace, 1) if k == "replace" and _NAME.match(w)]
        if mode == "peer":
            return [(publish[1], "before")]
        removal = next(n for n, (_, w) in enumerate(trace, 1) if w.endswith(".removing"))
        return [(publish[1], "before"), (publish[1], "after"), (removal, "after")]
    for n, (kind, what) in enumerate(trace, start=1):
        if what.endswith(".replaced") and len(found) < 1:
            found.append((n, "after"))
        elif kind == "unlink" and len(found) == 1 and mode != "async":
            found.append((n, "after"))  # a removal half done
    return found


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def loaded(directory: Path, path: Path | None = None) -> tuple[str, int, dict[str, Any]]:
    """Resume (or load ``path``) in this process: the checkpoint's name, its serial number
    and the state it put into a fresh model and optimizer."""
    from cudakit.checkpoint import _layout as layout

    model, opt, step = _build(seed=1)
    with cudakit.Checkpointer(directory, step=step, preemption=False) as ckpt:
        if path is not None:
            ckpt.load(path)
        else:
            ckpt.resume()
        where = ckpt.resumed_from
    if where is None:
        return "-", 0, {}
    return where.name, layout.read_manifest(where).serial, _state(model, opt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["sync", "async", "own", "ranks", "peer"])
    parser.add_argument("workdir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mode, work = args.mode, args.workdir
    work.mkdir(parents=True, exist_ok=True)
    ref_dir = work / "reference" / "run"
    ref_dir.parent.mkdir()
    snaps, published = work / "snapshots", work / "published"
    snaps.mkdir()
    published.mkdir()

    def snapshot(n: int, when: str, kind: str, what: str) -> None:
        shutil.copytree(ref_dir, snaps / f"{n}-{when}", symlinks=True)
        if when == "after" and kind == "replace" and _NAME.match(what):  # made visible
            serial = json.loads((ref_dir / what / "cudakit.json").read_text())["serial"]
            shutil.copytree(ref_dir / what, published / f"{what}-{serial}", symlinks=True)

    two = mode in ("ranks", "peer")
    rc, trace = attempt(mode, ref_dir, None, work / "ref-first.pt", None if two else snapshot)
    assert trace is not None, f"the reference run recorded nothing (status {rc})"
    reference, _ = until_done(mode, ref_dir, work / "ref.pt")
    rows: list[dict[str, Any]] = []
    expected: dict[tuple[str, int], dict[str, Any]] = {}
    for snap in sorted(snaps.iterdir(), key=lambda p: int(p.name.split("-")[0])):
        n, when = int(snap.name.split("-")[0]), snap.name.split("-")[1]
        name, serial, state = loaded(snap)
        if (name, serial) not in expected and name != "-":
            expected[(name, serial)] = loaded(published, published / f"{name}-{serial}")[2]
        rows.append({
            "how": "copy", "step": n, "when": when, "op": trace[n - 1][0],
            "what": trace[n - 1][1], "resumed_from": name,
            "newest_published": published_before(trace, n, when),
            "equal": name == "-" or equal(state, expected[(name, serial)]),
        })  # fmt: skip
        shutil.rmtree(snap)
    for n, when in kill_points(trace, mode):
        run = work / f"{n}-{when}" / "run"
        run.parent.mkdir()
        first, _ = attempt(mode, run, (n, when), work / "out.pt")
        got, codes = until_done(mode, run, work / "out.pt")
        rows.append({
            "how": "kill", "step": n, "when": when, "op": trace[n - 1][0],
            "what": trace[n - 1][1], "first": first, "codes": codes,
            "resumed_from": (run.parent / "resumed.txt").read_text().split()[1],
            "newest_published": published_before(trace, n, when),
            "equal": equal(got["state"], reference["state"]),
        })  # fmt: skip
        shutil.rmtree(run.parent)
    (work / "report.json").write_text(json.dumps({"trace": trace, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
