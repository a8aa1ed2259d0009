"""A run rolled back to an older checkpoint, a load that fails part-way, a loop with its own data.

* After ``load(older)`` and a save, the newest checkpoint is the one written last (the
  manifest's serial number), not the abandoned one of a higher step number; ``keep=``
  never removes the checkpoint it has just written.
* A load that fails after the checks (bytes changed in a data file, an extra that
  refuses its state) puts every tensor, the optimizer, scheduler, step and extras back.
* ``maybe_save()`` in a loop that brings its own data counts its batches and saves
  every ``every`` windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit
from cudakit.amp import autocast_step
from cudakit.checkpoint import _layout as layout


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("ckpt-"))


def _parts(accumulate: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    @autocast_step(opt, model=model, scheduler=sched, accumulate=accumulate, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), torch.zeros(len(x), 2))

    return model, opt, sched, step


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {
            k: v.clone()
            for p, s in opt.state.items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "sched": sched.state_dict(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and a["opt"].keys() == b["opt"].keys()
        and all(torch.equal(a["opt"][k], b["opt"][k]) for k in a["opt"])
        and a["groups"] == b["groups"]
        and a["sched"] == b["sched"]
    )


def test_maybe_save_counts_the_batches_of_a_loop_with_its_own_data(tmp_path: Path) -> None:
    *_, step = _parts(accumulate=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, every=2)
    saved = []
    for _ in range(8):
        step(torch.randn(3, 4))
        saved.append(ckpt.maybe_save())
    ckpt.close()
    # Windows of 2 batches; a save every 2 windows: after batches 4 and 8 (steps 2, 4).
    assert [p.name if p else None for p in saved] == [
        None, None, None, "ckpt-0000000002", None, None, None, "ckpt-0000000004"
    ]  # fmt: skip
    assert ckpt.position == cudakit.Position(epoch=0, batch=8, total=8, windows=4)
    resumed = cudakit.Checkpointer(tmp_path, step=_parts(accumulate=2)[3], every=2)
    assert resumed.resume() == ckpt.position
    resumed.close()


def test_maybe_save_inside_batches_does_not_count_twice(tmp_path: Path) -> None:
    *_, step = _parts()
    loader = torch.utils.data.DataLoader(torch.randn(6, 4), batch_size=2)
    ckpt = cudakit.Checkpointer(tmp_path, step=step, loader=loader, every=2)
    for _ in ckpt.epochs(1):
        for x in ckpt.batches():
            step(x)
            ckpt.maybe_save()
    assert (ckpt.position.total, ckpt.position.windows) == (3, 3)
    ckpt.close()


def test_after_a_rollback_the_newest_checkpoint_is_the_one_written_last(tmp_path: Path) -> None:
    *_, step = _parts()
    ckpt = cudakit.Checkpointer(tmp_path, step=step, every=1)
    for _ in range(4):
        step(torch.randn(2, 4))
        ckpt.maybe_save()
    ckpt.load(tmp_path / "ckpt-0000000002")  # roll back, e.g. after a loss spike
    step(torch.randn(2, 4))
    assert ckpt.maybe_save() == tmp_path / "ckpt-0000000003"  # replaces the abandoned 3
    ckpt.close()
    assert cudakit.find_latest(tmp_path) == tmp_path / "ckpt-0000000003"
    serials = {p: layout.read_manifest(tmp_path / p).serial for p in _dirs(tmp_path)}
    assert serials["ckpt-0000000003"] > serials["ckpt-0000000004"]
    again = cudakit.Checkpointer(tmp_path, step=_parts()[3])
    assert again.resume().total == 3  # not the abandoned ckpt-4
    again.close()


def test_keep_never_removes_the_checkpoint_it_has_just_written(tmp_path: Path) -> None:
    *_, step = _parts()
    ckpt = cudakit.Checkpointer(tmp_path, step=step, every=2)
    for _ in range(8):
        step(torch.randn(2, 4))
        ckpt.maybe_save()
    assert _dirs(tmp_path) == [f"ckpt-{n:010d}" for n in (2, 4, 6, 8)]
    ckpt.close()
    ckpt = cudakit.Checkpointer(tmp_path, step=step, every=1, keep=1)
    ckpt.load(tmp_path / "ckpt-0000000002")
    step(torch.randn(2, 4))
    assert ckpt.maybe_save() == tmp_path / "ckpt-0000000003"
    assert (tmp_path / "ckpt-0000000003").is_dir()
    step(torch.randn(2, 4))
    ckpt.maybe_save()
    ckpt.close()
    assert _dirs(tmp_path) == ["ckpt-0000000004"]  # the run's own; the abandoned 8 went too
    assert layout.read_manifest(tmp_path / "ckpt-0000000004").total == 4


def test_a_manifest_without_a_serial_number_still_reads(tmp_path: Path) -> None:
    *_, step = _parts()
    with cudakit.Checkpointer(tmp_path, step=step) as ckpt:
        ckpt.save()
    path = tmp_path / "ckpt-0000000000"
    text = (path / layout.MANIFEST).read_text().replace('"serial": 1', '"serial": 0')
    (path / layout.MANIFEST).write_text(text)
    assert layout.read_manifest(path).serial == 0
    assert cudakit.find_latest(tmp_path) == path


def _garble(path: Path) -> None:
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-64:] = bytes(64)  # the same size: the manifest's check passes
    data.write_bytes(bytes(raw))


def test_a_load_that_fails_after_the_checks_changes_nothing(tmp_path: Path) -> None:
    model, opt, sched, step = _parts()
    with cudakit.Checkpointer(tmp_path, step=step) as ckpt:
        for _ in range(3):
            step(torch.randn(2, 4))
            ckpt.maybe_save()
        ckpt.save()
    _garble(tmp_path / "ckpt-0000000003")
    model, opt, sched, step = _parts()
    for _ in range(2):
        step(torch.randn(2, 4))
    before = _snapshot(model, opt, sched)
    step_state = step.state_dict() if hasattr(step, "state_dict") else None
    ckpt = cudakit.Checkpointer(tmp_path, step=step)
    with pytest.raises(cudakit.CheckpointError, match=r"Nothing was changed") as info:
        ckpt.load(tmp_path / "ckpt-0000000003")
    assert "loading" in str(info.value)
    assert _same(before, _snapshot(model, opt, sched))
    if step_state is not None:
        assert str(step.state_dict()) == str(step_state)
    assert ckpt.resumed_from is None
    assert ckpt.position == cudakit.Position()
    ckpt.close()


class _Ema:
    def __init__(self, size: int) -> None:
        self.shadow = torch.zeros(size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["shadow"].shape != self.shadow.shape:
            raise ValueError(f"shape {tuple(state['shadow'].shape)} != {tuple(self.shadow.shape)}")
        self.shadow = state["shadow"].clone()


def test_an_extra_that_refuses_its_state_is_named_and_changes_nothing(tmp_path: Path) -> None:
    model, opt, sched, step = _parts()
    with cudakit.Checkpointer(tmp_path, step=step, extra={"ema": _Ema(3), "best": 0.5}) as ckpt:
        step(torch.randn(2, 4))
        ckpt.save()
    model, opt, sched, step = _parts()
    step(torch.randn(2, 4))
    step(torch.randn(2, 4))
    before = _snapshot(model, opt, sched)
    extra = {"ema": _Ema(4), "best": 9.0}
    ckpt = cudakit.Checkpointer(tmp_path, step=step, extra=extra)
    with pytest.raises(cudakit.CheckpointError, match=r"the extra 'ema' \(_Ema\) refused"):
        ckpt.resume()
    assert _same(before, _snapshot(model, opt, sched))
    assert ckpt.extra["best"] == 9.0
    assert ckpt.resumed_from is None
    ckpt.close()


def test_an_extra_that_cannot_be_pickled_is_named_not_blamed_on_the_disk(tmp_path: Path) -> None:
    *_, step = _parts()
    ckpt = cudakit.Checkpointer(tmp_path, step=step, extra={"it": (i for i in range(3))})
    with pytest.raises(
        cudakit.CheckpointSaveError, match=r"The extra\(s\) 'it' \(generator"
    ) as info:
        ckpt.save()
    assert "Free space" not in str(info.value)
    assert _dirs(tmp_path) == []
    ckpt.close()


def test_maybe_save_before_resume_is_refused_where_a_checkpoint_waits(tmp_path: Path) -> None:
    *_, step = _parts()
    with cudakit.Checkpointer(tmp_path, step=step) as ckpt:
        step(torch.randn(2, 4))
        ckpt.maybe_save()
        ckpt.save()
    model, opt, sched, step = _parts()
    step(torch.randn(2, 4))
    before = _snapshot(model, opt, sched)
    ckpt = cudakit.Checkpointer(tmp_path, step=step)
    with pytest.raises(RuntimeError, match=r"maybe_save\(\) before resume\(\).*ckpt-0000000001"):
        ckpt.maybe_save()
    assert _same(before, _snapshot(model, opt, sched))  # nothing loaded over the step
    assert ckpt.resume().total == 1
    ckpt.close()


class _Counting(torch.optim.SGD):
    """An optimizer that keeps a plain int in its per-parameter state."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return out


