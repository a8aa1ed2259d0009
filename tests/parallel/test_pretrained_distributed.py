"""Pretrained weights into a model sharded over gloo ranks, and back out: a slice per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from meta_gpt import GPT, gpt_init

import cudakit.parallel as cp

st_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.distributed

VOCAB, WIDTH = 37, 10  # 37 rows over 3 ranks: 13, 13, 11


def _source() -> dict[str, torch.Tensor]:
    torch.manual_seed(21)
    sd = GPT(vocab=VOCAB, width=WIDTH).state_dict()
    return {k: v for k, v in sd.items() if k != "head.weight"}  # tied: once


def _ranks(tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    out: dict[str, Any] = {}
    with cp.process_group(timeout=120):
        with torch.device("meta"):
            model = GPT(vocab=VOCAB, width=WIDTH)
        model = cp.parallelize(model, "fsdp", init=gpt_init)
        res = cp.load_pretrained(model, root / "hf" / "w.safetensors")
        out["bytes"] = res.bytes_read
        out["shard_bytes"] = sum(p.to_local().nbytes for p in model.parameters())
        out["tied"] = model.head.weight is model.embed.weight
        out["loaded"] = {k: v.clone() for k, v in cp.state_dict(model).items()}
        out["files"] = cp.save_pretrained(model, root / "out", max_shard_size=2000)
        with torch.device("meta"):
            again = GPT(vocab=VOCAB, width=WIDTH)
        again = cp.parallelize(again, "fsdp", init=gpt_init, init_seed=1)
        assert cp.load_pretrained(again, root / "dcp").bytes_read is None
        out["from_dcp"] = {k: v.clone() for k, v in cp.state_dict(again).items()}
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_each_rank_reads_its_rows_and_the_files_written_load_bit_for_bit(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = _source()
    (tmp_path / "hf").mkdir()
    st_torch.save_file(src, str(tmp_path / "hf" / "w.safetensors"))
    dcp.save({f"model.model.{k}": v for k, v in src.items()}, checkpoint_id=str(tmp_path / "dcp"))
    results = cp.launch(_ranks, str(tmp_path), nprocs=3, timeout=300)
    total = sum(v.nbytes for v in src.values())
    # Every row read by exactly one rank, each rank its own shard's rows and no more.
    assert sum(r["bytes"] for r in results) == total
    for r in results:
        assert r["bytes"] == r["shard_bytes"]
        assert r["bytes"] < total / 2
        assert r["tied"]
    loaded = results[0]["loaded"]
    for k, v in src.items():
        assert torch.equal(loaded[k], v), k
        assert torch.equal(results[0]["from_dcp"][k], v), k
    assert torch.equal(loaded["head.weight"], src["embed.weight"])
    files = results[0]["files"]
    assert len(files) > 1
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(st_torch.load_file(str(f)))
    assert merged.keys() == src.keys()
    for k, v in src.items():
        assert torch.equal(merged[k], v), k
