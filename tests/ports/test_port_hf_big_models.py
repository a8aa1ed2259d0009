"""Hugging Face models through cudakit's big-model path: built on meta, sharded, loaded.

Ports the user's side of transformers' own meta-device story (``from_config`` on
meta, ``save_pretrained``/``from_pretrained``, ``gradient_checkpointing_enable``)
onto ``parallelize``, ``materialize``, ``load_pretrained``, ``save_pretrained``,
``recompute`` and ``estimate_memory``, with tiny configs (hidden 32, 2 layers,
vocab 128). Each launch builds every model once and returns what the parent compares.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import port_hf_helpers as hf  # noqa: E402  (imports transformers)

import cudakit.parallel as cp  # noqa: E402

KINDS = ["llama", "gpt2", "bert", "qwen2"]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        assert torch.equal(got[key], value), (what, key)


# --------------------------------------------------------------------------- init on meta


@pytest.mark.parametrize("kind", KINDS)
def test_a_meta_built_hf_model_is_initialised_by_its_own_init_weights(kind: str) -> None:
    model = cp.parallelize(hf.build(kind), "none", device="cpu", init_seed=3)
    _assert_equal(hf.tensors(model), hf.tensors(hf.hand_init(kind, 3)), kind)
    assert not any(t.is_meta for t in hf.tensors(model).values())
    normal = hf.build(kind, meta=False)  # buffers (RoPE's inv_freq, position ids) as built
    for key, value in normal.named_buffers():
        assert torch.equal(dict(model.named_buffers())[key], value), key
    if kind in ("gpt2", "qwen2"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    hf.loss_of(kind, model).backward()


def test_gpt2s_scaled_residual_init_reaches_the_projections() -> None:
    # GPT2Attention holds no tensor itself: its _init_weights rescales c_proj's.
    model = cp.materialize(hf.build("gpt2"), "cpu", init_seed=0)
    proj = model.transformer.h[0].attn.c_proj.weight
    attn = model.transformer.h[0].attn.c_attn.weight
    assert proj.std() < 0.6 * attn.std()  # 0.02 / sqrt(2 * 2 layers) against 0.02


def test_passing_init_weights_yourself_is_the_default() -> None:
    model = hf.build("gpt2")
    model = cp.materialize(model, "cpu", init=model._init_weights, init_seed=3)
    _assert_equal(hf.tensors(model), hf.tensors(hf.hand_init("gpt2", 3)), "gpt2")
