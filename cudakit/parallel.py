"""Parallel training: choose DataParallel / DDP / FSDP2, set it up correctly, tear it down.

The decision is a pure function, :func:`choose_strategy`, tested over every input;
:func:`parallelize` only carries it out (moves the model, initialises the process
group, wraps) and logs it once. Around it sit the helpers every DDP script needs:
:func:`process_group` (guaranteed teardown), :func:`launch` (N local processes with
a torchrun-equivalent environment), :func:`unwrap`, :func:`state_dict` /
:func:`load_state_dict` (no ``module.`` prefix), :func:`rank`, :func:`world_size`,
:func:`local_rank`, :func:`is_main_process`, :func:`main_process_first` and
:func:`distributed_loader` (a rank's shard, ``set_epoch`` called for you).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import difflib
import inspect
import logging
import math
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, TypeVar, cast, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import Self

from ._contextlib import ContextDecorator
from ._launch import launch
from .device import DeviceLike, resolve_device
from .exceptions import DeviceError, DistributedSetupError, LaunchError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = [
    "DistributedEnv",
    "DistributedLoader",
    "LaunchError",
    "ProcessGroupInfo",
    "Strategy",
    "StrategyRequest",
    "choose_strategy",
    "distributed_loader",
    "is_main_process",
    "launch",
    "load_state_dict",
    "local_rank",
    "main_process_first",
    "parallelize",
    "process_group",
    "rank",
    "read_env",
    "state_dict",
    "unwrap",
    "world_size",
]

logger = logging.getLogger("cudakit")

T_co = TypeVar("T_co", covariant=True)

#: What :func:`choose_strategy` decides.
Strategy = Literal["none", "dp", "ddp", "fsdp"]
#: What a user may ask :func:`parallelize` for.
StrategyRequest = Literal["auto", "none", "dp", "ddp", "fsdp"]

_REQUESTS: tuple[str, ...] = get_args(StrategyRequest)
_ENV_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def _launch_hint(world: int | None = None) -> str:
    n = world if world and world > 1 else "N"
    return (
        f"Launch the script with `torchrun --nproc-per-node {n} script.py` (one node), or call "
        "cudakit.parallel.launch(fn, nprocs=N) from Python"
    )


# --------------------------------------------------------------------------- environment


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    """The launcher environment of this process, as torchrun sets it.

    .. versionadded:: 0.1
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _parse_int(env: Mapping[str, str], name: str, lo: int) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistributedSetupError(
            f"environment variable {name}={raw!r} is not an integer. {_launch_hint()}, which "
            "sets it correctly."
        ) from None
    if value < lo:
        raise DistributedSetupError(
            f"environment variable {name}={value} must be >= {lo}. {_launch_hint()}, which sets "
            "it correctly."
        )
    return value


