"""What a checkpoint may hold: plain values and tensors round-trip through the safe
loaders; a user's own type only through safe_globals=; a value the safe loader would
refuse is refused at save(); checkpoints of an older host format only with trust_pickles."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cudakit
from cudakit.checkpoint import _layout as layout
from cudakit.checkpoint import data

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_training import run
from tampered import fix_manifest


@dataclasses.dataclass
class Config:
    """A user's own type, saved as an extra."""

    name: str
    depth: int


class Counter:
    """An extra saved by its state_dict(), whose state is plain values."""

    def __init__(self) -> None:
        self.n = 0
        self.seen = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seen": self.seen.clone(), "tags": ("a", 1)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.seen = state["n"], state["seen"]


class WithExtraState(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.config = Config("lin", 1)

    def get_extra_state(self) -> Any:
        return self.config

    def set_extra_state(self, state: Any) -> None:
        self.config = state


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _np_equal(a: Any, b: Any) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def test_a_clean_checkpoint_puts_torch_python_and_numpy_rng_and_extras_back_bit_for_bit(
    tmp_path: Path,
) -> None:
    model, opt = _model()
    counter = Counter()
    counter.n, counter.seen = 7, torch.tensor([1.0, 2.0, 3.0])
    extras = {
        "plain": {"best": 0.25, "names": ["a", "b"], "pair": (1, None), "ok": True},
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.float64(1.5),
        "counter": counter,
    }
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra=extras,
                                preemption=False)  # fmt: skip
    random.seed(1)
    np.random.seed(2)
    np.random.randn()  # NumPy now holds a cached Gaussian
    torch.manual_seed(3)
    expected = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    ckpt.save()
    ckpt.close()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    fresh = Counter()
    extras2: dict[str, Any] = {"plain": None, "array": None, "scalar": None, "counter": fresh}
    model2, opt2 = _model()
    again = cudakit.Checkpointer(tmp_path, model=model2, optimizer=opt2, extra=extras2,
                                 preemption=False)  # fmt: skip
    again.resume()
    assert random.getstate() == expected[0]
    assert _np_equal(np.random.get_state(), expected[1])
    assert torch.equal(torch.get_rng_state(), expected[2])
    assert again.extra["plain"] == extras["plain"]
    assert isinstance(again.extra["plain"]["pair"], tuple)
    assert np.array_equal(again.extra["array"], extras["array"])
    assert again.extra["array"].dtype == np.float32
    assert again.extra["scalar"] == np.float64(1.5)
    assert fresh.n == 7
    assert torch.equal(fresh.seen, counter.seen)
    again.close()


def test_the_rank_file_loads_with_torch_alone(tmp_path: Path) -> None:
    """No NumPy type in a rank file of plain extras: torch.load(weights_only=True) reads it."""
    model, opt = _model()
    np.random.seed(4)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, extra={"x": [1, 2.0]},
                                preemption=False)  # fmt: skip
    path = ckpt.save()
    ckpt.close()
    host = torch.load(path / "rank-00000.pt", weights_only=True)
    assert host["format"] == layout.HOST_FORMAT == 2
    assert isinstance(host["rng"]["numpy"]["keys"], torch.Tensor)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), draws=st.integers(0, 700), gauss=st.booleans())
def test_numpys_state_round_trips_through_the_safe_loader(
    seed: int, draws: int, gauss: bool
) -> None:
    rs = np.random.RandomState(seed)
    rs.random_sample(draws)
    if gauss:
        rs.standard_normal()
    state = rs.get_state()
    plain = data.numpy_state_to_plain(state)
    buffer = __import__("io").BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    back = data.numpy_state_from_plain(torch.load(buffer, weights_only=True))
    assert _np_equal(back, state)
    other = np.random.RandomState(0)
    other.set_state(back)
    assert np.array_equal(other.random_sample(5), rs.random_sample(5))


_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_plain = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(value=b"")  # pickle writes an empty bytes as a call of bytes()
@example(value={"k": [b"", bytearray(b"x")]})
@given(value=_plain)
def test_plain_extras_round_trip_with_their_types(value: Any) -> None:
    root = Path(tempfile.mkdtemp())
    try:
        model, opt = _model()
        ckpt = cudakit.Checkpointer(root, model=model, optimizer=opt, extra={"v": value},
                                    preemption=False)  # fmt: skip
        ckpt.save()
        ckpt.close()
        again = cudakit.Checkpointer(root, model=model, optimizer=opt, extra={"v": None},
                                     preemption=False)  # fmt: skip
        again.resume()
        assert again.extra["v"] == value
        assert repr(again.extra["v"]) == repr(value)  # tuples stay tuples, ints ints
        again.close()
    finally:
        shutil.rmtree(root)


def test_an_extra_of_a_users_type_is_refused_at_save_with_the_fix(tmp_path: Path) -> None:
    model, opt = _model()
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False,
                                extra={"config": Config("a", 2)})  # fmt: skip
    with pytest.raises(cudakit.CheckpointSaveError) as info:
        ckpt.save()
    message = str(info.value)
    assert "'config' (Config: " in message
    assert f"{Config.__module__}.Config" in message
    assert "weights_only=True" in message
    assert "safe_globals=[TheType]" in message
    assert "Free space" not in message
    assert not any(tmp_path.glob("ckpt-*"))  # nothing of it became visible
    ckpt.close()


def test_safe_globals_lets_a_users_type_round_trip(tmp_path: Path) -> None:
    model, opt = _model()
    ckpt = cudakit.Checkpointer(
        tmp_path, model=model, optimizer=opt, preemption=False,
        extra={"config": Config("a", 2)}, safe_globals=[Config],
    )  # fmt: skip
    ckpt.save()
    ckpt.close()
    refused = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False,
                                   extra={"config": None})  # fmt: skip
    with pytest.warns(UserWarning, match=r"skipping .*Config"):
        refused.resume()  # the type is not allowed in this run: refused
    refused.close()
    again = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False,
                                 extra={"config": None}, safe_globals=[Config])  # fmt: skip
    again.resume()
    assert again.extra["config"] == Config("a", 2)
    again.close()


def test_a_modules_extra_state_is_checked_at_save_and_allowed_by_safe_globals(
    tmp_path: Path,
) -> None:
    model = WithExtraState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cudakit.Checkpointer(tmp_path / "a", model=model, optimizer=opt, preemption=False)
    with pytest.raises(cudakit.CheckpointSaveError, match=r"_extra_state.*Config.*safe_globals"):
        ckpt.save()
    ckpt.close()
    ckpt = cudakit.Checkpointer(tmp_path / "b", model=model, optimizer=opt, preemption=False,
                                safe_globals=[Config])  # fmt: skip
    ckpt.save()
    ckpt.close()
    other = WithExtraState()
    other.config = Config("other", 0)
    again = cudakit.Checkpointer(tmp_path / "b", model=other, preemption=False,
                                 optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                                 safe_globals=[Config])  # fmt: skip
    again.resume()
    assert other.config == Config("lin", 1)
    again.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"safe_globals": "Config"}, r"Checkpointer\(safe_globals=\.\.\.\) expects a list"),
        ({"safe_globals": [Config("a", 1)]}, r"safe_globals.*Item 0 is Config.*not an instance"),
        ({"safe_globals": [Config, "m.C"]}, r"safe_globals.*Item 1 is str 'm\.C': pass the class"),
        ({"trust_pickles": "yes"}, r"trust_pickles.*only for checkpoints you wrote"),
    ],
)
def test_bad_safe_globals_and_trust_pickles_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    model, opt = _model()
    with pytest.raises(TypeError, match=match):
        cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False, **kwargs)


# ---------------------------------------------------------------- older checkpoints


@pytest.fixture(scope="module")
def old_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose newest checkpoint has a rank file of host format 1 (NumPy's state as
    NumPy saves it), as cudakit wrote before the safe loader."""
    root = tmp_path_factory.mktemp("old") / "run"
    np.random.seed(5)
    run(root, accumulate=1, every=10)
    for ckpt in (root / "ckpt-0000000010", root / "ckpt-0000000020"):
        file = ckpt / "rank-00000.pt"
        host = torch.load(file, weights_only=True)
        host["format"] = 1
        host["rng"]["numpy"] = data.numpy_state_from_plain(host["rng"]["numpy"])
        host["extras"]["config"] = ("value", Config("old", 3))  # a pickle-only extra
        torch.save(host, file)
        fix_manifest(ckpt)
    return root


def test_an_older_checkpoint_is_refused_with_the_opt_in_named(
    old_run: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(old_run, root)
    from test_checkpoint_tampered_files import checkpointer

    ckpt, model = checkpointer(root)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cudakit.CheckpointError, match=r"older cudakit \(host format 1") as info:
        ckpt.resume()  # not skipped: a run would start over and lose it
    assert "trust_pickles=True" in str(info.value)
    assert "rank-00000.pt" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ckpt.close()


def test_trust_pickles_loads_an_older_checkpoint_and_saves_the_new_format(
    old_run: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(old_run, root)
    from test_checkpoint_tampered_files import checkpointer

    ckpt, _ = checkpointer(root, trust_pickles=True, extra={"config": None})
    np.random.seed(0)
    assert ckpt.resume() == cudakit.Position(2, 0, 20, 20)
    assert ckpt.extra["config"] == Config("old", 3)
    saved = torch.load(root / "ckpt-0000000020" / "rank-00000.pt", weights_only=False)
    assert _np_equal(np.random.get_state(), saved["rng"]["numpy"])
    ckpt.extra["config"] = {"name": "old", "depth": 3}  # plain from now on
    ckpt._position = cudakit.Position(2, 0, 21, 21)
    path = ckpt.save()
    ckpt.close()
    assert torch.load(path / "rank-00000.pt", weights_only=True)["format"] == 2


# ---------------------------------------------------------------- the walkers


@settings(max_examples=60, deadline=None)
@given(value=_plain, where=st.integers(0, 3))
def test_the_save_check_finds_a_users_object_anywhere_in_the_state(value: Any, where: int) -> None:
    from cudakit.checkpoint import _admit as admit

    assert list(admit._leaves({"model": {"w": torch.zeros(1), "v": value}}, "")) == []
    nests: list[Any] = [Config("x", 1)]
    for _ in range(where):
        nests = [{"k": nests}, (0, nests)][where % 2 : where % 2 + 1]
    state = {"optim": {"param_groups": [value, nests]}}
    found = list(admit._leaves(state, ""))
    assert [type(v) for _, v in found] == [Config]
    assert found[0][0].startswith("optim.param_groups.1")


@settings(max_examples=60, deadline=None)
@given(value=_plain, protocol=st.integers(0, 5))
def test_the_static_scan_finds_no_global_in_plain_values(value: Any, protocol: int) -> None:
    from cudakit.checkpoint import _safe_load as safe_load

    names = safe_load.refused_globals(pickle.dumps(value, protocol=protocol))
    assert set(names) <= {"_codecs.encode", "copyreg._reconstructor", "builtins.bytes"}


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=200))
def test_the_static_scan_never_raises_on_garbage(data: bytes) -> None:
    from cudakit.checkpoint import _safe_load as safe_load

    assert isinstance(safe_load.refused_globals(data), list)
    found = safe_load._host_format(data)
    assert found is None or isinstance(found, int)


_loadable_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.complex_numbers()
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu")])
    | st.builds(torch.zeros, st.integers(0, 3))
)
_loadable = st.recursive(
    _loadable_leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=_loadable)
def test_what_the_save_check_admits_unread_loads_with_the_safe_loader(value: Any) -> None:
    """A save reads its rank file back only when the walk cannot vouch for its state."""
    import io

    from cudakit.checkpoint import _admit as admit
    from cudakit.checkpoint import _safe_load as safe_load

    assert admit.known_to_load({"v": value})
    buffer = io.BytesIO()
    torch.save({"v": value}, buffer)
    buffer.seek(0)
    with safe_load.allowed_globals():
        torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "value",
    [
        Config("x", 1),
        collections.OrderedDict(a=1),
        np.float64(1.5),
        torch.nn.Linear(1, 1),
        torch.zeros(2).to_sparse(),
        [[0]] * 2,  # the same list twice: read back to know
        True.__class__,
        range(3),
    ],
)
def test_the_save_check_reads_back_what_it_cannot_vouch_for(value: Any) -> None:
    from cudakit.checkpoint import _admit as admit

    assert not admit.known_to_load({"k": [1, (2, value)]})
