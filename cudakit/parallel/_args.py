"""The wrapper options of :func:`~cudakit.parallel.parallelize`: names and values, checked.

``parallelize(model, **options)`` hands its keyword arguments to the wrapper it
chooses: ``DistributedDataParallel``, ``DataParallel`` or ``fully_shard()``. They are
checked here before anything happens, so a typo or a bad value is a clear error at
the call, not an ``IndexError`` or ``AttributeError`` from inside the wrapper after the
model was moved (or half sharded). Under ``strategy="auto"`` the options are DDP's,
checked as DDP's even on a machine where no DDP is chosen.

Pure: nothing is read from the process (``device_count`` is passed in).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from .._check import (
    check_bool,
    check_callable,
    check_int,
    check_number,
    check_type,
    fail_type,
    fail_value,
)
from ..exceptions import DistributedSetupError

__all__ = ["WRAPPER_NAMES", "check_option_names", "check_options", "cuda_index", "fully_shard"]

#: The wrapper each strategy hands the options to.
WRAPPER_NAMES = {
    "ddp": "DistributedDataParallel",
    "fsdp": "fully_shard()",
    "dp": "DataParallel",
}


def fully_shard() -> Callable[..., Any]:
    """``torch.distributed.fsdp.fully_shard`` (FSDP2), or a clear error on an old torch."""
    try:
        from torch.distributed.fsdp import fully_shard as shard
    except ImportError:  # pragma: no cover - torch < 2.6
        raise DistributedSetupError(
            "strategy='fsdp' needs torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6); "
            f"this is torch {torch.__version__}. Upgrade torch or use strategy='ddp'."
        ) from None
    return cast("Callable[..., Any]", shard)


def _wrapper_target(kind: str) -> Callable[..., Any]:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel.__init__
    if kind == "fsdp":
        return fully_shard()
    return torch.nn.DataParallel.__init__


def check_option_names(
    func: str, kind: str, options: Mapping[str, Any], *, auto: bool = False
) -> None:
    """Options the wrapper of ``kind`` does not take are a ``TypeError`` listing the valid ones."""
    if kind not in WRAPPER_NAMES or not options:
        return
    what = WRAPPER_NAMES[kind]
    if auto:
        what += (
            " (strategy='auto' passes its options to DDP under torchrun; fully_shard()'s "
            "need strategy='fsdp')"
        )
    params = inspect.signature(_wrapper_target(kind)).parameters
    unknown = [k for k in options if k not in params or k in ("self", "module")]
    if unknown:
        valid = ", ".join(p for p in params if p not in ("self", "module"))
        raise TypeError(
            f"{func}() got keyword argument(s) {', '.join(map(repr, unknown))} that "
            f"{what} does not accept. Valid: {valid}."
        )


# --------------------------------------------------------------------------- values


def cuda_index(value: object) -> int | None:
    """The CUDA index ``value`` names (``1``, ``torch.device("cuda", 1)``, ``"cuda:1"``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError:
            return None
    if isinstance(value, torch.device) and value.type == "cuda" and value.index is not None:
        return value.index
    return None


_DEVICE = "an int (a CUDA index), a torch.device or a string such as 'cuda:0'"


def _check_device_ids(
    func: str, value: object, kind: str, device_count: int | None
) -> tuple[int, ...] | None:
    if value is None:
        return None
    fix = (
        "Pass device_ids=None (the default: every visible GPU, this process's first)."
        if kind == "dp"
        else "Pass device_ids=None (the default: this rank's own GPU, cuda:LOCAL_RANK)."
    )
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        fail_type(func, "device_ids", f"a list of devices, each {_DEVICE}", value, fix)
    if len(value) == 0:
        fail_value(
            func, "device_ids", "a non-empty list of devices", value, f"[] names no device. {fix}"
        )
    if kind == "ddp" and len(value) > 1:
        fail_value(
            func,
            "device_ids",
            "None or a list of one device (DDP runs one device per process)",
            value,
            f"Start one process per GPU (torchrun --nproc-per-node {len(value)}). {fix}",
        )
    ids = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, str, torch.device)):
            fail_type(func, "device_ids", f"a list of devices, each {_DEVICE}", item, fix)
        index = cuda_index(item)
        if kind == "dp" and index is None:
            fail_value(func, "device_ids", "CUDA devices with an index (0, 'cuda:1')", item, fix)
        if (
            kind == "dp"
            and device_count is not None
            and index is not None
            and index >= device_count
        ):
            fail_value(
                func,
                "device_ids",
                f"CUDA indices below {device_count} (the GPUs this process sees)",
                item,
                f"Check CUDA_VISIBLE_DEVICES. {fix}",
            )
        if index is not None:
            ids.append(index)
    if len(set(ids)) != len(ids):
        fail_value(func, "device_ids", "each device once", value, fix)
    return tuple(ids) if kind == "dp" else None


