"""The precision policy: which dtype, whether autocast runs, whether a scaler is needed.

:func:`decide_precision` is pure: it takes the capabilities of the machine as an
argument (:class:`Capabilities`, gathered once by :func:`probe_capabilities`) and
is tested over every combination. ``dtype="auto"`` never picks a precision the
hardware only emulates, so automatic precision is never slower than float32:

- CUDA: bf16 where the GPU runs it natively (Ampere and later), else fp16 with a
  ``GradScaler``;
- CPU: bf16 only where the CPU runs it natively (AVX512-bf16 or AMX), else float32
  with autocast off;
- MPS: fp16 with a scaler; other accelerators: bf16.

An explicit dtype is always honoured.
"""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

import torch

from .._accel import cpu_native_bf16, cpu_native_fp16
from .._check import check_bool, check_type, fail_value

__all__ = [
    "DTYPE_ALIASES",
    "Capabilities",
    "Precision",
    "check_autocast",
    "cpu_native_bf16",
    "cpu_native_fp16",
    "decide_precision",
    "log_choice",
    "parse_dtype",
    "probe_capabilities",
]

_log = logging.getLogger("cudakit.amp")

DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    # Lightning Fabric's and accelerate's names for the same mixed precisions.
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "16": torch.float16,
    "32-true": torch.float32,
    "32": torch.float32,
    "no": torch.float32,
}
#: Precisions that keep the weights themselves in low precision: not autocast's job.
_TRUE_LOW_PRECISION = ("bf16-true", "16-true", "64-true", "64")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Capabilities(NamedTuple):
    """What the hardware runs natively (False where it was not asked or is absent).

    .. versionadded:: 0.1
    """

    #: The CUDA device computes bf16 natively (compute capability 8.0 or later).
    cuda_bf16: bool = False
    #: The CPU has native bf16 kernels (AVX512-bf16 or AMX), per oneDNN.
    cpu_bf16: bool = False
    #: The CPU has native fp16 kernels (AVX512-fp16 or AMX-fp16), per oneDNN.
    cpu_fp16: bool = False


class Precision(NamedTuple):
    """A decided precision: ``dtype`` is float32 exactly when autocast is off.

    .. versionadded:: 0.1
    """

    dtype: torch.dtype
    autocast: bool
    scaler: bool
    #: Why ``"auto"`` chose what it chose (empty for an explicit dtype).
    reason: str = ""


