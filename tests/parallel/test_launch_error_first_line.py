"""The first line of a failed ``launch()`` says what went wrong, on real 2-rank gloo launches.

* a hung rank is named, with where it was when last seen (its Python stack, dumped by
  faulthandler when ``launch()`` stops it), and its peer's timeout comes after it as
  the consequence, also when the peer's error passed through ``autocast_step``;
* a rank's failure leads with the exception's type and its *first* line (torch's
  multi-line messages end with advice, not the gist);
* DDP's unused-parameter error under ``parallelize`` names the parameters and the fix.

Finite timeouts everywhere; no process outlives a test.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
from torch import nn

import cudakit.parallel as cp
from cudakit.amp import autocast_step

pytestmark = pytest.mark.distributed


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _nothing_left(err: cp.LaunchError) -> None:
    assert all(_gone(pid) for pid in err.pids)
    assert multiprocessing.active_children() == []


def _wait_for_a_message_that_never_comes() -> None:
    time.sleep(120)


def _hang_on_rank_1_inside_autocast_step() -> None:
    """Rank 1 stops before its second backward; rank 0's DDP backward times out (3 s)."""
    torch.manual_seed(0)
    with cp.process_group(timeout=3):
        model = cp.parallelize(nn.Linear(4, 2))
        step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        for i in range(2):
            if i == 1 and cp.rank() == 1:
                _wait_for_a_message_that_never_comes()
            with step:
                loss = model(torch.ones(8, 4)).square().mean()
            step.backward(loss)


def test_a_hung_rank_is_named_with_where_it_was_last_seen() -> None:
    start = time.monotonic()
    with pytest.raises(cp.LaunchError) as info:
        cp.launch(_hang_on_rank_1_inside_autocast_step, nprocs=2, timeout=120)
    assert time.monotonic() - start < 90  # the 3 s group timeout, not the 120 s sleep
    err = info.value
    text = str(err)
    first = text.splitlines()[0]
    assert first.startswith(
        f"rank 1 of 2 (pid {err.pids[1]}) did not arrive; last seen in: "
        "_wait_for_a_message_that_never_comes (test_launch_error_first_line.py:"
    ), first
    assert (err.rank, err.exitcode) == (1, None)
    # Its stack follows, most recent call first, down to the launched function.
    stack = text[text.index("Rank 1's Python stack when last seen") :]
    assert "_wait_for_a_message_that_never_comes" in stack
    assert "_hang_on_rank_1_inside_autocast_step" in stack
    assert "launcher.py" not in stack.split("\n\n")[0]
    # Rank 0's timeout is the consequence, after it.
    assert "(then, as a consequence: rank 0: RuntimeError: " in text
    assert text.index("rank 0: RuntimeError") > text.index("did not arrive")
    _nothing_left(err)


def test_the_launch_timeout_names_where_each_rank_was_last_seen() -> None:
    with pytest.raises(cp.LaunchError) as info:
        # long enough for both ranks to start on a busy machine, short of the 120 s sleep
        cp.launch(_sleep_on_both_ranks, nprocs=2, timeout=40)
    text = str(info.value)
    assert text.startswith("launch() timed out after 40s with rank(s) [0, 1] still running")
    assert "rank 0 last seen in: _wait_for_a_message_that_never_comes (" in text
    assert "rank 1 last seen in: _wait_for_a_message_that_never_comes (" in text
    _nothing_left(info.value)


def _sleep_on_both_ranks() -> None:
    _wait_for_a_message_that_never_comes()


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)  # defined, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _unused_layer() -> None:
    torch.manual_seed(0)
    with cp.process_group(timeout=30):
        model = cp.parallelize(_TwoLayers())
        step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        for _ in range(2):
            with step:
                loss = model(torch.ones(8, 4)).square().mean()
            step.backward(loss)


def test_an_unused_parameter_error_names_the_parameters_and_the_fix() -> None:
    with pytest.raises(cp.LaunchError) as info:
        cp.launch(_unused_layer, nprocs=2, timeout=120)
    text = str(info.value)
    first = text.splitlines()[0]
    # The exception's type and its first line, never torch's closing advice.
    assert first.startswith("rank "), first
    assert " failed: RuntimeError: Expected to have finished reduction " in first, first
    assert "TORCH_DISTRIBUTED_DEBUG" not in first
    assert (
        "DDP's parameters 'b.weight', 'b.bias' received no gradient: the loss does not use them"
    ) in text
    assert "find_unused_parameters=True" in text
    assert text.count("received no gradient") == 1  # said once, though the step noted it too
    _nothing_left(info.value)


def _raise_a_multiline_error() -> None:
    raise ValueError("the gist, on the first line\nthe details\nand advice at the end")


def test_a_rank_failure_leads_with_the_exception_type_and_first_line() -> None:
    with pytest.raises(cp.LaunchError) as info:
        cp.launch(_raise_a_multiline_error, nprocs=1, timeout=60)
    first = str(info.value).splitlines()[0]
    assert first.endswith("failed: ValueError: the gist, on the first line"), first


def _notes_of_an_unused_layer(decorated: bool) -> list[str] | None:
    """The notes on DDP's unused-parameter error as the rank's own code catches it."""
    torch.manual_seed(0)
    with cp.process_group(timeout=30):
        model = cp.parallelize(_TwoLayers())
        step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model)

        @step
        def train(x: torch.Tensor) -> torch.Tensor:
            return model(x).square().mean()

        try:
            for _ in range(2):
                if decorated:
                    train(torch.ones(8, 4))
                else:
                    with step:
                        loss = model(torch.ones(8, 4)).square().mean()
                    step.backward(loss)
        except RuntimeError as exc:
            return list(getattr(exc, "__notes__", []))
    return None  # (no error: the test fails on it)


@pytest.mark.parametrize("decorated", [True, False], ids=["decorated", "with-step"])
def test_the_step_names_the_unused_parameters_outside_launch(decorated: bool) -> None:
    # Under torchrun the rank's own traceback is what the user reads: autocast_step,
    # which holds the DDP model, notes the names and the fix on torch's error.
    notes = cp.launch(_notes_of_an_unused_layer, decorated, nprocs=2, timeout=120)
    for rank_notes in notes:
        assert rank_notes is not None, "DDP raised no error"
        text = "\n".join(rank_notes)
        assert "DDP's parameters 'b.weight', 'b.bias' received no gradient" in text, rank_notes
        assert "find_unused_parameters=True" in text
