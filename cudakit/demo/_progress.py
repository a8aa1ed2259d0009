"""The demo's progress: a tqdm bar per epoch when tqdm is installed, else a line per epoch."""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A tqdm bar per epoch when tqdm is installed, else one plain line per epoch."""

    def __init__(self, total: int, desc: str, *, enabled: bool, bar: bool = True) -> None:
        self.desc = desc
        self.bar: Any = None
        self.enabled = enabled
        if enabled and bar:
            try:
                tqdm = importlib.import_module("tqdm.auto").tqdm
            except ImportError:  # the optional "progress" extra is not installed
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=True)

    def update(self, n: int, *, loss: float | None, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}")

    def close(self, line: str) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            print(f"{self.desc}: {line}", file=sys.stderr, flush=True)
