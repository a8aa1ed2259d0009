"""A load reads each tensor's archive as ``torch.load`` does, unpickling one archive of
each layout: the others of its size are read straight into new memory, and any byte
around their storage that is not the layout's sends them back to ``torch.load``."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudakit
from cudakit.checkpoint import _unarchive as unarchive

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.empty(shape, dtype=dtype)
    raw = torch.randint(0, 256, (tensor.nbytes,), generator=gen, dtype=torch.uint8)
    tensor.view(-1).view(torch.uint8).copy_(raw) if tensor.nbytes else None
    return tensor


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _torch_load(raw: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        return type(exc)


def _ours(reader: unarchive.TensorReader, raw: bytes) -> Any:
    try:
        return reader.read(io.BytesIO(raw), len(raw))
    except Exception as exc:
        return type(exc)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.requires_grad == b.requires_grad
            and bytes(a.untyped_storage()) == bytes(b.untyped_storage())
        )
    return bool(a == b)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    shape=st.lists(st.integers(0, 6), max_size=3).map(tuple),
    seeds=st.lists(st.integers(0, 2**31), min_size=2, max_size=4),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
)
def test_every_archive_reads_as_torch_load_reads_it(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    seeds: list[int],
    flips: list[tuple[int, int]],
) -> None:
    """The first archive teaches the layout; each later one, with bytes changed anywhere
    (the storage, the pickle, the zip's records, the CRC-32s), is either read without
    torch.load as the very tensor torch.load reads, or left to torch.load itself (which
    on some broken records returns memory it never filled, so it is not compared)."""
    reader = unarchive.TensorReader()
    first = _saved(_random(dtype, shape, seeds[0]))
    assert _same(_ours(reader, first), _torch_load(first))
    for seed in seeds[1:]:
        raw = bytearray(_saved(_random(dtype, shape, seed)))
        for at, xor in flips:
            raw[at % len(raw)] ^= xor
        with _torch_load_calls() as calls:
            ours = _ours(reader, bytes(raw))
        if not calls:
            assert isinstance(ours, torch.Tensor)
            assert _same(ours, _torch_load(bytes(raw)))
        if not flips and torch.Size(shape).numel():
            assert not calls  # an archive of the layout is read without unpickling


@contextlib.contextmanager
def _torch_load_calls() -> Iterator[list[bool]]:
    calls: list[bool] = []
    real = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(False)  # (a call that raises counts too)
        out = real(*args, **kwargs)
        calls[-1] = isinstance(out, torch.Tensor)
        return out

    torch.load = counted
    try:
        yield calls
    finally:
        torch.load = real


def test_changed_crcs_and_serialization_id_are_read_without_unpickling() -> None:
    """The bytes that change with the storage (its CRC-32s, the serialization id's
    digits) may hold any CRC-32 and any id: the tensor is torch.load's."""
    reader = unarchive.TensorReader()
    first = _saved(_random(torch.float32, (3, 5), 0))
    reader.read(io.BytesIO(first), len(first))
    layout = reader._layouts[len(first)]
    assert layout is not None
    assert layout.holes
    raw = bytearray(_saved(_random(torch.float32, (3, 5), 1)))
    tail_at = len(layout.head) + layout.size
    for start, end in layout.holes:
        for at in range(tail_at + start, tail_at + end):
            raw[at] ^= 0x5A
    if layout.digits is not None:  # torch.load decodes the id: other digits
        start, end = (tail_at + at for at in layout.digits)
        raw[start:end] = b"%020d" % 12345678901234567890
    with _torch_load_calls() as calls:
        ours = reader.read(io.BytesIO(bytes(raw)), len(raw))
    assert not calls
    assert _same(ours, _torch_load(bytes(raw)))


def test_one_archive_of_each_layout_is_unpickled(tmp_path: Path) -> None:
    """A model of eight same-shaped layers loads with one torch.load for each layout
    (the weights', the biases', the step's), and loads bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ck = cudakit.Checkpointer(tmp_path / "c", model=model, optimizer=opt, preemption=False)
    ck.save()
    ck.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {
        (i, k): v.clone()
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
        if torch.is_tensor(v)
    }

    torch.manual_seed(1)
    other = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with _torch_load_calls() as calls:
        ck = cudakit.Checkpointer(
            tmp_path / "c", model=other, optimizer=other_opt, preemption=False
        )
        ck.resume()
        ck.close()
    # 64 tensors (weights and biases, two AdamW states each, the steps), three layouts;
    # (the other torch.loads read the host file and the hyper-parameters DCP pickled)
    assert sum(calls) == 3
    for key, value in other.state_dict().items():
        assert torch.equal(value, expected[key]), key
    got = {
        (i, k): v
        for i, s in enumerate(other_opt.state.values())
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    assert got.keys() == expected_opt.keys()
    for entry, value in got.items():
        assert torch.equal(value, expected_opt[entry])
        assert value.dtype == expected_opt[entry].dtype


def test_a_file_that_ends_early_is_left_to_torch_load() -> None:
    reader = unarchive.TensorReader()
    raw = _saved(torch.arange(64.0))
    reader.read(io.BytesIO(raw), len(raw))
    short = _saved(torch.arange(64.0) + 1)[:-100]
    with _torch_load_calls() as calls, pytest.raises(RuntimeError):
        reader.read(io.BytesIO(short), len(raw))
    assert calls


def test_an_archive_of_another_kind_and_the_same_size_is_unpickled() -> None:
    """(16, 4) and (4, 16) archives have one size; the second is torch.load's."""
    reader = unarchive.TensorReader()
    a = _saved(torch.arange(64.0).reshape(16, 4))
    b = _saved(torch.arange(64.0).reshape(4, 16) * 2)
    assert len(a) == len(b)
    reader.read(io.BytesIO(a), len(a))
    got = reader.read(io.BytesIO(b), len(b))
    assert got.shape == (4, 16)
    assert torch.equal(got, torch.arange(64.0).reshape(4, 16) * 2)
