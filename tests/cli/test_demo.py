"""``cudakit demo``: it trains (the loss falls), reports, and rejects bad options clearly."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudakit.amp.policy import cpu_native_bf16
from cudakit.demo import DemoSummary, EpochStats, _args, command, main, make_dataset, make_model
from cudakit.demo._evaluation import evaluate
from cudakit.demo._progress import Progress
from cudakit.parallel import launch

# One short epoch: 256 images in batches of 32 -> 8 micro-steps, 4 optimizer steps.
SHORT = ["--epochs", "1", "--train-size", "256", "--batch-size", "32", "--seed", "3"]


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*SHORT, "--json", "--no-progress", *argv]) == 0
    out = capsys.readouterr().out
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The JSON summary of one short CPU epoch (run once for the module).

    With matplotlib installed the run also writes ``--plot``; ``result["plot"]`` is the path.
    """
    import contextlib
    import io

    plot = tmp_path_factory.mktemp("demo") / "demo.png"
    extra = ["--plot", str(plot)] if importlib.util.find_spec("matplotlib") else []
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*SHORT, "--json", "--no-progress", *extra]) == 0
    result: dict[str, Any] = json.loads(buf.getvalue())  # nothing but the JSON on stdout
    result["plot"] = plot
    return result


# -- training ----------------------------------------------------------------------------


def test_one_short_epoch_trains_and_the_loss_falls(short_run: dict[str, Any]) -> None:
    s = short_run
    assert s["device"] == "cpu"
    # autocast_step's "auto" on a CPU: bf16 where it is native, else float32
    assert s["dtype"] == ("bfloat16" if cpu_native_bf16() else "float32")
    assert (s["strategy"], s["world_size"]) == ("none", 1)
    assert (s["batch_size"], s["accumulate"], s["max_grad_norm"]) == (32, 2, 1.0)
    assert (s["train_samples"], s["val_samples"]) == (256, 256)
    assert s["loss_fell"] is True
    assert s["final_loss"] < s["first_loss"] - 0.1
    assert s["first_loss"] == pytest.approx(2.3, abs=0.3)  # ln(10): chance at the start
    assert 0.0 <= s["final_accuracy"] <= 1.0
    (epoch,) = s["epochs"]
    assert epoch["epoch"] == 1
    assert epoch["optimizer_steps"] == 4  # 8 micro-steps, accumulate=2
    assert epoch["skipped_steps"] == s["steps_skipped"] == 0
    assert epoch["samples_per_s"] > 0
    assert epoch["seconds"] > 0
    assert epoch["peak_memory"] > 0
    assert epoch["memory_kind"] == "rss"
    assert s["warmup_first_pass_s"] > 0
    assert s["warmup_last_pass_s"] > 0