def read_env(env: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """Read torchrun's variables from ``env`` (default ``os.environ``); ``None`` outside a launcher.

    >>> read_env({})
    >>> read_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
    ...           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    DistributedEnv(rank=1, world_size=2, local_rank=1, local_world_size=2,
                   master_addr='127.0.0.1', master_port=29500)
    >>> read_env({"WORLD_SIZE": "2", "RANK": "0"})
    Traceback (most recent call last):
    ...
    cudakit.exceptions.DistributedSetupError: incomplete launcher environment: ...

    A partial environment is an error when it claims more than one process (or
    ``strict=True`` in the callers that need a launcher); one that claims a single
    process (``WORLD_SIZE`` unset or ``1``) with some variables missing is treated
    as no launcher at all, so stray variables never break a plain ``python script.py``.

    Args:
        env: a mapping of environment variables; ``None`` reads ``os.environ``.

    Returns:
        A :class:`DistributedEnv`, or ``None`` when no launcher set the variables.

    Raises:
        DistributedSetupError: variables are missing although ``WORLD_SIZE`` > 1, or
            a value is not an integer, or ``RANK``/``LOCAL_RANK`` is out of range.

    .. versionadded:: 0.1
    """
    return _read_env(os.environ if env is None else env, strict=False)


def _read_env(env: Mapping[str, str], *, strict: bool) -> DistributedEnv | None:
    present = [k for k in _ENV_VARS if env.get(k, "") != ""]
    if not present:
        return None
    missing = [k for k in _ENV_VARS if k not in present]
    if missing:
        world = _parse_int(env, "WORLD_SIZE", 1) if "WORLD_SIZE" in present else None
        if not strict and (world is None or world == 1):
            return None
        raise DistributedSetupError(
            f"incomplete launcher environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. {_launch_hint(world)}, which sets all of "
            f"{', '.join(_ENV_VARS)}; for several nodes add --nnodes, --node-rank and "
            "--rdzv-endpoint (see the cudakit parallel docs)."
        )
    world = _parse_int(env, "WORLD_SIZE", 1)
    rank_ = _parse_int(env, "RANK", 0)
    local = _parse_int(env, "LOCAL_RANK", 0)
    port = _parse_int(env, "MASTER_PORT", 1)
    local_world = (
        _parse_int(env, "LOCAL_WORLD_SIZE", 1) if env.get("LOCAL_WORLD_SIZE", "") else world
    )
    if rank_ >= world:
        raise DistributedSetupError(
            f"RANK={rank_} but WORLD_SIZE={world}: ranks run from 0 to WORLD_SIZE-1. "
            f"{_launch_hint(world)} instead of setting the variables by hand."
        )
    if local >= local_world:
        raise DistributedSetupError(
            f"LOCAL_RANK={local} but LOCAL_WORLD_SIZE={local_world}: local ranks run from 0 to "
            f"LOCAL_WORLD_SIZE-1. {_launch_hint(world)} instead of setting the variables by hand."
        )
    if port > 65535:
        raise DistributedSetupError(
            f"MASTER_PORT={port} is not a TCP port (1-65535). Pick a free port, e.g. "
            "`torchrun --master-port 29500 ...`, or let torchrun choose with --standalone."
        )
    return DistributedEnv(rank_, world, local, local_world, env["MASTER_ADDR"], port)


# --------------------------------------------------------------------------- the decision


def _check_request(strategy: object) -> str:
    if not isinstance(strategy, str):
        raise TypeError(
            f"strategy must be one of {', '.join(map(repr, _REQUESTS))}, got "
            f"{type(strategy).__name__} {strategy!r}. Pass strategy='auto' to let cudakit choose."
        )
    if strategy not in _REQUESTS:
        low = strategy.strip().lower().replace("_", "").replace("-", "")
        aliases = {
            "dataparallel": "dp",
            "distributeddataparallel": "ddp",
            "distributed": "ddp",
            "fsdp2": "fsdp",
            "fullyshard": "fsdp",
            "fullyshardeddataparallel": "fsdp",
            "single": "none",
            "off": "none",
        }
        guess = low if low in _REQUESTS else aliases.get(low)
        if guess is None:
            close = difflib.get_close_matches(low, _REQUESTS, n=1)
            guess = close[0] if close else "auto"
        raise ValueError(
            f"unknown strategy {strategy!r}; did you mean {guess!r}? Valid strategies: "
            f"{', '.join(map(repr, _REQUESTS))}."
        )
    return strategy


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
    cudakit.exceptions.DistributedSetupError: strategy='ddp' needs one process per GPU ...

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
    request = _check_request(strategy)
    if isinstance(device_count, bool) or not isinstance(device_count, int):
        raise TypeError(f"device_count must be an int, got {type(device_count).__name__}.")
    if device_count < 0:
        raise ValueError(f"device_count must be >= 0, got {device_count}.")
    if not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a string such as 'cuda' or 'cpu', got "
            f"{type(device_type).__name__}; pass torch.device(...).type."
        )
    if group_world_size is not None:
        if isinstance(group_world_size, bool) or not isinstance(group_world_size, int):
            raise TypeError(
                f"group_world_size must be an int or None, got {type(group_world_size).__name__}."
            )
        if group_world_size < 1:
            raise ValueError(f"group_world_size must be >= 1, got {group_world_size}.")
        world: int | None = group_world_size
    else:
        launcher = _read_env(env, strict=request in ("ddp", "fsdp"))
        world = None if launcher is None else launcher.world_size

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
            f"process was not (no {', '.join(_ENV_VARS)} in the environment and no initialised "
            f"process group). {_launch_hint()}; or use strategy='auto', which falls back to "
            "DataParallel or a single device."
        )
    return cast(Strategy, request)


# --------------------------------------------------------------------------- process group

_lock = threading.RLock()
_owned_group = False  # True while the default group is one cudakit created
_atexit_registered = False
# The rendezvous store, kept across groups (see _group_store), keyed by the environment
# that made it; and how many groups this process has initialised on it.
_store: tuple[tuple[str, int, int, int, str], Store] | None = None
_generation = 0


@dataclasses.dataclass(frozen=True)
class ProcessGroupInfo:
    """What :func:`process_group` set up (or found): backend, ranks, device, timeout.

    .. versionadded:: 0.1
    """

    backend: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: datetime.timedelta
    created: bool


def _check_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return _DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not math.isfinite(timeout):
            td = datetime.timedelta(0)  # rejected below with the finite-timeout message
        else:
            td = datetime.timedelta(seconds=float(timeout))
    else:
        raise TypeError(
            f"timeout must be seconds (int/float) or a datetime.timedelta, got "
            f"{type(timeout).__name__} {timeout!r}; e.g. timeout=600."
        )
    if not td.total_seconds() > 0:
        raise ValueError(
            f"timeout must be a finite positive duration, got {timeout!r}: an infinite "
            "timeout turns one crashed rank into a hang on every other. Use e.g. timeout=600."
        )
    return td


