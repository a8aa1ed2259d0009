"""Complete or absent: the manifest written last, keep=k, finding the latest, faults on disk."""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit
from cudakit.checkpoint import _layout as layout

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import Crash, run, same_state


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt-"))


def test_every_saves_at_window_ends_and_keep_removes_the_oldest(tmp_path: Path) -> None:
    run(tmp_path, accumulate=2, every=2, keep=2)
    # 20 batches, windows of 2: a save every 2 windows (4 batches); the last two kept,
    # named by optimizer step (the last is the epochs' end, step 10).
    assert _dirs(tmp_path) == ["ckpt-0000000008", "ckpt-0000000010"]
    manifest = layout.read_manifest(tmp_path / "ckpt-0000000010")
    assert (manifest.epoch, manifest.batch, manifest.total, manifest.windows) == (2, 0, 20, 10)
    assert {".metadata", "rank-00000.pt"} <= set(manifest.files)


def test_keep_never_removes_the_checkpoint_a_run_resumed_from_before_a_newer_one(
    tmp_path: Path,
) -> None:
    with pytest.raises(Crash):
        run(tmp_path, accumulate=1, every=5, keep=1, crash_at=8)
    assert _dirs(tmp_path) == ["ckpt-0000000005"]
    resumed = run(tmp_path, accumulate=1, every=5, keep=1)
    assert resumed["ckpt"].resumed_from == tmp_path / "ckpt-0000000005"
    assert _dirs(tmp_path) == ["ckpt-0000000020"]


def test_to_remove_protects_the_newest_and_the_resumed_one() -> None:
    paths = [Path(f"c{i}") for i in range(5)]
    assert layout.to_remove(paths, 2, []) == paths[:3]
    assert layout.to_remove(paths, 2, [paths[0]]) == paths[1:3]
    assert layout.to_remove(paths, 1, []) == paths[:4]
    assert layout.to_remove(paths, None, []) == []
    assert layout.to_remove(paths[:1], 1, []) == []


def test_latest_skips_incomplete_and_corrupted_checkpoints_naming_them(tmp_path: Path) -> None:
    run(tmp_path, accumulate=1, every=5)  # ckpt-5, 10, 15, 20
    # A save a crash interrupted (no manifest yet), a truncated file, a missing one.
    (tmp_path / "ckpt-0000000020" / layout.MANIFEST).unlink()
    data = next(p for p in (tmp_path / "ckpt-0000000015").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:10])
    (tmp_path / "ckpt-0000000010" / "rank-00000.pt").unlink()
    with pytest.warns(UserWarning, match="skipping checkpoint") as caught:
        latest = cudakit.find_latest(tmp_path)
    assert latest == tmp_path / "ckpt-0000000005"
    text = " ".join(str(w.message) for w in caught)
    assert "ckpt-0000000020" in text
    assert "no cudakit.json" in text
    assert "ckpt-0000000015" in text
    assert "truncated" in text
    assert "ckpt-0000000010" in text
    assert "rank-00000.pt is missing" in text


def test_resume_skips_a_partial_save_and_removes_it(tmp_path: Path) -> None:
    run(tmp_path, accumulate=1, every=10)
    partial = tmp_path / ("ckpt-0000000030" + layout.PARTIAL)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    again = run(tmp_path, accumulate=1, every=10, epochs=2)
    assert again["ckpt"].resumed_from == tmp_path / "ckpt-0000000020"
    assert not partial.exists()


def test_loading_a_truncated_checkpoint_is_a_clear_error_and_changes_nothing(
    tmp_path: Path,
) -> None:
    run(tmp_path, accumulate=1, every=20)
    target = tmp_path / "ckpt-0000000020"
    data = next(p for p in target.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:-7])
    model = torch.nn.Linear(6, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = cudakit.Checkpointer(tmp_path / "other", model=model, preemption=False)
    with pytest.raises(cudakit.CheckpointError, match=r"corrupted: __0_0\.distcp has \d+ bytes"):
        ckpt.load(target)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def _fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import filesystem

    from cudakit.checkpoint import _storage as storage

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)  # where DCP writes itself
    monkeypatch.setattr(storage, "_write_file", full)  # where cudakit writes DCP's files


