"""Dense peak FLOP/s per GPU model and dtype, from NVIDIA's datasheets: :func:`lookup_peak`.

Every figure is the **dense** Tensor Core rate (the CUDA-core rate for ``"fp32"``).
NVIDIA's datasheets print the 2:4 *sparse* rate for most Tensor Core figures, marked
with an asterisk; the dense rate is half of it, and that half is what the table holds.
Taking the sparse figure is the classic way to report an MFU half of the truth
(Lightning #21677, OLMo-core #614, fms-fsdp #89).

A device name is matched on whole words (``"NVIDIA L40S"`` is not an ``"L4"``,
``"NVIDIA GH200"`` not an ``"H200"``, ``"A10G"`` not an ``"A10"``). A name
that matches nothing, or more than one entry, gives no peak and a reason: the table
never lends one GPU's peak to another (torchtitan once showed 152 % MFU that way).

>>> p = lookup_peak("NVIDIA H100 80GB HBM3", "bf16")
>>> p.tflops, p.model
(989.5, 'H100 SXM')
>>> lookup_peak("NVIDIA A10G", "bf16").tflops is None
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import torch

from .._check import check_type, fail_type

__all__ = ["DTYPE_KEYS", "PEAKS", "DevicePeak", "Peak", "dtype_key", "lookup_peak"]

#: The dtype keys of the table: CUDA-core fp32, then the Tensor Core formats.
DTYPE_KEYS: Final = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class DevicePeak:
    """One GPU model's dense peak TFLOP/s per dtype, and the document they come from.

    .. versionadded:: 0.1
    """

    #: A short name for the model, e.g. ``"H100 SXM"``.
    model: str
    #: Every word that must appear in the device name (upper case), e.g. ``("H100",)``.
    words: tuple[str, ...]
    #: Dense TFLOP/s per dtype key (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``).
    tflops: Mapping[str, float]
    #: The document the figures come from.
    source: str
    #: Where that document is.
    url: str
    #: Words that rule the model out (another variant, e.g. ``"NVL"``, ``"PCIE"``).
    not_words: tuple[str, ...] = ()
    #: At least one of these words must appear too, when given (e.g. ``("SXM", "HBM3")``).
    any_words: tuple[str, ...] = ()
    #: A note on how the figures were read from the document.
    note: str = field(default="")


_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
_A100_URL = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H100_URL = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_H200_URL = "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
_V100 = "NVIDIA V100 Tensor Core GPU specifications"
_V100_URL = "https://www.nvidia.com/en-us/data-center/v100/"
_HALF = "Tensor Core figures: the datasheet's sparse figure (marked *) halved."

# Add a model by appending an entry with its datasheet; never guess.
PEAKS: Final[tuple[DevicePeak, ...]] = (
    # A100 SXM4 and PCIe, 40 GB and 80 GB: one column of figures for all four.
    DevicePeak(
        "A100",
        ("A100",),
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        _A100,
        _A100_URL,
        note="TF32 156, BF16/FP16 312 dense (312/624 with sparsity); no FP8.",
    ),
    # "NVIDIA H100 80GB HBM3" is the SXM5 board; PCIe and NVL say so in their names.
    DevicePeak(
        "H100 SXM",
        ("H100",),
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
        _H100,
        _H100_URL,
        not_words=("PCIE", "NVL"),
        any_words=("SXM", "SXM5", "HBM3"),
        note=_HALF + " TF32 989*, BF16/FP16 1,979*, FP8 3,958*.",
    ),
    DevicePeak(
        "H100 PCIe",
        ("H100", "PCIE"),
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
        _H100,
        _H100_URL,
        note=_HALF + " TF32 756*, BF16/FP16 1,513*, FP8 3,026*.",
    ),
    DevicePeak(
        "H100 NVL",
        ("H100", "NVL"),
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        _H100,
        _H100_URL,
        note=_HALF + " TF32 835*, BF16/FP16 1,671*, FP8 3,341* (per GPU).",
    ),
    DevicePeak(
        "H200 SXM",
        ("H200",),
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
        _H200,
        _H200_URL,
        not_words=("NVL",),
        note=_HALF + " TF32 989*, BF16/FP16 1,979*, FP8 3,958*.",
    ),
    DevicePeak(
        "H200 NVL",
        ("H200", "NVL"),
        {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        _H200,
        _H200_URL,
        note=_HALF + " TF32 835*, BF16/FP16 1,671*, FP8 3,341*.",
    ),
    # Volta and Turing have no sparsity: their Tensor Core figures are dense as printed.
    # PyTorch's fp16 matmuls accumulate in fp32 there, the rate these pages give.
    DevicePeak(
        "V100 SXM2",
        ("V100", "SXM2"),
        {"fp32": 15.7, "fp16": 125.0},
        _V100,
        _V100_URL,
        note="Single precision 15.7, Tensor Performance 125 (dense); no TF32 or BF16.",
    ),
    DevicePeak(
        "V100 PCIe",
        ("V100", "PCIE"),
        {"fp32": 14.0, "fp16": 112.0},
        _V100,
        _V100_URL,
        note="Single precision 14, Tensor Performance 112 (dense); no TF32 or BF16.",
    ),
    DevicePeak(
        "V100S PCIe",
        ("V100S", "PCIE"),
        {"fp32": 16.4, "fp16": 130.0},
        _V100,
        _V100_URL,
        note="Single precision 16.4, Tensor Performance 130 (dense); no TF32 or BF16.",
    ),
    DevicePeak(
        "T4",
        ("T4",),
        {"fp32": 8.1, "fp16": 65.0},
        "NVIDIA T4 Tensor Core GPU specifications",
        "https://www.nvidia.com/en-us/data-center/tesla-t4/",
        note="Single precision 8.1, mixed precision (FP16/FP32) 65 (dense); no TF32 or BF16.",
    ),
    DevicePeak(
        "A10",
        ("A10",),
        {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
        "NVIDIA A10 Tensor Core GPU specifications",
        "https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
        note="The page prints dense | sparse: TF32 62.5 | 125*, BF16/FP16 125 | 250*. "
        "The A10G (a cloud variant) has no NVIDIA page and no entry.",
    ),
    DevicePeak(
        "L4",
        ("L4",),
        {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
        "NVIDIA L4 Tensor Core GPU datasheet",
        "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
        note=_HALF + " TF32 120*, BF16/FP16 242*, FP8 485*.",
    ),
    DevicePeak(
        "L40S",
        ("L40S",),
        {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
        "NVIDIA L40S GPU datasheet",
        "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
        note="The datasheet prints dense | sparse: TF32 183, BF16/FP16 362.05, FP8 733.",
    ),
    DevicePeak(
        "L40",
        ("L40",),
        {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362.0},
        "NVIDIA L40 GPU specifications",
        "https://www.nvidia.com/en-us/data-center/l40/",
        note="The page prints dense | sparse: TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*, "
        "FP8 362 | 724*.",
    ),
    # GeForce cards run fp16/bf16/fp8 at half rate with an fp32 accumulator, which is
    # what PyTorch's matmuls use; the table holds those rates.
    DevicePeak(
        "RTX 4090",
        ("RTX", "4090"),
        {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
        "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090)",
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        not_words=("D", "LAPTOP", "MOBILE"),
        note="Dense rates with FP32 accumulate: FP16/BF16 165.2, FP8 330.3, TF32 82.6.",
    ),
    DevicePeak(
        "B200",
        ("B200",),
        {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
        "NVIDIA HGX platform specifications (HGX B200, per GPU)",
        "https://www.nvidia.com/en-us/data-center/hgx/",
        note=_HALF + " TF32 2.2 PF*, BF16/FP16 4.5 PF*, FP8 9 PF* (HGX B200, 1,000 W). TF32 follows"
        " the per-GPU 2.2 PF, as does the HGX B200 table (1,100 dense) of"
        " glennklockwood.com/garden/processors/B200; the 8-GPU total of 18 PF would"
        " give 1,125, 2 % more.",
    ),
)
"""The table :func:`lookup_peak` reads: one :class:`DevicePeak` per GPU model.

