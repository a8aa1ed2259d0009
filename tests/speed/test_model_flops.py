"""Model FLOPs: the same model counts the same whatever attention kernel or recompute runs.

MFU is defined on model FLOPs (PaLM, appendix B): what the model's maths needs,
leaving out what a kernel or activation checkpointing computes again. Fused
attention's backward recomputes the scores and ``torch.utils.checkpoint`` reruns a
block's forward: both are hardware FLOPs (``FlopCount.hardware``), never MFU's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cudakit.speed import FlopCount, count_flops, speed_report

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 2


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
        self.attend = _fused_attention if fused else _explicit_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, fused: bool, recompute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList(Block(fused) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.recompute = recompute

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(x)


def _count(model: TinyGPT) -> FlopCount:
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def loss(idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(idx)[:, :-1].flatten(0, 1), idx[:, 1:].flatten())

    return count_flops(loss, idx, model=model)


def _matmul_parameters() -> int:
    per_block = WIDTH * 3 * WIDTH + WIDTH * WIDTH + 2 * WIDTH * 4 * WIDTH
    return LAYERS * per_block + WIDTH * VOCAB


def test_explicit_attention_counts_6nt_plus_the_attention_formula() -> None:
    count = _count(TinyGPT(fused=False))
    tokens = BATCH * SEQ
    # 6NT over the matmul weights, and 12·L·H·Q·T² for attention (per sequence)
    # with H·Q = WIDTH; the first block's input is no matmul's output, so all grads run.
    expected = 6 * _matmul_parameters() * tokens + 12 * LAYERS * WIDTH * SEQ * SEQ * BATCH
    assert count.total == expected
    assert count.hardware == count.total


def test_fused_attention_counts_the_same_model_flops_as_explicit_matmuls() -> None:
    explicit, fused = _count(TinyGPT(fused=False)), _count(TinyGPT(fused=True))
    assert (fused.total, fused.forward) == (explicit.total, explicit.forward)
    # The fused backward recomputes q @ k^T: 2·B·T²·d per layer, hardware FLOPs only.
    recomputed = LAYERS * 2 * BATCH * SEQ * SEQ * WIDTH
    assert fused.hardware == fused.total + recomputed


@pytest.mark.parametrize("fused", [False, True])
def test_activation_checkpointing_changes_hardware_flops_not_model_flops(fused: bool) -> None:
    plain, rerun = _count(TinyGPT(fused)), _count(TinyGPT(fused, recompute=True))
    assert (rerun.total, rerun.forward) == (plain.total, plain.forward)
    # Each block's forward runs again inside the backward, up to the last op whose
    # output the backward needs (torch stops the rerun there).
    block_forward = (plain.forward or 0) - 2 * BATCH * SEQ * WIDTH * VOCAB  # all but the head
    last_linear = LAYERS * 2 * BATCH * SEQ * 4 * WIDTH * WIDTH
    assert block_forward - last_linear <= rerun.hardware - plain.hardware <= block_forward


def test_reentrant_checkpointing_counts_its_rerun_as_hardware_flops() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    plain = count_flops(lambda x: net(x).sum(), x, model=net)
    rerun = count_flops(lambda x: checkpoint(net, x, use_reentrant=True).sum(), x, model=net)
    assert rerun.total == plain.total
    assert rerun.hardware == plain.total + (plain.forward or 0)


def test_mfu_is_the_same_for_both_kernels() -> None:
    meters = []
    for fused in (False, True):
        count = _count(TinyGPT(fused))
        meter = speed_report(flops=count, peak_tflops=1.0, file=None)
        for _ in range(2):
            with meter:
                pass
        meters.append(meter)
    assert meters[0].total.flops == meters[1].total.flops == 2 * _count(TinyGPT(False)).total


def test_hardware_defaults_to_the_model_count() -> None:
    count = FlopCount(total=300, forward=100, example=None)
    assert (count.hardware, count.recomputed) == (300, 0)
    assert FlopCount(300, 100, None, recomputed=40).hardware == 340


@pytest.mark.parametrize(
    "name",
    [
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    ],
)
def test_every_fused_attention_backward_leaves_its_recomputed_scores_out(name: str) -> None:
    from torch.utils import flop_counter

    from cudakit.speed._formulas import Formulas, _registry

    op = getattr(torch.ops.aten, name)
    q, k, v, g = (torch.empty(2, 4, 16, 8, device="meta") for _ in range(4))
    args = (g, q, k, v, None, None, None, None, 16, 16)  # the kernels without nested lengths
    formulas = Formulas()
    model = formulas.mapping()[op](*args, out_val=None)
    hardware = int(_registry()[op](*args, out_val=None))  # torch's own count
    batch, heads, seq, dim = 2, 4, 16, 8
    if hardware != flop_counter.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape):
        heads, seq = seq, heads  # torch 2.15 reads the flash kernel's (batch, seq, heads, dim)
    scores = 2 * batch * heads * seq * seq * dim
    assert (model, formulas.recomputed) == (hardware - scores, scores)
