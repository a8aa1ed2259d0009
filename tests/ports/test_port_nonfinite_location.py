"""find_nonfinite and autocast_step(locate_nonfinite=True) against peers' NaN hunters.

Scenarios drawn from torch's anomaly mode tests (pytorch test/test_autograd.py,
``detect_anomaly``: a custom ``autograd.Function`` whose backward returns NaN, NaN in a
forward op), torch's forward-NaN proposals (pytorch issue #182156 ``NaNGuard``: dict and
dataclass outputs, producer versus propagator, hooks left clean; issue #160016 /
PR #187653 ``NanDetectMode``: inf as well as NaN, integer outputs skipped), fairseq's
``NanDetector`` (module-name hooks, forward then backward), Lightning's
``Trainer(detect_anomaly=True)`` (a ``training_step`` that calls the submodules itself)
and ignite's / composer's ``TerminateOnNan`` (inf and NaN alike, in tuples and dicts).
Each names the first producer (phase, qualified name, class, shape, dtype) and leaves
the weights, gradients, optimizer state, buffers, hooks and every RNG bit for bit as
they were.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.checkpoint import checkpoint

import cudakit.amp.watch as amp_watch
from cudakit.amp import NonFiniteWarning, autocast_step, find_nonfinite

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _owned(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """What the user owns: weights, buffers, .grad (and their objects), optimizer state, RNG."""
    out: dict[str, Any] = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "cpu_rng": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "training": [m.training for m in model.modules()],
        "opt": [],
    }
    if opt is not None:
        out["opt"] = [
            {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for s in opt.state.values()
        ]
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any], ids: bool = True) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert _same(a["state"][k], b["state"][k]), k
    for x, y in zip(a["grads"], b["grads"], strict=True):
        assert (x is None and y is None) or (x is not None and y is not None and _same(x, y))
    if ids:
        assert a["grad_ids"] == b["grad_ids"]
    assert torch.equal(a["cpu_rng"], b["cpu_rng"])
    assert a["random"] == b["random"]
    assert np.array_equal(a["numpy"], b["numpy"])
    assert a["training"] == b["training"]
    assert len(a["opt"]) == len(b["opt"])
    for sa, sb in zip(a["opt"], b["opt"], strict=True):
        assert sa.keys() == sb.keys()
        assert all(_same(sa[k], sb[k]) for k in sa)


def _where(src: Any) -> tuple[Any, ...]:
    return (src.phase, src.name, src.module)


class Poison(nn.Module):
    """Adds ``value`` (NaN or inf) when ``bad``; else tanh."""

    def __init__(self, value: float = NAN) -> None:
        super().__init__()
        self.value = value
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.value if self.bad else torch.tanh(x)


def _mlp(poison: float = NAN) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Poison(poison), nn.Linear(8, 1))


def _xy(n: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    """One real step, so there are .grad tensors and optimizer state to keep."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _xy()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return opt


# ---------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_nan_and_inf_are_both_named(value: float) -> None:
    """TerminateOnNan / NanDetectMode(check_inf=True): an inf is a producer like a NaN."""
    model = _mlp(value)
    opt = _trained(model)
    model[1].bad = True
    before = _owned(model, opt)
    src = find_nonfinite(lambda a, b: F.mse_loss(model(a), b), *_xy())
    _assert_same(before, _owned(model, opt))
    assert src is not None
    assert _where(src) == ("forward", "1", "Poison")
    assert (src.shape, src.dtype, src.op, src.micro_batch) == ((6, 8), torch.float32, None, 0)


def test_nothing_is_found_and_nothing_changes_when_all_is_finite() -> None:
    model = _mlp()
    opt = _trained(model)
    before = _owned(model, opt)
    assert find_nonfinite(lambda a, b: F.mse_loss(model(a), b), *_xy()) is None
    _assert_same(before, _owned(model, opt))


# ---------------------------------------------------------------------- backward producers


