"""The parameters a step trains: each once, their gradients, and clipping their norm."""

from __future__ import annotations

from typing import cast

import torch

from .guard import local

__all__ = ["StepParams"]


class StepParams:
    """The parameters of a step's optimizers, in the optimizers' order."""

    __slots__ = ("_single", "max_grad_norm", "optimizers")

    def __init__(
        self, optimizers: tuple[torch.optim.Optimizer, ...], max_grad_norm: float | None
    ) -> None:
        self.optimizers = optimizers
        #: The clipping threshold (None: no clipping).
        self.max_grad_norm = max_grad_norm
        self._single = optimizers[0] if len(optimizers) == 1 else None

    def params(self) -> list[torch.Tensor]:
        """The parameters of every optimizer, each once, in the optimizers' order."""
        if self._single is not None:
            return [p for g in self._single.param_groups for p in g["params"]]
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        return list({id(p): p for p in params}.values())

    def grads(self) -> list[torch.Tensor]:
        """The gradients of :meth:`params` that exist."""
        if self._single is not None:
            return [
                p.grad for g in self._single.param_groups for p in g["params"] if p.grad is not None
            ]
        return [p.grad for p in self.params() if p.grad is not None]

    def clip(self) -> torch.Tensor:
        """Clip the total gradient norm of :meth:`params`; the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params(), cast(float, self.max_grad_norm))
        return local(norm)
