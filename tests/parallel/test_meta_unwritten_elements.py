"""No element of a model built on the meta device is left unwritten, and the check is cheap.

A tensor the dry run sees written whole (``normal_``, ``uniform_``, ``copy_``, an
``nn.init`` function... on the tensor itself or a view of all of it) is handed to the
real init as allocated: no NaN fill, no search for NaN after. Any other tensor is
filled with NaN first and searched after, so a partial write is named. A tensor the
dry run saw written whole but the real run did not is filled and written again.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from meta_gpt import GPT, gpt_init
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel import meta
from cudakit.parallel._init_watch import module_seed, seeded

Op = Callable[[torch.Tensor], object]


class Counts:
    """The tensors filled with NaN and the tensors searched for NaN, by shape."""

    def __init__(self) -> None:
        self.filled: list[tuple[int, ...]] = []
        self.searched: list[tuple[int, ...]] = []


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    got = Counts()
    poison, holes = meta._poison, meta._holes

    def counted_poison(t: torch.Tensor) -> None:
        got.filled.append(tuple(t.shape))
        poison(t)

    def counted_holes(t: torch.Tensor) -> bool:
        got.searched.append(tuple(t.shape))
        return holes(t)

    monkeypatch.setattr(meta, "_poison", counted_poison)
    monkeypatch.setattr(meta, "_holes", counted_holes)
    return got


def _linear(op: Op) -> tuple[nn.Linear, Callable[[nn.Module], None]]:
    """A meta Linear(3, 3) and an init that writes its weight with ``op``, its bias whole."""

    def init(module: nn.Module) -> None:
        assert isinstance(module, nn.Linear)
        op(module.weight)
        nn.init.zeros_(module.bias)

    with torch.device("meta"):
        return nn.Linear(3, 3), init


WHOLE: dict[str, Op] = {
    "normal_": lambda w: w.normal_(),
    "uniform_": lambda w: w.uniform_(-1, 1),
    "zero_": lambda w: w.zero_(),
    "fill_": lambda w: w.fill_(0.5),
    "copy_ of a broadcast row": lambda w: w.copy_(torch.arange(3.0, device=w.device)),
    "through .data": lambda w: w.data.normal_(),
    "a flat view": lambda w: w.view(-1).uniform_(),
    "nn.init.normal_": lambda w: nn.init.normal_(w, std=0.02),
    "nn.init.trunc_normal_": lambda w: nn.init.trunc_normal_(w, std=0.02),
    "nn.init.orthogonal_": nn.init.orthogonal_,
    "nn.init.xavier_uniform_": nn.init.xavier_uniform_,
    "nn.init.kaiming_uniform_": lambda w: nn.init.kaiming_uniform_(w, a=5**0.5),
    "nn.init.kaiming_normal_": nn.init.kaiming_normal_,
    "nn.init.eye_": nn.init.eye_,
    "nn.init.sparse_": lambda w: nn.init.sparse_(w, 0.5),
    "out=": lambda w: torch.randn(3, 3, out=w.data),
    "a whole write, then a part": lambda w: (w.normal_(), w[0].zero_()),
}


@pytest.mark.parametrize("op", WHOLE.values(), ids=WHOLE.keys())
def test_a_tensor_written_whole_is_neither_filled_nor_searched(counts: Counts, op: Op) -> None:
    model, init = _linear(op)
    cp.materialize(model, "cpu", init=init, init_seed=4)
    assert counts.filled == []
    assert counts.searched == []
    ref = nn.Linear(3, 3)
    with seeded(module_seed(4, ""), torch.device("cpu")), torch.no_grad():
        init(ref)
    assert torch.equal(model.weight, ref.weight)  # bit for bit what the init draws
    assert torch.equal(model.bias, ref.bias)


PARTIAL: dict[str, Op] = {
    "a slice's normal_": lambda w: w[:, :2].normal_(),
    "nn.init on a slice": lambda w: nn.init.normal_(w[:, :2]),
    "a row through .data": lambda w: w.data[:1].uniform_(),
    "the diagonal": lambda w: w.fill_diagonal_(0.0),
    "a flat view's head": lambda w: w.view(-1)[:3].zero_(),
    "one element": lambda w: w.__setitem__((0, 0), 1.0),
    "an op that reads first": lambda w: w.mul_(2.0),
    "a transposed row": lambda w: w.t()[0].zero_(),
}


@pytest.mark.parametrize("op", PARTIAL.values(), ids=PARTIAL.keys())
def test_a_tensor_written_in_part_is_filled_searched_and_named(counts: Counts, op: Op) -> None:
    model, init = _linear(op)
    with pytest.raises(ValueError, match=r"init=\.\.\. writes 1 tensor.*'weight \(parameter\)'"):
        cp.materialize(model, "cpu", init=init)
    assert counts.filled == [(3, 3)]  # the weight only: the bias is written whole
    assert counts.searched == [(3, 3)]


def test_a_write_whole_on_meta_but_in_part_on_the_device_is_named(counts: Counts) -> None:
    def op(w: torch.Tensor) -> None:
        if w.device.type == "meta":
            w.normal_()
        else:
            w[:1].normal_()

    model, init = _linear(op)
    with pytest.raises(ValueError, match=r"'weight \(parameter\)'"):
        cp.materialize(model, "cpu", init=init)
    assert counts.filled  # the real run found no whole write: filled, written again


@pytest.mark.parametrize("swap", ["set_", ".data ="])
def test_a_storage_swapped_after_a_whole_write_is_searched(counts: Counts, swap: str) -> None:
    def op(w: torch.Tensor) -> None:
        w.normal_()
        other = torch.full((3, 3), float("nan"), device=w.device)  # as if left unwritten
        if swap == "set_":
            w.set_(other)
        else:
            w.data = other

    model, init = _linear(op)
    with pytest.raises(ValueError, match=r"'weight \(parameter\)'"):
        cp.materialize(model, "cpu", init=init)
    assert (3, 3) in counts.searched


def test_a_gpt_is_neither_filled_nor_searched(counts: Counts) -> None:
    for init in (None, gpt_init):
        with torch.device("meta"):
            model = GPT()
        cp.materialize(model, "cpu", init=init, init_seed=2)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            assert not torch.isnan(t).any(), name
    assert counts.filled == []
    assert counts.searched == []


def test_a_hugging_face_style_init_is_neither_filled_nor_searched(counts: Counts) -> None:
    class _Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def post_init(self) -> None:
            pass

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(mean=0.0, std=0.02)
                module.bias.data.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.data.fill_(1.0)
                module.bias.data.zero_()

    with torch.device("meta"):
        model = _Model()
    cp.materialize(model, "cpu")
    assert counts.filled == []
    assert counts.searched == []
    assert torch.equal(model.norm.weight, torch.ones(4))
