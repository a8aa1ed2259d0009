"""Pretrained weights into a (sharded) model, a slice per rank, and back out.

:func:`load_pretrained` reads safetensors files (one, or a set with Hugging Face's
``model.safetensors.index.json``) and DCP checkpoints. Every rank reads only the
rows of its own shards: one ``seek`` and one read per tensor (safetensors), or
DCP's own per-shard reads. Everything is checked before the first tensor is
written: keys missing, unexpected or of another shape, dtypes, a prefix the file's
keys have (``model.``) or lack. :func:`save_pretrained` writes the model back as
safetensors, one full tensor at a time, so no rank holds the whole model.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .._check import check_bool, check_int, check_optional, check_type, fail_type
from ._safetensors import DTYPES, Entry, FileWriter, HeaderError, SliceReader, read_header
from .meta import check_all_meta, is_sharded, local_part, local_region
from .unwrapped import unwrap

__all__ = ["PretrainedLoad", "load_pretrained", "save_pretrained"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class PretrainedLoad(NamedTuple):
    """What :func:`load_pretrained` returns.

    .. versionadded:: 0.1
    """

    #: The model's keys the file did not have (only with ``strict=False``).
    missing_keys: list[str]
    #: The file's keys the model does not have (only with ``strict=False``).
    unexpected_keys: list[str]
    #: Bytes this rank read from safetensors files (None for DCP).
    bytes_read: int | None


class _Source(NamedTuple):
    kind: str  # "safetensors" or "dcp"
    root: Path
    keys: dict[str, tuple[tuple[int, ...], torch.dtype]]
    entries: dict[str, Entry]


def _names(names: Iterable[str], limit: int = 6) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- sources


def _safetensors_source(func: str, root: Path, files: Mapping[str, Path] | None) -> _Source:
    entries: dict[str, Entry] = {}
    paths = sorted(set(files.values())) if files is not None else [root]
    headers: dict[Path, dict[str, Entry]] = {}
    for file in paths:
        if not file.is_file():
            raise FileNotFoundError(
                f"{func}(path={str(root)!r}): {file.name} is named in {INDEX} but is not "
                "there. Download every file the index names."
            )
        try:
            headers[file] = read_header(file)
        except HeaderError as exc:
            raise ValueError(
                f"{func}(path={str(root)!r}): {exc}. The file is corrupt or not safetensors: "
                "download it again."
            ) from None
    if files is None:
        entries = headers[root]
    else:
        for key, file in files.items():
            if key not in headers[file]:
                raise ValueError(
                    f"{func}(path={str(root)!r}): {INDEX} puts {key!r} in {file.name}, which "
                    "does not hold it. The files do not belong together: download them again."
                )
            entries[key] = headers[file][key]
    keys = {k: (e.shape, e.dtype) for k, e in entries.items()}
    return _Source("safetensors", root, keys, entries)


def _dcp_source(func: str, root: Path) -> _Source:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..checkpoint._safe_dcp import dcp_reader

    metadata = dcp_reader(root).read_metadata()
    keys = {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    return _Source("dcp", root, keys, {})


def _source(func: str, path: Path) -> _Source:
    if path.is_file():
        return _safetensors_source(func, path, None)
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            files = {str(k): path / str(v) for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{func}(path={str(path)!r}): {INDEX} is not a safetensors index "
                f"({type(exc).__name__}: {exc}); it needs a 'weight_map' of names to files."
            ) from None
        return _safetensors_source(func, path, files)
    if (path / SINGLE).is_file():
        return _safetensors_source(func, path / SINGLE, None)
    if (path / ".metadata").is_file():
        return _dcp_source(func, path)
    what = "does not exist" if not path.exists() else "holds no weights cudakit can read"
    raise FileNotFoundError(
        f"{func}(path={str(path)!r}): the path {what}. Pass a .safetensors file, a folder "
        f"with {SINGLE} or {INDEX} (Hugging Face's layout), or a DCP checkpoint folder "
        "(one with a .metadata file)."
    )


# --------------------------------------------------------------------------- the model


def _model_tensors(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The model's state-dict tensors, grouped by object: tied names together."""
    groups: dict[int, list[tuple[str, torch.Tensor]]] = collections.OrderedDict()
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append((name, p))
    for mname, module in model.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for bname, b in module._buffers.items():
            if b is not None and bname not in skip:
                name = f"{mname}.{bname}" if mname else bname
                groups.setdefault(id(b), []).append((name, b))
    return {names[0][0]: names for names in groups.values()}


