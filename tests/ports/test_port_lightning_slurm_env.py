"""Rank, world size and rendezvous from SLURM's and torchrun's variables, ported from
Lightning's SLURMEnvironment/TorchElasticEnvironment tests and submitit's node-list
tests to cudakit's reading (``cudakit._dist``, through the public ``read_env``,
``rank``/``world_size``/``local_rank``/``is_main_process``, ``choose_strategy`` and
``choose_plan``).

Lightning's behaviour, held here: the attributes come from SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID (and the node's task count); the rendezvous host is the node list's
first host whatever its form (``node[01-04,07]``, commas, spaces, several bracket
groups); the port is derived from the job id (one per job, the same on every task);
``MASTER_ADDR``/``MASTER_PORT`` win when set; the interactive shell of ``salloc``
(``SLURM_JOB_NAME=bash``/``interactive``) is no launch; values that contradict each
other are refused, naming the SLURM variable each came from and SLURM's fix.
Environments are faked with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from launcher_env import clean_launcher_env, free_port

import cudakit
import cudakit.parallel as cp
from cudakit._dist import expand_hostlist
from cudakit.exceptions import DistributedSetupError
from cudakit.parallel.strategy import ParallelFacts, choose_plan

__all__ = ["clean_launcher_env"]  # the autouse fixture: no launcher or SLURM variables leak in

#: Lightning's test_attributes_from_environment_variables, with a consistent rank.
LIGHTNING_SLURM = {
    "SLURM_NODELIST": "1.1.1.1, 1.1.1.2",
    "SLURM_JOB_ID": "0001234",
    "SLURM_NTASKS": "20",
    "SLURM_NTASKS_PER_NODE": "10",
    "SLURM_LOCALID": "2",
    "SLURM_PROCID": "12",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NAME": "JOB",
}


def _set(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _task(procid: int = 0, ntasks: int = 2, **more: str) -> dict[str, str]:
    """The variables srun sets in task ``procid`` of ``ntasks`` on one node."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(ntasks),
        "SLURM_NODELIST": "gpu-node07",
        **more,
    }


# --------------------------------------------------------------------------- no launcher


def test_without_any_variables_this_is_one_process() -> None:
    assert cp.read_env() is None
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (0, 1, 0)
    assert cp.is_main_process()
    assert cp.is_main_process(local=True)
    assert cp.choose_strategy("auto", env={}, device_count=0, device_type="cpu") == "none"


# --------------------------------------------------------------------------- SLURM


def test_the_attributes_come_from_slurms_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, LIGHTNING_SLURM)
    env = cp.read_env()
    assert env == cp.DistributedEnv(
        rank=12, world_size=20, local_rank=2, local_world_size=10,
        master_addr="1.1.1.1", master_port=15000 + 1234,
    )  # fmt: skip
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (12, 20, 2)
    assert not cp.is_main_process()
    assert not cp.is_main_process(local=True)
    cuda = cp.choose_strategy("auto", env=LIGHTNING_SLURM, device_count=10, device_type="cuda")
    cpu = cp.choose_strategy("auto", env=LIGHTNING_SLURM, device_count=0, device_type="cpu")
    assert (cuda, cpu) == ("ddp", "ddp")


