"""resolve_device: every accepted spec and every error."""

from __future__ import annotations

import re

import pytest
import torch

from cudakit import DeviceError, resolve_device


def test_auto_and_none_pick_best_available() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device().type == expected
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("spec", ["cpu", "meta", torch.device("cpu"), torch.device("meta")])
def test_explicit_devices_pass_through(spec: str | torch.device) -> None:
    assert resolve_device(spec) == torch.device(spec)


@pytest.mark.parametrize(
    ("spec", "suggestion"),
    [
        ("gpu", "'cuda'"),
        ("GPU", "'cuda'"),
        ("cuda0", "'cuda:0'"),
        ("cdua", "'cuda'"),
        ("CPU", "'cpu'"),
    ],
)
def test_typos_suggest_the_right_spelling(spec: str, suggestion: str) -> None:
    with pytest.raises(DeviceError, match=f"unknown device '{spec}'; did you mean {suggestion}"):
        resolve_device(spec)


def test_negative_int_is_an_error() -> None:
    with pytest.raises(DeviceError, match="negative CUDA index"):
        resolve_device(-1)


@pytest.mark.parametrize("spec", [1.5, True, [0], object()])
def test_wrong_types(spec: object) -> None:
    with pytest.raises(TypeError, match="device must be a torch.device"):
        resolve_device(spec)  # type: ignore[arg-type]


def test_device_error_is_a_value_error() -> None:
    assert issubclass(DeviceError, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7", 0, 3, torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_clear_error(spec: object) -> None:
    with pytest.raises(DeviceError, match='CUDA is not available.*device="auto"'):
        resolve_device(spec)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the no-MPS error")
def test_mps_without_mps() -> None:
    with pytest.raises(DeviceError, match="MPS, which is not available"):
        resolve_device("mps")


def test_cuda_index_out_of_range_names_existing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(DeviceError, match=r"has 2 visible CUDA device\(s\): cuda:0, cuda:1"):
        resolve_device("cuda:7")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(1) == torch.device("cuda", 1)
    assert resolve_device(None) == torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_resolves_to_current_device() -> None:
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device(0) == torch.device("cuda", 0)


# -- device types torch can name but this build or machine cannot use (issue 15) -------

UNUSABLE = ["xla", "hpu", torch.device("xla")]
if not torch.xpu.is_available():
    UNUSABLE += ["xpu", "xpu:0"]


@pytest.mark.parametrize("spec", UNUSABLE, ids=str)
def test_unusable_device_types_are_refused_at_the_door(spec: str | torch.device) -> None:
    kind = str(spec).split(":")[0]
    with pytest.raises(
        DeviceError,
        match=rf"device={re.escape(repr(spec))} asks for a '{kind}' device, but this torch build "
        rf"\(torch .*\) or machine has none available\..* Use device=\"auto\" to pick the "
        r"best available device, or \"cpu\"\.",
    ):
        resolve_device(spec)


def test_xla_error_points_at_torch_xla() -> None:
    with pytest.raises(DeviceError, match="XLA devices come with the torch_xla package"):
        resolve_device("xla")


@pytest.mark.parametrize("spec", ["xla", "xpu"])
def test_on_device_refuses_unusable_devices_and_changes_nothing(spec: str) -> None:
    from cudakit import on_device

    t = torch.ones(2)
    model = torch.nn.Linear(2, 2)
    weight = model.weight
    batch = {"x": t, "m": model}
    with pytest.raises(
        DeviceError, match=rf"^on_device\(device='{spec}'\): asks for a '{spec}' device"
    ):
        on_device(batch, device=spec)
    assert batch == {"x": t, "m": model}
    assert t.device.type == "cpu"
    assert model.weight is weight
    assert weight.device.type == "cpu"


@pytest.mark.parametrize("spec", ["xla", "xpu"])
def test_on_device_decorator_refuses_unusable_devices_at_call_time(spec: str) -> None:
    from cudakit import on_device

    @on_device(spec)
    def f(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(DeviceError, match=rf"asks for a '{spec}' device"):
        f(torch.ones(1))


@pytest.mark.parametrize("spec", ["xla", "xpu"])
def test_loader_kwargs_and_prefetch_refuse_unusable_devices(spec: str) -> None:
    from cudakit.data import loader_kwargs, prefetch

    with pytest.raises(DeviceError, match=rf"^loader_kwargs\(device='{spec}'\): asks for a"):
        loader_kwargs(spec)
    source = [torch.ones(1)]
    with pytest.raises(DeviceError, match=rf"^prefetch\(device='{spec}'\): asks for a"):
        prefetch(source, device=spec)
    assert source[0].device.type == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"num_workers": "2"},
            TypeError,
            r"loader_kwargs\(num_workers=\.\.\.\) expects an int >= 0, got str '2'\. Leave it out "
            r"to let cudakit choose, or pass 0",
        ),
        (
            {"pin_memory": "no"},
            TypeError,
            r"loader_kwargs\(pin_memory=\.\.\.\) expects True, False or None \(let cudakit "
            r"choose\), got str 'no'\.",
        ),
    ],
)
def test_loader_kwargs_checks_overrides_before_the_device(
    kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    from cudakit.data import loader_kwargs

    # A wrong override is reported even when the device is unusable too: checks first.
    with pytest.raises(exc, match=match):
        loader_kwargs("xla", **kwargs)  # type: ignore[arg-type]


def test_on_device_non_blocking_message_names_function_argument_and_fix() -> None:
    from cudakit import on_device

    t = torch.ones(1)
    with pytest.raises(
        TypeError,
        match=r"on_device\(non_blocking=\.\.\.\) expects None \(async host-to-device copies, "
        r"synchronous to the CPU\), True or False, got int 1\. Leave it out unless",
    ):
        on_device(t, device="meta", non_blocking=1)  # type: ignore[call-overload]
    assert t.device.type == "cpu"


@pytest.mark.parametrize("epoch", ["1", 1.0, None])
def test_prefetch_set_epoch_wrong_kind_is_a_type_error(epoch: object) -> None:
    from cudakit.data import prefetch

    with pytest.raises(TypeError, match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got"):
        prefetch([torch.ones(1)], device="cpu").set_epoch(epoch)  # type: ignore[arg-type]


@pytest.mark.parametrize("func", ["on_device", "prefetch", "loader_kwargs", "decorator"])
def test_a_wrong_kind_of_device_names_the_function(func: str) -> None:
    from cudakit import loader_kwargs, on_device, prefetch

    calls = {
        "on_device": lambda: on_device(torch.ones(1), device=1.5),
        "prefetch": lambda: prefetch([torch.ones(1)], device=1.5),
        "loader_kwargs": lambda: loader_kwargs(1.5),
        "decorator": lambda: on_device(device=1.5),
    }
    name = "on_device" if func == "decorator" else func
    with pytest.raises(
        TypeError,
        match=rf"^{name}\(device=1\.5\): device must be a torch.device, a string such as "
        r"'cuda:0', an int CUDA index or None, got float 1.5\. Pass device='auto' to let "
        r"cudakit choose\.",
    ):
        calls[func]()


def test_prefetch_set_epoch_negative_is_a_value_error_and_changes_nothing() -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from cudakit.data import prefetch

    ds = TensorDataset(torch.arange(4))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    batches = prefetch(DataLoader(ds, sampler=sampler), device="cpu")
    with pytest.raises(
        ValueError,
        match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got int -1\. Epochs count "
        r"from 0",
    ):
        batches.set_epoch(-1)
    assert sampler.epoch == 0
