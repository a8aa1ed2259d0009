"""speed_report as a with block, a decorator and a reused object: its figures and its line."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch

import cudakit
from cudakit.speed import SpeedFigures, SpeedMeter, speed_report


def test_exported_beside_memory_report() -> None:
    assert cudakit.speed_report is speed_report
    assert "speed_report" in cudakit.__all__


def test_bare_decorator_names_the_function_and_counts_calls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    @speed_report
    def train_step(x: int) -> int:
        return x + 1

    assert [train_step(i) for i in range(3)] == [1, 2, 3]
    meter = train_step.speed_report
    assert isinstance(meter, SpeedMeter)
    assert (meter.label, meter.calls, meter.steps) == ("train_step", 3, 3)
    assert train_step.__name__ == "train_step"
    assert capsys.readouterr().err == ""  # every=100: no line yet
    meter.flush()
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"speed_report 'train_step' cpu step 3: \S+ \S?s/step \[last 3 steps\]; MFU n/a: no "
        r"FLOP count; pass flops=count_flops\(...\) \(or a number per call, or a function of "
        r"the batch\)\n",
        err,
    )
    meter.flush()  # nothing new: no line
    assert capsys.readouterr().err == ""


def test_line_every_n_steps_with_rolling_window_and_totals() -> None:
    out = io.StringIO()
    meter = speed_report("train", samples=8, tokens=64, flops=1e9, every=2, window=2, file=out)
    for _ in range(6):
        with meter:
            pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("speed_report 'train' cpu step 2: ")
    assert "samples/s" in lines[0]
    assert "tokens/s" in lines[0]
    assert "FLOP/s" in lines[0]
    assert "[last 2 steps]" in lines[2]
    assert "; all 6 steps: " in lines[2]
    assert meter.last_line == lines[2]
    recent, total = meter.recent, meter.total
    assert (recent.steps, recent.samples, total.steps, total.tokens) == (2, 16.0, 6, 384.0)
    assert meter.samples_per_s == recent.samples_per_s
    assert meter.tokens_per_s == recent.tokens_per_s
    assert meter.step_time == recent.step_time
    assert meter.tflops == recent.tflops


def test_log_goes_to_a_logger_at_info(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("cudakit.test.speed")
    meter = speed_report(every=1, log=logger)
    with caplog.at_level(logging.INFO, logger="cudakit.test.speed"), meter:
        pass
    assert caplog.records[0].levelno == logging.INFO
    assert caplog.records[0].getMessage().startswith("speed_report cpu step 1: ")


def test_file_none_is_silent_but_keeps_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    meter = speed_report(every=1, file=None)
    with meter:
        pass
    assert capsys.readouterr().err == ""
    assert meter.last_line is not None


def test_a_failed_call_is_not_counted() -> None:
    meter = speed_report(samples=4, every=1, file=None)
    with pytest.raises(KeyError), meter:
        raise KeyError("boom")

    @meter
    def fails() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        fails()
    assert (meter.calls, meter.steps, meter.last_line) == (0, 0, None)
    with meter:  # the object is usable again
        pass
    assert meter.calls == 1


def test_clones_measure_into_the_same_figures() -> None:
    meter = speed_report(samples=len, file=None)
    with meter.measure([1, 2]), meter.measure([3]):  # two clones may be open at once
        pass
    twin = meter.clone()
    with twin.measure([4]):
        pass
    assert meter.total.samples == 4.0
    assert twin.calls == 3


def test_recursive_decorated_calls_are_each_measured() -> None:
    @speed_report(samples=1, file=None)
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3
    assert depth.speed_report.calls == 4
    assert depth.speed_report.total.seconds > 0


def test_figures_before_any_step() -> None:
    meter = speed_report(samples=1, flops=1.0, peak_tflops=1.0, file=None)
    recent = meter.recent
    assert (recent.steps, recent.step_time, recent.samples_per_s, recent.mfu) == (
        0,
        None,
        None,
        None,
    )
    assert recent.summary() == "no step measured yet"
    assert meter.combined is None
    assert meter.last_line is None


def test_figures_to_dict_and_summary() -> None:
    f = SpeedFigures(4, 8, 2.0, 64.0, None, 8e12, 5.0, "given", None, 1)
    d = f.to_dict()
    assert d["samples_per_s"] == 32.0
    assert d["tflops"] == 4.0
    assert d["mfu"] == 0.8
    assert d["tokens_per_s"] is None
    assert d["step_time"] == 0.5
    assert f.summary() == "500.0 ms/step, 32.0 samples/s, 4.00 TFLOP/s, MFU 80.0%"
    over = SpeedFigures(1, 1, 1.0, None, None, 2e12, 1.0)
    assert "MFU 200.0% (above 100%: is dtype= the one the step runs in?)" in over.summary()


def test_beside_memory_report() -> None:
    speed = speed_report("step", samples=16, every=2, file=None)
    memory = cudakit.memory_report("step", device="cpu", file=None)
    model = torch.nn.Linear(4, 4)
    for _ in range(2):
        with speed, memory:
            model(torch.ones(16, 4)).sum().backward()
    assert speed.steps == 2
    assert memory.calls == 2
    assert speed.last_line is not None
    assert speed.last_line.startswith("speed_report 'step' cpu")
