"""A kill at any instant of a save leaves a complete checkpoint to resume from.

``fault_points.py`` records every file-system step of a run's saves (each file written,
each rename, each file of a removal) and stops the run at each of them, before and
after, deterministically (see its docstring): in ``epochs()``/``batches()`` with
``every=``, ``keep=`` rotation, the same position saved twice and a SIGTERM's stop,
synchronous and in the background; in a loop that calls ``save()`` itself; and on 2
ranks over gloo, with rank 1 killed while rank 0 renames. After each stop:

* the resume loads a checkpoint at least as new as the newest one that was visible
  before the stop (a half-finished one may be finished: never an older one);
* what it loads is exactly what the run wrote under that name;
* where the run was really killed and run again to its end, its weights and optimizer
  state equal those of the run never stopped, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("fault_points.py")


def _drive(mode: str, work: Path, timeout: float) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"fault_points.py {mode} ran past {timeout} s:\n{out.decode()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing it forked outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    report: dict[str, Any] = json.loads((work / "report.json").read_text())
    return report


def _number(name: str) -> int:
    return -1 if name == "-" else int(name.removeprefix("ckpt-"))


def _check(report: dict[str, Any], kills: int, stopped: int = 99) -> None:
    rows = report["rows"]
    assert rows
    for row in rows:
        where = f"stopped {row['when']} step {row['step']} ({row['op']} {row['what']}): {row}"
        assert _number(row["resumed_from"]) >= row["newest_published"], where
        assert row["equal"], where
    killed = [r for r in rows if r["how"] == "kill"]
    assert len(killed) == kills, killed
    assert all(r["first"] == stopped for r in killed), killed  # (really stopped there)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_at_each_step_of_a_save_in_batches(tmp_path: Path, mode: str) -> None:
    report = _drive(mode, tmp_path, timeout=600)
    kinds = {(row["op"], row["when"]) for row in report["rows"] if row["how"] == "copy"}
    assert {("save", "after"), ("fsync", "after"), ("replace", "before"), ("unlink", "after"),
            ("rmdir", "before"), ("rename", "after")} <= kinds  # fmt: skip
    replaced = [r for r in report["rows"] if r["what"].endswith(".replaced")]
    assert replaced, "the same position saved twice was never replaced"
    _check(report, kills=2 if mode == "sync" else 1)


def test_a_kill_at_each_step_of_a_save_in_a_loop_of_its_own(tmp_path: Path) -> None:
    _check(_drive("own", tmp_path, timeout=600), kills=2)


@pytest.mark.parametrize("mode", ["ranks", "peer"])
def test_a_rank_killed_while_rank_0_renames(tmp_path: Path, mode: str) -> None:
    report = _drive(mode, tmp_path, timeout=600)
    if mode == "ranks":
        _check(report, kills=3)
    else:  # rank 0 went on without rank 1, and failed at its next collective
        _check(report, kills=1, stopped=3)
