"""A module that calls itself (a tree or recursive net) keeps its span for backward names,
whether the replay finds it by name or only when it is first called."""

from __future__ import annotations

import torch
from torch import nn

from cudakit.amp import find_nonfinite


class Rec(nn.Module):
    """Calls itself once; the outer call's own ``sqrt`` gives inf in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        if depth:
            x = self(x, depth - 1)
            return self.lin(x).clamp(min=0).sqrt()  # sqrt'(0) = inf
        return self.lin(x) * 0  # type: ignore[no-any-return]


def test_a_recursive_root_is_named_for_the_backward_of_its_own_code() -> None:
    torch.manual_seed(0)
    rec = Rec()
    holder = [rec]  # reached through a list: found only when first called
    for fn in (lambda x: holder[0](x).sum(), lambda x: rec(x).sum()):
        found = find_nonfinite(fn, torch.ones(2, 4))
        assert found is not None
        assert (found.phase, found.name, found.module) == ("backward", "", "Rec")
        assert found.op == "SqrtBackward0"
