"""A model's repeated blocks: FSDP2's units, recompute's default blocks, the estimate's units.

A transformer keeps its blocks in a container: an ``nn.ModuleList`` (nanoGPT,
transformers) or an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (torchtitan, so
that a pipeline stage can drop the others). Every member of every such container is
a block; ``parallelize(strategy="fsdp")``, ``recompute`` and ``estimate_memory``
find them here, so the three agree.
"""

from __future__ import annotations

from torch import nn

__all__ = ["repeated_blocks"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Every member of every ``nn.ModuleList`` and ``nn.ModuleDict`` in ``model``.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)}))
    >>> [type(b).__name__ for b in repeated_blocks(net)]
    ['Linear']

    In ``model.modules()`` order, each container's members in their own order.
    """
    blocks: list[nn.Module] = []
    for sub in model.modules():
        if isinstance(sub, nn.ModuleList):
            blocks.extend(sub)
        elif isinstance(sub, nn.ModuleDict):
            blocks.extend(sub.values())
    return blocks
