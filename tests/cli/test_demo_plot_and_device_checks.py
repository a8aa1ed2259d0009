"""`cudakit demo` refuses up front what cannot work (a plot file it cannot write, the meta
device), and reports a plot it could not write after training as one line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cudakit.demo import DemoSummary, EpochStats, command, main


class _Trained(Exception):
    """Raised instead of training: the checks before it have all passed."""


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def _stop_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def stop(*args: object, **kwargs: object) -> None:
        raise _Trained

    monkeypatch.setattr(command, "train", stop)
    monkeypatch.setattr(command, "launch", stop)


def _summary() -> DemoSummary:
    epoch = EpochStats(
        epoch=1,
        train_loss=1.5,
        val_loss=1.4,
        val_accuracy=0.5,
        samples_per_s=1234.5,
        seconds=2.0,
        optimizer_steps=4,
        skipped_steps=0,
        peak_memory=3 * 2**20,
        memory_kind="rss",
    )
    return DemoSummary(
        device="cpu",
        dtype="float32",
        strategy="none",
        world_size=1,
        batch_size=64,
        accumulate=2,
        max_grad_norm=1.0,
        train_samples=2048,
        val_samples=512,
        seed=0,
        warmup_first_pass_s=0.5,
        warmup_last_pass_s=0.01,
        first_loss=2.3,
        final_loss=1.2,
        final_accuracy=0.5,
        epochs=[epoch],
        step_losses=[2.3, 1.2],
        step_memory=[2**20, 2**21],
    )


# -- --plot: checked up front -----------------------------------------------------------


def _unwritable() -> str:
    """A .png path in a folder that exists but that nobody (root included) can write."""
    target = "/sys/cudakit-demo.png"
    if not os.path.isdir("/sys"):
        pytest.skip("needs Linux's /sys, a folder nobody can write")
    try:
        with open(target, "ab"):
            pass
    except OSError:
        return target
    os.remove(target)
    pytest.skip("/sys is writable here")


def test_a_plot_file_that_cannot_be_written_is_refused_before_training(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    target = _unwritable()
    _stop_before_training(monkeypatch)
    err = _error(capsys, "--plot", target)
    assert (
        f"--plot {target}: the file cannot be written (Permission denied); "
        "choose a place you can write, e.g. --plot demo.png." in err
    ), err


def test_the_up_front_check_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    _stop_before_training(monkeypatch)
    fresh = tmp_path / "fresh.png"
    with pytest.raises(_Trained):
        main(["--plot", str(fresh)])
    assert not fresh.exists()
    old = tmp_path / "old.png"
    old.write_bytes(b"an earlier plot")
    with pytest.raises(_Trained):
        main(["--plot", str(old)])
    assert old.read_bytes() == b"an earlier plot"


# -- --plot: a write that fails after training ------------------------------------------


def _full_disk(tmp_path: Path) -> Path:
    """A .png path whose writes fail with ENOSPC, as on a full disk (a link to /dev/full)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    link = tmp_path / "demo.png"
    link.symlink_to("/dev/full")
    return link


@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_disk_is_one_line_naming_the_plot_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    as_json: bool,
) -> None:
    pytest.importorskip("matplotlib")
    target = _full_disk(tmp_path)
    monkeypatch.setattr(command, "train", lambda args: _summary())
    assert main(["--plot", str(target), *(["--json"] if as_json else [])]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"cudakit demo: could not write the plot to {target}: No space left on device "
        "[Errno 28]; the summary above is complete."
    ]
    if as_json:
        assert json.loads(out)["final_loss"] == 1.2  # stdout stays valid JSON
    else:
        assert "loss fell: 2.3000 -> 1.2000" in out
        assert "plot written" not in out


def test_a_plot_that_fails_to_write_keeps_the_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")

    def failing_plot(summary: DemoSummary, path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(command, "train", lambda args: _summary())
    monkeypatch.setattr(command, "plot_summary", failing_plot)
    target = tmp_path / "demo.png"
    assert main(["--plot", str(target)]) == 1
    out, err = capsys.readouterr()
    assert "loss fell: 2.3000 -> 1.2000" in out
    assert err.strip() == (
        f"cudakit demo: could not write the plot to {target}: Permission denied "
        "[Errno 13]; the summary above is complete."
    )


# -- --device ---------------------------------------------------------------------------


def test_the_meta_device_is_refused_as_the_demos_device_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _stop_before_training(monkeypatch)
    err = _error(capsys, "--device", "meta")
    assert (
        "--device meta holds no data, so the demo cannot train or "
        "measure anything there; use --device cpu, --device cuda or leave --device out." in err
    ), err
    assert "autocast_step" not in err
    assert "on_device" not in err
