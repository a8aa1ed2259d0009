"""Tiny Hugging Face models, batches and the hand-written loops HF users write.

The models are transformers' own classes (``LlamaForCausalLM``, ``GPT2LMHeadModel``
with its tied embeddings, ``BertForSequenceClassification``, ``BertForMaskedLM``,
``T5ForConditionalGeneration``) built from tiny configs, dropout on, so a test trains
one in well under a second on a busy 2-core CPU. The batches are what a tokenizer and
``transformers.default_data_collator`` hand a loop: ``input_ids``, ``attention_mask``
with padding, ``labels`` with -100 on the padding. Nothing is downloaded.

The hand-written loop is the one of transformers' ``run_clm_no_trainer.py`` example
without accelerate: ``model(**batch).loss``, divided by the accumulation steps,
``clip_grad_norm_``, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()``; the optimizer groups are the Trainer's (no weight decay for
biases and norms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import transformers
from torch import nn

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 128, 32, 2, 4, 8, 2
FP32, BF16 = torch.float32, torch.bfloat16


def llama(
    seed: int = 0, *, attn: str = "eager", dropout: float = 0.1, layers: int = LAYERS
) -> nn.Module:
    """A 2-layer ``LlamaForCausalLM`` (grouped-query attention, RMSNorm, SwiGLU)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
        max_position_embeddings=4 * SEQ, attention_dropout=dropout,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).train()


def gpt2(seed: int = 0, *, attn: str = "eager", dropout: float = 0.1) -> nn.Module:
    """A 2-layer ``GPT2LMHeadModel``: ``lm_head.weight`` is ``transformer.wte.weight``."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).train()


def _bert_config(dropout: float) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
        max_position_embeddings=4 * SEQ, num_labels=3, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, pad_token_id=0,
    )  # fmt: skip


def bert_classifier(seed: int = 0, *, dropout: float = 0.1) -> nn.Module:
    """A 2-layer ``BertForSequenceClassification`` with 3 labels."""
    config = _bert_config(dropout)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config).train()


def bert_mlm(seed: int = 0, *, dropout: float = 0.1) -> nn.Module:
    """A 2-layer ``BertForMaskedLM`` (its decoder tied to the word embeddings)."""
    config = _bert_config(dropout)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(config).train()


def t5(seed: int = 0, *, dropout: float = 0.1) -> nn.Module:
    """A 2-layer ``T5ForConditionalGeneration`` (relative attention bias, shared embeddings)."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=dropout,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(config).train()


# ----------------------------------------------------------------------------- batches


def _padded(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded with 0 to SEQ, and their attention mask."""
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    return ids * mask, mask


def lm_batches(n: int, *, seed: int = 0, batch: int = BATCH) -> list[transformers.BatchEncoding]:
    """Causal-LM batches as a tokenizer and collator give them: labels -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, mask = _padded(gen, batch)
        labels = ids.masked_fill(mask == 0, -100)
        out.append(
            transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})
        )
    return out


def cls_batches(n: int, *, seed: int = 0, batch: int = BATCH) -> list[dict[str, torch.Tensor]]:
    """Sequence-classification batches (``token_type_ids`` too), as plain dicts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, mask = _padded(gen, batch)
        out.append(
            {
                "input_ids": ids,
                "token_type_ids": torch.zeros_like(ids),
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (batch,), generator=gen),
            }
        )
    return out


def mlm_batches(n: int, *, seed: int = 0, batch: int = BATCH) -> list[dict[str, torch.Tensor]]:
    """Masked-LM batches: a quarter of the tokens replaced by [MASK] (3), the rest -100."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, mask = _padded(gen, batch)
        chosen = (torch.rand(ids.shape, generator=gen) < 0.25) & (mask == 1)
        chosen[:, 0] = True  # at least one masked token per row
        out.append(
            {
                "input_ids": ids.masked_fill(chosen, 3),
                "attention_mask": mask,
                "labels": ids.masked_fill(~chosen, -100),
            }
        )
    return out


def seq2seq_batches(n: int, *, seed: int = 0, batch: int = BATCH) -> list[dict[str, torch.Tensor]]:
    """Translation-style batches: source ids with a mask, target labels -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, mask = _padded(gen, batch)
        target, target_mask = _padded(gen, batch)
        out.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": target.masked_fill(target_mask == 0, -100),
            }
        )
    return out


# ----------------------------------------------------------------------------- the loop


def decay_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """The Trainer's optimizer groups: no weight decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        skip = name.endswith("bias") or "norm" in lowered or ".ln_" in lowered
        (no_decay if skip else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw(model: nn.Module, lr: float = 1e-2, **kw: Any) -> torch.optim.AdamW:
    """AdamW over the Trainer's decay / no-decay groups."""
    return torch.optim.AdamW(decay_groups(model), lr=lr, **kw)


def linear_warmup(optimizer: torch.optim.Optimizer, total: int) -> Any:
    """transformers' ``get_linear_schedule_with_warmup`` with a 2-step warm-up."""
    return transformers.get_linear_schedule_with_warmup(optimizer, 2, total)


def hand_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    *,
    scheduler: Any = None,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    dtype: torch.dtype = FP32,
    seed: int = 0,
    loss_of: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    skip: Callable[[int, torch.Tensor], bool] | None = None,
) -> list[torch.Tensor]:
    """run_clm_no_trainer's loop by hand; returns the losses (detached).

    ``skip(window, loss)`` says to drop a window after its backward (what a guard does
    by hand): no clipping, no optimizer or scheduler step, the gradients cleared.
    """
    torch.manual_seed(seed)  # dropout
    losses: list[torch.Tensor] = []
    window_losses: list[torch.Tensor] = []
    for i, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != FP32):
            loss = model(**batch).loss if loss_of is None else loss_of(model, batch)
        losses.append(loss.detach())
        window_losses.append(loss.detach())
        (loss / accumulate).backward()
        if (i + 1) % accumulate:
            continue
        window = (i + 1) // accumulate - 1
        bad = skip is not None and skip(window, torch.stack(window_losses))
        window_losses.clear()
        if not bad:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def mismatched(a: nn.Module, b: nn.Module) -> list[str]:
    """The names of the parameters and buffers that differ between two models (bitwise)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


# ----------------------------------------------------------------------------- resuming

EXAMPLES = 12  # 6 batches an epoch: windows of 2 close on the epoch's end


class Crash(Exception):
    """Stands for a process killed mid-run."""


def lm_examples() -> list[dict[str, torch.Tensor]]:
    """Single examples as a tokenized ``datasets.Dataset`` yields them."""
    return [{k: v[0] for k, v in batch.items()} for batch in lm_batches(EXAMPLES, seed=9, batch=1)]


def build_run(seed: int) -> dict[str, Any]:
    """A tiny Llama, AdamW with the Trainer's groups, the HF schedule and a shuffling
    loader collated by ``default_data_collator``; then the global RNG seeded (dropout).
    ``seed`` stands for a process: a resumed run starts from other seeds."""
    model = llama(seed)
    opt = adamw(model)
    sched = linear_warmup(opt, 6)
    gen = torch.Generator().manual_seed(1 + seed)
    loader = torch.utils.data.DataLoader(
        lm_examples(), batch_size=BATCH, shuffle=True, generator=gen,
        collate_fn=transformers.default_data_collator,
    )  # fmt: skip
    torch.manual_seed(2 + seed)
    return {"model": model, "opt": opt, "sched": sched, "loader": loader, "gen": gen}


def hand_run(epochs: int = 2) -> dict[str, Any]:
    """The loop of ``build_run`` written by hand, never stopped."""
    run = build_run(0)
    model, opt, sched = run["model"], run["opt"], run["sched"]
    micro = 0
    for _ in range(epochs):
        for batch in run["loader"]:
            (model(**batch).loss / 2).backward()
            micro += 1
            if micro % 2 == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
    return run | {"rng_end": torch.get_rng_state()}


def cudakit_run(
    directory: Any, *, seed: int = 0, crash_at: int | None = None, epochs: int = 2
) -> dict[str, Any]:
    """``build_run``'s loop with ``autocast_step`` and a ``Checkpointer`` saving every 2
    optimizer steps; ``crash_at``: abandon the run when that batch (counted over the
    run) comes, before its step."""
    import cudakit

    run = build_run(seed)
    model = run["model"]
    step = cudakit.autocast_step(
        run["opt"], model=model, scheduler=run["sched"], accumulate=2, max_grad_norm=1.0,
        dtype=FP32,
    )  # fmt: skip
    train_step = step(lambda batch: model(**batch))
    ckpt = cudakit.Checkpointer(
        directory, step=train_step, loader=run["loader"], every=2, preemption=False, file=None
    )
    try:
        for _ in ckpt.epochs(epochs):
            for batch in ckpt.batches():
                if ckpt.position.total == crash_at:
                    raise Crash(crash_at)
                train_step(batch)
    finally:
        ckpt.close()
    return run | {"step": step, "ckpt": ckpt, "rng_end": torch.get_rng_state()}


def run_state(run: dict[str, Any]) -> dict[str, Any]:
    """What the rest of a run depends on: weights, optimizer, schedule, RNGs."""
    return {
        "model": dict(run["model"].state_dict()),
        "opt": run["opt"].state_dict(),
        "sched": run["sched"].state_dict(),
        "rng": run["rng_end"],
        "loader_rng": run["gen"].get_state(),
    }
