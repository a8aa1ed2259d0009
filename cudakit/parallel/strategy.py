"""How to parallelise: every decision of :func:`~cudakit.parallel.parallelize`, made purely.

:func:`gather_facts` (in :mod:`~cudakit.parallel._facts`, public here) is the one
that looks at the process (the launcher's variables, a running group, the GPUs,
the requested device); it reads each fact once. :func:`choose_plan` turns those
facts into a :class:`ParallelPlan` (strategy, device, backend, DataParallel's
devices, the options the wrapper gets and the ones it ignores) without touching
anything, so every combination is tested on a CPU. :func:`choose_strategy` is its
public core.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed as dist

from .._check import check_int, check_type, fail_type, fail_value
from .._deprecated import renamed
from .._dist import (
    LAUNCHER_VARS,
    check_env,
    launch_hint,
    read_launcher_env,
)
from ..exceptions import DeviceError, DistributedSetupError
from ._args import check_options, cuda_index
from ._facts import ParallelFacts, gather_facts, requested_device

__all__ = [
    "REQUESTS",
    "ParallelFacts",
    "ParallelPlan",
    "Strategy",
    "StrategyRequest",
    "check_backend",
    "check_backend_serves",
    "check_strategy",
    "choose_plan",
    "choose_plan_for",
    "choose_strategy",
    "default_backend",
    "gather_facts",
    "rank_device",
    "requested_device",
]

#: What :func:`choose_strategy` decides.
Strategy = Literal["none", "dp", "ddp", "fsdp"]
#: What a user may ask :func:`parallelize` for.
StrategyRequest = Literal["auto", "none", "dp", "ddp", "fsdp"]

REQUESTS: tuple[str, ...] = get_args(StrategyRequest)

_ALIASES = {
    "dataparallel": "dp",
    "distributeddataparallel": "ddp",
    "distributed": "ddp",
    "fsdp2": "fsdp",
    "fullyshard": "fsdp",
    "fullyshardeddataparallel": "fsdp",
    "single": "none",
    "off": "none",
}


def check_strategy(strategy: object, *, func: str = "parallelize") -> str:
    """``strategy`` if it is one of :data:`REQUESTS`; else an error with a suggestion."""
    expected = f"one of {', '.join(map(repr, REQUESTS))}"
    strategy = check_type(
        func,
        "strategy",
        strategy,
        str,
        expected=expected,
        fix="Pass strategy='auto' to let cudakit choose.",
    )
    if strategy not in REQUESTS:
        low = strategy.strip().lower().replace("_", "").replace("-", "")
        guess = low if low in REQUESTS else _ALIASES.get(low)
        if guess is None:
            close = difflib.get_close_matches(low, REQUESTS, n=1)
            guess = close[0] if close else "auto"
        fail_value(func, "strategy", expected, strategy, f"Did you mean strategy={guess!r}?")
    return strategy


def _choose_strategy(
    request: str, *, world: int | None, device_count: int, device_type: str
) -> Strategy:
    """The rules of :func:`choose_strategy`, given the processes (``None``: no launcher)."""
    if world is not None and world > 1:
        if request == "dp":
            raise DistributedSetupError(
                f"strategy='dp' (DataParallel) inside a launch of {world} processes would make "
                "every process replicate the model over every GPU. Use strategy='ddp' (or 'auto') "
                "under torchrun, or run DataParallel in a single `python script.py` process."
            )
        return "ddp" if request == "auto" else cast(Strategy, request)
    if request == "auto":
        return "dp" if device_type == "cuda" and device_count > 1 else "none"
    if request == "dp":
        if device_type != "cuda" or device_count == 0:
            where = (
                "this machine has no visible CUDA device"
                if device_count == 0
                else f"the model's device is {device_type!r}"
            )
            raise DeviceError(
                f"strategy='dp' (DataParallel) needs CUDA devices, but {where}. Use "
                "strategy='auto' to fall back to a single device, or device='cuda'."
            )
        return "dp"
    if request in ("ddp", "fsdp") and world is None:
        raise DistributedSetupError(
            f"strategy={request!r} needs one process per GPU started by a launcher, but this "
            f"process was not (no {', '.join(LAUNCHER_VARS)} in the environment and no initialised "
            f"process group). {launch_hint()}; or use strategy='auto', which falls back to "
            "DataParallel or a single device."
        )
    return cast(Strategy, request)


#: Device types torch knows (``torch.device(...).type``).
_DEVICE_TYPES = frozenset(
    {"cpu", "cuda", "mps", "meta", "xpu", "hpu", "xla", "mtia", "privateuseone", "ipu"}
)


def choose_strategy(
    strategy: str = "auto",
    *,
    env: Mapping[str, str],
    device_count: int,
    device_type: str,
    group_world_size: int | None = None,
) -> Strategy:
    """Decide how to parallelise, from the launcher environment and the hardware. Pure.

    >>> torchrun = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
    ...             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    >>> choose_strategy("auto", env=torchrun, device_count=2, device_type="cuda")
    'ddp'
    >>> choose_strategy("auto", env={}, device_count=4, device_type="cuda")
    'dp'
    >>> choose_strategy("auto", env={}, device_count=0, device_type="cpu")
    'none'
    >>> choose_strategy("ddp", env={}, device_count=1, device_type="cuda")
    Traceback (most recent call last):
    ...
    cudakit.exceptions.DistributedSetupError: strategy='ddp' needs one process
    per GPU ...

    The rules, in order:

    * several processes (a launcher with ``WORLD_SIZE`` > 1, or an initialised
      group of that size): ``"auto"`` and ``"ddp"`` give ``"ddp"``; ``"fsdp"`` and
      ``"none"`` are honoured; ``"dp"`` is an error (each process would replicate
      over every GPU).
    * one process: ``"auto"`` gives ``"dp"`` when the device is CUDA and more than
      one GPU is visible, else ``"none"``. ``"dp"`` needs a CUDA device;
      ``"ddp"``/``"fsdp"`` need a launcher (``torchrun``, or an initialised group).

    ``"auto"`` never errors because of the hardware; it raises only for a launcher
    environment that claims several processes but is incomplete or inconsistent
    (guessing there would silently train N unrelated copies).

    Args:
        strategy: ``"auto"``, ``"none"``, ``"dp"``, ``"ddp"`` or ``"fsdp"``.
        env: the environment variables to read (pass ``os.environ`` for the live one).
        device_count: the number of visible CUDA devices.
        device_type: the type of the device the model will train on (``"cuda"``, ``"cpu"``...).
        group_world_size: the size of an already initialised default process group,
            ``None`` if there is none; it takes precedence over ``env``.

    Returns:
        ``"none"``, ``"dp"``, ``"ddp"`` or ``"fsdp"``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an unknown strategy (with a suggestion) or a negative count.
        DeviceError: ``"dp"`` without a CUDA device.
        DistributedSetupError: ``"ddp"``/``"fsdp"`` without a launcher, ``"dp"`` under
            one, or an incomplete launcher environment.

    .. versionadded:: 0.1
    """
    request = check_strategy(strategy, func="choose_strategy")
    check_env("choose_strategy", env)
    device_count = check_int(
        "choose_strategy",
        "device_count",
        device_count,
        minimum=0,
        fix="Pass torch.cuda.device_count().",
    )  # a NumPy int too
    device_type = check_type(
        "choose_strategy",
        "device_type",
        device_type,
        str,
        expected="a string such as 'cuda' or 'cpu'",
        fix="Pass torch.device(...).type.",
    )
    if device_type not in _DEVICE_TYPES:
        fail_value(
            "choose_strategy",
            "device_type",
            "a torch device type such as 'cuda' or 'cpu'",
            device_type,
            "Pass torch.device(...).type (lower case).",
        )
    if group_world_size is not None:
        group_world_size = check_int(
            "choose_strategy",
            "group_world_size",
            group_world_size,
            minimum=1,
            fix="Pass torch.distributed.get_world_size(), or None without a process group.",
        )
        world: int | None = group_world_size
    else:
        launcher = read_launcher_env(env, strict=request in ("ddp", "fsdp"))
        world = None if launcher is None else launcher.world_size
    return _choose_strategy(
        request, world=world, device_count=device_count, device_type=device_type
    )


# --------------------------------------------------------------------------- decisions


def _cuda_index_for(local: int, device_count: int) -> int:
    if local < device_count:
        return local
    if device_count == 1:  # one GPU per process via CUDA_VISIBLE_DEVICES
        return 0
    raise DistributedSetupError(
        f"LOCAL_RANK={local} but only {device_count} CUDA device(s) are visible to this process; "
        f"each rank needs its own GPU. Launch with `torchrun --nproc-per-node {device_count} "
        "script.py` (or fewer); under SLURM (srun), ask for no more tasks per node than GPUs "
        f"(`--ntasks-per-node={device_count}` with `--gpus-per-node={device_count}`) or give "
        "each task one GPU (`--gpus-per-task=1`); or check CUDA_VISIBLE_DEVICES."
    )


def rank_device(facts: ParallelFacts) -> torch.device:
    """This rank's device: the explicit one, else ``cuda:LOCAL_RANK``, else the best device.

    A group the user built without a launcher keeps the CUDA device they selected.
    """
    if facts.requested_device is not None:
        return facts.requested_device
    if not facts.cuda_available:
        return facts.best_device
    local = facts.env.local_rank if facts.env is not None else facts.current_cuda_index
    return torch.device("cuda", _cuda_index_for(local or 0, facts.device_count))


def default_backend(backend: str | None, device: torch.device) -> str:
    """``backend``, else ``"nccl"`` for a CUDA device and ``"gloo"`` otherwise."""
    if backend is not None:
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def check_backend(func: str, backend: object, *, planned: bool = False) -> str | None:
    """``backend``: ``None``, a backend torch knows (``"gloo"``, ``"nccl"``...) or a device map.

    ``planned=True`` (a plan made before any group starts) lets a name torch does not know
    yet through, since a plugin may register it (``Backend.register_backend``) before the
    group starts, and refuses only a typo: a name one edit from a known one, or another case.
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        fail_type(
            func,
            "backend",
            "a string such as 'nccl' or 'gloo', or None",
            backend,
            "Pass backend=None to pick nccl on CUDA and gloo on the CPU.",
        )
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    # "cpu:gloo,cuda:nccl" maps devices to backends; torch checks each part.
    parts = [p.split(":", 1)[-1].strip().lower() for p in backend.split(",")]
    unknown = [p for p in parts if p not in dist.Backend.backend_list]
    if planned:
        unknown = [p for p in unknown if any(_one_edit(p, k) for k in known)]
    if unknown:
        guesses = difflib.get_close_matches(unknown[0], known, n=1)
        guess = f"Did you mean {guesses[0]!r}? " if guesses else ""
        fail_value(
            func,
            "backend",
            f"one of {', '.join(map(repr, known))} (or a map such as 'cpu:gloo,cuda:nccl')",
            backend,
            f"{guess}Pass backend=None to pick nccl on CUDA and gloo on the CPU.",
        )
    return backend


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one insertion, deletion, substitution or swap."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
        return len(diff) == 1 or (swapped and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def check_backend_serves(func: str, backend: str | None, device: torch.device) -> None:
    """``backend`` must give ``device`` a backend that runs collectives on its tensors.

    A bare name serves every device but ``"nccl"``, which serves CUDA only; a map
    (``"cpu:gloo,cuda:nccl"``) serves the device types it names.
    """
    if backend is None:
        return
    parts = [p.strip().lower() for p in backend.split(",") if p.strip()]
    if parts and all(":" in p for p in parts):
        served = dict(p.split(":", 1) for p in parts)
        chosen = served.get(device.type)
        reason = f"the map has no entry for {device.type!r}"
    else:
        chosen = backend.strip().lower()
        reason = "NCCL runs collectives on CUDA tensors only"
    if chosen is not None and (chosen != "nccl" or device.type == "cuda"):
        return
    default = default_backend(None, device)
    where = "on CUDA" if device.type == "cuda" else "on the CPU"
    raise ValueError(
        f"{func}(backend=...): {backend!r} gives the device {device.type} no backend it "
        f"can run collectives with: {reason}. Pass backend={default!r} (or None, which picks "
        f"{default} {where}), or a device map such as 'cpu:gloo,cuda:nccl'."
    )


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """Every decision :func:`~cudakit.parallel.parallelize` carries out.

    .. versionadded:: 0.1
    """

    request: str  # what the user asked for
    strategy: Strategy
    device: torch.device  # where the model goes (DataParallel: its first GPU)
    create_group: bool  # DDP/FSDP without a running group: initialise one
    backend: str | None  # the backend of the group to create; None when none is created
    device_ids: tuple[Any, ...] | None  # DataParallel's devices; None for the other strategies
    wrapper_kwargs: Mapping[str, Any]  # what the wrapper (DDP, DataParallel, fully_shard) gets
    ignored: Mapping[str, Any]  # options the chosen strategy does not use (logged)


def choose_plan(
    request: str,
    facts: ParallelFacts,
    *,
    backend: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> ParallelPlan:
    """Decide everything :func:`~cudakit.parallel.parallelize` does, from ``facts``. Pure.

    >>> facts = ParallelFacts(env=None, group_world_size=None, cuda_available=False,
    ...     device_count=0, current_cuda_index=0, requested_device=None,
    ...     best_device=torch.device("cpu"))
    >>> plan = choose_plan(
    ...     "auto", facts, options={"find_unused_parameters": True}
    ... )
    >>> plan.strategy, plan.device, plan.ignored
    ('none', device(type='cpu'), {'find_unused_parameters': True})
    >>> choose_plan("DDP", facts)
    Traceback (most recent call last):
    ...
    ValueError: choose_plan(strategy=...) expects ..., got str 'DDP'. ...

    Every argument gets the door :func:`~cudakit.parallel.parallelize` has: the
    request, the kind of ``facts``, the backend (``"nccl"`` for a CPU plan is refused)
    and the wrapper options (names and values; under ``"auto"`` they are DDP's).

    Args:
        request: ``"auto"``, ``"none"``, ``"dp"``, ``"ddp"`` or ``"fsdp"``.
        facts: from :func:`gather_facts`, or built by hand.
        backend: the backend asked for, ``None`` to pick from the device.
        options: the wrapper options (``parallelize``'s ``**ddp_kwargs``).

    Raises:
        TypeError: a request, facts, backend or options of the wrong kind; unknown
            wrapper options; wrapper options for ``strategy="none"``.
        ValueError: an unknown request (with a suggestion), a backend that cannot
            serve the plan's device, a bad option value (``device_ids=[]``,
            ``bucket_cap_mb=-1``, ...).
        DeviceError, DistributedSetupError: as :func:`choose_strategy`.

    .. versionadded:: 0.1
    """
    return choose_plan_for(request, facts, backend=backend, options=options, func="choose_plan")


def choose_plan_for(
    request: object,
    facts: object,
    *,
    backend: object,
    options: object,
    func: str,
) -> ParallelPlan:
    """:func:`choose_plan`, its errors naming ``func`` (``parallelize`` calls it too)."""
    request = check_strategy(request, func=func)
    if not isinstance(facts, ParallelFacts):
        fail_type(
            func,
            "facts",
            "a ParallelFacts",
            facts,
            "Read them with cudakit.parallel.strategy.gather_facts(device, strict_env=False, "
            "func='choose_plan'), or build them by hand: ParallelFacts(env=..., "
            "group_world_size=..., cuda_available=..., device_count=..., current_cuda_index=..., "
            "requested_device=..., best_device=...) (a dict d: ParallelFacts(**d)).",
        )
    backend = check_backend(func, backend, planned=func == "choose_plan")
    # The options are checked before the decision: for an explicit request against its
    # wrapper, under "auto" against DDP's (a typo must not wait for the first torchrun).
    kind = "ddp" if request == "auto" else request
    opts = check_options(
        func, kind, options, device_count=facts.device_count, auto=request == "auto"
    )
    device = rank_device(facts)
    check_backend_serves(func, backend, device)
    world = (
        facts.group_world_size
        if facts.group_world_size is not None
        else (None if facts.env is None else facts.env.world_size)
    )
    chosen = _choose_strategy(
        request, world=world, device_count=facts.device_count, device_type=device.type
    )
    if chosen in ("ddp", "fsdp"):
        if chosen == "ddp" and device.type == "cuda":
            opts.setdefault("device_ids", [device.index])
            opts.setdefault("output_device", device.index)
        create = facts.group_world_size is None
        return ParallelPlan(
            request,
            chosen,
            device,
            create_group=create,
            backend=default_backend(backend, device) if create else None,
            device_ids=None,
            wrapper_kwargs=opts,
            ignored={},
        )
    if chosen == "dp":
        ignored: dict[str, Any] = opts if request == "auto" else {}
        kwargs = {} if request == "auto" else opts
        given = kwargs.pop("device_ids", None)
        if given is None:
            n = facts.device_count
            ids = [device.index, *(i for i in range(n) if i != device.index)]
        else:  # checked: CUDA devices with an index, each once, all visible
            ids = [cast(int, cuda_index(i)) for i in given]
        return ParallelPlan(
            request,
            "dp",
            torch.device("cuda", ids[0]),
            create_group=False,
            backend=None,
            device_ids=tuple(ids),
            wrapper_kwargs=kwargs,
            ignored=ignored,
        )
    if opts and request != "auto":
        raise TypeError(
            f"{func}(strategy='none') takes no wrapper options, got {sorted(opts)}. "
            "Drop them, or use strategy='ddp' under torchrun."
        )
    return ParallelPlan(
        request,
        "none",
        device,
        create_group=False,
        backend=None,
        device_ids=None,
        wrapper_kwargs={},
        ignored=opts,
    )


__getattr__ = renamed(__name__, {"plan_parallel": choose_plan})