def test_text_summary_with_progress_auto_batch_and_fp32(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--epochs", "1", "--train-size", "256", "--batch-size", "auto", "--dtype", "fp32"]
    rng = torch.get_rng_state()
    assert main(argv) == 0
    assert torch.equal(torch.get_rng_state(), rng)  # the demo seeds; the caller's RNG is kept
    captured = capsys.readouterr()
    out = captured.out
    for needle in ("device", "cpu", "dtype", "float32", "steps skipped", "samples/s", "peak mem"):
        assert needle in out
    assert "loss fell:" in out
    assert "final held-out accuracy" in out
    # --batch-size auto searched up to the cap (256 // 8 = 32 per process, multiple of 8).
    assert "x 2 accumulated, clip 1.0" in out
    batch = int(out.split("batch", 1)[1].split()[0])
    assert batch % 8 == 0
    assert 8 <= batch <= 32
    # The per-epoch line always goes to stderr, bar or no bar.
    assert "epoch 1/1: train loss" in captured.err
    if importlib.util.find_spec("tqdm") is not None:  # the bar, when tqdm is installed
        assert f"{256 // batch}/{256 // batch} [" in captured.err
    assert "samples/s" in captured.err


def test_plot_writes_a_png(short_run: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    assert short_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_announced_after_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "demo.png"
    monkeypatch.setattr(command, "train", lambda args: _summary(step_memory=[2**20, 2**21]))
    assert main(["--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert out.index("loss fell") < out.index(f"plot written to {target}")


@pytest.mark.distributed
def test_nprocs_2_trains_with_ddp_and_agrees_on_the_auto_batch_size(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank also checks the DDP evaluation (one spawn for both), and a rank stuck in
    # a collective fails the test instead of hanging CI.
    bn_checks: list[list[float]] = []

    def launch_checked(fn: Any, args: Any, *, nprocs: int) -> list[DemoSummary]:
        assert fn is command.launched
        results = launch(_bn_check_then_train, args, nprocs=nprocs, timeout=180)
        bn_checks.extend(bn for bn, _ in results)
        return [summary for _, summary in results]

    monkeypatch.setattr(command, "launch", launch_checked)
    # The later --batch-size wins over SHORT's; each rank searches, the smallest is used.
    s = _run_json(capsys, "--nprocs", "2", "--batch-size", "auto", "--device", "cpu")
    assert (s["strategy"], s["world_size"]) == ("DistributedDataParallel", 2)
    batch = s["batch_size"]
    assert batch % 8 == 0
    assert 8 <= batch <= 16  # the cap: 256 images / (2 ranks x 8 batches)
    # Each rank trains on its half (128 images): 128 // batch micro-steps, accumulate 2.
    assert s["epochs"][0]["optimizer_steps"] == math.ceil(128 // batch / 2)
    assert s["loss_fell"] is True
    # Evaluation under DDP scores one model: rank 0's BatchNorm statistics on every rank.
    assert bn_checks == [[0.0, 0.0], [0.0, 0.0]]


def _bn_check_then_train(args: Any) -> tuple[list[float], DemoSummary]:
    """One rank of ``--nprocs 2``: the evaluation check, then the demo's own rank function.

    One process group for both: the demo uses a group that exists and leaves it alone.
    (Destroying a group and creating another in the same launched process can hang:
    the second rendezvous may read the first one's stale keys from the shared store.)
    """
    from torch import nn

    from cudakit.amp import autocast_step
    from cudakit.parallel import process_group

    with process_group() as group:
        model = make_model(width=2)
        model[1].running_mean.fill_(float(group.rank))  # as after each rank's own last batch
        step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.0), dtype="fp32")
        images, labels = make_dataset(8, seed=0, split="val")
        r, w = group.rank, group.world_size
        evaluate(model, nn.CrossEntropyLoss(), step, images[r::w], labels[r::w], w)
        bn = [float(v) for v in model[1].running_mean]
        return bn, command.launched(args)


@pytest.mark.cuda
def test_nprocs_beyond_the_gpus_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    n = torch.cuda.device_count() + 1
    err = _error(capsys, "--nprocs", str(n))
    assert f"--nprocs {n} starts one process per GPU, but this machine has {n - 1}" in err


@pytest.mark.cuda
def test_demo_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    s = _run_json(capsys, "--device", "cuda")
    assert s["device"].startswith("cuda:")
    assert s["dtype"] in ("bfloat16", "float16")
    assert s["epochs"][0]["memory_kind"] == "allocated"
    assert s["epochs"][0]["peak_memory"] > 0
    assert s["loss_fell"] is True


@pytest.mark.cuda
def test_demo_on_cuda_fp16_uses_a_scaler_and_skips_nothing_for_long(
    capsys: pytest.CaptureFixture[str],
) -> None:
    s = _run_json(capsys, "--device", "cuda", "--dtype", "fp16", "--epochs", "2")
    assert s["dtype"] == "float16"
    assert s["steps_skipped"] <= 2  # GradScaler may skip its first step(s) while calibrating
    assert s["loss_fell"] is True


# -- the command line -----------------------------------------------------------------------


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def test_help_names_the_program_and_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cudakit demo")
    for option in ("--epochs", "--batch-size", "--dtype", "--device", "--seed", "--json"):
        assert option in out
    for option in ("--plot", "--nprocs", "--train-size", "--no-progress", "torchrun"):
        assert option in out


def test_cudakit_cli_routes_demo(capsys: pytest.CaptureFixture[str]) -> None:
    from cudakit.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
    assert "usage: cudakit demo" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], r"--epochs: expected a positive integer, got 0"),
        (["--epochs", "two"], r"--epochs: expected a positive integer, got 'two'"),
        (["--batch-size", "0"], r"--batch-size: expected a positive integer or 'auto'"),
        (["--batch-size", "big"], r"positive integer or 'auto' .*got 'big'"),
        (["--dtype", "half"], r"--dtype: invalid choice: 'half' \(choose from '?auto'?, '?bf16"),
        (["--nprocs", "-1"], r"--nprocs: expected a positive integer, got -1"),
        (["--device", "gpu"], r"--device gpu: unknown device 'gpu'; did you mean 'cuda'\?"),
    ],
)
def test_bad_options_are_clear_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    import re

    assert re.search(message, _error(capsys, *argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cuda_on_a_cpu_machine_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "--device", "cuda")
    assert "--device cuda: device='cuda' asks for CUDA, but CUDA is not available" in err
    assert 'Use device="auto"' in err


def test_plot_without_matplotlib_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    err = _error(capsys, "--plot", "out.png")
    assert "--plot out.png needs matplotlib, which is not installed" in err
    assert "pip install 'cudakit[plot]'" in err


def test_plot_into_a_missing_folder_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "nope" / "demo.png"
    err = _error(capsys, "--plot", str(target))
    assert f"--plot {target}: the folder {target.parent} does not exist" in err


def test_nprocs_inside_torchrun_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = _error(capsys, "--nprocs", "2")
    assert "--nprocs 2 was given inside a launcher (WORLD_SIZE=2)" in err
    assert "not both" in err


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any training (or launch) fail the test: errors must come before either."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started before rejecting its arguments")

    monkeypatch.setattr(command, "train", boom)
    monkeypatch.setattr(command, "launch", boom)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--train-size", "64", "--batch-size", "128"],
            r"--batch-size 128 is larger than the 64 training images, so not one batch would "
            r"run; use --batch-size 64 or less, or a larger --train-size\.",
        ),
        (  # the default train size on a CPU
            ["--batch-size", "4096"],
            r"--batch-size 4096 is larger than the 2048 training images",
        ),
        (
            ["--train-size", "101", "--batch-size", "64", "--nprocs", "2", "--device", "cpu"],
            r"--batch-size 64 is larger than each process's share of the 101 training images "
            r"\(51\), .*use --batch-size 51 or less",
        ),
        (
            ["--train-size", "6", "--batch-size", "auto"],
            r"--batch-size auto searches multiples of 8, more than the 6 training images; "
            r"use --train-size 8 or more\.",
        ),
    ],
)
def test_batch_larger_than_the_data_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    import re

    _no_training(monkeypatch)
    assert re.search(message, _error(capsys, *argv))


