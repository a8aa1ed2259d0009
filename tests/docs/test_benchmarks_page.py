"""The benchmarks page: one current, generated table per script, and its chart data.

Each bench script writes its data file with ``--json`` (``benchmarks/_report.py``); the
table on docs/benchmarks.md is generated from that file (``scripts/bench_tables.py``) and
the chart drawn from it (``scripts/make_figures.py``). These tests hold the three together.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"


# -- the benchmarks page -----------------------------------------------------------

#: Each benchmark script, and the utility page that summarises it and links to its table.
BENCHMARKS = {
    "bench_on_device.py": "device.md",
    "bench_autocast_step.py": "precision.md",
    "bench_memory_report.py": "memory.md",
    "bench_warmup.py": "warmup.md",
    "bench_prefetch.py": "data.md",
    "bench_checkpoint.py": "checkpoint.md",
    "bench_speed_report.py": "observe.md",
    "bench_loss_spikes.py": "observe.md",
    "bench_meta_init.py": "big-models.md",
    "bench_watching.py": "observe.md",
    "bench_recompute.py": "memory.md",
    "bench_estimate.py": "memory.md",
}

_TABLE_RULE = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$")


def _import(folder: str, name: str) -> ModuleType:
    """A module of ``benchmarks/`` or ``scripts/`` (neither is a package)."""
    path = str(ROOT / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def _sections(text: str) -> dict[str, str]:
    """The ``## `` sections of a page, by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _section(script: str) -> str:
    """The section of docs/benchmarks.md that names ``benchmarks/<script>``."""
    sections = _sections((DOCS / "benchmarks.md").read_text(encoding="utf-8"))
    (body,) = [b for b in sections.values() if f"`benchmarks/{script}`" in b]
    return body


