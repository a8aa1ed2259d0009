"""``ckpt.save()`` at the top of the loop body, before the batch's step (nanoGPT's order).

The batch ``batches()`` has just yielded is not stepped on yet: the checkpoint leaves
it out (position one batch back, the RNG as it is before its step, or as the epoch
began for its first batch), so the resumed run steps on it and ends bit for bit as the
run that never stopped. Any save point, any accumulation, both epochs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudakit


class Crash(Exception):
    pass


class Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """A random augmentation per item, drawn in the main process (num_workers=0)."""

    def __init__(self) -> None:
        self.x = torch.randn(12, 3, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + torch.rand(3)


def _run(directory: Path, seed: int, save_at: int, accumulate: int, crash_at: int | None = None,
         explicit: bool = False, augment: bool = False, every: int | None = None,
         ) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.3), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    step = cudakit.autocast_step(opt, model=model, dtype=torch.float32, accumulate=accumulate)
    samples: Any = (
        Augmented() if augment else torch.randn(12, 3, generator=torch.Generator().manual_seed(7))
    )
    loader = torch.utils.data.DataLoader(
        samples, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    ckpt = cudakit.Checkpointer(directory, step=step, loader=loader, preemption=False, every=every)
    losses: dict[int, float] = {}
    try:
        for _ in ckpt.epochs(2):
            for x in ckpt.batches():
                total = ckpt.position.total
                if total == crash_at:
                    raise Crash
                if total == save_at:
                    ckpt.save()  # the top of the body: before this batch's step
                if explicit:
                    with step:
                        loss = model(x).square().mean()
                    step.backward(loss)
                else:
                    loss = step(lambda x: model(x).square().mean())(x).loss
                losses[total] = float(loss.detach())
    finally:
        ckpt.close()
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(), "position": ckpt.position}  # fmt: skip


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a["position"] == b["position"]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(save_at=st.integers(1, 12), accumulate=st.sampled_from([1, 2, 3]), data=st.data())
def test_a_save_before_the_step_resumes_bit_for_bit(
    tmp_path: Path, save_at: int, accumulate: int, data: st.DataObject
) -> None:
    # A save asked mid-window is taken at the window's end (after batch `due`): a crash
    # before that leaves nothing to resume from, which another seed could not match.
    done = save_at - 1
    due = done if done % accumulate == 0 else -(-done // accumulate) * accumulate
    crash_at = data.draw(st.integers(max(save_at, due) + 1, 13), label="crash_at")
    root = tmp_path / f"{save_at}-{accumulate}-{crash_at}"
    ref = _run(root / "ref", 0, save_at, accumulate)
    # (crash_at 13 is never reached: the run ends, and resumes to nothing more)
    with contextlib.suppress(Crash):
        _run(root / "run", 0, save_at, accumulate, crash_at=crash_at)
    resumed = _run(root / "run", 1, save_at, accumulate)
    _same(ref, resumed)
    first = min(resumed["losses"], default=13)
    assert {k: v for k, v in ref["losses"].items() if k >= first} == resumed["losses"]


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented"])
@pytest.mark.parametrize("save_at", [1, 3, 7])
def test_the_explicit_form_an_epochs_first_batch_and_augmentation(
    tmp_path: Path, save_at: int, augment: bool
) -> None:
    """The explicit form too; batches 1 and 7 are the first of an epoch (the shuffle's
    draw); an augmenting dataset draws from torch's RNG as each batch is fetched."""
    kw: dict[str, Any] = {"explicit": True, "augment": augment}
    ref = _run(tmp_path / "ref", 0, save_at, 1, **kw)
    with pytest.raises(Crash):
        _run(tmp_path / "run", 0, save_at, 1, crash_at=save_at + 2, **kw)
    resumed = _run(tmp_path / "run", 1, save_at, 1, **kw)
    assert min(resumed["losses"]) == save_at  # the saved batch is stepped on after resume
    _same(ref, resumed)
    assert {k: v for k, v in ref["losses"].items() if k >= save_at} == resumed["losses"]


def test_a_save_after_the_step_still_counts_the_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    step = cudakit.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    loader = torch.utils.data.DataLoader(torch.randn(8, 3), batch_size=2)
    with cudakit.Checkpointer(tmp_path, step=step, loader=loader, preemption=False) as ckpt:
        for _ in ckpt.epochs(1):
            for x in ckpt.batches():
                step(lambda x: model(x).square().mean())(x)
                if ckpt.position.total == 2:
                    path = ckpt.save()
    assert path is not None
    assert path.name == "ckpt-0000000002"


def test_a_position_saved_already_is_not_written_again(tmp_path: Path) -> None:
    """every=1 saved ckpt-2 after batch 2; save() at the top of batch 3 is that position:
    it returns that checkpoint and does not write it again."""
    stamps: list[tuple[int, int]] = []
    original = cudakit.Checkpointer.save

    def save(self: cudakit.Checkpointer) -> Any:
        manifest = self.directory / "ckpt-0000000002" / "cudakit.json"
        before = manifest.stat().st_mtime_ns if self.position.total == 3 else 0
        path = original(self)
        if self.position.total == 3:
            assert path is not None
            assert path.name == "ckpt-0000000002"
            stamps.append((before, manifest.stat().st_mtime_ns))
        return path

    ref = _run(tmp_path / "ref", 0, 99, 1, every=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cudakit.Checkpointer, "save", save)
        got = _run(tmp_path / "run", 0, 3, 1, every=1)
    assert len(stamps) == 1
    assert stamps[0][0] == stamps[0][1]
    _same(ref, got)
