"""The benchmarks page: one current, generated table per script, and its chart data."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


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
}

_TABLE_RULE = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$")


def _sections(text: str) -> dict[str, str]:
    """The ``## `` sections of a page, by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_benchmark_has_one_current_table_on_the_benchmarks_page() -> None:
    """One section per script: the path of the script, the date measured, one table."""
    assert {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")} == set(BENCHMARKS)
    sections = _sections((DOCS / "benchmarks.md").read_text(encoding="utf-8"))
    for script in BENCHMARKS:
        link = f"`benchmarks/{script}`"
        (body,) = [b for b in sections.values() if link in b]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"{script}: no date measured"
        tables = [ln for ln in body.splitlines() if _TABLE_RULE.match(ln)]
        assert len(tables) == 1, f"{script}: {len(tables)} tables; keep only the latest run"


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


def test_benchmark_figure_data_matches_the_tables() -> None:
    """The chart data in docs/figures/ holds the figures the benchmarks page shows."""
    import json

    sections = _sections((DOCS / "benchmarks.md").read_text(encoding="utf-8"))
    for script in BENCHMARKS:
        name = script.removesuffix(".py")
        data = json.loads((DOCS / "figures" / f"{name}.json").read_text(encoding="utf-8"))
        assert data["script"] == f"benchmarks/{script}"
        (body,) = [b for b in sections.values() if f"`benchmarks/{script}`" in b]
        assert data["measured"] in body
        assert f"(figures/{name}.png)" in body
        for row in data["rows"]:
            if "ratio" in row:  # cudakit and its peers against the hand-written code
                if row["implementation"] == data["reference"]:
                    continue
                digits = 2 if name == "bench_on_device" else 3
                shown = [f"{row['ratio']:.{digits}f}"]
            else:
                shown = [f"{row['value']:,.{d}f}" for d in (1, 2)]
            assert any(re.search(rf"\| {re.escape(v)}(x| µs)? \|", body) for v in shown), row
