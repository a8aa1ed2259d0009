"""One rank of the 2-rank DDP nanoGPT resume test (gloo, CPU), spawned by launcher_env.run_ranks.

In one process group, three runs of the same loop: uninterrupted; saved (a save asked
for mid-window, taken at its end) and then abandoned; and rebuilt from fresh objects,
seeded otherwise, resumed from that checkpoint and run to the end. Each rank writes
what the test compares to ``{out}/{rank}.pt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from launcher_env import join_gloo

WORLD = 2


def worker(rank: int, port: int, out: str) -> None:
    from port_real_loops import Crash, gpt_run, training_state

    join_gloo(rank, port, WORLD)
    root = Path(out)
    result: dict[str, Any] = {}
    try:
        kw: dict[str, Any] = {"accumulate": 4, "epochs": 2, "ddp": True, "dtype": torch.float32}
        ref = gpt_run(root / "ref", **kw)
        try:
            gpt_run(root / "run", save_at=(5,), crash_at=10, **kw)
        except Crash:
            pass
        else:
            raise AssertionError("the first run was not abandoned")
        resumed = gpt_run(root / "run", noise=11 + rank, **kw)

        def plain(run: dict[str, Any]) -> dict[str, Any]:
            state = training_state(run)
            state.pop("loader_rng")  # a distributed_loader shuffles by seed and epoch
            state["step"] = {k: v for k, v in state["step"].items() if v is not None}
            return state

        ckpt = resumed["ckpt"]
        result = {
            "ref": plain(ref),
            "resumed": plain(resumed),
            "ref_losses": ref["losses"],
            "resumed_losses": resumed["losses"],
            "resumed_from": ckpt.resumed_from.name if ckpt.resumed_from else "",
            "weights": torch.cat([p.detach().reshape(-1) for p in resumed["model"].parameters()]),
        }
    finally:
        torch.distributed.destroy_process_group()
    torch.save(result, root / f"{rank}.pt")
