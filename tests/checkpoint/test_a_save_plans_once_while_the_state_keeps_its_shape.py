"""A save plans once while the state keeps its shape, and plans again when it changes.

DCP plans a save (a write item per tensor, the global plan, the metadata) from the
state's structure; the Checkpointer keeps that plan, and the archives of the values DCP
pickles, while nothing of the structure changes. A new parameter group, a resized
tensor, a new optimizer state key, a hyper-parameter that changes value or type: each
is saved as a save planned afresh would save it (the same ``.metadata`` as DCP's own
save), resumes bit for bit, and loads with plain ``dcp.load``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import cudakit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(3))


def _objects() -> tuple[Net, torch.optim.Optimizer]:
    model = Net()
    opt = torch.optim.AdamW(model.a.parameters(), lr=1e-2)
    opt.param_groups[0]["tag"] = "short"  # a value of the user's, saved and loaded
    return model, opt


def _step(model: Net, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))
    model.b(model.a(x)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _save_next(ckpt: cudakit.Checkpointer) -> Path:
    """A save one batch further than the last (a new checkpoint, not the same again)."""
    pos = ckpt.position
    ckpt._position = cudakit.Position(0, 0, pos.total + 1, pos.windows + 1)
    path = ckpt.save()
    assert path is not None
    return path


def _new_group(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.5})


def _resized(model: Net, opt: torch.optim.Optimizer) -> None:
    model.seen = torch.arange(5.0)


def _new_state_key(model: Net, opt: torch.optim.Optimizer) -> None:
    _step(model, opt)  # (a fresh optimizer has no state yet)
    opt.state[model.a.weight]["mark"] = torch.full((2,), 3.0)


def _new_lr(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["lr"] = 0.125


def _lr_as_tensor(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["lr"] = torch.tensor(0.25)


def _longer_value(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["tag"] = "long" * 100  # its archive grows: later offsets move


def _same_fqns_other_nesting(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["betas"] = [0.8, 0.9]  # a tuple before: pickled otherwise


CHANGES: dict[str, Callable[[Net, torch.optim.Optimizer], None]] = {
    "a new param group": _new_group,
    "a resized buffer": _resized,
    "a new optimizer state key": _new_state_key,
    "a hyper-parameter's new value": _new_lr,
    "a hyper-parameter's new type": _lr_as_tensor,
    "a hyper-parameter's new container": _same_fqns_other_nesting,
    "a hyper-parameter's longer value": _longer_value,
}


def _dcp_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": {"model": msd}, "optim": {"model": osd}}


def _metadata(path: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def _where(metadata: Any) -> dict[Any, tuple[str, int, int]]:
    return {k: (v.relative_path, v.offset, v.length) for k, v in metadata.storage_data.items()}


def _assert_same_state(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), where
        assert a.dtype == b.dtype, where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_state(x, y, f"{where}.{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_structure_is_saved_as_a_fresh_plan_would_save_it(
    tmp_path: Path, change: str
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    model, opt = _objects()
    _step(model, opt)
    ckpt = cudakit.Checkpointer(tmp_path / "mine", model=model, optimizer=opt, preemption=False)
    _save_next(ckpt)
    _save_next(ckpt)  # planned once, then kept
    CHANGES[change](model, opt)
    _step(model, opt)
    path = _save_next(ckpt)
    ckpt.close()

    # The .metadata DCP's own save writes for that state, afresh.
    dcp.save(_dcp_state(model, opt), storage_writer=FileSystemWriter(str(tmp_path / "dcp")),
             no_dist=True)  # fmt: skip
    mine, theirs = _metadata(path), _metadata(tmp_path / "dcp")
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.planner_data == theirs.planner_data
    assert _where(mine) == _where(theirs)
    assert (path / "__0_0.distcp").read_bytes() == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()

    # Plain dcp.load reads it, bit for bit.
    fresh, fresh_opt = _objects()
    CHANGES[change](fresh, fresh_opt)
    _step(fresh, fresh_opt)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    target = _dcp_state(fresh, fresh_opt)
    dcp.load(target, storage_reader=FileSystemReader(str(path)), no_dist=True)
    _assert_same_state(target, _dcp_state(model, opt))

    # And a resume puts it all back, bit for bit.
    again, again_opt = _objects()
    CHANGES[change](again, again_opt)
    resumed = cudakit.Checkpointer(tmp_path / "mine", model=again, optimizer=again_opt,
                                   preemption=False)  # fmt: skip
    resumed.resume()
    resumed.close()
    _assert_same_state(again.state_dict(), model.state_dict())
    _assert_same_state(again_opt.state_dict(), opt.state_dict())


def _counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count DCP's planning and the archives of the values it pickles."""
    from torch.distributed.checkpoint import default_planner

    counts = {"local": 0, "global": 0, "values": 0}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    for name, attr in (
        ("local", "create_default_local_save_plan"),
        ("global", "create_default_global_save_plan"),
    ):
        monkeypatch.setattr(default_planner, attr, counting(name, getattr(default_planner, attr)))
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, io.BytesIO) and not isinstance(obj, torch.Tensor):
            counts["values"] += 1
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return counts


