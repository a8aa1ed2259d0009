"""A save writes each file once, makes it durable before the checkpoint is visible, reads
nothing back for plain state, and leaves a data file DCP's own reader loads."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit
from cudakit.checkpoint import _layout as layout


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _data_file(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """The data file of one save of ``model`` and ``opt`` into ``root``."""
    ckpt = cudakit.Checkpointer(root, model=model, optimizer=opt, preemption=False)
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    return (path / "__0_0.distcp").read_bytes()


def _inodes(root: Path) -> set[int]:
    return {p.stat().st_ino for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("background", [False, True])
def test_every_file_and_the_directory_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, keep=1,
                                async_save=background, preemption=False)  # fmt: skip
    synced: list[int] = []
    at_rename: list[tuple[set[int], set[int]]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        if Path(src).name.endswith(layout.PARTIAL):  # the checkpoint made visible
            at_rename.append((_inodes(Path(src)), set(synced)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for _ in range(2):
        pos = ckpt.position
        ckpt._position = cudakit.Position(0, 0, pos.total + 1, pos.windows + 1)
        ckpt.save()
        ckpt.wait()
    ckpt.close()
    assert len(at_rename) == 2
    for files, fsynced in at_rename:
        assert files <= fsynced, "a file of the checkpoint was not fsynced before its rename"
    assert tmp_path.stat().st_ino in synced  # the rename itself made durable


def test_a_save_of_plain_state_loads_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    extra = {"best": 0.5, "tags": ("a", 1), "seen": torch.ones(2)}
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False, extra=extra)
    loads: list[Any] = []
    real_load = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    path = ckpt.save()
    monkeypatch.undo()
    ckpt.close()
    assert loads == []
    assert path is not None
    host = torch.load(path / "rank-00000.pt", weights_only=True)  # and it does load safely
    assert host["extras"]["tags"] == ("value", ("a", 1))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("background", [False, True])
def test_the_data_file_is_dcps_own_and_dcp_alone_loads_it_bit_for_bit(
    tmp_path: Path, background: bool
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path / "mine", model=model, optimizer=opt,
                                async_save=background, preemption=False)  # fmt: skip
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    msd, osd = get_state_dict(model, opt)
    state = {"model": {"model": msd}, "optim": {"model": osd}}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    mine = FileSystemReader(str(path)).read_metadata()
    theirs = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert mine.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()

    def where(metadata: Any) -> dict[Any, tuple[str, int, int]]:
        return {k: (v.relative_path, v.offset, v.length) for k, v in metadata.storage_data.items()}

    assert where(mine) == where(theirs)
    size = (tmp_path / "dcp" / "__0_0.distcp").stat().st_size
    assert (path / "__0_0.distcp").stat().st_size == size

    fresh, fresh_opt = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    target = {"model": {"model": fmsd}, "optim": {"model": fosd}}
    dcp.load(target, storage_reader=FileSystemReader(str(path)), no_dist=True)
    for key, value in msd.items():
        assert torch.equal(target["model"]["model"][key], value), key
    for pid, st in osd["state"].items():
        for name, value in st.items():
            assert torch.equal(target["optim"]["model"]["state"][pid][name], value), (pid, name)


def test_a_data_file_written_in_short_writes_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    expected = _data_file(tmp_path / "whole", model, opt)
    real_writev = os.writev
    calls = []

    def short(fd: int, buffers: Any) -> int:  # at most 5 bytes a call, cut mid-piece
        calls.append(len(buffers))
        return real_writev(fd, [bytes(memoryview(buffers[0]).cast("B")[:5])])

    monkeypatch.setattr(os, "writev", short)
    written = _data_file(tmp_path / "cut", model, opt)
    assert max(calls) > 1  # several pieces were offered to one call
    assert written == expected


def test_a_large_tensor_cut_short_by_a_write_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save writes a tensor's bytes in one call, and one system call writes at most
    2 GiB: a large tensor's archive goes through a buffer that finishes what a write
    cut (here every write is cut to 1000 bytes, and every tensor is a large one)."""
    import io

    from cudakit.checkpoint import _storage as storage

    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)  # a weight of 40,000 bytes: cut into 1000-byte writes
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    monkeypatch.setattr(storage, "DIRECT", 1)
    expected = _data_file(tmp_path / "whole", model, opt)

    class Short(io.FileIO):
        def write(self, data: Any) -> int:
            return super().write(memoryview(data).cast("B")[:1000])

    monkeypatch.setattr(storage, "_raw_file", Short)
    assert _data_file(tmp_path / "cut", model, opt) == expected


