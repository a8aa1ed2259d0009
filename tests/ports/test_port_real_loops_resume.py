"""Real training loops with cudakit's features together, stopped and resumed bit for bit.

The loops are the ones people run (nanoGPT's char-level transformer with weight tying,
dropout, AdamW's decay / no-decay groups, a cosine schedule with warm-up, gradient
accumulation and clipping; GPT-2's token-weighted loss; pytorch/examples' DCGAN; a
2-rank DDP run), each written once by hand in plain PyTorch and once with cudakit
(``autocast_step``, ``Checkpointer``, ``speed_report``, ``distributed_loader``): see
``port_real_loops.py``. Each check compares with ``torch.equal`` every weight, buffer,
optimizer and scheduler state, the step's state, the generators and the list of losses:

- the cudakit loop against the hand-written one (the same maths);
- a run saved (mid-epoch, at an epoch's end, mid-window: taken at the window's end),
  abandoned a few batches later, rebuilt from fresh objects seeded otherwise and
  resumed, against the run that never stopped, in float32 and bf16 autocast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher_env import run_ranks
from port_real_loops import (
    BATCH,
    BLOCK,
    Crash,
    differences,
    gan_run,
    gpt_run,
    plain_gan,
    plain_gpt,
    training_state,
)

import cudakit
from cudakit.amp import SpikeRule
from cudakit.checkpoint import _layout as layout

FP32, BF16 = torch.float32, torch.bfloat16
GAN = ("G", "D")
_REFERENCES: dict[tuple[Any, ...], dict[str, Any]] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, **kw: Any) -> dict[str, Any]:
    """The uninterrupted cudakit run with these options (made once per module)."""
    key = tuple(sorted(kw.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = gpt_run(tmp_path_factory.mktemp("reference"), **kw)
    return _REFERENCES[key]


def stop_and_resume(directory: Path, run: Any, crash_at: int, save: dict[str, Any], **kw: Any):
    """Run until ``crash_at`` (saving as ``save`` says), then resume from fresh objects."""
    with pytest.raises(Crash):
        run(directory, crash_at=crash_at, **save, **kw)
    return run(directory, noise=crash_at, **kw)


def without_step(state: dict[str, Any]) -> dict[str, Any]:
    """A state to compare with the hand-written loop's, which has no autocast_step."""
    return {k: v for k, v in state.items() if not k.endswith("step")}


def assert_same_run(ref: dict[str, Any], got: dict[str, Any], models=("model",)) -> None:
    assert differences(training_state(ref, models), training_state(got, models)) == []


def assert_resumed(
    ref: dict[str, Any], resumed: dict[str, Any], checkpoint: str, models=("model",)
) -> None:
    """Resumed from the checkpoint taken after the batches ``checkpoint`` numbers (it is
    named by its optimizer step) and ended as the run that never stopped, bit for bit."""
    ckpt = resumed["ckpt"]
    assert ckpt.resumed_from is not None
    manifest = layout.read_manifest(ckpt.resumed_from)
    assert manifest.total == int(checkpoint.rsplit("-", 1)[1])
    assert ckpt.resumed_from.name == layout.checkpoint_name(manifest.windows)
    start = manifest.total + 1
    assert min(resumed["losses"]) == start
    assert resumed["losses"] == {k: v for k, v in ref["losses"].items() if k >= start}
    assert_same_run(ref, resumed, models)


# ----------------------------------------------------------------------------- nanoGPT


@pytest.mark.parametrize(
    ("dtype", "accumulate", "flush"),
    [(FP32, 2, False), (FP32, 3, True), (BF16, 4, False), (BF16, 3, True)],
)
def test_nanogpt_loop_equals_the_hand_written_loop(
    tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype, accumulate: int, flush: bool
) -> None:
    """autocast_step + Checkpointer (nothing saved mid-run) change no number of the loop:
    loss / accumulate, clipping over the optimizer's parameters, AdamW's groups,
    LambdaLR after every real step, dropout drawing from the global generator."""
    plain = plain_gpt(dtype=dtype, accumulate=accumulate, flush=flush)
    got = reference(tmp_path_factory, dtype=dtype, accumulate=accumulate, flush=flush)
    assert got["losses"] == plain["losses"]
    assert differences(training_state(plain), without_step(training_state(got))) == []
    assert got["step"].steps == len(got["windows"])