def test_a_batch_equal_to_the_data_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    monkeypatch.setattr(command, "train", lambda args: ran.append(args.batch_size))
    monkeypatch.setattr(command, "finish", lambda summary, args: 0)
    assert main(["--train-size", "64", "--batch-size", "64"]) == 0
    assert ran == [64]


def test_one_gpu_index_for_several_processes_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a 2-GPU machine: cuda:1 exists, but 2 processes cannot share it.
    monkeypatch.setattr(_args, "resolve_device", lambda spec: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _no_training(monkeypatch)
    err = _error(capsys, "--nprocs", "2", "--device", "cuda:1")
    assert "--device cuda:1 would put all 2 processes of this machine on one GPU" in err
    assert "use --device cuda or leave --device out" in err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("demo.jpg", r"--plot demo.jpg: the plot is a PNG; give a file name ending in .png, "),
        ("demo", r"e\.g\. --plot demo\.png\."),
    ],
)
def test_plot_must_be_a_png(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
    message: str,
) -> None:
    import re

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    _no_training(monkeypatch)
    assert re.search(message, _error(capsys, "--plot", name))


def test_plot_onto_a_folder_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    folder = tmp_path / "out.png"
    folder.mkdir()
    _no_training(monkeypatch)
    err = _error(capsys, "--plot", str(folder))
    assert f"--plot {folder} is a folder; give a file name such as demo.png." in err