def test_rank_0_of_the_node_is_the_local_main_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**LIGHTNING_SLURM, "SLURM_PROCID": "10", "SLURM_LOCALID": "0"})
    assert not cp.is_main_process()
    assert cp.is_main_process(local=True)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("alpha", "alpha"),
        ("alpha,beta,gamma", "alpha"),
        ("alpha beta gamma", "alpha"),
        ("alpha  beta\tgamma", "alpha"),
        ("1.2.3.[100-110]", "1.2.3.100"),
        ("1.2.3.[089, 100-110]", "1.2.3.089"),
        ("host[22]", "host22"),
        ("host[1,5-9]", "host1"),
        ("host[5-9,1]", "host5"),
        ("alpha, host[5-9], gamma", "alpha"),
        ("alpha[3,1], beta", "alpha3"),
        ("node[01-04,07]", "node01"),
        ("rack[2-3]-n[08-10]", "rack2-n08"),
    ],
)
def test_the_rendezvous_host_is_the_first_of_the_node_list(
    monkeypatch: pytest.MonkeyPatch, nodelist: str, first: str
) -> None:
    _set(monkeypatch, _task(SLURM_NODELIST=nodelist))
    env = cp.read_env()
    assert env is not None
    assert env.master_addr == first


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("compute-b24", ["compute-b24"]),
        ("compute-a1,compute-b2", ["compute-a1", "compute-b2"]),
        ("compute-b2[1,2]", ["compute-b21", "compute-b22"]),
        ("compute-b2[011,022]", ["compute-b2011", "compute-b2022"]),
        ("compute-b2[1-3]", ["compute-b21", "compute-b22", "compute-b23"]),
        ("compute-b2[1-3,5-6,8],compute-a1", [
            "compute-b21", "compute-b22", "compute-b23", "compute-b25", "compute-b26",
            "compute-b28", "compute-a1",
        ]),
        ("compute[042-043,045,048-049]", [
            "compute042", "compute043", "compute045", "compute048", "compute049",
        ]),
        ("compute-b24-[1-3,5],compute-b25-[1,4]", [
            "compute-b24-1", "compute-b24-2", "compute-b24-3", "compute-b24-5",
            "compute-b25-1", "compute-b25-4",
        ]),
        ("a b,c", ["a", "b", "c"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ],
)  # fmt: skip
def test_node_lists_expand_as_slurm_expands_them(nodelist: str, hosts: list[str]) -> None:
    """submitit's test_slurm_node_list cases."""
    assert expand_hostlist(nodelist) == hosts


