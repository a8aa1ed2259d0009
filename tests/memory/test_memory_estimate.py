"""estimate_memory(): the peak predicted on fake tensors against the peak measured on real ones.

The measure is torch's own tracker of live tensors (``torch.distributed._tools``'s
``MemTracker``) over two real training steps on the CPU. The stated tolerance is
±10 % in every cell; on one process the two agree to the byte.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cudakit.parallel as cp
from cudakit.memory import MemoryEstimate, estimate_memory

TOLERANCE = 0.10


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def measure(
    model: nn.Module,
    shape: tuple[int, ...],
    *,
    strategy: str = "none",
    recompute: Any = None,
    precision: str = "fp32",
) -> int:
    """The real peak of live tensor bytes over two AdamW steps, as torch's MemTracker sees it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    peak = 0
    dtype = {"bf16": torch.bfloat16}.get(precision)
    with tracker:
        net = cp.parallelize(model, strategy, device="cpu", recompute=recompute)
        opt = torch.optim.AdamW(net.parameters())
        x = torch.randn(shape)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            cast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            with cast:
                loss = net(x).sum()
            loss.backward()
            del loss
            opt.step()
            peak = max(peak, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()
    return int(peak)


def _meta(depth: int = 3, width: int = 64) -> Net:
    with torch.device("meta"):
        return Net(depth, width)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", [None, "full", "selective"])
def test_one_process_within_tolerance(policy: str | None, precision: str) -> None:
    shape = (4, 32, 64)
    want = measure(Net(), shape, recompute=policy, precision=precision)
    got = estimate_memory(
        _meta(), torch.empty(shape, device="meta"), recompute=policy, precision=precision
    )
    assert abs(got.peak - want) <= TOLERANCE * want, (got, want)


@settings(max_examples=8)
@given(depth=st.integers(1, 4), batch=st.integers(1, 6), every=st.integers(1, 3))
def test_recompute_policies_within_tolerance(depth: int, batch: int, every: int) -> None:
    shape = (batch, 16, 64)
    spec = cp.Recompute("full", every=every)
    want = measure(Net(depth), shape, recompute=spec)
    got = estimate_memory(_meta(depth), torch.empty(shape, device="meta"), recompute=spec)
    assert abs(got.peak - want) <= TOLERANCE * want, (got, want)


def test_recompute_lowers_the_activations() -> None:
    batch = torch.empty(8, 64, 64, device="meta")
    peaks = {
        p: estimate_memory(_meta(4), batch, recompute=p).activations
        for p in (None, "selective", "full")
    }
    assert peaks["full"] < peaks["selective"] < peaks[None]


def test_breakdown_sums_to_the_peak_and_renders() -> None:
    e = estimate_memory(_meta(), torch.empty(2, 8, 64, device="meta"), strategy="ddp")
    assert isinstance(e, MemoryEstimate)
    parts = ("parameters", "gradients", "optimizer", "activations", "communication")
    assert e.peak == sum(getattr(e, f) for f in (*parts, "temporaries"))
    assert e.communication > 0  # DDP's buckets
    text = str(e)
    assert text.startswith("estimated peak per rank:")
    assert all(p in text for p in parts)
    assert e.to_dict()["peak"] == e.peak


def test_fsdp_shards_the_state_by_world_size() -> None:
    batch = torch.empty(2, 8, 64, device="meta")
    one = estimate_memory(_meta(), batch, strategy="fsdp", world_size=1)
    four = estimate_memory(_meta(), batch, strategy="fsdp", world_size=4)
    assert four.optimizer == pytest.approx(one.optimizer / 4, rel=0.02)
    assert four.parameters < one.parameters / 2


def test_the_model_is_left_as_it_was() -> None:
    model = _meta()
    keys = {k: (v.shape, v.device) for k, v in model.state_dict().items()}
    estimate_memory(model, torch.empty(2, 8, 64, device="meta"), recompute="full")
    assert {k: (v.shape, v.device) for k, v in model.state_dict().items()} == keys
    assert cp.recomputed_blocks(model) == []


def test_real_model_and_factory_alike() -> None:
    batch = (torch.randn(2, 8, 64),)
    torch.manual_seed(0)
    real = estimate_memory(Net(), batch)
    factory = estimate_memory(lambda: Net(), batch)
    assert real == factory


def test_optimizer_factory_changes_the_state() -> None:
    batch = torch.empty(2, 8, 64, device="meta")
    sgd = estimate_memory(_meta(), batch, optimizer=torch.optim.SGD)
    adam = estimate_memory(_meta(), batch)
    assert sgd.optimizer == 0
    assert adam.optimizer > 0


def test_an_8b_model_at_world_size_64_on_a_laptop_cpu_in_under_a_minute() -> None:
    # 8.07 B parameters: 32 GB of fp32 weights that are never allocated.
    model = _meta(depth=60, width=4096)
    assert sum(p.numel() for p in model.parameters()) > 8e9
    t0 = time.perf_counter()
    e = estimate_memory(
        model,
        torch.empty(1, 2048, 4096, device="meta"),
        strategy="fsdp",
        world_size=64,
        precision="bf16",
        recompute="full",
    )
    assert time.perf_counter() - t0 < 60  # 3.4 s on a busy 2-core VM
    assert e.parameters < 8.1e9 * 4 / 64 * 1.01  # this rank's 1/64 of the weights


# --------------------------------------------------------------------------- refusals


def test_world_size_the_strategy_cannot_run() -> None:
    with pytest.raises(
        ValueError,
        match=r"estimate_memory\(world_size=\.\.\.\) expects 1 with strategy='none', got int 4\. "
        r"strategy='none' runs one process; pass strategy='ddp' or 'fsdp'",
    ):
        estimate_memory(_meta(), torch.empty(2, 64, device="meta"), world_size=4)


def test_unknown_strategy_and_precision() -> None:
    batch = torch.empty(2, 64, device="meta")
    with pytest.raises(ValueError, match=r"estimate_memory\(strategy=\.\.\.\).*'dp'.*Pass 'none'"):
        estimate_memory(_meta(), batch, strategy="dp")
    with pytest.raises(ValueError, match=r"estimate_memory\(precision=\.\.\.\).*'fp8'"):
        estimate_memory(_meta(), batch, precision="fp8")
    with pytest.raises(
        ValueError, match=r"estimate_memory\(world_size=\.\.\.\) expects an int >= 1"
    ):
        estimate_memory(_meta(), batch, strategy="ddp", world_size=0)


def test_batch_the_model_refuses_names_its_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"estimate_memory\(batch=\.\.\.\): the Net refused the batch \(RuntimeError: .*\)"
        r"\. Pass a batch of the shapes",
    ):
        estimate_memory(_meta(), torch.empty(2, 63, device="meta"))


