"""SLURM without torchrun: rank, world size, local rank and the rendezvous from srun's
variables, read in the one place that reads the distributed environment (``_dist``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from launcher_env import clean_launcher_env, free_port  # noqa: F401 (autouse fixture)

import cudakit
from cudakit import _dist
from cudakit.exceptions import DistributedSetupError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("rack[1-2]-gpu[3-4]", ["rack1-gpu3", "rack1-gpu4", "rack2-gpu3", "rack2-gpu4"]),
        ("gpu-a[1-2]b", ["gpu-a1b", "gpu-a2b"]),
        ("127.0.0.1", ["127.0.0.1"]),
    ],
)
def test_expand_hostlist(nodelist: str, hosts: list[str]) -> None:
    assert _dist.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "n[3-1]", "n[a-b]", "n[1,,2x]"])
def test_a_malformed_hostlist_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match=r"unbalanced|runs backwards|not a number"):
        _dist.expand_hostlist(bad)


@given(
    groups=st.lists(
        st.tuples(
            st.sampled_from(["node", "gpu-", "r1n", "a"]),
            st.lists(st.integers(0, 120), min_size=1, max_size=6, unique=True),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_expanding_a_compressed_list_gives_the_explicit_list(
    groups: list[tuple[str, list[int], int]],
) -> None:
    compressed, explicit = [], []
    for prefix, numbers, width in groups:
        numbers = sorted(numbers)
        parts, run = [], [numbers[0]]
        for n in numbers[1:]:
            if n == run[-1] + 1:
                run.append(n)
                continue
            parts.append(run)
            run = [n]
        parts.append(run)
        text = ",".join(
            f"{r[0]:0{width}d}" if len(r) == 1 else f"{r[0]:0{width}d}-{r[-1]:0{width}d}"
            for r in parts
        )
        compressed.append(f"{prefix}[{text}]")
        explicit.extend(f"{prefix}{n:0{width}d}" for n in numbers)
    assert _dist.expand_hostlist(",".join(compressed)) == explicit


_LITERAL = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=5)
_NUMBERS = st.tuples(
    st.lists(st.integers(0, 130), min_size=1, max_size=6, unique=True), st.integers(1, 4)
)


def _compress(numbers: list[int], width: int) -> str:
    """``[1,2,3,7]`` as SLURM writes it: ``1-3,7``, each number padded to ``width``."""
    numbers = sorted(numbers)
    runs, run = [], [numbers[0]]
    for n in numbers[1:]:
        if n == run[-1] + 1:
            run.append(n)
        else:
            runs.append(run)
            run = [n]
    runs.append(run)
    return ",".join(
        f"{r[0]:0{width}d}" if len(r) == 1 else f"{r[0]:0{width}d}-{r[-1]:0{width}d}" for r in runs
    )


@given(
    hosts=st.lists(
        st.lists(st.one_of(_LITERAL, _NUMBERS), min_size=1, max_size=4).filter(
            lambda segments: isinstance(segments[0], str)  # a host name starts with text
        ),
        min_size=1,
        max_size=4,
    )
)
def test_several_bracket_groups_and_plain_names_expand_to_the_explicit_list(
    hosts: list[list[str | tuple[list[int], int]]],
) -> None:
    compressed, explicit = [], []
    for segments in hosts:
        text, names = "", [""]
        for seg in segments:
            if isinstance(seg, str):
                text += seg
                names = [n + seg for n in names]
            else:
                numbers, width = seg
                text += f"[{_compress(numbers, width)}]"
                # the first group varies slowest, as SLURM's own expansion does
                names = [n + f"{v:0{width}d}" for n in names for v in sorted(numbers)]
        compressed.append(text)
        explicit.extend(names)
    assert _dist.expand_hostlist(",".join(compressed)) == explicit


def test_the_empty_node_list_has_no_host() -> None:
    assert _dist.expand_hostlist("") == []
    assert _dist.expand_hostlist(" a , b ") == ["a", "b"]


def _srun(procid: int, ntasks: int = 2, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(procid),
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    env.update(extra)
    return env


def test_read_env_takes_rank_world_size_and_local_rank_from_slurm() -> None:
    env = _dist.read_env(_srun(1))
    assert env == _dist.DistributedEnv(1, 2, 1, 2, "gpu07", 15000 + 123456 % 5000)


def test_master_addr_and_port_win_over_the_nodelist() -> None:
    env = _dist.read_env(_srun(0, MASTER_ADDR="10.0.0.5", MASTER_PORT="29400"))
    assert env is not None
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 29400)


def test_tasks_per_node_give_the_local_world_size() -> None:
    env = _dist.read_env(
        _srun(5, ntasks=7, SLURM_LOCALID="1", SLURM_NODEID="1",
              SLURM_STEP_TASKS_PER_NODE="4,3")
    )  # fmt: skip
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 7, 1, 3)
    assert _dist._tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_torchrun_inside_a_slurm_job_wins() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h",
                "MASTER_PORT": "1234"}  # fmt: skip
    env = _dist.read_env({**_srun(0), **torchrun})
    assert env == _dist.DistributedEnv(3, 4, 3, 4, "h", 1234)


def test_the_interactive_shell_of_salloc_is_not_a_launch() -> None:
    assert _dist.read_env(_srun(0, SLURM_JOB_NAME="bash")) is None


def test_the_rank_helpers_read_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _srun(1, SLURM_NTASKS_PER_NODE="2").items():
        monkeypatch.setenv(key, value)
    assert (cudakit.rank(), cudakit.world_size(), cudakit.local_rank()) == (1, 2, 1)
    assert not cudakit.is_main_process()


def test_an_inconsistent_slurm_environment_is_a_clear_error() -> None:
    with pytest.raises(
        DistributedSetupError, match=r"RANK=2 \(from SLURM_PROCID\) but WORLD_SIZE=2 \(from SLURM"
    ):
        _dist.read_launcher_env(_srun(2), strict=True)


def test_srun_inside_salloc_is_a_launch() -> None:
    # salloc's shell is named "interactive" (or "bash"); srun inside it sets SLURM_STEP_ID.
    env = _dist.read_env(_srun(1, SLURM_JOB_NAME="interactive", SLURM_STEP_ID="0"))
    assert env is not None
    assert (env.rank, env.world_size) == (1, 2)


def test_an_unreadable_node_list_without_master_addr_is_a_clear_error() -> None:
    with pytest.raises(
        DistributedSetupError,
        match=r"a task srun started, but no rendezvous address: SLURM_NODELIST='gpu\[07-' names "
        r"no host cudakit can read\. Set MASTER_ADDR",
    ):
        _dist.read_env(_srun(0, SLURM_NODELIST="gpu[07-"))
    env = _dist.read_env(_srun(0, SLURM_NODELIST="gpu[07-", MASTER_ADDR="10.0.0.1"))
    assert env is not None
    assert env.master_addr == "10.0.0.1"


def test_the_port_is_the_same_on_every_task_and_differs_between_jobs() -> None:
    ports = {_dist.read_env(_srun(r, ntasks=4)).master_port for r in range(4)}  # type: ignore[union-attr]
    assert ports == {15000 + 123456 % 5000}
    other = _dist.read_env(_srun(0, SLURM_JOB_ID="123457"))
    assert other is not None
    assert other.master_port == 15000 + 123457 % 5000
    assert _dist.slurm_port({}) == 29500  # no job id: torchrun's default


def test_a_job_shell_without_task_variables_is_no_launch() -> None:
    # A batch script's own shell (no srun) that looks like one process is no launch.
    assert _dist.read_env({"SLURM_JOB_ID": "5", "SLURM_NODELIST": "n1"}) is None


def test_parallelize_and_choose_strategy_read_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch import nn

    import cudakit.parallel as cp

    assert cp.choose_strategy("auto", env=_srun(1), device_count=0, device_type="cpu") == "ddp"
    one_task = _srun(0, ntasks=1, SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(free_port()))
    for key, value in one_task.items():
        monkeypatch.setenv(key, value)
    model = cp.parallelize(nn.Linear(2, 2), "ddp", timeout=30)  # a group from SLURM's variables
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")


_WORKER = """
import json, torch, cudakit
with cudakit.process_group(timeout=60) as info:
    t = torch.tensor([cudakit.rank() + 1.0])
    torch.distributed.all_reduce(t)
    print(json.dumps({"rank": cudakit.rank(), "world": cudakit.world_size(),
                      "local": cudakit.local_rank(), "sum": t.item(),
                      "backend": info.backend}))
"""


@pytest.mark.distributed
def test_two_tasks_started_as_srun_would_form_a_group() -> None:
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        base.pop(name, None)
    base["PYTHONPATH"] = str(ROOT)
    procs = []
    for procid in range(2):
        env = {**base, **_srun(procid, SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port))}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for procid, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"task {procid} failed:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # nothing outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [(r["rank"], r["world"], r["local"]) for r in results] == [(0, 2, 0), (1, 2, 1)]
    assert {r["sum"] for r in results} == {3.0}
    assert {r["backend"] for r in results} == {"gloo"}