def _mapping(model_keys: set[str], file_keys: set[str], prefix: str | None) -> tuple[str, str]:
    """``(add, strip)``: the file's key of a model key ``k`` is ``add + k[len(strip):]``."""
    if prefix is not None:
        return prefix, ""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    counts[("", "")] = len(model_keys & file_keys)
    for keys, others, side in ((file_keys, model_keys, 0), (model_keys, file_keys, 1)):
        for key in keys:
            for i, ch in enumerate(key):
                if ch == "." and key[i + 1 :] in others:
                    cut = key[: i + 1]
                    counts[(cut, "") if side == 0 else ("", cut)] += 1
    best = max(counts.values())
    return min((c for c, n in counts.items() if n == best), key=lambda c: len(c[0] + c[1]))


def _file_key(key: str, add: str, strip: str) -> str | None:
    if not key.startswith(strip):
        return None
    return add + key[len(strip) :]


class _Match(NamedTuple):
    tensor: torch.Tensor
    key: str  # the file's
    name: str  # the model's


def _plan(
    func: str,
    model: nn.Module,
    source: _Source,
    *,
    strict: bool,
    dtype: torch.dtype | None,
    prefix: str | None,
) -> tuple[list[_Match], list[str], list[str]]:
    """Match the model's tensors with the file's keys; every refusal raised here."""
    groups = _model_tensors(model)
    all_names = {name for names in groups.values() for name, _ in names}
    add, strip = _mapping(all_names, set(source.keys), prefix)
    matches: list[_Match] = []
    missing: list[str] = []
    used: set[str] = set()
    for first, names in groups.items():
        found = None
        for name, tensor in names:
            key = _file_key(name, add, strip)
            if key is not None and key in source.keys:
                found = _Match(tensor, key, name)
                used.add(key)
        if found is None:
            missing.append(first)
        else:
            matches.append(found)
    unexpected = [k for k in source.keys if k not in used and k.startswith(add)]
    where = f"{func}(path={str(source.root)!r})"
    if not matches:
        raise ValueError(
            f"{where}: none of the {len(source.keys)} keys of the file matches the "
            f"{type(model).__name__}'s {len(groups)} tensors (the file has "
            f"{_names(source.keys, 3)}, the model {_names(groups, 3)}): it holds another "
            "model's weights. Pass the file of this model, or prefix='...' if its keys carry "
            "a prefix the model's do not."
        )
    shapes = [
        f"{m.key!r}: the file's {list(source.keys[m.key][0])}, the model's {list(m.tensor.shape)}"
        for m in matches
        if tuple(source.keys[m.key][0]) != tuple(m.tensor.shape)
    ]
    if shapes:
        raise ValueError(
            f"{where}: {len(shapes)} tensor(s) have another shape than the model's: "
            f"{'; '.join(shapes[:6])}. Build the model with the configuration the weights "
            "were trained with."
        )
    if dtype is not None:
        other = [
            f"{m.key!r} ({source.keys[m.key][1]})"
            for m in matches
            if source.keys[m.key][1] != dtype
        ]
        if other:
            more = f" and {len(other) - 6} more" if len(other) > 6 else ""
            raise ValueError(
                f"{where}: {len(other)} tensor(s) are not {dtype} as asked (dtype=...): "
                f"{', '.join(other[:6])}{more}. Pass dtype=None to cast whatever the file "
                "holds to the model's dtypes."
            )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the file: {_names(missing)}")
        if unexpected:
            parts.append(f"in the file but not in the model: {_names(unexpected)}")
        raise ValueError(
            f"{where}: the keys do not match the {type(model).__name__}'s ("
            + "; ".join(parts)
            + "), so nothing was loaded. Pass strict=False to load the keys that match "
            "(the model's others keep their init) and get the rest back in the result, "
            "or prefix='...' if the file's keys carry a prefix."
        )
    return matches, missing, unexpected


