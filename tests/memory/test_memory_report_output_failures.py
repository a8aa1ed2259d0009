"""memory_report's line cannot be written (a full disk, a closed file, a stream that wants
bytes, a log function that fails): the block's own exception goes on with a note, and a
stream that can never take the line is refused at the door."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest

from cudakit.memory import memory_report


class _Mine(Exception):
    """The user's own error, raised inside the measured block."""


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.fixture
def full_disk() -> Any:
    """A text file whose writes fail with ENOSPC, as on a full disk (/dev/full)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    f = open("/dev/full", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
    yield f
    with contextlib.suppress(OSError):  # the line that could not be written is still buffered
        f.close()


class _WantsBytes:
    """A stream that passes the door (it has .write) but takes only bytes."""

    name = "wants-bytes"

    def write(self, data: bytes) -> int:
        if not isinstance(data, bytes):
            raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'")
        return len(data)


def _closed_file(tmp_path: Path) -> Any:
    return open(tmp_path / "report.log", "w", encoding="utf-8")


# -- the block's own exception goes on ---------------------------------------------------


def test_a_full_disk_keeps_the_blocks_own_exception(full_disk: Any) -> None:
    with pytest.raises(_Mine) as info, memory_report("step", device="cpu", file=full_disk):
        raise _Mine("the user's error")
    assert str(info.value) == "the user's error"
    assert (
        "cudakit.memory_report 'step' could not write its line to '/dev/full': "
        "OSError: [Errno 28] No space left on device" in _notes(info.value)
    )


def test_a_file_closed_before_the_block_ends_keeps_the_blocks_own_exception(
    tmp_path: Path,
) -> None:
    f = _closed_file(tmp_path)
    rep = memory_report("step", device="cpu", file=f)

    def block() -> None:
        with rep:
            f.close()
            raise _Mine("the user's error")

    with pytest.raises(_Mine) as info:
        block()
    assert "could not write its line to" in _notes(info.value)
    assert "ValueError: I/O operation on closed file" in _notes(info.value)
    assert rep.last is not None  # the report itself is kept
    assert rep.last.raised == "_Mine"


def test_a_stream_that_wants_bytes_keeps_the_blocks_own_exception() -> None:
    with pytest.raises(_Mine) as info, memory_report("step", device="cpu", file=_WantsBytes()):
        raise _Mine("the user's error")
    assert (
        "could not write its line to 'wants-bytes': TypeError: a bytes-like object is "
        "required, not 'str'" in _notes(info.value)
    )


def test_a_failing_log_function_keeps_the_blocks_own_exception() -> None:
    def log(line: str) -> None:
        raise ConnectionError("the log server went away")

    with pytest.raises(_Mine) as info, memory_report("step", device="cpu", log=log):
        raise _Mine("the user's error")
    assert "could not write its line to log=: ConnectionError: the log server went away" in _notes(
        info.value
    )


def test_a_keyboard_interrupt_keeps_going_past_a_full_disk(full_disk: Any) -> None:
    with pytest.raises(KeyboardInterrupt), memory_report(device="cpu", file=full_disk):
        raise KeyboardInterrupt


# -- a block that succeeded: the write failure is the error ------------------------------


def test_a_full_disk_after_a_good_block_raises_the_write_error_with_a_note(
    full_disk: Any,
) -> None:
    rep = memory_report("step", device="cpu", file=full_disk)
    with pytest.raises(OSError, match="No space left on device") as info, rep:
        pass
    assert info.value.errno == errno.ENOSPC
    assert "cudakit.memory_report 'step' could not write its line to '/dev/full'" in _notes(
        info.value
    )
    assert rep.last is not None  # measured all the same
    assert rep.last.raised is None


# -- at the door -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stream", [io.BytesIO(), io.BufferedWriter(io.BytesIO())], ids=["BytesIO", "BufferedWriter"]
)
def test_a_binary_stream_is_refused_at_the_door(stream: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"memory_report\(file=\.\.\.\) expects a text stream .*got "
        + type(stream).__name__
        + r" .*It is a binary stream: open the file with 'w'",
    ):
        memory_report(device="cpu", file=stream)


def test_a_file_opened_for_bytes_is_refused_at_the_door(tmp_path: Path) -> None:
    with (
        open(tmp_path / "report.log", "wb") as f,
        pytest.raises(TypeError, match=r"got BufferedWriter .*It is a binary stream"),
    ):
        memory_report(device="cpu", file=f)


def test_a_closed_file_is_refused_at_the_door(tmp_path: Path) -> None:
    f = _closed_file(tmp_path)
    f.close()
    with pytest.raises(
        ValueError, match=r"memory_report\(file=\.\.\.\) got a closed file .*report\.log"
    ):
        memory_report(device="cpu", file=f)


def test_the_bare_decorator_form_refuses_a_binary_stream_too() -> None:
    def step() -> None:
        pass

    with pytest.raises(TypeError, match="It is a binary stream"):
        memory_report(step, file=io.BytesIO())  # type: ignore[call-overload]
