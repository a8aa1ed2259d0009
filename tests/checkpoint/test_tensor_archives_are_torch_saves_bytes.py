"""Each small tensor's archive in a data file is the bytes ``torch.save`` writes for it,
made from a template of its kind instead of pickling it again."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudakit.checkpoint import _archive as archive

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


class Tagged(torch.Tensor):
    pass


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _archive(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    archive.save(tensor, buffer)
    return buffer.getvalue()


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 16,), generator=gen)
    tensor = torch.empty(shape, dtype=dtype)
    tensor.view(-1).view(torch.uint8).copy_(raw[: tensor.nbytes].to(torch.uint8))
    return tensor


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    transpose=st.booleans(),
    view=st.booleans(),
    seeds=st.lists(st.integers(0, 2**31), min_size=2, max_size=3),
)
def test_every_archive_is_the_bytes_torch_save_writes(
    dtype: torch.dtype, shape: tuple[int, ...], transpose: bool, view: bool, seeds: list[int]
) -> None:
    archive.forget()
    for seed in seeds:  # the first is the template; the others are made from it
        tensor = _random(dtype, shape, seed)
        if transpose and tensor.dim() >= 2:
            tensor = tensor.transpose(0, -1)
        if view and tensor.dim() >= 1 and tensor.shape[0] > 1:
            tensor = tensor[1:]  # a view of a larger storage
        assert _archive(tensor) == _torch_save(tensor)
        loaded = torch.load(io.BytesIO(_archive(tensor)), weights_only=True)
        assert loaded.dtype == tensor.dtype
        assert loaded.stride() == tensor.stride()
        assert loaded.storage_offset() == tensor.storage_offset()
        assert bytes(loaded.untyped_storage()) == bytes(tensor.untyped_storage())


def test_an_archive_is_made_from_the_template_without_torch_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive.forget()
    first = _random(torch.float32, (3, 4), 1)
    _archive(first)  # the template, by torch.save
    second = _random(torch.float32, (3, 4), 2)
    expected = _torch_save(second)
    calls: list[object] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert _archive(second) == expected
    assert calls == []


def test_what_is_not_a_plain_host_tensor_goes_through_torch_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensor = torch.arange(4.0)
    odd = [
        torch.arange(4.0).as_subclass(Tagged),
        torch.arange(4.0, requires_grad=True),
        torch.complex(tensor, tensor).conj(),
    ]
    archive.forget()
    calls: list[object] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(a) or real(*a, **k))
    for value in odd:
        calls.clear()
        for _ in range(2):
            _archive(value)
        assert len(calls) == 2, value
        assert _archive(value) == _torch_save(value)


def test_a_torch_whose_archives_the_template_cannot_reproduce_keeps_torch_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive.forget()
    real = torch.save

    def other_format(obj: torch.Tensor, f: io.BytesIO, *args: object, **kwargs: object) -> None:
        own = io.BytesIO()
        real(obj, own, *args, **kwargs)  # and a trailer that depends on the data
        f.write(own.getvalue() + hashlib.sha256(own.getvalue()).digest())

    monkeypatch.setattr(torch, "save", other_format)
    for seed in range(3):
        tensor = _random(torch.float32, (2, 3), seed)
        expected = io.BytesIO()
        other_format(tensor, expected)
        assert _archive(tensor) == expected.getvalue()