# --------------------------------------------------------------------------- loading


def _check_common(func: str, model: object, path: object) -> tuple[nn.Module, Path]:
    module = check_type(
        func, "model", model, nn.Module, expected="an nn.Module", fix="Pass the model."
    )
    if not isinstance(path, (str, os.PathLike)):
        fail_type(func, "path", "a path (str or os.PathLike)", path, "For example: path='ckpt/'.")
    return unwrap(module), Path(os.fsdecode(path))


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
) -> PretrainedLoad:
    """Load pretrained weights into ``model``, each rank reading only its own shards.

    >>> import tempfile, torch, cudakit.parallel as cp
    >>> src = torch.nn.Linear(3, 2)
    >>> folder = tempfile.mkdtemp()
    >>> _ = cp.save_pretrained(src, folder)
    >>> net = torch.nn.Linear(3, 2)
    >>> cp.load_pretrained(net, folder).missing_keys
    []
    >>> torch.equal(net.weight, src.weight)
    True

    ``path`` is a ``.safetensors`` file, a folder with ``model.safetensors`` or a
    sharded set with ``model.safetensors.index.json`` (Hugging Face's layout), or a
    DCP checkpoint folder (its ``.metadata`` read through cudakit's safe reader).
    For a model sharded with FSDP2 every rank reads only the rows of its own
    shards. Values are cast to each tensor's dtype. Tied weights need one of their
    names in the file. Non-persistent buffers are not in files: the model's init
    (``parallelize(init=...)``) sets them.

    Every check comes before the first tensor is written, so a refused file
    changes nothing.

    Args:
        model: the model, allocated (e.g. by :func:`parallelize` from the meta
            device), wrapped or not.
        path: where the weights are.
        strict: refuse a file whose keys do not match the model's exactly.
        dtype: the dtype the file's tensors must have (None: any, cast).
        prefix: what the file's keys have in front of the model's (``"model."``);
            None finds it (either way round). Keys outside it are left alone.

    Returns:
        The keys that did not match, and the bytes this rank read.

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: a model still on the meta device; missing or unexpected keys
            (with ``strict``), tensors of another shape or dtype, a file of another
            model, a corrupt header.
        FileNotFoundError: nothing readable at ``path``.

    .. versionadded:: 0.1
    """
    func = "load_pretrained"
    inner, root = _check_common(func, model, path)
    check_bool(func, "strict", strict)
    check_optional(
        check_type,
        func,
        "dtype",
        dtype,
        types=torch.dtype,
        expected="a torch.dtype or None",
        fix="For example: dtype=torch.bfloat16.",
    )
    check_optional(
        check_type, func, "prefix", prefix, types=str, expected="a str or None",
        fix="For example: prefix='model.'.",
    )  # fmt: skip
    if check_all_meta(func, inner):
        raise ValueError(
            f"{func}() got a {type(inner).__name__} still on the meta device. Allocate it "
            "first: model = parallelize(model, 'fsdp') (only this rank's shards), then "
            "load_pretrained(model, path)."
        )
    source = _source(func, root)
    matches, missing, unexpected = _plan(
        func, inner, source, strict=strict, dtype=dtype, prefix=prefix
    )
    if source.kind == "dcp":
        _load_dcp(source, matches)
        return PretrainedLoad(missing, unexpected, None)
    reader = SliceReader()
    try:
        with torch.no_grad():
            for m in matches:
                data = reader.read(source.entries[m.key], local_region(m.tensor))
                local_part(m.tensor).copy_(data)
    finally:
        reader.close()
    return PretrainedLoad(missing, unexpected, reader.bytes_read)


