"""Tiny Hugging Face models trained with cudakit, against the loops HF users write.

Ported from how transformers' examples (``run_clm_no_trainer.py``,
``run_glue_no_trainer.py``) and the Trainer train: batches are ``BatchEncoding``s or
dicts of ``input_ids``/``attention_mask``/``labels``, the step is
``model(**batch).loss`` (or the whole ``ModelOutput``), AdamW has the Trainer's
decay / no-decay groups, the schedule is ``get_linear_schedule_with_warmup``, dropout
is on. Each cudakit loop is checked bit for bit (``torch.equal`` of every weight and
the optimizer state) against the same loop written by hand (``port_hf_helpers.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from port_hf_helpers import (  # noqa: E402
    BF16,
    FP32,
    Crash,
    adamw,
    bert_classifier,
    bert_mlm,
    cls_batches,
    cudakit_run,
    gpt2,
    hand_loop,
    hand_run,
    linear_warmup,
    llama,
    lm_batches,
    mismatched,
    mlm_batches,
    run_state,
    seq2seq_batches,
    t5,
)
from port_real_loops import differences  # noqa: E402

import cudakit  # noqa: E402
import cudakit.amp._stepper as amp_stepper  # noqa: E402

MODELS = {
    "llama": (llama, lm_batches),
    "gpt2-tied": (gpt2, lm_batches),
    "bert-cls": (bert_classifier, cls_batches),
    "bert-mlm": (bert_mlm, mlm_batches),
    "t5": (t5, seq2seq_batches),
}


def cudakit_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    *,
    returns: str = "loss",
    seed: int = 0,
    **options: Any,
) -> tuple[list[torch.Tensor], Any]:
    """The same loop with ``autocast_step``: returns the losses and the step."""
    options.setdefault("dtype", FP32)
    step = cudakit.autocast_step(optimizer, model=model, **options)

    @step
    def train_step(batch: Any) -> Any:
        output = model(**batch)
        return output.loss if returns == "loss" else output

    torch.manual_seed(seed)
    losses = [train_step(batch).loss for batch in batches]
    return losses, step


def assert_same_training(a: torch.nn.Module, b: torch.nn.Module, opt_a: Any, opt_b: Any) -> None:
    assert mismatched(a, b) == []
    assert differences(opt_a.state_dict(), opt_b.state_dict()) == []


# ----------------------------------------------------------------------------- on_device


def test_on_device_keeps_a_batch_encoding_its_attributes_and_aliases() -> None:
    batch = lm_batches(1)[0]
    batch["decoder_input_ids"] = batch["input_ids"]  # one tensor under two keys
    moved = cudakit.on_device(batch, device="meta")
    assert type(moved) is transformers.BatchEncoding
    assert moved is not batch
    assert moved.data is not batch.data
    assert list(moved.keys()) == list(batch.keys())
    assert all(t.device.type == "meta" for t in moved.values())
    assert all(t.device.type == "cpu" for t in batch.values())  # the user's is untouched
    assert moved["decoder_input_ids"] is moved["input_ids"]
    assert moved.input_ids is moved["input_ids"]  # attribute access reads the new data
    assert moved.n_sequences == batch.n_sequences
    assert moved.encodings is None
    assert cudakit.on_device(moved, device="meta") is moved  # nothing to move: same object
    assert cudakit.on_device(batch, device="cpu") is batch


def test_on_device_moves_dicts_of_input_ids_mask_and_labels_keeping_types() -> None:
    batch = cls_batches(1)[0]
    shared = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    nested = [batch, {"lm": shared, "step": 3}]
    moved = cudakit.on_device(nested, device="meta")
    assert type(moved) is list
    assert type(moved[0]) is dict
    assert list(moved[0]) == list(batch)
    assert moved[0]["input_ids"].dtype == torch.int64
    assert moved[1]["lm"]["labels"] is moved[1]["lm"]["input_ids"]
    assert moved[1]["lm"]["input_ids"] is moved[0]["input_ids"]  # across the whole object
    assert moved[1]["step"] == 3
    same = cudakit.on_device(batch, device="cpu")
    assert same is batch


def test_on_device_of_a_fast_tokenizers_output_keeps_its_encodings() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3, "a": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]"
    )
    batch = tokenizer(
        ["hello world", "a"], return_tensors="pt", padding=True, return_offsets_mapping=True
    )
    batch["labels"] = batch["input_ids"]
    moved = cudakit.on_device({"batch": batch, "epoch": 1}, device="meta")["batch"]
    assert type(moved) is transformers.BatchEncoding
    assert moved.is_fast
    assert moved.encodings is batch.encodings  # the Rust encodings hold no tensors
    assert moved.word_ids(0) == [0, 1]
    assert moved["offset_mapping"].device.type == "meta"
    assert moved["labels"] is moved["input_ids"]
    lists = tokenizer(["hello world", "a"], padding=True)  # no tensors: the same object
    assert cudakit.on_device(lists, device="meta") is lists


def test_batch_encoding_moved_by_on_device_trains_as_the_users_own() -> None:
    batches = lm_batches(3)
    a, b = llama(), llama()
    opt_a, opt_b = adamw(a), adamw(b)
    hand_loop(a, opt_a, batches)
    moved = [cudakit.on_device(x, device="cpu") for x in batches]
    cudakit_loop(b, opt_b, moved)
    assert_same_training(a, b, opt_a, opt_b)


# ----------------------------------------------------------------------------- autocast_step


@pytest.mark.parametrize(
    ("name", "returns"),
    [("llama", "loss"), ("llama", "output"), ("gpt2-tied", "output"), ("bert-cls", "loss"),
     ("bert-mlm", "output"), ("t5", "loss")],
)  # fmt: skip
def test_fp32_step_matches_the_hand_written_loop_bit_for_bit(name: str, returns: str) -> None:
    build, data = MODELS[name]
    batches = data(3)
    a, b = build(), build()
    opt_a, opt_b = adamw(a), adamw(b)
    want = hand_loop(a, opt_a, batches)
    got, step = cudakit_loop(b, opt_b, batches, returns=returns)
    assert torch.equal(torch.stack(want), torch.stack(got))
    assert_same_training(a, b, opt_a, opt_b)
    assert step.steps == 3


def test_returned_model_output_comes_back_whole() -> None:
    model = gpt2()
    step = cudakit.autocast_step(adamw(model), dtype=FP32)
    result = step(lambda batch: model(**batch))(lm_batches(1)[0])
    assert isinstance(result.output, transformers.modeling_outputs.ModelOutput)
    assert type(result.output).__name__ == "CausalLMOutputWithCrossAttentions"
    assert result.output.logits.shape == (2, 8, 128)
    assert torch.equal(result.loss, result.output.loss.detach())
    assert not result.loss.requires_grad


def test_explicit_form_takes_the_model_output_as_the_hand_loop_does() -> None:
    batches = lm_batches(4, seed=2)
    a, b = gpt2(), gpt2()
    opt_a, opt_b = adamw(a), adamw(b)
    hand_loop(a, opt_a, batches, accumulate=2, max_grad_norm=1.0)
    step = cudakit.autocast_step(opt_b, model=b, dtype=FP32, accumulate=2, max_grad_norm=1.0)
    torch.manual_seed(0)
    for batch in batches:
        with step:
            outputs = b(**batch)
        result = step.backward(outputs)
    assert result.output is outputs
    assert step.steps == 2
    assert_same_training(a, b, opt_a, opt_b)


def test_token_weighted_steps_match_the_trainers_num_items_in_batch() -> None:
    # The Trainer (transformers >= 4.46) passes num_items_in_batch, the window's count of
    # target tokens, so each micro-batch's loss is its summed loss over the window's
    # tokens; cudakit's form returns the summed loss and its count. The same maths, in
    # another order: close, not bitwise.
    batches = lm_batches(4, seed=7)
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    a, b = llama(dropout=0.0), llama(dropout=0.0)
    opt_a, opt_b = adamw(a), adamw(b)
    for i, batch in enumerate(batches):
        window = counts[i - i % 2 : i - i % 2 + 2]
        a(**batch, num_items_in_batch=sum(window)).loss.backward()
        if i % 2:
            torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
            opt_a.step()
            opt_a.zero_grad()
    step = cudakit.autocast_step(opt_b, model=b, dtype=FP32, accumulate=2, max_grad_norm=1.0)

    @step
    def train_step(batch: Any) -> dict[str, torch.Tensor]:
        summed = b(**batch, num_items_in_batch=1).loss
        return {"loss": summed, "weight": (batch["labels"][:, 1:] != -100).sum()}

    for batch in batches:
        train_step(batch)
    assert step.steps == 2
    for (name, p), q in zip(b.named_parameters(), a.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("name", "returns"),
    [("llama", "output"), ("gpt2-tied", "loss"), ("bert-cls", "output"), ("t5", "loss")],
)
def test_bf16_step_matches_a_hand_written_autocast_loop(name: str, returns: str) -> None:
    build, data = MODELS[name]
    batches = data(3)
    a, b = build(), build()
    opt_a, opt_b = adamw(a), adamw(b)
    want = hand_loop(a, opt_a, batches, dtype=BF16)
    got, step = cudakit_loop(b, opt_b, batches, returns=returns, dtype=BF16)
    assert step.dtype == BF16
    assert torch.equal(torch.stack(want), torch.stack(got))
    assert_same_training(a, b, opt_a, opt_b)


@pytest.mark.parametrize(
    ("accumulate", "dtype", "returns"),
    [(2, FP32, "loss"), (3, FP32, "output"), (4, FP32, "loss"), (2, BF16, "output")],
)
def test_accumulation_clipping_and_hf_schedule_match_the_hand_loop(
    accumulate: int, dtype: torch.dtype, returns: str
) -> None:
    batches = lm_batches(3 * accumulate, seed=accumulate)
    a, b = llama(), llama()
    opt_a, opt_b = adamw(a), adamw(b)
    sched_a, sched_b = linear_warmup(opt_a, 3), linear_warmup(opt_b, 3)
    want = hand_loop(
        a, opt_a, batches, scheduler=sched_a, accumulate=accumulate, max_grad_norm=0.5, dtype=dtype
    )
    got, step = cudakit_loop(
        b, opt_b, batches, returns=returns, scheduler=sched_b, accumulate=accumulate,
        max_grad_norm=0.5, dtype=dtype,
    )  # fmt: skip
    assert torch.equal(torch.stack(want), torch.stack(got))
    assert_same_training(a, b, opt_a, opt_b)
    assert sched_a.state_dict() == sched_b.state_dict()
    assert step.steps == 3
    assert opt_b.param_groups[0]["lr"] == 0.0  # the schedule ran out


def test_torch_schedule_with_tied_gpt2_matches_the_hand_loop() -> None:
    batches = lm_batches(6, seed=5)
    a, b = gpt2(), gpt2()
    assert b.lm_head.weight is b.transformer.wte.weight
    opt_a, opt_b = adamw(a), adamw(b)
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(opt_a, T_max=3)
    sched_b = torch.optim.lr_scheduler.CosineAnnealingLR(opt_b, T_max=3)
    hand_loop(a, opt_a, batches, scheduler=sched_a, accumulate=2, max_grad_norm=1.0)
    cudakit_loop(b, opt_b, batches, scheduler=sched_b, accumulate=2, max_grad_norm=1.0)
    assert_same_training(a, b, opt_a, opt_b)
    assert b.lm_head.weight is b.transformer.wte.weight  # still tied


# ----------------------------------------------------------------------------- guard, spikes


def test_nonfinite_window_is_skipped_as_a_hand_written_guard_skips_it() -> None:
    # A window whose second micro-batch turns NaN in layer 1's o_proj (a forward hook):
    # no step, no scheduler step, the weights and AdamW's state untouched; the run goes on.
    batches = lm_batches(8, seed=3)

    def poison(model: torch.nn.Module, at: int) -> None:
        calls = [0]

        def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return out * float("nan") if calls[0] == at else out

        model.model.layers[1].self_attn.o_proj.register_forward_hook(hook)

    a, b = llama(), llama()
    poison(a, 4)
    poison(b, 4)
    opt_a, opt_b = adamw(a), adamw(b)
    sched_a, sched_b = linear_warmup(opt_a, 4), linear_warmup(opt_b, 4)
    hand_loop(
        a, opt_a, batches, scheduler=sched_a, accumulate=2, max_grad_norm=1.0,
        skip=lambda window, losses: not bool(torch.isfinite(losses).all()),
    )  # fmt: skip
    losses, step = cudakit_loop(
        b, opt_b, batches, returns="output", scheduler=sched_b, accumulate=2, max_grad_norm=1.0
    )
    assert torch.isnan(losses[3])
    assert (step.steps, step.skipped_steps) == (3, 1)
    assert sched_b.last_epoch == 3
    assert_same_training(a, b, opt_a, opt_b)


def test_sync_free_guard_with_fused_adamw_skips_as_the_hand_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The GPU's path (the verdict handed to fused AdamW as found_inf, read a window
    # later), forced on the CPU, with the schedule put back after the skipped window.
    monkeypatch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
    a, b = bert_mlm(), bert_mlm()
    poison = {"on": False}

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * float("nan") if poison["on"] else out

    for model in (a, b):
        model.bert.encoder.layer[0].output.dense.register_forward_hook(hook)
    opt_a, opt_b = adamw(a, fused=True), adamw(b, fused=True)
    sched_a, sched_b = linear_warmup(opt_a, 5), linear_warmup(opt_b, 5)
    data = mlm_batches(6, seed=11)

    def loss_of(model: torch.nn.Module, i_batch: Any) -> torch.Tensor:
        poison["on"] = i_batch[0] == 3
        return model(**i_batch[1]).loss

    hand_loop(
        a, opt_a, list(enumerate(data)), scheduler=sched_a, max_grad_norm=1.0, loss_of=loss_of,
        skip=lambda window, losses: window == 3,
    )  # fmt: skip
    step = cudakit.autocast_step(opt_b, model=b, dtype=FP32, scheduler=sched_b, max_grad_norm=1.0)
    assert step.sync_free

    @step
    def train_step(i: int, batch: Any) -> Any:
        poison["on"] = i == 3
        return b(**batch)

    torch.manual_seed(0)
    results = [train_step(i, batch) for i, batch in enumerate(data)]
    assert [bool(r.skipped) for r in results] == [i == 3 for i in range(6)]
    assert (step.steps, step.skipped_steps, sched_b.last_epoch) == (5, 1, 5)
    assert_same_training(a, b, opt_a, opt_b)


def test_spike_skipped_as_the_hand_loop_drops_that_window() -> None:
    batches = [(batch, 40.0 if i == 7 else 1.0) for i, batch in enumerate(lm_batches(10, seed=4))]
    a, b = gpt2(), gpt2()
    opt_a, opt_b = adamw(a, lr=1e-3), adamw(b, lr=1e-3)
    hand_loop(
        a, opt_a, batches, max_grad_norm=1.0, loss_of=lambda m, bk: m(**bk[0]).loss * bk[1],
        skip=lambda window, losses: window == 7,
    )  # fmt: skip
    rule = cudakit.amp.SpikeRule(on="loss", z=6.0, warmup=4)
    step = cudakit.autocast_step(opt_b, model=b, dtype=FP32, max_grad_norm=1.0, skip_spikes=rule)

    @step
    def train_step(batch: Any, k: float) -> Any:
        return b(**batch).loss * k

    torch.manual_seed(0)
    spikes = [bool(train_step(batch, k).spike) for batch, k in batches]
    assert spikes == [i == 7 for i in range(10)]
    assert (step.steps, step.spike_steps) == (9, 1)
    assert_same_training(a, b, opt_a, opt_b)


@pytest.mark.parametrize(
    ("build", "where", "cls"),
    [
        (llama, "model.layers.1.mlp.down_proj", "Linear"),
        (gpt2, "transformer.h.0.attn.c_proj", "Conv1D"),
    ],
)
def test_locate_nonfinite_names_the_hf_submodule(build: Any, where: str, cls: str) -> None:
    model = build()
    module = model.get_submodule(where)
    with torch.no_grad():
        module.weight[0, 0] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = adamw(model)
    step = cudakit.autocast_step(opt, model=model, dtype=FP32, locate_nonfinite=True)
    batch = lm_batches(1)[0]
    with pytest.warns(cudakit.amp.NonFiniteWarning, match=where):
        result = step(lambda batch: model(**batch))(batch)
    assert result.skipped
    source = result.nonfinite
    assert (source.phase, source.name, source.module) == ("forward", where, cls)
    assert mismatched_state(model, before) == []
    assert opt.state == {}
    found = cudakit.amp.find_nonfinite(lambda batch: model(**batch).loss, batch)
    assert found is not None
    assert (found.phase, found.name) == ("forward", where)


def mismatched_state(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


# ----------------------------------------------------------------------------- Checkpointer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return cudakit_run(tmp_path_factory.mktemp("uninterrupted"))


def test_checkpointed_run_matches_the_hand_written_loop(uninterrupted: dict[str, Any]) -> None:
    want = run_state(hand_run())
    assert differences(want, run_state(uninterrupted)) == []
    assert uninterrupted["step"].steps == 6


@pytest.mark.parametrize("crash_at", [5, 9])  # 5: mid-window (saved at 4), 9: a window later
def test_killed_and_resumed_run_is_bit_identical(
    tmp_path: Any, uninterrupted: dict[str, Any], crash_at: int
) -> None:
    with pytest.raises(Crash):
        cudakit_run(tmp_path, crash_at=crash_at)
    resumed = cudakit_run(tmp_path, seed=100)  # fresh objects, seeded otherwise
    assert resumed["ckpt"].resumed_from is not None
    want, got = run_state(uninterrupted), run_state(resumed)
    assert differences(want, got) == []
    assert resumed["step"].state_dict() == uninterrupted["step"].state_dict()


# ----------------------------------------------------------------------------- speed, warm-up


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "opt": copy.deepcopy(opt.state_dict()),
        "rng": torch.get_rng_state(),
        "training": [m.training for m in model.modules()],
    }


def test_count_flops_of_an_hf_step_is_flop_counter_modes_and_changes_nothing() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model, batch = llama(), lm_batches(1)[0]
    opt = adamw(model)
    before = snapshot(model, opt)
    count = cudakit.speed.count_flops(lambda batch: model(**batch).loss, batch, model=model)
    assert differences(before, snapshot(model, opt)) == []
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    assert count.total == counter.get_total_flops()
    assert count.recomputed == 0
    assert 0 < count.forward < count.total
    # the same model with PyTorch's fused attention: the same model FLOPs
    fused = llama(attn="sdpa")
    fused_count = cudakit.speed.count_flops(lambda b: fused(**b).loss, batch, model=fused)
    assert fused_count.total == count.total


def test_speed_report_counts_samples_tokens_and_flops_of_hf_batches() -> None:
    model = gpt2()
    batches = lm_batches(4)
    example = batches[0]
    count = cudakit.speed.count_flops(lambda b: model(**b).loss, example, model=model)

    @cudakit.speed_report(
        samples=lambda batch: len(batch["input_ids"]),
        tokens=lambda batch: batch["attention_mask"].sum(),
        flops=count, every=2, file=None,
    )  # fmt: skip
    @cudakit.autocast_step(adamw(model), model=model, dtype=FP32, accumulate=2)
    def train_step(batch: Any) -> Any:
        return model(**batch)

    for batch in batches:
        train_step(batch)
    total = train_step.speed_report.total
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    assert (total.steps, total.calls, total.samples, total.tokens) == (2, 4, 8, tokens)
    example_tokens = int(example["attention_mask"].sum())
    assert total.flops == pytest.approx(count.total * tokens / example_tokens, rel=1e-9)
    with pytest.raises(ValueError, match="samples=len"):
        cudakit.speed_report(samples=len, file=None)(lambda batch: None)(example)


def test_warmup_of_an_hf_model_leaves_no_trace_and_training_unchanged() -> None:
    batches = lm_batches(4, seed=6)
    a, b = llama(), llama()
    opt_a, opt_b = adamw(a), adamw(b)
    step_b = cudakit.autocast_step(opt_b, model=b, dtype=FP32, accumulate=2, max_grad_norm=1.0)
    train_b = step_b(lambda model, batch: model(**batch))
    torch.manual_seed(0)
    before = snapshot(b, opt_b)
    report = cudakit.warmup(b, batches[0], optimizer=opt_b, steps=2)  # model(**batch).loss
    assert report.steps == 2
    cudakit.warmup(b, batches[0], loss_fn=train_b, optimizer=opt_b, amp=step_b)
    assert differences(before, snapshot(b, opt_b)) == []
    assert (step_b.steps, step_b.position) == (0, 0)
    for batch in batches:
        train_b(b, batch)
    hand_loop(a, opt_a, batches, accumulate=2, max_grad_norm=1.0)
    assert_same_training(a, b, opt_a, opt_b)


def test_find_batch_size_with_hf_trials_leaves_the_model_as_it_was() -> None:
    model = bert_classifier()
    opt = adamw(model)
    step = cudakit.autocast_step(opt, model=model, dtype=FP32)
    train_step = step(lambda batch: model(**batch))
    before = snapshot(model, opt)
    tried: list[int] = []

    def trial(batch_size: int) -> None:
        tried.append(batch_size)
        if batch_size > 6:  # stands for the device's memory
            raise torch.OutOfMemoryError("CPU out of memory. Tried to allocate 2.00 GiB")
        with cudakit.preserve_state(model, opt, extra=(step,)):
            train_step(cls_batches(1, batch=batch_size)[0])

    assert cudakit.find_batch_size(trial, start=2, upper=16) == 6
    assert tried == [2, 4, 8, 6, 7]
    assert differences(before, snapshot(model, opt)) == []
    assert step.steps == 0


# ----------------------------------------------------------------------------- compile


def test_compiled_step_trains_a_tiny_llama_as_the_eager_step() -> None:
    # inductor on the CPU: the same maths, other kernels, so close rather than equal
    batches = lm_batches(3, seed=8)
    a, b = llama(dropout=0.0, layers=1), llama(dropout=0.0, layers=1)
    opt_a, opt_b = adamw(a), adamw(b)
    want, _ = cudakit_loop(a, opt_a, batches, max_grad_norm=1.0)
    got, step = cudakit_loop(b, opt_b, batches, returns="output", max_grad_norm=1.0, compile=True)
    assert step.steps == 3
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(b.named_parameters(), a.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5, msg=name)


def test_cudakit_never_imports_transformers() -> None:
    # transformers is a test-only dependency: cudakit duck-types BatchEncoding/ModelOutput
    import ast
    from pathlib import Path

    package = Path(cudakit.__file__).parent
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}:{node.lineno}" for n in names if n.split(".")[0] in (
                "transformers", "accelerate")]  # fmt: skip
    assert found == []