def test_the_summary_is_printed_before_the_plot(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")

    def failing_plot(summary: DemoSummary, path: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(command, "train", lambda args: _summary())
    monkeypatch.setattr(command, "plot_summary", failing_plot)
    assert main(["--plot", str(tmp_path / "demo.png")]) == 1
    out, err = capsys.readouterr()
    assert "loss fell: 2.3000 -> 1.2000" in out  # not lost with the plot
    assert "could not write the plot to" in err
    assert "disk full" in err


# -- the pieces ---------------------------------------------------------------------------


def test_dataset_is_deterministic_and_the_splits_differ() -> None:
    x1, y1 = make_dataset(64, seed=5)
    x2, y2 = make_dataset(64, seed=5)
    assert torch.equal(x1, x2)
    assert torch.equal(y1, y2)
    xv, _ = make_dataset(64, seed=5, split="val")
    assert not torch.equal(x1, xv)
    x3, _ = make_dataset(64, seed=6)
    assert not torch.equal(x1, x3)
    assert x1.shape == (64, 3, 32, 32)
    assert y1.dtype == torch.int64
    assert set(make_dataset(500)[1].tolist()) == set(range(10))


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"n": 0}, ValueError, r"make_dataset\(n=\.\.\.\) expects an int >= 1, got int 0\. .*n=64"),
        ({"n": True}, TypeError, r"make_dataset\(n=\.\.\.\) expects an int >= 1, got bool True"),
        (
            {"n": 4, "split": "test"},
            ValueError,
            r"make_dataset\(split=\.\.\.\) expects 'train' or 'val', got str 'test'\. Pass",
        ),
    ],
)
def test_dataset_errors(kwargs: dict[str, Any], exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        make_dataset(**kwargs)


def test_model_is_conv_bn_relu_blocks() -> None:
    model = make_model(width=4)
    kinds = [type(m).__name__ for m in model]
    assert kinds[:3] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert kinds.count("BatchNorm2d") == 4
    assert model(torch.zeros(3, 3, 32, 32)).shape == (3, 10)


def _summary(**over: Any) -> DemoSummary:
    epoch = EpochStats(
        epoch=1,
        train_loss=1.5,
        val_loss=1.4,
        val_accuracy=0.5,
        samples_per_s=1234.5,
        seconds=2.0,
        optimizer_steps=4,
        skipped_steps=1,
        peak_memory=3 * 2**20,
        memory_kind="allocated",
    )
    fields: dict[str, Any] = {
        "device": "cuda:0",
        "dtype": "bfloat16",
        "strategy": "none",
        "world_size": 1,
        "batch_size": 64,
        "accumulate": 2,
        "max_grad_norm": 1.0,
        "train_samples": 2048,
        "val_samples": 512,
        "seed": 0,
        "warmup_first_pass_s": 0.5,
        "warmup_last_pass_s": 0.01,
        "first_loss": 2.3,
        "final_loss": 1.2,
        "final_accuracy": 0.5,
        "epochs": [epoch],
        "step_losses": [2.3, 1.2],
    }
    fields.update(over)
    return DemoSummary(**fields)


def test_summary_table_and_dict() -> None:
    s = _summary()
    text = str(s)
    assert "warm-up        500.0 ms first pass, 10.0 ms last pass" in text
    assert "steps skipped  1" in text
    assert "3.00 MiB" in text
    assert "1,234" in text
    assert "50.0%" in text
    assert "loss fell: 2.3000 -> 1.2000" in text
    d = s.to_dict()
    assert "step_losses" not in d
    assert d["loss_fell"] is True
    assert d["steps_skipped"] == 1
    assert json.loads(json.dumps(d)) == d
    assert "did NOT fall" in str(_summary(final_loss=2.4))
    assert "epoch  train loss" in str(_summary(epochs=[]))  # a header even with no rows


def test_plain_progress_prints_one_line_per_epoch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the "progress" extra missing
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = Progress(10, "epoch 1/2", enabled=True)
    assert bar.bar is None
    bar.update(10, loss=1.0, samples_per_s=5.0)
    bar.close("train loss 1.0")
    assert capsys.readouterr().err == "epoch 1/2: train loss 1.0\n"
    no_bar = Progress(10, "epoch 1/2", enabled=True, bar=False)  # --no-progress
    assert no_bar.bar is None
    no_bar.close("x")
    assert capsys.readouterr().err == "epoch 1/2: x\n"
    silent = Progress(10, "epoch 1/2", enabled=False)  # ranks other than 0
    silent.close("x")
    assert capsys.readouterr().err == ""


@given(
    samples=st.floats(0, 1e7),
    tflops=st.one_of(st.none(), st.floats(0, 5e3)),
    mfu=st.one_of(st.none(), st.floats(0, 1)),
    memory=st.integers(0, 2**42),
    skipped=st.integers(0, 10**6),
    epochs=st.integers(1, 3),
    reason=st.one_of(
        st.none(),
        st.lists(st.text("abcdefghij=.", min_size=1, max_size=12), max_size=30).map(" ".join),
    ),
)
@settings(max_examples=60, deadline=None)
def test_the_summary_fits_a_terminal_80_columns_wide(
    samples: float,
    tflops: float | None,
    mfu: float | None,
    memory: int,
    skipped: int,
    epochs: int,
    reason: str | None,
) -> None:
    """Every line fits 80 columns: a wide table goes in parts, the epoch repeated; a long
    value wraps under itself. Nothing is lost on the way."""
    rows = [
        EpochStats(
            epoch=i + 1,
            train_loss=1.5,
            val_loss=1.4,
            val_accuracy=0.5,
            samples_per_s=samples,
            seconds=2.0,
            optimizer_steps=4,
            skipped_steps=skipped,
            peak_memory=memory,
            memory_kind="rss",
            tflops=tflops,
            mfu=mfu,
        )
        for i in range(epochs)
    ]
    text = str(_summary(epochs=rows, mfu_reason=reason))
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for header in ("train loss", "samples/s", "FLOP/s", "MFU", "peak mem", "skipped"):
        assert header in text
    assert text.count(f"{skipped:>7}") >= epochs or str(skipped) in text
    if reason:
        assert " ".join(reason.split()) in " ".join(text.split())


def test_a_wide_summary_table_repeats_the_epoch_in_each_part() -> None:
    row = EpochStats(
        epoch=1,
        train_loss=1.5,
        val_loss=1.4,
        val_accuracy=0.5,
        samples_per_s=1234.5,
        seconds=2.0,
        optimizer_steps=4,
        skipped_steps=0,
        peak_memory=3 * 2**30,
        memory_kind="rss",
        tflops=0.02,
    )
    lines = str(_summary(epochs=[row], mfu_reason="x")).splitlines()
    headers = [ln for ln in lines if ln.startswith("epoch")]
    assert len(headers) == 2
    assert "train loss" in headers[0]
    assert "peak mem" in headers[1]