def _cuda_index_for(local: int, device_count: int) -> int:
    if local < device_count:
        return local
    if device_count == 1:  # one GPU per process via CUDA_VISIBLE_DEVICES
        return 0
    raise DistributedSetupError(
        f"LOCAL_RANK={local} but only {device_count} CUDA device(s) are visible to this process; "
        f"each rank needs its own GPU. Launch with `torchrun --nproc-per-node {device_count} "
        "script.py` (or fewer), or check CUDA_VISIBLE_DEVICES."
    )


def _default_device(env_: DistributedEnv | None) -> torch.device:
    """Each rank's own device without starting CUDA: cuda:LOCAL_RANK, else auto."""
    if torch.cuda.is_available():
        if env_ is not None:
            local = env_.local_rank
        else:  # a group the user built without torchrun: keep the device they selected
            local = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return torch.device("cuda", _cuda_index_for(local, torch.cuda.device_count()))
    return resolve_device(None)


def _index(device: torch.device) -> int | None:
    return cast("int | None", device.index)


def _resolve_rank_device(device: DeviceLike, env_: DistributedEnv | None) -> torch.device:
    if device is None or (isinstance(device, str) and device in ("auto", "cuda")):
        if device == "cuda" and not torch.cuda.is_available():
            return resolve_device(device)  # the clear DeviceError
        return _default_device(env_)
    if isinstance(device, torch.device) and device.type == "cuda" and _index(device) is None:
        return _default_device(env_) if torch.cuda.is_available() else resolve_device(device)
    return resolve_device(device)


def _exit_barrier() -> None:
    """Wait until every rank has reached the end of its work, before the group goes away.

    gloo gets ``monitored_barrier``, whose error names the ranks that never arrived;
    it runs under the group's own (finite) timeout.
    """
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(wait_all_ranks=True)
    else:
        _barrier()


def _teardown(*, sync: bool = False) -> None:
    """Destroy the default process group if cudakit created it. Idempotent, never raises.

    ``sync=True`` (a clean exit) first waits in a barrier for the other ranks: a
    rank that destroys its gloo group while a peer is still finishing its last
    collective can make either process abort ("terminate called without an active
    exception"). After an exception there is no barrier: the peers may be gone.
    """
    global _owned_group
    with _lock:
        if not _owned_group:
            return
        _owned_group = False
        if not (dist.is_available() and dist.is_initialized()):
            return
        if sync:
            try:
                if dist.get_world_size() > 1:
                    _exit_barrier()
            except Exception as exc:  # a peer died: destroy our side anyway
                logger.warning(
                    "cudakit: not every rank reached the end of its work before the process "
                    "group was destroyed (%s); destroying it on this rank anyway",
                    exc,
                )
        try:
            dist.destroy_process_group()
            logger.debug("cudakit: destroyed the default process group")
        except Exception as exc:  # teardown must never mask the real error
            logger.warning("cudakit: destroying the process group failed: %r", exc)


def _group_store(env_: DistributedEnv, timeout: datetime.timedelta) -> Store:
    """The store for the next default group: torch's ``env://`` store under a fresh prefix.

    torch resets its group names when the default group is destroyed, so a second
    ``init_process_group`` on the same store writes and reads the very keys the first
    one left there (pytorch/pytorch#55967). Under ``launch()`` and ``torchrun`` the
    store lives in the parent (``TORCHELASTIC_USE_AGENT_STORE``) and outlives every
    group, so a rank re-initialising reads its peer's *old* gloo address: "Connection
    refused", or a hang until the timeout. Without an agent store, rank 0 hosts it and
    a peer can reach the old server just before rank 0 closes it. So the store is made
    once per process and environment, by torch's own ``env://`` rendezvous, and kept;
    each group gets the prefix ``cudakit/<n>``, where ``n`` counts the groups this
    process initialised. Every rank creates and destroys the group together, so every
    rank agrees on ``n``.
    """
    from torch.distributed.distributed_c10d import PrefixStore

    global _store, _generation
    key = (
        env_.master_addr,
        env_.master_port,
        env_.rank,
        env_.world_size,
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", ""),
    )
    if _store is None or _store[0] != key:
        _store = None  # a rank 0 releases the old server before it binds the port again
        rendezvous = dist.rendezvous(  # type: ignore[attr-defined]
            "env://", env_.rank, env_.world_size, timeout=timeout
        )
        store, _, _ = next(rendezvous)
        _store = (key, store)
    base = _store[1]
    base.set_timeout(timeout)
    prefix = f"cudakit/{_generation}"  # PrefixStore adds the "/"
    _generation += 1
    return PrefixStore(prefix, base)


