"""Tiny Hugging Face models for the big-model port, and what their launched ranks run.

Imported by tests/ports/test_port_hf_big_models.py and by the gloo ranks it
launches; every config is small (hidden 32, 2 layers, vocab 128) so a model builds
in milliseconds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel._init_watch import module_seed

logging.getLogger("transformers").setLevel(logging.ERROR)  # tiny vocabularies warn

VOCAB = 128


def config(kind: str) -> Any:
    """The tiny config of ``kind``: "llama", "gpt2" (tied embeddings), "bert", "qwen2"
    (tied); no dropout, so a loss is the same in train and eval mode."""
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    if kind == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    raise ValueError(kind)


CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertModel",
}


def build(kind: str, meta: bool = True) -> nn.Module:
    """The model of ``kind``, built on the meta device or normally (HF's own init)."""
    cls = getattr(transformers, CLASSES[kind])
    if meta:
        with torch.device("meta"):
            return cls(config(kind))
    torch.manual_seed(0)
    return cls(config(kind))


def post_order(model: nn.Module, name: str = "") -> list[tuple[str, nn.Module]]:
    """Children before their parent, as HF's ``initialize_weights`` visits them."""
    out: list[tuple[str, nn.Module]] = []
    for child_name, child in model.named_children():
        out += post_order(child, f"{name}.{child_name}" if name else child_name)
    return [*out, (name, model)]


def hand_init(kind: str, seed: int) -> nn.Module:
    """The reference: a normally built model, then each module, children first, seeded
    from its name and initialised by the nearest ``_init_weights`` (a tied output
    embedding is the input one's, so its module is skipped)."""
    model = build(kind, meta=False)
    owners: dict[str, Any] = {}
    tied = getattr(model.get_output_embeddings(), "weight", None) is getattr(
        model.get_input_embeddings(), "weight", 0
    )
    for name, module in model.named_modules():
        parent = owners.get(name.rpartition(".")[0], model)
        owners[name] = module if hasattr(module, "_init_weights") else parent
    with torch.no_grad():
        for name, module in post_order(model):
            if tied and module is model.get_output_embeddings():
                continue
            torch.manual_seed(module_seed(seed, name))
            owners[name]._init_weights(module)
    return model


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, persistent or not, by name (cloned)."""
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({k: v.detach().clone() for k, v in model.named_buffers()})
    return out


def batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids} if kind == "bert" else {"input_ids": ids, "labels": ids}


def loss_of(kind: str, model: nn.Module) -> torch.Tensor:
    out = model(**batch(kind))
    return out.loss if kind != "bert" else out.last_hidden_state.square().mean()


def _gathered(kind: str, model: nn.Module) -> dict[str, Any]:
    inner = cp.unwrap(model)
    loss = loss_of(kind, model)
    loss.backward()
    return {
        "full": {k: v.clone() for k, v in cp.state_dict(model).items()},
        "buffers": {k: v.clone() for k, v in inner.named_buffers()},
        "meta": [k for k, v in inner.state_dict().items() if v.is_meta],
        "tied": getattr(inner.get_output_embeddings(), "weight", None)
        is getattr(inner.get_input_embeddings(), "weight", 0),
        "loss": loss.detach().clone(),
        "sharded": all(hasattr(p, "to_local") for p in inner.parameters()),
        "grads": all(p.grad is not None for p in inner.parameters()),
    }


def ranks(root: str | None, kinds: list[str], seed: int) -> dict[str, Any]:
    """On every rank: each model built on meta and sharded by parallelize(), then
    gathered; with ``root``, also one loaded from transformers' files in
    ``root/hf-<kind>`` and written back to ``root/out-<kind>``."""
    out: dict[str, Any] = {}
    with cp.process_group(timeout=120):
        for kind in kinds:
            model = cp.parallelize(build(kind), "fsdp", init_seed=seed)
            out[kind] = _gathered(kind, model)
            if root is None:
                continue
            model = cp.parallelize(build(kind), "fsdp", init_seed=seed + 1)
            res = cp.load_pretrained(model, Path(root) / f"hf-{kind}")
            out[f"{kind}-loaded"] = _gathered(kind, model)
            out[f"{kind}-loaded"]["bytes"] = res.bytes_read
            target = Path(root) / f"out-{kind}"
            cp.save_pretrained(model, target, max_shard_size=20_000)
            if cp.is_main_process():
                cp.unwrap(model).config.save_pretrained(target)
    return out