class NanGrad(torch.autograd.Function):
    """detect_anomaly's MyFunc: identity forward, a NaN gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * NAN


class Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanGrad.apply(x)  # type: ignore[no-any-return]


def test_a_custom_function_backward_nan_is_named_with_its_node() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Custom(), nn.Tanh(), nn.Linear(8, 1))
    opt = None  # (a real step would take NaN gradients)
    before = _owned(model, opt)
    src = find_nonfinite(lambda a, b: F.mse_loss(model(a), b), *_xy())
    _assert_same(before, _owned(model, opt))
    assert src is not None
    assert _where(src) == ("backward", "1", "Custom")
    assert src.op == "NanGradBackward"
    assert (src.shape, src.dtype) == ((6, 8), torch.float32)


def test_a_backward_only_nan_in_the_loss_code_names_no_module() -> None:
    """sqrt at 0: a finite forward, an inf gradient made outside every module."""
    model = _mlp()
    src = find_nonfinite(lambda a: (model(a) * 0).sqrt().sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("backward", "", None)
    assert src.op == "SqrtBackward0"
    assert "outside any module" in str(src)


# ---------------------------------------------------------------------- attention


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out, _ = self.attn(h, h, h, key_padding_mask=mask)  # need_weights: softmax of -inf
        return out.mean(dim=1)  # type: ignore[no-any-return]


def test_a_fully_masked_attention_row_is_named_at_the_attention() -> None:
    torch.manual_seed(0)
    model = Attn()
    x = torch.randn(2, 3, 8)
    mask = torch.tensor([[True] * 3, [False] * 3])  # sample 0 attends to nothing
    before = _owned(model)
    src = find_nonfinite(lambda a, *, mask: model(a, mask=mask).sum(), x, mask=mask)
    _assert_same(before, _owned(model))
    assert src is not None
    assert _where(src) == ("forward", "attn", "MultiheadAttention")
    assert (src.shape, src.dtype) == ((2, 3, 8), torch.float32)


def test_a_transformer_layer_with_a_fully_masked_row_agrees_with_a_plain_backward() -> None:
    """The SDPA path gives zeros for a fully masked row: found only if a plain pass sees NaN."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(2, 3, 8)
    mask = torch.tensor([[True] * 3, [False] * 3])

    def fn(a: torch.Tensor) -> torch.Tensor:
        return layer(a, src_key_padding_mask=mask).pow(2).mean()

    loss = fn(x)
    grads = torch.autograd.grad(loss, list(layer.parameters()))
    plain_bad = not loss.isfinite() or not all(g.isfinite().all() for g in grads)
    src = find_nonfinite(fn, x)
    assert (src is not None) == plain_bad
    if src is not None:
        assert src.name.startswith("self_attn")


# ---------------------------------------------------------------------- module shapes


class Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Twice(nn.Module):
    """One module called twice (shared weights): finite the first time, inf the second."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.shared = Scale(1e25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.shared(self.shared(h)).sum(-1, keepdim=True)  # 1e25 then 1e50: inf


def test_a_module_called_twice_is_named_once_by_its_name() -> None:
    torch.manual_seed(0)
    model = Twice()
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "shared", "Scale")
    assert src.shape == (6, 8)


class SharedLinear(nn.Module):
    """A linear layer applied twice; a NaN gradient appears only in its second use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.custom = Custom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(torch.tanh(x))
        return self.lin(self.custom(h))  # type: ignore[no-any-return]


def test_a_backward_nan_between_two_uses_of_a_shared_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), SharedLinear(), nn.Linear(8, 1))
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("backward", "1.custom", "Custom")


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    logits: torch.Tensor


