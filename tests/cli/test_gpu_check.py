"""``scripts/gpu-check``: its control flow, with a stand-in for Python (no GPU needed).

The stand-in answers the CUDA probe (``python -c ...``) with the exit status chosen by
the test and then either succeeds at once or hangs, so the budget logic is exercised in
seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)


def _run(tmp_path: Path, *, cuda: bool, hang: bool, budget: int) -> tuple[int, str, float]:
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f"[[ $1 == -c ]] && exit {0 if cuda else 1}\n"
        + ("sleep 60\n" if hang else 'echo "ran: $*"\n')
    )
    fake.chmod(0o755)
    log = tmp_path / "gpu-check.log"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "GPU_CHECK_LOG": str(log),
        "GPU_CHECK_BUDGET": str(budget),
    }
    start = time.monotonic()
    proc = subprocess.run(
        [str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return proc.returncode, log.read_text(), time.monotonic() - start


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    rc, log, _ = _run(tmp_path, cuda=False, hang=False, budget=480)
    assert rc == 2
    assert "no usable CUDA GPU (torch.cuda.is_available() is False); nothing to check." in log


def test_every_step_runs_into_one_log(tmp_path: Path) -> None:
    rc, log, _ = _run(tmp_path, cuda=True, hang=False, budget=480)
    assert rc == 0, log
    assert "ran: -m pytest -m cuda or multigpu" in log
    benches = sorted((SCRIPT.parent.parent / "benchmarks").glob("bench_*.py"))
    assert benches
    for bench in benches:
        # The gloo-rank benchmarks (no --device) run as they are.
        device = " --device cuda" if '"--device"' in bench.read_text() else ""
        assert f"== PASS benchmarks/{bench.name}{device}" in log
    assert "ran: -m cudakit demo --device cuda --no-progress" in log
    assert log.rstrip().endswith("all GPU checks passed")


def test_a_hanging_machine_stays_inside_the_budget(tmp_path: Path) -> None:
    # Every step hangs: `cudakit info` gets what is left (2 s), then nothing fits.
    rc, log, seconds = _run(tmp_path, cuda=True, hang=True, budget=12)
    assert rc == 1
    assert seconds < 12, log
    assert "== SKIP pytest -m 'cuda or multigpu': the 12 s budget is spent" in log
    assert "FAILED: pytest -m 'cuda or multigpu' (not run: out of time)" in log