def _load_dcp(source: _Source, matches: list[_Match]) -> None:
    import torch.distributed as dist

    from ..checkpoint._safe_dcp import dcp_load

    state: dict[str, Any] = {m.key: m.tensor.detach() for m in matches}
    distributed = dist.is_available() and dist.is_initialized()
    with torch.no_grad():
        dcp_load(state, source.root, distributed=distributed)


# --------------------------------------------------------------------------- saving


def _shard_files(
    sizes: list[tuple[str, int]], max_bytes: int
) -> list[list[str]]:  # pragma: no branch
    files: list[list[str]] = [[]]
    total = 0
    for name, n in sizes:
        if files[-1] and total + n > max_bytes:
            files.append([])
            total = 0
        files[-1].append(name)
        total += n
    return files


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``model``'s weights as safetensors, one full tensor at a time.

    >>> import tempfile, torch, cudakit.parallel as cp
    >>> files = cp.save_pretrained(torch.nn.Linear(3, 2), tempfile.mkdtemp())
    >>> [f.name for f in files]
    ['model.safetensors']

    Hugging Face's layout: ``model.safetensors``, or past ``max_shard_size`` bytes
    ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``.
    The files load with ``safetensors.torch.load_file`` (so ``from_pretrained``) and
    with :func:`load_pretrained`. For a sharded model this is a collective: each
    tensor is gathered in turn and rank 0 writes it, so a rank holds its shards plus
    one full tensor. Tied weights are written once, under their first name.
    Non-persistent buffers are not written.

    Args:
        model: the model, wrapped or not.
        path: the folder to write (made if missing); files of the same names are
            replaced.
        max_shard_size: the most bytes of tensors in one file.
        dtype: cast floating-point tensors to this dtype (None: as they are).

    Returns:
        The files written (on every rank).

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: a model on the meta device, a ``max_shard_size`` below 1.

    .. versionadded:: 0.1
    """
    import torch.distributed as dist

    func = "save_pretrained"
    inner, root = _check_common(func, model, path)
    max_bytes = check_int(func, "max_shard_size", max_shard_size, minimum=1)
    check_optional(
        check_type, func, "dtype", dtype, types=torch.dtype, expected="a torch.dtype or None",
        fix="For example: dtype=torch.bfloat16.",
    )  # fmt: skip
    if dtype is not None and dtype not in DTYPES.values():
        raise ValueError(f"{func}(dtype={dtype}): safetensors cannot hold it. Pass dtype=None.")
    if check_all_meta(func, inner):
        raise ValueError(
            f"{func}() got a {type(inner).__name__} on the meta device: it holds no values. "
            "Allocate and initialise it first (parallelize() does)."
        )
    distributed = dist.is_available() and dist.is_initialized()
    writes = not distributed or dist.get_rank() == 0
    tensors = {first: names[0][1] for first, names in _model_tensors(inner).items()}

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    sizes = [(k, t.numel() * out_dtype(t).itemsize) for k, t in tensors.items()]
    groups = _shard_files(sizes, max_bytes)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = [root / name for name in names]
    if writes:
        root.mkdir(parents=True, exist_ok=True)
    for file, keys in zip(files, groups, strict=True):
        layout = {k: (out_dtype(tensors[k]), tuple(tensors[k].shape)) for k in keys}
        writer = FileWriter(file, layout) if writes else None
        try:
            for k in keys:
                t = tensors[k]
                full = t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]
                if writer is not None:
                    writer.write(full.to(out_dtype(t)))
                del full
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.close()
    if writes and n > 1:
        total = sum(size for _, size in sizes)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f.name for f, keys in zip(files, groups, strict=True) for k in keys},
        }
        (root / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    if distributed:
        dist.barrier()
    return files