class Shaped(nn.Module):
    """Returns its result as a tuple, dict, dataclass or None (the NaN in the 2nd item)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        bad = h[:, :3] * NAN
        if self.kind == "tuple":
            return h, bad
        if self.kind == "dict":
            return {"hidden": h, "logits": bad}
        if self.kind == "dataclass":
            return Out(h, bad)
        return None


class Holder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.body = Shaped(kind)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out = self.body(h)
        if self.kind == "none":
            return (h - 100).log().sum(-1)  # the NaN made here, after a module gave None
        logits = {"tuple": lambda o: o[1], "dict": lambda o: o["logits"]}.get(
            self.kind, lambda o: o.logits
        )(out)
        return logits.sum(-1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass", "none"])
def test_outputs_of_every_shape_are_searched(kind: str) -> None:
    torch.manual_seed(0)
    model = Holder(kind)
    src = find_nonfinite(lambda a: model(a).mean(), _xy()[0])
    assert src is not None
    if kind == "none":
        assert _where(src) == ("forward", "", "Holder")
        assert src.shape == (6,)
    else:
        assert _where(src) == ("forward", "body", "Shaped")
        assert src.shape == (6, 3)


# ---------------------------------------------------------------------- keyword arguments


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + bias  # type: ignore[no-any-return]


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.child = Child()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        bias = (h - 100).log()  # NaN, made in Parent's own code
        return self.child(h, bias=bias)  # type: ignore[no-any-return]


def test_a_keyword_argument_made_bad_by_the_caller_names_the_caller() -> None:
    """The same value passed positionally names the caller; by keyword it must too.

    Regression: Parent's own code makes the NaN and hands it to ``child`` as ``bias=``; the
    replay names ``p.child`` (a propagator), because its global forward pre-hook sees
    positional ``args`` only (``register_module_forward_pre_hook`` gets no kwargs), so
    the bad keyword input is never checked. Repro::

        class Parent(nn.Module):  # lin: Linear(4, 8), child(x, *, bias): lin(x) + bias
            def forward(self, x):
                h = self.lin(x)
                return self.child(h, bias=(h - 100).log())
        find_nonfinite(lambda a: model(a).sum(), x)  # model.p is a Parent
        # expected: forward of 'p' (Parent); got: forward of 'p.child' (Child)
    """
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("p", Parent())
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "p", "Parent")


def test_a_keyword_argument_made_bad_by_the_step_function_names_its_code() -> None:
    """Regression (same cause): ``model(x=a.log())`` names the model instead of the function's
    own code, where ``model(a.log())`` names the function's code. Repro::

        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh())  # any module; here KwNet
        find_nonfinite(lambda a: net(x=(a - 100).log()).sum(), x)
        # expected: forward of the function's own code; got: forward of '' (KwNet)
    """

    class KwNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, *, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    net = KwNet()
    positional = find_nonfinite(lambda a: net.lin((a - 100).log()).sum(), _xy()[0])
    assert positional is not None
    assert _where(positional) == ("forward", "", None)
    src = find_nonfinite(lambda a: net(x=(a - 100).log()).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "", None)


def test_a_module_taking_keyword_arguments_is_named_when_it_makes_the_nan() -> None:
    torch.manual_seed(0)
    child = Child()
    src = find_nonfinite(
        lambda a, *, b: child(torch.tanh(a @ torch.ones(4, 8)), bias=b).log().sum(),
        _xy()[0],
        b=torch.full((8,), -50.0),
    )
    assert src is not None  # log(<0) in the function's code, after a finite child
    assert _where(src) == ("forward", "", None)


# ---------------------------------------------------------------------- already bad


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


def test_a_nan_already_in_the_batch_is_named_by_its_path() -> None:
    model = _mlp()
    x, y = _xy()
    x[4, 2] = NAN
    src = find_nonfinite(lambda b: F.mse_loss(model(b["x"]), b["y"]), {"x": x, "y": y})
    assert src is not None
    assert (src.phase, src.name, src.module) == ("input", "args[0]['x']", None)
    assert (src.shape, src.dtype) == ((6, 4), torch.float32)
    src = find_nonfinite(lambda b: F.mse_loss(model(b.x), b.y), Batch(x, y))
    assert src is not None
    assert (src.phase, src.name) == ("input", "args[0].x")
    src = find_nonfinite(lambda b: F.mse_loss(model(b[0][0]), b[1]), ([x], y))
    assert src is not None
    assert (src.phase, src.name) == ("input", "args[0][0][0]")


def test_a_nan_already_in_a_weight_names_the_module_that_uses_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _trained_tokens(model)
    with torch.no_grad():
        model[1].weight[2, 5] = NAN
    before = _owned(model, opt)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    src = find_nonfinite(lambda t: model(t).mean(), tokens)  # integer input: not checked
    _assert_same(before, _owned(model, opt))
    assert src is not None
    assert _where(src) == ("forward", "1", "Linear")
    assert src.shape == (2, 3, 8)


def _trained_tokens(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[0, 1, 2]])).mean().backward()
    opt.step()
    return opt


def test_a_nan_made_in_the_loss_function_names_no_module() -> None:
    model = _mlp()
    src = find_nonfinite(lambda a, b: torch.log(model(a) - b - 100).mean(), *_xy())
    assert src is not None
    assert _where(src) == ("forward", "", None)
    assert src.shape == ()  # the loss itself: the first bad tensor the replay saw


def test_a_loss_module_that_makes_the_nan_is_named() -> None:
    class LogLoss(nn.Module):
        def forward(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.log(p - y - 100).mean()

    model, crit = _mlp(), LogLoss()
    src = find_nonfinite(lambda a, b: crit(model(a), b), *_xy())
    assert src is not None
    assert (src.phase, src.module) == ("forward", "LogLoss")


# ---------------------------------------------------------------------- in place


def test_in_place_activations_do_not_hide_the_producer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), Poison(), nn.Linear(8, 1))
    model[2].bad = True
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "2", "Poison")
    torch.manual_seed(0)
    model = nn.Sequential(Scale(1e39), nn.ReLU(inplace=True), nn.Linear(4, 1))
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "0", "Scale")


# ---------------------------------------------------------------------- user hooks


def test_user_hooks_run_once_in_the_replay_and_stay_registered() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Custom(), nn.Linear(8, 1))
    calls = {"pre": 0, "fwd": 0, "bwd": 0, "tensor": 0}

    def pre(m: nn.Module, args: Any) -> None:
        calls["pre"] += 1

    def fwd(m: nn.Module, args: Any, out: Any) -> None:
        calls["fwd"] += 1

    def bwd(m: nn.Module, gi: Any, go: Any) -> None:
        calls["bwd"] += 1

    def tensor_hook(g: torch.Tensor) -> None:
        calls["tensor"] += 1

    hooked = model[3]  # downstream of the NaN gradient: its backward hooks run first
    handles = [
        hooked.register_forward_pre_hook(pre),
        hooked.register_forward_hook(fwd),
        hooked.register_full_backward_hook(bwd),
        hooked.weight.register_hook(tensor_hook),
    ]
    counts = (
        len(hooked._forward_pre_hooks),
        len(hooked._forward_hooks),
        len(hooked._backward_hooks),
    )
    globals_before = _global_hooks()
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("backward", "2", "Custom")
    assert calls == {"pre": 1, "fwd": 1, "bwd": 1, "tensor": 1}
    assert counts == (
        len(hooked._forward_pre_hooks),
        len(hooked._forward_hooks),
        len(hooked._backward_hooks),
    )
    assert _global_hooks() == globals_before
    for h in handles:
        h.remove()


def _global_hooks() -> tuple[int, ...]:
    return tuple(
        len(getattr(module_hooks, name))
        for name in (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


def test_a_user_forward_hook_that_makes_the_nan_counts_as_its_module() -> None:
    """Regression: a backward hook that changes a gradient counts as its module's (documented),
    but a forward hook that changes an output is blamed on the enclosing module: the
    global forward hook runs before the module's own hooks, so it checks the output
    before the user's hook changed it. Repro::

        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        model[0].register_forward_hook(lambda m, i, o: o * float("nan"))
        find_nonfinite(lambda a: model(a).sum(), x)
        # expected: forward of '0' (Linear); got: forward of '' (Sequential)
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    handle = model[0].register_forward_hook(lambda m, i, o: o * NAN)
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    handle.remove()
    assert src is not None
    assert _where(src) == ("forward", "0", "Linear")


