"""Device placement.

:func:`resolve_device` turns what the user wrote into a ``torch.device``;
:func:`on_device` moves anything a training loop holds (tensors, modules,
optimizers, nested containers) onto it.
"""

from .move import OnDeviceDecorator, on_device
from .register import register_container
from .resolve import DeviceLike, resolve_device

__all__ = [
    "DeviceLike",
    "OnDeviceDecorator",
    "on_device",
    "register_container",
    "resolve_device",
]
