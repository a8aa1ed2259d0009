"""A registered container whose flatten or unflatten is wrong is reported, not followed.

* an ``unflatten`` that returns ``None`` (it set attributes and forgot ``return``) is a
  ``TypeError`` that names the type, where it is and the fix, instead of a ``None``
  handed back in place of the object;
* a ``flatten`` whose keys are no attributes of the object, under the default
  ``unflatten`` (which sets each key as an attribute), is a ``ValueError`` that names
  the keys and the fix, instead of a copy with a stray attribute and the field unmoved;
* a ``flatten`` that misses a field holding tensors (a typo, a forgotten key) leaves
  those tensors where they were, with a ``TensorsLeftBehindWarning`` (once per type)
  that names the attributes: leaving a field out on purpose is legitimate, so it is a
  warning, which the user can filter, and the moved object still comes back.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import plain_leaves, tensors

from cudakit import TensorsLeftBehindWarning, register_container
from cudakit.device import on_device

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    """TensorsLeftBehindWarning is shown once per type and process: start afresh."""
    from cudakit._tree import forget_warnings

    forget_warnings()


class Sample:
    def __init__(self, pixels: Any, mask: Any = None, label: str = "cat") -> None:
        self.pixels = pixels
        self.mask = mask
        self.label = label


def _forgets_return(obj: Sample, moved: dict[str, Any]) -> None:
    new = copy.copy(obj)
    new.pixels = moved["pixels"]  # ... and no `return new`


# -- unflatten returning None ----------------------------------------------------------


def test_an_unflatten_that_returns_none_is_a_type_error_naming_the_fix() -> None:
    class Forgetful(Sample):
        pass

    register_container(
        Forgetful,
        flatten=lambda s: {"pixels": s.pixels},
        unflatten=_forgets_return,
    )
    s = Forgetful(torch.ones(2))
    with pytest.raises(
        TypeError,
        match=r"on_device\(\) moved the tensors inside the Forgetful at obj\['batch'\]\[0\] but "
        r"the unflatten registered for Forgetful returned None\. unflatten\(obj, moved\) must "
        r"return the new object, e\.g\. `return copy` at the end of a function that sets the "
        r"moved values on a copy, or `lambda obj, moved: Forgetful\(\*\*moved\)`\.",
    ):
        on_device({"batch": [s]}, device="meta")
    assert s.pixels.device == CPU  # nothing the user owns changed


def test_an_unflatten_returning_none_is_refused_in_the_decorator_too() -> None:
    class Forgetful2(Sample):
        pass

    register_container(
        Forgetful2,
        flatten=lambda s: {"pixels": s.pixels},
        unflatten=_forgets_return,
    )

    @on_device("meta")
    def step(sample: Any) -> Any:
        return sample

    with pytest.raises(TypeError, match=r"at \S*step\(\) args\[0\] but the unflatten .* None"):
        step(Forgetful2(torch.ones(2)))


def test_an_unflatten_returning_none_is_fine_when_nothing_moved() -> None:
    """unflatten is not called when nothing moved: the object itself comes back."""

    class Forgetful3(Sample):
        pass

    register_container(
        Forgetful3,
        flatten=lambda s: {"pixels": s.pixels},
        unflatten=_forgets_return,
    )
    s = Forgetful3(torch.ones(2))
    assert on_device(s, device="cpu") is s


# -- flatten missing a field -----------------------------------------------------------


def test_a_flatten_that_misses_a_tensor_field_warns_once_naming_it() -> None:
    class Typo(Sample):
        pass

    register_container(Typo, flatten=lambda s: {"pixels": s.pixels, "label": s.label})
    s = Typo(torch.ones(2), mask=torch.zeros(2))
    with pytest.warns(TensorsLeftBehindWarning) as caught:
        out = on_device({"s": s}, device="meta")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's line
    assert (
        f"on_device() left tensors behind inside a {Typo.__module__}.{Typo.__qualname__}: its "
        "attribute 'mask' holds tensors that the flatten registered for Typo does not return"
    ) in message
    assert "add them to flatten's dict" in message
    assert "warnings.filterwarnings('ignore', category=cudakit.TensorsLeftBehindWarning)" in (
        message
    )
    assert "shown once per type" in message
    # the object still comes back, moved where flatten reached and as it was elsewhere
    assert out["s"].pixels.device == META
    assert out["s"].mask.device == CPU
    # once per type
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_device(Typo(torch.ones(1), mask=torch.ones(1)), device="meta")


def test_a_flatten_that_returns_no_tensor_at_all_still_warns() -> None:
    """Nothing moved, so the object comes back as itself: the check runs on that path too."""

    class OnlyLabel(Sample):
        pass

    register_container(OnlyLabel, flatten=lambda s: {"label": s.label})
    s = OnlyLabel(torch.ones(2), mask=[torch.ones(1), torch.ones(1)])
    with pytest.warns(TensorsLeftBehindWarning, match=r"attributes 'mask', 'pixels' hold"):
        out = on_device(s, device="meta")
    assert out is s


def test_a_missed_tensor_nested_in_a_field_is_found() -> None:
    class Nested(Sample):
        pass

    register_container(Nested, flatten=lambda s: {"pixels": s.pixels})
    s = Nested(torch.ones(2), mask={"a": [None, (torch.ones(1),)]})
    with pytest.warns(TensorsLeftBehindWarning, match=r"attribute 'mask' holds"):
        on_device(s, device="meta")


def test_a_flatten_with_its_own_unflatten_is_checked_on_the_result() -> None:
    class Built(Sample):
        pass

    register_container(
        Built,
        flatten=lambda s: {"pixels": s.pixels},
        unflatten=lambda s, moved: Built(moved["pixels"], s.mask, s.label),
    )
    with pytest.warns(TensorsLeftBehindWarning, match=r"attribute 'mask' holds"):
        on_device(Built(torch.ones(2), torch.ones(2)), device="meta")


def test_a_tensor_left_out_on_purpose_can_be_silenced() -> None:
    class Quiet(Sample):
        pass

    register_container(Quiet, flatten=lambda s: {"pixels": s.pixels})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=TensorsLeftBehindWarning)
        out = on_device(Quiet(torch.ones(2), torch.ones(2)), device="meta")
    assert out.mask.device == CPU


@pytest.mark.parametrize(
    "mask",
    [
        None,
        "no tensor",
        [1, 2, "three"],
        torch.ones(2, device="meta"),  # already where it goes: nothing left behind
    ],
    ids=["none", "str", "list-of-leaves", "on-target"],
)
def test_no_warning_when_nothing_is_left_behind(mask: Any) -> None:
    class Complete(Sample):
        pass

    register_container(Complete, flatten=lambda s: {"pixels": s.pixels})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = on_device(Complete(torch.ones(2), mask), device="meta")
    assert out.pixels.device == META


def test_derived_flatten_values_rebuilt_by_unflatten_do_not_warn() -> None:
    class Pair:
        __slots__ = ("a", "b")

        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self.a = a
            self.b = b

    register_container(
        Pair,
        flatten=lambda p: {"both": (p.a, p.b)},
        unflatten=lambda p, moved: Pair(*moved["both"]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = on_device(Pair(torch.ones(1), torch.zeros(1)), device="meta")
    assert out.a.device == META
    assert out.b.device == META


def test_a_module_the_same_call_moves_is_not_left_behind() -> None:
    """A field holding the model, left out of flatten, is moved by the same call."""

    class WithModel(Sample):
        pass

    register_container(WithModel, flatten=lambda s: {"pixels": s.pixels})
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, out = on_device(model, WithModel(torch.ones(2), model), device="meta")
    assert out.pixels.device == META


def test_the_default_flatten_moves_every_attribute_without_a_warning() -> None:
    class Plain(Sample):
        pass

    register_container(Plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = on_device(Plain(torch.ones(2), [torch.ones(1)]), device="meta")
    assert out.mask[0].device == META


# -- flatten keys under the default unflatten -------------------------------------------


def test_a_flatten_key_that_is_no_attribute_is_refused_with_the_fix() -> None:
    class Misnamed(Sample):
        pass

    register_container(Misnamed, flatten=lambda s: {"pixel": s.pixels})
    s = Misnamed(torch.ones(2))
    with pytest.raises(
        ValueError,
        match=r"on_device\(\) cannot rebuild the Misnamed at obj\['s'\]: the flatten registered "
        r"for it returned 'pixel', which is no attribute of it \(its attributes: 'label', "
        r"'mask', 'pixels'\), and the default unflatten sets each key as an attribute\. "
        r"Return attribute names from flatten, e\.g\. \{'pixels': obj\.pixels\}, or "
        r"register an unflatten of your own\.",
    ):
        on_device({"s": s}, device="meta")
    assert s.pixels.device == CPU  # nothing the user owns changed
    assert not hasattr(s, "pixel")


def test_a_flatten_key_that_is_no_string_is_refused() -> None:
    class Numbered(Sample):
        pass

    register_container(Numbered, flatten=lambda s: {0: s.pixels})
    with pytest.raises(ValueError, match=r"returned 0, which is no attribute of it"):
        on_device(Numbered(torch.ones(2)), device="meta")


def test_the_keys_are_checked_when_nothing_would_move_too() -> None:
    class Idle(Sample):
        pass

    register_container(Idle, flatten=lambda s: {"lable": s.label})
    with pytest.raises(ValueError, match=r"returned 'lable', which is no attribute"):
        on_device(Idle(None), device="meta")


def test_slot_names_are_attributes() -> None:
    class Slotted:
        __slots__ = ("a", "b")

        def __init__(self, a: torch.Tensor) -> None:
            self.a = a

    register_container(Slotted, flatten=lambda p: {"a": p.a})
    assert on_device(Slotted(torch.ones(1)), device="meta").a.device == META
    register_container(Slotted, flatten=lambda p: {"b": p.a})  # b is a slot never set
    with pytest.raises(ValueError, match=r"returned 'b', which is no attribute of it"):
        on_device(Slotted(torch.ones(1)), device="meta")


@given(keys=st.sets(st.sampled_from(("f0", "f1", "x", "f0_"))))
def test_refused_exactly_when_a_key_is_no_attribute(keys: set[str]) -> None:
    class Two:
        def __init__(self) -> None:
            self.f0, self.f1 = torch.ones(1), torch.zeros(1)

    names = sorted(keys)
    register_container(Two, flatten=lambda r: {n: getattr(r, n, r.f0) for n in names})
    obj = Two()
    before = dict(vars(obj))
    stray = [n for n in names if n not in ("f0", "f1")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TensorsLeftBehindWarning)
        if stray:
            shown = ", ".join(map(repr, stray))
            with pytest.raises(ValueError, match=rf"returned {shown}, which (is|are) no attribute"):
                on_device(obj, device="meta")
        else:
            on_device(obj, device="meta")
    assert vars(obj) == before


# -- property: a warning exactly when a left-out field holds a tensor off the target ---


_FIELDS = ("f0", "f1", "f2", "f3")
_values = st.one_of(
    plain_leaves(),
    tensors(),
    tensors("meta"),
    st.lists(st.one_of(plain_leaves(), tensors(), tensors("meta")), max_size=3),
)


@given(
    values=st.fixed_dictionaries(dict.fromkeys(_FIELDS, _values)),
    kept=st.sets(st.sampled_from(_FIELDS)),
)
def test_warns_exactly_when_a_left_out_field_holds_a_tensor_off_the_target(
    values: dict[str, Any], kept: set[str]
) -> None:
    from cudakit._tree import forget_warnings

    forget_warnings()

    class Record:
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    names = sorted(kept)
    register_container(Record, flatten=lambda r: {n: getattr(r, n) for n in names})

    def off_target(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return v.device != META
        return isinstance(v, list) and any(map(off_target, v))

    left = [n for n in _FIELDS if n not in kept and off_target(values[n])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = on_device(Record(**values), device="meta")
    assert len(caught) == (1 if left else 0), [str(w.message) for w in caught]
    if left:
        assert caught[0].category is TensorsLeftBehindWarning
        assert ", ".join(map(repr, left)) in str(caught[0].message)
    for n in _FIELDS:  # kept fields moved, the others as they were
        v = getattr(out, n)
        if n not in kept:
            assert v is values[n]
        elif isinstance(v, torch.Tensor):
            assert v.device == META


def test_the_check_runs_only_for_types_with_their_own_flatten_until_they_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain containers, the default flatten and a type that has warned are not probed."""
    import cudakit._tree.probe as objects

    probed: list[object] = []
    real = objects.holds_tensor

    def counting(x: object, *args: Any, **kwargs: Any) -> bool:
        probed.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(objects, "holds_tensor", counting)

    class Default(Sample):
        pass

    class Own(Sample):
        pass

    register_container(Default)
    register_container(Own, flatten=lambda s: {"pixels": s.pixels})
    on_device({"x": [torch.ones(1)], "d": Default(torch.ones(1), torch.ones(1))}, device="meta")
    assert probed == []
    with pytest.warns(TensorsLeftBehindWarning):
        on_device(Own(torch.ones(1), torch.ones(1)), device="meta")
    assert probed
    probed.clear()
    on_device(Own(torch.ones(1), torch.ones(1)), device="meta")  # warned once: not probed
    assert probed == []
