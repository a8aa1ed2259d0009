"""Checkpoints are named by optimizer step, and a loop that calls ``save()`` itself
gets distinct, ordered checkpoints.

* With ``step=``, a save records the windows the step closed (its optimizer steps,
  skipped ones included) and is named by them: step 20 is ``ckpt-0000000020``, also
  with ``accumulate=4`` under ``batches()`` (80 batches).
* Without a step, a loop with its own data records the saves themselves: 1, 2, ...
* ``keep=3`` after 5 saves leaves 3 complete checkpoints, the newest 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import cudakit
from cudakit.checkpoint import _layout as layout


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt-"))


def _parts(accumulate: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=accumulate)
    return model, opt, step


def test_an_own_loop_with_a_step_names_each_save_by_its_step(tmp_path: Path) -> None:
    model, _, step = _parts()
    train_step = step(lambda x: F.mse_loss(model(x), torch.zeros(len(x), 2)))
    ckpt = cudakit.Checkpointer(tmp_path, step=step, keep=3, preemption=False)
    saved = []
    for i in range(10):
        train_step(torch.randn(2, 4))
        if i % 2 == 1:
            saved.append(ckpt.save())
    ckpt.close()
    assert [p.name for p in saved] == [layout.checkpoint_name(n) for n in (2, 4, 6, 8, 10)]
    assert _dirs(tmp_path) == ["ckpt-0000000006", "ckpt-0000000008", "ckpt-0000000010"]
    manifest = layout.read_manifest(tmp_path / "ckpt-0000000010")
    assert (manifest.windows, manifest.total) == (10, 0)  # steps; no batch was shown it
    again = cudakit.Checkpointer(tmp_path, step=_parts()[2], preemption=False)
    assert again.resume().windows == 10
    again.close()


def test_an_own_loop_without_a_step_counts_its_saves(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cudakit.Checkpointer(
        tmp_path, model=model, optimizer=opt, keep=3, preemption=False
    ) as ckpt:
        paths = [ckpt.save() for _ in range(5)]
    assert [p.name for p in paths] == [layout.checkpoint_name(n) for n in range(1, 6)]
    assert _dirs(tmp_path) == [layout.checkpoint_name(n) for n in (3, 4, 5)]
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False) as ckpt:
        assert ckpt.resume().windows == 5
        assert ckpt.save() == tmp_path / layout.checkpoint_name(6)  # the count goes on


def test_batches_names_checkpoints_by_optimizer_step_not_by_batch(tmp_path: Path) -> None:
    model, _, step = _parts(accumulate=4)
    train_step = step(lambda x: F.mse_loss(model(x), torch.zeros(len(x), 2)))
    loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=2)  # 16 batches
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=2, preemption=False)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches():
            train_step(x)
    ckpt.close()
    assert _dirs(tmp_path) == ["ckpt-0000000002", "ckpt-0000000004"]  # steps 2, 4
    assert layout.read_manifest(tmp_path / "ckpt-0000000004").total == 16


@settings(max_examples=15, deadline=None)
@given(
    saves=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=6),
    keep=st.integers(min_value=1, max_value=4),
)
def test_an_own_loop_keeps_the_newest_k_of_its_distinct_saves(
    tmp_path_factory: Any, saves: list[int], keep: int
) -> None:
    """Steps between saves (0: the same position saved again); the names follow the steps,
    keep= keeps the newest k distinct ones, the newest is the last save."""
    root = tmp_path_factory.mktemp("own")
    model, _, step = _parts()
    train_step = step(lambda x: F.mse_loss(model(x), torch.zeros(len(x), 2)))
    ckpt = cudakit.Checkpointer(root, step=step, keep=keep, preemption=False)
    done, names = 0, []
    for between in saves:
        for _ in range(between):
            train_step(torch.ones(1, 4))
        done += between
        path = ckpt.save()
        assert path is not None
        assert path.name == layout.checkpoint_name(done)
        if path.name not in names:
            names.append(path.name)
    ckpt.close()
    assert _dirs(root) == sorted(names[-keep:])
    assert cudakit.find_latest(root) == root / names[-1]
