"""Setting up a model bigger than one rank: per-rank peak memory, setup time, bytes read.

Run ``python benchmarks/bench_meta_init.py`` (``--quick`` for a smoke run with a small
model; ``--ranks 2 4`` picks the world sizes, ``--rounds`` the launches of each
way). For each world size, gloo ranks on the
CPU set up the same transformer (~184M parameters, fp32: 32,000 x 1,024 tied
embeddings, 12 blocks of width 1,024) two ways, each in fresh processes:

* **build, then shard** (the usual way): every rank builds the whole model on the
  CPU (``torch.manual_seed(0); Model()``), then ``parallelize(model, "fsdp")``;
* **meta + parallelize**: ``with torch.device("meta"): Model()``, then
  ``parallelize(model, "fsdp", init_seed=0)``: only this rank's shards are allocated.

Then the weights of a safetensors file (written once by ``save_pretrained``) go into
the sharded model three ways: ``load_pretrained`` (each rank reads its shard's rows),
each rank reading the whole file and keeping its rows, and rank 0 reading it and
broadcasting (``cudakit.parallel.load_state_dict``, DCP's ``broadcast_from_rank0``).

Memory is measured, never computed: each rank resets its resident-set high-water
mark (``/proc/self/clear_refs``) before a phase and reads ``VmHWM`` after it; the
figure is that peak above the resident set at the start of the phase. glibc is told
to give large blocks back to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so
the resident set follows what is alive. Bytes read are the ``rchar`` of
``/proc/self/io`` (every ``read`` call). The table shows the largest rank's figures
and each peak over the goal, shard + largest tensor (goal: at most 1.1).

``--device cuda`` sets the model up on one GPU instead (one process, NCCL, the
two ways in turn in each of ``--rounds`` launches): the setup time and the peak of
``torch.cuda.max_memory_allocated`` above the start, against the same goal. The
usual way builds on the CPU (torch's default threads) and moves the model. Without
a CUDA GPU it stops with a message.

``--json PATH`` writes the figures, the machine and the date (the data file of
``docs/figures/bench_meta_init.json``). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report

import cudakit.parallel as cp

MiB = 2**20


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


class Phase:
    """Peak resident memory above the start, wall time and bytes read of one phase."""

    def __enter__(self) -> Phase:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.rss0 = _status("VmRSS")
        self.read0 = _rchar()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.seconds = time.perf_counter() - self.t0
        self.peak = max(_status("VmHWM") - self.rss0, 0)
        self.read = _rchar() - self.read0

    def figures(self, **extra: Any) -> dict[str, Any]:
        return {"peak": self.peak, "seconds": self.seconds, "read": self.read, **extra}


def _sizes(model: nn.Module) -> dict[str, int]:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {
        "shard": sum(t.nbytes for t in local),
        "largest": max(p.numel() * p.element_size() for p in model.parameters()),
    }


def _set_up(way: str, cfg: tuple[int, int, int], device: str) -> nn.Module:
    """The model set up ``way``: built on meta and parallelized, or built, then sharded."""
    if way == "meta":
        with torch.device("meta"):
            model = Model(*cfg)
        return cp.parallelize(model, "fsdp", device, init_seed=0)
    torch.manual_seed(0)
    return cp.parallelize(Model(*cfg), "fsdp", device)


def _warm_up(device: str) -> None:
    """Both ways' imports and first calls (FSDP2, DTensor) before anything is measured."""
    for way in ("meta", "build"):
        _set_up(way, (64, 8, 1), device)
    gc.collect()


def _gpu_rank(cfg: tuple[int, int, int], order: list[str]) -> dict[str, Any]:
    """One process on one GPU: each way in ``order``, its setup time and the device's
    peak allocation above the start (the model before it freed)."""
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    with cp.process_group(timeout=600, device="cuda"):
        _warm_up("cuda")
        for way in order:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            model = _set_up(way, cfg, "cuda")
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() - start
            out[way] = {"setup": {"peak": peak, "seconds": seconds, "read": 0, **_sizes(model)}}
            del model
    return out


