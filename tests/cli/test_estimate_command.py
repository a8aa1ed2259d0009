"""`cudakit estimate`: a model factory's peak per rank, and the largest batch that fits."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cudakit.cli import main

FACTORY = """
import torch


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build():
    return Stack()
"""


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "estimate_models.py").write_text(FACTORY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "estimate_models:build"
    sys.modules.pop("estimate_models", None)


def test_prints_the_breakdown(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", factory, "--batch", "16,64", "--strategy", "fsdp", "--world-size", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("estimated peak per rank: ")
    assert "(fsdp, world size 4, recompute none, fp32)" in out
    for part in ("parameters", "gradients", "optimizer", "activations", "communication"):
        assert part in out


def test_fit_gives_the_largest_batch_per_choice(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["estimate", factory, "--batch", "1,64", "--strategy", "ddp", "--world-size", "2"]
    assert main([*argv, "--fit", "2MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fit"] == 2 * 2**20
    choices = {(c["strategy"], c["recompute"]): c["batch"] for c in data["choices"]}
    assert set(choices) == {(s, p) for s in ("ddp", "fsdp") for p in ("none", "selective", "full")}
    assert choices[("fsdp", "none")] > choices[("ddp", "none")] > 0


def test_bad_factory_and_bad_batch_are_clear(
    factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match=r"MODEL expects module:function"):
        main(["estimate", "estimate_models", "--batch", "2,64"])
    with pytest.raises(SystemExit, match=r"cannot load 'estimate_models:nope'"):
        main(["estimate", "estimate_models:nope", "--batch", "2,64"])
    with pytest.raises(SystemExit):
        main(["estimate", factory, "--batch", "2,x"])
    assert "--batch expects a shape and an optional dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"world_size=\.\.\.\) expects 1 with strategy='none'"):
        main(["estimate", factory, "--batch", "2,64", "--world-size", "2"])
    with pytest.raises(SystemExit, match=r"the Stack refused the batch"):
        main(["estimate", factory, "--batch", "2,63"])