def test_every_benchmark_has_one_current_table_on_the_benchmarks_page() -> None:
    """One section per script: its path, one generated table with the date measured."""
    assert {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")} == set(BENCHMARKS)
    for script in BENCHMARKS:
        body = _section(script)
        name = script.removesuffix(".py")
        assert f"<!-- {name}:table -->" in body, f"{script}: no generated table"
        assert re.search(r"\bMeasured 20\d\d-\d\d-\d\d on ", body), f"{script}: no date"
        tables = [ln for ln in body.splitlines() if _TABLE_RULE.match(ln)]
        assert len(tables) == 1, f"{script}: {len(tables)} tables; keep only the latest run"
        assert f"(figures/{name}.png)" in body, f"{script}: no chart"


def test_utility_pages_link_to_the_benchmarks_instead_of_copying_them() -> None:
    """A table or paragraph of docs/benchmarks.md appears on no other page."""
    bench = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    rows = {ln for ln in bench.splitlines() if ln.startswith("| ") and re.search(r"\d", ln)}
    paragraphs = {p.strip() for p in bench.split("\n\n") if len(p.strip()) > 120}
    for page in sorted(DOCS.rglob("*.md")):
        if page.name == "benchmarks.md":
            continue
        text = page.read_text(encoding="utf-8")
        assert not rows & set(text.splitlines()), f"{page.name} copies a benchmark table"
        for para in paragraphs:
            assert para not in text, f"{page.name} copies from benchmarks.md: {para[:60]}..."
    for page in BENCHMARKS.values():
        assert "](benchmarks.md#" in (DOCS / page).read_text(encoding="utf-8"), page
    assert "No GPU figures are published here" in bench


def test_the_tables_on_the_page_are_generated_from_the_data_files() -> None:
    """Every table on the page is what scripts/bench_tables.py makes of its data file now,
    and every data file has a table: page and data cannot drift apart."""
    tables = _import("scripts", "bench_tables")
    data = {p.stem for p in FIGURES.glob("bench_*.json")}
    assert data == set(tables.TABLES), "a data file without a table, or a table without data"
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    new, changed = tables.update(page)
    assert not changed, f"run python scripts/bench_tables.py: {changed} differ from their data"
    assert new == page
    for name in sorted(data):
        record = json.loads((FIGURES / f"{name}.json").read_text(encoding="utf-8"))
        _check_schema(record)
        assert Path(record["script"]).name in BENCHMARKS, name
        assert f"(figures/{name}.png)" in page, f"{name}: its chart is not on the page"


def test_a_table_is_rewritten_between_its_markers_only(tmp_path: Path) -> None:
    """A stale table is replaced; the text around the markers is left as it was."""
    tables = _import("scripts", "bench_tables")
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    stale = re.sub(
        r"(<!-- bench_warmup:table -->\n).*?(<!-- /bench_warmup:table -->)",
        r"\1| old | table |\n\2",
        page,
        flags=re.S,
    )
    assert stale != page
    new, changed = tables.update(stale)
    assert changed == ["bench_warmup"]
    assert new == page
    (tmp_path / "benchmarks.md").write_text(stale, encoding="utf-8")
    assert tables.main(["--check", "--page", str(tmp_path / "benchmarks.md")]) == 1
    assert tables.main(["--page", str(tmp_path / "benchmarks.md")]) == 0
    assert (tmp_path / "benchmarks.md").read_text(encoding="utf-8") == page
    with pytest.raises(ValueError, match=r"0 blocks for bench_warmup; put its table between"):
        tables.update(page.replace("<!-- bench_warmup:table -->", ""))


@pytest.mark.parametrize("data", sorted(p.name for p in FIGURES.glob("bench_*.json")))
def test_each_data_file_regenerates_its_figure(data: str, tmp_path: Path) -> None:
    """make_figures draws the chart of docs/figures/<data> from the data file alone."""
    pytest.importorskip("matplotlib", reason="the charts need matplotlib (the plot extra)")
    figures = _import("scripts", "make_figures")
    png = figures.draw(FIGURES / data, tmp_path)
    assert png == tmp_path / data.replace(".json", ".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- what the scripts write ------------------------------------------------------------


def _check_schema(record: dict[str, Any]) -> None:
    """The keys every data file has, and those its kind of chart reads."""
    report = _import("benchmarks", "_report")
    for key in report.REQUIRED:
        assert key in record, key
    assert set(report.MACHINE) <= set(record["machine"])
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", record["measured"])
    assert record["command"].startswith(f"python {record['script']}")
    assert record["rows"]
    if "reference" in record:  # a ratio chart: bars from 1
        for row in record["rows"]:
            assert {"implementation", "ratio", *record["group_by"]} <= set(row), row
    else:  # a bar chart: bars from 0
        assert record["unit"]
        for row in record["rows"]:
            assert {"group", "series", "value"} <= set(row), row


def _rendered(name: str, path: Path) -> None:
    """The file at ``path`` is in the schema and makes a table (what the chart reads is
    in the schema; the charts of the data files in docs/figures/ are drawn above)."""
    record = json.loads(path.read_text(encoding="utf-8"))
    _check_schema(record)
    tables = _import("scripts", "bench_tables")
    text = tables.render(name, record)
    assert text.startswith(f"\nMeasured {record['measured']} on ")
    assert sum(1 for ln in text.splitlines() if _TABLE_RULE.match(ln)) == 1


#: Runs of a script short enough for the suite (a second or two each, in this process).
_QUICK_RUNS = {
    "bench_on_device": ["--quick", "--rounds", "1", "--clock", "cpu"],
    "bench_memory_report": ["--quick", "--rounds", "1", "--calls", "20"],
    "bench_prefetch": ["--quick", "--rounds", "1"],
    "bench_loss_spikes": ["--quick", "--rounds", "1", "--sets", "1", "--block", "1"],
    "bench_watching": [
        "--quick", "--rounds", "1", "--block", "0.002", "--calls", "64", "--dtype", "fp32"
    ],
    "bench_recompute": ["--quick", "--rounds", "1"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_QUICK_RUNS))
def test_a_quick_run_writes_its_data_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json PATH`` writes a file the table and the chart are made from."""
    module = _import("benchmarks", name)
    if name == "bench_on_device":  # its first case only: the others build 11,000 tensors
        cases = module.cases
        monkeypatch.setattr(module, "cases", lambda source: dict(list(cases(source).items())[:1]))
    path = tmp_path / f"{name}.json"
    threads = torch.get_num_threads()
    try:
        module.main([*_QUICK_RUNS[name], "--json", str(path)])
    finally:
        torch.set_num_threads(threads)  # some scripts time on one thread
    assert f"# data written to {path}" in capsys.readouterr().out
    record = json.loads(path.read_text(encoding="utf-8"))
    assert record["script"] == f"benchmarks/{name}.py"
    assert record["command"] == f"python benchmarks/{name}.py " + " ".join(_QUICK_RUNS[name])
    _rendered(name, path)


def _ratio_rows(cases: list[str], impls: list[str]) -> list[dict[str, Any]]:
    return [
        {"case": c, "implementation": i, "time_us": 100.0 + k, "ratio": 1 + k / 100}
        for c in cases
        for k, i in enumerate(impls)
    ]


def _estimate_rows(accelerate: bool) -> list[dict[str, Any]]:
    """bench_estimate's table for made-up peaks, with accelerate's column or without."""
    rows = []
    for k, (world, strategy) in enumerate([(1, "none"), (2, "ddp"), (4, "fsdp")]):
        theirs = 0.5 + k / 10 if accelerate else None
        rows.append(
            {"cell": f"{world}, {strategy}, none, fp32", "world": world, "strategy": strategy,
             "recompute": "none", "precision": "fp32", "measured_kib": 100.0 * world,
             "ranks_kib": [100.0 * world] * world, "estimate_kib": 100.0 * world,
             "ratio": 1 + k / 20, "accelerate_kib": theirs and 50.0,
             "accelerate_ratio": theirs}
        )  # fmt: skip
    return rows


def _records() -> dict[str, Any]:
    """The data file each slow script would write for made-up measurements."""
    autocast = _import("benchmarks", "bench_autocast_step")
    warmup = _import("benchmarks", "bench_warmup")
    speed = _import("benchmarks", "bench_speed_report")
    checkpoint = _import("benchmarks", "bench_checkpoint")
    estimate = _import("benchmarks", "bench_estimate")
    impls = ["hand-written", "hand-written + guard", "cudakit @autocast_step", "accelerate"]
    pairs = [{"case": "a", "mine": impls[2], "theirs": impls[1], "ratio": 0.99}]
    speed_rows = [
        {"group": f"side by side: {form}", "series": s, "value": v}
        for form in ("@speed_report over it", "with meter.measure(x)")
        for s, v in (("bfloat16", -0.5), ("float32", 1.2))
    ]
    steps = [
        {"series": s, "step_us": 700.0, "meter_us": {"@speed_report": 2.9}, "host_reads": 0,
         "in_place_us": {"@speed_report": 4.1}, "metered_steps": 20}
        for s in ("bfloat16", "float32")
    ]  # fmt: skip
    medians = {"save": 1.0, "load": 2.0}
    result = {
        "params": 1_000_000,
        "rounds": 1,
        "table": {
            "torch.save": medians,
            "Checkpointer": medians,
            "Checkpointer async": {**medians, "blocked": 0.1},
        },
    }
    return {
        "bench_autocast_step": autocast.figure_data(
            _ratio_rows(["a", "b"], impls), pairs, "settings", False, [], 0.5
        ),
        "bench_autocast_step_compile": autocast.figure_data(
            _ratio_rows(["a"], impls), pairs, "settings", True, ["--compile"], 0.5
        ),
        "bench_warmup": warmup.figure_data(
            [("cold first pass / last pass", "1.02x")], {"last pass": 3.0}, "cpu", "s", [], 0.5
        ),
        "bench_speed_report": speed.figure_data(speed_rows, steps, "settings", [], 0.5),
        "bench_checkpoint": checkpoint.figure_data(result, "settings", [], 0.5),
        "bench_estimate": estimate.figure_data(_estimate_rows(True), "settings", [], 0.5),
        "bench_estimate_alone": estimate.figure_data(_estimate_rows(False), "settings", [], 0.5),
    }


@pytest.mark.parametrize(
    "name",
    [
        "bench_autocast_step",
        "bench_autocast_step_compile",
        "bench_warmup",
        "bench_speed_report",
        "bench_checkpoint",
        "bench_estimate",
        "bench_estimate_alone",
    ],
)
def test_a_slow_script_writes_its_data_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scripts too slow to run here build their data file with the same function."""
    report = _import("benchmarks", "_report")
    path = report.write(tmp_path / f"{name}.json", _records()[name])
    assert capsys.readouterr().out == f"# data written to {path}\n"
    _rendered(name.removesuffix("_alone"), path)


def test_a_data_file_without_its_keys_is_refused(tmp_path: Path) -> None:
    report = _import("benchmarks", "_report")
    record = report.record("benchmarks/bench_x.py", title="t", settings="s", rows=[], argv=[])
    del record["settings"]
    record["machine"].pop("cpu")
    with pytest.raises(ValueError, match=r"benchmark record lacks settings, machine\.cpu"):
        report.write(tmp_path / "x.json", record)
    assert not (tmp_path / "x.json").exists()


def test_the_command_leaves_out_where_the_data_went() -> None:
    report = _import("benchmarks", "_report")
    argv = ["--quick", "--json", "out.json", "--rounds", "3", "--json=b.json"]
    record = report.record("benchmarks/bench_x.py", title="t", settings="s", rows=[], argv=argv)
    assert record["command"] == "python benchmarks/bench_x.py --quick --rounds 3"
    assert record["machine"]["cores"]
    assert record["machine"]["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("device", "flags", "cuda_bf16", "expected"),
    [
        ("cpu", "fpu sse avx2 avx512f avx512_bf16", False, "native"),
        ("cpu", "fpu avx512f amx_tile amx_bf16", False, "native"),
        ("cpu", "fpu sse avx2 avx512f", False, "emulated"),
        ("cpu", "fpu sse avx2 avx512f", True, "emulated"),  # a GPU's says nothing of the CPU
        ("cpu", "", False, "unknown"),  # no flags to read (not Linux)
        ("cuda", "", True, "native"),
        ("cuda", "avx512_bf16", False, "emulated"),  # the CPU's say nothing of the GPU
    ],
)
def test_the_watched_run_decides_bf16_support_from_capabilities_passed_in(
    device: str, flags: str, cuda_bf16: bool, expected: str
) -> None:
    """bench_watching labels bf16 emulated where the machine lacks it, never assuming."""
    watching = _import("benchmarks", "bench_watching")
    assert watching.bf16_support(device, flags, cuda_bf16) == expected
