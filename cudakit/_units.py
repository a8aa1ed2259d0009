"""Human-readable units for reports."""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | None) -> str:
    """Format a byte count in binary units.

    >>> format_bytes(3 * 2**20), format_bytes(-512), format_bytes(None)
    ('3.00 MiB', '-512 B', 'n/a')
    """
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = _UNITS[0]
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