def test_a_user_forward_hook_that_cleans_a_nan_is_not_blamed() -> None:
    """Regression (same cause): a module whose own hook repairs its output (nan_to_num) is named
    as the producer, though nothing non-finite left it; the real producer, a backward
    NaN further on, is never reported. Repro::

        model = nn.Sequential(nn.Linear(4, 8), Poison(), Custom(), nn.Linear(8, 1))
        model[1].bad = True  # its output is NaN; its own hook cleans it
        model[1].register_forward_hook(lambda m, i, o: torch.nan_to_num(o, nan=0.0))
        find_nonfinite(lambda a: model(a).sum(), x)  # Custom: a NaN gradient
        # expected: backward of '2' (Custom); got: forward of '1' (Poison)
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Poison(), Custom(), nn.Linear(8, 1))
    model[1].bad = True
    handle = model[1].register_forward_hook(lambda m, i, o: torch.nan_to_num(o, nan=0.0))
    x = _xy()[0]
    assert model(x).isfinite().all()  # what leaves model[1] is finite
    src = find_nonfinite(lambda a: model(a).sum(), x)
    handle.remove()
    assert src is not None
    assert _where(src) == ("backward", "2", "Custom")


# ---------------------------------------------------------------------- dropout, BN, RNG


class Noisy(nn.Module):
    """Dropout, BatchNorm and a spectral-normed layer (power iteration in its buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(8)
        self.sn = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.act = Poison()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sn(self.bn(self.drop(self.inp(x))))
        return self.head(self.act(h))  # type: ignore[no-any-return]


def test_dropout_batchnorm_in_train_mode_change_nothing_and_find_the_same_nan() -> None:
    torch.manual_seed(0)
    model = Noisy().train()
    opt = _trained(model)
    model.act.bad = True
    random.seed(5)
    np.random.seed(5)
    before = _owned(model, opt)
    fn = lambda a, b: F.mse_loss(model(a), b)  # noqa: E731
    first = find_nonfinite(fn, *_xy())
    _assert_same(before, _owned(model, opt))
    second = find_nonfinite(fn, *_xy())
    _assert_same(before, _owned(model, opt))
    assert first == second
    assert first is not None
    assert _where(first) == ("forward", "act", "Poison")


def _noisy_run(locate: bool, skip_on: str) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    model = Noisy().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=locate)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    train(*_xy())
    model.act.bad = True
    result = train(*_xy())
    if locate:
        assert result.nonfinite  # read: on the device path, replays now
    model.act.bad = False
    train(*_xy(seed=4))
    assert (step.steps, step.skipped_steps) == (2, 1)
    return result, _owned(model, opt)


