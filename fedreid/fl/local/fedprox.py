"""FedProx's client objective (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Paper, Eq. (2) (the local subproblem of Algorithm 2)::

    min_w  h_k(w; w^t) = F_k(w) + mu/2 * ||w - w^t||^2

with ``F_k`` the local empirical loss (here: the batch's mean cross-entropy)
and ``w^t`` the global model received this round. The proximal term is a true
term of the loss, over every method parameter (the shared trainable
parameters, see :func:`fedreid.fl.local.base.shared_parameters`), so its
gradient is ``mu (w - w^t)``.

The official code (``litian96/FedProx``, TensorFlow) adds ``mu (w - w^t)`` to
the gradient inside its ``PerturbedGradientDescent`` optimizer instead of to
the loss; the gradient, hence training, is the same, only the logged loss
differs (ours includes the term). The paper tunes ``mu`` in
``{0.001, 0.01, 0.1, 1}``; the default here is 0.01.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

import torch
from torch import Tensor, nn

from fedreid.fl.local.base import (
    AnchoredObjective,
    check_positive,
    register_objective,
)


def proximal_term(params: Mapping[str, Tensor], reference: Mapping[str, Tensor], mu: float) -> Tensor:
    """``mu/2 * sum_names ||w - w_ref||^2`` (Eq. 2's proximal term); gradient ``mu (w - w_ref)``."""
    total: Optional[Tensor] = None
    for name, p in params.items():
        sq = (p - reference[name]).pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total


@dataclass
class FedProxOptions:
    """Options of ``train.objective: fedprox``."""

    #: Weight of the proximal term ``mu/2 ||w - w_global||^2`` (Li et al. 2020, Eq. 2).
    mu: float = 0.01


@register_objective
class FedProx(AnchoredObjective):
    """``CE + mu/2 ||w - w_global||^2`` over the shared trainable parameters."""

    name = "fedprox"
    Options: ClassVar[type] = FedProxOptions

    def __init__(self, mu: float = 0.01) -> None:
        super().__init__()
        self.mu = check_positive("fedprox mu", mu)

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        ce = super().loss(model, images, labels, logits, features)
        prox = proximal_term(self._params, self._ref, self.mu).to(ce.device)
        self.last_terms["prox"] = prox.detach()
        return ce + prox

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        self._params, self._ref = {}, {}
        return super().end_round(model)

    def __repr__(self) -> str:
        return f"FedProx(mu={self.mu})"


__all__ = ["FedProx", "proximal_term"]
