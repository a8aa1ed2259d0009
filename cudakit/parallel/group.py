"""The lifetime of the default process group cudakit creates, and its state.

:func:`ensure_group` initialises the group from the launcher's environment (or
finds the running one), :func:`teardown_owned_group` destroys it again if cudakit
created it, and :class:`process_group` is both as a block. What they share (whether
cudakit owns the running group, the rendezvous store kept across groups, how many
groups this process created) lives in one :class:`_GroupState`.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import math
import os
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.distributed as dist

from .._check import fail_type, fail_value, is_real
from .._contextlib import ContextDecorator
from .._dist import (
    LAUNCHER_VARS,
    DistributedEnv,
    group_rank,
    group_world_size,
    is_group_running,
    launch_hint,
)
from ..device import DeviceLike
from ..exceptions import DistributedSetupError
from .ranks import barrier
from .strategy import (
    ParallelFacts,
    check_backend,
    check_backend_serves,
    default_backend,
    gather_facts,
    rank_device,
    requested_device,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProcessGroupInfo",
    "check_timeout",
    "ensure_group",
    "process_group",
    "require_distributed",
    "teardown_owned_group",
]

logger = logging.getLogger("cudakit")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


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


#: The longest process-group timeout accepted (torch's store overflows far beyond it).
MAX_TIMEOUT = datetime.timedelta(days=365)


def check_timeout(func: str, timeout: object) -> datetime.timedelta:
    """``timeout`` (seconds or a ``timedelta``; ``None``: 10 minutes) as a finite ``timedelta``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif is_real(timeout):  # NumPy's too
        seconds = float(timeout)
        if not math.isfinite(seconds) or seconds <= 0:
            td = datetime.timedelta(0)  # rejected below with the finite-timeout message
        elif seconds > MAX_TIMEOUT.total_seconds():
            td = datetime.timedelta.max  # rejected below (timedelta itself would overflow)
        else:
            td = datetime.timedelta(seconds=seconds)
    else:
        fail_type(
            func,
            "timeout",
            "seconds (an int or float) or a datetime.timedelta",
            timeout,
            "Pass e.g. timeout=600, or None for the default 600 s.",
        )
    if td > MAX_TIMEOUT:
        fail_value(
            func,
            "timeout",
            f"at most {MAX_TIMEOUT.days} days",
            timeout,
            "torch's store counts it in milliseconds and overflows beyond that. A hung rank "
            "should fail, not wait forever; pass e.g. timeout=600, or None for the default.",
        )
    if not td.total_seconds() > 0:
        fail_value(
            func,
            "timeout",
            "a finite positive duration",
            timeout,
            "An infinite timeout turns one crashed rank into a hang on every other. Pass e.g. "
            "timeout=600.",
        )
    return td


# The store's key: the environment that made it.
_StoreKey = tuple[str, int, int, int, str]


