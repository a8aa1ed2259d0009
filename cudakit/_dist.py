"""The one place that reads the distributed environment of this process.

Two sources, each read here and nowhere else:

* what a launcher (torchrun, ``cudakit.parallel.launch``, SLURM's ``srun``) promised
  through environment variables: ``launched_*`` and :func:`read_env` (strict parsing,
  for the callers that set a process group up from them). A task ``srun`` started has
  SLURM's variables only; :func:`launcher_view` derives torchrun's from them (rank,
  world size, local rank, and the rendezvous at the node list's first host);
* the process group actually running: ``group_*`` and :func:`is_group_running`.

``current_rank``/``current_world_size`` prefer the running group and fall back to
the launcher's variables. Every function answers without starting anything (no
process group, no CUDA context).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import torch

from ._check import fail_type
from .exceptions import DistributedSetupError

__all__ = [
    "LAUNCHER_VARS",
    "SLURM_VARS",
    "DistributedEnv",
    "check_env",
    "current_rank",
    "current_world_size",
    "expand_hostlist",
    "group_rank",
    "group_world_size",
    "is_group_running",
    "is_srun_task",
    "launch_hint",
    "launched_local_rank",
    "launched_local_world_size",
    "launched_rank",
    "launched_world_size",
    "launcher_view",
    "read_env",
    "read_launcher_env",
    "slurm_launcher_vars",
    "slurm_port",
    "slurm_sources",
]

#: The variables torchrun sets in every process, all needed to build a process group.
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """The launcher's variables: ``env`` (default ``os.environ``), with torchrun's
    variables derived from SLURM's where ``srun`` started the process."""
    return launcher_view(os.environ if env is None else env)


# --------------------------------------------------------------------------- SLURM

#: What ``srun`` sets in every task, from which torchrun's variables are derived.
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODELIST")

_BRACKETED = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, compressed forms expanded, in order.

    >>> expand_hostlist("node[01-03,07],gpu-a[1-2]b,login")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a1b', 'gpu-a2b', 'login']
    >>> expand_hostlist("rack[1-2]-n[8-9]")
    ['rack1-n8', 'rack1-n9', 'rack2-n8', 'rack2-n9']
    >>> expand_hostlist("alpha beta, gamma[1, 3]")
    ['alpha', 'beta', 'gamma1', 'gamma3']

    Names are separated by commas or whitespace (inside brackets, spaces after the commas
    are allowed too). Zero padding is kept (``[08-10]`` gives ``08, 09, 10``); several
    bracket groups in one name expand as a product, the first group varying slowest, as
    SLURM does.

    Raises:
        ValueError: an unbalanced bracket or a range that is not ``lo-hi`` with lo <= hi.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        parts = _BRACKETED.split(item)  # text, ranges, text, ranges, ..., text
        if "[" in "".join(parts[::2]) or "]" in "".join(parts[::2]):
            raise ValueError(f"unbalanced brackets in the SLURM node list {nodelist!r}")
        names = [parts[0]]
        for ranges, text in zip(parts[1::2], parts[2::2], strict=True):
            names = [n + value + text for n in names for value in _expand_ranges(ranges)]
        hosts.extend(names)
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """The names of a node list: separated by commas or whitespace outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(ranges: str) -> list[str]:
    values: list[str] = []
    for part in ranges.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a number or a range lo-hi in [{ranges}]")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range {part!r} in [{ranges}] runs backwards")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` (SLURM's tasks-per-node form) as ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a SLURM job without ``MASTER_PORT``: one per job.

    ``15000 + SLURM_JOB_ID % 5000``, below Linux's ephemeral ports, the same on every
    task of the job; 29500 (torchrun's default) without a job id.
    """
    job = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job) % 5000 if job.isdigit() else 29500