def test_bad_recompute_policy() -> None:
    with pytest.raises(ValueError, match=r"estimate_memory\(recompute=\.\.\.\).*'most'"):
        estimate_memory(_meta(), torch.empty(2, 64, device="meta"), recompute="most")


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"model": 3}, "model"),
        ({"batch": "x"}, "batch"),
        ({"optimizer": 3}, "optimizer"),
        ({"world_size": "2"}, "world_size"),
        ({"loss_fn": 1}, "loss_fn"),
    ],
)
def test_wrong_kinds(kwargs: dict[str, Any], arg: str) -> None:
    call: dict[str, Any] = {"model": _meta(), "batch": torch.empty(2, 64, device="meta")}
    call.update(kwargs)
    with pytest.raises(TypeError, match=rf"estimate_memory\({arg}=\.\.\.\) expects"):
        estimate_memory(call.pop("model"), call.pop("batch"), **call)


def test_largest_batch_is_the_edge_of_fitting() -> None:
    from cudakit.memory import largest_batch

    example = torch.empty(1, 8, 64, device="meta")
    capacity = estimate_memory(_meta(), torch.empty(37, 8, 64, device="meta")).peak
    size, est = largest_batch(_meta(), example, capacity)
    assert size >= 37
    assert est is not None
    assert est.fits(capacity)
    assert not estimate_memory(_meta(), torch.empty(size + 1, 8, 64, device="meta")).fits(capacity)
    assert largest_batch(_meta(), example, 1000) == (0, None)


def test_largest_batch_refuses_a_capacity_that_is_no_size() -> None:
    from cudakit.memory import largest_batch

    with pytest.raises(ValueError, match=r"largest_batch\(capacity=\.\.\.\) expects an int >= 1"):
        largest_batch(_meta(), torch.empty(1, 64, device="meta"), 0)
