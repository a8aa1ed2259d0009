"""A run resumed from a checkpoint equals the run that never stopped, bit for bit (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import Crash, run, same_state

REFERENCE: dict[tuple[int, bool], dict] = {}


def reference(accumulate: int, loader_generator: bool = False) -> dict:
    key = (accumulate, loader_generator)
    if key not in REFERENCE:
        REFERENCE[key] = run(None, accumulate=accumulate, loader_generator=loader_generator)
    return REFERENCE[key]


def test_an_uninterrupted_run_with_a_checkpointer_equals_the_plain_loop(tmp_path: Path) -> None:
    ref = reference(2)
    got = run(tmp_path, accumulate=2)
    assert got["losses"] == ref["losses"]
    assert same_state(got, ref)


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_resume_after_a_crash_mid_epoch_is_bit_for_bit(tmp_path: Path, accumulate: int) -> None:
    ref = reference(accumulate)
    with pytest.raises(Crash):
        run(tmp_path, accumulate=accumulate, crash_at=14)
    resumed = run(tmp_path, accumulate=accumulate, noise=1234)
    ckpt = resumed["ckpt"]
    assert ckpt.resumed_from is not None
    start = min(resumed["losses"])
    assert start > 1  # it really resumed rather than starting over
    assert resumed["losses"] == {k: v for k, v in ref["losses"].items() if k >= start}
    assert same_state(resumed, ref)


def test_resume_keeps_the_loaders_own_generator(tmp_path: Path) -> None:
    ref = reference(1, loader_generator=True)
    with pytest.raises(Crash):
        run(tmp_path, accumulate=1, crash_at=7, loader_generator=True)
    resumed = run(tmp_path, accumulate=1, noise=99, loader_generator=True)
    assert same_state(resumed, ref)


@pytest.mark.parametrize("kind", ["distributed", "prefetch"])
def test_resume_through_distributed_loader_and_prefetch(tmp_path: Path, kind: str) -> None:
    ref = run(None, accumulate=2, kind=kind)
    with pytest.raises(Crash):
        run(tmp_path, accumulate=2, crash_at=15, kind=kind)
    resumed = run(tmp_path, accumulate=2, noise=3, kind=kind)
    assert resumed["ckpt"].resumed_from is not None
    assert same_state(resumed, ref)


def test_a_finished_run_started_again_does_nothing_more(tmp_path: Path) -> None:
    first = run(tmp_path, accumulate=2)
    again = run(tmp_path, accumulate=2, noise=5)
    assert again["losses"] == {}
    assert same_state(first, again)


@settings(max_examples=12, deadline=None)
@given(
    crash_at=st.integers(min_value=1, max_value=20),
    accumulate=st.sampled_from([1, 2, 4]),
    every=st.sampled_from([1, 2, 3]),
)
def test_any_moment_of_a_crash_resumes_bit_for_bit(
    tmp_path_factory: pytest.TempPathFactory, crash_at: int, accumulate: int, every: int
) -> None:
    directory = tmp_path_factory.mktemp("any")
    ref = reference(accumulate)
    with pytest.raises(Crash):
        run(directory, accumulate=accumulate, every=every, crash_at=crash_at)
    resumed = run(directory, accumulate=accumulate, every=every, noise=crash_at)
    assert same_state(resumed, ref)
    start = min(resumed["losses"])
    assert resumed["losses"] == {k: v for k, v in ref["losses"].items() if k >= start}
