"""launch() answers every bad argument before it starts a process."""

from __future__ import annotations

import pytest

import cudakit.parallel as cp


def test_launch_start_method_kind_and_value() -> None:
    with pytest.raises(TypeError, match=r"launch\(start_method=\.\.\.\) .*'spawn'.*got int 3"):
        cp.launch(print, nprocs=1, start_method=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"launch\(start_method=\.\.\.\) .* got str 'thread'"):
        cp.launch(print, nprocs=1, start_method="thread")  # type: ignore[arg-type]
