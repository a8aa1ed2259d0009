"""What a run's directory holds is data: keep= never deletes through a planted symlink,
a tampered cudakit.json is only read, and listing checkpoints unpickles nothing."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit
from cudakit.checkpoint import _layout as layout

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import run
from tampered import plant


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    return victim


def test_keep_never_deletes_through_a_symlink_planted_in_an_old_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    victim = _victim(tmp_path)
    run(root, accumulate=1, every=5, epochs=1)  # ckpt-5, ckpt-10
    (root / "ckpt-0000000005" / "link").symlink_to(victim, target_is_directory=True)
    (root / "ckpt-0000000005" / "file-link").symlink_to(victim / "precious.txt")
    run(root, accumulate=1, every=5, keep=1)  # the second epoch; keep=1 prunes ckpt-5
    assert not (root / "ckpt-0000000005").exists()
    assert (victim / "precious.txt").read_text() == "keep me"


def test_keep_never_deletes_a_directory_a_checkpoint_name_links_to(tmp_path: Path) -> None:
    root = tmp_path / "run"
    run(root, accumulate=1, every=5, epochs=1)
    victim = tmp_path / "victim"
    shutil.copytree(root / "ckpt-0000000005", victim)  # a complete checkpoint's files
    (victim / "precious.txt").write_text("keep me")
    shutil.rmtree(root / "ckpt-0000000005")
    (root / "ckpt-0000000005").symlink_to(victim, target_is_directory=True)
    run(root, accumulate=1, every=5, keep=1)
    assert (victim / "precious.txt").read_text() == "keep me"
    assert (victim / layout.MANIFEST).exists()


@pytest.mark.parametrize(
    "change",
    [
        {"files": {"/etc/hostname": 1, "../../victim/precious.txt": 7}},
        {"serial": "__import__('os').system('touch x')"},
        {"models": [{"py/object": "os.system"}]},
        {"format": "!!python/object/apply:os.system"},
        {"world_size": -1},
    ],
)
def test_a_tampered_manifest_is_only_data(tmp_path: Path, change: dict[str, Any]) -> None:
    root = tmp_path / "run"
    victim = _victim(tmp_path)
    run(root, accumulate=1, every=10, epochs=1)  # ckpt-10
    manifest = root / "ckpt-0000000010" / layout.MANIFEST
    data = json.loads(manifest.read_text())
    data.update(change)
    manifest.write_text(json.dumps(data))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert cudakit.find_latest(root) is None
    assert (victim / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_listing_checkpoints_unpickles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    run(root, accumulate=1, every=10)
    proof = tmp_path / "payload-ran"
    plant(root / "ckpt-0000000020", "rank file, torch.save", "exec", 2, proof)
    plant(root / "ckpt-0000000010", ".metadata, whole", "os.system", 2, proof)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("listing checkpoints unpickled a file")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert cudakit.find_latest(root) == root / "ckpt-0000000020"
    found = layout.list_checkpoints(root)
    assert [p.name for p, _ in found.complete] == ["ckpt-0000000010", "ckpt-0000000020"]
    model = torch.nn.Linear(6, 2)
    ckpt = cudakit.Checkpointer(root, model=model, preemption=False)
    assert ckpt.latest == root / "ckpt-0000000020"
    ckpt.close()
    assert not proof.exists()
