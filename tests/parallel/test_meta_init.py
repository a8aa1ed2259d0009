"""materialize(): a model built on the meta device, allocated and initialised on one process."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from meta_gpt import GPT, gpt_init
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel._init_watch import module_seed, seeded


def _meta_gpt(**kw: int) -> GPT:
    with torch.device("meta"):
        return GPT(**kw)


def hand_written(model: nn.Module, init: Any, seed: int) -> None:
    """The loop materialize() must equal: every module that holds tensors, seeded by its
    name, initialised; a tensor tied to an earlier module's is written to a dropped copy."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        tables = [module._parameters, module._buffers]
        own = [(t, k) for t in tables for k, v in t.items() if v is not None]
        if not own:
            continue
        kept = []
        for table, key in own:
            tensor = table[key]
            if id(tensor) in seen:
                kept.append((table, key, tensor))
                table[key] = nn.Parameter(torch.empty_like(tensor))
            seen.add(id(tensor))
        with seeded(module_seed(seed, name), torch.device("cpu")), torch.no_grad():
            if init is None:
                module.reset_parameters()  # type: ignore[operator]
            else:
                init(module, name)
        for table, key, tensor in kept:
            table[key] = tensor


def _reference(init: object, seed: int, **kw: int) -> GPT:
    model = GPT(**kw)
    hand_written(model, init, seed)
    return model


@pytest.mark.parametrize("init", [None, gpt_init])
def test_matches_the_hand_written_loop_bit_for_bit(init: object) -> None:
    model = cp.materialize(_meta_gpt(), "cpu", init=init, init_seed=3)  # type: ignore[arg-type]
    ref = _reference(init, 3)
    for (k, a), (_, b) in zip(
        model.state_dict(keep_vars=True).items(), ref.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    assert torch.equal(model.rope.inv_freq, ref.rope.inv_freq)  # non-persistent


class _NanoGPTInit(GPT):
    """nanoGPT's _init_weights(module), in no Hugging Face model: Linear and Embedding
    only, its LayerNorms keep torch's."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class _ArglessInit(GPT):
    """An _init_weights(self) that walks the model itself, as much hand-written code has."""

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)


@pytest.mark.parametrize("cls", [_NanoGPTInit, _ArglessInit])
def test_an_init_weights_outside_hugging_face_leaves_reset_parameters(cls: type[GPT]) -> None:
    with torch.device("meta"):
        meta = cls()
    model = cp.materialize(meta, "cpu", init_seed=3)
    ref = cls()
    hand_written(ref, None, 3)
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_tied_weights_stay_one_tensor_and_nothing_is_nan() -> None:
    model = cp.materialize(_meta_gpt(), "cpu", init=gpt_init)
    assert model.head.weight is model.embed.weight
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert not t.is_meta, name
        assert not torch.isnan(t).any(), name
    steps = torch.arange(0, 10, 2, dtype=torch.float32)
    assert torch.equal(model.rope.inv_freq, 1.0 / (10000.0 ** (steps / 10)))
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()  # trains


def test_the_seed_picks_the_values_and_the_global_generator_is_left_alone() -> None:
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    a = cp.materialize(_meta_gpt(), "cpu", init_seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = cp.materialize(_meta_gpt(), "cpu", init_seed=1)
    c = cp.materialize(_meta_gpt(), "cpu", init_seed=2)
    assert torch.equal(a.embed.weight, b.embed.weight)
    assert not torch.equal(a.embed.weight, c.embed.weight)


class _Bare(nn.Module):
    """A module with a parameter and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))


def test_tensors_nothing_initialises_are_named_before_anything_is_allocated() -> None:
    with torch.device("meta"):
        model = _Bare()
    with pytest.raises(ValueError, match=r"no reset_parameters\(\)") as err:
        cp.materialize(model, "cpu")
    text = str(err.value)
    assert "'scale (parameter)'" in text
    assert "'mask (buffer)'" in text
    assert "lin.weight" not in text
    assert "inv_freq" in text
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing allocated