def _rank(way: str, cfg: tuple[int, int, int], file: str) -> dict[str, Any]:
    """One rank: set the model up ``way``, then load the file (the loads of that way)."""
    import torch.distributed as dist

    from cudakit.parallel._safetensors import SliceReader, read_header
    from cudakit.parallel.meta import local_part, local_region

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with cp.process_group(timeout=3600, device="cpu"):  # gloo, even on a GPU machine
        _warm_up("cpu")
        if way == "meta":
            with Phase() as ph:
                model = _set_up("meta", cfg, "cpu")
            out["setup"] = ph.figures(**_sizes(model))
            with Phase() as ph:
                cp.load_pretrained(model, file)
            out["load_pretrained"] = ph.figures()
            return out
        with Phase() as ph:
            model = _set_up("build", cfg, "cpu")
        out["setup"] = ph.figures(**_sizes(model))
        entries = read_header(Path(file))
        with Phase() as ph:  # every rank reads the whole file, keeps its rows
            reader = SliceReader()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in entries:
                        full = reader.read(entries[name], None)
                        region = local_region(p)
                        local_part(p).copy_(full[region] if region is not None else full)
                        del full
            reader.close()
        out["whole file per rank"] = ph.figures()
        with Phase() as ph:  # rank 0 reads it and broadcasts
            state: dict[str, torch.Tensor] = {}
            if dist.get_rank() == 0:
                reader = SliceReader()
                state = {k: reader.read(e, None) for k, e in entries.items()}
                reader.close()
            cp.load_state_dict(model, state, strict=False)
            del state
        out["rank 0 broadcasts"] = ph.figures()
    return out


def _median_run(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's figures: per phase the median time and the highest peak over rounds."""
    out = []
    for rank_runs in zip(*rounds, strict=True):
        merged: dict[str, Any] = {}
        for phase in rank_runs[0]:
            runs = [run[phase] for run in rank_runs]
            merged[phase] = {
                **runs[0],
                "seconds": statistics.median(f["seconds"] for f in runs),
                "peak": max(f["peak"] for f in runs),
                "read": max(f["read"] for f in runs),
            }
        out.append(merged)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (~6M parameters)")
    parser.add_argument("--ranks", type=int, nargs="+", help="world sizes (default: 1 2 4)")
    parser.add_argument("--rounds", type=int, default=3, help="launches of each way")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="gloo ranks or one GPU"
    )
    parser.add_argument("--json", "--figure", dest="json", help="write the data file here")
    args = parser.parse_args(argv)
    cfg = (8000, 256, 4) if args.quick else (32000, 1024, 12)
    if args.device == "cuda":
        if args.ranks not in (None, [1]):
            parser.error("--device cuda sets the model up on one GPU: leave --ranks out")
        if not torch.cuda.is_available():
            sys.exit(
                "bench_meta_init.py --device cuda needs a CUDA GPU; this machine has none "
                "(torch.cuda.is_available() is False). Run it without --device for the "
                "gloo ranks on the CPU."
            )
        return _gpu_main(args, cfg, sys.argv[1:] if argv is None else argv)
    args.ranks = args.ranks or [1, 2, 4]
    load_before = _report.load_average()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # big blocks go back when freed
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        src = Model(*cfg)
        (file,) = cp.save_pretrained(src, tmp)
        n_params = sum(p.numel() for p in src.parameters())
        del src
        size = file.stat().st_size / MiB
        print(f"# model: {n_params / 1e6:.1f}M parameters, file {size:.0f} MiB")
        results: dict[int, dict[str, Any]] = {}
        for n in args.ranks:
            runs: dict[str, list[list[dict[str, Any]]]] = {"build": [], "meta": []}
            for r in range(args.rounds):  # the two ways take turns, so noise hits both
                for way in ("build", "meta") if r % 2 == 0 else ("meta", "build"):
                    ranks = cp.launch(_rank, way, cfg, str(file), nprocs=n, timeout=3600)
                    runs[way].append(ranks)
            results[n] = {way: _median_run(rounds) for way, rounds in runs.items()}
    rows = _rows(results)
    _print(rows, n_params)
    if args.json:
        record = _report.record(
            "benchmarks/bench_meta_init.py",
            title=f"A sharded model's setup and pretrained load, {n_params / 1e6:.0f}M parameters",
            settings=(
                f"gloo ranks on the CPU, one thread each, {args.rounds} rounds taking turns; "
                "peak resident memory above the start of each phase (the largest rank's, "
                "the highest round's), median time; other jobs running on the VM"
            ),
            unit="MiB",
            rows=rows,
            argv=sys.argv[1:] if argv is None else argv,
            load_before=load_before,
        )
        _report.write(args.json, record)
    return 0