class _GroupState:
    """Whether cudakit owns the running default group, and the store kept across groups."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.owned = False  # True while the default group is one cudakit created
        self.atexit_registered = False
        # The rendezvous store, kept across groups (see _group_store), keyed by the
        # environment that made it; and how many groups this process initialised on it.
        self.store: tuple[_StoreKey, Store] | None = None
        self.generation = 0
        # The timeout of the group cudakit created (its exit barrier waits that long).
        self.timeout: datetime.timedelta = DEFAULT_TIMEOUT


_state = _GroupState()


def _exit_barrier() -> None:
    """Wait until every rank has reached the end of its work, before the group goes away.

    gloo gets ``monitored_barrier``, whose error names the ranks that never arrived;
    it runs under the group's own (finite) timeout (left to itself it would wait
    torch's default 30 minutes).
    """
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=_state.timeout, wait_all_ranks=True)
    else:
        barrier()


def teardown_owned_group(*, sync: bool = False) -> None:
    """Destroy the default process group if cudakit created it. Idempotent, never raises.

    ``sync=True`` (a clean exit) first waits in a barrier for the other ranks: a
    rank that destroys its gloo group while a peer is still finishing its last
    collective can make either process abort ("terminate called without an active
    exception"). After an exception there is no barrier: the peers may be gone.
    """
    with _state.lock:
        if not _state.owned:
            return
        _state.owned = False
        if not is_group_running():
            return
        if sync:
            try:
                if group_world_size() > 1:
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


def _group_store(env: DistributedEnv, timeout: datetime.timedelta) -> Store:
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

    key = (
        env.master_addr,
        env.master_port,
        env.rank,
        env.world_size,
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", ""),
    )
    if _state.store is None or _state.store[0] != key:
        _state.store = None  # a rank 0 releases the old server before it binds the port again
        # torchrun's variables are in the environment (env://, which also finds
        # torchrun's agent store); a task srun started has them only as derived from
        # SLURM's (tcp:// to the address cudakit worked out).
        from_env = all(os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT"))
        url = "env://" if from_env else f"tcp://{env.master_addr}:{env.master_port}"
        rendezvous = dist.rendezvous(  # type: ignore[attr-defined]
            url, env.rank, env.world_size, timeout=timeout
        )
        store, _, _ = next(rendezvous)
        _state.store = (key, store)
    base = _state.store[1]
    base.set_timeout(timeout)
    # torchrun's agent store also outlives a restart (--max-restarts): the restarted
    # ranks count their groups from 0 again, so the attempt is part of the prefix.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    restart = f"-restart{attempt}" if attempt not in ("", "0") else ""
    prefix = f"cudakit/{_state.generation}{restart}"  # PrefixStore adds the "/"
    _state.generation += 1
    return PrefixStore(prefix, base)


def require_distributed() -> None:
    """Raise unless this torch build has ``torch.distributed``."""
    if not dist.is_available():
        raise DistributedSetupError(
            "this torch build has no torch.distributed support; install a standard PyTorch "
            "wheel from pytorch.org."
        )


def ensure_group(
    backend: str | None,
    timeout: datetime.timedelta,
    facts: ParallelFacts,
    device: torch.device,
    *,
    announce: bool = True,
    func: str = "process_group",
) -> ProcessGroupInfo:
    """The running default group, or one initialised from ``facts.env`` on ``device``.

    ``device`` and ``backend`` were decided by the caller (``backend=None`` picks from
    the device; one that cannot serve ``device`` is refused, naming ``func``). A group
    created here is owned by cudakit: :func:`teardown_owned_group`
    destroys it, and an ``atexit`` hook does if the process ends first.
    """
    require_distributed()
    with _state.lock:
        if is_group_running():
            return ProcessGroupInfo(
                backend=str(dist.get_backend()),
                rank=group_rank(),
                world_size=group_world_size(),
                local_rank=facts.env.local_rank if facts.env is not None else 0,
                device=device,
                timeout=timeout,
                created=False,
            )
        env = facts.env
        if env is None:
            raise DistributedSetupError(
                "no launcher environment: a process group needs "
                f"{', '.join(LAUNCHER_VARS)}, which this process does not have. {launch_hint()}."
            )
        chosen = default_backend(backend, device)
        if chosen == "nccl" and not dist.is_nccl_available():
            raise DistributedSetupError(
                "backend='nccl' is not available in this torch build (CPU-only or no NCCL). "
                "Use backend='gloo', or install a CUDA build of PyTorch."
            )
        check_backend_serves(func, chosen, device)
        if device.type == "cuda":
            # Before anything else touches CUDA: otherwise every rank allocates on GPU 0.
            torch.cuda.set_device(device)
        kwargs: dict[str, Any] = {"backend": chosen, "timeout": timeout}
        if chosen == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            store=_group_store(env, timeout), rank=env.rank, world_size=env.world_size, **kwargs
        )
        _state.owned = True
        _state.timeout = timeout
        if not _state.atexit_registered:
            atexit.register(teardown_owned_group)
            _state.atexit_registered = True
        log = logger.info if env.rank == 0 and announce else logger.debug
        log(
            "cudakit: process group initialised: backend=%s world_size=%d rank=%d "
            "local_rank=%d device=%s timeout=%ss",
            chosen,
            env.world_size,
            env.rank,
            env.local_rank,
            device,
            int(timeout.total_seconds()),
        )
        return ProcessGroupInfo(
            backend=chosen,
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            device=device,
            timeout=timeout,
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
        TypeError, ValueError: a bad ``backend``, ``timeout`` or ``device`` (at the call).
        DeviceError: a ``device`` this machine does not have (at the call).

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        device: DeviceLike = None,
    ) -> None:
        # Everything is checked at the call site, not at entry.
        self._timeout = check_timeout("process_group", timeout)
        self.backend = check_backend("process_group", backend)
        requested_device("process_group", device, cuda_available=torch.cuda.is_available())
        self.timeout = timeout
        self.device = device
        self._created = False

    def clone(self) -> Self:
        return type(self)(self.backend, timeout=self.timeout, device=self.device)

    def __enter__(self) -> ProcessGroupInfo:
        require_distributed()
        strict = not is_group_running()  # creating a group needs a complete launcher
        facts = gather_facts(self.device, strict_env=strict, func="process_group")
        info = ensure_group(self.backend, self._timeout, facts, rank_device(facts))
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
            teardown_owned_group(sync=exc_type is None)