def _ensure_group(
    backend: str | None,
    timeout: float | datetime.timedelta | None,
    device: DeviceLike,
    *,
    announce: bool = True,
) -> ProcessGroupInfo:
    global _owned_group, _atexit_registered
    td = _check_timeout(timeout)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend must be a string such as 'nccl' or 'gloo', or None, got "
            f"{type(backend).__name__}."
        )
    if not dist.is_available():
        raise DistributedSetupError(
            "this torch build has no torch.distributed support; install a standard PyTorch "
            "wheel from pytorch.org."
        )
    with _lock:
        if dist.is_initialized():
            env_ = _read_env(os.environ, strict=False)
            dev = _resolve_rank_device(device, env_)
            return ProcessGroupInfo(
                backend=str(dist.get_backend()),
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                local_rank=env_.local_rank if env_ is not None else 0,
                device=dev,
                timeout=td,
                created=False,
            )
        env_ = _read_env(os.environ, strict=True)
        if env_ is None:
            raise DistributedSetupError(
                "no launcher environment: a process group needs "
                f"{', '.join(_ENV_VARS)}, which this process does not have. {_launch_hint()}."
            )
        dev = _resolve_rank_device(device, env_)
        if dev.type == "cuda":
            # Before anything else touches CUDA: otherwise every rank allocates on GPU 0.
            torch.cuda.set_device(dev)
        chosen = backend if backend is not None else ("nccl" if dev.type == "cuda" else "gloo")
        if chosen == "nccl" and not dist.is_nccl_available():
            raise DistributedSetupError(
                "backend='nccl' is not available in this torch build (CPU-only or no NCCL). "
                "Use backend='gloo', or install a CUDA build of PyTorch."
            )
        kwargs: dict[str, Any] = {"backend": chosen, "timeout": td}
        if chosen == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(
            store=_group_store(env_, td), rank=env_.rank, world_size=env_.world_size, **kwargs
        )
        _owned_group = True
        if not _atexit_registered:
            atexit.register(_teardown)
            _atexit_registered = True
        log = logger.info if env_.rank == 0 and announce else logger.debug
        log(
            "cudakit: process group initialised: backend=%s world_size=%d rank=%d "
            "local_rank=%d device=%s timeout=%ss",
            chosen,
            env_.world_size,
            env_.rank,
            env_.local_rank,
            dev,
            int(td.total_seconds()),
        )
        return ProcessGroupInfo(
            backend=chosen,
            rank=env_.rank,
            world_size=env_.world_size,
            local_rank=env_.local_rank,
            device=dev,
            timeout=td,
            created=True,
        )


class process_group(ContextDecorator):
    """Initialise the default process group from torchrun's environment; destroy it on exit.

    >>> import cudakit.parallel as cp
    >>> with cp.process_group():
    ...     pass
    Traceback (most recent call last):
    ...
    cudakit.exceptions.DistributedSetupError: no launcher environment: ...

    Under ``torchrun`` (or :func:`launch`): ``backend`` defaults to ``"nccl"`` for a
    CUDA device and ``"gloo"`` otherwise, the timeout to 10 minutes (never torch's
    silent 30), and ``torch.cuda.set_device(LOCAL_RANK)`` runs before anything
    touches CUDA. A group that already exists is used and left alone; a group this
    block created is destroyed once on exit, also after an exception, and an
    ``atexit`` safety net destroys it if the process ends first. On a clean exit the
    ranks first wait for each other in a barrier (``monitored_barrier`` on gloo, so
    a rank that never arrives is named), because a rank that destroys its group
    while a peer is still in its last collective can abort either process; after
    an exception there is no barrier, since the peers may be gone. The block may be
    entered again after it ends (two training phases, say) when every rank does so:
    each group cudakit creates meets on its own keys of the rendezvous store. Works
    as ``@process_group()`` too.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... ; ``None`` picks from the device.
        timeout: seconds or ``timedelta`` for collectives (default 600 s).
        device: this rank's device; ``None`` means ``cuda:LOCAL_RANK`` when CUDA
            is available, else the CPU.

    Yields:
        ProcessGroupInfo: what was set up (backend, rank, world size, whether it was created here).

    Raises:
        DistributedSetupError: no or an incomplete launcher environment, or NCCL missing.
        TypeError, ValueError: a bad ``backend`` or ``timeout``.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        device: DeviceLike = None,
    ) -> None:
        _check_timeout(timeout)  # fail at the call site, not at entry
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self._created = False

    def clone(self) -> Self:
        return type(self)(self.backend, timeout=self.timeout, device=self.device)

    def __enter__(self) -> ProcessGroupInfo:
        info = _ensure_group(self.backend, self.timeout, self.device)
        self._created = info.created
        return info

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._created:
            self._created = False
            _teardown(sync=exc_type is None)


# --------------------------------------------------------------------------- rank helpers


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def rank() -> int:
    """This process's global rank: from the process group, else ``RANK``, else 0.

    >>> import cudakit.parallel as cp
    >>> cp.rank()
    0

    .. versionadded:: 0.1
    """
    return dist.get_rank() if _group_ready() else _env_int("RANK", 0)


def world_size() -> int:
    """The number of processes: from the process group, else ``WORLD_SIZE``, else 1.

    >>> import cudakit.parallel as cp
    >>> cp.world_size()
    1

    .. versionadded:: 0.1
    """
    return dist.get_world_size() if _group_ready() else _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, else 0): its GPU index under torchrun.

    >>> import cudakit.parallel as cp
    >>> cp.local_rank()
    0

    .. versionadded:: 0.1
    """
    return _env_int("LOCAL_RANK", 0)


