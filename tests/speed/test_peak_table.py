"""The dense peak table, device-name matching, and MFU against a (faked) device's peak."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cudakit.speed._probes as probes
from cudakit.speed import PEAKS, lookup_peak, speed_report
from cudakit.speed._recorder import Recorder

NAMES = {
    "NVIDIA A100-SXM4-40GB": ("A100", 312.0),
    "NVIDIA A100-SXM4-80GB": ("A100", 312.0),
    "NVIDIA A100-PCIE-40GB": ("A100", 312.0),
    "NVIDIA A100 80GB PCIe": ("A100", 312.0),
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989.5),
    "NVIDIA H100 SXM5 94GB": ("H100 SXM", 989.5),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756.5),
    "NVIDIA H100 NVL": ("H100 NVL", 835.5),
    "NVIDIA H200": ("H200 SXM", 989.5),
    "NVIDIA H200 NVL": ("H200 NVL", 835.5),
    "NVIDIA L4": ("L4", 121.0),
    "NVIDIA L40S": ("L40S", 362.05),
    "NVIDIA L40": ("L40", 181.05),
    "NVIDIA A10": ("A10", 125.0),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 165.2),
    "NVIDIA B200": ("B200", 2250.0),
}

# Other GPUs whose names contain a listed one's: never lent its peak.
UNKNOWN = [
    "NVIDIA A40",
    "Tesla V100-SXM3-32GB",  # not the SXM2 board the page rates
    "Tesla V100-FHHL-16GB",
    "NVIDIA T400 4GB",
    "Quadro RTX T4000",
    "NVIDIA GH200 480GB",
    "NVIDIA GB200",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA GeForce RTX 4090 Laptop GPU",
    "NVIDIA H100",  # SXM, PCIe or NVL: the name does not say
    "NVIDIA A10G",
    "NVIDIA GeForce RTX 3090",
    "",
]


@pytest.mark.parametrize(("name", "expected"), sorted(NAMES.items()))
def test_listed_devices_match_their_dense_bf16_peak(name: str, expected: tuple[str, float]) -> None:
    peak = lookup_peak(name, torch.bfloat16)
    assert (peak.model, peak.tflops, peak.reason) == (*expected, None)
    assert str(peak.source).startswith("NVIDIA ")
    assert peak.describe() == f"{expected[1]:g} TFLOP/s ({expected[0]}, bf16)"


# Volta and Turing: fp16 Tensor Cores (dense as printed), no bf16 or tf32.
FP16_ONLY = {
    "Tesla V100-SXM2-16GB": ("V100 SXM2", 125.0, 15.7),
    "Tesla V100-SXM2-32GB": ("V100 SXM2", 125.0, 15.7),
    "Tesla V100-PCIE-16GB": ("V100 PCIe", 112.0, 14.0),
    "Tesla V100S-PCIE-32GB": ("V100S PCIe", 130.0, 16.4),
    "Tesla T4": ("T4", 65.0, 8.1),
}


@pytest.mark.parametrize(("name", "expected"), sorted(FP16_ONLY.items()))
def test_volta_and_turing_have_fp16_and_fp32_peaks_only(
    name: str, expected: tuple[str, float, float]
) -> None:
    model, fp16, fp32 = expected
    assert (lookup_peak(name, torch.float16).model, lookup_peak(name, "fp16").tflops) == (
        model,
        fp16,
    )
    assert lookup_peak(name, torch.float32).tflops == fp32
    for dtype in ("bf16", "tf32", "fp8"):
        peak = lookup_peak(name, dtype)
        assert (peak.tflops, peak.model) == (None, model)
        assert f"the {model} has no {dtype} Tensor Core rate" in str(peak.reason)


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_devices_get_no_peak_and_a_reason(name: str) -> None:
    peak = lookup_peak(name, "bf16")
    assert peak.tflops is None
    assert f"the device {name!r}" in str(peak.reason)
    assert "pass peak_tflops=..." in str(peak.reason)
    assert peak.describe().startswith("no peak: ")


def test_mig_slice_gets_no_peak() -> None:
    peak = lookup_peak("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16")
    assert peak.tflops is None
    assert "MIG slice" in str(peak.reason)


def test_table_holds_dense_figures_with_their_datasheets() -> None:
    assert len({e.model for e in PEAKS}) == len(PEAKS)
    for entry in PEAKS:
        assert entry.url.startswith("https://")
        assert entry.source
        assert entry.note
        t = entry.tflops
        assert set(t) <= {"fp32", "tf32", "bf16", "fp16", "fp8"}
        assert t["fp32"] < t["fp16"]
        if "bf16" not in t:  # Volta, Turing: fp16 Tensor Cores only
            assert set(t) == {"fp32", "fp16"}
            continue
        assert t["bf16"] == t["fp16"]
        # Each Tensor Core format runs at twice the rate of the wider one (to the
        # datasheets' rounding): a sparse figure taken by mistake would be 2x off.
        assert t["tf32"] == pytest.approx(t["bf16"] / 2, rel=0.05)
        if "fp8" in t:
            assert t["fp8"] == pytest.approx(2 * t["bf16"], rel=0.05)
    # The sparse figures NVIDIA prints first are twice these (Lightning #21677).
    h100 = next(e for e in PEAKS if e.model == "H100 SXM")
    assert h100.tflops["bf16"] == 1979 / 2


def test_dtype_without_a_figure() -> None:
    peak = lookup_peak("NVIDIA A100-SXM4-80GB", "fp8")
    assert peak.tflops is None
    assert peak.model == "A100"
    assert "has no fp8 Tensor Core rate" in str(peak.reason)
    other = lookup_peak("NVIDIA H100 PCIe", torch.int8)
    assert other.tflops is None
    assert "no figures for torch.int8" in str(other.reason)
    assert lookup_peak("NVIDIA H100 PCIe", torch.float8_e4m3fn).tflops == 1513.0


@given(
    st.lists(
        st.sampled_from(
            [
                "NVIDIA",
                "A100",
                "H100",
                "H200",
                "PCIe",
                "NVL",
                "L4",
                "L40S",
                "RTX",
                "4090",
                "D",
                "B200",
                "GB200",
                "SXM5",
                "HBM3",
                "80GB",
                "MIG",
                "X",
            ]
        ),
        max_size=6,
    )
)
def test_a_peak_only_for_a_name_with_every_word_of_its_entry(words: list[str]) -> None:
    name = " ".join(words)
    peak = lookup_peak(name, "bf16")
    if peak.tflops is not None:
        entry = next(e for e in PEAKS if e.model == peak.model)
        upper = set(re.findall(r"[A-Z0-9]+", name.upper()))
        assert set(entry.words) <= upper
        assert not set(entry.not_words) & upper
        assert "MIG" not in upper


def _run(meter: object, steps: int = 4) -> None:
    for _ in range(steps):
        with meter:  # type: ignore[attr-defined]
            pass


def test_mfu_against_a_faked_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    out = io.StringIO()
    meter = speed_report("fake", flops=1e12, dtype=torch.bfloat16, every=4, file=out)
    _run(meter)
    figures = meter.recent
    assert figures.peak_tflops == 989.5
    assert meter.mfu == pytest.approx(figures.tflops / 989.5)
    assert meter.mfu_reason is None
    assert meter.peak.model == "H100 SXM"
    line = out.getvalue()
    assert "MFU " in line
    assert "(peak 989.5 TFLOP/s, H100 SXM, bf16: NVIDIA H100" in line


def test_unknown_device_gives_no_mfu_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: "NVIDIA A10G")
    lines: list[str] = []
    meter = speed_report(flops=1e9, dtype="bf16", every=2, log=lines.append)
    _run(meter, 2)
    assert meter.mfu is None
    assert meter.tflops is not None
    assert meter.mfu_reason == (
        "no entry of the peak table matches the device 'NVIDIA A10G'; pass peak_tflops=... "
        "(its dense peak for bf16)"
    )
    assert f"MFU n/a: {meter.mfu_reason}" in lines[0]


def test_cpu_reports_tflops_and_an_mfu_only_with_a_peak() -> None:
    meter = speed_report(flops=1e9, file=None)
    _run(meter)
    assert meter.tflops is not None
    assert meter.mfu is None
    assert meter.mfu_reason == (
        "the peak table covers NVIDIA GPUs, not cpu; pass peak_tflops=... to get an MFU"
    )
    given_peak = speed_report(flops=1e9, peak_tflops=2.0, file=None)
    _run(given_peak)
    assert given_peak.mfu == pytest.approx(given_peak.tflops / 2.0)  # type: ignore[operator]
    assert given_peak.peak.model == "given"


def test_no_flop_count_gives_no_mfu() -> None:
    meter = speed_report(samples=8, peak_tflops=1.0, file=None)
    _run(meter)
    assert meter.tflops is None
    assert meter.mfu is None
    assert str(meter.mfu_reason).startswith("no FLOP count; pass flops=count_flops(...)")


@pytest.mark.parametrize(("tf32", "key", "tflops"), [(False, "fp32", 67.0), (True, "tf32", 494.5)])
def test_float32_steps_use_tf32_when_matmuls_do(
    monkeypatch: pytest.MonkeyPatch, tf32: bool, key: str, tflops: float
) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(probes, "tf32_matmuls", lambda: tf32)
    settings = speed_report(file=None)._settings
    cuda = dataclasses.replace(settings, device=torch.device("cuda", 0), follow=False)
    peak = Recorder(cuda).peak(None)
    assert (peak.dtype, peak.tflops) == (key, tflops)
    # An explicit "fp32" is taken at its word.
    explicit = Recorder(dataclasses.replace(cuda, dtype="fp32")).peak(None)
    assert (explicit.dtype, explicit.tflops) == ("fp32", 67.0)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_float32_steps_on_a_gpu_without_tf32_use_its_fp32_rate(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None
) -> None:
    monkeypatch.setattr(probes, "device_name", lambda device: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(probes, "tf32_matmuls", lambda: True)  # "high": no TF32 on Volta
    settings = speed_report(file=None)._settings
    cuda = dataclasses.replace(settings, device=torch.device("cuda", 0), follow=False)
    peak = Recorder(dataclasses.replace(cuda, dtype=dtype)).peak(None)
    assert (peak.model, peak.dtype, peak.tflops) == ("V100 SXM2", "fp32", 15.7)
    # Asked for by name, TF32 has no figure there, and the reason says so.
    asked = Recorder(dataclasses.replace(cuda, dtype="tf32")).peak(None)
    assert asked.tflops is None
    assert "the V100 SXM2 has no tf32 Tensor Core rate" in str(asked.reason)


def test_cuda_not_started_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = speed_report(file=None)._settings
    cuda = dataclasses.replace(settings, device=torch.device("cuda", 0), follow=False)
    monkeypatch.setattr(probes, "device_name", lambda device: None)
    peak = Recorder(cuda).peak(None)
    assert peak.tflops is None
    assert str(peak.reason).startswith("CUDA has not started in this process")


def test_probes_read_nothing_on_the_cpu() -> None:
    assert probes.device_name(torch.device("cpu")) is None
    assert probes.tf32_matmuls() in (True, False)


def test_a_name_two_entries_match_gets_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    import cudakit.speed.peaks as peaks

    twin = dataclasses.replace(PEAKS[0], model="A100 twin")
    monkeypatch.setattr(peaks, "PEAKS", (*PEAKS, twin))
    peak = lookup_peak("NVIDIA A100-SXM4-80GB", "bf16")
    assert peak.tflops is None
    assert peak.reason == (
        "the device 'NVIDIA A100-SXM4-80GB' could be A100 or A100 twin; pass peak_tflops=... "
        "(its dense peak for bf16)"
    )