def test_a_background_save_in_one_process_fsyncs_nothing_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, keep=1, async_save=True,
                                preemption=False)  # fmt: skip
    threads: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for _ in range(3):
        pos = ckpt.position
        ckpt._position = cudakit.Position(0, 0, pos.total + 1, pos.windows + 1)
        ckpt.save()
    ckpt.wait()
    ckpt.close()
    assert len(threads) == 3 * 6  # each file, the directory, its rename: all made durable
    assert threading.main_thread().name not in threads
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-0000000003"]


@pytest.mark.parametrize("on_a_gpu", [False, True])
def test_a_small_background_save_makes_its_bytes_on_the_loop_and_only_writes_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_a_gpu: bool
) -> None:
    """A thread running Python beside the loop slows the loop's own Python: for a small
    state the thread only writes, fsyncs and renames (calls that release the GIL). Also
    for a state on a device: what is written is its copy in host memory."""
    from cudakit.checkpoint import _archive as archive
    from cudakit.checkpoint import _storage as storage

    if on_a_gpu:  # (pretend: a machine with a GPU, and the state on it)
        monkeypatch.setattr(storage, "_gpu_like", lambda: True)
        monkeypatch.setattr("cudakit.checkpoint._writer._on_host", lambda tree: False)
    model, opt = _model()
    made: list[str] = []
    written: list[str] = []
    real_pieces, real_writev = archive.Archives.pieces, os.writev

    def pieces(self: Any, tensor: torch.Tensor) -> Any:
        made.append(threading.current_thread().name)
        return real_pieces(self, tensor)

    def writev(fd: int, buffers: Any) -> int:
        written.append(threading.current_thread().name)
        return real_writev(fd, buffers)

    removed: list[str] = []
    real_rmtree = layout.shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        removed.append(threading.current_thread().name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(archive.Archives, "pieces", pieces)
    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(layout.shutil, "rmtree", rmtree)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, async_save=True,
                                keep=1, preemption=False)  # fmt: skip
    for _ in range(3):
        ckpt.maybe_save()  # one batch further: a new checkpoint
        ckpt.save()
    ckpt.wait()
    ckpt.close()
    loop = threading.main_thread().name
    assert made
    assert set(made) == {loop}
    assert written
    assert loop not in written
    assert len(removed) == 2  # (keep=1 let two go)
    assert loop not in removed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-0000000003"]


def test_a_background_save_writes_the_bytes_of_a_synchronous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also for tensors a synchronous save streams straight into the file."""
    from cudakit.checkpoint import _storage as storage

    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    monkeypatch.setattr(storage, "DIRECT", 1)
    expected = _data_file(tmp_path / "sync", model, opt)
    ckpt = cudakit.Checkpointer(tmp_path / "async", model=model, optimizer=opt,
                                async_save=True, preemption=False)  # fmt: skip
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    assert (path / "__0_0.distcp").read_bytes() == expected


@pytest.mark.parametrize("on_a_gpu", [False, True])
def test_dcp_writes_itself_only_where_it_overlaps_device_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_a_gpu: bool
) -> None:
    """Host tensors are written in one pass also on a machine with a GPU; tensors on a
    device are left to DCP's own writer, which overlaps their copies with its writes."""
    from cudakit.checkpoint import _storage as storage

    monkeypatch.setattr(storage, "_gpu_like", lambda: True)
    calls: list[Path] = []
    real = storage._write_file

    def spy(path: Path, *args: Any) -> Any:
        calls.append(path)
        return real(path, *args)

    monkeypatch.setattr(storage, "_write_file", spy)
    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    if on_a_gpu:  # (pretend: the state is on a device)
        monkeypatch.setattr("cudakit.checkpoint._writer._on_host", lambda tree: False)
    path = ckpt.save()
    ckpt.close()
    assert len(calls) == (0 if on_a_gpu else 1)
    assert path is not None
    again, again_opt = _model()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    fresh = cudakit.Checkpointer(tmp_path, model=again, optimizer=again_opt, preemption=False)
    fresh.resume()
    fresh.close()
    pairs = zip(again.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
