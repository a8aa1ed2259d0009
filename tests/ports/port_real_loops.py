"""Real training loops for the resume tests: nanoGPT, GPT-2 token weighting, DCGAN.

Each loop exists twice: written by hand in plain PyTorch (the reference maths), and
written with cudakit (``autocast_step``, ``Checkpointer``, ``speed_report``) the way a
user converts it. The cudakit loop can save at chosen points, "crash" (abandon the run)
at a chosen batch, and start again from fresh objects seeded otherwise, so that
``Checkpointer.resume()`` alone brings the run back.

The models are tiny on purpose: the tests run on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cudakit

VOCAB = 11
BLOCK = 8
SAMPLES = 44  # 11 batches of 4: windows of 2, 3 or 4 straddle the epochs
BATCH = 4


class Crash(Exception):
    """Stands for a process killed mid-run."""


# ----------------------------------------------------------------------------- nanoGPT


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model, tiny: token and position embeddings, blocks, tied head."""

    def __init__(self, n_layer: int = 2, n_embd: int = 16, n_head: int = 2, dropout: float = 0.1):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, n_embd),
                "wpe": nn.Embedding(BLOCK, n_embd),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(t)))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))


def configure_optimizers(model: nn.Module, *, fused: bool = False) -> torch.optim.AdamW:
    """nanoGPT's: weight decay on the matrices and embeddings, none on biases and norms."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), fused=fused or None)


WARMUP, DECAY_ITERS, MIN_RATIO = 3, 12, 0.1


def cosine_with_warmup(it: int) -> float:
    """nanoGPT's get_lr() over the base lr: linear warm-up, cosine decay, a floor."""
    if it < WARMUP:
        return (it + 1) / (WARMUP + 1)
    if it > DECAY_ITERS:
        return MIN_RATIO
    ratio = (it - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_RATIO + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1 - MIN_RATIO)


def char_dataset(*, padded: bool = False) -> TensorDataset:
    """Windows of a fixed pseudo-random text; ``padded``: targets padded with -1 (ignored)."""
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, VOCAB, (SAMPLES + BLOCK + 1,), generator=g)
    x = torch.stack([text[i : i + BLOCK] for i in range(SAMPLES)])
    y = torch.stack([text[i + 1 : i + 1 + BLOCK] for i in range(SAMPLES)])
    if padded:  # each sequence has its own length: 1 to BLOCK real targets
        lengths = torch.randint(1, BLOCK + 1, (SAMPLES,), generator=g)
        y = torch.where(torch.arange(BLOCK) < lengths[:, None], y, torch.full_like(y, -1))
    return TensorDataset(x, y)


@dataclasses.dataclass
class Seeds:
    """Where each generator starts: the model's init, the loader's, the global (dropout)."""

    model: int = 0
    loader: int = 1
    train: int = 2

    @classmethod
    def noisy(cls, noise: int | None) -> Seeds:
        return cls() if noise is None else cls(100 + noise, 200 + noise, 300 + noise)


def build_gpt(
    seeds: Seeds, *, fused: bool = False, padded: bool = False, ddp: bool = False
) -> tuple[GPT, torch.optim.AdamW, Any, DataLoader[Any], torch.Generator]:
    """The model, nanoGPT's optimizer, the schedule and a shuffling loader; then the
    global generators seeded for training (per rank under DDP, as nanoGPT does)."""
    torch.manual_seed(seeds.model)
    model = GPT()
    opt = configure_optimizers(model, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup)
    gen = torch.Generator().manual_seed(seeds.loader)
    data = char_dataset(padded=padded)
    loader: DataLoader[Any]
    if ddp:  # shuffled by its seed (configuration, as a script has it) and the epoch
        loader = cudakit.distributed_loader(data, batch_size=BATCH, seed=Seeds().loader)
    else:
        loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=gen)
    offset = torch.distributed.get_rank() if ddp else 0
    torch.manual_seed(seeds.train + offset)
    random.seed(seeds.train + offset)
    return model, opt, sched, loader, gen


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1), ignore_index=-1)


def lm_summed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """HF GPT-2 style: the summed loss over the real tokens, and their count."""
    logits = model(x)
    loss = F.cross_entropy(
        logits.float().view(-1, VOCAB), y.view(-1), ignore_index=-1, reduction="sum"
    )
    return {"loss": loss, "weight": (y != -1).sum()}