Each entry holds the dense TFLOP/s per dtype key, the words a device name must (and
must not) contain, and the datasheet the figures come from, with its address.

>>> [p.model for p in PEAKS]  # doctest: +NORMALIZE_WHITESPACE
['A100', 'H100 SXM', 'H100 PCIe', 'H100 NVL', 'H200 SXM', 'H200 NVL',
 'V100 SXM2', 'V100 PCIe', 'V100S PCIe', 'T4', 'A10', 'L4', 'L40S', 'L40',
 'RTX 4090', 'B200']
>>> PEAKS[1].tflops["bf16"], PEAKS[1].source
(989.5, 'NVIDIA H100 Tensor Core GPU datasheet')

.. versionadded:: 0.1
"""

_WORD = re.compile(r"[A-Z0-9]+")
_DTYPES: Final[Mapping[object, str]] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
    "fp32": "fp32",
    "float32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "fp8": "fp8",
}


def dtype_key(dtype: object) -> str | None:
    """The table's key for ``dtype`` (a ``torch.dtype`` or a name), or None if it has none.

    >>> dtype_key(torch.bfloat16), dtype_key("tf32"), dtype_key(torch.int8)
    ('bf16', 'tf32', None)
    """
    try:
        return _DTYPES.get(dtype)
    except TypeError:  # unhashable
        return None


@dataclass(frozen=True)
class Peak:
    """The peak a device runs ``dtype`` at, or why there is none.

    .. versionadded:: 0.1
    """

    #: Dense peak TFLOP/s, or None when unknown (then :attr:`reason` says why).
    tflops: float | None
    #: The table's model name (``"H100 SXM"``), ``"given"`` for ``peak_tflops=``, or None.
    model: str | None
    #: The dtype key the peak is for (``"bf16"``...).
    dtype: str
    #: The document the figure comes from, or None.
    source: str | None = None
    #: Why there is no peak, or None when there is one.
    reason: str | None = None

    def describe(self) -> str:
        """``"989.5 TFLOP/s (H100 SXM, bf16)"``, or the reason there is none."""
        if self.tflops is None:
            return f"no peak: {self.reason}"
        return f"{self.tflops:g} TFLOP/s ({self.model}, {self.dtype})"


def _matches(entry: DevicePeak, words: set[str]) -> bool:
    return (
        all(w in words for w in entry.words)
        and not any(w in words for w in entry.not_words)
        and (not entry.any_words or any(w in words for w in entry.any_words))
    )


def lookup_peak(name: str, dtype: object) -> Peak:
    """The dense peak of the GPU called ``name`` (``torch.cuda.get_device_name()``) at ``dtype``.

    >>> lookup_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16).tflops
    312.0
    >>> print(lookup_peak("NVIDIA GeForce RTX 4090 D", "bf16").reason)
    no entry of the peak table matches the device
    'NVIDIA GeForce RTX 4090 D'; pass ...

    Args:
        name: the device's name as the driver reports it.
        dtype: a ``torch.dtype`` or one of ``"fp32"``, ``"tf32"``, ``"bf16"``,
            ``"fp16"``, ``"fp8"``.

    Returns:
        The ``Peak``, with the figure and its datasheet, or no figure and the reason.

    Raises:
        TypeError: ``name`` is not a str, or ``dtype`` neither a ``torch.dtype`` nor a str.

    .. versionadded:: 0.1
    """
    check_type(
        "lookup_peak",
        "name",
        name,
        str,
        expected="the device's name as a str",
        fix="Pass torch.cuda.get_device_name(device), e.g. 'NVIDIA H100 80GB HBM3'.",
    )
    if not isinstance(dtype, torch.dtype | str):
        fail_type(
            "lookup_peak",
            "dtype",
            f"a torch.dtype or one of {', '.join(map(repr, DTYPE_KEYS))}",
            dtype,
            "Pass e.g. torch.bfloat16 or 'bf16'.",
        )
    key = dtype_key(dtype)
    if key is None:
        return Peak(
            None,
            None,
            str(dtype),
            reason=f"the peak table has no figures for {dtype}; it covers "
            f"{', '.join(DTYPE_KEYS)}. Pass peak_tflops=... for this dtype.",
        )
    fix = f"pass peak_tflops=... (its dense peak for {key})"
    words = set(_WORD.findall(name.upper()))
    if "MIG" in words:
        return Peak(
            None,
            None,
            key,
            reason=f"the device {name!r} is a MIG slice, which runs on a part of the GPU "
            f"that the datasheet does not rate; {fix}",
        )
    found = [entry for entry in PEAKS if _matches(entry, words)]
    if not found:
        return Peak(
            None,
            None,
            key,
            reason=f"no entry of the peak table matches the device {name!r}; {fix}",
        )
    if len(found) > 1:
        names = " or ".join(e.model for e in found)
        return Peak(None, None, key, reason=f"the device {name!r} could be {names}; {fix}")
    entry = found[0]
    tflops = entry.tflops.get(key)
    if tflops is None:
        return Peak(
            None,
            entry.model,
            key,
            entry.source,
            reason=f"the {entry.model} has no {key} Tensor Core rate in {entry.source}; "
            f"train in {', '.join(entry.tflops)}, or pass peak_tflops=...",
        )
    return Peak(tflops, entry.model, key, entry.source)
