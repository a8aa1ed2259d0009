"""What a saved :class:`~cudakit.memory.MemoryReport` holds, checked field by field.

``MemoryReport.from_json``/``from_dict`` read data that came from a file: every field
is checked before anything is built, and a wrong one is named (``'devices[0].free'``)
with what it must be: ``TypeError`` for a wrong kind, ``ValueError`` for a wrong value,
a missing or an unknown field.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

from .._check import check_type, describe

__all__ = ["DEVICE_FIELDS", "REPORT_FIELDS", "load_json", "read_report"]

_WHERE: Final = "MemoryReport.from_dict(data)"

#: Each saved field of a report and of one of its devices, and the kind it must be.
REPORT_FIELDS: Final = {
    "label": "text?",
    "devices": "devices",
    "elapsed": "seconds",
    "raised": "text?",
    "shared": "bool",
    "history": "text?",
}
DEVICE_FIELDS: Final = {
    "device": "name",
    "allocated_before": "bytes",
    "allocated_after": "bytes",
    "peak_allocated": "bytes",
    "reserved_before": "bytes?",
    "reserved_after": "bytes?",
    "peak_reserved": "bytes?",
    "free": "bytes?",
    "total": "bytes?",
    "cuda_started": "bool?",
    "peak_since_start": "bool",
}

_EXPECTED: Final = {
    "text?": "a string or null",
    "name": "a device name",
    "seconds": "a number of seconds",
    "bool": "true or false",
    "bool?": "true, false or null",
    "bytes": "a whole number of bytes",
    "bytes?": "a whole number of bytes or null",
    "devices": "a list of devices",
}


def load_json(text: object) -> object:
    """``json.loads(text)``, with errors that say what ``from_json`` expects."""
    text = check_type(
        "MemoryReport.from_json",
        "text",
        text,
        (str, bytes, bytearray),
        expected="the string MemoryReport.to_json() wrote",
        fix="To rebuild from a dict use MemoryReport.from_dict(data).",
    )
    try:
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"MemoryReport.from_json(text): the bytes are not UTF-8 text ({exc.reason} at "
            f"byte {exc.start}). Pass the string MemoryReport.to_json() wrote, or the file's "
            "bytes unchanged."
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"MemoryReport.from_json(text): the text is not JSON ({exc.msg}: line "
            f"{exc.lineno} column {exc.colno}). Pass the string MemoryReport.to_json() wrote, "
            "whole."
        ) from None


def read_report(data: object) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The report's fields (``devices`` left out) and one dict per device, all checked."""
    data = check_type(
        "MemoryReport.from_dict",
        "data",
        data,
        dict,
        expected="a dict as MemoryReport.to_dict() returns",
        fix="Pass that dict, or use MemoryReport.from_json(text) for its JSON.",
    )
    fields = _fields(data, REPORT_FIELDS, "")
    devices = fields.pop("devices")
    if not devices:
        raise ValueError(f"{_WHERE}: the field 'devices' must list at least one device, got none.")
    out = []
    for i, device in enumerate(devices):
        if not isinstance(device, dict):
            raise TypeError(
                f"{_WHERE}: the field 'devices[{i}]' must be an object with a device's fields, "
                f"got {describe(device)}."
            )
        out.append(_fields(device, DEVICE_FIELDS, f"devices[{i}]."))
    return fields, out


def _fields(data: dict[Any, Any], schema: dict[str, str], prefix: str) -> dict[str, Any]:
    """``data``'s fields, each checked against ``schema``; missing and unknown ones named."""
    for key in data:
        if key not in schema:
            raise ValueError(
                f"{_WHERE}: unknown field '{prefix}{key}'; expected the fields of "
                f"MemoryReport.to_dict(): {', '.join(schema)}."
            )
    for name, kind in schema.items():
        if name not in data:
            raise ValueError(
                f"{_WHERE}: the field '{prefix}{name}' is missing; a saved report has every "
                f"one of {', '.join(schema)}: save the report with MemoryReport.to_json() "
                "and read it back with MemoryReport.from_json()."
            )
        _check(f"{prefix}{name}", kind, data[name])
    return {name: data[name] for name in schema}


def _check(name: str, kind: str, value: object) -> None:
    if value is None and kind.endswith("?"):
        return
    base = kind.rstrip("?")
    ok = {
        "text": isinstance(value, str),
        "name": isinstance(value, str),
        "bool": isinstance(value, bool),
        "bytes": isinstance(value, int) and not isinstance(value, bool),
        "seconds": isinstance(value, (int, float)) and not isinstance(value, bool),
        "devices": isinstance(value, (list, tuple)),
    }[base]
    if not ok:
        raise TypeError(
            f"{_WHERE}: the field '{name}' must be {_EXPECTED[kind]}, got {describe(value)}."
        )
    if base == "name" and not value:
        raise ValueError(f"{_WHERE}: the field '{name}' must name a device, got ''.")
    if base == "seconds" and not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{_WHERE}: the field '{name}' must be finite, got {value}.")
    if base in ("bytes", "seconds") and value < 0:  # type: ignore[operator]
        raise ValueError(f"{_WHERE}: the field '{name}' must be at least 0, got {value}.")
