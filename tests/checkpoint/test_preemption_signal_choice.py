"""``Checkpointer(preemption=...)`` chooses the stop signals: SLURM's ``--signal=USR2@90``
(submitit's default), SIGHUP, or SIGTERM alone, as well as True/False.

A watched signal other than SIGTERM and SIGINT is a requeue signal under
``requeue="auto"``, as SIGUSR1 is by default.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import make_data

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="POSIX signals")


def _loop(tmp_path: Path, signum: int, **kwargs: Any) -> None:
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=4)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, **kwargs)
    try:
        for _ in ckpt.epochs(3):
            for x, y in ckpt.batches():
                if ckpt.position.total == 3:
                    os.kill(os.getpid(), signum)
                with step:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                step.backward(loss)
    finally:
        ckpt.close()


def _requeues(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    asked: list[str] = []
    monkeypatch.setattr(
        "cudakit.checkpoint._preemption.requeue_slurm_job", lambda: asked.append("x") or None
    )
    return asked


@pytest.mark.parametrize(
    "preemption",
    [signal.SIGUSR2, "USR2", "SIGUSR2", ["SIGTERM", "usr2"]],
    ids=["Signals", "USR2", "SIGUSR2", "a list"],
)
def test_a_chosen_signal_saves_exits_and_requeues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preemption: Any
) -> None:
    asked = _requeues(monkeypatch)
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(SystemExit) as info:
        _loop(tmp_path, signal.SIGUSR2, preemption=preemption)
    assert info.value.code == 128 + int(signal.SIGUSR2)
    latest = cudakit.find_latest(tmp_path)
    assert latest is not None
    assert latest.name == "ckpt-0000000003"
    assert asked == ["x"]  # a requeue signal, as SIGUSR1 is by default
    assert signal.getsignal(signal.SIGUSR2) == before  # put back


def test_sigterm_alone_leaves_sigusr1_alone(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = signal.getsignal(signal.SIGUSR1)
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption="SIGTERM"):
        assert signal.getsignal(signal.SIGUSR1) == before
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)


def test_sigterm_does_not_requeue_under_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _requeues(monkeypatch)
    with pytest.raises(SystemExit) as info:
        _loop(tmp_path, signal.SIGTERM, preemption=("SIGTERM", "SIGUSR2"))
    assert info.value.code == 143
    assert asked == []


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (2.5, TypeError, "got float 2.5"),
        ([signal.SIGTERM, 1.0], TypeError, "got float 1.0"),
        ({"SIGTERM": 1}, TypeError, "got dict"),
        ("SIGFOO", ValueError, "'SIGFOO'"),
        (1, TypeError, "got int 1"),
        (int(signal.SIGUSR2), TypeError, "got int"),
        (signal.SIGKILL, ValueError, "cannot be caught"),
        ("STOP", ValueError, "cannot be caught"),
    ],
    ids=["float", "float in a list", "dict", "unknown name", "1", "a number", "SIGKILL", "STOP"],
)
def test_a_wrong_preemption_is_refused_with_its_fix(
    tmp_path: Path, value: Any, error: type[Exception], words: str
) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    with pytest.raises(error) as info:
        cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=value)
    message = str(info.value)
    assert "Checkpointer(preemption=" in message
    assert words in message
    assert "SIGUSR2" in message  # the fix shows a form that works
    assert {s: signal.getsignal(s) for s in before} == before
    assert not any(tmp_path.iterdir())


def test_ctrl_c_watched_saves_and_exits_130_without_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _requeues(monkeypatch)
    with pytest.raises(SystemExit) as info:
        _loop(tmp_path, signal.SIGINT, preemption=["SIGTERM", "SIGINT"])
    assert info.value.code == 130
    latest = cudakit.find_latest(tmp_path)
    assert latest is not None
    assert latest.name == "ckpt-0000000003"
    assert asked == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_interrupts_as_without_the_watch(tmp_path: Path) -> None:
    """The first Ctrl-C asks for the save; a second one (a hang, a long evaluation) raises
    KeyboardInterrupt, so the process can always be stopped."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cudakit.Checkpointer(
        tmp_path, model=model, optimizer=opt, preemption=["SIGTERM", "SIGINT"]
    ) as ckpt:
        os.kill(os.getpid(), signal.SIGINT)
        assert ckpt.stop_requested
        with pytest.raises(KeyboardInterrupt):  # (Python runs the handler at once)
            os.kill(os.getpid(), signal.SIGINT)


def test_every_rank_exits_with_the_agreed_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that got different signals, or none, exit alike: SIGTERM's among several."""
    from cudakit.checkpoint import _preemption as preemption

    monkeypatch.setattr(preemption, "requeue_slurm_job", lambda: None)
    term, usr1, usr2 = int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGUSR2)

    class Watch:
        def __init__(self, *got: int) -> None:
            self.signum = got[0] if got else None
            self.seen = list(got)

    for agreed in [(term, usr1), (usr1, term), (usr2, term)]:
        codes = {
            preemption.after_stop(1, agreed, Watch(*got), "auto", None)  # type: ignore[arg-type]
            for got in [(), (usr1,), (term,), (usr2,)]
        }
        assert codes == {128 + term}
    codes = {
        preemption.after_stop(1, (usr2,), Watch(*got), "auto", None)  # type: ignore[arg-type]
        for got in [(), (usr2,)]
    }
    assert codes == {128 + usr2}
