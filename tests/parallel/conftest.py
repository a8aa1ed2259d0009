"""Fixtures the parallel tests share."""

from __future__ import annotations

import pytest
from launcher_env import free_port, torchrun_env


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment for a single rank on a free port."""
    env = torchrun_env(1, 0, free_port())
    for k, v in env.items():
        monkeypatch.setenv(k, v)
