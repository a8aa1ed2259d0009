"""The parameters a step trains: each once, their gradients, and clipping their norm."""

from __future__ import annotations

from typing import cast

import torch

from ._guard import local

__all__ = ["StepParams"]


class StepParams:
    """The parameters of a step's optimizers, in the optimizers' order."""

    __slots__ = ("_clip_key", "_clip_order", "_model", "_single", "max_grad_norm", "optimizers")

    def __init__(
        self,
        optimizers: tuple[torch.optim.Optimizer, ...],
        max_grad_norm: float | None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.optimizers = optimizers
        #: The clipping threshold (None: no clipping).
        self.max_grad_norm = max_grad_norm
        self._single = optimizers[0] if len(optimizers) == 1 else None
        self._model = model
        # The model's order of the trained parameters, kept while they stay the same
        # (walking the model's modules every step costs tens of microseconds).
        self._clip_key: tuple[int, ...] = ()
        self._clip_order: list[torch.Tensor] = []

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

    def clipped(self) -> list[torch.Tensor]:
        """:meth:`params` in the order their norm is summed: the model's, when there is one.

        The total norm's float sum depends on the order, and a hand-written loop clips
        ``model.parameters()`` whatever the optimizer's groups (decay / no-decay), so
        ``model=`` clips bit for bit as it does; parameters the model lacks come last.
        """
        params = self.params()
        if self._model is None:
            return params
        key = tuple(map(id, params))
        if key != self._clip_key:
            trained = {id(p): p for p in params}
            ordered = [p for p in self._model.parameters() if trained.pop(id(p), None) is not None]
            self._clip_key, self._clip_order = key, ordered + list(trained.values())
        return self._clip_order

    def clip(self) -> torch.Tensor:
        """Clip the total gradient norm of :meth:`clipped`; the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.clipped(), cast(float, self.max_grad_norm))
        return local(norm)
