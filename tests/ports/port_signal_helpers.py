"""What test_port_lightning_signals.py shares: a tiny training run in a child process.

Run as a script, this module trains a small model for 2 epochs with a
:class:`cudakit.Checkpointer` (``autocast_step`` with ``accumulate=2``, AdamW, a
shuffling loader) and writes its final weights and losses to ``--out``::

    python port_signal_helpers.py --dir D --out O [--pause-at K] [--ready F]
                                  [--user-log F] [--hold-save] [--ddp]

``--pause-at K`` stops the loop while batch K is in hand (before its step), after
writing the ready file ``F``, until a stop signal arrives: the test sends the signal
from outside, with ``os.kill``, and knows where the run stood. ``--user-log F``
installs the user's own SIGTERM/SIGUSR1 handler (it appends each signal's number to
``F``) before the Checkpointer exists. ``--hold-save`` makes the first save after the
signal wait inside the save (an extra's ``state_dict``), after writing ``F.saving``,
until a second signal arrives. ``--ddp`` runs one rank of a gloo group whose
environment (torchrun's or SLURM's) the test set.

The parent side (start, wait for the ready file, finish with a finite timeout and
nothing left running) is :func:`start`, :func:`wait_for` and :func:`finish`;
:func:`fake_scontrol` puts an ``scontrol`` on ``PATH`` that records its arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import cudakit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: The variables a launcher or SLURM sets; a child starts without the test runner's.
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC", "PET_")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
EPOCHS = 2
BATCHES = 12  # per epoch in one process (48 samples, batches of 4)


def build(*, ddp: bool = False) -> tuple[nn.Module, Any, Any]:
    """The model (DDP-wrapped with ``ddp``), its optimizer and the ``autocast_step``
    (accumulate=2), seeded."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    if ddp:
        import cudakit.parallel as cp

        model = cp.parallelize(model, "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=2)
    return model, opt, step


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)
    )


def train(
    directory: Path,
    *,
    pause_at: int = -1,
    ready: Path | None = None,
    hold_save: bool = False,
    ddp: bool = False,
    preemption: bool = True,
) -> dict[str, Any]:
    """Train 2 epochs under a Checkpointer; returns the weights, optimizer state, losses."""
    model, opt, step = build(ddp=ddp)
    if ddp:
        loader: Any = cudakit.distributed_loader(dataset(), batch_size=4, seed=3)
    else:
        loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True)

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    holder = _HoldSave(ready) if hold_save and ready is not None else None
    ckpt = cudakit.Checkpointer(
        directory,
        step=train_step,
        loader=loader,
        extra={"hold": holder} if holder is not None else None,
        preemption=preemption,
    )
    if holder is not None:
        holder.ckpt = ckpt
    losses: dict[int, float] = {}
    for _ in ckpt.epochs(EPOCHS):
        for x, y in ckpt.batches():
            total = ckpt.position.total
            if total == pause_at:
                _pause_for_signal(ckpt, ready)
            losses[total] = float(train_step(x, y).loss)
    ckpt.close()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": opt.state_dict(),
        "losses": losses,
        "resumed_from": None if ckpt.resumed_from is None else ckpt.resumed_from.name,
    }


def _pause_for_signal(ckpt: cudakit.Checkpointer, ready: Path | None) -> None:
    """Tell the test where the run stands, then wait (finitely) for its signal."""
    if ready is not None:
        ready.write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not ckpt.stop_requested and time.monotonic() < deadline:
        time.sleep(0.005)


class _HoldSave:
    """An extra whose ``state_dict`` (called inside a save) waits for a second signal
    once a stop was requested: the test sends it while the checkpoint is being written."""

    def __init__(self, ready: Path) -> None:
        self.flag = ready.with_suffix(".saving")
        self.ckpt: cudakit.Checkpointer | None = None
        self.held = False

    def state_dict(self) -> dict[str, Any]:
        if self.ckpt is not None and self.ckpt.stop_requested and not self.held:
            self.held = True
            before = len(_SEEN)
            self.flag.write_text("saving")
            deadline = time.monotonic() + 60
            while len(_SEEN) == before and time.monotonic() < deadline:
                time.sleep(0.005)
        return {"held": self.held}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.held = bool(state["held"])


_SEEN: list[int] = []


def _install_user_handlers(log: Path) -> None:
    """The user's own handlers, installed before the Checkpointer (chained by it)."""

    def mine(signum: int, frame: FrameType | None) -> None:
        _SEEN.append(signum)
        with log.open("a") as f:
            f.write(f"{signum}\n")

    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGUSR1, mine)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--user-log", type=Path)
    parser.add_argument("--hold-save", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.user_log is not None:
        _install_user_handlers(args.user_log)
    run = {"pause_at": args.pause_at, "ready": args.ready, "hold_save": args.hold_save}
    if args.ddp:
        with cudakit.process_group(timeout=datetime.timedelta(seconds=40)):
            import cudakit.parallel as cp

            result = train(args.dir, ddp=True, **run)
            rank = cp.rank()
        torch.save(result, args.out.with_name(f"{args.out.stem}-{rank}.pt"))
    else:
        torch.save(train(args.dir, **run), args.out)


# --------------------------------------------------------------------------- parent side


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's or SLURM's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_VARS
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def start(*args: str | Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start this module as a training child (its own session: nothing outlives a kill)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *map(str, args)]
    return subprocess.Popen(
        cmd,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    """Wait until ``path`` exists; fail early (with the output) if a child ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise AssertionError(
                    f"child {proc.pid} ended with status {proc.returncode} before "
                    f"{path.name} appeared:\n{out[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout:g} s")
        time.sleep(0.01)


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, str]:
    """Wait for the child (its whole session is killed past ``timeout``); status, output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(
            f"child {proc.pid} ran past {timeout:g} s:\n{out.decode(errors='replace')[-3000:]}"
        ) from None
    finally:
        kill(proc)
    return proc.returncode, out.decode(errors="replace")


def kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole session (a no-op once everything in it has ended)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def fake_scontrol(bin_dir: Path, *, status: int = 0) -> Path:
    """An ``scontrol`` in ``bin_dir`` that appends its arguments to ``bin_dir/calls``
    and exits with ``status``; returns the calls file."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = bin_dir / "calls"
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> "{calls}"\necho "scontrol: fake failure" >&2\nexit {status}\n'
        if status
        else f'#!/bin/sh\necho "$@" >> "{calls}"\nexit 0\n'
    )
    script.chmod(0o755)
    return calls


if __name__ == "__main__":
    main()
