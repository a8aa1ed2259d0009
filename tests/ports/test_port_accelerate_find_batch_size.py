"""find_batch_size against accelerate's find_executable_batch_size tests.

Ported from Hugging Face accelerate tests/test_memory_utils.py (test_memory_implicit,
test_memory_explicit, test_start_zero, test_approach_zero, test_verbose_guard,
test_any_other_error, and the memory release between tries), with the search's bounds
(multiple_of, margin, lower, upper) checked on the same fake out-of-memory trials.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable

import pytest
import torch

from cudakit import BatchSizeSearchError, find_batch_size

# Not `import cudakit.warmup.batch_size`: the attribute cudakit.warmup is the function.
batch_size_module = importlib.import_module("cudakit.warmup.batch_size")


@pytest.fixture(autouse=True)
def _fast_free_memory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full gc.collect() per try costs ~0.1 s in a big test session; skip it on the CPU
    except where the test is about the memory released between tries."""
    if "real_free" not in request.node.name:
        monkeypatch.setattr(batch_size_module, "free_memory", lambda: None)


def fake_cuda_oom() -> None:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")


def trial_fitting(limit: int, tried: list[int] | None = None) -> Callable[[int], int]:
    """A trial that runs out of memory above ``limit`` (and logs the sizes to ``tried``)."""

    def trial(bs: int) -> int:
        if tried is not None:
            tried.append(bs)
        if bs > limit:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return bs

    return trial


def test_memory_implicit() -> None:
    sizes: list[int] = []

    @find_batch_size(start=128)
    def loop(batch_size: int) -> int:
        sizes.append(batch_size)
        if batch_size > 8:
            fake_cuda_oom()
        return batch_size

    assert loop() == 8  # the result at the chosen size
    assert sizes[0] == 128


def test_memory_explicit() -> None:
    @find_batch_size(start=128)
    def loop(batch_size: int, arg1: str, *, kw: int | None = None) -> tuple[int, str, int | None]:
        if batch_size > 8:
            fake_cuda_oom()
        return batch_size, arg1, kw

    assert loop("hello", kw=3) == (8, "hello", 3)


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="deliberate difference: cudakit recognises only the messages torch raises "
    "('CUDA out of memory', 'DefaultCPUAllocator: can't allocate memory', ...); "
    "'CPU out of memory.' is accelerate's own fake, not a torch message",
)
def test_memory_accelerate_fake_cpu_oom_message() -> None:
    @find_batch_size(start=128, upper=1024)
    def loop(batch_size: int) -> int:
        if batch_size > 8:
            raise RuntimeError("CPU out of memory.")  # accelerate's fake OOM on a CPU device
        return batch_size

    assert loop() == 8


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory."), MemoryError()],
    ids=["OutOfMemoryError", "MemoryError"],
)
def test_memory_error_types(error: BaseException) -> None:
    @find_batch_size(start=16, upper=256)
    def loop(batch_size: int) -> int:
        if batch_size > 20:
            raise error
        return batch_size

    assert loop() == 20


def test_start_zero() -> None:
    with pytest.raises(ValueError, match="start >= 1"):
        find_batch_size(start=0)


def test_approach_zero() -> None:
    """Nothing fits, not even the lower bound."""

    @find_batch_size(start=16)
    def loop(batch_size: int) -> None:
        fake_cuda_oom()

    with pytest.raises(BatchSizeSearchError, match="not even the lower bound"):
        loop()


def test_verbose_guard() -> None:
    """Passing the batch size yourself is refused."""

    @find_batch_size(start=128)
    def loop(batch_size: int, arg1: str, arg2: str) -> None:
        pass

    with pytest.raises(TypeError, match="remaining arguments only"):
        loop(128, "hello", "world")  # type: ignore[call-arg]


def test_signature_hides_batch_size() -> None:
    @find_batch_size(start=16)
    def loop(batch_size: int, arg1: int, arg2: int = 3) -> int:
        return batch_size

    assert list(inspect.signature(loop).parameters) == ["arg1", "arg2"]