@st.composite
def _groups(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A compressed SLURM node list and the hosts it names, built side by side."""
    parts, hosts = [], []
    for _ in range(draw(st.integers(1, 3))):
        prefix = draw(st.sampled_from(["node", "gpu-a", "r1-n", "10.0.0."]))
        if draw(st.booleans()):
            parts.append(f"{prefix}{draw(st.integers(0, 99))}")
            hosts.append(parts[-1])
            continue
        width = draw(st.integers(1, 3))
        ranges, names = [], []
        for _ in range(draw(st.integers(1, 3))):
            lo = draw(st.integers(0, 10 ** min(width, 2) - 1))
            hi = lo + draw(st.integers(0, 3))
            text = f"{lo:0{width}d}" + (f"-{hi:0{width}d}" if hi > lo else "")
            ranges.append(text)
            names += [f"{prefix}{n:0{width}d}" for n in range(lo, hi + 1)]
        sep = draw(st.sampled_from([",", ", "]))
        parts.append(f"{prefix}[{sep.join(ranges)}]")
        hosts += names
    joiner = draw(st.sampled_from([",", " ", ", "]))
    return joiner.join(parts), hosts


@given(_groups())
def test_any_compressed_node_list_expands_in_order_and_its_first_host_is_the_address(
    case: tuple[str, list[str]],
) -> None:
    nodelist, hosts = case
    assert expand_hostlist(nodelist) == hosts
    env = cp.read_env(_task(SLURM_NODELIST=nodelist))
    assert env is not None
    assert env.master_addr == hosts[0]


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("compute-b2[1-,4]", "not a number or a range"),
        ("compute-b2[1,2,compute-b3]", "not a number or a range"),
        ("n[3-1]", "runs backwards"),
        ("n[1-2", "unbalanced brackets"),
    ],
)
def test_a_node_list_that_cannot_be_read_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, nodelist: str, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        expand_hostlist(nodelist)
    _set(monkeypatch, _task(SLURM_NODELIST=nodelist))
    with pytest.raises(DistributedSetupError, match="SLURM_NODELIST") as info:
        cp.read_env()
    assert "Set MASTER_ADDR" in str(info.value)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")  # the fix
    env = cp.read_env()
    assert env is not None
    assert env.master_addr == "10.1.2.3"


def test_master_addr_and_port_set_by_hand_win(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**LIGHTNING_SLURM, "MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "31234"})
    env = cp.read_env()
    assert env is not None
    assert (env.master_addr, env.master_port) == ("10.9.8.7", 31234)


@pytest.mark.parametrize(
    ("job", "port"), [("0001234", 16234), ("1234", 16234), ("12345", 17345), ("4999", 19999)]
)
def test_the_port_is_derived_from_the_job_id(
    monkeypatch: pytest.MonkeyPatch, job: str, port: int
) -> None:
    _set(monkeypatch, _task(SLURM_JOB_ID=job))
    env = cp.read_env()
    assert env is not None
    assert env.master_port == port


def test_every_task_of_a_job_meets_on_one_port_and_the_next_job_on_another() -> None:
    def port(procid: int, job: str) -> int:
        env = cp.read_env(_task(procid, 4, SLURM_JOB_ID=job, SLURM_NTASKS_PER_NODE="4"))
        assert env is not None
        return env.master_port

    assert len({port(r, "90210") for r in range(4)}) == 1
    assert port(0, "90210") != port(0, "90211")
    assert all(1024 < port(0, str(job)) < 32768 for job in (0, 1, 4999, 5000, 123456789))


def test_without_a_job_id_the_port_is_torchruns_default() -> None:
    task = _task()
    del task["SLURM_JOB_ID"]
    env = cp.read_env(task)
    assert env is not None
    assert env.master_port == 29500


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_the_interactive_shell_of_salloc_is_no_launch(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    task = _task(3, 4, SLURM_JOB_NAME=name, SLURM_NTASKS_PER_NODE="4")
    del task["SLURM_STEP_ID"]
    _set(monkeypatch, task)
    assert cp.read_env() is None
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (0, 1, 0)
    assert cp.choose_strategy("auto", env=task, device_count=0, device_type="cpu") == "none"
    # srun typed in that shell starts tasks: SLURM_STEP_ID marks them.
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    env = cp.read_env()
    assert env is not None
    assert (env.rank, env.world_size) == (3, 4)
    assert cp.rank() == 3


def test_torchruns_variables_win_inside_a_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, LIGHTNING_SLURM)
    _set(monkeypatch, {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400",
    })  # fmt: skip
    assert cp.read_env() == cp.DistributedEnv(1, 4, 1, 2, "10.0.0.5", 29400)
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (1, 4, 1)


def test_a_steps_task_count_wins_over_the_jobs() -> None:
    """`srun -n 2 python train.py` inside an allocation of 8 tasks."""
    env = cp.read_env(_task(1, 8, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2"))
    assert env is not None
    assert (env.world_size, env.local_world_size) == (2, 2)


@pytest.mark.parametrize(("node", "local_world"), [("0", 4), ("1", 4), ("2", 3)])
def test_uneven_nodes_take_their_own_task_count(node: str, local_world: int) -> None:
    task = _task(
        8 if node == "2" else 0, 11, SLURM_NODEID=node, SLURM_LOCALID="0",
        SLURM_STEP_TASKS_PER_NODE="4(x2),3",
    )  # fmt: skip
    del task["SLURM_NTASKS_PER_NODE"]
    env = cp.read_env(task)
    assert env is not None
    assert env.local_world_size == local_world


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"SLURM_NTASKS_PER_NODE": "4"}, ["LOCAL_WORLD_SIZE=4 (from SLURM_NTASKS_PER_NODE)",
                                           "WORLD_SIZE=2 (from SLURM_NTASKS)"]),
        ({"SLURM_PROCID": "2"}, ["RANK=2 (from SLURM_PROCID)", "WORLD_SIZE=2 (from SLURM_NTASKS)"]),
        ({"SLURM_LOCALID": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"},
         ["LOCAL_RANK=2 (from SLURM_LOCALID)", "LOCAL_WORLD_SIZE=2 (from SLURM_NTASKS_PER_NODE)"]),
        ({"SLURM_LOCALID": "1", "SLURM_PROCID": "0"}, ["LOCAL_RANK=1 (from SLURM_LOCALID)",
                                                        "RANK=0 (from SLURM_PROCID)"]),
    ],
)  # fmt: skip
def test_contradicting_slurm_variables_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, str], names: list[str]
) -> None:
    _set(monkeypatch, {**_task(1, 2), **change})
    with pytest.raises(DistributedSetupError) as info:
        cp.read_env()
    message = str(info.value)
    for name in names:
        assert name in message, message
    assert "--ntasks-per-node" in message
    assert "srun python" in message
    assert "torchrun --nproc-per-node" not in message  # SLURM's fix, not torchrun's


@pytest.mark.parametrize("variable", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"])
def test_a_slurm_variable_that_is_no_number_is_named_with_slurms_fix(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    _set(monkeypatch, {**_task(1, 2), variable: "two"})
    with pytest.raises(DistributedSetupError) as info:
        cp.read_env()
    message = str(info.value)
    assert f"{variable}='two'" in message, message
    assert "is not an integer" in message
    assert "srun python" in message
    assert "torchrun --nproc-per-node" not in message


def _facts(env: cp.DistributedEnv, device_count: int) -> ParallelFacts:
    return ParallelFacts(
        env=env, group_world_size=None, cuda_available=True, device_count=device_count,
        current_cuda_index=0, requested_device=None, best_device=torch.device("cuda", 0),
    )  # fmt: skip


def test_each_task_trains_on_its_local_gpu_or_on_its_only_one() -> None:
    env = cp.read_env(_task(3, 4, SLURM_NTASKS_PER_NODE="4"))
    assert env is not None
    assert choose_plan("auto", _facts(env, 4)).device == torch.device("cuda", 3)
    # --gpus-per-task=1: each task sees one GPU, its own
    assert choose_plan("auto", _facts(env, 1)).device == torch.device("cuda", 0)


def test_more_tasks_per_node_than_gpus_is_refused_with_slurms_fix() -> None:
    """Lightning's validate_settings: --ntasks-per-node must match the GPUs."""
    env = cp.read_env(_task(3, 4, SLURM_NTASKS_PER_NODE="4"))
    assert env is not None
    with pytest.raises(DistributedSetupError) as info:
        choose_plan("auto", _facts(env, 2))
    message = str(info.value)
    assert "LOCAL_RANK=3" in message
    assert "2 CUDA device(s)" in message
    assert "--ntasks-per-node" in message, message


def test_a_single_task_job_sets_up_a_group_from_slurms_variables_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _set(monkeypatch, _task(0, 1, SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(free_port())))
    with cp.process_group(timeout=datetime.timedelta(seconds=30)):
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert (cudakit.parallel.rank(), cudakit.parallel.world_size()) == (0, 1)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- torchrun


def test_the_attributes_come_from_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's TorchElasticEnvironment attributes (with a local rank that fits)."""
    torchrun = {
        "MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "WORLD_SIZE": "20", "RANK": "5",
        "LOCAL_RANK": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "",
    }  # fmt: skip
    _set(monkeypatch, torchrun)
    assert cp.read_env() == cp.DistributedEnv(5, 20, 2, 20, "1.2.3.4", 500)
    assert (cp.rank(), cp.world_size(), cp.local_rank()) == (5, 20, 2)
    assert cp.choose_strategy("auto", env=torchrun, device_count=0, device_type="cpu") == "ddp"


def test_a_local_rank_above_the_global_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's example (RANK=1, LOCAL_RANK=2) cannot come from torchrun: cudakit says so."""
    _set(monkeypatch, {
        "MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "WORLD_SIZE": "20", "RANK": "1",
        "LOCAL_RANK": "2",
    })  # fmt: skip
    with pytest.raises(DistributedSetupError, match=r"LOCAL_RANK=2 but RANK=1"):
        cp.read_env()


def test_an_incomplete_torchrun_environment_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _set(monkeypatch, {"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(DistributedSetupError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"):
        cp.read_env()
    # one process with stray variables is no launch
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cp.read_env() is None