def is_main_process(*, local: bool = False) -> bool:
    """Whether this is rank 0 (``local=True``: local rank 0, one per node).

    >>> import cudakit.parallel as cp
    >>> cp.is_main_process()
    True

    Args:
        local: ask about the node (for per-node work such as a download to local disk).

    .. versionadded:: 0.1
    """
    return (local_rank() if local else rank()) == 0


def _barrier() -> None:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class main_process_first(ContextDecorator):
    """Run the block on the main process first, then on every other rank.

    >>> import cudakit.parallel as cp
    >>> with cp.main_process_first():   # one process: just runs the block
    ...     data = [1, 2, 3]             # e.g. download, then everyone reads the cache

    The other ranks wait in a barrier until the main process has finished the
    block (also when it raised: they are released rather than left hanging until
    the timeout). Without an initialised process group of more than one process it
    simply runs the block. Works as ``@main_process_first()`` too.

    Args:
        local: main process per node (local rank 0) instead of global rank 0; use it
            when each node has its own disk.

    .. versionadded:: 0.1
    """

    def __init__(self, *, local: bool = False) -> None:
        if not isinstance(local, bool):
            raise TypeError(f"local must be True or False, got {type(local).__name__}.")
        self.local = local
        self._sync = False

    def clone(self) -> Self:
        return type(self)(local=self.local)

    def __enter__(self) -> None:
        self._sync = _group_ready() and dist.get_world_size() > 1
        if self._sync and not is_main_process(local=self.local):
            _barrier()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sync and is_main_process(local=self.local):
            _barrier()


# --------------------------------------------------------------------------- unwrap / state


def _compiled_type() -> type[nn.Module] | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover - torch without dynamo
        return None
    return cast(type[nn.Module], OptimizedModule)


