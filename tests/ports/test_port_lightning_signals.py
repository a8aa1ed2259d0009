"""Preemption signals, ported from Lightning's signal-connector tests (and submitit's,
composer's requeue cases) to :class:`cudakit.Checkpointer`.

What Lightning establishes, and cudakit must hold too:

- SIGTERM ends the run with status 143 (128 + SIGTERM), after a checkpoint; SIGUSR1
  (SLURM's ``--signal``) saves and runs ``scontrol requeue <job>`` (``<array>_<task>``
  for an array task), once, on rank 0; a failed requeue is reported, not raised;
- a handler the user installed before keeps running (chained), and the handlers that
  were there before are put back exactly when the Checkpointer closes;
- made in a thread other than the main one, nothing crashes (signals are the main
  thread's);
- across ranks, a signal that reached one rank stops every rank at the same boundary.

The process-level behaviour is tested with real signals (``os.kill``) sent to real
child processes running a small training loop (port_signal_helpers.py); the handler
mechanics in this process. ``scontrol`` is a script on ``PATH`` that records its
arguments.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import cudakit
from cudakit.checkpoint import _preemption as preemption

sys.path.insert(0, str(Path(__file__).resolve().parent))
import port_signal_helpers as helpers
from launcher_env import free_port

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGUSR1"), reason="POSIX signals (SIGUSR1) are not on this platform"
)

SIGTERM = signal.SIGTERM
SIGUSR1 = getattr(signal, "SIGUSR1", signal.SIGTERM)


@pytest.fixture(autouse=True)
def keep_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test leaves SIGTERM/SIGUSR1 as it found them, and sees no SLURM job."""
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    saved = {sig: signal.getsignal(sig) for sig in (SIGTERM, SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _own_loop_until_stop(ckpt: cudakit.Checkpointer, signum: int) -> None:
    """One batch of an own-data loop, a signal to this process, then the boundary."""
    ckpt.resume()
    os.kill(os.getpid(), signum)
    ckpt.maybe_save()  # counts the batch and, a stop being agreed, saves and exits
    raise AssertionError("maybe_save() returned after a stop signal")


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


# --------------------------------------------------------------------------- handlers


def _users_handler(signum: int, frame: FrameType | None) -> None:
    """A handler of the user's own (module level: comparable after a restore)."""


@pytest.mark.parametrize("sig", [SIGTERM, SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
@pytest.mark.parametrize(
    "before", [signal.SIG_DFL, signal.SIG_IGN, _users_handler], ids=["default", "ignore", "user"]
)
def test_handlers_are_put_back_exactly_after_close(
    tmp_path: Path, sig: signal.Signals, before: Any
) -> None:
    signal.signal(sig, before)
    ckpt = cudakit.Checkpointer(tmp_path, model=_model())
    assert signal.getsignal(sig) is not before  # watching
    ckpt.close()
    assert signal.getsignal(sig) is before
    ckpt.close()  # idempotent
    assert signal.getsignal(sig) is before


def test_preemption_false_installs_nothing(tmp_path: Path) -> None:
    signal.signal(SIGUSR1, _users_handler)
    ckpt = cudakit.Checkpointer(tmp_path, model=_model(), preemption=False)
    assert signal.getsignal(SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(SIGUSR1) is _users_handler
    ckpt.close()


def test_the_users_handler_runs_for_every_signal_and_the_stop_still_happens(
    tmp_path: Path,
) -> None:
    seen: list[int] = []
    signal.signal(SIGTERM, lambda signum, frame: seen.append(signum))
    ckpt = cudakit.Checkpointer(tmp_path, model=_model())
    os.kill(os.getpid(), SIGTERM)
    os.kill(os.getpid(), SIGTERM)
    assert seen == [SIGTERM, SIGTERM]
    assert ckpt.stop_requested
    with pytest.raises(SystemExit) as info:
        ckpt.maybe_save()
    assert info.value.code == 143
    assert cudakit.find_latest(tmp_path) is not None


def test_a_checkpointer_made_in_a_thread_does_not_crash_nor_touch_signals(
    tmp_path: Path,
) -> None:
    """Lightning's test_signal_connector_in_thread: signal.signal() only works in the
    main thread, so a Checkpointer made elsewhere watches nothing, and says nothing."""
    signal.signal(SIGTERM, _users_handler)

    def make_and_close() -> bool:
        ckpt = cudakit.Checkpointer(tmp_path, model=_model())
        watching = ckpt.stop_requested
        ckpt.close()
        return watching

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(make_and_close).result(timeout=30) is False
    assert signal.getsignal(SIGTERM) is _users_handler
    assert signal.getsignal(SIGUSR1) is signal.SIG_DFL


def test_two_checkpointers_closed_in_the_order_they_were_made_give_the_handler_back(
    tmp_path: Path,
) -> None:
    """A second Checkpointer chains the first; closing the first (not the newest) must
    neither lose the user's handler nor leave a closed one installed."""
    seen: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    signal.signal(SIGTERM, mine)
    first = cudakit.Checkpointer(tmp_path / "a", model=_model())
    second = cudakit.Checkpointer(tmp_path / "b", model=_model())
    first.close()
    os.kill(os.getpid(), SIGTERM)
    assert seen == [SIGTERM]  # still chained through the closed one
    assert second.stop_requested
    second.close()
    assert signal.getsignal(SIGTERM) is mine
    os.kill(os.getpid(), SIGTERM)
    assert seen == [SIGTERM, SIGTERM]


def test_two_checkpointers_closed_in_creation_order_leave_sigterm_deadly(
    tmp_path: Path,
) -> None:
    """Without a handler of the user's, SIGTERM must end the process again once every
    Checkpointer is closed, whatever the order of the closes."""
    code = f"""
        import os, signal, time, torch, cudakit
        first = cudakit.Checkpointer({str(tmp_path / "a")!r}, model=torch.nn.Linear(1, 1))
        second = cudakit.Checkpointer({str(tmp_path / "b")!r}, model=torch.nn.Linear(1, 1))
        first.close()
        second.close()
        print("installed:", signal.getsignal(signal.SIGTERM), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived SIGTERM", flush=True)
    """
    status, out = _python(code)
    assert status == -SIGTERM, out


def test_closing_in_another_thread_does_not_leave_sigterm_swallowed(tmp_path: Path) -> None:
    """close() from a worker thread cannot call signal.signal(); the closed
    Checkpointer's handler must still not keep a SIGTERM from ending the process."""
    code = f"""
        import os, signal, threading, time, torch, cudakit
        ckpt = cudakit.Checkpointer({str(tmp_path)!r}, model=torch.nn.Linear(1, 1))
        worker = threading.Thread(target=ckpt.close)
        worker.start(); worker.join()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived SIGTERM", flush=True)
    """
    status, out = _python(code)
    assert status == -SIGTERM, out


def _python(code: str, timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=helpers.child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return helpers.finish(proc, timeout)


# --------------------------------------------------------------------------- requeue


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A recording ``scontrol`` first on PATH; returns the file of its calls."""
    calls = helpers.fake_scontrol(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return calls


def _calls(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_sigusr1_under_slurm_requeues_the_job_and_exits_138(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    ckpt = cudakit.Checkpointer(tmp_path / "ckpt", model=_model())
    with pytest.raises(SystemExit) as info:
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert info.value.code == 128 + SIGUSR1
    assert _calls(scontrol) == ["requeue 12345"]
    assert cudakit.find_latest(tmp_path / "ckpt") is not None


def test_an_array_task_requeues_itself_not_the_array(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "12346")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    ckpt = cudakit.Checkpointer(tmp_path / "ckpt", model=_model())
    with pytest.raises(SystemExit):
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert _calls(scontrol) == ["requeue 12345_2"]


def test_an_array_job_id_without_its_task_id_requeues_the_job_id(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never the whole array: the task's own SLURM_JOB_ID names it alone."""
    monkeypatch.setenv("SLURM_JOB_ID", "12346")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12345")
    assert preemption.requeue_slurm_job() == "scontrol requeue 12346"
    assert _calls(scontrol) == ["requeue 12346"]


@pytest.mark.parametrize("job", ["invalid", "12345; rm -rf ~", "-1", ""])
def test_a_job_id_that_is_no_job_id_is_not_passed_to_scontrol(
    scontrol: Path, monkeypatch: pytest.MonkeyPatch, job: str
) -> None:
    """Lightning refuses SLURM_JOB_ID=invalid before calling scontrol."""
    monkeypatch.setenv("SLURM_JOB_ID", job)
    preemption.requeue_slurm_job()
    assert _calls(scontrol) == []


def test_sigterm_does_not_requeue_unless_asked(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    ckpt = cudakit.Checkpointer(tmp_path / "a", model=_model())
    with pytest.raises(SystemExit) as info:
        _own_loop_until_stop(ckpt, SIGTERM)
    assert info.value.code == 143
    assert _calls(scontrol) == []
    forced = cudakit.Checkpointer(tmp_path / "b", model=_model(), requeue=True)
    with pytest.raises(SystemExit):
        _own_loop_until_stop(forced, SIGTERM)
    assert _calls(scontrol) == ["requeue 77"]


def test_requeue_false_never_calls_scontrol(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    ckpt = cudakit.Checkpointer(tmp_path / "a", model=_model(), requeue=False)
    with pytest.raises(SystemExit) as info:
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert info.value.code == 128 + SIGUSR1
    assert _calls(scontrol) == []


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_no_requeue_from_the_interactive_shell_of_salloc(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Lightning takes SLURM_JOB_NAME bash/interactive for no batch job (nothing to
    requeue), as cudakit's launcher reading does."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", name)
    ckpt = cudakit.Checkpointer(tmp_path / "a", model=_model())
    with pytest.raises(SystemExit) as info:
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert info.value.code == 128 + SIGUSR1
    assert _calls(scontrol) == []


class _SignalDuringSave:
    """An extra whose state (read inside the save) sends this process ``signum``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def state_dict(self) -> dict[str, int]:
        os.kill(os.getpid(), self.signum)
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_a_sigusr1_during_the_save_of_a_sigterm_still_requeues(
    tmp_path: Path, scontrol: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM's --signal=USR1 arriving while the preemption's SIGTERM save is written:
    the job still asks to be requeued, and exits with SIGTERM's status."""
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    extra = {"late": _SignalDuringSave(SIGUSR1)}
    ckpt = cudakit.Checkpointer(tmp_path / "ckpt", model=_model(), extra=extra)
    with pytest.raises(SystemExit) as info:
        _own_loop_until_stop(ckpt, SIGTERM)
    assert info.value.code == 143
    assert _calls(scontrol) == ["requeue 31"]
    assert cudakit.find_latest(tmp_path / "ckpt") is not None


def test_a_failed_requeue_is_reported_and_the_run_still_exits_for_the_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = helpers.fake_scontrol(tmp_path / "bin", status=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    ckpt = cudakit.Checkpointer(tmp_path / "ckpt", model=_model())
    with (
        caplog.at_level(logging.WARNING, logger="cudakit.checkpoint"),
        pytest.raises(SystemExit) as info,
    ):
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert info.value.code == 128 + SIGUSR1
    assert _calls(calls) == ["requeue 4242"]
    assert "scontrol requeue 4242 failed with status 1: scontrol: fake failure" in caplog.text


def test_an_scontrol_that_cannot_run_does_not_turn_the_stop_into_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    broken = bin_dir / "scontrol"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    ckpt = cudakit.Checkpointer(tmp_path / "ckpt", model=_model())
    with (
        caplog.at_level(logging.WARNING, logger="cudakit.checkpoint"),
        pytest.raises(SystemExit) as info,
    ):
        _own_loop_until_stop(ckpt, SIGUSR1)
    assert info.value.code == 128 + SIGUSR1
    assert "scontrol requeue 4242 failed" in caplog.text
    assert cudakit.find_latest(tmp_path / "ckpt") is not None
    assert signal.getsignal(SIGUSR1) is signal.SIG_DFL  # closed on the way out


# --------------------------------------------------------------------------- child processes


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SIGTERM sent while batch 3 is in hand (mid-window, accumulate=2), a second one
    while the checkpoint is being written, with the user's own handlers installed; then
    the same command again (the requeued job)."""
    root = tmp_path_factory.mktemp("sigterm")
    ckpt_dir, ready, log = root / "ckpt", root / "ready", root / "user.log"
    common = ("--dir", ckpt_dir, "--user-log", log, "--hold-save", "--ready", ready)
    proc = helpers.start(*common, "--out", root / "stopped.pt", "--pause-at", "3")
    try:
        helpers.wait_for(ready, [proc])
        os.kill(proc.pid, SIGTERM)
        helpers.wait_for(ready.with_suffix(".saving"), [proc])
        os.kill(proc.pid, SIGTERM)  # the second signal, during the save
        status, out = helpers.finish(proc)
    finally:
        helpers.kill(proc)
    stopped_at = cudakit.find_latest(ckpt_dir)
    partials = sorted(p.name for p in ckpt_dir.glob("*.partial"))
    resumed = helpers.start(*common, "--out", root / "resumed.pt")
    resumed_status, resumed_out = helpers.finish(resumed)
    return {
        "status": status,
        "out": out,
        "stopped_at": stopped_at,
        "partials": partials,
        "user_log": log.read_text().split() if log.exists() else [],
        "stopped_pt": root / "stopped.pt",
        "resumed_status": resumed_status,
        "resumed_out": resumed_out,
        "resumed": root / "resumed.pt",
        "root": root,
    }


def test_sigterm_exits_143_after_saving(sigterm_run: dict[str, Any]) -> None:
    assert sigterm_run["status"] == 143, sigterm_run["out"][-3000:]
    assert "exiting with status 143" in sigterm_run["out"]
    assert not sigterm_run["stopped_pt"].exists()  # the loop did not run on


def test_a_signal_mid_window_saves_at_the_windows_end(sigterm_run: dict[str, Any]) -> None:
    # Batch 3 opened the window of batches 3-4: the checkpoint is at its end.
    assert sigterm_run["stopped_at"] is not None
    assert sigterm_run["stopped_at"].name == "ckpt-0000000002"


def test_the_users_handler_ran_for_both_signals(sigterm_run: dict[str, Any]) -> None:
    assert sigterm_run["user_log"] == [str(int(SIGTERM))] * 2


def test_a_second_signal_during_the_save_leaves_a_complete_checkpoint(
    sigterm_run: dict[str, Any],
) -> None:
    assert sigterm_run["partials"] == []
    assert sigterm_run["resumed_status"] == 0, sigterm_run["resumed_out"][-3000:]


def test_the_requeued_run_ends_bit_for_bit_as_one_never_stopped(
    sigterm_run: dict[str, Any],
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the children
    try:
        ref = helpers.train(
            sigterm_run["root"] / "reference",
            preemption=False,
            hold_save=True,
            ready=sigterm_run["root"] / "unused",
        )
    finally:
        torch.set_num_threads(threads)
    got = torch.load(sigterm_run["resumed"], weights_only=False)
    assert got["resumed_from"] == "ckpt-0000000002"
    for name, tensor in ref["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["losses"] == {k: v for k, v in ref["losses"].items() if k > 4}
    for key, state in ref["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(got["optim"]["state"][key][name]), value)


def test_sigusr1_from_outside_saves_requeues_once_and_exits_138(tmp_path: Path) -> None:
    """A batch job (`python train.py` in the sbatch script, no srun) told by SLURM's
    --signal=USR1@90 that its time is running out."""
    calls = helpers.fake_scontrol(tmp_path / "bin")
    env = {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
    }
    ready = tmp_path / "ready"
    proc = helpers.start(
        "--dir", tmp_path / "ckpt", "--out", tmp_path / "o.pt", "--pause-at", "5",
        "--ready", ready, env=env,
    )  # fmt: skip
    try:
        helpers.wait_for(ready, [proc])
        os.kill(proc.pid, SIGUSR1)
        status, out = helpers.finish(proc)
    finally:
        helpers.kill(proc)
    assert status == 128 + SIGUSR1, out[-3000:]
    assert _calls(calls) == ["requeue 4242"]
    latest = cudakit.find_latest(tmp_path / "ckpt")
    assert latest is not None
    assert latest.name == "ckpt-0000000003"


# --------------------------------------------------------------------------- two ranks


def _two_ranks(
    tmp_path: Path, envs: list[dict[str, str]], target: int, signum: int
) -> tuple[list[int], list[str]]:
    """Two gloo ranks of the helper's DDP run; ``signum`` goes to rank ``target`` only,
    while it holds batch 3 (the other rank runs on until DDP's all-reduce waits)."""
    ready = tmp_path / "ready"
    procs = []
    for rank, env in enumerate(envs):
        args: list[str | Path] = ["--dir", tmp_path / "ckpt", "--out", tmp_path / "out.pt", "--ddp"]
        if rank == target:
            args += ["--pause-at", "3", "--ready", ready]
        procs.append(helpers.start(*args, env=env))
    try:
        helpers.wait_for(ready, procs)
        os.kill(procs[target].pid, signum)
        results = [helpers.finish(p, timeout=90) for p in procs]
    finally:
        for p in procs:
            helpers.kill(p)
    assert all(p.poll() is not None for p in procs)  # nothing outlives the test
    return [s for s, _ in results], [o for _, o in results]


@pytest.mark.distributed
def test_a_sigterm_to_rank_0_only_stops_both_ranks_at_one_boundary(tmp_path: Path) -> None:
    port = str(free_port())
    envs = [
        {
            "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }
        for r in range(2)
    ]  # fmt: skip
    statuses, outs = _two_ranks(tmp_path, envs, target=0, signum=SIGTERM)
    assert statuses == [143, 143], "\n".join(o[-2000:] for o in outs)
    latest = cudakit.find_latest(tmp_path / "ckpt")
    # Noted during the window 3-4, agreed at the next boundary (6): one checkpoint there.
    assert latest is not None
    assert latest.name == "ckpt-0000000003"
    assert not list((tmp_path / "ckpt").glob("*.partial"))


@pytest.mark.distributed
def test_a_sigusr1_to_rank_1_only_requeues_from_rank_0_and_both_exit_138(
    tmp_path: Path,
) -> None:
    """srun's tasks (SLURM's variables, no torchrun): the signal reached rank 1 first
    (SLURM signals the tasks one by one); rank 0 must still requeue, once."""
    calls = helpers.fake_scontrol(tmp_path / "bin")
    port = str(free_port())
    envs = [
        {
            "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for r in range(2)
    ]  # fmt: skip
    statuses, outs = _two_ranks(tmp_path, envs, target=1, signum=SIGUSR1)
    assert statuses == [128 + SIGUSR1] * 2, "\n".join(o[-2000:] for o in outs)
    assert _calls(calls) == ["requeue 4242"]
    latest = cudakit.find_latest(tmp_path / "ckpt")
    assert latest is not None
    assert latest.name == "ckpt-0000000003"
