"""Human-readable units for reports."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds", "format_signed_bytes"]

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


def format_signed_bytes(n: int | None) -> str:
    """:func:`format_bytes` with an explicit sign, for deltas.

    >>> format_signed_bytes(2**20), format_signed_bytes(0)
    ('+1.00 MiB', '+0 B')
    >>> format_signed_bytes(None)
    'n/a'
    """
    if n is None:
        return "n/a"
    return ("+" if n >= 0 else "") + format_bytes(n)


def format_seconds(s: float) -> str:
    """A duration in µs, ms or s.

    >>> format_seconds(2e-5), format_seconds(0.0413), format_seconds(3.5)
    ('20 µs', '41.3 ms', '3.50 s')
    """
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"
