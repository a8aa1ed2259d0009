"""Hugging Face models through cudakit's big-model path: built on meta, sharded, loaded.

Ports the user's side of transformers' own meta-device story (``from_config`` on
meta, ``save_pretrained``/``from_pretrained``, ``gradient_checkpointing_enable``)
onto ``parallelize``, ``materialize``, ``load_pretrained``, ``save_pretrained``,
``recompute`` and ``estimate_memory``, with tiny configs (hidden 32, 2 layers,
vocab 128). Each launch builds every model once and returns what the parent compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import port_hf_models as hf  # noqa: E402  (imports transformers)

import cudakit.memory as cp_memory  # noqa: E402
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


# --------------------------------------------------------------------------- pretrained


def _hf_folder(kind: str, root: Path) -> tuple[Path, Any]:
    """A model built normally and written by transformers in shards of 50 kB."""
    model = hf.build(kind, meta=False)
    folder = root / f"hf-{kind}"
    model.save_pretrained(folder, max_shard_size="50KB")
    return folder, type(model).from_pretrained(folder)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_transformers_sharded_files_load_into_a_meta_built_model(kind: str, tmp_path: Path) -> None:
    folder, ref = _hf_folder(kind, tmp_path)
    assert (folder / "model.safetensors.index.json").exists()
    model = cp.parallelize(hf.build(kind), "none", device="cpu", init_seed=1)
    result = cp.load_pretrained(model, folder)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    _assert_equal(hf.tensors(model), hf.tensors(ref), kind)
    assert torch.equal(hf.loss_of(kind, model), hf.loss_of(kind, ref))


def test_a_base_models_file_loads_into_its_head_model_and_back(tmp_path: Path) -> None:
    base = transformers.LlamaModel(hf.config("llama"))
    base.save_pretrained(tmp_path / "base")
    model = cp.materialize(hf.build("llama"), "cpu")
    head_before = model.lm_head.weight.clone()
    result = cp.load_pretrained(model, tmp_path / "base", strict=False)
    assert result.missing_keys == ["lm_head.weight"]
    assert torch.equal(model.lm_head.weight, head_before)
    _assert_equal(hf.tensors(model.model), hf.tensors(base), "model.")
    # The head model's file into the base model: "model." found, keys outside it
    # (lm_head) left alone, as documented.
    model.save_pretrained(tmp_path / "head")
    again = cp.materialize(_meta_base(), "cpu", init_seed=4)
    result = cp.load_pretrained(again, tmp_path / "head")
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    _assert_equal(hf.tensors(again), hf.tensors(model.model), "base")


def _meta_base() -> Any:
    with torch.device("meta"):
        return transformers.LlamaModel(hf.config("llama"))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_cudakit_save_pretrained_loads_with_from_pretrained(kind: str, tmp_path: Path) -> None:
    model = cp.parallelize(hf.build(kind), "none", device="cpu", init_seed=2)
    files = cp.save_pretrained(model, tmp_path, max_shard_size=20_000)
    model.config.save_pretrained(tmp_path)  # from_pretrained needs config.json
    assert len(files) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_equal(hf.tensors(loaded), hf.tensors(model), kind)
    if kind == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


# --------------------------------------------------------------------------- FSDP2 over gloo


def _one_process(kind: str, seed: int) -> dict[str, torch.Tensor]:
    model = cp.parallelize(hf.build(kind), "none", device="cpu", init_seed=seed)
    return model.state_dict()


def _check_rank(kind: str, res: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    """One rank's result; rank 0's state dict is the full one, the others' empty."""
    if res["full"]:
        _assert_equal(res["full"], want, kind)
    assert res["meta"] == [], kind
    assert res["sharded"], kind
    assert res["grads"], kind
    normal = hf.build(kind, meta=False)  # non-persistent buffers as built
    _assert_equal(res["buffers"], dict(normal.named_buffers()), kind)
    assert res["tied"] == (kind in ("gpt2", "qwen2")), kind
    normal.load_state_dict(want)
    assert torch.equal(res["loss"], hf.loss_of(kind, normal)), kind


@pytest.mark.distributed
def test_fsdp_over_two_ranks_inits_loads_and_saves_hf_models(tmp_path: Path) -> None:
    kinds = ["llama", "gpt2"]
    refs = {kind: _hf_folder(kind, tmp_path)[1] for kind in kinds}
    results = cp.launch(hf.ranks, str(tmp_path), kinds, 5, nprocs=2, timeout=150)
    for kind in kinds:
        want = _one_process(kind, 5)
        loaded = refs[kind].state_dict()
        assert results[0][kind]["full"]
        assert results[0][f"{kind}-loaded"]["full"]
        for res in results:
            _check_rank(kind, res[kind], want)
            _check_rank(kind, res[f"{kind}-loaded"], loaded)
        total = sum(v.nbytes for k, v in loaded.items() if k != "lm_head.weight" or kind != "gpt2")
        assert sum(res[f"{kind}-loaded"]["bytes"] for res in results) == total
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{kind}")
        _assert_equal(again.state_dict(), loaded, kind)