def test_any_other_error() -> None:
    @find_batch_size(start=16)
    def loop(batch_size: int) -> None:
        raise ValueError("Oops, we had an error!")

    with pytest.raises(ValueError, match="Oops, we had an error!"):
        loop()


def test_other_runtime_error_propagates_without_retry() -> None:
    calls: list[int] = []

    @find_batch_size(start=16)
    def loop(batch_size: int) -> None:
        calls.append(batch_size)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        loop()
    assert calls == [16]


def test_keyboard_interrupt_propagates() -> None:
    def trial(bs: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        find_batch_size(trial, start=8)


def test_each_call_runs_a_fresh_search() -> None:
    limit = [8]

    @find_batch_size(start=4, upper=64)
    def loop(batch_size: int) -> int:
        if batch_size > limit[0]:
            fake_cuda_oom()
        return batch_size

    assert loop() == 8
    limit[0] = 32
    assert loop() == 32


def test_result_not_recomputed() -> None:
    calls: list[int] = []

    @find_batch_size(start=4, upper=64)
    def loop(batch_size: int) -> object:
        calls.append(batch_size)
        if batch_size > 8:
            fake_cuda_oom()
        return object()

    loop()
    assert calls.count(8) == 1


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 9, 15, 16, 17, 100, 127, 128, 129, 1000])
@pytest.mark.parametrize("start", [1, 8, 128])
def test_exact_largest(limit: int, start: int) -> None:
    tried: list[int] = []
    assert find_batch_size(trial_fitting(limit, tried), start=start, upper=4096) == limit
    assert len(tried) == len(set(tried)), tried  # no size tried twice


@pytest.mark.parametrize("limit", [8, 9, 15, 16, 17, 100, 296, 300])
def test_multiple_of(limit: int) -> None:
    tried: list[int] = []
    got = find_batch_size(trial_fitting(limit, tried), start=8, multiple_of=8, upper=1024)
    assert got == (limit // 8) * 8
    assert all(bs % 8 == 0 for bs in tried)


@pytest.mark.parametrize(
    ("limit", "mult", "margin", "lower"),
    [(300, 8, 0.1, 1), (20, 8, 0.5, 8), (100, 1, 0.25, 1), (9, 4, 0.0, 4)],
)
def test_margin_rounding(limit: int, mult: int, margin: float, lower: int) -> None:
    got = find_batch_size(
        trial_fitting(limit),
        start=mult * 2,
        multiple_of=mult,
        margin=margin,
        lower=lower,
        upper=4096,
    )
    best = (limit // mult) * mult
    assert got == max(lower, int(best * (1 - margin)) // mult * mult)
    assert got % mult == 0


def test_documented_examples() -> None:
    trial = trial_fitting(300)
    assert find_batch_size(trial, start=32) == 300
    assert find_batch_size(trial, start=256, multiple_of=8, upper=1024) == 296
    assert find_batch_size(trial, start=256, multiple_of=8, margin=0.1) == 264


def test_upper_respected() -> None:
    tried: list[int] = []
    assert find_batch_size(trial_fitting(10**6, tried), start=8, upper=100) == 100
    assert max(tried) <= 100


@pytest.mark.parametrize(("start", "first"), [(128, 64), (2, 8)])
def test_start_outside_bounds_clamped(start: int, first: int) -> None:
    """accelerate only shrinks from its start; cudakit clamps the start into [lower, upper]."""
    tried: list[int] = []
    find_batch_size(trial_fitting(10**6, tried), start=start, lower=8, upper=64)
    assert tried[0] == first
    assert min(tried) >= 8
    assert max(tried) <= 64


def test_failed_try_memory_released_before_next_try_real_free() -> None:
    """accelerate drops the exception (and its frames), then gc and empty_cache, per try."""
    refs: list[weakref.ref[torch.Tensor]] = []
    seen_alive: list[bool] = []

    def trial(bs: int) -> None:
        if refs:
            seen_alive.append(refs[-1]() is not None)
        t = torch.empty(bs, 16)
        refs.append(weakref.ref(t))
        if bs > 8:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    find_batch_size(trial, start=64, upper=256)
    assert seen_alive
    assert not any(seen_alive), seen_alive
