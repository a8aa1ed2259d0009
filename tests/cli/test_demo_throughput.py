"""``cudakit demo`` reports throughput: time per step, FLOP/s and MFU per epoch, and plots it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

import cudakit.speed._probes as probes
from cudakit.demo import DemoSummary, EpochStats, main
from cudakit.demo._plot import plot_summary

SHORT = ["--epochs", "1", "--train-size", "128", "--batch-size", "32", "--seed", "3"]


def _run(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*SHORT, "--no-progress", *argv]) == 0
    return buf.getvalue()


def test_epochs_carry_the_meter_figures_and_the_reason_for_no_mfu() -> None:
    s: dict[str, Any] = json.loads(_run("--json", "--dtype", "fp32"))
    (epoch,) = s["epochs"]
    assert epoch["optimizer_steps"] == 2  # 4 micro-steps, accumulate=2
    assert epoch["step_time"] > 0
    assert epoch["tflops"] > 0  # FLOPs counted once, over the measured steps' time
    assert epoch["mfu"] is None
    assert s["mfu_reason"] == (
        "the peak table covers NVIDIA GPUs, not cpu; pass peak_tflops=... to get an MFU"
    )


def test_table_shows_flops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    out = _run("--dtype", "fp32")
    # The table may come in parts (80 columns), each starting with the epoch.
    headers = [line.split() for line in out.splitlines() if line.lstrip().startswith("epoch")]
    assert [word for h in headers for word in h[1:]] == [
        "train", "loss", "val", "loss", "val", "acc", "samples/s", "FLOP/s", "MFU",
        "peak", "mem", "skipped",
    ]  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("1 ")]
    values = [value for row in rows for value in row[1:]]
    assert values[5].endswith("%")  # an MFU against the (faked) H100 peak for fp32
    assert not re.search(r"^MFU +n/a", out, re.M)  # no reason line when there is an MFU


def _summary(tflops: float | None) -> DemoSummary:
    epochs = [
        EpochStats(e, 2.0 - e / 4, 1.9, 0.3, 100.0 * e, 1.0, 4, 0, 2**20, "rss", 0.1, tflops, None)
        for e in (1, 2)
    ]
    return DemoSummary(
        "cpu", "float32", "none", 1, 32, 2, 1.0, 128, 256, 0, 0.1, 0.01, 2.3, 1.9, 0.3,
        epochs, [2.3, 2.1, 2.0, 1.9], [2**20] * 4, None, "no peak",
    )  # fmt: skip


@pytest.mark.parametrize("tflops", [1.5e-3, None])  # None: a run saved before the meter
def test_plot_draws_the_throughput_panel(tmp_path: Path, tflops: float | None) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    plot_summary(_summary(tflops), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_without_meter_fields_still_reads() -> None:
    old = dataclasses.replace(_summary(None), mfu_reason=None)
    text = str(old)
    assert "n/a" in text
    assert not re.search(r"^MFU +n/a", text, re.M)
    assert re.search(r"^MFU +n/a: no peak$", str(_summary(None)), re.M)
    assert old.to_dict()["epochs"][0]["tflops"] is None
