"""DCP's save plan, kept while the state's structure is unchanged.

DCP plans every save from scratch: a write item per tensor (``create_local_plan``),
then, on the coordinator, the global plan and the checkpoint's metadata
(``create_global_plan``); and it pickles each non-tensor value (a hyper-parameter)
with ``torch.save``. For a loop that saves the same state again and again, all of it
depends only on the state's structure, or on values that rarely change. A
:class:`Plans` (one per :class:`~cudakit.checkpoint.Checkpointer`, never shared)
keeps them:

* the local plan, while the flat state's *structure* is the same: its names and
  nesting, each value's kind, and for each tensor what DCP's write item holds (shape,
  dtype, layout, ``requires_grad``, pinned memory; a DTensor's mesh and placements);
  any other kind of value (a ShardedTensor, an object planning its own writes) is
  planned afresh every time;
* the global plan and the metadata, while every rank's local plan equals the one it
  was made from: the coordinator compares the plans it gathers (each rank sends its
  plan in DCP's collective as before), so the decision is one rank's and the same for
  all of them;
* each pickled value's archive, by the value's pickle (plain values only: numbers,
  strings, containers of them), with the serialization settings of the moment;
* the pickle of the ``.metadata``: where the metadata equals the last save's but for
  its save id and the checkpoint's directory name (of the same lengths), those two
  are put into the last pickle's bytes. Such a pickle is used once it has reproduced
  ``pickle.dumps`` byte for byte (on the save after the one it was made on).

What changes from save to save is recomputed as before: the data, the archives of
values that changed, each item's offset and length in the file (the metadata's
storage part, filled in by the storage writer).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import torch

__all__ = ["Plans", "planner"]

_PLAIN = (int, float, complex, str, bytes, bool, type(None))


@dataclasses.dataclass
class Plans:
    """What a Checkpointer's saves reuse; the saves run one at a time."""

    structure: Any = None  # the structure the local plan was made from
    local: Any = None  # that local plan
    gathered: list[Any] | None = None  # every rank's plan the global plan was made from
    global_plan: list[Any] | None = None
    metadata: Any = None
    #: Archives of pickled values, of the last save and of the one before (by settings
    #: and pickle), so that a value that changes does not make the cache grow.
    archives: dict[tuple[Any, bytes], bytes] = dataclasses.field(default_factory=dict)
    earlier: dict[tuple[Any, bytes], bytes] = dataclasses.field(default_factory=dict)
    pickled: _Pickled | None = None  # the last .metadata pickle
    #: Whether the state's flattening differed from DCP's (then DCP flattens it).
    flatten_refused: bool = False
    #: How many plans were made and reused, and metadata pickled (read by the tests).
    made: int = 0
    reused: int = 0
    pickles: int = 0

    def start(self) -> None:
        """A save begins: the archives of the save before become the older ones."""
        self.earlier, self.archives = self.archives, {}

    def archive(self, value: Any) -> io.BytesIO:
        """``torch.save(value)``'s bytes, made once for each plain value."""
        key = _archive_key(value)
        if key is None:
            return _torch_saved(value)
        found = self.archives.get(key)
        if found is None:
            found = self.earlier.get(key)
            if found is None:
                found = _torch_saved(value).getvalue()
            self.archives[key] = found
        return io.BytesIO(found)

    def metadata_pickle(self, metadata: Any) -> bytes:
        """``pickle.dumps(metadata)``: the last save's bytes with the save id and the
        directory name put in, where nothing else changed."""
        fixed, names = _metadata_parts(metadata)
        last = self.pickled
        if last is not None and names is not None and last.fits(fixed, names):
            spliced = last.spliced(names)
            if last.verified:
                return spliced
            data = self._pickle(metadata)
            if data == spliced:
                last.verified = True
                return data
        else:
            data = self._pickle(metadata)
        self.pickled = _Pickled.make(data, fixed, names)
        return data

    def _pickle(self, metadata: Any) -> bytes:
        self.pickles += 1
        return pickle.dumps(metadata)


@dataclasses.dataclass
class _Pickled:
    """A ``.metadata`` pickle, what of its metadata must stay the same to reuse it, and
    where the strings that may change are in it (start, length)."""

    data: bytes
    fixed: tuple[Any, ...]
    at: tuple[tuple[int, int], ...]
    verified: bool = False

    @classmethod
    def make(cls, data: bytes, fixed: tuple[Any, ...], names: tuple[bytes, ...] | None) -> Any:
        if names is None:
            return None
        at = []
        for name in names:
            start = data.find(name)
            if not name or start < 0 or data.find(name, start + 1) >= 0:
                return None  # (not found once: where to put it in is not known)
            at.append((start, len(name)))
        return cls(data, fixed, tuple(at))

    def fits(self, fixed: tuple[Any, ...], names: tuple[bytes, ...]) -> bool:
        return (
            fixed[0] is self.fixed[0]
            and fixed[1] is self.fixed[1]
            and fixed[2:] == self.fixed[2:]
            and all(len(n) == size for n, (_, size) in zip(names, self.at, strict=True))
        )

    def spliced(self, names: tuple[bytes, ...]) -> bytes:
        data = bytearray(self.data)
        for name, (start, size) in zip(names, self.at, strict=True):
            data[start : start + size] = name
        return bytes(data)


