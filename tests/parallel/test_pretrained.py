"""load_pretrained() and save_pretrained() on one process: files made here, no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from meta_gpt import GPT
from torch import nn

import cudakit.parallel as cp
from cudakit.parallel._safetensors import DTYPES, SliceReader, read_header, write_file

st_torch = pytest.importorskip("safetensors.torch")


def _gpt(seed: int = 0, **kw: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(**kw)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _hf_file(model: nn.Module, file: Path, **renames: str) -> dict[str, torch.Tensor]:
    """The model's weights as the safetensors package writes them (tied written once)."""
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    st_torch.save_file(sd, str(file))
    return sd


def test_save_pretrained_loads_with_the_package_bit_for_bit(tmp_path: Path) -> None:
    model = _gpt()
    (file,) = cp.save_pretrained(model, tmp_path)
    assert file == tmp_path / "model.safetensors"
    loaded = st_torch.load_file(str(file))
    sd = model.state_dict()
    assert set(loaded) == set(sd) - {"head.weight"}  # tied: written once
    for k, v in loaded.items():
        assert torch.equal(v, sd[k]), k


def test_a_file_of_the_package_loads_bit_for_bit(tmp_path: Path) -> None:
    src = _gpt(1)
    _hf_file(src, tmp_path / "w.safetensors")
    model = _gpt(2)
    res = cp.load_pretrained(model, tmp_path / "w.safetensors")
    assert res == cp.PretrainedLoad(
        [], [], sum(v.nbytes for v in src.state_dict().values()) - src.head.weight.nbytes
    )
    assert _same(model, src)
    assert model.head.weight is model.embed.weight


def test_sharded_files_with_an_index(tmp_path: Path) -> None:
    src = _gpt(3)
    files = cp.save_pretrained(src, tmp_path, max_shard_size=1000)
    assert len(files) > 2
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(src.state_dict()) - {"head.weight"}
    merged = {}
    for f in files:
        merged.update(st_torch.load_file(str(f)))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in merged.values())
    model = _gpt(4)
    cp.load_pretrained(model, tmp_path)
    assert _same(model, src)


def test_dtype_casts_and_the_dtype_asked_for(tmp_path: Path) -> None:
    src = _gpt(5)
    cp.save_pretrained(src, tmp_path, dtype=torch.bfloat16)
    assert all(
        v.dtype == torch.bfloat16
        for v in st_torch.load_file(str(tmp_path / "model.safetensors")).values()
    )
    model = _gpt(6)
    cp.load_pretrained(model, tmp_path, dtype=torch.bfloat16)
    assert torch.equal(model.embed.weight, src.embed.weight.to(torch.bfloat16).float())
    before = model.embed.weight.clone()
    with pytest.raises(
        ValueError, match=r"are not torch.float16 as asked \(dtype=\.\.\.\): 'embed"
    ):
        cp.load_pretrained(model, tmp_path, dtype=torch.float16)
    assert torch.equal(model.embed.weight, before)


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _gpt(7)


def test_prefixes_found_either_way_round(tmp_path: Path) -> None:
    src = _gpt(8)
    sd = {f"model.{k}": v for k, v in src.state_dict().items() if k != "head.weight"}
    sd["lm_extra.weight"] = torch.ones(2)  # outside the prefix: left alone
    st_torch.save_file(sd, str(tmp_path / "a.safetensors"))
    model = _gpt(9)
    assert cp.load_pretrained(model, tmp_path / "a.safetensors").unexpected_keys == []
    assert _same(model, src)
    wrapped = _Wrapper()  # the model's keys have `inner.`, the file's not
    cp.save_pretrained(src, tmp_path / "b")
    cp.load_pretrained(wrapped, tmp_path / "b")
    assert _same(wrapped.inner, src)
    other = _gpt(10)
    with pytest.raises(ValueError, match=r"none of the \d+ keys"):
        cp.load_pretrained(other, tmp_path / "a.safetensors", prefix="")


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path: Path) -> None:
    src = _gpt(11)
    sd = {k: v for k, v in src.state_dict().items() if k not in ("head.weight", "norm.bias")}
    sd["extra"] = torch.zeros(3)
    st_torch.save_file(sd, str(tmp_path / "w.safetensors"))
    model = _gpt(12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"missing from the file: 'norm.bias'; in the file but not in the model: 'extra'\)"
        r", so nothing was loaded",
    ):
        cp.load_pretrained(model, tmp_path / "w.safetensors")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    res = cp.load_pretrained(model, tmp_path / "w.safetensors", strict=False)
    assert (res.missing_keys, res.unexpected_keys) == (["norm.bias"], ["extra"])
    assert torch.equal(model.norm.bias, before["norm.bias"])
    assert torch.equal(model.embed.weight, src.embed.weight)
    wide = _gpt(13, width=12)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"'embed.weight': the file's \[37, 10\], the model's \[37, 12\]"
    ):
        cp.load_pretrained(wide, tmp_path / "w.safetensors", strict=False)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())


