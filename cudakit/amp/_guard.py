"""The non-finite guard: one fused check for inf/NaN, and one verdict for every rank.

:class:`NonFiniteGuard` owns small persistent flag tensors (one per device). A check
runs ``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of one (values
unchanged) over the window's losses and the gradients: the cheapest exact full pass
torch offers, and one that cannot overflow the way a norm can. Sharded gradients
(FSDP2's ``DTensor``) are checked through their local shards, and the verdict is
combined across ranks (an all-reduce with ``MAX``), so a NaN on one rank makes every
rank skip.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .._dist import group_world_size

__all__ = ["NonFiniteGuard", "VerdictMailbox", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class NonFiniteGuard:
    """Persistent per-device flags, the fused check, and the verdict across ranks."""

    def __init__(self) -> None:
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._primary: tuple[torch.Tensor, torch.Tensor] | None = None  # (flag, one)
        self._world: int | None = None

    @property
    def world(self) -> int:
        """Ranks in the default process group, read once at the first verdict."""
        if self._world is None:
            self._world = group_world_size()
        return self._world

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one

    def _flag(self, device: torch.device) -> torch.Tensor:
        # Zero between checks (re-zeroed only after a hit): no fill kernel on the hot path.
        flag = self._flags.get(device)
        if flag is None:
            flag = self._flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag

    def primary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (flag, one) pair of the step's main device, made once."""
        if self._primary is None:
            self._primary = (self._flag(device), self._one(device))
        return self._primary

    def check(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """A 1-element float tensor, > 0 iff a tensor holds an inf/NaN; None for no tensors."""
        if not tensors:
            return None
        primary = self._primary or self.primary(local(tensors[0]).device)
        # Gradients come last: under FSDP2 they are DTensors, which must not reach the
        # fused kernel (DTensor dispatch warns, then fails).
        if type(tensors[-1]) is torch.Tensor:
            try:  # fast path: one device, dense plain tensors (mixed dtypes are fine)
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, *primary)
                return primary[0]
            except (RuntimeError, AttributeError, TypeError):
                pass  # several devices, sparse gradients, a DTensor among them: group
        # DTensors are checked through their local shards, complex tensors as real pairs.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            t = local(t)
            if t.is_sparse:
                t = t.coalesce()._values()
            if t.is_complex():  # the kernel takes real dtypes: check both parts
                t = torch.view_as_real(t.resolve_conj())  # (autograd may leave a conj view)
            groups.setdefault((t.device, t.dtype), []).append(t)
        per_device: dict[torch.device, torch.Tensor] = {}
        for (device, _), group in groups.items():
            flag = per_device[device] = self._flag(device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, self._one(device))
        found: torch.Tensor | None = None
        for flag in per_device.values():
            found = flag if found is None else found + flag.to(found.device)
        return found

    @staticmethod
    def read(verdict: torch.Tensor) -> bool:
        """Whether ``verdict`` (a 1-element tensor) found an inf/NaN: ``.item()``, which waits."""
        return bool(verdict.item())

    @staticmethod
    def read_memory(verdict: torch.Tensor) -> bool:
        """:meth:`read` for a CPU verdict, straight from its memory: no torch op at all.

        On the CPU every op has finished when it returns, so nothing is waited for; the
        sync-free step reads its verdict this way there. Other tensors (and any while
        dynamo traces) fall back to :meth:`read`.
        """
        if (
            type(verdict) is torch.Tensor
            and verdict.is_cpu
            and verdict.dtype == torch.float32
            and not torch.compiler.is_compiling()
        ):
            return ctypes.c_float.from_address(verdict.data_ptr()).value != 0
        return bool(verdict.item())

    def reset(self) -> None:
        """Zero the flags after a hit (or a check that raised), ready for the next check."""
        for flag in self._flags.values():
            flag.zero_()

    def combine(
        self,
        found: torch.Tensor | None,
        scaler_found: list[dict[torch.device, torch.Tensor]] | None = None,
        ride: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One verdict tensor, > 0 iff any rank saw an inf/NaN; and ``ride`` summed over ranks.

        ``found`` plus the scaler's per-optimizer flags, MAX over ranks: under
        ``torch.distributed`` the all-reduce runs here; the scaler's flags are
        overwritten with the combined verdict, so every rank's scaler backs off (or
        not) together and every optimizer of the step skips (or not) together.

        ``ride`` (a 0-dim float32 tensor: a rank's share of the loss a spike rule
        watches) travels in the same all-reduce, which then sums: the verdict comes back
        as the number of ranks that saw a non-finite value (clamped to 1 for the
        optimizers), ``ride`` as its sum over ranks. One collective either way.
        """
        if scaler_found:
            flags = [f for per_opt in scaler_found for f in per_opt.values()]
            for flag in flags:
                found = flag.clone() if found is None else found + flag.to(found.device)
        else:
            flags = []
        if found is None:
            if ride is None:
                return None, None
            found = torch.zeros(1, dtype=torch.float32, device=ride.device)
        if self.world > 1:
            if ride is None:
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            else:
                packed = torch.cat([found.reshape(1), ride.to(found.device).reshape(1)])
                torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM)
                found, ride = packed[:1].clamp(max=1), packed[1]
        # The scaler then steps (or not) on the whole verdict: losses, optimizers, ranks.
        for flag in flags:
            flag.copy_(found.reshape(flag.shape).clamp(max=1).to(flag.device))
        return found, ride


class VerdictMailbox:
    """Verdict tensors posted by sync-free steps, read back on the host later.

    A post enqueues a copy of the verdict (and of what a spike rule watches, riding
    with it) into a small host buffer (pinned, with a CUDA event, on a GPU), so nothing
    waits. :meth:`drain` reads the posted values in order: after the event (already
    passed one step later) and straight from the host buffer's memory, so the read
    itself launches nothing and syncs nothing more.
    """

    def __init__(self) -> None:
        self._posted: list[tuple[torch.Tensor, Any, Any]] = []
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}

    def __len__(self) -> int:
        return len(self._posted)

    def __getstate__(self) -> dict[str, Any]:
        # The ctypes cells read the host buffers' memory; a copy (or a pickle) gets
        # them by value, no longer aimed at its own buffers: it makes its own cells,
        # and new buffers when it next posts.
        posted = [(host, event) for host, event, _ in self._posted]
        return {"posted": posted}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._free = {}
        self._posted = []
        for host, event in state["posted"]:
            n = host.numel()
            kind = ctypes.c_float if n == 1 else ctypes.c_float * n
            self._posted.append((host, event, kind.from_address(host.data_ptr())))

    def post(self, values: torch.Tensor) -> None:
        """Enqueue the device-to-host copy of a float32 verdict (its first value) and extras."""
        n = values.numel()
        free = self._free.get(n)
        if free:
            host, cells = free.pop()
        else:
            pin = values.device.type == "cuda"
            host = torch.empty(n, dtype=torch.float32, pin_memory=pin)
            kind = ctypes.c_float if n == 1 else ctypes.c_float * n
            cells = kind.from_address(host.data_ptr())
        event: Any = None
        if values.device.type == "cuda":
            host.copy_(values.reshape(n), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # the CPU (already in order), or another accelerator (a plain copy)
            host.copy_(values.reshape(n))
        self._posted.append((host, event, cells))

    def drain(self) -> list[bool]:
        """True for each posted verdict that found an inf/NaN, oldest first; empties it."""
        return [values[0] > 0 for values in self.drain_values()]

    def drain_values(self) -> list[tuple[float, ...]]:
        """The posted values, oldest first (``[0] > 0``: an inf/NaN was found); empties it."""
        out: list[tuple[float, ...]] = []
        for host, event, cells in self._posted:
            # One window later the copy has long landed: query() says so without a wait
            # (and without anything torch's sync debug mode would flag).
            if event is not None and not event.query():
                event.synchronize()
            one = isinstance(cells, ctypes.c_float)
            out.append((cells.value,) if one else tuple(cells))
            self._free.setdefault(1 if one else len(cells), []).append((host, cells))
        self._posted.clear()
        return out

    def clear(self) -> None:
        """Forget posted verdicts (their windows were rolled back)."""
        for host, _, cells in self._posted:
            n = 1 if isinstance(cells, ctypes.c_float) else len(cells)
            self._free.setdefault(n, []).append((host, cells))
        self._posted.clear()
