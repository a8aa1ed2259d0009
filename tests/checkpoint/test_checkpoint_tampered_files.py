"""A checkpoint cannot run code: payloads planted in any of its files are refused or
skipped, with the file named, and a sentinel file proves that none of them ran."""

from __future__ import annotations

import pickle
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import cudakit
from cudakit.checkpoint import _safe_dcp as safe_dcp
from cudakit.checkpoint import _safe_load as safe_load

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import make_data, make_net, run
from tampered import KINDS, PLACES, PROTOCOLS, plant


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's directory with two complete checkpoints: ckpt-10 and ckpt-20."""
    root = tmp_path_factory.mktemp("genuine") / "run"
    run(root, accumulate=1, every=10)
    return root


@pytest.fixture
def copy(genuine: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(genuine, target)
    return target


@pytest.fixture
def proof(tmp_path: Path) -> Iterator[Path]:
    """The sentinel a payload writes when it runs; checked absent after the test."""
    path = tmp_path / "payload-ran"
    yield path
    time.sleep(0.05)  # (a process a payload started would have written by now)
    assert not path.exists(), "a payload ran"


def checkpointer(root: Path, **options: Any) -> tuple[cudakit.Checkpointer, torch.nn.Module]:
    """A Checkpointer over the objects ckpt_training.run() saves."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    step = cudakit.autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=1, scheduler=sched, max_grad_norm=1.0
    )

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loader = DataLoader(make_data(), batch_size=4, shuffle=True)
    ckpt = cudakit.Checkpointer(root, step=train_step, loader=loader, preemption=False, **options)
    return ckpt, model


def test_the_payloads_run_when_pickle_loads_them(tmp_path: Path) -> None:
    """The corpus is live: pickle's full loader runs every payload."""
    for kind, make in KINDS.items():
        proof = tmp_path / f"ran-{kind.replace(' ', '_')}"
        result = pickle.loads(pickle.dumps(make(proof), protocol=2))
        if hasattr(result, "wait"):
            result.wait()
        assert proof.exists(), kind


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("place", list(PLACES))
def test_a_named_checkpoint_with_a_payload_is_refused_naming_the_file(
    copy: Path, proof: Path, place: str, kind: str, protocol: int
) -> None:
    target = copy / "ckpt-0000000020"
    name = plant(target, place, kind, protocol, proof)
    ckpt, model = checkpointer(copy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(safe_load.RefusedCheckpointError, match=r"nothing of it ran") as info:
        ckpt.load(target)
    assert name in str(info.value)
    assert info.value.refused
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("place", list(PLACES))
def test_resume_skips_a_checkpoint_with_a_payload_for_the_one_before(
    copy: Path, proof: Path, place: str, protocol: int
) -> None:
    kind = list(KINDS)[protocol % len(KINDS)]
    name = plant(copy / "ckpt-0000000020", place, kind, protocol, proof)
    ckpt, _ = checkpointer(copy)
    with pytest.warns(UserWarning, match="skipping checkpoint .*ckpt-0000000020") as caught:
        position = ckpt.resume()
    assert position == cudakit.Position(1, 0, 10, 10)
    assert ckpt.resumed_from == copy / "ckpt-0000000010"
    message = " ".join(str(w.message) for w in caught)
    assert name in message
    assert "refuses" in message
    ckpt.close()


def test_the_refusal_names_the_global(copy: Path, proof: Path) -> None:
    plant(copy / "ckpt-0000000020", ".metadata, whole", "os.system", 2, proof)
    ckpt, _ = checkpointer(copy)
    with pytest.raises(safe_load.RefusedCheckpointError, match=r"holds posix\.system") as info:
        ckpt.load(copy / "ckpt-0000000020")
    assert info.value.refused == ("posix.system",)
    assert info.value.file.endswith(".metadata")
    plant(copy / "ckpt-0000000010", "rank file, torch.save", "exec", 2, proof)
    with pytest.raises(safe_load.RefusedCheckpointError, match=r"holds builtins\.exec"):
        ckpt.load(copy / "ckpt-0000000010")
    ckpt.close()


def test_resume_starts_fresh_when_every_checkpoint_holds_a_payload(copy: Path, proof: Path) -> None:
    plant(copy / "ckpt-0000000020", "rank file, nested", "exec", 3, proof)
    plant(copy / "ckpt-0000000010", ".metadata, in a field", "eval", 4, proof)
    ckpt, model = checkpointer(copy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="skipping checkpoint") as caught:
        assert ckpt.resume() == cudakit.Position()
    assert len(caught) == 2
    assert ckpt.resumed_from is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def test_a_data_file_replaced_whole_is_a_corrupted_checkpoint(copy: Path, proof: Path) -> None:
    target = copy / "ckpt-0000000020"
    from tampered import System, fix_manifest

    (target / "__0_0.distcp").write_bytes(pickle.dumps(System(proof), protocol=2) * 50)
    fix_manifest(target)
    ckpt, model = checkpointer(copy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cudakit.CheckpointError, match=r"__0_0\.distcp"):
        ckpt.load(target)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def test_trust_pickles_reads_with_the_full_loader(copy: Path, tmp_path: Path) -> None:
    """The opt-in does what its name says: a payload runs (so it is for your own files)."""
    proof = tmp_path / "ran-trusted"
    plant(copy / "ckpt-0000000020", "rank file, nested", "exec", 2, proof)
    ckpt, _ = checkpointer(copy, trust_pickles=True)
    with pytest.raises(cudakit.CheckpointError):
        ckpt.load(copy / "ckpt-0000000020")  # (its Python RNG state is no state)
    assert proof.exists()
    ckpt.close()


def _host(ckpt: Path) -> Any:
    return torch.load(ckpt / "rank-00000.pt", weights_only=True)


def test_cudakit_files_load_with_torchs_safe_loader(genuine: Path) -> None:
    host = _host(genuine / "ckpt-0000000020")
    assert host["format"] == 2
    assert isinstance(host["rng"]["cpu"], torch.Tensor)
    with open(genuine / "ckpt-0000000020" / ".metadata", "rb") as f:
        metadata = safe_dcp._MetadataUnpickler(f).load()
    assert metadata.state_dict_metadata
