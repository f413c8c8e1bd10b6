"""FedNova: normalised averaging (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020, "Tackling the
objective inconsistency problem in heterogeneous federated optimization", Sec. 4-5).

Client ``i`` starts from ``x`` (``AggregationInput.global_state``), takes
``tau_i`` local optimizer steps (``Update.metadata["steps"]``, reported by
:meth:`fedreid.fl.client.Client.fit`) and returns ``y_i``. Its cumulative
update is ``x - y_i = eta G_i a_i`` (Eq. 5-6): a linear combination of its
``tau_i`` stochastic gradients with coefficients ``a_i``. FedNova divides
each client's update by ``||a_i||_1`` and rescales the average by an
effective number of steps (Eq. 7, Sec. 5)::

    d_i      = (x - y_i) / ||a_i||_1
    tau_eff  = sum_i p_i ||a_i||_1
    x_new    = x - eta_g tau_eff sum_i p_i d_i

with ``p_i = n_i / n`` over the round's accepted clients (``weighting:
size``, the paper's; ``uniform`` gives ``1 / |S_t|``) and ``eta_g`` =
``fl.server_lr`` (1, the paper's rule). ``||a_i||_1`` for the local solvers
here (:func:`local_norm`; the optimiser's momentum buffer starts at 0 every
round, :mod:`fedreid.fl.local.sgd`):

* plain SGD: ``a_i = [1, ..., 1]``, ``||a_i||_1 = tau_i``;
* heavy-ball momentum ``rho`` (Sec. 5, "momentum SGD"):
  ``a_{i,k} = (1 - rho^{tau_i - k}) / (1 - rho)``,
  ``||a_i||_1 = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)``;
* Nesterov momentum ``rho`` (PyTorch's ``SGD(nesterov=True)``: the step is
  ``g_k + rho v_k``), not in the paper: each gradient gets an extra ``1``
  at its own step, so ``a_{i,k} = 1 + rho (1 - rho^{tau_i - k}) / (1 - rho)``
  and ``||a_i||_1 = tau_i + rho * (the heavy-ball norm)``.

With equal ``tau_i`` every ``||a_i||_1`` is the same and ``x_new`` is the
weighted average (FedAvg) for any ``rho``.

What is not modelled. The learning rate is taken as constant within a round
(true unless ``train.local_epochs`` exceeds ``train.lr_step_size``); weight
decay and a client objective's extra loss terms count as part of the gradient,
as in the authors' code for weight decay -- FedProx's proximal term strictly
gives ``||a_i||_1 = (1 - (1 - eta mu)^tau_i) / (eta mu)`` (paper, Sec. 4),
which differs from ``tau_i`` by ``O(eta mu tau_i^2)``.

Buffers (BatchNorm statistics, counters) take the server's average
(``AggregationInput.average()``, ``fl.weighting``); only the trainable
parameters of the global state take the FedNova step. Arithmetic is in
float64, cast back to each parameter's dtype. FedNova keeps no state between
rounds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from numbers import Real
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.aggregate import Aggregate, size_weights, uniform_weights
from fedreid.fl.local.base import normalised_steps
from fedreid.fl.server_hooks.base import AggregationInput, HookContext, ServerHook, register_hook
from fedreid.fl.update import Update
from fedreid.options import ConfigError

#: Update metadata key: the client's local optimizer steps this round (``tau_i``).
STEPS_KEY = "steps"


@dataclass
class FedNovaOptions:
    """Options of the ``fednova`` server hook (``fl.hooks: [{name: fednova, ...}]``)."""

    #: Momentum ``rho`` of the clients' local SGD, which sets ``||a_i||_1``; null takes
    #: ``train.momentum`` (what the clients use). ``0 <= rho < 1``.
    momentum: Optional[float] = None
    #: Whether that momentum is Nesterov's (``||a_i||_1 = tau_i + rho * heavy-ball norm``);
    #: null takes ``train.nesterov`` (only with ``momentum > 0``).
    nesterov: Optional[bool] = None
    #: ``p_i``: ``size`` (``n_i / n``, the paper's) or ``uniform`` (``1 / |S_t|``).
    weighting: Literal["size", "uniform"] = "size"

    def validate(self, prefix: str) -> None:
        if self.momentum is not None and not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ConfigError(f"{prefix}.momentum: expected 0 <= momentum < 1 (or null for train.momentum), "
                              f"got {self.momentum}")


def local_norm(steps: int, momentum: float = 0.0, nesterov: bool = False) -> float:
    """``||a_i||_1`` of ``steps`` local SGD steps with ``momentum`` (module docstring; paper Sec. 5).

    ``steps`` must be a positive integer and ``0 <= momentum < 1``.
    """
    tau = int(steps)
    if tau != steps or tau <= 0:
        raise ValueError(f"FedNova: local steps must be a positive integer, got {steps!r}")
    rho = float(momentum)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"FedNova: momentum must satisfy 0 <= momentum < 1, got {momentum!r}")
    return normalised_steps(tau, rho, nesterov)


def fednova_step(
    x: Mapping[str, Tensor],
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    norms: Sequence[float],
    server_lr: float = 1.0,
) -> tuple["OrderedDict[str, Tensor]", float]:
    """``(x_new, tau_eff)``: ``x - server_lr * tau_eff * sum_i p_i (x - y_i) / ||a_i||_1`` in float64.

    ``weights`` are the normalised ``p_i``, ``norms`` the ``||a_i||_1``, both in
    the order of ``states``; the names are those of ``x``.
    """
    if not (len(states) == len(weights) == len(norms)) or not states:
        raise ValueError(f"FedNova: {len(states)} states, {len(weights)} weights, {len(norms)} norms")
    tau_eff = math.fsum(p * a for p, a in zip(weights, norms))
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name, prev in x.items():
        x64 = prev.detach().to("cpu", torch.float64)
        acc = torch.zeros_like(x64)
        for p, a, st in zip(weights, norms, states):
            acc.add_(x64 - st[name].detach().to("cpu", torch.float64), alpha=float(p) / float(a))
        out[name] = x64 - (server_lr * tau_eff) * acc
    return out, tau_eff


@register_hook
class FedNovaHook(ServerHook):
    """FedNova's normalised averaging (see the module docstring); needs ``steps`` from every client."""

    name = "fednova"
    Options: ClassVar[type] = FedNovaOptions

    @classmethod
    def context_defaults(cls, context: HookContext) -> dict[str, Any]:
        """The clients' ``train.momentum`` and ``train.nesterov``."""
        train = context.cfg.train
        return {"momentum": float(train.momentum), "nesterov": bool(train.nesterov)}

    @classmethod
    def build(cls, options: FedNovaOptions, context: HookContext) -> "FedNovaHook":
        train = context.cfg.train
        momentum = float(train.momentum) if options.momentum is None else options.momentum
        nesterov = bool(train.nesterov) if options.nesterov is None else options.nesterov
        return cls(momentum=momentum, nesterov=nesterov, weighting=options.weighting,
                   server_lr=float(context.cfg.fl.server_lr))

    def __init__(
        self,
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        weighting: str = "size",
        server_lr: float = 1.0,
    ) -> None:
        FedNovaOptions(momentum, nesterov, weighting).validate("fednova")  # type: ignore[arg-type]
        if weighting not in ("size", "uniform"):
            raise ValueError(f"FedNova: weighting must be 'size' or 'uniform', got {weighting!r}")
        if not (math.isfinite(server_lr) and server_lr > 0):
            raise ValueError(f"FedNova: server_lr must be a finite positive number, got {server_lr!r}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov) and self.momentum > 0
        self.weighting = weighting
        self.server_lr = float(server_lr)

    def required_metadata(self, round_index: int) -> tuple[str, ...]:
        return (STEPS_KEY,)

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s ``steps`` cannot be ``tau_i`` (not a positive finite integer), or None."""
        steps = update.metadata.get(STEPS_KEY)
        if isinstance(steps, Tensor) and steps.numel() == 1:
            steps = steps.item()
        if isinstance(steps, bool) or not isinstance(steps, Real):
            return f"{STEPS_KEY} is not a number ({steps!r})"
        if not math.isfinite(float(steps)) or float(steps) <= 0 or float(steps) != int(steps):
            return f"{STEPS_KEY} must be a positive whole number, got {steps!r}"
        return None

    def norm(self, steps: Any) -> float:
        """``||a_i||_1`` of a client that took ``steps`` local steps."""
        if isinstance(steps, Tensor):
            steps = steps.item()
        return local_norm(int(steps), self.momentum, self.nesterov)

    def aggregate(self, batch: AggregationInput) -> Aggregate:
        """``x - eta_g tau_eff sum_i p_i d_i`` on the parameters, the server's average on the buffers."""
        updates = batch.updates
        missing = [u.client for u in updates if STEPS_KEY not in u.metadata]
        if missing:
            raise ValueError(f"FedNova round {batch.round_index}: client {missing[0]!r} sent no {STEPS_KEY}")
        average = batch.average()
        weights = size_weights(updates) if self.weighting == "size" else uniform_weights(updates)
        norms = [self.norm(u.metadata[STEPS_KEY]) for u in updates]
        names = [n for n in batch.parameters if n in batch.global_state]
        x = OrderedDict((n, batch.global_state[n]) for n in names)
        x_new, tau_eff = fednova_step(x, [u.state for u in updates], weights, norms, self.server_lr)
        state = OrderedDict(
            (k, x_new[k].to(device=v.device, dtype=v.dtype) if k in x_new else v) for k, v in average.state.items()
        )
        steps = [float(u.metadata[STEPS_KEY]) for u in updates]
        return Aggregate(
            state, weights, self.weighting, [u.client for u in updates],
            note=f"parameters: x - {self.server_lr:g} * tau_eff * sum p_i (x - y_i) / ||a_i||_1 "
                 f"({self.weighting} p_i); buffers: {average.weighting} weights",
            stats={"tau_eff": tau_eff, "steps_min": min(steps), "steps_max": max(steps),
                   "norms": dict(zip([u.client for u in updates], norms))},
        )

    def __repr__(self) -> str:
        return (f"FedNovaHook(momentum={self.momentum:g}, nesterov={self.nesterov}, weighting={self.weighting!r}, "
                f"server_lr={self.server_lr:g})")


__all__ = ["STEPS_KEY", "FedNovaHook", "FedNovaOptions", "fednova_step", "local_norm"]