def plain_gpt(
    *,
    dtype: torch.dtype = torch.float32,
    accumulate: int = 2,
    epochs: int = 2,
    flush: bool = False,
    weighted: bool = False,
) -> dict[str, Any]:
    """nanoGPT's loop written by hand: the reference maths for the cudakit loop."""
    model, opt, sched, loader, gen = build_gpt(Seeds(), padded=weighted)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses: dict[int, float] = {}
    pending: list[torch.Tensor] = []  # the window's token counts (weighted)

    def finish(count: int) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if weighted:
            total = pending[0]
            for w in pending[1:]:
                total = total + w
            torch._foreach_mul_(grads, torch.reciprocal(total))
            pending.clear()
        elif count != accumulate:  # a partial window: a step on its mean
            torch._foreach_mul_(grads, accumulate / count)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # nanoGPT's, verbatim
        opt.step()
        sched.step()

    micro = 0
    for _ in range(epochs):
        for x, y in loader:
            if micro == 0:
                opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                if weighted:
                    out = lm_summed(model, x, y)
                    loss = out["loss"]
                    pending.append(out["weight"])
                else:
                    loss = lm_loss(model, x, y)
            losses[len(losses) + 1] = float(loss.detach())
            (loss if weighted else loss / accumulate).backward()
            micro += 1
            if micro == accumulate:
                finish(micro)
                micro = 0
        if flush and micro:
            finish(micro)
            micro = 0
    return {
        "model": model, "opt": opt, "sched": sched, "gen": gen, "losses": losses,
        "rng_end": torch.get_rng_state(),
    }  # fmt: skip


def gpt_run(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    accumulate: int = 2,
    epochs: int = 2,
    flush: bool = False,
    every: int | None = None,
    save_at: tuple[int, ...] = (),
    save_after_epoch: tuple[int, ...] = (),
    crash_at: int | None = None,
    noise: int | None = None,
    fused: bool = False,
    spikes: Any = False,
    spike_at: tuple[int, ...] = (),
    weighted: bool = False,
    meter: bool = False,
    ddp: bool = False,
) -> dict[str, Any]:
    """nanoGPT's loop with cudakit: ``autocast_step``, a ``Checkpointer``, optionally a
    ``speed_report`` around the step.

    ``save_at``: ``ckpt.save()`` after the step of these batches (counted over the run);
    ``save_after_epoch``: after these epochs' batches; ``crash_at``: raise :class:`Crash`
    when the loader hands out that batch, before its step; ``noise``: every generator
    seeded otherwise (a new process); ``spike_at``: the loss of these batches times 40.
    """
    model, opt, sched, loader, gen = build_gpt(
        Seeds.noisy(noise), fused=fused, padded=weighted, ddp=ddp
    )
    net: nn.Module = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    step = cudakit.autocast_step(
        opt, model=net, dtype=dtype, accumulate=accumulate, scheduler=sched,
        max_grad_norm=1.0, skip_spikes=spikes,
    )  # fmt: skip

    def compute(x: torch.Tensor, y: torch.Tensor, k: float = 1.0) -> Any:
        if weighted:
            return lm_summed(net, x, y)
        loss = lm_loss(net, x, y)
        return loss * k if k != 1.0 else loss

    train_step: Any = step(compute)
    speed = None
    if meter:
        train_step = cudakit.speed_report(
            samples=len, tokens=lambda x: x.numel(), every=3, file=None
        )(train_step)
        speed = train_step.speed_report
    losses: dict[int, float] = {}
    windows: dict[
        int, tuple[bool, bool, bool]
    ] = {}  # at each window's end: stepped, skipped, spike
    ckpt = cudakit.Checkpointer(
        directory, step=train_step, loader=loader, every=every, preemption=False
    )
    try:
        for epoch in ckpt.epochs(epochs):
            for x, y in ckpt.batches():
                total = ckpt.position.total
                if total == crash_at:
                    raise Crash(total)
                result = train_step(x, y, 40.0 if total in spike_at else 1.0)
                losses[total] = float(result.loss)
                if step.position == 0:
                    windows[total] = (
                        bool(result.stepped),
                        bool(result.skipped),
                        bool(result.spike),
                    )
                if total in save_at:
                    ckpt.save()
            if flush:
                result = train_step.flush()
                if result is not None:
                    windows[ckpt.position.total] = (
                        bool(result.stepped), bool(result.skipped), bool(result.spike),
                    )  # fmt: skip
            if epoch in save_after_epoch:
                ckpt.save()
    finally:
        ckpt.close()
    return {
        "model": model, "opt": opt, "sched": sched, "gen": gen, "step": step, "ckpt": ckpt,
        "losses": losses, "windows": windows, "meter": speed, "rng_end": torch.get_rng_state(),
    }  # fmt: skip


# ----------------------------------------------------------------------------- DCGAN

NZ = 8