def unwrap(model: nn.Module) -> nn.Module:
    """Return the user's own module from inside DataParallel, DDP and ``torch.compile`` wrappers.

    >>> import torch, cudakit.parallel as cp
    >>> net = torch.nn.Linear(2, 2)
    >>> cp.unwrap(torch.nn.DataParallel(net)) is net
    True

    Nested wrappers (``torch.compile(DDP(model))``, ``DDP(torch.compile(model))``)
    are peeled all the way. FSDP2 (``fully_shard``) changes the module in place and
    has no wrapper, so the module is returned as it is.

    Args:
        model: any ``nn.Module``.

    Returns:
        The innermost module.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    .. versionadded:: 0.1
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"unwrap() expects an nn.Module, got {type(model).__name__}. Pass the model "
            "(the object parallelize() or torch.compile() returned)."
        )
    compiled = _compiled_type()
    wrappers: tuple[type[nn.Module], ...] = (
        nn.DataParallel,
        nn.parallel.DistributedDataParallel,
    )
    for _ in range(64):  # wrappers nest a few levels at most; never loop forever
        if isinstance(model, wrappers):
            model = cast(nn.Module, model.module)
        elif compiled is not None and isinstance(model, compiled):
            model = cast(nn.Module, model._orig_mod)
        else:
            break
    return model


def _is_fsdp2(model: nn.Module) -> bool:
    # A model can only be sharded once torch.distributed.fsdp was imported, so never pay
    # for that import (over a second) just to answer no.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_type = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module_type is not None and isinstance(model, module_type)


def state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with bare keys: no ``module.`` or ``_orig_mod.`` prefix.

    >>> import torch, cudakit.parallel as cp
    >>> wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    >>> list(cp.state_dict(wrapped))
    ['weight', 'bias']

    Loads into the bare model, the wrapped one, or a ``torch.compile``-d one with
    :func:`load_state_dict`. For an FSDP2 model this is a collective (every rank
    must call it): rank 0 receives the full, unsharded state dict on the CPU, the
    other ranks an empty dict.

    .. versionadded:: 0.1
    """
    inner = unwrap(model)
    if _is_fsdp2(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return inner.state_dict()


_PREFIXES = ("module.", "_orig_mod.")


def _strip(sd: Mapping[str, Any], own_keys: set[str]) -> Mapping[str, Any]:
    """Drop leading wrapper prefixes until the keys match the model's own (or none is left)."""
    keys = list(sd)
    prefix = ""
    while keys:
        if own_keys and {k[len(prefix) :] for k in keys} & own_keys:
            break  # already matches: a submodule really called `module` keeps its name
        step = next((p for p in _PREFIXES if all(k.startswith(prefix + p) for k in keys)), None)
        if step is None:
            break
        prefix += step
    if not prefix:
        return sd
    out: OrderedDict[str, Any] = OrderedDict((k[len(prefix) :], v) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if isinstance(meta, Mapping):
        bare = prefix[:-1]
        new_meta: OrderedDict[str, Any] = OrderedDict()
        for k, v in meta.items():
            if k == bare:
                new_meta[""] = v
            elif k.startswith(prefix):
                new_meta[k[len(prefix) :]] = v
            elif k == "" or prefix.startswith(k + "."):
                continue  # the wrappers' own entries
            else:
                new_meta[k] = v
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out


class _LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state_dict(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
) -> _LoadResult:
    """Load a state dict saved with or without ``module.`` / ``_orig_mod.`` prefixes.

    >>> import torch, cudakit.parallel as cp
    >>> wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    >>> bare = torch.nn.Linear(2, 2)
    >>> cp.load_state_dict(bare, wrapped.state_dict())     # keys 'module.weight', ...
    _LoadResult(missing_keys=[], unexpected_keys=[])
    >>> torch.equal(bare.weight, wrapped.module.weight)
    True

    The state dict is not modified. For an FSDP2 model this is a collective: pass
    the full state dict on rank 0 (as :func:`state_dict` returns it) and anything
    (e.g. ``{}``) on the other ranks; rank 0 broadcasts it.

    Args:
        model: the target, bare or wrapped.
        state: a state dict from :func:`state_dict`, ``model.state_dict()`` or a checkpoint.
        strict: as in ``nn.Module.load_state_dict``.

    Returns:
        The missing and unexpected keys, as ``nn.Module.load_state_dict`` reports them.

    Raises:
        TypeError: ``state`` is not a mapping, or ``model`` is not an ``nn.Module``.
        RuntimeError: with ``strict=True``, keys that do not match (torch's message).

    .. versionadded:: 0.1
    """
    inner = unwrap(model)
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_state_dict() expects a mapping of parameter names to tensors, got "
            f"{type(state).__name__}. If you saved a whole checkpoint, pass "
            "checkpoint['model'] (or whichever key holds the model's state)."
        )
    if _is_fsdp2(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        bare = dict(_strip(state, set())) if state else {}
        res = set_model_state_dict(inner, bare, options=opts)
        return _LoadResult(list(res.missing_keys), list(res.unexpected_keys))
    own = set(inner.state_dict().keys())
    res = inner.load_state_dict(_strip(state, own), strict=strict)
    return _LoadResult(list(res.missing_keys), list(res.unexpected_keys))


# --------------------------------------------------------------------------- parallelize

_DP_KWARGS = ("device_ids", "output_device", "dim")


def _check_kwargs(target: Callable[..., Any], kwargs: Mapping[str, Any], what: str) -> None:
    params = inspect.signature(target).parameters
    unknown = [k for k in kwargs if k not in params or k in ("self", "module")]
    if unknown:
        valid = ", ".join(p for p in params if p not in ("self", "module"))
        raise TypeError(
            f"parallelize() got keyword argument(s) {', '.join(map(repr, unknown))} that "
            f"{what} does not accept. Valid: {valid}."
        )


def _fsdp(model: nn.Module, kwargs: Mapping[str, Any]) -> nn.Module:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        raise DistributedSetupError(
            "strategy='fsdp' needs torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6); "
            f"this is torch {torch.__version__}. Upgrade torch or use strategy='ddp'."
        ) from None
    _check_kwargs(fully_shard, kwargs, "fully_shard()")
    # Shard every block of every ModuleList (a transformer's layers) as its own unit,
    # so parameters are gathered one block at a time, then the root for the rest.
    for sub in list(model.modules()):
        if isinstance(sub, nn.ModuleList):
            for block in sub:
                if any(p.requires_grad for p in block.parameters()) and not _is_fsdp2(block):
                    fully_shard(block, **kwargs)
    return cast(nn.Module, fully_shard(model, **kwargs))


def parallelize(
    model: nn.Module,
    strategy: str = "auto",
    device: DeviceLike = None,
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for data parallelism; log the choice.

    >>> import torch, cudakit.parallel as cp
    >>> net = cp.parallelize(torch.nn.Linear(4, 2), device="cpu")   # one CPU process
    >>> type(net).__name__                                          # nothing to wrap
    'Linear'

    The strategy comes from :func:`choose_strategy`: under ``torchrun`` DDP
    (initialising the process group from the environment if needed: ``nccl`` on
    CUDA, ``gloo`` on the CPU, a finite timeout, ``set_device(LOCAL_RANK)`` first);
    one process with several GPUs DataParallel (with a logged hint that DDP is
    faster); otherwise the model is just moved. ``strategy="dp"`` on a CPU is an
    error; under ``"auto"`` a CPU-only process gets the plain model back (the
    documented pass-through). A model that is already wrapped is returned as it is.

    ``strategy="fsdp"`` shards with FSDP2 (``fully_shard``): each block of every
    ``nn.ModuleList`` (a transformer's layers) becomes its own unit, then the root.

    Args:
        model: the module to train.
        strategy: ``"auto"``, ``"none"``, ``"dp"``, ``"ddp"`` or ``"fsdp"``.
        device: ``None`` picks ``cuda:LOCAL_RANK`` (or the best device outside a
            launcher); anything :func:`~cudakit.device.resolve_device` accepts.
        backend: process-group backend when one must be created (default from the device).
        timeout: collective timeout in seconds or a ``timedelta`` (default 600 s).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (or to ``fully_shard``
            for ``"fsdp"``, to ``DataParallel`` for an explicit ``"dp"``). Under
            ``"auto"`` they are ignored, with a log line, when no DDP is chosen.

    Returns:
        The model, moved and possibly wrapped; use :func:`unwrap` to get yours back.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or unknown keyword arguments.
        ValueError: an unknown strategy, or a model with no trainable parameters for DDP.
        DeviceError: ``"dp"`` without CUDA, or a device that does not exist.
        DistributedSetupError: ``"ddp"``/``"fsdp"`` without a launcher, or an
            incomplete launcher environment.

    .. versionadded:: 0.1
    """
    obj: object = model
    if not isinstance(obj, nn.Module):
        opt = isinstance(obj, torch.optim.Optimizer)
        hint = " Pass the model, not the optimizer." if opt else ""
        raise TypeError(
            f"parallelize() expects an nn.Module, got {type(model).__name__}.{hint} "
            "For example: model = parallelize(MyNet())."
        )
    request = _check_request(strategy)
    ddp_type = nn.parallel.DistributedDataParallel
    if isinstance(model, (ddp_type, nn.DataParallel)) or _is_fsdp2(model):
        logger.info(
            "cudakit: parallelize(): model is already %s; returned as is", type(model).__name__
        )
        return model

    env_ = _read_env(os.environ, strict=request in ("ddp", "fsdp"))
    group_world = dist.get_world_size() if _group_ready() else None
    dev = _resolve_rank_device(device, env_)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = choose_strategy(
        request,
        env=os.environ,
        device_count=n_gpu,
        device_type=dev.type,
        group_world_size=group_world,
    )
    main = (group_world is None and (env_ is None or env_.rank == 0)) or (
        group_world is not None and dist.get_rank() == 0
    )
    log = logger.info if main else logger.debug

    if chosen in ("ddp", "fsdp"):
        if chosen == "ddp":
            _check_kwargs(ddp_type.__init__, ddp_kwargs, "DistributedDataParallel")
            if not any(p.requires_grad for p in model.parameters()):
                raise ValueError(
                    "parallelize() with DDP needs a model with trainable parameters, but "
                    f"{type(model).__name__} has none requiring grad. Unfreeze some, or use "
                    "strategy='none' for inference."
                )
        info = _ensure_group(backend, timeout, dev, announce=False)  # logged once, below
        dev = info.device if device is None else dev
        if dev.type == "cuda" and torch.cuda.current_device() != dev.index:
            torch.cuda.set_device(dev)
        model = model.to(dev)
        if chosen == "fsdp":
            wrapped = _fsdp(model, ddp_kwargs)
        else:
            kw = dict(ddp_kwargs)
            if dev.type == "cuda":
                kw.setdefault("device_ids", [dev.index])
                kw.setdefault("output_device", dev.index)
            wrapped = ddp_type(model, **kw)
        log(
            "cudakit: parallelize(strategy=%r) -> %s on %s (rank %d of %d, backend %s, %s)",
            request,
            chosen.upper(),
            dev,
            dist.get_rank(),
            dist.get_world_size(),
            info.backend,
            f"process group created, timeout {int(info.timeout.total_seconds())}s"
            if info.created
            else "existing process group",
        )
        return wrapped

    if chosen == "dp":
        if request == "auto":
            if ddp_kwargs:
                log("cudakit: parallelize(): DDP options %s ignored (DataParallel)", ddp_kwargs)
            dp_kw: dict[str, Any] = {}
        else:
            _check_kwargs(nn.DataParallel.__init__, ddp_kwargs, "DataParallel")
            dp_kw = dict(ddp_kwargs)
        ids = dp_kw.pop("device_ids", None)
        if ids is None:
            ids = [dev.index, *(i for i in range(n_gpu) if i != dev.index)]
        model = model.to(torch.device("cuda", ids[0] if isinstance(ids[0], int) else dev.index))
        log(
            "cudakit: parallelize(strategy=%r) -> DataParallel over cuda:%s. Hint: DDP is "
            "faster and DataParallel is in maintenance mode upstream; launch with "
            "`torchrun --nproc-per-node %d script.py` and parallelize() picks DDP.",
            request,
            ",".join(map(str, ids)),
            len(ids),
        )
        return nn.DataParallel(model, device_ids=ids, **dp_kw)

    if ddp_kwargs and request == "auto":
        log("cudakit: parallelize(): DDP options %s ignored (single device)", ddp_kwargs)
    elif ddp_kwargs:
        raise TypeError(
            f"parallelize(strategy='none') takes no wrapper options, got {sorted(ddp_kwargs)}. "
            "Drop them, or use strategy='ddp' under torchrun."
        )
    model = model.to(dev)
    reason = "" if n_gpu < 2 or dev.type != "cuda" else " (as requested)"
    log("cudakit: parallelize(strategy=%r) -> single device %s%s", request, dev, reason)
    return model


# --------------------------------------------------------------------------- data


class DistributedLoader(Generic[T_co]):
    """A ``DataLoader`` over this rank's shard that calls ``sampler.set_epoch`` by itself.

    Each ``iter(loader)`` (each ``for batch in loader``) starts a new epoch with a
    new shuffle that every rank agrees on. Attributes the ``DataLoader`` has
    (``dataset``, ``batch_size``, ...) are forwarded. Built by :func:`distributed_loader`.

    .. versionadded:: 0.1
    """

    def __init__(self, loader: DataLoader[T_co], sampler: DistributedSampler[T_co]) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (to resume from a checkpoint)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}.")
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "epoch"):  # not yet set: avoid recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return (
            f"DistributedLoader(rank={self.sampler.rank}, num_replicas="
            f"{self.sampler.num_replicas}, batches={len(self)}, next_epoch={self.epoch})"
        )


def distributed_loader(
    dataset: Dataset[T_co],
    batch_size: int = 1,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> DistributedLoader[T_co]:
    """A ``DataLoader`` that gives this rank its shard and reshuffles every epoch by itself.

    >>> import torch, cudakit.parallel as cp
    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> loader = cp.distributed_loader(data, batch_size=4, shuffle=False)
    >>> [batch[0].tolist() for batch in loader]       # one process: all of it
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]

    Under DDP each rank sees ``len(dataset) / world_size`` samples
    (``DistributedSampler``, padded with repeats so every rank gets the same number
    of batches and no rank waits forever in an all-reduce). Each ``for`` loop over
    the loader calls ``sampler.set_epoch(epoch)`` first: forgetting it is the classic
    bug that repeats the same order every epoch.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on each rank.
        shuffle: shuffle (identically seeded on every rank).
        seed: the shuffle seed, the same on every rank.
        drop_last: drop the last incomplete batch of each rank.
        **loader_kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``...).

    Returns:
        A :class:`DistributedLoader`.

    Raises:
        TypeError: an ``IterableDataset``, or a ``sampler``/``batch_sampler`` argument.

    .. versionadded:: 0.1
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "distributed_loader() needs a map-style dataset (with __getitem__ and __len__), got "
            f"the IterableDataset {type(dataset).__name__}, which a sampler cannot shard. Shard "
            "inside its __iter__ with cudakit.parallel.rank() and world_size() instead."
        )
    for bad in ("sampler", "batch_sampler"):
        if bad in loader_kwargs:
            raise TypeError(
                f"distributed_loader() makes its own DistributedSampler, so {bad}= cannot be "
                "passed. Build DataLoader(dataset, sampler=DistributedSampler(...)) yourself and "
                "call sampler.set_epoch(epoch) every epoch if you need a custom sampler."
            )
    sampler: DistributedSampler[T_co] = DistributedSampler(
        dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, seed=seed
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs
    )
    return DistributedLoader(loader, sampler)
