"""A resume into a model built on the meta device: saved at 2 ranks, resumed at 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from meta_gpt import GPT, gpt_init

import cudakit
import cudakit.parallel as cp

pytestmark = pytest.mark.distributed


def _run(directory: str, resume: bool) -> dict[str, Any]:
    with cp.process_group(timeout=120):
        with torch.device("meta"):
            model = GPT(vocab=13, width=6)
        # Another seed on resume: the checkpoint's values must win.
        model = cp.parallelize(model, "fsdp", init=gpt_init, init_seed=2 if resume else 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = cudakit.Checkpointer(directory, model=model, optimizer=opt, preemption=False)
        if resume:
            ckpt.resume()
        else:
            model(torch.arange(6).reshape(2, 3)).sum().backward()
            opt.step()
            ckpt.save()
        ckpt.close()
        return {k: v.clone() for k, v in cp.state_dict(model).items()}


def test_a_checkpoint_resumes_into_a_meta_built_model_at_another_world_size(
    tmp_path: Path,
) -> None:
    saved = cp.launch(_run, str(tmp_path), False, nprocs=2, timeout=300)[0]
    resumed = cp.launch(_run, str(tmp_path), True, nprocs=3, timeout=300)[0]
    assert saved.keys() == resumed.keys()
    for k, v in saved.items():
        assert torch.equal(v, resumed[k]), k