@pytest.mark.distributed
def test_fsdp_over_three_ranks_gives_the_one_process_init() -> None:
    # 128 rows and 32 columns over 3 ranks: uneven shards.
    results = cp.launch(hf.ranks, None, ["llama", "qwen2"], 9, nprocs=3, timeout=150)
    for kind in ["llama", "qwen2"]:
        assert results[0][kind]["full"]
        for res in results:
            _check_rank(kind, res[kind], _one_process(kind, 9))


# --------------------------------------------------------------------------- recompute


def _llama_grads(policy: str | None, **batch: Any) -> tuple[dict[str, torch.Tensor], Any]:
    model = cp.materialize(hf.build("llama"), "cpu", init_seed=1)
    keys = list(model.state_dict())
    if policy is not None:
        cp.recompute(model, policy)  # the ModuleList's LlamaDecoderLayers, found alone
        assert cp.recomputed_blocks(model) == ["model.layers.0", "model.layers.1"]
    assert list(model.state_dict()) == keys
    out = model(**hf.batch("llama"), **batch)
    out.loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}, out


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("use_cache", [None, False])  # None: the config's, True
def test_recomputed_llama_layers_give_the_same_gradients(policy: str, use_cache: Any) -> None:
    want, _ = _llama_grads(None, use_cache=use_cache)
    got, out = _llama_grads(policy, use_cache=use_cache)
    _assert_equal(got, want, policy)
    if out.past_key_values is not None:  # as under HF's own checkpointing: nothing cached
        assert out.past_key_values.get_seq_length() == 0


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_gpt2_blocks_write_no_cache_and_give_the_same_gradients(policy: str) -> None:
    # GPT2Model hands its blocks the cache positionally (config.use_cache is True).
    grads, caches = [], []
    for recomputed in (False, True):
        model = cp.materialize(hf.build("gpt2"), "cpu", init_seed=1)
        if recomputed:
            cp.recompute(model, policy)
        out = model(**hf.batch("gpt2"))
        out.loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
        caches.append(out.past_key_values)
    _assert_equal(grads[1], grads[0], policy)
    assert caches[1] is None or caches[1].get_seq_length() == 0


def test_recomputed_gpt2_with_attention_dropout_equals_use_cache_false() -> None:
    grads = []
    for recomputed in (False, True):
        model = cp.materialize(hf.build("gpt2"), "cpu", init_seed=1)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.1
        if recomputed:
            cp.recompute(model, "full")
        torch.manual_seed(5)
        model(**hf.batch("gpt2"), use_cache=False if not recomputed else None).loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    _assert_equal(grads[1], grads[0], "gpt2 with dropout")


def test_recompute_refuses_blocks_hf_already_checkpoints() -> None:
    model = cp.materialize(hf.build("llama"), "cpu")
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match=r"activation_checkpointing_disable\(\)"):
        cp.recompute(model, "full")
    assert cp.recomputed_blocks(model) == []
    meta = hf.build("llama")
    meta.activation_checkpointing_enable()
    with pytest.raises(ValueError, match=r"activation_checkpointing_disable\(\)"):
        cp.parallelize(meta, "none", device="cpu", recompute="full")
    assert all(t.is_meta for t in meta.parameters())  # refused: nothing changed
    model.activation_checkpointing_disable()
    cp.recompute(model, "full")
    model.activation_checkpointing_enable()  # afterwards: refused at the forward
    with pytest.raises(RuntimeError, match="recomputed twice"):
        model(**hf.batch("llama"))
    with torch.no_grad():  # nothing is checkpointed without gradients
        model(**hf.batch("llama"))


# --------------------------------------------------------------------------- estimate_memory


def _hf_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _measure(model: Any, batch: dict[str, torch.Tensor], recompute: str | None) -> int:
    """The real peak of live tensor bytes over two AdamW steps (MemTracker), as
    tests/memory/test_memory_estimate.py measures it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    peak = 0
    with tracker:
        net = cp.parallelize(model, "none", device="cpu", recompute=recompute)
        opt = torch.optim.AdamW(net.parameters())
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = _hf_loss(net, batch)
            loss.backward()
            del loss
            opt.step()
            peak = max(peak, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()
    return int(peak)


# MemTracker loses its module stack in HF's decoder loop; the byte counts stay right.
@pytest.mark.filterwarnings("ignore:The module hierarchy tracking:UserWarning")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_estimate_memory_of_a_meta_built_hf_model_is_within_tolerance(
    kind: str, recompute: str | None
) -> None:
    ids = torch.randint(0, hf.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    fake = {k: torch.empty_like(v, device="meta") for k, v in batch.items()}
    got = cp_memory.estimate_memory(hf.build(kind), fake, loss_fn=_hf_loss, recompute=recompute)
    want = _measure(cp.materialize(hf.build(kind), "cpu"), batch, recompute)
    assert abs(got.peak - want) <= 0.10 * want, (got, want)  # the stated tolerance
