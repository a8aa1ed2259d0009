"""Shared test configuration: hypothesis profiles and GPU/distributed markers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import cudakit.amp._stepper as amp_stepper

# The tests live in one folder per concern (tests/amp/, tests/device/, ...); the helpers
# they share (launcher_env.py, strategies.py) stay here, imported by name from every folder
# whatever pytest's import mode. Helpers of one concern sit beside its tests (ports/).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Derandomized in CI so a red build is reproducible; no deadline anywhere because
# torch's first calls (kernel loading, allocator growth) are slow and uneven.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m cuda` on a GPU machine")
    skip_multi = pytest.mark.skip(
        reason=f"needs 2+ CUDA GPUs, this machine has {n_gpu}; run `pytest -m multigpu`"
    )
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        elif "cuda" in item.keywords and n_gpu < 1:
            item.add_marker(skip_cuda)


def force_skip_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make steps built from now on take the GPU's sync-free path on the CPU.

    On a GPU a sync-free step hands its verdict to the optimizer as ``found_inf`` and
    reads it lazily; on the CPU (where nothing waits) it reads the verdict at once. This
    forces the GPU's path, so it is tested here too.
    """
    monkeypatch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)


@pytest.fixture
def skip_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's sync-free path (found_inf, lazily read verdicts), forced on the CPU."""
    force_skip_on_device(monkeypatch)


@pytest.fixture(params=["host", "device"])
def skip_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a sync-free step skips a bad step: "host" (the CPU's: the verdict read
    from memory at once) and "device" (the GPU's: found_inf, verdicts read lazily)."""
    if request.param == "device":
        force_skip_on_device(monkeypatch)
    return str(request.param)
