"""A tiny torchtitan Llama 3, its init, and torchtitan's training flow written by hand.

The model follows torchtitan/models/llama3/model/model.py (before the config refactor
of #2386): ``Transformer`` holds a non-persistent complex ``freqs_cis`` RoPE buffer,
its blocks sit in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (for pipeline
splits), and ``init_weights(buffer_device=None)`` is the root's init: ``freqs_cis``
recomputed on the buffer device, the embedding ``normal_``, each block's norms reset,
``wq``/``wk``/``wv``/``w1`` ``trunc_normal_(std=0.02)``, ``wo``/``w2``/``w3`` at the
block's depth-scaled std, the output at ``dim ** -0.5`` cut at three stds.

``titan_init(module, name)`` is the same rules as cudakit's ``init=`` takes them, one
module at a time; ``titan_flow_*`` is torchtitan's trainer written by hand (train.py:
``zero_grad``, micro-batches with the loss rescaled by the accumulation steps,
``dist_utils.clip_grad_norm_`` with ``foreach=True``, AdamW, warmup ``LambdaLR``).
The ranks import this module, so the bodies live here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import cudakit
import cudakit.parallel as cp

SEED = 3
DIM, LAYERS, HEADS, VOCAB, SEQ = 32, 2, 4, 128, 16
BATCH = 4  # per micro-batch and rank
ACCUMULATE = 2
STEPS = 4  # optimizer steps
WARMUP = 3
MAX_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class Args:
    dim: int = DIM
    n_layers: int = LAYERS
    n_heads: int = HEADS
    vocab_size: int = VOCAB
    max_seq_len: int = SEQ
    multiple_of: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    depth_init: bool = True


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    """RoPE's rotations as complex64, one row per position (on the current device)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    rot = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, q.shape[-1])
    return (
        torch.view_as_real(q * rot).flatten(3).type_as(xq),
        torch.view_as_real(k * rot).flatten(3).type_as(xk),
    )


def trunc_normal_(tensor: torch.Tensor, std: float, a: float = -2.0, b: float = 2.0) -> None:
    """torchtitan's: drawn in float32, then copied into the tensor's dtype."""
    tmp = tensor.float()
    nn.init.trunc_normal_(tmp, mean=0.0, std=std, a=a, b=b)
    tensor.copy_(tmp)


class Attention(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        shape = (bs, seqlen, self.n_heads, self.head_dim)
        q, k = apply_rotary_emb(self.wq(x).view(shape), self.wk(x).view(shape), freqs_cis)
        v = self.wv(x).view(shape)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, multiple_of: int) -> None:
        super().__init__()
        hidden = int(2 * hidden / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Args) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: Args = Args()) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def titan_init(module: nn.Module, name: str) -> None:
    """``Transformer.init_weights``'s rules, for the one module cudakit hands over.

    What a torchtitan user writes for ``parallelize(init=...)``: each module that holds
    tensors gets the call ``init_weights`` would make for it. In ``named_modules()``
    order these calls draw what ``init_weights()`` draws, in its order.
    """
    if isinstance(module, Transformer):  # the root holds freqs_cis
        with torch.device(module.freqs_cis.device):
            module.freqs_cis = module._precompute_freqs_cis()
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight)
    elif isinstance(module, nn.RMSNorm):
        module.reset_parameters()
    elif name == "output":
        std = DIM**-0.5
        trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
    else:  # layers.<i>.attention.wq, ..., layers.<i>.feed_forward.w3
        assert isinstance(module, nn.Linear), name
        _, layer_id, _, leaf = name.split(".")
        wide = leaf in ("wq", "wk", "wv", "w1")
        std = 0.02 if wide else 0.02 / (2 * (int(layer_id) + 1)) ** 0.5
        trunc_normal_(module.weight, std=std)


def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer()


def own_tensors(module: nn.Module) -> bool:
    return bool(module._parameters or module._buffers)


def seeded_reference(seed: int = SEED) -> Transformer:
    """What docs/big-models.md says cudakit's init gives: a CPU build, then each module
    that holds tensors seeded by ``module_seed(seed, name)`` and initialised."""
    from cudakit.parallel._init_watch import module_seed

    model = Transformer()
    state = torch.get_rng_state()
    try:
        with torch.no_grad():
            for name, module in model.named_modules():
                if own_tensors(module):
                    torch.manual_seed(module_seed(seed, name))
                    titan_init(module, name)
    finally:
        torch.set_rng_state(state)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered, and every buffer (freqs_cis is not in state_dict())."""
    out = {k: v.detach().clone() for k, v in cp.state_dict(model).items()}
    for name, buf in cp.unwrap(model).named_buffers():
        out.setdefault(name, buf.detach().clone())
    return out


# --------------------------------------------------------------------------- training


def batches(rank: int = 0, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches: inputs and next-token labels, fixed by the seed."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps * ACCUMULATE):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross_entropy_loss: logits in float32, the mean over tokens."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def warmup_lambda(step: int) -> float:
    """torchtitan's linear_warmup_stable_decay, warmup then stable."""
    return (step + 1) / WARMUP if step < WARMUP else 1.0


def optimizer_and_scheduler(model: nn.Module) -> tuple[torch.optim.AdamW, Any]:
    """torchtitan's defaults: AdamW(lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)


def titan_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's dist_utils.clip_grad_norm_ without pipeline or expert parallelism."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    full = getattr(total, "full_tensor", None)
    if full is not None:  # a DTensor: reduced over the ranks
        total = full()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, True)
    return total


def titan_steps(
    model: nn.Module, data: list[Any], dtype: torch.dtype, *, sync_each: bool = False
) -> list[torch.Tensor]:
    """torchtitan's train_step, ``STEPS`` times; the summed loss of each step.

    Under FSDP2 the micro-batches before the last skip the reduce-scatter
    (``set_requires_gradient_sync(False)``), as cudakit does; ``sync_each`` is
    torchtitan's own, which reduce-scatters every micro-batch.
    """
    opt, sched = optimizer_and_scheduler(model)
    params = list(model.parameters())
    fsdp = hasattr(model, "set_requires_gradient_sync")
    losses = []
    it = iter(data)
    for _ in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            tokens, labels = next(it)
            if fsdp and not sync_each:
                model.set_requires_gradient_sync(micro == ACCUMULATE - 1)  # type: ignore[operator]
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_fn(model(tokens), labels) / ACCUMULATE
            loss.backward()
            total += loss.detach()
        titan_clip(params, MAX_NORM)
        opt.step()
        sched.step()
        losses.append(total)
    return losses


def cudakit_steps(model: nn.Module, data: list[Any], dtype: torch.dtype) -> list[torch.Tensor]:
    """The same run through ``autocast_step``: the summed loss of each step."""
    opt, sched = optimizer_and_scheduler(model)
    step = cudakit.autocast_step(
        opt,
        model=model,
        scheduler=sched,
        dtype=dtype,
        accumulate=ACCUMULATE,
        max_grad_norm=MAX_NORM,
    )

    @step
    def train_step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(tokens), labels)

    losses = []
    total = torch.zeros(())
    for tokens, labels in data:
        result = train_step(tokens, labels)
        total += result.loss.detach() / ACCUMULATE
        if step.position == 0:
            losses.append(total)
            total = torch.zeros(())
    return losses


def shard_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """torchtitan's seed-checkpoint load: each rank keeps its rows of the full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    persistent = {k: v for k, v in state.items() if k != "freqs_cis"}
    set_model_state_dict(model, persistent, options=StateDictOptions(full_state_dict=True))


def titan_fsdp_model(state: dict[str, torch.Tensor]) -> nn.Module:
    """torchtitan's build: on meta, ``fully_shard`` per block then the root,
    ``to_empty``, the buffers recomputed, the weights (a seed checkpoint) loaded."""
    from torch.distributed.fsdp import fully_shard

    model = meta_model()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.freqs_cis = model._precompute_freqs_cis()
    shard_full_state(model, state)
    return model


def units(model: nn.Module) -> list[str]:
    """The names of the FSDP2 units of ``model`` (the root is ``""``)."""
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in cp.unwrap(model).named_modules() if isinstance(m, FSDPModule)]


# --------------------------------------------------------------------------- the ranks


def build_everywhere() -> dict[str, Any]:
    """On every rank: the meta model through ``parallelize`` with ``titan_init``."""
    model = cp.parallelize(meta_model(), "fsdp", init=titan_init, init_seed=SEED)
    out = {"state": full_state(model), "units": units(model)}
    out["freqs_cis"] = cp.unwrap(model).freqs_cis.clone()
    logits = model(batches(cp.rank(), 1)[0][0])
    out["finite"] = bool(torch.isfinite(logits).all())
    return out


def train_everywhere(dtype: torch.dtype) -> dict[str, Any]:
    """On every rank: cudakit's FSDP2 run and the hand-written one, from equal weights."""
    data = batches(cp.rank())
    model = cp.parallelize(meta_model(), "fsdp", init=titan_init, init_seed=SEED)
    full = full_state(model)  # a collective: rank 0 gets the whole state
    box = [full if cp.rank() == 0 else {}]
    torch.distributed.broadcast_object_list(box, src=0)
    ours = cudakit_steps(model, data, dtype)
    theirs_model = titan_fsdp_model(box[0])
    theirs = titan_steps(theirs_model, data, dtype)
    out = {"ours": ours, "theirs": theirs, "ours_state": full_state(model)}
    out["theirs_state"] = full_state(theirs_model)
    if dtype == torch.float32:  # torchtitan's own: a reduce-scatter every micro-batch
        titan_model = titan_fsdp_model(box[0])
        out["sync_each"] = titan_steps(titan_model, data, dtype, sync_each=True)
    return out


# --------------------------------------------------------------------------- checkpoints


class Crash(Exception):
    """A run stopped half-way: its objects are abandoned, not closed."""


def checkpointed_run(directory: str, crash_at: int | None = None) -> dict[str, Any]:
    """torchtitan's trainer through cudakit: built on meta, ``parallelize``d, a
    ``Checkpointer`` saving every 2 optimizer steps over ``batches(steps=STEPS)``.

    ``crash_at``: raise :class:`Crash` when that batch (counted over the run) comes.
    Returns the loss of each optimizer step this run made, and the final state.
    """
    strategy = "fsdp" if cp.world_size() > 1 else "none"
    model = cp.parallelize(meta_model(), strategy, device="cpu", init=titan_init, init_seed=SEED)
    opt, sched = optimizer_and_scheduler(model)
    step = cudakit.autocast_step(
        opt, model=model, scheduler=sched, accumulate=ACCUMULATE, max_grad_norm=MAX_NORM
    )

    @step
    def train_step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(tokens), labels)

    data = batches(cp.rank())
    dataset = torch.utils.data.TensorDataset(
        torch.cat([t for t, _ in data]), torch.cat([lab for _, lab in data])
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    ckpt = cudakit.Checkpointer(
        directory, step=train_step, loader=loader, every=2, preemption=False, file=None
    )
    losses: dict[int, torch.Tensor] = {}
    total = torch.zeros(())
    for tokens, labels in ckpt.batches(steps=STEPS):
        if ckpt.position.total == crash_at:
            raise Crash(crash_at)
        total += train_step(tokens, labels).loss.detach() / ACCUMULATE
        if step.position == 0:
            losses[ckpt.position.windows] = total
            total = torch.zeros(())
    ckpt.close()
    return {"losses": losses, "state": full_state(model), "opt": _opt_state(model, opt)}


def _opt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state, gathered to full tensors (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = cp.unwrap(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(get_optimizer_state_dict(inner, opt, options=options))


def resume_everywhere(fresh: str, crashed: str) -> dict[str, Any]:
    """On every rank: an uninterrupted run, and a run stopped after its step-2 save,
    abandoned, then built again on meta and resumed from its directory."""
    whole = checkpointed_run(fresh)
    with contextlib.suppress(Crash):
        checkpointed_run(crashed, crash_at=5)  # the save of step 2 is behind it
    resumed = checkpointed_run(crashed)
    return {"whole": whole, "resumed": resumed}


def reshard_everywhere(saved: str) -> dict[str, Any]:
    """On every rank, at another world size than ``saved`` was written at: the model
    weights of its step-2 and last checkpoints through ``load_pretrained``, and the
    Checkpointer's verdict on each whole checkpoint."""
    from cudakit.exceptions import CheckpointError

    out: dict[str, Any] = {}
    for name in ("ckpt-0000000002", f"ckpt-{STEPS:010d}"):
        model = cp.parallelize(meta_model(), "fsdp", init=titan_init, init_seed=SEED + 1)
        cp.load_pretrained(model, f"{saved}/{name}")
        weights = full_state(model)
        opt, sched = optimizer_and_scheduler(model)
        step = cudakit.autocast_step(opt, model=model, scheduler=sched)
        ckpt = cudakit.Checkpointer(f"{saved}-{name}", step=step, preemption=False, file=None)
        try:
            ckpt.load(f"{saved}/{name}")
            verdict = "loaded"
        except CheckpointError as e:
            verdict = str(e)
        ckpt.close()
        out[name] = {"weights": weights, "verdict": verdict, "state": full_state(model)}
        out[name]["opt"] = _opt_state(model, opt)
    return out


def seed_checkpoint(folder: str) -> Transformer:
    """torchtitan's ``--checkpoint.create_seed_checkpoint``: one process builds the model
    on the CPU, ``init_weights()`` under one seed, and writes it; here as safetensors."""
    torch.manual_seed(SEED)
    model = Transformer()
    with torch.no_grad():
        model.init_weights()
    cp.save_pretrained(model, folder)
    return model


def seeded_everywhere(folder: str) -> dict[str, Any]:
    """On every rank: built on meta, ``parallelize``d, the seed checkpoint loaded."""
    model = cp.parallelize(meta_model(), "fsdp", init=titan_init, init_seed=SEED + 1)
    result = cp.load_pretrained(model, folder)
    return {"state": full_state(model), "missing": list(result.missing_keys)}


def at_two_ranks(directory: str) -> dict[str, Any]:
    """Everything the tests ask of 2 ranks, in one launch (spawning costs seconds)."""
    with cp.process_group(timeout=60):
        return {
            "build": build_everywhere(),
            "fp32": train_everywhere(torch.float32),
            "bf16": train_everywhere(torch.bfloat16),
            "resume": resume_everywhere(f"{directory}/fresh", f"{directory}/crashed"),
            "seeded": seeded_everywhere(f"{directory}/seed"),
        }


def at_three_ranks(directory: str) -> dict[str, Any]:
    """Everything the tests ask of 3 ranks (uneven shards: 32 rows are 11, 11, 10)."""
    with cp.process_group(timeout=60):
        return {
            "build": build_everywhere(),
            "reshard": reshard_everywhere(f"{directory}/fresh"),
            "seeded": seeded_everywhere(f"{directory}/seed"),
        }