def test_an_init_that_skips_a_tensor_is_named_too() -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)  # the bias is forgotten

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"init=\.\.\. writes 1 tensor.*'0\.bias \(parameter\)'"):
        cp.materialize(model, "cpu", init=init)
    assert model[0].weight.is_meta


def test_writes_through_data_trunc_normal_and_assignment_count() -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_()  # Hugging Face's style
            nn.init.trunc_normal_(module.bias)  # returns at once on meta
        elif isinstance(module, _Bare):
            module.scale = nn.Parameter(torch.full((3,), 2.0, device=module.scale.device))
            module.mask.fill_(True)

    with torch.device("meta"):
        model = _Bare()
    scale = model.scale
    cp.materialize(model, "cpu", init=init)
    assert model.scale is not scale  # to_empty made the object; the values were copied in
    assert torch.equal(model.scale, torch.full((3,), 2.0))
    assert not torch.isnan(model.lin.weight).any()
    assert bool(model.mask.all())


def test_a_row_left_unwritten_is_named() -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight[0].zero_()  # only the first row
            nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'0\.weight \(parameter\)'"):
        cp.materialize(model, "cpu", init=init)


def test_an_init_that_leaves_a_tensor_on_meta_is_refused() -> None:
    def init(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.zeros(2, 2, device="meta"))
        module.bias = nn.Parameter(torch.zeros(2, device=module.bias.device))

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"left 1 tensor.*on the meta device: 'weight"):
        cp.materialize(model, "cpu", init=init)


def test_an_init_that_changes_a_shape_is_refused() -> None:
    def init(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.zeros(3, 3, device=module.weight.device))
        nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"replaced 'weight' with a tensor of shape \(3, 3\)"):
        cp.materialize(model, "cpu", init=init)


def test_a_model_partly_on_meta_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        model.append(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"only partly on the meta device: '1\.weight'"):
        cp.materialize(model, "cpu")
    with pytest.raises(ValueError, match="no tensor on the meta device"):
        cp.materialize(nn.Linear(2, 2), "cpu")


def test_bad_arguments() -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"materialize\(init=\.\.\.\) expects a callable"):
        cp.materialize(model, "cpu", init="normal")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"materialize\(init_seed=\.\.\.\) expects an int"):
        cp.materialize(model, "cpu", init_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"init_seed=\.\.\.\) expects an int >= 0"):
        cp.materialize(model, "cpu", init_seed=-1)
    with pytest.raises(TypeError, match=r"materialize\(model=\.\.\.\) expects an nn.Module"):
        cp.materialize("model", "cpu")  # type: ignore[arg-type]
    assert model.weight.is_meta


def test_a_whole_model_init_is_refused_before_anything() -> None:
    # torchtitan's model.init_weights(buffer_device=None), an argless _init_weights(self),
    # a reset_parameters: each initialises its own module, not the one it is handed.
    for cls, name in ((_ArglessInit, "_init_weights"), (GPT, "reset_parameters")):
        with torch.device("meta"):
            model = cls()
        init = model._init_weights if name == "_init_weights" else model.norm.reset_parameters
        owner = type(init.__self__).__name__  # type: ignore[union-attr]
        method = init.__name__  # type: ignore[union-attr]
        with pytest.raises(TypeError, match=r"^materialize\(init=\.\.\.\) expects a callable") as e:
            cp.materialize(model, "cpu", init=init)
        assert f"{owner}.{method}() takes no module" in str(e.value)
        assert "one module at a time" in str(e.value)
        assert all(t.is_meta for t in model.parameters())
    with torch.device("meta"):  # a method that takes the module is an init like any other
        owner = _Owner()
    cp.materialize(owner, "cpu", init=owner.init_module)
    assert torch.equal(owner.fc.weight, torch.zeros(2, 2))


class _Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)