def _check_output_device(func: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        fail_type(func, "output_device", f"{_DEVICE}, or None", value)
    if isinstance(value, int) and value < 0:
        fail_value(func, "output_device", "a CUDA index >= 0, or None", value)
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            fail_value(func, "output_device", f"{_DEVICE}, or None", value)


def _check_bucket_cap(func: str, name: str, value: object) -> None:
    fix = "Pass a size in MiB such as 25 (DDP's default), or None for the default."
    expected = "a positive finite number of MiB, or None"
    check_number(func, name, value, positive=True, expected=expected, fix=fix)


_DDP_BOOLS = (
    "init_sync",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)
_DDP_OPTIONAL_BOOLS = ("broadcast_buffers", "forward_sync_buffers")


def _check_ddp(func: str, options: Mapping[str, Any]) -> None:
    for name in _DDP_BOOLS:
        if name in options:
            check_bool(func, name, options[name])
    for name in _DDP_OPTIONAL_BOOLS:
        if options.get(name) is not None:
            check_bool(func, name, options[name], fix=f"Pass {name}=True, False or None.")
    if options.get("bucket_cap_mb") is not None:
        _check_bucket_cap(func, "bucket_cap_mb", options["bucket_cap_mb"])
    caps = options.get("bucket_cap_mb_list")
    if caps is not None:
        if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
            fail_type(func, "bucket_cap_mb_list", "a list of positive numbers of MiB", caps)
        for cap in caps:
            _check_bucket_cap(func, "bucket_cap_mb_list", cap)
    if "process_group" in options and options["process_group"] is not None:
        group_type = getattr(torch.distributed, "ProcessGroup", None)
        if group_type is not None and not isinstance(options["process_group"], group_type):
            fail_type(
                func,
                "process_group",
                "a torch.distributed.ProcessGroup (e.g. from dist.new_group()), or None",
                options["process_group"],
                "Pass None for the default group.",
            )
    _check_mesh(func, "device_mesh", options.get("device_mesh"))


def _check_mesh(func: str, name: str, value: object) -> None:
    if value is None:
        return
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(value, DeviceMesh):
        fail_type(
            func,
            name,
            "a torch.distributed.device_mesh.DeviceMesh, or None",
            value,
            "Build one with init_device_mesh('cuda', (world_size,)) (or 'cpu'), or pass None "
            "for one mesh over every rank.",
        )


def _check_fsdp(func: str, options: Mapping[str, Any]) -> None:
    """The kinds of fully_shard()'s options: it records a module before it checks them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    kinds: dict[str, tuple[tuple[type[Any], ...], str]] = {
        "reshard_after_forward": ((bool, int), "True, False or an int (the group size)"),
        "mp_policy": ((MixedPrecisionPolicy,), "a torch.distributed.fsdp.MixedPrecisionPolicy"),
        "offload_policy": ((OffloadPolicy,), "a torch.distributed.fsdp.OffloadPolicy"),
        "ignored_params": ((set, frozenset), "a set of parameters"),
    }
    for name, value in options.items():
        if value is None or name not in kinds:
            continue
        types, expected = kinds[name]
        check_type(func, name, value, types, expected=expected)
    _check_pinned_offload(func, options.get("offload_policy"))
    fn = options.get("shard_placement_fn")
    if fn is not None:
        check_callable(func, "shard_placement_fn", fn, expected="a function of a parameter")
    _check_mesh(func, "mesh", options.get("mesh"))


def _check_pinned_offload(func: str, policy: object) -> None:
    """fully_shard pins offloaded shards (and fails) only once it has taken the model."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    pinned = isinstance(policy, CPUOffloadPolicy) and policy.pin_memory
    if pinned and not torch.accelerator.is_available():
        fail_value(
            func,
            "offload_policy",
            "CPUOffloadPolicy(pin_memory=False) on a machine without a GPU",
            policy,
            "Pinned memory is for copies to a GPU: pass CPUOffloadPolicy(pin_memory=False) "
            "to offload without pinning.",
        )


def check_options(
    func: str,
    kind: str,
    options: object,
    *,
    device_count: int | None = None,
    auto: bool = False,
) -> dict[str, Any]:
    """``options`` for the wrapper of ``kind`` (``"ddp"``, ``"dp"``, ``"fsdp"``), checked.

    Names first (a ``TypeError`` listing the valid ones), then the values cudakit can
    judge without the model: kinds, ranges, empty or out-of-range ``device_ids``.
    Returns a plain ``dict`` copy; ``options`` itself is not changed.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        fail_type(
            func,
            "options",
            "a mapping of wrapper option names to values, or None",
            options,
            "Pass e.g. options={'find_unused_parameters': True}.",
        )
    for key in options:
        check_type(
            func,
            "options",
            key,
            str,
            expected="strings as wrapper option names",
            fix="Pass them as keyword arguments, e.g. find_unused_parameters=True.",
        )
    opts = dict(options)
    check_option_names(func, kind, opts, auto=auto)
    if kind in ("ddp", "dp"):
        _check_device_ids(func, opts.get("device_ids"), kind, device_count)
        _check_output_device(func, opts.get("output_device"))
        if "dim" in opts:
            check_int(func, "dim", opts["dim"], fix="It is the batch dimension: pass dim=0.")
    if kind == "ddp":
        _check_ddp(func, opts)
    elif kind == "fsdp":
        _check_fsdp(func, opts)
    return opts