@pytest.mark.parametrize("async_save", [False, True])
def test_an_unchanged_state_is_planned_and_pickled_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    model, opt = _objects()
    _step(model, opt)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, async_save=async_save,
                                preemption=False)  # fmt: skip
    counts = _counted(monkeypatch)
    _save_next(ckpt)
    ckpt.wait()
    first = dict(counts)
    assert first["local"] == first["global"] == 1
    assert first["values"] > 0  # the hyper-parameters, pickled by torch.save
    for _ in range(3):
        _step(model, opt)  # new values, the same structure
        _save_next(ckpt)
        ckpt.wait()
    assert counts == first
    # The .metadata pickle: made, checked against pickle.dumps on the next save, reused.
    assert ckpt._writer._plans.pickles == 2
    latest = ckpt.latest
    assert latest is not None
    raw = (latest / ".metadata").read_bytes()
    metadata = pickle.loads(raw)
    assert pickle.dumps(metadata) == raw
    assert metadata.storage_meta.checkpoint_id.name == latest.name + ".partial"
    assert _where(metadata) == _where(_metadata(latest))
    _new_lr(model, opt)  # a new value: its archive is made again, the plan is kept
    _save_next(ckpt)
    ckpt.wait()
    assert (counts["local"], counts["global"]) == (1, 1)
    assert counts["values"] == first["values"] + 1
    _new_group(model, opt)  # a new structure: planned again
    _save_next(ckpt)
    ckpt.close()
    assert (counts["local"], counts["global"]) == (2, 2)


def test_two_checkpointers_keep_plans_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, first_opt = _objects()
    second, second_opt = _objects()
    _new_group(second, second_opt)
    for m, o in ((first, first_opt), (second, second_opt)):
        _step(m, o)
    one = cudakit.Checkpointer(tmp_path / "one", model=first, optimizer=first_opt,
                               preemption=False)  # fmt: skip
    two = cudakit.Checkpointer(tmp_path / "two", model=second, optimizer=second_opt,
                               preemption=False)  # fmt: skip
    counts = _counted(monkeypatch)
    for _ in range(2):
        paths = [_save_next(one), _save_next(two)]
    one.close()
    two.close()
    assert counts["global"] == 2
    keys = [set(_metadata(p).state_dict_metadata) for p in paths]
    assert "optim.model.param_groups.1.lr" in keys[1] - keys[0]


_LEAVES = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.none(),
    st.builds(torch.zeros, st.integers(0, 3)),
)
_STATES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3),
        st.dictionaries(st.integers(0, 3), inner, max_size=2),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(state=st.dictionaries(st.text("xyz", min_size=1, max_size=2), _STATES, max_size=3))
def test_the_state_is_flattened_as_dcp_flattens_it(state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    from cudakit.checkpoint import _plan as plan

    try:
        dcp_flat, dcp_mappings = flatten_state_dict(state)
    except ValueError:  # a name made twice ('a.0' from a dict and a list): DCP refuses it
        assert plan._flattened(state) is None
        return
    dcp_flat = _flatten_sharded_tensors(dcp_flat)
    got = plan._flattened(state)
    assert got is not None
    assert plan._same_flat(*got, dcp_flat, dcp_mappings)


def test_a_flattening_unlike_dcps_is_left_to_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudakit.checkpoint import _plan as plan

    real = plan._flattened

    def renamed(state: Any) -> Any:
        flat, mappings = real(state)
        return {f"x{k}": v for k, v in flat.items()}, {f"x{k}": v for k, v in mappings.items()}

    monkeypatch.setattr(plan, "_flattened", renamed)
    model, opt = _objects()
    _step(model, opt)
    ckpt = cudakit.Checkpointer(tmp_path, model=model, optimizer=opt, preemption=False)
    for _ in range(2):
        _save_next(ckpt)
    assert ckpt._writer._plans.flatten_refused
    ckpt.close()
    names = set(dcp.FileSystemReader(str(ckpt.latest)).read_metadata().state_dict_metadata)
    assert "model.model.a.weight" in names
