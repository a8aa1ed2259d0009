"""MemoryReport.from_json / from_dict: a saved report comes back equal; malformed text or
data is a TypeError (a wrong kind) or ValueError (a wrong value) that names the field."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudakit.memory import DeviceMemory, MemoryReport, memory_report
from cudakit.memory._schema import DEVICE_FIELDS, REPORT_FIELDS

# -- strategies ---------------------------------------------------------------------------

_bytes = st.integers(min_value=0, max_value=2**50)
_maybe_bytes = st.none() | _bytes
_name = st.text(min_size=1, max_size=12)

devices = st.builds(
    DeviceMemory,
    device=st.sampled_from(["cpu", "cuda:0", "cuda:1"]),
    allocated_before=_bytes,
    allocated_after=_bytes,
    peak_allocated=_bytes,
    reserved_before=_maybe_bytes,
    reserved_after=_maybe_bytes,
    peak_reserved=_maybe_bytes,
    free=_maybe_bytes,
    total=_maybe_bytes,
    cuda_started=st.none() | st.booleans(),
    peak_since_start=st.booleans(),
)

reports = st.builds(
    MemoryReport,
    label=st.none() | _name,
    devices=st.lists(devices, min_size=1, max_size=3).map(tuple),
    elapsed=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    raised=st.none() | _name,
    shared=st.booleans(),
    history=st.none() | _name,
    done=st.just(True),
)


def _real() -> dict[str, Any]:
    with memory_report("step", device="cpu", file=None) as rep:
        pass
    return rep.to_dict()


# -- round trip ---------------------------------------------------------------------------


@given(reports)
def test_a_saved_report_comes_back_equal(report: MemoryReport) -> None:
    back = MemoryReport.from_json(report.to_json())
    assert back == report
    assert back.figures() == report.figures()


def test_the_schema_lists_exactly_the_saved_fields() -> None:
    saved = {f.name for f in dataclasses.fields(MemoryReport) if f.compare}
    assert set(REPORT_FIELDS) == saved
    assert set(DEVICE_FIELDS) == {f.name for f in dataclasses.fields(DeviceMemory)}


def test_bytes_are_accepted_as_json_text() -> None:
    text = json.dumps(_real()).encode()
    assert MemoryReport.from_json(text).label == "step"


# -- malformed JSON -----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "{", '{"label": "x",}', "nan?"])
def test_text_that_is_not_json_is_a_value_error(text: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"^MemoryReport\.from_json\(text\): the text is not JSON \(.* line 1 column \d+\)"
        r".*Pass the string MemoryReport\.to_json\(\) wrote",
    ):
        MemoryReport.from_json(text)


@pytest.mark.parametrize("text", [None, 3, {"label": None}])
def test_from_json_of_something_not_text_is_a_type_error(text: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"^MemoryReport\.from_json\(text=\.\.\.\) expects the string "
        r"MemoryReport\.to_json\(\) wrote, got " + re.escape(type(text).__name__),
    ):
        MemoryReport.from_json(text)


@pytest.mark.parametrize("data", [[], "report", 3, None])
def test_data_that_is_not_an_object_is_a_type_error(data: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"^MemoryReport\.from_dict\(data=\.\.\.\) expects a dict as "
        r"MemoryReport\.to_dict\(\) returns, got " + re.escape(type(data).__name__),
    ):
        MemoryReport.from_dict(data)
    with pytest.raises(TypeError, match=r"^MemoryReport\.from_dict\(data=\.\.\.\) expects a dict"):
        MemoryReport.from_json(json.dumps(data))


# -- fields -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REPORT_FIELDS))
def test_a_missing_field_is_named(name: str) -> None:
    data = _real()
    del data[name]
    with pytest.raises(
        ValueError,
        match=rf"^MemoryReport\.from_dict\(data\): the field '{name}' is missing; .*"
        r"save the report with MemoryReport\.to_json\(\)",
    ):
        MemoryReport.from_dict(data)


def test_an_unknown_field_is_named() -> None:
    data = {**_real(), "peak": 3}
    with pytest.raises(
        ValueError, match=r"^MemoryReport\.from_dict\(data\): unknown field 'peak'; expected"
    ):
        MemoryReport.from_dict(data)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("label", 3, "a string or null"),
        ("elapsed", "1.5", "a number of seconds"),
        ("elapsed", True, "a number of seconds"),
        ("elapsed", None, "a number of seconds"),
        ("raised", ["KeyError"], "a string or null"),
        ("shared", "no", "true or false"),
        ("shared", 0, "true or false"),
        ("history", 1, "a string or null"),
        ("devices", {"device": "cpu"}, "a list of devices"),
        ("devices", "cpu", "a list of devices"),
    ],
)
def test_a_report_field_of_the_wrong_kind_is_a_type_error(
    field: str, value: Any, expected: str
) -> None:
    data = {**_real(), field: value}
    with pytest.raises(
        TypeError,
        match=rf"^MemoryReport\.from_dict\(data\): the field '{field}' must be "
        + re.escape(expected)
        + r", got "
        + re.escape(type(value).__name__),
    ):
        MemoryReport.from_dict(data)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("device", 0, "a device name"),
        ("allocated_before", "12", "a whole number of bytes"),
        ("allocated_before", 1.5, "a whole number of bytes"),
        ("peak_allocated", True, "a whole number of bytes"),
        ("peak_allocated", None, "a whole number of bytes"),
        ("reserved_after", "0", "a whole number of bytes or null"),
        ("cuda_started", "yes", "true, false or null"),
        ("peak_since_start", None, "true or false"),
    ],
)
def test_a_device_field_of_the_wrong_kind_is_a_type_error(
    field: str, value: Any, expected: str
) -> None:
    data = _real()
    data["devices"][0][field] = value
    with pytest.raises(
        TypeError,
        match=rf"^MemoryReport\.from_dict\(data\): the field 'devices\[0\]\.{field}' must be "
        + re.escape(expected)
        + r", got "
        + re.escape(type(value).__name__),
    ):
        MemoryReport.from_dict(data)


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("elapsed", -1.0, r"the field 'elapsed' must be at least 0, got -1\.0"),
        ("elapsed", float("inf"), r"the field 'elapsed' must be finite, got inf"),
        ("allocated_after", -5, r"the field 'devices\[0\]\.allocated_after' must be at least 0"),
        ("devices", [], r"the field 'devices' must list at least one device, got none"),
    ],
)
def test_a_field_out_of_range_is_a_value_error(where: str, value: Any, message: str) -> None:
    data = _real()
    if where in data:
        data[where] = value
    else:
        data["devices"][0][where] = value
    with pytest.raises(ValueError, match=r"^MemoryReport\.from_dict\(data\): " + message):
        MemoryReport.from_dict(data)


def test_a_device_entry_that_is_not_an_object_is_named() -> None:
    data = {**_real(), "devices": ["cpu"]}
    with pytest.raises(
        TypeError,
        match=r"^MemoryReport\.from_dict\(data\): the field 'devices\[0\]' must be an object "
        r"with a device's fields, got str",
    ):
        MemoryReport.from_dict(data)


def test_a_missing_device_field_is_named() -> None:
    data = _real()
    del data["devices"][0]["free"]
    with pytest.raises(ValueError, match=r"the field 'devices\[0\]\.free' is missing"):
        MemoryReport.from_dict(data)


def test_an_empty_device_name_is_a_value_error() -> None:
    data = _real()
    data["devices"][0]["device"] = ""
    with pytest.raises(ValueError, match=r"the field 'devices\[0\]\.device' must name a device"):
        MemoryReport.from_dict(data)


def test_an_unknown_device_field_is_named() -> None:
    data = _real()
    data["devices"][0]["extra"] = 1
    with pytest.raises(ValueError, match=r"unknown field 'devices\[0\]\.extra'"):
        MemoryReport.from_dict(data)


@given(
    field=st.sampled_from(sorted(REPORT_FIELDS)),
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=5),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
)
def test_any_value_in_any_field_is_accepted_or_refused_by_name(field: str, value: Any) -> None:
    data = {**_real(), field: value}
    refused = ""
    back = None
    try:
        back = MemoryReport.from_dict(data)
    except (TypeError, ValueError) as exc:
        refused = str(exc)
    if back is None:
        assert f"the field '{field}" in refused
    else:
        assert getattr(back, field) == (tuple(back.devices) if field == "devices" else value)
