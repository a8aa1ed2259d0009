"""What a load copies to host memory to put the run back should it fail.

On the CPU, a load reads the optimizers' state and the model's tensors into new
storage: the optimizers take the new tensors, the model's are copied in at the very
end, after everything that can fail, so a failed load needs no host copy of them. A
model that loads in a way of its own (a ``_load_from_state_dict`` or a load hook)
loads in place, from a host copy of its tensors should the load fail.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit
import cudakit.checkpoint._reader as reader
import cudakit.checkpoint._rollback as rollback
from cudakit.amp import autocast_step


class _OwnLoad(nn.Linear):
    """A module whose load runs code of its own (here: counting its loads)."""

    loads = 0

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        type(self).loads += 1
        super()._load_from_state_dict(*args, **kwargs)


def _run(first: Callable[[], nn.Module] = lambda: nn.Linear(8, 16)) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(first(), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    @autocast_step(opt, model=model, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), torch.zeros(len(x), 2))

    return model, opt, step


def _copied_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = rollback._to_host

    def counting(tree: Any) -> Any:
        out = real(tree)
        if isinstance(out, torch.Tensor):
            sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(rollback, "_to_host", counting)
    return sizes


def _optimizer_state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in s.items()} for s in opt.state_dict()["state"].values()]


def _same_state(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def _saved(tmp: Path, first: Callable[[], nn.Module] = lambda: nn.Linear(8, 16)) -> Any:
    model, opt, step = _run(first)
    for _ in range(2):
        step(torch.randn(4, 8))
    with cudakit.Checkpointer(tmp, step=step) as ckpt:
        path = ckpt.save()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return path, weights, _optimizer_state(opt)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh optimizer", "stepped"])
def test_a_resume_on_the_cpu_copies_nothing_to_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stepped: bool
) -> None:
    """The loaded values arrive, the parameters stay the same objects, and no tensor is
    copied for a rollback."""
    _, weights, state = _saved(tmp_path)
    model2, opt2, step2 = _run()
    if stepped:
        step2(torch.randn(4, 8))
    params = list(model2.parameters())
    sizes = _copied_bytes(monkeypatch)
    with cudakit.Checkpointer(tmp_path, step=step2) as ckpt2:
        ckpt2.resume()
    assert sizes == []
    assert all(a is b for a, b in zip(params, model2.parameters(), strict=True))
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())
    assert _same_state(state, _optimizer_state(opt2))
    assert list(opt2.state) == params  # the optimizer steps the model's own parameters


def test_a_model_that_loads_in_its_own_way_is_loaded_by_it_from_a_host_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, weights, _ = _saved(tmp_path, lambda: _OwnLoad(8, 16))
    model2, _, step2 = _run(lambda: _OwnLoad(8, 16))
    sizes = _copied_bytes(monkeypatch)
    loads = _OwnLoad.loads
    with cudakit.Checkpointer(tmp_path, step=step2) as ckpt2:
        ckpt2.resume()
    assert _OwnLoad.loads == loads + 1
    model_bytes = sum(p.numel() * p.element_size() for p in model2.parameters())
    assert sum(sizes) == model_bytes  # the model's tensors; not the optimizer's
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())


@pytest.mark.parametrize("where", ["data file", "extra", "interrupt"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh optimizer", "stepped"])
def test_a_load_that_fails_after_reading_leaves_model_and_optimizer_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, stepped: bool
) -> None:
    """Changed bytes in a data file, an extra that refuses its state, a Ctrl-C while the
    extras load: the weights, the optimizer's state (its tensors, the same objects) and
    the RNG are as they were."""
    path, _, _ = _saved(tmp_path)
    if where == "data file":
        data = sorted(path.glob("*.distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # same size, other bytes
        data.write_bytes(bytes(raw))
    else:
        error = ValueError("not mine") if where == "extra" else KeyboardInterrupt()

        def refuse(host: Any, extras: Any, loader: Any) -> None:
            raise error

        monkeypatch.setattr(reader, "_load_extras", refuse)
    model2, opt2, step2 = _run()
    if stepped:
        for _ in range(3):
            step2(torch.randn(4, 8))
    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    state = _optimizer_state(opt2)
    tensors = [v for s in opt2.state.values() for v in s.values()]
    rng = torch.get_rng_state()
    raised = KeyboardInterrupt if where == "interrupt" else cudakit.CheckpointError
    with cudakit.Checkpointer(tmp_path, step=step2) as ckpt2, pytest.raises(raised):
        ckpt2.load(path)
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())
    assert _same_state(state, _optimizer_state(opt2))
    after = [v for s in opt2.state.values() for v in s.values()]
    assert len(after) == len(tensors)
    assert all(a is b for a, b in zip(tensors, after, strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert bool(opt2.state) == stepped


def test_tied_weights_load_and_stay_tied(tmp_path: Path) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    torch.manual_seed(0)
    model, opt = build()
    model(torch.arange(10)).sum().backward()
    opt.step()
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        ckpt.save()
    torch.manual_seed(1)
    model2, opt2 = build()
    with cudakit.Checkpointer(tmp_path, model=model2, optimizer=opt2) as ckpt2:
        ckpt2.resume()
    assert model2[1].weight is model2[0].weight
    assert torch.equal(model2[0].weight, model[0].weight)
    assert _same_state(_optimizer_state(opt), _optimizer_state(opt2))
