"""launch() answers every bad argument before it starts a process."""

from __future__ import annotations

import pytest
from launcher_env import clean_launcher_env  # noqa: F401 (autouse fixture)

import cudakit.parallel as cp


def test_launch_start_method_kind_and_value() -> None:
    with pytest.raises(TypeError, match=r"launch\(start_method=\.\.\.\) .*'spawn'.*got int 3"):
        cp.launch(print, nprocs=1, start_method=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"launch\(start_method=\.\.\.\) .* got str 'thread'"):
        cp.launch(print, nprocs=1, start_method="thread")  # type: ignore[arg-type]


def test_launch_argument_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"launch\(nprocs=\.\.\.\) expects an int >= 1, got int 0\. It counts the processes",
    ):
        cp.launch(print, nprocs=0)
    with pytest.raises(TypeError, match=r"launch\(nprocs=\.\.\.\) expects an int >= 1, got str"):
        cp.launch(print, nprocs="2")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"launch\(timeout=\.\.\.\) expects a positive finite number of seconds"
    ):
        cp.launch(print, nprocs=1, timeout="10")  # type: ignore[arg-type]
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(
            ValueError,
            match=r"timeout=\.\.\.\) expects a positive finite number of seconds, or None, got",
        ):
            cp.launch(print, nprocs=1, timeout=bad)
    with pytest.raises(TypeError, match=r"cannot be pickled .* Define it at module level"):
        cp.launch(lambda: None, nprocs=1)
    with pytest.raises(ValueError, match=r"start_method=\.\.\.\) expects one of 'spawn'"):
        cp.launch(print, nprocs=1, start_method="thread")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects a function to run, got int"):
        cp.launch(3, nprocs=1)  # type: ignore[arg-type]
