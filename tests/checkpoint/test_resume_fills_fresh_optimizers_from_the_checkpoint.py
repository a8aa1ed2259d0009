"""A resume gives optimizers without state the checkpoint's state, without stepping them.

DCP's ``get_state_dict`` makes a fresh optimizer's state by stepping it once with zero
gradients (on a large model, more than the load costs); the resume instead lays out
the state the checkpoint holds, in empty tensors the load fills, nested values (LBFGS's
history lists) too. Where it cannot tell that state safely (state under other names,
sharded parameters) DCP's way is kept, and an optimizer DCP cannot step that way is
refused with everything left as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cudakit


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.spare = nn.Linear(2, 2)  # in the optimizer, never given a gradient: no state
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model[2](model[1](model[0](x))).square().mean().backward()
        opt.step()


def _saved(tmp_path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    path = ckpt.save()
    ckpt.close()
    assert path is not None
    return path


def _same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, st in sa["state"].items():
        assert st.keys() == sb["state"][pid].keys()
        for key, value in st.items():
            other = sb["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other)
                assert value.dtype == other.dtype
            else:
                assert value == other


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-momentum", "adagrad"],
)
def test_a_fresh_optimizer_takes_the_saved_state_without_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, 3)
    _saved(tmp_path, model, opt)

    fresh_model = _model()
    fresh = make(fresh_model.parameters())
    steps: list[int] = []
    real_step = fresh.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(fresh, "step", counted)
    again = cudakit.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh, preemption=False, file=None
    )
    again.resume()
    again.close()
    assert steps == []  # not stepped to make its state
    _same_optimizer(fresh, opt)
    for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    # and it trains on as the original does, bit for bit
    monkeypatch.undo()
    _train(model, opt, 2)
    _train(fresh_model, fresh, 2)
    for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


class _Nested(torch.optim.Optimizer):
    """An optimizer whose per-parameter state holds a list (flattened deeper by DCP)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["pair"] = [torch.zeros_like(p), torch.zeros_like(p)]
                state["pair"][0].add_(p.grad)
                state["pair"][1].add_(p.grad.square())
                p.sub_(group["lr"] * state["pair"][0])


def test_nested_state_is_laid_out_without_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    opt = _Nested(model.parameters())
    _train(model, opt, 2)
    _saved(tmp_path, model, opt)
    fresh_model = _model()
    fresh = _Nested(fresh_model.parameters())
    steps: list[int] = []
    monkeypatch.setattr(fresh, "step", lambda *a, **k: steps.append(1))
    again = cudakit.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh, preemption=False, file=None
    )
    again.resume()
    again.close()
    assert steps == []
    for p, q in zip(fresh.param_groups[0]["params"], opt.param_groups[0]["params"], strict=True):
        assert fresh.state.get(p, {}).keys() == opt.state.get(q, {}).keys()
        if opt.state.get(q):
            for a, b in zip(fresh.state[p]["pair"], opt.state[q]["pair"], strict=True):
                assert torch.equal(a, b)


def _lbfgs(params: Any) -> torch.optim.LBFGS:
    # one iteration a step here: after two steps the history holds one direction of
    # three, and ``al`` a tensor and two Nones; after four it is full
    return torch.optim.LBFGS(params, lr=0.5, max_iter=2, history_size=3)


