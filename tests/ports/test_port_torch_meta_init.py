"""What torch's meta-device init tests and Fabric's empty-init tests assert, asked of
``cudakit.parallel.parallelize`` and ``materialize``.

Ported from pytorch test/distributed/_composable/fsdp/test_fully_shard_init.py
(TestFullyShardMetaDeviceInit: even, uneven and empty shards, a bf16 mixed-precision
policy, ``fully_shard`` by hand on meta, ``to_empty`` then ``reset_parameters`` writes
every parameter and buffer, one training iteration runs; TestFullyShardManagedModules:
shared parameters, buffers and modules) and from Lightning Fabric's
tests_fabric/utilities/test_init.py and test_fabric.py (``init_module(empty_init=True)``:
nothing drawn while building, ``_materialize_meta_tensors``: each module's own
``reset_parameters``, BatchNorm's buffers, a module that lacks one refused).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from port_torch_meta import BUILDERS, MLP, SEED, Stack, build_everywhere, meta, one_process
from torch import nn

import cudakit.parallel as cp


def _assert_written(model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device == torch.device("cpu"), name
        if tensor.is_floating_point():
            assert not torch.isnan(tensor).any(), name


# --------------------------------------------------------------------------- one process


def test_reset_parameters_writes_every_parameter_and_buffer_on_the_device() -> None:
    model = cp.materialize(meta("dim8"), "cpu", init_seed=SEED)
    _assert_written(model)
    for block in model.layers:
        for linear in (block.in_proj, block.out_proj):
            bound = 1 / math.sqrt(linear.in_features)  # nn.Linear's own init
            assert linear.weight.abs().max() <= bound
            assert linear.bias.abs().max() <= bound
            assert linear.weight.std() > bound / 4  # drawn, not a constant
        assert block.buffer.std() > 0.3  # normal_(): the persistent buffer was drawn
        assert torch.equal(block.scale, torch.full((8,), 0.5))  # the non-persistent one
    assert torch.equal(model.norm.weight, torch.ones(8))
    assert torch.equal(model.norm.bias, torch.zeros(8))
    assert "layers.0.scale" not in model.state_dict()


def test_building_on_meta_draws_nothing_and_the_seed_picks_the_values() -> None:
    # Fabric's empty_init: no init runs while building; cudakit's init leaves the
    # global generator as it was too.
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = cp.parallelize(meta("dim3"), "none", device="cpu", init_seed=SEED)
    assert torch.equal(torch.get_rng_state(), before)
    again = cp.materialize(meta("dim3"), "cpu", init_seed=SEED)
    other = cp.materialize(meta("dim3"), "cpu", init_seed=SEED + 1)
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert not torch.equal(model.layers[0].in_proj.weight, other.layers[0].in_proj.weight)


def test_the_same_values_as_one_process_whatever_the_entry_point() -> None:
    ref = one_process("dim3")
    model = cp.parallelize(meta("dim3"), "none", device="cpu", init_seed=SEED)
    got = {**model.state_dict(), **dict(model.named_buffers())}
    assert got.keys() == ref.keys()
    for key in ref:
        assert torch.equal(got[key], ref[key]), key


def test_shared_parameters_buffers_and_modules_stay_shared() -> None:
    model = cp.materialize(meta("shared"), "cpu", init_seed=SEED)
    layers: Any = model.layers
    assert layers[0].in_proj.weight is layers[1].in_proj.weight
    assert layers[2].in_proj.weight is layers[1].in_proj.weight
    assert layers[1].buffer is layers[2].buffer
    assert layers[2].out_proj is layers[0].out_proj
    _assert_written(model)
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_dtype_and_frozen_parameters_are_kept() -> None:
    with torch.device("meta"):
        model = Stack(4).to(torch.bfloat16)
    model.layers[0].requires_grad_(False)
    cp.materialize(model, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.layers[0].parameters())
    assert all(p.requires_grad for p in model.layers[1].parameters())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_batchnorm_buffers_are_reset_as_fabric_expects() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
    cp.materialize(model, "cpu")
    bn: Any = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0
    assert bn.num_batches_tracked.dtype == torch.long
    model(torch.randn(5, 3)).sum().backward()


class Gated(nn.Module):
    """Holds a parameter of its own, has no reset_parameters; its child has one."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gate