def parse_dtype(dtype: object) -> torch.dtype | None:
    """The torch dtype asked for (None for ``"auto"``); TypeError/ValueError otherwise."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return None
        alias = DTYPE_ALIASES.get(dtype.lower())
        if dtype.lower() in _TRUE_LOW_PRECISION:
            raise ValueError(
                f"autocast_step(dtype={dtype!r}) asks for weights held in that precision; "
                "autocast_step runs mixed precision (float32 weights, autocast for the "
                "compute). Pass dtype='bf16' (Lightning's 'bf16-mixed') or 'fp16' "
                "('16-mixed'), or convert the model yourself (model.to(torch.bfloat16)) "
                "and pass dtype='fp32'."
            )
        if alias is None:
            raise ValueError(
                f"autocast_step(dtype={dtype!r}) is not a precision cudakit knows; expected "
                '"auto", torch.bfloat16, torch.float16 or torch.float32 '
                '(or the strings "bf16", "fp16", "fp32", and Lightning\'s "bf16-mixed", '
                '"16-mixed", "32-true").'
            )
        return alias
    dtype = check_type(
        "autocast_step",
        "dtype",
        dtype,
        torch.dtype,
        expected="a torch.dtype or 'auto'",
        fix="For example: dtype=torch.bfloat16.",
    )
    if dtype not in _DTYPES:
        raise ValueError(
            f"autocast_step(dtype={dtype}) is not a mixed-precision dtype; expected "
            "torch.bfloat16, torch.float16, torch.float32 (autocast off) or 'auto'."
        )
    return dtype


def decide_precision(
    requested: torch.dtype | None,
    device_type: str,
    *,
    enabled: bool,
    user_scaler: bool,
    caps: Capabilities,
) -> Precision:
    """Decide the step's precision from the request and the machine's capabilities.

    ``requested`` is None for ``"auto"``. Pure: no device is queried here.

    >>> decide_precision(None, "cpu", enabled=True, user_scaler=False,
    ...                  caps=Capabilities())
    Precision(dtype=torch.float32, autocast=False, scaler=False, reason='...')
    >>> decide_precision(None, "cuda", enabled=True, user_scaler=False,
    ...                  caps=Capabilities(cuda_bf16=True)).dtype
    torch.bfloat16

    Raises:
        TypeError: an argument of the wrong kind (``caps`` not a :class:`Capabilities`).
        ValueError: ``requested`` is not bf16, fp16 or fp32 (``parse_dtype`` first).

    .. versionadded:: 0.1
    """
    func = "decide_precision"
    if requested is not None:
        check_type(
            func,
            "requested",
            requested,
            torch.dtype,
            expected="a torch.dtype or None",
            fix="Pass parse_dtype(dtype), e.g. torch.bfloat16, or None for 'auto'.",
        )
        if requested not in _DTYPES:
            fail_value(
                func,
                "requested",
                "torch.bfloat16, torch.float16 or torch.float32",
                requested,
                "Pass parse_dtype(dtype) first.",
            )
    _check_device_type(func, device_type)
    check_bool(func, "enabled", enabled)
    check_bool(func, "user_scaler", user_scaler)
    check_type(
        func,
        "caps",
        caps,
        Capabilities,
        expected="a cudakit.amp.policy.Capabilities",
        fix="Pass probe_capabilities(device_type), or Capabilities(...) in a test.",
    )
    if not enabled:
        return Precision(torch.float32, False, False)
    if requested is not None:
        return _precision(requested)
    if user_scaler:
        return _precision(torch.float16, "a GradScaler was given, so fp16")
    if device_type == "cuda":
        if caps.cuda_bf16:
            return _precision(torch.bfloat16, "the GPU runs bf16 natively")
        return _precision(torch.float16, "the GPU has no native bf16, so fp16 with a scaler")
    if device_type == "mps":
        return _precision(torch.float16, "MPS runs fp16")
    if device_type == "cpu":
        if caps.cpu_bf16:
            return _precision(torch.bfloat16, "the CPU runs bf16 natively (AVX512-bf16/AMX)")
        return _precision(
            torch.float32,
            "the CPU has no native bf16 (no AVX512-bf16 or AMX), where emulated bf16 is "
            "about 10 times slower than float32; pass dtype=torch.bfloat16 to force it",
        )
    return _precision(torch.bfloat16, f"{device_type} runs bf16")


def _precision(dtype: torch.dtype, reason: str = "") -> Precision:
    on = dtype != torch.float32
    return Precision(dtype, on, dtype == torch.float16, reason)


def _cuda_native_bf16() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3 has no including_emulation
        major, _ = torch.cuda.get_device_capability()
        return major >= 8


def _check_device_type(func: str, device_type: object) -> None:
    kind = check_type(
        func,
        "device_type",
        device_type,
        str,
        expected="a device type such as 'cuda'",
        fix="Pass torch.device(...).type, e.g. 'cuda' or 'cpu'.",
    )
    try:
        torch.device(kind)
    except (RuntimeError, ValueError):
        fail_value(
            func,
            "device_type",
            "a device type torch knows, such as 'cuda' or 'cpu'",
            device_type,
            "Pass torch.device(...).type.",
        )


def probe_capabilities(device_type: str) -> Capabilities:
    """Gather the capabilities :func:`decide_precision` needs for ``device_type``, only those."""
    _check_device_type("probe_capabilities", device_type)
    if device_type == "cuda":
        return Capabilities(cuda_bf16=_cuda_native_bf16())
    if device_type == "cpu":
        return Capabilities(cpu_bf16=cpu_native_bf16(), cpu_fp16=cpu_native_fp16())
    return Capabilities()


_logged: set[tuple[str, torch.dtype]] = set()


def log_choice(device_type: str, precision: Precision) -> None:
    """Log once per (device type, dtype) why ``"auto"`` fell back to float32."""
    _check_device_type("log_choice", device_type)
    check_type(
        "log_choice",
        "precision",
        precision,
        Precision,
        expected="a Precision",
        fix="Pass what decide_precision() returned.",
    )
    key = (device_type, precision.dtype)
    if precision.dtype == torch.float32 and precision.reason and key not in _logged:
        _logged.add(key)
        _log.info("autocast_step(dtype='auto') on %s: float32, %s.", device_type, precision.reason)


def check_autocast(device_type: str, dtype: torch.dtype, enabled: bool) -> None:
    """Raise if ``torch.autocast`` would refuse or silently disable this combination."""
    _check_device_type("check_autocast", device_type)
    check_type(
        "check_autocast",
        "dtype",
        dtype,
        torch.dtype,
        expected="a torch.dtype",
        fix="Pass e.g. torch.bfloat16.",
    )
    check_bool("check_autocast", "enabled", enabled)
    available = getattr(torch.amp.autocast_mode, "is_autocast_available", None)
    if enabled and available is not None and not available(device_type):
        raise ValueError(
            f"autocast_step(): the optimizer's parameters are on {device_type!r}, where "
            "torch.autocast is not available. Move the model to 'cuda' or 'cpu' first "
            "(cudakit.device.on_device(model, device=...)), or pass enabled=False."
        )
    if not enabled:
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.autocast(device_type, dtype=dtype, enabled=True)
    except RuntimeError as e:
        raise ValueError(
            f"autocast_step(dtype={dtype}) cannot run on {device_type!r}: {e} "
            "Pass dtype='auto' to let cudakit pick the precision this device supports."
        ) from None
    for w in caught:
        if "not support" in str(w.message) or "Disabling autocast" in str(w.message):
            raise ValueError(
                f"autocast_step(dtype={dtype}) cannot run on {device_type!r}: "
                f"{str(w.message).strip()} Pass dtype='auto' to let cudakit pick the "
                "precision this device supports."
            )