def test_a_disk_that_fills_up_mid_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run(tmp_path, accumulate=1, every=20, epochs=1)  # ckpt-10 complete
    model, _opt = first["model"], first["opt"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = cudakit.Checkpointer(tmp_path, step=first["step"], preemption=False)
    ckpt.resume()
    ckpt._position = cudakit.Position(1, 0, 11, 10)  # pretend a batch ran (step 11)
    _fill_disk(monkeypatch)
    with pytest.raises(cudakit.CheckpointSaveError, match="No space left on device") as info:
        ckpt.save()
    message = str(info.value)
    assert "ckpt-0000000011" in message
    assert "ckpt-0000000010 is intact" in message
    assert isinstance(info.value, OSError)
    assert not (tmp_path / "ckpt-0000000011.partial").exists()
    assert not (tmp_path / "ckpt-0000000011").exists()
    assert cudakit.find_latest(tmp_path) == tmp_path / "ckpt-0000000010"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def test_an_unwritable_directory_is_refused_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(cudakit.CheckpointSaveError, match=r"directory cannot be written"):
        cudakit.Checkpointer(blocker / "ckpts", model=torch.nn.Linear(1, 1))


def test_the_async_save_stages_a_copy_and_finishes_on_wait(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = cudakit.Checkpointer(
        tmp_path, model=model, optimizer=opt, async_save=True, preemption=False
    )
    path = ckpt.save()
    with torch.no_grad():
        model.weight.add_(1.0)  # the loop goes on while the save is written
    assert ckpt.wait() == path
    assert cudakit.find_latest(tmp_path) == path
    ckpt.close()
    fresh = torch.nn.Linear(4, 3)
    other = cudakit.Checkpointer(
        tmp_path, model=fresh, optimizer=torch.optim.Adam(fresh.parameters()), preemption=False
    )
    other.resume()
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    other.close()


@pytest.mark.parametrize("whole_first", [True, False], ids=["copied-whole", "tensor-by-tensor"])
def test_a_background_run_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_first: bool
) -> None:
    from cudakit.checkpoint import _writer as writer

    # A small state is copied whole before the thread writes; a large one tensor by tensor.
    monkeypatch.setattr(writer, "COPY_FIRST", 1 << 40 if whole_first else -1)
    ref = run(None, accumulate=2)
    with pytest.raises(Crash):
        run(tmp_path, accumulate=2, every=1, async_save=True, crash_at=13)
    resumed = run(tmp_path, accumulate=2, every=1, async_save=True, noise=7)
    assert same_state(resumed, ref)


def test_a_background_save_left_running_by_a_crash_in_this_process_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Checkpointer that raised without close() leaves its background save running; a
    new one in the same process waits for it before it cleans up and writes the same
    step again (a crashed process would have taken the thread along)."""
    import time

    from cudakit.checkpoint import _writer as writer

    slow = writer.Writer._publish  # (on the writing thread, after the files)

    def slowly(self: Any, pending: Any) -> None:
        time.sleep(0.3)  # still writing when the next run starts
        slow(self, pending)

    monkeypatch.setattr(writer.Writer, "_publish", slowly)
    ref = run(None, accumulate=1)
    with pytest.raises(Crash):
        run(tmp_path, accumulate=1, every=3, async_save=True, crash_at=8)
    resumed = run(tmp_path, accumulate=1, every=3, async_save=True, noise=3)
    assert same_state(resumed, ref)


def _raise_interrupt(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    raise KeyboardInterrupt


@pytest.mark.parametrize("whole_first", [True, False], ids=["copied-whole", "tensor-by-tensor"])
def test_a_background_save_whose_copy_fails_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_first: bool
) -> None:
    """The copy into host buffers fails (here: interrupted): the writing thread has
    finished (or never started) before the partial checkpoint is removed, and nothing
    is visible."""
    from cudakit.checkpoint import _writer as writer

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    ckpt = cudakit.Checkpointer(
        tmp_path, model=model, optimizer=opt, async_save=True, preemption=False
    )

    class Interrupting(torch.Tensor):
        pass

    def interrupted(copies: Any, events: Any) -> None:
        for done in events:
            done.set()
        raise KeyboardInterrupt

    real_staged = writer._staged

    def staged_to_interrupt(tree: Any, cache: Any) -> Any:
        staged, copies = real_staged(tree, cache)
        bad = torch.empty(0).as_subclass(Interrupting)  # copy_ from it: interrupted
        return staged, [*copies, (bad, torch.empty(0))]

    if whole_first:
        monkeypatch.setattr(writer, "COPY_FIRST", 1 << 40)
        monkeypatch.setattr(writer, "_staged", staged_to_interrupt)
        monkeypatch.setattr(
            Interrupting, "__torch_function__", classmethod(_raise_interrupt), raising=False
        )
    else:
        monkeypatch.setattr(writer, "COPY_FIRST", -1)
        monkeypatch.setattr(writer, "_copy_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save()
    monkeypatch.undo()
    writer.drain_background()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")] == []
    assert ckpt.save() is not None
    ckpt.close()
    assert cudakit.find_latest(tmp_path) is not None


@pytest.mark.parametrize("whole_first", [True, False], ids=["copied-whole", "tensor-by-tensor"])
def test_a_new_checkpointer_finishes_a_background_save_left_running_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_first: bool
) -> None:
    """A Checkpointer abandoned (no close()) with its background save still writing: a
    new one in the same process lets that save finish before it looks at the directory,
    so it resumes from it, and nothing half-written is left."""
    import time

    from cudakit.checkpoint import _writer as writer

    monkeypatch.setattr(writer, "COPY_FIRST", 1 << 40 if whole_first else -1)
    slow = writer.Writer._publish  # (on the writing thread, after the files)

    def slowly(self: Any, pending: Any) -> None:
        time.sleep(0.3)  # still writing when the next Checkpointer starts
        slow(self, pending)

    monkeypatch.setattr(writer.Writer, "_publish", slowly)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    left = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, async_save=True,
                                preemption=False)  # fmt: skip
    left.resume()
    left.maybe_save()  # one batch: the save below is of position 1
    left.save()  # in flight, and never closed
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    again = cudakit.Checkpointer(tmp_path, model=fresh, optimizer=fresh_opt, preemption=False)
    assert again.resume().total == 1
    again.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-0000000001"]
    left.close()
