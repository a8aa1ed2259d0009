"""A save gathers the state as DCP's ``get_state_dict`` gives it, names worked out once.

``Gather`` keeps the names ``get_state_dict`` works out while the model's structure is
the same, and uses its shortcut only once it has given the same state dicts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict

from cudakit.checkpoint import _gather as gather_module
from cudakit.checkpoint._gather import Gather


def _stepped(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def _same(a: Any, b: Any) -> bool:
    return gather_module._same(a, b)


def _check(model: nn.Module, opts: list[torch.optim.Optimizer], calls: int = 3) -> Gather:
    gather = Gather()
    for _ in range(calls):
        got = gather(model, opts)
        assert _same(got, get_state_dict(model, tuple(opts)))
    return gather


class _Block(nn.Module):
    def __init__(self, width: int, buffers: bool, frozen: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        if buffers:
            self.register_buffer("kept", torch.arange(float(width)))
            self.register_buffer("scratch", torch.zeros(width), persistent=False)
        if frozen:
            self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.lin(x)))


class _Net(nn.Module):
    def __init__(self, blocks: list[tuple[bool, bool]], tied: bool, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width, bias=False)
        self.blocks = nn.ModuleList(_Block(width, b, f) for b, f in blocks)
        self.heads = nn.ModuleDict({"out": nn.Linear(width, width, bias=False)})
        if tied:
            self.heads["out"].weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.heads["out"](x)


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=0, max_size=3),
    tied=st.booleans(),
    groups=st.integers(min_value=1, max_value=3),
    kind=st.sampled_from(["adamw", "sgd"]),
    unused=st.booleans(),
)
def test_the_same_state_dicts_as_get_state_dict(
    blocks: list[tuple[bool, bool]], tied: bool, groups: int, kind: str, unused: bool
) -> None:
    torch.manual_seed(0)
    model = _Net(blocks, tied)
    if unused:
        model.spare = nn.Linear(2, 2)  # stepped by the optimizer, never given a gradient
    params = [p for p in model.parameters() if p.requires_grad]
    split = [params[i::groups] for i in range(groups)]
    param_groups = [{"params": g, "lr": 0.1 * (i + 1)} for i, g in enumerate(split) if g]
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(param_groups)
    else:
        opt = torch.optim.SGD(param_groups, momentum=0.9)
    _stepped(model, opt, torch.randn(3, 4))
    gather = _check(model, [opt])
    assert (gather.short, gather.full) == (2, 1)  # verified once, then the shortcut


def test_two_optimizers_of_one_model() -> None:
    model = _Net([(True, False)], tied=False)
    first = torch.optim.AdamW(model.embed.parameters())
    second = torch.optim.SGD(list(model.blocks.parameters()), lr=0.1, momentum=0.9)
    for opt in (first, second):
        _stepped(model, opt, torch.randn(2, 4))
    gather = _check(model, [first, second])
    assert gather.short == 2


def test_a_model_without_optimizers() -> None:
    model = _Net([(True, True)], tied=True)
    gather = _check(model, [])
    assert (gather.short, gather.full) == (2, 1)


def test_wrapped_submodules_get_dcps_names() -> None:
    model = _Net([(True, False), (False, False)], tied=False)
    model.blocks[0] = torch.compile(model.blocks[0], backend="eager")  # '_orig_mod.' keys
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert any("_orig_mod" in k for k in model.state_dict())
    gather = _check(model, [opt])
    msd, osd = gather(model, [opt])
    assert not any("_orig_mod" in k for k in [*msd, *osd["state"]])
    assert gather.short == 3


def test_a_changed_structure_is_worked_out_again() -> None:
    model = _Net([(False, False)], tied=False)
    opt = torch.optim.AdamW(model.parameters())
    _stepped(model, opt, torch.randn(2, 4))
    gather = _check(model, [opt], calls=2)
    model.heads["extra"] = nn.Linear(4, 4)  # a new module, its parameters a new group
    opt.add_param_group({"params": list(model.heads["extra"].parameters()), "lr": 0.5})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for _ in range(2):
        assert _same(gather(model, [opt]), get_state_dict(model, (opt,)))
    assert (gather.full, gather.short) == (2, 2)


def test_a_meta_tensor_is_gathered_as_get_state_dict_does() -> None:
    model = _Net([(False, False)], tied=False)
    opt = torch.optim.AdamW(model.parameters())
    _stepped(model, opt, torch.randn(2, 4))
    model.register_buffer("later", torch.empty(3, device="meta"))
    gather = _check(model, [opt])
    assert gather.short == 2


def test_an_optimizer_without_state_goes_through_get_state_dict() -> None:
    model = _Net([(False, False)], tied=False)
    opt = torch.optim.AdamW(model.parameters())
    gather = Gather()
    for p in model.parameters():
        p.grad = None
    got = gather(model, [opt])
    assert (gather.full, gather.short) == (1, 0)
    assert set(got[1]["state"]) == {n for n, _ in model.named_parameters()}


def test_a_get_state_dict_that_gives_more_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = dcp_state_dict.get_state_dict

    def more(model: nn.Module, optimizers: Any) -> Any:
        msd, osd = real(model, optimizers)
        msd["extra.key"] = torch.zeros(1)
        return msd, osd

    monkeypatch.setattr(dcp_state_dict, "get_state_dict", more)
    model = _Net([(False, False)], tied=False)
    opt = torch.optim.AdamW(model.parameters())
    _stepped(model, opt, torch.randn(2, 4))
    gather = Gather()
    for _ in range(3):
        assert "extra.key" in gather(model, [opt])[0]
    assert (gather.full, gather.short) == (3, 0)


def test_state_under_keys_it_cannot_name_goes_through_get_state_dict() -> None:
    model = _Net([(False, False)], tied=False)
    opt = torch.optim.AdamW(model.parameters())
    _stepped(model, opt, torch.randn(2, 4))
    gather = _check(model, [opt], calls=2)
    opt.state["not a parameter"] = {"x": 1}  # type: ignore[index]
    with pytest.raises(KeyError):
        get_state_dict(model, (opt,))
    with pytest.raises(KeyError):  # get_state_dict's own error
        gather(model, [opt])


def test_a_save_gathers_through_the_shortcut(tmp_path: Any) -> None:
    import cudakit

    torch.manual_seed(0)
    model = _Net([(True, True)], tied=True)
    opt = torch.optim.AdamW(model.parameters())
    _stepped(model, opt, torch.randn(2, 4))
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    for _ in range(3):
        ckpt.maybe_save()
        ckpt.save()
    assert ckpt._parts.gathers["model"].short == 2
    ckpt.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    again = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    again.resume()
    again.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key])