class _Tagged(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)
        self.tag = "mine"

    def get_extra_state(self) -> Any:
        return {"tag": self.tag}

    def set_extra_state(self, state: Any) -> None:
        self.tag = state["tag"]


def test_a_failed_load_puts_back_plain_optimizer_state_and_module_extra_state(
    tmp_path: Path,
) -> None:
    def build(size: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        torch.manual_seed(0)
        model = _Tagged()
        opt = _Counting(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, {"ema": _Ema(size)}

    model, opt, extra = build(3)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    model.tag = "saved"
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra=extra) as ckpt:
        ckpt.save()
    model, opt, extra = build(4)  # its extra refuses the saved one, after the tensors load
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    counts = [s["count"] for s in opt.state.values()]
    weights = [p.detach().clone() for p in model.parameters()]
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra=extra)
    with pytest.raises(cudakit.CheckpointError, match="refused"):
        ckpt.resume()
    assert [s["count"] for s in opt.state.values()] == counts == [2, 2]
    assert model.tag == "mine"
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    ckpt.close()


def test_a_tensor_learning_rate_is_put_back_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra={"ema": _Ema(3)}) as c:
        c.save()
    lr = opt.param_groups[0]["lr"]
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra={"ema": _Ema(5)})
    with pytest.raises(cudakit.CheckpointError):
        ckpt.resume()
    assert opt.param_groups[0]["lr"] is lr
    assert torch.equal(lr, torch.tensor(0.01))
    ckpt.close()