def test_a_module_without_reset_parameters_is_refused_before_anything() -> None:
    # Fabric's _materialize refuses a module whose tensors nothing initialises.
    with torch.device("meta"):
        model = nn.Sequential(Gated())
    with pytest.raises(ValueError, match=r"'0\.gate \(parameter\)'") as info:
        cp.parallelize(model, "none", device="cpu")
    assert "reset_parameters()" in str(info.value)
    assert "init=" in str(info.value)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_an_init_function_covers_what_reset_parameters_does_not() -> None:
    calls: list[tuple[str, str]] = []

    def init(module: nn.Module, name: str) -> None:
        calls.append((name, type(module).__name__))
        if isinstance(module, Gated):
            nn.init.ones_(module.gate)
        elif isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.25)
            nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = nn.Sequential(Gated())
    cp.parallelize(model, "none", device="cpu", init=init)
    # Each module that holds tensors, by its name: on meta first (the dry run that
    # names what nothing writes), then for real.
    assert calls == [("0", "Gated"), ("0.fc", "Linear")] * 2
    assert torch.equal(model[0].gate, torch.ones(4))
    assert torch.equal(model[0].fc.weight, torch.full((4, 4), 0.25))

    seen: list[str] = []  # the one-argument form

    def by_module(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)

    with torch.device("meta"):
        model = nn.Sequential(Gated())
    cp.materialize(model, "cpu", init=by_module)
    assert seen == ["Gated", "Linear"] * 2
    assert all(bool(p.eq(0).all()) for p in model.parameters())


def test_a_parameter_registered_after_construction() -> None:
    with torch.device("meta"):
        model = Stack(4)
        model.extra = nn.Parameter(torch.empty(3))  # no module's reset_parameters knows it
    with pytest.raises(ValueError, match=r"'extra \(parameter\)'"):
        cp.materialize(model, "cpu")
    assert model.extra.is_meta

    def init(module: nn.Module) -> None:
        if module is model:
            nn.init.constant_(model.extra, 2.0)
        else:
            module.reset_parameters()  # type: ignore[operator]

    cp.materialize(model, "cpu", init=init)
    assert torch.equal(model.extra, torch.full((3,), 2.0))
    _assert_written(model)

    with torch.device("meta"):
        model = Stack(4)
    model.late = nn.Parameter(torch.zeros(3))  # allocated: the model is only partly on meta
    with pytest.raises(ValueError, match="only partly on the meta device"):
        cp.parallelize(model, "none", device="cpu")
    assert model.layers[0].in_proj.weight.is_meta


def test_reset_parameters_on_the_child_only_is_enough_when_the_parent_holds_nothing() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Sequential(MLP(3), nn.ReLU()), nn.Linear(3, 2))
    cp.materialize(model, "cpu")
    _assert_written(model)
    assert model(torch.randn(2, 3)).shape == (2, 2)


# --------------------------------------------------------------------------- gloo ranks


def _check_ranks(results: list[dict[str, Any]], strategy: str) -> None:
    world = len(results)
    for name in BUILDERS:
        ref = one_process(name)
        got = results[0][name]
        assert got["state"].keys() == ref.keys(), name
        for key in ref:
            assert torch.equal(got["state"][key], ref[key]), (name, key)
        for rank, res in enumerate(results):
            facts = res[name]
            assert facts["devices"] == ["cpu"], (name, rank)
            assert facts["on_meta"] == [], (name, rank)
            assert facts["step"], (name, rank)  # one iteration runs and stays finite
        held = [res[name]["held"] for res in results]
        if strategy == "fsdp":  # each rank allocated its shards only; they add up
            assert sum(held) == got["total"], (name, held)
        else:
            assert held == [got["total"]] * world, name
    for rank, res in enumerate(results):
        assert res["shared"]["tied"] == [True] * 4, rank
        assert res["shared_allocated"]["tied"] == [True] * 4, rank
        assert res["shared_allocated"]["step"], rank


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "world"), [("fsdp", 2), ("fsdp", 1), ("ddp", 2)])
def test_meta_models_across_ranks_equal_one_process(strategy: str, world: int) -> None:
    results = cp.launch(build_everywhere, strategy, nprocs=world, timeout=180)
    _check_ranks(results, strategy)
    if strategy == "fsdp":  # sharded by hand on meta, then materialize()
        ref = one_process("dim3")
        for rank, res in enumerate(results):
            assert res["by_hand"]["step"], rank
            assert res["by_hand"]["on_meta"] == [], rank
        for key in ref:
            assert torch.equal(results[0]["by_hand"]["state"][key], ref[key]), key
