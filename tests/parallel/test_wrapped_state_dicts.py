"""State dicts of wrapped models through ``cudakit.parallel``: FSDP2's keep a submodule
really called ``module`` (and load a DDP wrapper's keys), and the helpers check their
arguments, changing nothing when they refuse."""

from __future__ import annotations

import pytest
import torch
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from small_models import snapshot as _snapshot
from small_models import unchanged as _unchanged
from torch import nn

import cudakit.parallel as cp


class Holder(nn.Module):
    """A wrapper whose only child is really called ``module`` (an EMA or task wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_fsdp2_state_dict_round_trip_keeps_a_submodule_called_module(one_rank: None) -> None:
    torch.manual_seed(0)
    model = cp.parallelize(Holder(), "fsdp", timeout=30)
    sd = cp.state_dict(model)
    assert sorted(sd) == ["module.0.bias", "module.0.weight", "module.1.bias", "module.1.weight"]
    changed = {k: v + 1 for k, v in sd.items()}
    res = cp.load_state_dict(model, changed)
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    after = cp.state_dict(model)
    assert all(torch.equal(after[k], changed[k]) for k in changed)
    # A checkpoint saved through a DDP wrapper (keys "module.module.0.weight") loads too.
    res = cp.load_state_dict(model, {"module." + k: v for k, v in sd.items()})
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    assert all(torch.equal(cp.state_dict(model)[k], sd[k]) for k in sd)


def test_state_dict_helpers_check_their_arguments() -> None:
    net = nn.Linear(2, 2)
    before = _snapshot(net)
    with pytest.raises(
        TypeError, match=r"state_dict\(model=\.\.\.\) expects an nn.Module, got dict"
    ):
        cp.state_dict({})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"load_state_dict\(model=\.\.\.\) expects an nn.Module, got str"
    ):
        cp.load_state_dict("net", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_state_dict\(strict=\.\.\.\) expects True or"):
        cp.load_state_dict(net, nn.Linear(2, 2).state_dict(), strict="yes")  # type: ignore[arg-type]
    assert _unchanged(net, before)


def test_load_state_dict_errors() -> None:
    with pytest.raises(TypeError, match=r"expects a mapping .* got list.*checkpoint\['model'\]"):
        cp.load_state_dict(nn.Linear(2, 2), [])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"Missing key"):
        cp.load_state_dict(nn.Linear(2, 2), {"module.weight": torch.zeros(2, 2)})
    res = cp.load_state_dict(nn.Linear(2, 2), {"module.weight": torch.zeros(2, 2)}, strict=False)
    assert res.missing_keys == ["bias"]
