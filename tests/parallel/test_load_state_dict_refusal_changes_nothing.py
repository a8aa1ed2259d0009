"""``cudakit.parallel.load_state_dict`` refuses a state that does not fit and leaves the
model as it was, whatever does not fit: a value that is not a tensor, a complex tensor
for a real one (torch copies the parts that fit before it raises)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cudakit.parallel as parallel


@pytest.mark.parametrize(
    "bad",
    [3, "zeros", torch.ones(2, dtype=torch.complex64)],
    ids=["an int", "a str", "complex"],
)
def test_a_refused_state_changes_nothing(bad: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"weight": torch.ones(2, 2), "bias": bad}
    with pytest.raises(ValueError, match=r"load_state_dict\(state=") as info:
        parallel.load_state_dict(model, state)
    assert isinstance(info.value, RuntimeError)  # torch's own kind, too
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
