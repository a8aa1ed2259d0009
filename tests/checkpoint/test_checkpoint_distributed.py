"""Checkpoints across ranks (gloo, CPU): FSDP2 shards, resharding to 1 and 4 ranks, a rank
killed under torchrun --max-restarts, and a SIGTERM seen by one rank only.

Each scenario is one torchrun launch of ``ckpt_dist_script.py`` (a free rendezvous port,
finite timeouts, the whole process group killed if it overruns).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
SCRIPT = HERE / "ckpt_dist_script.py"
sys.path.insert(0, str(HERE))


def torchrun(*args: str, nproc: int = 2, restarts: int = 0, timeout: float = 240) -> int:
    """Run the script under torchrun; returns its exit status (the whole group is killed
    if it runs past ``timeout``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", str(SCRIPT), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {args} ran past {timeout} s:\n{out.decode()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the group outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
    torchrun.last_output = out.decode(errors="replace")  # type: ignore[attr-defined]
    return proc.returncode


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted FSDP2 run over 2 ranks, and its checkpoint directory."""
    root = tmp_path_factory.mktemp("fsdp_ref")
    out = root / "ref.pt"
    code = torchrun("train", "--dir", str(root / "ckpt"), "--out", str(out), "--strategy", "fsdp")
    assert code == 0, torchrun.last_output[-3000:]  # type: ignore[attr-defined]
    return root / "ckpt", torch.load(out, weights_only=False)


def test_fsdp2_writes_each_ranks_own_shards(fsdp_reference: tuple[Path, Any]) -> None:
    ckpt_dir, _ = fsdp_reference
    latest = cudakit.find_latest(ckpt_dir)
    assert latest is not None
    assert latest.name == "ckpt-0000000008"
    files = {p.name for p in latest.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt"} <= files
    sizes = [(latest / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.3 * max(sizes)  # both ranks hold a real share


def test_a_rank_killed_under_torchrun_restarts_and_ends_bit_for_bit(
    tmp_path: Path, fsdp_reference: tuple[Path, dict[str, Any]]
) -> None:
    _, ref = fsdp_reference
    out = tmp_path / "killed.pt"
    code = torchrun(
        "train", "--dir", str(tmp_path / "ckpt"), "--out", str(out), "--strategy", "fsdp",
        "--kill-at", "7", restarts=1,
    )  # fmt: skip
    assert code == 0, torchrun.last_output[-3000:]  # type: ignore[attr-defined]
    got = torch.load(out, weights_only=False)
    assert got["resumed_from"].endswith("ckpt-0000000002")
    assert equal(got["state"]["model"], ref["state"]["model"])
    assert equal(got["state"]["optim"], ref["state"]["optim"])
    assert got["losses"] == {k: v for k, v in ref["losses"].items() if k >= 5}


def test_an_fsdp2_checkpoint_of_2_ranks_loads_in_one_process(
    fsdp_reference: tuple[Path, dict[str, Any]],
) -> None:
    from ckpt_dist_script import build, full_state

    ckpt_dir, ref = fsdp_reference
    model, opt, _, step = build("none", lr=0.5)
    ckpt = cudakit.Checkpointer(ckpt_dir, step=step, preemption=False)
    assert ckpt.resume() == cudakit.Position(2, 0, 16, 8)
    ckpt.close()
    state = full_state(model, opt)
    assert equal(state["model"], ref["state"]["model"])
    assert equal(state["optim"], ref["state"]["optim"])


def test_an_fsdp2_checkpoint_of_2_ranks_loads_on_4(
    tmp_path: Path, fsdp_reference: tuple[Path, dict[str, Any]]
) -> None:
    ckpt_dir, ref = fsdp_reference
    out = tmp_path / "four.pt"
    code = torchrun(
        "load", "--dir", str(ckpt_dir), "--out", str(out), "--strategy", "fsdp", nproc=4
    )
    assert code == 0, torchrun.last_output[-3000:]  # type: ignore[attr-defined]
    got = torch.load(out, weights_only=False)
    assert got["position"] == cudakit.Position(2, 0, 16, 8)
    assert equal(got["state"]["model"], ref["state"]["model"])
    assert equal(got["state"]["optim"], ref["state"]["optim"])


def test_a_sigterm_on_one_rank_saves_on_both_and_exits_for_a_requeue(tmp_path: Path) -> None:
    """DDP, background saves on their own gloo group."""
    ref_out = tmp_path / "ref.pt"
    assert torchrun("train", "--dir", str(tmp_path / "ref"), "--out", str(ref_out)) == 0
    ref = torch.load(ref_out, weights_only=False)
    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "stopped.pt"
    code = torchrun(
        "train", "--dir", str(ckpt_dir), "--out", str(out), "--sigterm-at", "5", "--async-save"
    )
    log = torchrun.last_output  # type: ignore[attr-defined]
    assert code != 0, log[-3000:]
    assert "exitcode  : 143" in log, log[-3000:]
    # A clean exit on both ranks: each saved and said so, neither raised.
    assert log.count("exiting with status 143") == 2, log[-3000:]
    assert "[rank0]:" not in log, log[-3000:]
    assert "[rank1]:" not in log, log[-3000:]
    latest = cudakit.find_latest(ckpt_dir)
    # The signal arrived while batch 5 was in hand (mid-window): both ranks agreed one
    # window boundary later and saved there.
    assert latest is not None
    assert latest.name == "ckpt-0000000004"
    assert not out.exists()
    # DDP wrote the replicated tensors once: rank 1's data file holds none of them.
    data = sorted(latest.glob("*.distcp"))
    assert sum(p.stat().st_size for p in data) < 1.5 * max(p.stat().st_size for p in data)
    # The same command again (the requeued job) finishes the run, as if never stopped.
    assert torchrun("train", "--dir", str(ckpt_dir), "--out", str(out), "--async-save") == 0
    got = torch.load(out, weights_only=False)
    assert equal(got["state"]["model"], ref["state"]["model"])
    assert got["losses"] == {k: v for k, v in ref["losses"].items() if k > 8}


def test_a_mid_epoch_checkpoint_of_2_ranks_is_refused_on_1(tmp_path: Path) -> None:
    from ckpt_dist_script import build, data

    ckpt_dir = tmp_path / "ckpt"
    code = torchrun(
        "train", "--dir", str(ckpt_dir), "--out", str(tmp_path / "o.pt"), "--sigterm-at", "2"
    )
    assert code != 0
    latest = cudakit.find_latest(ckpt_dir)
    assert latest is not None
    assert latest.name == "ckpt-0000000002"
    model, _opt, _, step = build("none")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = torch.utils.data.DataLoader(data(), batch_size=4)
    ckpt = cudakit.Checkpointer(ckpt_dir, step=step, loader=loader, preemption=False)
    with pytest.raises(cudakit.CheckpointError, match=r"saved mid-epoch .* by 2 rank\(s\)"):
        ckpt.resume()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def _tamper_rank_1(ckpt: Path, proof: Path) -> None:
    """rank-00001.pt with a payload nested in its genuine state; sizes fixed to match."""
    from tampered import Exec, fix_manifest

    file = ckpt / "rank-00001.pt"
    host = torch.load(file, weights_only=True)
    host["extras"]["x"] = ("value", [Exec(proof)])
    torch.save(host, file)
    fix_manifest(ckpt)


def test_one_ranks_refused_file_stops_every_rank_with_the_same_error(
    tmp_path: Path, fsdp_reference: tuple[Path, Any]
) -> None:
    ckpt_dir, _ = fsdp_reference
    run_dir, proof = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(ckpt_dir, run_dir)
    target = run_dir / "ckpt-0000000008"
    _tamper_rank_1(target, proof)
    code = torchrun(
        "load", "--dir", str(run_dir), "--out", str(tmp_path / "o.pt"), "--strategy", "fsdp",
        "--path", str(target), timeout=150,
    )  # fmt: skip
    log = torchrun.last_output  # type: ignore[attr-defined]
    assert code != 0, log[-3000:]
    # (Two processes print to one pipe at once: a line may run into the other's.)
    lines = re.findall(r"rank \d stopped: (.*?\))(?=rank \d stopped: |\n|$)", log)
    assert len(lines) == 2, log[-3000:]
    messages = set(lines)
    assert len(messages) == 1, lines  # the same error on both ranks
    message = messages.pop()
    assert message.startswith("RefusedCheckpointError")
    assert "rank-00001.pt holds builtins.exec" in message
    assert "found by rank 1" in message
    assert not proof.exists()
    assert not (tmp_path / "o.pt").exists()


def test_resume_on_2_ranks_skips_a_checkpoint_one_rank_refuses(
    tmp_path: Path, fsdp_reference: tuple[Path, Any]
) -> None:
    ckpt_dir, _ = fsdp_reference
    run_dir, proof = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(ckpt_dir, run_dir)
    _tamper_rank_1(run_dir / "ckpt-0000000008", proof)
    out = tmp_path / "o.pt"
    code = torchrun(
        "load", "--dir", str(run_dir), "--out", str(out), "--strategy", "fsdp", timeout=150
    )
    log = torchrun.last_output  # type: ignore[attr-defined]
    assert code == 0, log[-3000:]
    assert log.count("skipping checkpoint") >= 2, log[-3000:]  # a warning on each rank
    got = torch.load(out, weights_only=False)
    assert got["position"].total == 12
    assert not proof.exists()


def test_an_fsdp2_load_copies_nothing_to_host_memory(
    tmp_path: Path, fsdp_reference: tuple[Path, dict[str, Any]]
) -> None:
    """The shards are read into new storage and copied in at the end: no host copy of
    them is kept to put the run back, and the loaded values are the saved ones."""
    ckpt_dir, ref = fsdp_reference
    out = tmp_path / "o.pt"
    code = torchrun(
        "load", "--dir", str(ckpt_dir), "--out", str(out), "--strategy", "fsdp", "--stepped",
        "--report",
    )  # fmt: skip
    log = torchrun.last_output  # type: ignore[attr-defined]
    assert code == 0, log[-3000:]
    assert sorted(re.findall(r"rank (\d) copied to host: (\d+) bytes", log)) == [
        ("0", "0"),
        ("1", "0"),
    ], log[-3000:]
    got = torch.load(out, weights_only=False)
    assert equal(got["state"]["model"], ref["state"]["model"])
    assert equal(got["state"]["optim"], ref["state"]["optim"])


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh optimizer", "stepped"])
def test_an_fsdp2_load_failing_part_way_changes_nothing_on_either_rank(
    tmp_path: Path, fsdp_reference: tuple[Path, Any], stepped: bool
) -> None:
    """Rank 1's data file with other bytes (same size): rank 0 reads its own shards, rank 1
    fails part-way; on both ranks the shards, the optimizer state (the same tensors) and
    the RNG are as they were."""
    ckpt_dir, _ = fsdp_reference
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt_dir, run_dir)
    target = run_dir / "ckpt-0000000008"
    data = target / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)
    data.write_bytes(bytes(raw))
    args = ["--stepped"] if stepped else []
    code = torchrun(
        "load", "--dir", str(run_dir), "--out", str(tmp_path / "o.pt"), "--strategy", "fsdp",
        "--path", str(target), "--report", *args, timeout=150,
    )  # fmt: skip
    log = torchrun.last_output  # type: ignore[attr-defined]
    assert code != 0, log[-3000:]
    assert sorted(re.findall(r"rank (\d) unchanged: (\w+)", log)) == [
        ("0", "True"),
        ("1", "True"),
    ], log[-3000:]
    assert not (tmp_path / "o.pt").exists()