def _train_closure(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model[2](model[1](model[0](x))).square().mean()
            loss.backward()
            return loss

        opt.step(closure)


def _same_nested(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
        assert a.dtype == b.dtype
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same_nested(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_nested(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "trained", [1, 2, 4], ids=["history-empty", "history-partial", "history-full"]
)
def test_a_fresh_lbfgs_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: int
) -> None:
    """A restarted run's new LBFGS, whose step needs a closure, takes its history from
    the checkpoint (not from a step with zero gradients), and steps on as the run that
    never stopped."""
    model = _model()
    opt = _lbfgs(model.parameters())
    _train_closure(model, opt, trained)
    _saved(tmp_path, model, opt)

    fresh_model = _model()
    fresh = _lbfgs(fresh_model.parameters())
    steps: list[int] = []
    monkeypatch.setattr(fresh, "step", lambda *a, **k: steps.append(1))
    again = cudakit.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh, preemption=False, file=None
    )
    again.resume()
    again.close()
    monkeypatch.undo()
    assert steps == []
    _same_nested(fresh.state_dict(), opt.state_dict())
    _train_closure(model, opt, 3)
    _train_closure(fresh_model, fresh, 3)
    for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    _same_nested(fresh.state_dict(), opt.state_dict())


def test_a_fresh_optimizer_dcp_cannot_step_is_refused_and_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the state cannot be laid out (here: as for sharded parameters), DCP makes it
    by stepping the optimizer with zero gradients and a zero learning rate; LBFGS's
    step needs a closure. The load is refused, naming the optimizer and the fix, and
    the optimizer (its learning rate, state, groups), the gradients and the model are
    as they were."""
    from cudakit.checkpoint import _state as state_module

    model = _model()
    opt = _lbfgs(model.parameters())
    _train_closure(model, opt, 2)
    path = _saved(tmp_path, model, opt)

    monkeypatch.setattr(state_module, "_saved_states", lambda *args: None)
    fresh_model = _model()
    lr = torch.tensor(0.25)  # a tensor lr: DCP swaps in another tensor for its step
    fresh = torch.optim.LBFGS(fresh_model.parameters(), lr=lr, history_size=3)
    fresh_model[0].weight.grad = torch.full_like(fresh_model[0].weight, 3.0)
    groups = [dict(g) for g in fresh.param_groups]
    weights = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    again = cudakit.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh, preemption=False, file=None
    )
    with pytest.raises(cudakit.CheckpointError) as info:
        again.load(path)
    again.close()
    text = str(info.value)
    assert text.startswith("Checkpointer.load(): optimizer 0 (LBFGS) has no state yet")
    assert "TypeError" in text  # DCP's step without a closure
    assert "Nothing was changed" in text
    assert "Step it once" in text  # the fix
    assert not fresh.state
    assert len(fresh.param_groups) == len(groups)
    for group, before in zip(fresh.param_groups, groups, strict=True):
        assert group.keys() == before.keys()
        for key, value in before.items():
            assert group[key] is value  # the same objects: the lr tensor too
    assert torch.equal(lr, torch.tensor(0.25))
    assert torch.equal(fresh_model[0].weight.grad, torch.full_like(fresh_model[0].weight, 3.0))
    for p in list(fresh_model.parameters())[1:]:
        assert p.grad is None
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, weights[key])


def test_a_failed_load_leaves_the_fresh_optimizer_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudakit.checkpoint import _reader as reader

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 2)
    path = _saved(tmp_path, model, opt)

    def refused(*args: Any) -> None:
        raise RuntimeError("an extra refused its state")  # after the tensors are in

    monkeypatch.setattr(reader, "_load_extras", refused)
    fresh_model = _model()
    before = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    fresh = torch.optim.AdamW(fresh_model.parameters())
    again = cudakit.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh, preemption=False, file=None
    )
    with pytest.raises(cudakit.CheckpointError, match="an extra refused its state"):
        again.load(path)
    again.close()
    assert not fresh.state
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, before[key])


def test_an_optimizer_with_state_must_find_all_of_it(tmp_path: Path) -> None:
    """An optimizer that has stepped (here without a gradient for the last layer) is
    not fresh: a checkpoint with state for every parameter must fill all of it, and
    cannot, so the load is refused and nothing changes."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 2)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    path = ckpt.save()
    ckpt.close()
    other = _model()
    stepped = torch.optim.AdamW(list(other[0].parameters()) + list(other[2].parameters()))
    stepped.add_param_group({"params": list(other.spare.parameters())})
    for p in other[0].parameters():
        p.grad = torch.ones_like(p)
    stepped.step()  # state for the first layer only
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in stepped.state.items()}
    again = cudakit.Checkpointer(
        tmp_path, model=other, optimizer=stepped, preemption=False, file=None
    )
    with pytest.raises(cudakit.CheckpointError):
        again.load(path)
    again.close()
    assert {id(p) for p in stepped.state} == set(before)
    for p, st in stepped.state.items():
        for key, value in st.items():
            assert torch.equal(value, before[id(p)][key])


def test_step_is_laid_out_in_host_memory() -> None:
    """``step`` stays in host memory, as a load of the saved state leaves it (a
    capturable or fused optimizer's load_state_dict moves it); the rest goes where the
    parameter is (``meta`` stands in for a GPU here)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from cudakit.checkpoint._state import _saved_states

    model = nn.Linear(2, 2, device="meta")
    opt = torch.optim.AdamW(model.parameters())

    def meta(shape: tuple[int, ...]) -> TensorStorageMetadata:
        size = torch.Size(shape)
        chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])

    entries = {}
    for name, p in model.named_parameters():
        entries[f"optim.model.state.{name}.step"] = meta(())
        entries[f"optim.model.state.{name}.exp_avg"] = meta(tuple(p.shape))
    metadata = Metadata(state_dict_metadata=entries)
    states = _saved_states(model, [opt], metadata, "optim.model.state.")
    assert states is not None
    for state in states[0].values():
        assert state["step"].device.type == "cpu"
        assert state["exp_avg"].device.type == "meta"


def test_a_stepped_optimizer_loads_its_checkpoint_with_an_unused_layer(tmp_path: Path) -> None:
    """A layer that never had a gradient has no optimizer state, in the optimizer nor in
    the checkpoint: loading it back into the run (a rollback) leaves it without, as
    ``optimizer.load_state_dict`` does, and the run goes on bit for bit."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    twin = _model()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _train(twin, twin_opt, 3)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False, file=None)
    path = ckpt.save()
    assert path is not None
    _train(model, opt, 2)  # on past the checkpoint, then back
    ckpt.load(path)
    ckpt.close()
    _same_optimizer(opt, twin_opt)
    _train(model, opt, 2)
    _train(twin, twin_opt, 2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not opt.state[model.spare.weight]


def test_state_a_stepped_optimizer_would_not_load_is_refused(tmp_path: Path) -> None:
    """The checkpoint holds state for a layer this stepped optimizer has none for (that
    layer trained before the save, not here): the load cannot give it that state, so it
    is refused, naming the layer, and nothing changes."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model.spare(torch.ones(1, 2)).sum().backward()  # this run trains the spare layer
    opt.step()
    assert opt.state[model.spare.weight]
    path = _saved(tmp_path, model, opt)

    other = _model()
    stepped = torch.optim.AdamW(other.parameters(), lr=1e-2)
    _train(other, stepped, 2)
    assert not stepped.state[other.spare.weight]
    before = {k: v.clone() for k, v in other.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in stepped.state.items()}
    again = cudakit.Checkpointer(
        tmp_path, model=other, optimizer=stepped, preemption=False, file=None
    )
    with pytest.raises(cudakit.CheckpointError, match=r"spare\.weight") as info:
        again.load(path)
    again.close()
    assert "new optimizer" in str(info.value)
    for key, value in other.state_dict().items():
        assert torch.equal(value, before[key])
    assert {id(p) for p, s in stepped.state.items() if s} == {
        i for i, s in state_before.items() if s
    }
    for p, st in stepped.state.items():
        for key, value in st.items():
            assert torch.equal(value, state_before[id(p)][key])
