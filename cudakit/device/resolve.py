"""Device resolution: :func:`resolve_device` turns what the user wrote into a ``torch.device``."""

from __future__ import annotations

import difflib
import re

import torch

from .._accel import default_cuda_index
from .._check import check_device, is_int, name_error
from ..exceptions import DeviceError

__all__ = ["DeviceLike", "resolve_cached", "resolve_device", "resolve_for", "resolve_spec"]

#: Everything cudakit accepts wherever it takes ``device=``.
DeviceLike = torch.device | str | int | None

_KNOWN_TYPES = ("cpu", "cuda", "mps", "meta")
_GLUED_INDEX = re.compile(r"^(cuda|cpu|mps|meta)(\d+)$")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _existing_cuda() -> str:
    n = torch.cuda.device_count()
    if n == 0:
        return "no CUDA devices"
    return ", ".join(f"cuda:{i}" for i in range(n))


def _suggest(spec: str) -> str:
    low = spec.strip().lower()
    m = _GLUED_INDEX.match(low)
    if m:
        return f"{m.group(1)}:{m.group(2)}"
    if low in ("gpu", "nvidia", "cuda()", "gpu:0") or low.startswith("gpu"):
        idx = low[3:].lstrip(":")
        return f"cuda:{idx}" if idx.isdigit() else "cuda"
    if low in _KNOWN_TYPES or low == "auto":
        return low
    close = difflib.get_close_matches(low.split(":")[0], [*_KNOWN_TYPES, "auto"], n=1)
    return close[0] if close else "auto"


def _check_cuda_index(index: int, spec: object) -> torch.device:
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device={spec!r} asks for CUDA, but CUDA is not available on this machine "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
            'Use device="auto" to fall back to the best available device, or "cpu".'
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device={spec!r} asks for CUDA device {index}, but this machine has {count} "
            f"visible CUDA device(s): {_existing_cuda()}. Pick one of those "
            "(CUDA_VISIBLE_DEVICES may be hiding the others)."
        )
    return torch.device("cuda", index)


def resolve_device(spec: DeviceLike = None) -> torch.device:
    """Turn a device spec into a concrete ``torch.device``, or explain why it cannot.

    ``None`` and ``"auto"`` pick the current CUDA device, else MPS, else the CPU
    (a quiet fallback: you asked for the best there is). Before CUDA starts, under
    torchrun or SLURM the "current" CUDA device is this process's own, ``LOCAL_RANK``
    (torch's would be 0 in every process). Everything explicit is
    honoured exactly or raises :class:`~cudakit.exceptions.DeviceError`.

    >>> resolve_device("cpu")
    device(type='cpu')
    >>> resolve_device(torch.device("meta"))
    device(type='meta')
    >>> resolve_device("gpu")
    Traceback (most recent call last):
    ...
    cudakit.exceptions.DeviceError: resolve_device(spec='gpu'): unknown device ...

    Args:
        spec: ``None``/``"auto"``; ``"cuda"`` (the current CUDA device) or
            ``"cuda:N"``; an ``int`` N (CUDA device N; a NumPy int too); ``"cpu"``,
            ``"mps"``, ``"meta"``; or a ``torch.device``, which is checked and passed
            through.

    Returns:
        A ``torch.device``; CUDA devices always carry an index.

    Raises:
        DeviceError: the device does not exist here, or the spec is misspelt; also a
            device type this torch build or machine cannot use (``"xla"``, ``"xpu"``).
        TypeError: the spec is not a string, int, ``torch.device`` or ``None``.

    .. versionadded:: 0.1
    """
    try:
        return resolve_spec(spec)
    except (TypeError, ValueError) as exc:  # named: resolve_device(spec=...): device=...
        raise name_error("resolve_device", "spec", spec, exc) from None


