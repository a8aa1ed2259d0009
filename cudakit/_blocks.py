"""A model's repeated blocks: FSDP2's units, recompute's default blocks, the estimate's units.

A transformer keeps its blocks in a container: an ``nn.ModuleList`` (nanoGPT,
transformers) or an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (torchtitan, so
that a pipeline stage can drop the others). Every member of every such container is
a block, unless it sits inside another block (a block's own containers, LoRA's
adapter dicts or a mixture's experts, are part of that block);
``parallelize(strategy="fsdp")``, ``recompute`` and ``estimate_memory`` find them
here, so the three agree.
"""

from __future__ import annotations

from torch import nn

__all__ = ["repeated_blocks"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Every member of every ``nn.ModuleList`` and ``nn.ModuleDict`` in ``model`` that
    is not inside another such member.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)}))
    >>> [type(b).__name__ for b in repeated_blocks(net)]
    ['Linear']

    In ``model.modules()`` order, each container's members in their own order.
    """
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # the modules of the blocks found so far
    for sub in model.modules():
        if id(sub) in inside:
            continue
        if isinstance(sub, nn.ModuleList):
            members = list(sub)
        elif isinstance(sub, nn.ModuleDict):
            members = list(sub.values())
        else:
            continue
        for block in members:
            if id(block) not in inside:
                blocks.append(block)
                inside.update(id(m) for m in block.modules())
    return blocks