# (dtype, accumulate, flush, how it saves, crash_at, the batches of the checkpoint resumed
# from, as ckpt-<batches>: the checkpoint itself is named by its optimizer step)
RESUMES = {
    "mid-epoch": (FP32, 2, False, {"save_at": (6,)}, 9, "ckpt-0000000006"),
    "asked-mid-window": (FP32, 4, False, {"save_at": (5,)}, 10, "ckpt-0000000008"),
    "epoch-end-flushed": (FP32, 3, True, {"save_after_epoch": (0,)}, 14, "ckpt-0000000011"),
    # 11 batches an epoch: the window open at the epoch's end closes in the next one
    "epoch-end-mid-window": (FP32, 2, False, {"save_after_epoch": (0,)}, 15, "ckpt-0000000012"),
    "every-3-steps": (FP32, 2, False, {"every": 3}, 17, "ckpt-0000000012"),
    "bf16-mid-epoch": (BF16, 2, False, {"save_at": (6,)}, 9, "ckpt-0000000006"),
    "bf16-asked-mid-window": (BF16, 3, False, {"save_at": (7,)}, 12, "ckpt-0000000009"),
    "bf16-epoch-end-flushed": (BF16, 3, True, {"save_after_epoch": (0,)}, 13, "ckpt-0000000011"),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_nanogpt_resumes_bit_for_bit(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, case: str
) -> None:
    dtype, accumulate, flush, save, crash_at, checkpoint = RESUMES[case]
    kw = {"dtype": dtype, "accumulate": accumulate, "flush": flush}
    ref = reference(tmp_path_factory, **kw)
    resumed = stop_and_resume(tmp_path, gpt_run, crash_at, save, **kw)
    assert_resumed(ref, resumed, checkpoint)
    assert resumed["ckpt"].position == ref["ckpt"].position


# ----------------------------------------------------------------------------- spikes

RULE = SpikeRule(on="loss", z=3.0, warmup=3)


@pytest.mark.parametrize(
    ("spike_at", "save_at", "crash_at"),
    [((16,), 8, 11), ((10, 16), 8, 11), ((8, 16), 8, 11)],
    ids=["after-the-save", "before-and-after", "at-the-saved-window-and-after"],
)
def test_spike_skips_and_statistics_resume_bit_for_bit(
    tmp_path: Path, skip_on: str, spike_at: tuple[int, ...], save_at: int, crash_at: int
) -> None:
    """skip_spikes= with fused AdamW, on the CPU's path and the GPU's (verdicts read a
    window late). The window saved last may itself be a skipped spike: on the GPU's path
    its verdict is still pending when the save begins, the schedule has stepped ahead and
    the learning rates with it; the checkpoint must hold the settled ones."""
    kw: dict[str, Any] = {"accumulate": 2, "spikes": RULE, "spike_at": spike_at, "fused": True}
    ref = gpt_run(tmp_path / "ref", **kw)
    assert [k for k, v in ref["windows"].items() if v[2]] == list(spike_at)
    assert ref["step"].spike_steps == len(spike_at)
    resumed = stop_and_resume(tmp_path / "run", gpt_run, crash_at, {"save_at": (save_at,)}, **kw)
    assert_resumed(ref, resumed, f"ckpt-{save_at:010d}")
    assert resumed["windows"] == {k: v for k, v in ref["windows"].items() if k > save_at}
    assert resumed["step"].state_dict()["spike_stats"] == ref["step"].state_dict()["spike_stats"]


def test_bf16_spike_after_the_resume_point(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"dtype": BF16, "accumulate": 3, "spikes": RULE, "spike_at": (17,)}
    ref = gpt_run(tmp_path / "ref", **kw)
    assert [k for k, v in ref["windows"].items() if v[2]] == [18]  # the window of batch 17
    resumed = stop_and_resume(tmp_path / "run", gpt_run, 12, {"save_at": (8,)}, **kw)
    assert_resumed(ref, resumed, "ckpt-0000000009")
    assert resumed["windows"] == {k: v for k, v in ref["windows"].items() if k > 9}


# ----------------------------------------------------------------------------- token-weighted


@pytest.mark.parametrize(
    ("dtype", "accumulate", "flush"), [(FP32, 2, False), (FP32, 3, True), (BF16, 3, False)]
)
def test_token_weighted_loop_equals_the_hand_written_maths_and_resumes(
    tmp_path: Path, dtype: torch.dtype, accumulate: int, flush: bool
) -> None:
    """GPT-2's loss: summed over the real tokens, the window's gradients divided by its
    token count; saved mid-window (taken at its end), resumed bit for bit."""
    kw: dict[str, Any] = {"dtype": dtype, "accumulate": accumulate, "flush": flush}
    plain = plain_gpt(weighted=True, **kw)
    ref = gpt_run(tmp_path / "ref", weighted=True, **kw)
    assert ref["losses"] == plain["losses"]
    assert differences(training_state(plain), without_step(training_state(ref))) == []
    resumed = stop_and_resume(tmp_path / "run", gpt_run, 13, {"save_at": (5,)}, weighted=True, **kw)
    saved = -(-5 // accumulate) * accumulate  # the end of the window batch 5 is in
    assert_resumed(ref, resumed, f"ckpt-{saved:010d}")


# ----------------------------------------------------------------------------- DCGAN


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_dcgan_two_steps_equal_the_hand_written_loop_and_resume(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """Two models, two optimizers, two autocast_steps (G's with a scheduler), BatchNorm
    in both, the noise drawn from the global generator, one Checkpointer saving every 4
    batches."""
    plain = plain_gan(dtype=dtype)
    ref = gan_run(tmp_path / "ref", dtype=dtype)
    assert ref["losses"] == plain["losses"]
    assert differences(training_state(plain, GAN), without_step(training_state(ref, GAN))) == []
    resumed = stop_and_resume(tmp_path / "run", gan_run, 11, {"every": 4}, dtype=dtype)
    assert_resumed(ref, resumed, "ckpt-0000000008", GAN)


# ----------------------------------------------------------------------------- speed_report


@pytest.mark.parametrize(("accumulate", "flush"), [(2, False), (3, True), (4, False)])
def test_speed_report_counts_right_and_changes_no_number(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, accumulate: int, flush: bool
) -> None:
    """speed_report above the autocast_step function, in the Checkpointer's loop: the
    steps are the windows (the flushed ones too), the samples and tokens those of their
    calls, and the training is the run without it, also across a resume."""
    kw: dict[str, Any] = {"accumulate": accumulate, "flush": flush}
    ref = reference(tmp_path_factory, dtype=FP32, **kw)
    got = gpt_run(tmp_path / "whole", meter=True, **kw)
    assert got["losses"] == ref["losses"]
    assert_same_run(ref, got)
    meter = got["meter"]
    windows = len(got["windows"])
    in_windows = 22 if flush else windows * accumulate  # calls of the closed windows
    assert (meter.calls, meter.steps) == (22, windows)
    assert meter.total.steps == windows
    assert meter.total.calls == in_windows
    assert (meter.total.samples, meter.total.tokens) == (
        in_windows * BATCH,
        in_windows * BATCH * BLOCK,
    )

    resumed = stop_and_resume(tmp_path / "run", gpt_run, 14, {"save_at": (5,)}, meter=True, **kw)
    saved = -(-5 // accumulate) * accumulate
    assert_resumed(ref, resumed, f"ckpt-{saved:010d}")
    meter = resumed["meter"]
    in_windows = 22 - saved if flush else len(resumed["windows"]) * accumulate
    assert (meter.calls, meter.steps) == (22 - saved, len(resumed["windows"]))
    assert meter.total.samples == in_windows * BATCH


# ----------------------------------------------------------------------------- reduced


def _tiny(seed: int, *, fused: bool = False, accumulate: int = 2) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i))
    step = cudakit.autocast_step(opt, model=net, dtype=FP32, accumulate=accumulate, scheduler=sched)
    return {"model": net, "opt": opt, "sched": sched, "step": step}


def test_an_explicit_save_at_a_window_end_counts_that_window(tmp_path: Path) -> None:
    """ckpt.save() in the loop body right after a window's last micro-step: the window
    has ended, so the checkpoint's Position.windows counts it (it held one window too
    few, and a resumed run stayed one behind: every= saved a window late)."""
    data = torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=2)
    o = _tiny(0)
    fn = o["step"](lambda x: o["model"](x).square().mean())
    ckpt = cudakit.Checkpointer(tmp_path, step=fn, loader=data, preemption=False)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches():
            fn(x)
            if ckpt.position.total == 2:
                assert ckpt.save() is not None  # at the window's end: saved now
    ckpt.close()
    assert ckpt.position == cudakit.Position(1, 0, 4, 2)
    fresh = _tiny(1)
    again = cudakit.Checkpointer(tmp_path, step=fresh["step"], loader=data, preemption=False)
    assert again.load(tmp_path / "ckpt-0000000001") == cudakit.Position(0, 2, 2, 1)
    again.close()


def test_a_save_right_after_a_skipped_window_holds_the_settled_learning_rate(
    tmp_path: Path, skip_on: str
) -> None:
    """On the GPU's sync-free path (fused AdamW) a skipped window's verdict is read late:
    the schedule steps at once and is put back, with the learning rates, when the
    verdict is read. A save right after such a window read the optimizer's learning
    rates before that, so the checkpoint held the rate of a step that never happened."""
    o = _tiny(0, fused=True, accumulate=1)
    fn = o["step"](lambda x, k: o["model"](x).square().mean() * k)
    ckpt = cudakit.Checkpointer(tmp_path, step=fn, preemption=False)
    for k in (1.0, 1.0, float("nan")):
        fn(torch.randn(4, 3), k)
    path = ckpt.save()
    ckpt.close()
    assert o["step"].steps == 2
    assert o["step"].skipped_steps == 1
    settled = [g["lr"] for g in o["opt"].param_groups]
    assert settled == o["sched"].get_last_lr() == [0.1 / 3]
    fresh = _tiny(1, fused=True, accumulate=1)
    loader = cudakit.Checkpointer(tmp_path, step=fresh["step"], preemption=False)
    loader.load(path)
    loader.close()
    assert [g["lr"] for g in fresh["opt"].param_groups] == settled
    assert differences(fresh["opt"].state_dict(), o["opt"].state_dict()) == []


def _top_of_body_run(directory: Path, seed: int, crash_at: int | None = None) -> dict[str, Any]:
    """nanoGPT's order: the checkpoint at the top of the iteration, then the step."""
    o = _tiny(seed, accumulate=1)
    fn = o["step"](lambda x: o["model"](x).square().mean())
    gen = torch.Generator().manual_seed(5)
    samples = torch.randn(12, 3, generator=torch.Generator().manual_seed(7))  # any seed
    data = torch.utils.data.DataLoader(samples, batch_size=2, shuffle=True, generator=gen)
    ckpt = cudakit.Checkpointer(directory, step=fn, loader=data, preemption=False)
    losses: dict[int, float] = {}
    try:
        for _ in ckpt.epochs(1):
            for x in ckpt.batches():
                total = ckpt.position.total
                if total == crash_at:
                    raise Crash(total)
                if total == 3:
                    ckpt.save()  # before this batch's step
                losses[total] = float(fn(x).loss)
    finally:
        ckpt.close()
    o.update(losses=losses, ckpt=ckpt, gen=gen, rng_end=torch.get_rng_state())
    return o


def test_a_save_before_the_batchs_step_resumes_with_that_batch(tmp_path: Path) -> None:
    ref = _top_of_body_run(tmp_path / "ref", 0)
    with pytest.raises(Crash):
        _top_of_body_run(tmp_path / "run", 0, crash_at=5)
    resumed = _top_of_body_run(tmp_path / "run", 1)
    assert resumed["losses"] == {k: v for k, v in ref["losses"].items() if k >= 3}
    assert_same_run(ref, resumed)


# ----------------------------------------------------------------------------- the run's end


def test_a_run_ending_with_an_open_window_says_it_saved_no_last_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/checkpoint.md: when the loop ends, epochs() saves a last checkpoint, so the
    command run again does nothing more. 22 batches with accumulate=4 leave 2 micro-steps
    in an open window, which a checkpoint never holds: no checkpoint at all here (every=
    None), and the run used to end silently, so running it again trained it all again.
    It now logs a warning that says so, and the fix."""
    with caplog.at_level(logging.WARNING, logger="cudakit.checkpoint"):
        first = gpt_run(tmp_path / "open", accumulate=4)
    assert first["ckpt"].latest is None
    [record] = [r for r in caplog.records if "open accumulation window" in r.message]
    message = record.getMessage()
    assert "2 of 4 micro-batches" in message
    assert "resumes from the start" in message
    assert "train_step.flush() after each epoch's batches" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cudakit.checkpoint"):
        flushed = gpt_run(tmp_path / "flushed", accumulate=4, flush=True)
    assert not [r for r in caplog.records if "open accumulation window" in r.message]
    assert flushed["ckpt"].latest is not None
    assert layout.read_manifest(flushed["ckpt"].latest).total == 22
    again = gpt_run(tmp_path / "flushed", accumulate=4, flush=True, noise=1)
    assert again["losses"] == {}
    assert_same_run(flushed, again)


def test_the_open_window_warning_names_the_checkpoint_a_new_run_resumes_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="cudakit.checkpoint"):
        gpt_run(tmp_path, accumulate=4, every=2)
    [record] = [r for r in caplog.records if "open accumulation window" in r.message]
    assert f"resumes from {tmp_path / 'ckpt-0000000004'} and trains" in record.getMessage()


# ----------------------------------------------------------------------------- DDP


@pytest.mark.distributed
def test_ddp_nanogpt_resumes_bit_for_bit_on_two_ranks(tmp_path: Path) -> None:
    """2 gloo ranks, DDP over the tied transformer, distributed_loader, accumulate=4 over
    6 batches an epoch (windows straddle epochs), a save asked for mid-window."""
    from port_real_loops_worker import worker

    results = run_ranks(worker, tmp_path, 2, timeout=240)
    for rank, got in enumerate(results):
        assert got["resumed_from"] == "ckpt-0000000002", rank  # step 2 (batch 8)
        start = min(got["resumed_losses"])
        assert start == 9, rank
        assert got["resumed_losses"] == {
            k: v for k, v in got["ref_losses"].items() if k >= start
        }, rank
        assert differences(got["ref"], got["resumed"]) == [], rank
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    assert results[0]["ref_losses"] != results[1]["ref_losses"]  # each rank its own shard