def _metadata_parts(metadata: Any) -> tuple[tuple[Any, ...], tuple[bytes, ...] | None]:
    """What of ``metadata`` must be the same for its pickle to be the last one's (the
    state's metadata and the planner's data by identity, the rest by value), and the
    encoded strings that may change (None: a metadata of another form)."""
    meta = metadata.storage_meta
    storage = metadata.storage_data
    places = (
        tuple(
            (key, key.index, type(value), tuple(value.__dict__.items()))
            for key, value in storage.items()
        )
        if isinstance(storage, dict)
        else storage
    )
    fixed: tuple[Any, ...] = (
        metadata.state_dict_metadata,
        metadata.planner_data,
        type(metadata),
        sorted(k for k in metadata.__dict__),
        places,
        metadata.version,
        type(meta),
    )
    checkpoint = getattr(meta, "checkpoint_id", None)
    save_id = getattr(meta, "save_id", None)
    if not isinstance(checkpoint, PurePath) or type(save_id) is not str:
        return fixed, None
    rest = tuple((k, v) for k, v in meta.__dict__.items() if k not in ("checkpoint_id", "save_id"))
    fixed += (type(checkpoint), str(checkpoint.parent), rest)
    return fixed, (_encoded(save_id), _encoded(checkpoint.name))


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # (as pickle writes a string)


def planner(plans: Plans) -> Any:
    """DCP's default save planner, with what ``plans`` keeps reused and kept."""
    return _planner_class()(plans)