def test_a_step_with_dropout_and_batchnorm_equals_the_run_without_locate(skip_on: str) -> None:
    plain, want = _noisy_run(False, skip_on)
    with pytest.warns(NonFiniteWarning, match="'act' \\(Poison\\)"):
        result, got = _noisy_run(True, skip_on)
    _assert_same(want, got, ids=False)
    assert plain.nonfinite is None
    assert _where(result.nonfinite) == ("forward", "act", "Poison")


# ---------------------------------------------------------------------- checkpointing


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, where: str) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), Poison(), Custom())
        if where != "backward":
            self.inner[3] = nn.Identity()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = checkpoint(self.inner, h, use_reentrant=self.reentrant)
        return self.head(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("where", ["forward", "backward", "nowhere"])
def test_activation_checkpointing_non_reentrant(where: str) -> None:
    """Regression (backward, nowhere): once the replay reaches the backward of a model with
    ``checkpoint(..., use_reentrant=False)`` it raises CheckpointError ("A different
    number of tensors was saved during the original forward and recomputation"), even
    when everything is finite: the replay's module hooks check each input and output
    with ``torch.isfinite`` (``_bad()``) under grad mode, and on a tensor that requires
    grad that records ``abs`` nodes which save tensors inside the checkpointed forward;
    the recomputation (hooks gone) saves fewer. ``_bad`` under ``torch.no_grad()``
    (or on ``value.detach()``) makes it pass. Repro::

        inner, head = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1)
        fn = lambda a: head(checkpoint(inner, a, use_reentrant=False)).sum()
        fn(torch.randn(6, 8)).backward()  # fine
        find_nonfinite(fn, torch.randn(6, 8))
        # expected: None; got: CheckpointError (autocast_step: "replaying it raised")
    """
    torch.manual_seed(0)
    model = Checkpointed(False, where)
    opt = _trained(model) if where != "backward" else None
    model.inner[2].bad = where == "forward"
    before = _owned(model, opt)
    try:
        src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    finally:
        _assert_same(before, _owned(model, opt))  # BN ran twice (recomputed): put back
    if where == "nowhere":
        assert src is None
        return
    assert src is not None
    if where == "forward":
        assert _where(src) == ("forward", "inner.2", "Poison")
    else:
        assert _where(src) == ("backward", "inner.3", "Custom")
        assert src.op == "NanGradBackward"


def test_reentrant_checkpointing_backward_nan_is_located() -> None:
    """Regression: with ``use_reentrant=True`` (HF models' default for years) a backward NaN is
    not located: the replay's ``torch.autograd.grad`` raises "Checkpointing is not
    compatible with .grad()"; find_nonfinite raises it, autocast_step reports "replaying
    it raised". Not in the documented limits. Repro::

        inner = nn.Sequential(nn.Linear(8, 8), Custom())  # Custom: NaN gradient
        fn = lambda a: checkpoint(inner, a, use_reentrant=True).sum()
        find_nonfinite(fn, torch.randn(6, 8, requires_grad=True))
        # expected: backward of ... (Custom); got: RuntimeError
    """
    torch.manual_seed(0)
    model = Checkpointed(True, "backward")
    before = _owned(model)
    try:
        src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    finally:
        _assert_same(before, _owned(model))
    assert src is not None
    assert src.phase == "backward"


def test_reentrant_checkpointing_forward_nan_is_located() -> None:
    torch.manual_seed(0)
    model = Checkpointed(True, "forward")
    model.inner[2].bad = True
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "inner.2", "Poison")


# ---------------------------------------------------------------------- accumulation


class LogOf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + 3)  # NaN only where the batch is below -3


def _accumulate_run(locate: bool, skip_on: str) -> tuple[list[Any], dict[str, Any], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(LogOf(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=2, locate_nonfinite=locate
    )
    train = step(lambda a, b: F.mse_loss(model(a), b))
    x, y = _xy()
    x = x.clamp(-2.5, 2.5)
    bad = x.clone()
    bad[5, 1] = -10.0  # finite in the batch; NaN once LogOf sees it
    results = [train(x, y), train(x, y), train(x, y), train(bad, y), train(x, y), train(x, y)]
    if locate:
        assert results[3].nonfinite
    assert (step.steps, step.skipped_steps) == (2, 1)
    return results, _owned(model, opt), step


def test_accumulation_names_the_second_micro_batch(skip_on: str) -> None:
    _, want, _ = _accumulate_run(False, skip_on)
    with pytest.warns(NonFiniteWarning, match="forward of '0' \\(LogOf\\)"):
        results, got, step = _accumulate_run(True, skip_on)
    _assert_same(want, got, ids=False)
    src = results[3].nonfinite
    assert _where(src) == ("forward", "0", "LogOf")
    assert (src.micro_batch, src.shape) == (1, (6, 4))
    assert not results[1].nonfinite
    assert not results[5].nonfinite
    assert step._stepper.watch._calls == []


# ---------------------------------------------------------------------- precision


def test_bf16_autocast_names_a_bf16_tensor() -> None:
    model = _mlp()
    model[1].bad = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        src = find_nonfinite(lambda a: model(a).float().sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("forward", "1", "Poison")
    assert src.dtype == torch.bfloat16


def test_a_bf16_step_replays_under_its_autocast() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = autocast_step(opt, model=model, dtype=torch.bfloat16, locate_nonfinite=True)
    train = step(lambda a, b: F.mse_loss(model(a).float(), b))
    model[1].bad = True
    with pytest.warns(NonFiniteWarning, match="bfloat16 tensor of shape \\(6, 8\\)"):
        result = train(*_xy())
    assert result.skipped
    assert result.nonfinite.dtype == torch.bfloat16


def test_fp16_forward_overflow_names_the_layer_and_its_dtype() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # |x| up to ~3 per feature: 4 * 3e4 * 3 > 65504
    with torch.autocast("cpu", dtype=torch.float16):
        src = find_nonfinite(lambda a: model(a).float().sum(), _xy()[0] * 3)
    assert src is not None
    assert _where(src) == ("forward", "0", "Linear")
    assert src.dtype == torch.float16


def _fp16_run(locate: bool) -> tuple[Any, Any, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    step = autocast_step(
        opt, model=model, dtype=torch.float16, scaler=scaler, locate_nonfinite=locate
    )
    train = step(lambda a, b: F.mse_loss(model(a).float(), b) * 1e3)  # scaled: fp16 grads overflow
    x, y = _xy()
    result = train(x, y)
    return result, scaler, _owned(model, opt)


def test_an_fp16_loss_scale_overflow_names_no_module() -> None:
    """A GradScaler overflow (the scale is too high) is skipped like a NaN; the replay,
    first without the scale, stays finite, so no module is named (the warning says it
    was the scale). The state equals the run without locate_nonfinite, and the scale
    backs off the same way."""
    plain, scaler_plain, want = _fp16_run(False)
    if not plain.skipped:
        pytest.skip("this CPU's fp16 backward did not overflow at scale 2**16")
    with pytest.warns(NonFiniteWarning, match="only the loss scale made"):
        result, scaler, got = _fp16_run(True)
    _assert_same(want, got, ids=False)
    assert scaler.get_scale() == scaler_plain.get_scale() < 2.0**16
    assert result.nonfinite is None


def test_an_fp16_loss_scale_overflow_is_reported_as_one() -> None:
    """Regression (it was misleading): a window skipped because the GradScaler's scale
    is too high (routine: the scaler probes a higher scale every ``growth_interval``
    steps) is reported as a producer, "backward of the function's own code (outside any
    module), in ToCopyBackward0": the user is sent to code that is fine, on every
    back-off. The replay could tell a scale overflow (finite at scale 1) from a real
    inf/NaN; docs/observe.md says nothing about fp16 scale overflows. Repro::

        step = autocast_step(opt, model=model, dtype=torch.float16,
                             scaler=torch.amp.GradScaler("cpu"), locate_nonfinite=True)
        step(lambda a, b: F.mse_loss(model(a).float(), b) * 1e3)(x, y)
        # expected: a warning naming the loss scale (65536) as the cause;
        # got: "the first came from backward of the function's own code ..."
    """
    plain, _, _ = _fp16_run(False)
    if not plain.skipped:
        pytest.skip("this CPU's fp16 backward did not overflow at scale 2**16")
    with pytest.warns(NonFiniteWarning) as caught:
        _fp16_run(True)
    assert "scale" in str(caught[0].message)


# ---------------------------------------------------------------------- torch.compile


def test_a_compiled_model_is_replayed_eagerly_and_named_inside() -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x, y = _xy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own notices
        F.mse_loss(compiled(x), y)
        model[1].bad = True
        src = find_nonfinite(lambda a, b: F.mse_loss(compiled(a), b), x, y)
    assert src is not None
    assert _where(src) == ("forward", "1", "Poison")


# ---------------------------------------------------------------------- names under model=


def test_a_step_calling_submodules_names_them_from_its_model() -> None:
    """Lightning's ``training_step`` calls ``self.encoder`` and ``self.decoder`` itself.

    Regression (design): with ``autocast_step(model=net)`` the name is still relative to the
    outermost module *called*, so an encoder's ``0`` and a decoder's ``0`` are both
    reported as ``'0'``; the step knows ``model=`` and could name ``decoder.0``. Repro::

        net = nn.Module(); net.encoder = nn.Sequential(Linear, Tanh)
        net.decoder = nn.Sequential(Poison(bad), Linear)
        step = autocast_step(opt, model=net, locate_nonfinite=True)
        step(lambda a: net.decoder(net.encoder(a)).sum())(x)
        # expected: forward of 'decoder.0' (Poison); got: forward of '0' (Poison)
    """
    torch.manual_seed(0)
    net = nn.Module()
    net.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    net.decoder = nn.Sequential(Poison(), nn.Linear(8, 1))
    net.decoder[0].bad = True
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    step = autocast_step(opt, model=net, dtype=torch.float32, locate_nonfinite=True)
    train = step(lambda a: net.decoder(net.encoder(a)).sum())
    with pytest.warns(NonFiniteWarning):
        result = train(_xy()[0])
    assert _where(result.nonfinite) == ("forward", "decoder.0", "Poison")


# ---------------------------------------------------------------------- no cost


def test_a_finite_run_registers_no_hook_and_replays_nothing(
    skip_on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replays: list[Any] = []
    real = amp_watch.replay
    monkeypatch.setattr(amp_watch, "replay", lambda *a, **k: replays.append(a) or real(*a, **k))
    model = _mlp()
    seen: list[tuple[int, ...]] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_global_hooks())
            return x

    model.insert(0, Spy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=True)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    quiet = _global_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [train(*_xy(seed=s)) for s in range(4)]
    assert not any(r.nonfinite for r in results)
    assert not replays
    assert set(seen) == {quiet}  # no global hook during a finite step
    model[2].bad = True
    with pytest.warns(NonFiniteWarning):
        assert train(*_xy()).nonfinite
    assert len(replays) == 1
    assert _global_hooks() == quiet  # and none left after a replay
    assert step._stepper.watch._calls == []


# ---------------------------------------------------------------------- DDP over gloo


def _ddp_worker(rank: int, port: int, out: str) -> None:
    import datetime
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    results: dict[str, Any] = {}
    try:
        for locate in (False, True):
            torch.manual_seed(0)
            net = _mlp()
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            step = autocast_step(opt, model=ddp, dtype=torch.float32, locate_nonfinite=locate)
            train = step(lambda a, b, ddp=ddp: F.mse_loss(ddp(a), b))
            messages: list[str] = []
            sources = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(3):
                    net[1].bad = rank == 0 and i == 1  # rank 0 only, window 1 only
                    r = train(*_xy(seed=10 * rank + i))
                    sources.append(None if not r.nonfinite else _where(r.nonfinite))
            messages = [str(w.message) for w in caught if w.category is NonFiniteWarning]
            w = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            gathered = [torch.empty_like(w) for _ in range(2)]
            torch.distributed.all_gather(gathered, w)
            results[str(locate)] = {
                "sources": sources,
                "messages": messages,
                "weights": w,
                "equal": torch.equal(gathered[0], gathered[1]),
                "counts": (step.steps, step.skipped_steps),
                "rng": torch.get_rng_state(),
            }
        torch.save(results, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from launcher_env import run_ranks

    return run_ranks(_ddp_worker, tmp_path_factory.mktemp("nan_ddp"), 2, timeout=120)


@pytest.mark.distributed
def test_ddp_names_the_module_inside_the_wrapper_on_the_rank_that_made_it(
    ddp_ranks: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(ddp_ranks):
        plain, located = got["False"], got["True"]
        assert plain["counts"] == located["counts"] == (2, 1), rank
        assert located["equal"], rank
        assert plain["equal"], rank
        assert _same(plain["weights"], located["weights"]), rank
        assert torch.equal(plain["rng"], located["rng"]), rank
        assert plain["messages"] == [], rank
    assert ddp_ranks[0]["True"]["sources"] == [None, ("forward", "1", "Poison"), None]
    assert len(ddp_ranks[0]["True"]["messages"]) == 1


@pytest.mark.distributed
def test_ddp_a_clean_rank_does_not_blame_an_overflow(ddp_ranks: list[dict[str, Any]]) -> None:
    """Regression: the rank whose batch stayed finite skips with the others (the verdict is
    all-reduced) and its replay finds nothing, so it warns that "the gradients overflowed
    only when summed over the window, or the data changed since the step": neither is
    true, the inf/NaN came from another rank. Repro: 2 gloo ranks, DDP, rank 0's
    module makes a NaN in one window; rank 1's NonFiniteWarning.
    Expected: a message saying another rank made it; got: the overflow explanation.
    (cudakit/amp/watch.py ``locate_now``, the ``source is None`` message.)
    """
    clean = ddp_ranks[1]["True"]
    assert clean["sources"] == [None, None, None]
    assert len(clean["messages"]) == 1
    assert "overflowed only when summed" not in clean["messages"][0]
    assert "rank" in clean["messages"][0]


# ---------------------------------------------------------------------- step function forms


@pytest.mark.parametrize("form", ["tuple", "weighted"])
def test_the_step_function_forms_are_replayed(form: str) -> None:
    """``(loss, logits)`` and ``{"loss": summed, "weight": count}`` (autocast_step's forms)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=True)

    @step
    def train(a: torch.Tensor, b: torch.Tensor) -> Any:
        out = model(a)
        if form == "tuple":
            return F.mse_loss(out, b), out
        return {"loss": F.mse_loss(out, b, reduction="sum"), "weight": torch.tensor(6.0)}

    train(*_xy())
    model[1].bad = True
    with pytest.warns(NonFiniteWarning, match="'1' \\(Poison\\)"):
        result = train(*_xy())
    assert _where(result.nonfinite) == ("forward", "1", "Poison")


def test_a_step_that_changes_its_batch_in_place_is_not_changed_again() -> None:
    """Regression: "the replay changes nothing you own", but a step function that normalises
    its batch in place (``x.sub_(mean)``) runs again on the same tensor, so the user's
    batch is changed twice (and the replay sees other data than the step did). Repro::

        @autocast_step(opt, model=model, locate_nonfinite=True)
        def train(x, y):
            x.sub_(1.0)              # in-place preprocessing
            return F.mse_loss(model(x), y)   # model makes a NaN
        x0 = x.clone(); train(x, y)
        # expected: x == x0 - 1; got: x == x0 - 2
    (cudakit/amp/watch.py ``Watch.record`` keeps references, not copies.)
    """
    results = []
    for locate in (False, True):
        model = _mlp()
        model[1].bad = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=locate)

        @step
        def train(a: torch.Tensor, b: torch.Tensor, model: nn.Module = model) -> torch.Tensor:
            a.sub_(1.0)
            return F.mse_loss(model(a), b)

        x, y = _xy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            train(x, y)
        results.append(x)
    assert _same(results[0], results[1])


class RootOf(nn.Module):
    """sqrt of a ReLU in its own code, between two submodules: an inf gradient at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sqrt(torch.relu(self.a(x))))  # type: ignore[no-any-return]


def test_a_backward_nan_in_a_modules_own_code_names_that_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Tanh(), RootOf())
    src = find_nonfinite(lambda a: model(a).sum(), _xy()[0])
    assert src is not None
    assert _where(src) == ("backward", "1", "RootOf")
    assert src.op == "SqrtBackward0"