def _gpu_main(args: argparse.Namespace, cfg: tuple[int, int, int], argv: list[str]) -> int:
    load_before = _report.load_average()
    n_params = sum(p.numel() for p in Model(*cfg).parameters())
    print(f"# model: {n_params / 1e6:.1f}M parameters, one GPU")
    runs: dict[str, list[list[dict[str, Any]]]] = {"build": [], "meta": []}
    gpu = ""
    for r in range(args.rounds):  # the two ways take turns, so noise hits both
        order = ["build", "meta"] if r % 2 == 0 else ["meta", "build"]
        (got,) = cp.launch(_gpu_rank, cfg, order, nprocs=1, timeout=600)
        gpu = got["gpu"]
        for way in order:
            runs[way].append([got[way]])
    by_way = {way: _median_run(rounds) for way, rounds in runs.items()}
    rows = _rows({1: by_way}, loads=False)
    for row in rows:
        row["group"] = "1 GPU: setup"
    _print(rows, n_params)
    if args.json:
        record = _report.record(
            "benchmarks/bench_meta_init.py",
            title=f"A model's setup on one GPU, {n_params / 1e6:.0f}M parameters",
            settings=(
                f"{gpu}, one process (NCCL), {args.rounds} rounds, the two ways taking turns "
                "in each; peak torch.cuda.max_memory_allocated above the start of the setup "
                "(the highest round's), median time; the usual way builds on the CPU with "
                f"{torch.get_num_threads()} threads"
            ),
            unit="MiB",
            rows=rows,
            argv=argv,
            load_before=load_before,
        )
        _report.write(args.json, record)
    return 0


def _rows(results: dict[int, dict[str, Any]], loads: bool = True) -> list[dict[str, Any]]:
    rows = []
    for n, by_way in results.items():
        setups = {
            "build, then shard": by_way["build"],
            "meta + parallelize": by_way["meta"],
        }
        build_time = max(r["setup"]["seconds"] for r in by_way["build"])
        for impl, ranks in setups.items():
            worst = max(ranks, key=lambda r: r["setup"]["peak"])["setup"]
            goal = worst["shard"] + worst["largest"]
            seconds = max(r["setup"]["seconds"] for r in ranks)
            rows.append(
                {
                    "group": f"{n} rank{'s' if n > 1 else ''}: setup",
                    "series": impl,
                    "value": round(worst["peak"] / MiB, 1),
                    "ranks": n,
                    "phase": "setup",
                    "over_goal": round(worst["peak"] / goal, 3),
                    "seconds": round(seconds, 2),
                    "time_ratio": round(seconds / build_time, 3),
                    "read_mib": None,
                    "shard_mib": round(worst["shard"] / MiB, 1),
                    "largest_mib": round(worst["largest"] / MiB, 1),
                }
            )
        if not loads:
            continue
        shard = max(r["setup"]["shard"] for r in by_way["meta"])
        largest = by_way["meta"][0]["setup"]["largest"]
        loads = {
            "load_pretrained": by_way["meta"],
            "whole file per rank": by_way["build"],
            "rank 0 broadcasts": by_way["build"],
        }
        for impl, ranks in loads.items():
            worst = max((r[impl] for r in ranks), key=lambda f: f["peak"])
            rows.append(
                {
                    "group": f"{n} rank{'s' if n > 1 else ''}: load",
                    "series": impl,
                    "value": round(worst["peak"] / MiB, 1),
                    "ranks": n,
                    "phase": "load",
                    "over_goal": round(worst["peak"] / (shard + largest), 3),
                    "seconds": round(max(r[impl]["seconds"] for r in ranks), 2),
                    "time_ratio": None,
                    "read_mib": round(max(r[impl]["read"] for r in ranks) / MiB, 1),
                    "shard_mib": round(shard / MiB, 1),
                    "largest_mib": round(largest / MiB, 1),
                }
            )
    return rows


def _print(rows: list[dict[str, Any]], n_params: int) -> None:
    print(f"# {n_params / 1e6:.1f}M parameters; per rank, the largest rank's figures")
    print("# goal: peak <= 1.1 x (shard + largest); times: the median round's")
    head = f"{'ranks':>5} {'phase':<6} {'implementation':<22} {'peak MiB':>9} {'x goal':>7}"
    print(head + f" {'time s':>8} {'x build':>8} {'read MiB':>9} {'shard MiB':>10}")
    for r in rows:
        ratio = f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else ""
        read = f"{r['read_mib']:.1f}" if r["read_mib"] is not None else ""
        print(
            f"{r['ranks']:>5} {r['phase']:<6} {r['series']:<22} {r['value']:>9.1f} "
            f"{r['over_goal']:>7.2f} {r['seconds']:>8.2f} {ratio:>8} {read:>9} "
            f"{r['shard_mib']:>10.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