def test_seeds_differ_by_name_and_seed() -> None:
    seeds = {module_seed(s, n) for s in range(3) for n in ("", "a", "a.b", "b")}
    assert len(seeds) == 12
    assert all(0 <= s < 2**63 for s in seeds)
    assert math.isfinite(float(module_seed(0, "x")))


# --------------------------------------------------------------------------- random models

_LEAVES = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 5), st.integers(1, 5), st.booleans()),
    st.tuples(st.just("norm"), st.integers(1, 5)),
    st.tuples(st.just("embed"), st.integers(1, 5), st.integers(1, 5)),
)
_TREES = st.recursive(_LEAVES, lambda kids: st.lists(kids, min_size=1, max_size=3), max_leaves=8)


def _build(spec: Any) -> nn.Module:
    if isinstance(spec, list):
        return nn.Sequential(*(_build(s) for s in spec))
    if spec[0] == "linear":
        return nn.Linear(spec[1], spec[2], bias=spec[3])
    if spec[0] == "norm":
        return nn.LayerNorm(spec[1])
    return nn.Embedding(spec[1], spec[2])


def _tie_some(model: nn.Module, pick: int) -> None:
    """Tie the weights of two leaves of the same shape, if there are any."""
    leaves = [m for m in model.modules() if getattr(m, "weight", None) is not None]
    pairs = [
        (a, b)
        for i, a in enumerate(leaves)
        for b in leaves[i + 1 :]
        if a.weight.shape == b.weight.shape and type(a) is type(b)
    ]
    if pairs:
        a, b = pairs[pick % len(pairs)]
        b.weight = a.weight


@settings(deadline=None, max_examples=30)
@given(spec=_TREES, seed=st.integers(0, 2**31), tie=st.integers(0, 9))
def test_any_model_equals_the_hand_written_loop(spec: Any, seed: int, tie: int) -> None:
    """Over random module trees (tied weights included): materialize() gives what
    seeding each module by its name and calling reset_parameters() gives."""
    with torch.device("meta"):
        model = _build(spec if isinstance(spec, list) else [spec])
        _tie_some(model, tie)
    ref = _build(spec if isinstance(spec, list) else [spec])
    _tie_some(ref, tie)
    hand_written(ref, None, seed)
    cp.materialize(model, "cpu", init_seed=seed)
    got = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(got[key], value), key
    tied = {id(p) for p in model.parameters()}
    assert len(tied) == len({id(p) for p in ref.parameters()})


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)


class _HFStyle(nn.Module):
    """Hugging Face's shape: one _init_weights(module) for every module, and a parent
    (the attention, holding no tensor) that rescales its child's weight."""

    def __init__(self, gain: bool = False) -> None:
        super().__init__()
        self.attn = _Attn()
        self.norm = nn.LayerNorm(4)
        if gain:
            self.gain = nn.Parameter(torch.ones(4))

    def post_init(self) -> None:  # transformers' PreTrainedModel has both
        pass

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, _Attn):
            nn.init.normal_(module.proj.weight, std=0.001)


def test_a_model_with_init_weights_is_initialised_by_it_children_first() -> None:
    with torch.device("meta"):
        model = _HFStyle()
    model = cp.materialize(model, "cpu", init_seed=3)
    ref = _HFStyle()
    with torch.no_grad():  # children before parents, each under its own seed
        for name in ["attn.qkv", "attn.proj", "attn", "norm", ""]:
            with seeded(module_seed(3, name), torch.device("cpu")):
                ref._init_weights(ref.get_submodule(name))
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert model.attn.proj.weight.std() < 0.01  # the parent's rescale came last


def test_tensors_init_weights_leaves_are_named() -> None:
    with torch.device("meta"):
        model = _HFStyle(gain=True)
    with pytest.raises(
        ValueError,
        match=r"_HFStyle\._init_weights\(\) writes none of 1 .*'gain.*Write them in _init_weights",
    ):
        cp.materialize(model, "cpu")
    assert model.gain.is_meta