@functools.cache
def _planner_class() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class KeptPlanner(DefaultSavePlanner):
        def __init__(self, plans: Plans) -> None:
            super().__init__()
            self.plans = plans
            self._structure: Any = None
            self._made: tuple[Any, ...] | None = None

        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            plans = self.plans
            flat = None if plans.flatten_refused else _flattened(state_dict)
            if flat is None:
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
            else:
                self.state_dict, self.mappings = flat
                self.is_coordinator = is_coordinator
            self._structure = _structure(self.state_dict, self.mappings, self.is_coordinator)
            if flat is not None and self._structure != plans.structure:
                # a new plan: the flattening checked against DCP's own once more
                flat_state, mappings = self.state_dict, self.mappings
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
                if not _same_flat(flat_state, mappings, self.state_dict, self.mappings):
                    plans.flatten_refused = True
                    self._structure = _structure(
                        self.state_dict, self.mappings, self.is_coordinator
                    )
            plans.start()

        def create_local_plan(self) -> Any:
            plans = self.plans
            if self._structure is not None and self._structure == plans.structure:
                self.plan = plans.local
                return self.plan
            plan = super().create_local_plan()
            self._made = (self._structure, plan)
            return plan

        def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
            plans = self.plans
            kept = plans.global_plan
            if kept is not None and plans.gathered is not None and _same(all_plans, plans.gathered):
                global_plan = kept
                metadata = dataclasses.replace(plans.metadata)  # (its storage part is set anew)
                plans.reused += 1
            else:
                global_plan, metadata = super().create_global_plan(all_plans)
                plans.gathered, plans.global_plan = list(all_plans), global_plan
                plans.metadata = dataclasses.replace(metadata)
                plans.made += 1
            self.global_plan, self.metadata = global_plan, metadata
            return global_plan, metadata

        def finish_plan(self, new_plan: Any) -> Any:
            plan = super().finish_plan(new_plan)
            if self._made is not None:  # kept once the global plan is made
                self.plans.structure, self.plans.local = self._made
            return plan

        def resolve_data(self, write_item: Any) -> Any:
            # A plain tensor is its own data (what DCP's lookup gives, in fewer calls).
            if write_item.type != WriteItemType.BYTE_IO:
                index = write_item.index
                value = self.state_dict.get(index.fqn)
                if type(value) is torch.Tensor and (index.offset is None or not any(index.offset)):
                    return value
            return super().resolve_data(write_item)

        def transform_object(self, write_item: Any, obj: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return self.plans.archive(obj)
            return super().transform_object(write_item, obj)

    return KeptPlanner


def _same(plans: list[Any], kept: list[Any]) -> bool:
    """Whether the gathered plans are those the kept global plan was made from (in one
    process the very objects: identity makes it cheap)."""
    return len(plans) == len(kept) and all(
        a is b or a == b for a, b in zip(plans, kept, strict=True)
    )


def _structure(flat: Mapping[str, Any], mappings: Any, coordinator: bool) -> Any:
    """What DCP's local plan of the flat state ``flat`` depends on (None: a value whose
    plan is not known from it, planned afresh every time)."""
    from torch.distributed.tensor import DTensor

    properties = _properties()
    parts: list[Any] = [coordinator]
    for name, value in flat.items():
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            leaf: Any = (value.size(), properties(value))
        elif kind is DTensor:
            local = value.to_local()
            leaf = (
                value.size(),
                value.device_mesh,
                value.placements,
                local.size(),
                properties(local),
            )
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            leaf = None  # (a pickled value: its plan is its name)
        parts.append((name, mappings.get(name) if mappings else None, kind, leaf))
    return tuple(parts)


@functools.cache
def _properties() -> Any:
    """What DCP's ``TensorProperties`` of a tensor holds, as a tuple where its fields are
    those known here (a dataclass per tensor costs more than the rest of the walk)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    fields = tuple(f.name for f in dataclasses.fields(TensorProperties))
    known = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    if fields == known:
        return lambda t: (t.dtype, t.layout, t.requires_grad, t.is_pinned())
    if fields == (*known, "strides"):
        return lambda t: (t.dtype, t.layout, t.requires_grad, t.is_pinned(), t.stride())
    return TensorProperties.create_from_tensor  # pragma: no cover - a torch with others


def _flattened(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """DCP's flat state and its mappings, as ``flatten_state_dict`` and then
    ``_flatten_sharded_tensors`` give them (None: a state or a torch where they may not
    be these: a ShardedTensor, DCP's 2.3 layout).

    Mappings are walked, lists too where they hold a tensor or a mapping with one (a
    list of plain values, and a tuple, stay one value); a value's name is its path
    joined with dots. :func:`_same_flat` checks the result against DCP's own.
    """
    try:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor
        from torch.distributed.checkpoint import _version
    except ImportError:  # pragma: no cover - a torch that moved them
        return None
    if getattr(_version, "_derived_version", None) is not None:
        return None
    flat: dict[str, Any] = {}
    mappings: dict[str, Any] = {}

    def terminal(value: Any) -> bool:
        kind = type(value)
        if kind is dict or (kind is not list and isinstance(value, Mapping)):
            return False
        if kind is not list and not isinstance(value, list):
            return True
        for entry in value:
            if type(entry) in _PLAIN:
                continue
            if isinstance(entry, Mapping | list) and not terminal(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
        return True

    def walk(path: tuple[Any, ...], value: Any) -> None:
        kind = type(value)
        if kind is dict or (kind is not torch.Tensor and isinstance(value, Mapping)):
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif kind is torch.Tensor or isinstance(value, torch.Tensor) or terminal(value):
            if kind is not torch.Tensor and isinstance(value, ShardedTensor):
                raise _Unflat
            name = ".".join(map(str, path))
            if name in flat:
                raise _Unflat  # (DCP raises its own error for it)
            flat[name] = value
            mappings[name] = path
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk((*path, i), v)

    try:
        for key, value in state.items():
            walk((str(key),), value)
    except _Unflat:
        return None
    return flat, mappings


class _Unflat(Exception):
    """A state :func:`_flattened` leaves to DCP."""


def _same_flat(
    flat: dict[str, Any], mappings: dict[str, Any], dcp_flat: Any, dcp_mappings: Any
) -> bool:
    """Whether a flattening is DCP's: the same names in order, the same objects, the same
    paths."""
    return (
        list(flat) == list(dcp_flat)
        and all(v is dcp_flat[k] for k, v in flat.items())
        and mappings == dict(dcp_mappings)
    )


def _archive_key(value: Any) -> tuple[Any, bytes] | None:
    """The serialization settings and the value's pickle, where ``torch.save``'s archive
    of it follows from them (a plain value); else None."""
    if not _plain(value):
        return None
    try:
        from torch.utils.serialization import config

        tls = getattr(torch.serialization, "_serialization_tls", None)
        settings = (
            config.save.compute_crc32,
            config.save.storage_alignment,
            getattr(tls, "skip_data", False),
        )
    except (ImportError, AttributeError):  # pragma: no cover - a torch that moved them
        return None
    return settings, pickle.dumps(value, protocol=torch.serialization.DEFAULT_PROTOCOL)


def _plain(value: Any) -> bool:
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is tuple or kind is list:
        return all(_plain(v) for v in value)
    if kind is dict:
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _torch_saved(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer
