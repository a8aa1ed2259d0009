"""``read_env`` refuses launcher variables that contradict each other, naming them (and the
SLURM variable each came from, for a task ``srun`` started)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cudakit.parallel as cp
from cudakit._dist import read_launcher_env
from cudakit.exceptions import DistributedSetupError


def _env(world: int, rank: int, local: int, local_world: int | None = None) -> dict[str, str]:
    env = {
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    if local_world is not None:
        env["LOCAL_WORLD_SIZE"] = str(local_world)
    return env


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (_env(2, 0, 0, 4), r"LOCAL_WORLD_SIZE=4 but WORLD_SIZE=2: a node cannot run more "),
        (_env(1, 0, 0, 8), r"LOCAL_WORLD_SIZE=8 but WORLD_SIZE=1"),
        (_env(2, 2, 0), r"RANK=2 but WORLD_SIZE=2: ranks run from 0 to WORLD_SIZE-1"),
        (_env(4, 1, 2, 4), r"LOCAL_RANK=2 but RANK=1: a local rank counts the processes "),
        (_env(4, 3, 2, 2), r"LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2: local ranks run from 0 to "),
    ],
)
def test_contradicting_variables_are_refused_by_name(env: dict[str, str], match: str) -> None:
    with pytest.raises(DistributedSetupError, match=match) as info:
        cp.read_env(env)
    assert "instead of setting the variables by hand" in str(info.value)


def test_a_consistent_environment_is_read() -> None:
    assert cp.read_env(_env(8, 5, 1, 4)) == cp.DistributedEnv(5, 8, 1, 4, "127.0.0.1", 29500)
    assert cp.read_env(_env(2, 1, 1)) == cp.DistributedEnv(1, 2, 1, 2, "127.0.0.1", 29500)


@given(
    world=st.integers(1, 16),
    rank=st.integers(0, 20),
    local=st.integers(0, 20),
    local_world=st.none() | st.integers(1, 20),
)
def test_read_env_accepts_exactly_the_consistent_environments(
    world: int, rank: int, local: int, local_world: int | None
) -> None:
    lw = world if local_world is None else local_world
    consistent = rank < world and lw <= world and local < lw and local <= rank
    env = _env(world, rank, local, local_world)
    if consistent:
        assert read_launcher_env(env, strict=True) == cp.DistributedEnv(
            rank, world, local, lw, "127.0.0.1", 29500
        )
    else:
        with pytest.raises(DistributedSetupError):
            read_launcher_env(env, strict=True)


def test_slurm_errors_name_the_slurm_variables() -> None:
    srun = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "7",
    }
    with pytest.raises(
        DistributedSetupError,
        match=r"RANK=2 \(from SLURM_PROCID\) but WORLD_SIZE=2 \(from SLURM_NTASKS\): ranks run",
    ) as info:
        cp.read_env(srun)
    assert "srun" in str(info.value)  # the fix speaks of the launcher that was used
    many = {**srun, "SLURM_PROCID": "1", "SLURM_NTASKS_PER_NODE": "4"}
    with pytest.raises(
        DistributedSetupError,
        match=r"LOCAL_WORLD_SIZE=4 \(from SLURM_NTASKS_PER_NODE\) but WORLD_SIZE=2 \(from SLURM_N",
    ):
        cp.read_env(many)


@pytest.mark.parametrize("name", ["MASTER_ADDR", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID"])
def test_a_variable_present_as_none_is_refused(name: str) -> None:
    env: dict[str, str | None] = {**_env(2, 1, 1), name: None}
    before = dict(env)
    with pytest.raises(
        TypeError,
        match=rf"read_env\(env=\.\.\.\) expects string values, as os\.environ holds; {name} is "
        rf"None, got NoneType None\. Leave {name} out of env \(an unset variable is absent\), "
        r"or give it a string",
    ):
        cp.read_env(env)  # type: ignore[arg-type]
    assert env == before