def test_a_file_of_another_model_is_refused(tmp_path: Path) -> None:
    st_torch.save_file({"conv.weight": torch.zeros(2, 2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=r"holds another model's weights"):
        cp.load_pretrained(_gpt(), tmp_path / "w.safetensors", strict=False)


def _with_header(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x01\x00", r"shorter than the 8-byte header length"),
        ((10**9).to_bytes(8, "little") + b"{}", r"a header of 1000000000 bytes"),
        ((4).to_bytes(8, "little") + b"{no}", r"the header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", r"a JSON list, not an object"),
        (
            _with_header(b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'),
            r"'a' of shape \[4\] \(F32\) claims bytes 0 to 16 of 0",
        ),
        ((25).to_bytes(8, "little") + b'{"a":{"dtype":"X","s":1}}', r"the entry of 'a' is"),
    ],
)
def test_a_corrupt_file_is_refused(tmp_path: Path, data: bytes, why: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(data)
    model = nn.Linear(2, 2)
    before = model.weight.clone()
    with pytest.raises(
        ValueError, match=rf"load_pretrained\(path=.*is not a valid safetensors file: .*{why}"
    ):
        cp.load_pretrained(model, tmp_path)
    assert torch.equal(model.weight, before)


def test_paths_and_models_that_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"the path does not exist\. Pass a \.safetensors"):
        cp.load_pretrained(nn.Linear(2, 2), tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"holds no weights cudakit can read"):
        cp.load_pretrained(nn.Linear(2, 2), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "x.safetensors"}}')
    with pytest.raises(
        FileNotFoundError, match=r"x.safetensors is named in model.safetensors.index.json"
    ):
        cp.load_pretrained(nn.Linear(2, 2), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"is not a safetensors index"):
        cp.load_pretrained(nn.Linear(2, 2), tmp_path)
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"still on the meta device.*parallelize"):
        cp.load_pretrained(meta, tmp_path)
    with pytest.raises(ValueError, match=r"save_pretrained\(\) got a Linear on the meta device"):
        cp.save_pretrained(meta, tmp_path)


def test_bad_arguments(tmp_path: Path) -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"load_pretrained\(model=\.\.\.\) expects an nn.Module"):
        cp.load_pretrained("net", tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_pretrained\(path=\.\.\.\) expects a path"):
        cp.load_pretrained(net, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_pretrained\(strict=\.\.\.\) expects True or False"):
        cp.load_pretrained(net, tmp_path, strict="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_pretrained\(dtype=\.\.\.\) expects a torch.dtype"):
        cp.load_pretrained(net, tmp_path, dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_pretrained\(prefix=\.\.\.\) expects a str"):
        cp.load_pretrained(net, tmp_path, prefix=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"save_pretrained\(max_shard_size=\.\.\.\) expects an int >= 1"
    ):
        cp.save_pretrained(net, tmp_path, max_shard_size=0)
    with pytest.raises(TypeError, match=r"save_pretrained\(path=\.\.\.\) expects a path"):
        cp.save_pretrained(net, None)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = _gpt(14)
    state = {f"model.model.{k}": v for k, v in src.state_dict().items()}
    state["optim.state.0.exp_avg"] = torch.zeros(3)
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    model = _gpt(15)
    res = cp.load_pretrained(model, tmp_path)
    assert res == cp.PretrainedLoad([], [], None)
    assert _same(model, src)
    # DCP's .metadata is a pickle: one naming anything else is refused, never run.
    meta = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")
    with pytest.raises(Exception, match=r"os.system"):
        cp.load_pretrained(model, tmp_path)
    (tmp_path / ".metadata").write_bytes(meta)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(_DTYPES),
    data=st.data(),
)
def test_slices_read_are_the_rows_asked_for(
    tmp_path_factory: pytest.TempPathFactory,
    shape: list[int],
    dtype: torch.dtype,
    data: st.DataObject,
) -> None:
    full = (torch.randn(shape) * 10).to(dtype)
    file = tmp_path_factory.mktemp("st") / "t.safetensors"
    write_file(file, {"t": full, "u": full.flatten()})
    assert torch.equal(st_torch.load_file(str(file))["t"], full)
    entry = read_header(file)["t"]
    reader = SliceReader()
    if shape:
        start = data.draw(st.integers(0, shape[0]))
        stop = data.draw(st.integers(start, shape[0]))
        region = (slice(start, stop), *(slice(0, n) for n in shape[1:]))
        got = reader.read(entry, region)
        assert torch.equal(got, full[start:stop])
        assert reader.bytes_read == full[start:stop].nbytes
    else:
        assert torch.equal(reader.read(entry, None), full)
    reader.close()
    assert set(DTYPES.values()) >= set(_DTYPES)
