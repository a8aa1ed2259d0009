"""``on_device(tensor)``: one plain tensor is moved without a walk, with the same rules
as inside a container (same object when already there, the non_blocking policy, a
forced asynchronous copy to the CPU waited for, the meta-tensor error)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cudakit.device import on_device

META = torch.device("meta")


@pytest.fixture
def to_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every Tensor.to call's keyword arguments."""
    calls: list[dict[str, Any]] = []
    real = torch.Tensor.to

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording)
    return calls


def test_a_tensor_already_there_is_the_same_object(to_calls: list[dict[str, Any]]) -> None:
    t = torch.ones(2, device="meta")
    assert on_device(t, device="meta") is t
    c = torch.ones(2)
    assert on_device(c, device="cpu") is c
    assert to_calls == []  # no Tensor.to at all


@pytest.mark.parametrize(
    ("non_blocking", "passed"), [(None, {}), (False, {}), (True, {"non_blocking": True})]
)
def test_the_copy_follows_the_non_blocking_policy(
    to_calls: list[dict[str, Any]], non_blocking: bool | None, passed: dict[str, Any]
) -> None:
    t = torch.ones(2)
    out = on_device(t, device="meta", non_blocking=non_blocking)
    assert out.device == META
    assert to_calls == [passed]
    # the same as the same tensor inside a list
    to_calls.clear()
    (inner,) = on_device([t], device="meta", non_blocking=non_blocking)
    assert inner.device == META
    assert to_calls == [passed]


@pytest.mark.cuda
def test_on_cuda_the_copy_is_asynchronous_and_a_forced_one_back_is_waited_for(
    to_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Any] = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: (synced.append(d), real_sync(d)))
    t = torch.arange(1 << 20, dtype=torch.float32)
    g = on_device(t, device="cuda")
    assert to_calls[-1] == {"non_blocking": True}  # towards the GPU: asynchronous
    back = on_device(g * 2, device="cpu", non_blocking=True)
    assert synced  # the forced asynchronous copy to the CPU was waited for
    assert torch.equal(back, t * 2)  # safe to read at once


def test_a_meta_tensor_to_the_cpu_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"cannot copy the tensor at obj from the meta device"):
        on_device(torch.ones(1, device="meta"), device="cpu")