def make_gan(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    gen = nn.Sequential(
        nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip  # (B, NZ, 1, 1) -> (B, 1, 8, 8)
    disc = nn.Sequential(
        nn.Conv2d(1, 8, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16),
        nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(16, 1, 2, 1, 0, bias=False), nn.Flatten(),
    )  # fmt: skip  # (B, 1, 8, 8) -> (B, 1)
    for m in (*gen.modules(), *disc.modules()):  # DCGAN's weights_init
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)
    return gen, disc


def build_gan(seeds: Seeds) -> dict[str, Any]:
    netG, netD = make_gan(seeds.model)
    opt_g = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=4, gamma=0.7)
    g = torch.Generator().manual_seed(9)
    images = torch.tanh(torch.randn(24, 1, 8, 8, generator=g))
    gen = torch.Generator().manual_seed(seeds.loader)
    loader = DataLoader(TensorDataset(images), batch_size=4, shuffle=True, generator=gen)
    torch.manual_seed(seeds.train)
    return {
        "G": netG, "D": netD, "opt_g": opt_g, "opt_d": opt_d, "sched_g": sched_g,
        "loader": loader, "gen": gen,
    }  # fmt: skip


def d_loss(netD: nn.Module, netG: nn.Module, real: torch.Tensor) -> dict[str, Any]:
    """The discriminator's loss on a real and a fake batch; the fake, for the G step."""
    b = real.shape[0]
    noise = torch.randn(b, NZ, 1, 1)
    fake = netG(noise)
    err_real = F.binary_cross_entropy_with_logits(netD(real).float(), torch.ones(b, 1))
    err_fake = F.binary_cross_entropy_with_logits(netD(fake.detach()).float(), torch.zeros(b, 1))
    return {"loss": err_real + err_fake, "fake": fake}


def g_loss(netD: nn.Module, fake: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(netD(fake).float(), torch.ones(fake.shape[0], 1))


def plain_gan(*, dtype: torch.dtype = torch.float32, epochs: int = 2) -> dict[str, Any]:
    """pytorch/examples' DCGAN loop written by hand (one backward on D's summed loss)."""
    o = build_gan(Seeds())
    losses: dict[int, tuple[float, float]] = {}
    for _ in range(epochs):
        for (real,) in o["loader"]:
            o["opt_d"].zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                out = d_loss(o["D"], o["G"], real)
            out["loss"].backward()
            o["opt_d"].step()
            o["opt_g"].zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                err_g = g_loss(o["D"], out["fake"])
            err_g.backward()
            o["opt_g"].step()
            o["sched_g"].step()
            losses[len(losses) + 1] = (float(out["loss"].detach()), float(err_g.detach()))
    o["losses"] = losses
    o["rng_end"] = torch.get_rng_state()
    return o


def gan_run(
    directory: Path,
    *,
    dtype: torch.dtype = torch.float32,
    epochs: int = 2,
    every: int | None = None,
    crash_at: int | None = None,
    noise: int | None = None,
) -> dict[str, Any]:
    """The DCGAN loop with two ``autocast_step`` objects and one ``Checkpointer``."""
    o = build_gan(Seeds.noisy(noise))
    netG, netD = o["G"], o["D"]
    d_step = cudakit.autocast_step(o["opt_d"], model=netD, dtype=dtype)
    g_step = cudakit.autocast_step(o["opt_g"], model=netG, dtype=dtype, scheduler=o["sched_g"])
    train_d = d_step(lambda real: d_loss(netD, netG, real))
    train_g = g_step(lambda fake: g_loss(netD, fake))
    ckpt = cudakit.Checkpointer(
        directory, step=[train_d, train_g], model={"G": netG, "D": netD},
        loader=o["loader"], every=every, preemption=False,
    )  # fmt: skip
    losses: dict[int, tuple[float, float]] = {}
    try:
        for _ in ckpt.epochs(epochs):
            for (real,) in ckpt.batches():
                total = ckpt.position.total
                if total == crash_at:
                    raise Crash(total)
                rd = train_d(real)
                rg = train_g(rd.output["fake"])
                losses[total] = (float(rd.loss), float(rg.loss))
    finally:
        ckpt.close()
    o.update(ckpt=ckpt, losses=losses, d_step=d_step, g_step=g_step, rng_end=torch.get_rng_state())
    return o


# ----------------------------------------------------------------------------- comparing


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested states differ (tensors by torch.equal, with dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return [f"{where}: tensors differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def training_state(run: dict[str, Any], models: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """Everything the rest of a run depends on: weights, buffers, optimizer and scheduler
    state, the step's state, and the generators."""
    state: dict[str, Any] = {}
    for name in models:
        state[name] = dict(run[name].state_dict())
    for key in ("opt", "opt_g", "opt_d"):
        if key in run:
            state[key] = run[key].state_dict()
    for key in ("sched", "sched_g"):
        if key in run:
            state[key] = run[key].state_dict()
    for key in ("step", "d_step", "g_step"):
        if key in run:
            state[key] = run[key].state_dict()
    state["rng"] = run["rng_end"]
    state["loader_rng"] = run["gen"].get_state()
    return state