def is_srun_task(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a task ``srun`` started (and torchrun's variables are absent).

    ``SLURM_PROCID`` and ``SLURM_NTASKS`` mark a task. The interactive shell of
    ``salloc`` (``SLURM_JOB_NAME`` ``bash``/``interactive``) has them too but is no
    launch, unless ``srun`` started this process inside it (``SLURM_STEP_ID``).
    """
    if any(env.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return False  # torchrun (or launch()) inside a SLURM job wins
    if not (env.get("SLURM_PROCID", "") and env.get("SLURM_NTASKS", "")):
        return False
    in_step = bool(env.get("SLURM_STEP_ID", "") or env.get("SLURM_STEPID", ""))
    return in_step or env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    """The first of ``names`` set in ``env``: (value, name); ("", "") for none."""
    for name in names:
        if env.get(name, ""):
            return env[name], name
    return "", ""


def slurm_sources(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """torchrun's variables derived from SLURM's: name -> (value, where it came from).

    Empty unless :func:`is_srun_task`. ``MASTER_ADDR`` is missing when the node list
    cannot be read (the strict reader then says why).
    """
    if not is_srun_task(env):
        return {}
    out = {
        "RANK": (env["SLURM_PROCID"], "SLURM_PROCID"),
        "WORLD_SIZE": _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        "LOCAL_RANK": _first(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else ("0", ""),
    }
    per_node_spec, per_node_name = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node = _tasks_per_node(per_node_spec) if per_node_spec else []
    node = env.get("SLURM_NODEID", "")
    if per_node and node.isdigit() and int(node) < len(per_node):
        out["LOCAL_WORLD_SIZE"] = (str(per_node[int(node)]), per_node_name)
    elif env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        out["LOCAL_WORLD_SIZE"] = (env["SLURM_NTASKS_PER_NODE"], "SLURM_NTASKS_PER_NODE")
    if env.get("MASTER_ADDR", ""):
        out["MASTER_ADDR"] = (env["MASTER_ADDR"], "MASTER_ADDR")
    else:
        nodelist, name = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        try:
            hosts = expand_hostlist(nodelist) if nodelist else []
        except ValueError:
            hosts = []
        if hosts:
            out["MASTER_ADDR"] = (hosts[0], f"the first host of {name}")
    if env.get("MASTER_PORT", ""):
        out["MASTER_PORT"] = (env["MASTER_PORT"], "MASTER_PORT")
    else:
        out["MASTER_PORT"] = (str(slurm_port(env)), "SLURM_JOB_ID")
    return out


def slurm_launcher_vars(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a task ``srun`` started; ``{}`` for anything else.

    Only when torchrun's own (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) are absent:
    torchrun inside a SLURM job wins. The interactive shell of ``salloc`` is not a
    launch (:func:`is_srun_task`). The rendezvous address is ``MASTER_ADDR``/``MASTER_PORT``
    when set, else the first host of the node list and :func:`slurm_port`.
    """
    return {name: value for name, (value, _) in slurm_sources(env).items()}


def launcher_view(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` as a launcher would have set it: SLURM's variables turned into torchrun's."""
    derived = slurm_launcher_vars(env)
    return {**env, **derived} if derived else env


# --------------------------------------------------------------------------- running group


def is_group_running() -> bool:
    """True when ``torch.distributed`` is built in and a default process group exists."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def group_world_size(group: object = None) -> int:
    """Processes in ``group`` (the default group) of the running process group; 1 without one."""
    if not is_group_running():
        return 1
    return int(torch.distributed.get_world_size(group))  # type: ignore[arg-type]


def group_rank() -> int:
    """This process's rank in the running default group; 0 without one."""
    if not is_group_running():
        return 0
    return int(torch.distributed.get_rank())


# --------------------------------------------------------------------------- launcher variables


def _int_var(env: Mapping[str, str] | None, name: str, default: int) -> int:
    raw = _environ(env).get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        return default


def launched_world_size(env: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` as a launcher set it (1 when unset or unreadable)."""
    return max(1, _int_var(env, "WORLD_SIZE", 1))


def launched_rank(env: Mapping[str, str] | None = None) -> int:
    """``RANK`` as a launcher set it (0 when unset or unreadable)."""
    return _int_var(env, "RANK", 0)


def launched_local_rank(env: Mapping[str, str] | None = None) -> int:
    """``LOCAL_RANK`` as a launcher set it (0 when unset or unreadable): the GPU index."""
    return _int_var(env, "LOCAL_RANK", 0)


def launched_local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Processes on this node: ``LOCAL_WORLD_SIZE``, else ``SLURM_NTASKS_PER_NODE``, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = _environ(env).get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def current_rank() -> int:
    """This process's global rank: the running group's, else ``RANK``, else 0."""
    return group_rank() if is_group_running() else launched_rank()


def current_world_size() -> int:
    """The number of processes: the running group's, else ``WORLD_SIZE``, else 1."""
    return group_world_size() if is_group_running() else launched_world_size()


# --------------------------------------------------------------------------- strict parsing


def launch_hint(world: int | None = None) -> str:
    """The sentence that tells how to start ``world`` processes correctly."""
    n = world if world and world > 1 else "N"
    return (
        f"Launch the script with `torchrun --nproc-per-node {n} script.py` (one node), or call "
        "cudakit.parallel.launch(fn, nprocs=N) from Python"
    )


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


def _parse_int(
    env: Mapping[str, str],
    name: str,
    lo: int,
    sources: Mapping[str, tuple[str, str]] | None = None,
) -> int:
    """``env[name]`` as an integer >= ``lo``; the error names the SLURM variable it came
    from (``sources``, see :func:`slurm_sources`) and SLURM's fix for a task srun started."""
    raw = env[name]
    source = (sources or {}).get(name, ("", ""))[1]
    shown = source if source.startswith("SLURM_") else name
    fix = _SLURM_FIX if shown != name else f"{launch_hint()}, which sets it correctly."
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistributedSetupError(
            f"environment variable {shown}={raw!r} is not an integer. {fix}"
        ) from None
    if value < lo:
        raise DistributedSetupError(f"environment variable {shown}={value} must be >= {lo}. {fix}")
    return value


def check_env(func: str, env: object) -> None:
    """``env`` must be a mapping of environment variables with string values."""
    if not isinstance(env, Mapping):
        fail_type(
            func,
            "env",
            "a mapping of environment variable names to strings",
            env,
            "Pass env=os.environ for this process, or env={} for a process without a launcher.",
        )
    for name, value in env.items():
        read = name in LAUNCHER_VARS or name == "LOCAL_WORLD_SIZE"
        if not (read or (isinstance(name, str) and name.startswith("SLURM_"))):
            continue
        if value is None:  # present but None: not "unset", which is leaving it out
            fail_type(
                func,
                "env",
                f"string values, as os.environ holds; {name} is None",
                value,
                f"Leave {name} out of env (an unset variable is absent), or give it a string.",
            )
        if not isinstance(value, str):
            fail_type(
                func,
                "env",
                f"string values, as os.environ holds; {name} is not a string",
                value,
                f"Pass {name}={str(value)!r}.",
            )


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

    A task ``srun`` started without torchrun has SLURM's variables only; they stand in
    for torchrun's (``SLURM_PROCID`` for ``RANK``, ...; see docs/parallel.md, "SLURM
    without torchrun"). torchrun's win when both are set.

    A partial environment is an error when it claims more than one process (or
    ``strict=True`` in the callers that need a launcher); one that claims a single
    process (``WORLD_SIZE`` unset or ``1``) with some variables missing is treated
    as no launcher at all, so stray variables never break a plain ``python script.py``.

    Args:
        env: a mapping of environment variables; ``None`` reads ``os.environ``.

    Returns:
        A ``DistributedEnv``, or ``None`` when no launcher set the variables.

    Raises:
        DistributedSetupError: variables are missing although ``WORLD_SIZE`` > 1, a
            value is not an integer, or the values contradict each other (``RANK`` >=
            ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` > ``WORLD_SIZE``, ``LOCAL_RANK`` >=
            ``LOCAL_WORLD_SIZE`` or > ``RANK``); the message names the variables, and for
            a task ``srun`` started the SLURM variable each came from.

        TypeError: ``env`` is not a mapping of strings.

    .. versionadded:: 0.1
    """
    if env is not None:
        check_env("read_env", env)
    return read_launcher_env(os.environ if env is None else env, strict=False)


def read_launcher_env(env: Mapping[str, str], *, strict: bool) -> DistributedEnv | None:
    """:func:`read_env`; with ``strict=True`` any partial environment is an error."""
    sources = slurm_sources(env)
    if sources:
        env = {**env, **{name: value for name, (value, _) in sources.items()}}
    present = [k for k in LAUNCHER_VARS if env.get(k, "") != ""]
    if not present:
        return None
    missing = [k for k in LAUNCHER_VARS if k not in present]
    if missing:
        world = _parse_int(env, "WORLD_SIZE", 1, sources) if "WORLD_SIZE" in present else None
        if not strict and (world is None or world == 1):
            return None
        if sources and missing == ["MASTER_ADDR"]:
            nodelist, name = _first(
                env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"
            )
            raise DistributedSetupError(
                f"a task srun started, but no rendezvous address: {name or 'SLURM_NODELIST'}="
                f"{nodelist!r} names no host cudakit can read. Set MASTER_ADDR to the first "
                "node's host name (e.g. `export MASTER_ADDR=$(scontrol show hostnames "
                '"$SLURM_JOB_NODELIST" | head -n 1)` in the batch script).'
            )
        raise DistributedSetupError(
            f"incomplete launcher environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. {launch_hint(world)}, which sets all of "
            f"{', '.join(LAUNCHER_VARS)}; for several nodes add --nnodes, --node-rank and "
            "--rdzv-endpoint (see the cudakit parallel docs)."
        )

    def shown(name: str, value: int) -> str:
        source = sources.get(name, ("", ""))[1]
        return f"{name}={value}" + (f" (from {source})" if source and source != name else "")

    world = _parse_int(env, "WORLD_SIZE", 1, sources)
    rank_ = _parse_int(env, "RANK", 0, sources)
    local = _parse_int(env, "LOCAL_RANK", 0, sources)
    port = _parse_int(env, "MASTER_PORT", 1, sources)
    local_world = (
        _parse_int(env, "LOCAL_WORLD_SIZE", 1, sources)
        if env.get("LOCAL_WORLD_SIZE", "")
        else world
    )
    fix = (
        f"{_SLURM_FIX}"
        if sources
        else f"{launch_hint(world)} instead of setting the variables by hand."
    )
    if rank_ >= world:
        raise DistributedSetupError(
            f"{shown('RANK', rank_)} but {shown('WORLD_SIZE', world)}: ranks run from 0 to "
            f"WORLD_SIZE-1. {fix}"
        )
    if local_world > world:
        raise DistributedSetupError(
            f"{shown('LOCAL_WORLD_SIZE', local_world)} but {shown('WORLD_SIZE', world)}: a node "
            f"cannot run more processes than the whole job. {fix}"
        )
    if local >= local_world:
        raise DistributedSetupError(
            f"{shown('LOCAL_RANK', local)} but {shown('LOCAL_WORLD_SIZE', local_world)}: local "
            f"ranks run from 0 to LOCAL_WORLD_SIZE-1. {fix}"
        )
    if local > rank_:
        raise DistributedSetupError(
            f"{shown('LOCAL_RANK', local)} but {shown('RANK', rank_)}: a local rank counts the "
            "processes on this node before this one, each with a lower global rank, so it "
            f"cannot exceed RANK. {fix}"
        )
    if port > 65535:
        raise DistributedSetupError(
            f"{shown('MASTER_PORT', port)} is not a TCP port (1-65535). Pick a free port, e.g. "
            "`torchrun --master-port 29500 ...`, or let torchrun choose with --standalone."
        )
    return DistributedEnv(rank_, world, local, local_world, env["MASTER_ADDR"], port)


#: The fix for an inconsistent environment that SLURM's variables gave.
_SLURM_FIX = (
    "SLURM set these for a task srun started: check the job's --ntasks and --ntasks-per-node "
    "and any SLURM_* variable exported by hand, and start the tasks with `srun python "
    "script.py` (or set torchrun's RANK, WORLD_SIZE, LOCAL_RANK, which win)."
)
