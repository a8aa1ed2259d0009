"""memory_report(record_history=..., stacks=...): Python stacks only unless asked for all.

Recorded with C++ frames too, a history dump can take minutes (torchtitan PR#3628:
about 461 s with stacks="all" against about 4 s with "python"). Runs on the CPU: the
report's probe is the real one for the history (torch.cuda.memory._record_memory_history
faked) and a pretend GPU for the counters.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from cudakit.memory import _probes, memory_report


class _PretendGpu(_probes.TorchCuda):
    """One GPU whose counters stay at 0; start/stop of the history are the real probe's."""

    def __init__(self) -> None:
        self.dumped: list[str] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_index(self) -> int:
        return 0

    def stats(self, index: int) -> tuple[int, int, int, int]:
        return 0, 0, 0, 0

    def reset_peak(self, index: int) -> None:
        pass

    def free_total(self, index: int) -> tuple[int | None, int | None]:
        return None, None

    def dump_history(self, path: str) -> None:
        self.dumped.append(path)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every call of torch.cuda.memory._record_memory_history, by keyword."""
    calls: list[dict[str, Any]] = []

    def record(enabled: str | None = "all", **kwargs: Any) -> None:
        calls.append({"enabled": enabled, **kwargs})

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(_probes, "cuda", _PretendGpu())
    return calls


def test_python_stacks_are_the_default(recorded: list[dict[str, Any]], tmp_path: Path) -> None:
    with memory_report(device="all", file=None, record_history=tmp_path / "step.pickle"):
        pass
    assert recorded == [
        {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 100_000},
        {"enabled": None},
    ]
    assert _probes.cuda.dumped == [str(tmp_path / "step.pickle")]


def test_all_stacks_when_asked(recorded: list[dict[str, Any]], tmp_path: Path) -> None:
    with memory_report(
        device="all", file=None, record_history=tmp_path / "step.pickle", stacks="all"
    ):
        pass
    assert recorded[0]["stacks"] == "all"
    assert recorded[-1] == {"enabled": None}


def test_a_nested_report_joins_the_recording_with_the_same_stacks(
    recorded: list[dict[str, Any]], tmp_path: Path
) -> None:
    with (
        memory_report(device="all", file=None, record_history=tmp_path / "a.pickle"),
        memory_report(device="all", file=None, record_history=tmp_path / "b.pickle"),
    ):
        pass
    assert [c["enabled"] for c in recorded] == ["all", None]  # one recording for both


def test_a_nested_report_asking_for_other_stacks_is_refused_and_changes_nothing(
    recorded: list[dict[str, Any]], tmp_path: Path
) -> None:
    inner = memory_report(
        "inner", device="all", file=None, record_history=tmp_path / "b.pickle", stacks="all"
    )
    with memory_report("outer", device="all", file=None, record_history=tmp_path / "a.pickle"):
        with pytest.raises(
            RuntimeError,
            match=r"memory_report\('inner', stacks='all'\) is nested in a report that records "
            r"the allocator history with stacks='python'; one recording serves both, so give "
            r"the nested report stacks='python' too",
        ):
            inner.__enter__()
        assert [c["enabled"] for c in recorded] == ["all"]  # the outer recording goes on
    assert [c["enabled"] for c in recorded] == ["all", None]
    with inner:  # nothing of the refused entry was left behind
        pass
    assert recorded[-2]["stacks"] == "all"


# -- at the door ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["cpp", "Python", "", "none"])
def test_an_unknown_stacks_value_is_a_value_error(value: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"^memory_report\(stacks=\.\.\.\) expects one of 'python', 'all', got str "
        + re.escape(repr(value))
        + r"\. Pass stacks='python' \(the default: fast to dump\) or stacks='all' \(C\+\+ "
        r"frames too: slow to dump\)",
    ):
        memory_report(device="cpu", stacks=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, 1, True, ["python"]])
def test_a_stacks_value_of_the_wrong_kind_is_a_type_error(value: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"^memory_report\(stacks=\.\.\.\) expects one of 'python', 'all', got "
        + type(value).__name__,
    ):
        memory_report(device="cpu", stacks=value)


def test_stacks_all_without_record_history_is_a_value_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"^memory_report\(stacks='all'\) chooses the stacks of record_history=, which "
        r"was not given; pass record_history='step\.pickle' too, or drop stacks=",
    ):
        memory_report(device="cpu", stacks="all")


def test_the_bare_decorator_form_checks_stacks_too() -> None:
    def step() -> None:
        pass

    with pytest.raises(ValueError, match=r"memory_report\(stacks=\.\.\.\) .* got str 'cpp'"):
        memory_report(step, stacks="cpp")  # type: ignore[call-overload]
