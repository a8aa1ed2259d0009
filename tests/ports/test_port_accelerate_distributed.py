"""Two gloo ranks on the CPU, ported from Hugging Face accelerate.

Ported from src/accelerate/test_utils/scripts/test_sync.py (test_distributed_sync,
test_gradient_accumulation) and tests/test_data_loader.py (shards per process). One
launch runs every check (port_accelerate_helpers.accelerate_checks); the tests read
its results.
"""

from __future__ import annotations

from typing import Any

import pytest
from port_accelerate_helpers import LOADER_CASES, accelerate_checks

import cudakit.parallel as cp

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return cp.launch(accelerate_checks, nprocs=2, timeout=120)


def test_gradient_accumulation_syncs_only_on_stepping_micro_steps(
    results: list[dict[str, Any]],
) -> None:
    # (stepped, grads equal the whole-batch reference): local grads differ while no_sync
    # holds the all-reduce back; the flushed partial window syncs too.
    expected = [(False, False), (True, True)] * 3
    for r in results:
        assert r["sync"] == expected


def test_nan_on_one_rank_skips_on_every_rank(results: list[dict[str, Any]]) -> None:
    nan0, nan1 = (r["nan"] for r in results)
    assert [skipped for skipped, _ in nan0] == [False, True, False]
    assert [skipped for skipped, _ in nan1] == [False, True, False]
    assert [w for _, w in nan0] == [w for _, w in nan1]  # the replicas never diverge


@pytest.mark.parametrize(("n", "drop_last"), LOADER_CASES)
def test_distributed_loader_two_ranks(
    results: list[dict[str, Any]], n: int, drop_last: bool
) -> None:
    (len0, a0, b0), (len1, a1, _) = (r["loaders"][n, drop_last] for r in results)
    assert len0 == len1 == len(a0) == len(a1)  # the same number of batches on every rank
    assert a0 != b0  # reshuffled each epoch
    flat = [x for b in a0 + a1 for x in b]
    if drop_last:
        assert len(flat) == len(set(flat))
    else:
        assert set(flat) == set(range(n))