def resolve_spec(spec: DeviceLike) -> torch.device:
    """:func:`resolve_device` with errors that name no function, for callers that name
    their own (``check_device`` prefixes the public function and its ``device=``)."""
    if spec is None or (isinstance(spec, str) and spec == "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", default_cuda_index())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if is_int(spec) and type(spec) is not int:
        spec = int(spec)  # a NumPy int: a CUDA index like any other
    if not (is_int(spec) or isinstance(spec, (str, torch.device))):
        raise TypeError(
            "device must be a torch.device, a string such as 'cuda:0', an int CUDA index or "
            f"None, got {type(spec).__name__} {spec!r}. Pass device='auto' to let cudakit choose."
        )
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceError(
                f"device={spec} is a negative CUDA index; CUDA indices start at 0. "
                f"Existing devices: {_existing_cuda()}. Pass one of those, or 'cpu'."
            )
        return _check_cuda_index(spec, spec)
    if isinstance(spec, str):
        try:
            dev = torch.device(spec)
        except (RuntimeError, ValueError):
            raise DeviceError(
                f"unknown device {spec!r}; did you mean {_suggest(spec)!r}? "
                "Valid specs: 'auto', 'cpu', 'cuda', 'cuda:N', 'mps', 'meta', an int N, "
                "or a torch.device."
            ) from None
    else:
        dev = spec
    if dev.type == "cuda":
        return _check_cuda_index(default_cuda_index() if dev.index is None else dev.index, spec)
    if dev.type == "mps" and not _mps_available():
        raise DeviceError(
            f"device={spec!r} asks for Apple MPS, which is not available on this machine. "
            'Use device="auto" or "cpu".'
        )
    if dev.type not in ("cpu", "meta", "mps") and not _backend_available(dev.type):
        # torch.device accepts every type torch knows the name of ("xla", "xpu", "hpu");
        # without this check the move fails later, deep inside torch.
        extra = (
            " XLA devices come with the torch_xla package, through its own device API."
            if dev.type == "xla"
            else ""
        )
        raise DeviceError(
            f"device={spec!r} asks for a {dev.type!r} device, but this torch build "
            f"(torch {torch.__version__}) or machine has none available.{extra} "
            'Use device="auto" to pick the best available device, or "cpu".'
        )
    if dev.type in ("cpu", "meta") and dev.index is not None:
        # Tensors on them carry no index: "cpu:0" is "cpu", so `t.device == dev` holds.
        return torch.device(dev.type)
    return dev


def _backend_available(device_type: str) -> bool:
    """Whether ``torch.<device_type>.is_available()`` says yes (xpu, hpu, npu, ...)."""
    backend = getattr(torch, device_type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available):
        return False
    try:
        return bool(is_available())
    except Exception:  # a broken backend is not an available one
        return False


# check_device (cudakit._check) calls the plain resolver through this, so that an error
# names the public function that took ``device=``, not resolve_device as well.
resolve_device.__wrapped__ = resolve_spec  # type: ignore[attr-defined]


def resolve_for(func: str, spec: DeviceLike) -> torch.device:
    """:func:`resolve_device` for the public function ``func``, which its errors name."""
    return check_device(func, "device", spec, resolve_device)


_RESOLVED: dict[tuple[type, object], torch.device] = {}
# (spec, device) of the last explicit spec answered from _RESOLVED; never None/"auto".
_LAST: tuple[object, torch.device] = (object(), torch.device("cpu"))


def resolve_cached(spec: DeviceLike) -> torch.device:
    """resolve_device, memoised for explicit specs whose answer cannot change.

    ``None``/``"auto"`` and an index-less ``"cuda"`` follow the current device, so
    they are resolved on every call; ``"cpu"``, ``"meta"``, ``"cuda:1"``, ``1`` or a
    ``torch.device`` with an index always mean the same device in a process.
    """
    global _LAST
    last = _LAST
    if spec is last[0]:  # the spec of the previous call, the very object: the same answer
        return last[1]
    key = (type(spec), spec)
    try:
        dev = _RESOLVED[key]
    except (KeyError, TypeError):
        pass
    else:
        _LAST = (spec, dev)
        return dev
    dev = resolve_for("on_device", spec)
    stable = spec is not None and spec != "auto"
    if dev.type == "cuda":
        stable = stable and (
            isinstance(spec, int) or (isinstance(spec, (str, torch.device)) and ":" in str(spec))
        )
    if stable and len(_RESOLVED) < 64:
        _RESOLVED[key] = dev
    return dev
