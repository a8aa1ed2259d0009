"""What every benchmark script writes with ``--json PATH``: its figures, where and when.

One record per run, the data file ``scripts/make_figures.py`` draws the chart from and
``scripts/bench_tables.py`` writes the table of docs/benchmarks.md from::

    {"script": "benchmarks/bench_on_device.py",
     "command": "python benchmarks/bench_on_device.py --clock cpu",
     "title": "...", "measured": "2026-12-04",
     "machine": {"cpu": "AMD EPYC", "cores": 2, "system": "Linux x86_64",
                 "torch": "2.13.0+cpu", "python": "3.11.7", "peers": {"optree": "0.20.0"}},
     "load_average": [0.8, 2.1],
     "settings": "25 interleaved rounds, median per call, cpu clock",
     "revision": "1e5198e",
     "rows": [...]}

``rows`` are the chart's: ``implementation``, ``time_us`` and ``ratio`` per case for a
ratio chart (with ``reference`` and ``group_by``), ``group``, ``series`` and ``value``
for a bar chart (with ``unit``). A script adds what its table shows beyond the chart
(``table``, ``pairs``, ...). The record says nothing that was not measured in the run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: Keys every record has (``scripts/bench_tables.py`` and the docs tests read them).
REQUIRED = ("script", "command", "title", "measured", "machine", "settings", "rows")
#: Keys of ``machine``.
MACHINE = ("cpu", "cores", "system", "torch", "python", "peers")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(peers: Iterable[str] = ()) -> dict[str, Any]:
    """This machine: CPU model, cores, system, torch, Python, and the installed ``peers``."""
    import torch

    versions = {}
    for name in peers:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "system": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "peers": versions,
    }


def revision() -> str:
    """The checkout's commit, and whether ``cudakit/`` differs from it ("" outside git)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = commit and git("status", "--porcelain", "--", "cudakit")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}, with uncommitted changes in cudakit/" if changed else commit


def load_average() -> float:
    """The 1-minute load average (0.0 where the system does not say)."""
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return 0.0


def record(
    script: str,
    *,
    title: str,
    settings: str,
    rows: list[dict[str, Any]],
    argv: Sequence[str] | None = None,
    load_before: float | None = None,
    peers: Iterable[str] = (),
    **fields: Any,
) -> dict[str, Any]:
    """The data file of one run of ``script`` (a path such as ``benchmarks/bench_x.py``).

    ``argv`` is the run's command line after the script (default ``sys.argv[1:]``),
    ``load_before`` the load average when it started, ``peers`` the distributions whose
    versions matter (the peer libraries measured); ``fields`` are added as they are.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    out: dict[str, Any] = {
        "script": script,
        "command": " ".join(["python", script, *_without_json(argv)]),
        "title": title,
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine(peers),
        "settings": settings,
        "revision": revision(),
    }
    if load_before is not None:
        out["load_average"] = [load_before, load_average()]
    out.update(fields)
    out["rows"] = rows
    return out


def _without_json(argv: list[str]) -> list[str]:
    """The command line without ``--json PATH`` (where the data went, not what ran)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            out.append(arg)
    return out


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as the JSON file at ``path`` (after checking it has every key)."""
    missing = [k for k in REQUIRED if k not in data]
    missing += [f"machine.{k}" for k in MACHINE if k not in data.get("machine", {})]
    if missing:
        raise ValueError(f"benchmark record lacks {', '.join(missing)}")
    path = Path(path)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"# data written to {path}")
    return path
