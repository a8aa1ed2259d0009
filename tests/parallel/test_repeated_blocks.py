"""Which modules are a model's repeated blocks: FSDP2's units, recompute's default
blocks and ``estimate_memory``'s units, found the same way by all three.

torchtitan keeps its blocks in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (for
pipeline splits); nanoGPT and transformers in an ``nn.ModuleList``. Sharding them is
checked on gloo ranks in tests/ports/test_port_torchtitan.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cudakit._blocks import repeated_blocks
from cudakit.memory.estimate import _units
from cudakit.parallel import Recompute
from cudakit.parallel.recompute import find_blocks


class Net(nn.Module):
    def __init__(self, container: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        blocks = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)]
        if container is nn.ModuleDict:
            self.layers: nn.Module = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        else:
            self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_the_blocks_of_a_module_list_or_dict(container: type[nn.Module]) -> None:
    net = Net(container)
    layers = list(net.layers.children())
    assert repeated_blocks(net) == layers
    found = find_blocks(net, Recompute("full"))
    assert [name for name, _ in found] == ["layers.0", "layers.1", "layers.2"]
    with torch.device("meta"):
        meta = Net(container)
    blocks, root = _units(meta)
    assert blocks == [4 * 5 * 4] * 3  # weight and bias of each block's Linear, fp32
    assert root == (4 * 5 + 4 * 2 + 2) * 4


def test_a_model_without_one_has_no_blocks() -> None:
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


class Adapted(nn.Module):
    """A block holding adapters in an ``nn.ModuleDict`` (PEFT's LoRA layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def test_containers_inside_a_block_are_part_of_that_block() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Adapted(), Adapted()]))
    outer = list(net[1])
    assert repeated_blocks(net) == outer
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Adapted(), Adapted()]))
    blocks, root = _units(meta)
    per_block = (4 * 4 + 4) + 4 * 2 + 2 * 4 + 2 * (4 * 4 + 4)
    assert blocks == [per_block * 4] * 2
    assert root == (4 * 4 + 4) * 4
