"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

Client, Algorithm 1 (lines 8-13), control-variate update **option II**:

* each local step: ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)`` -- the stochastic
  gradient is corrected by ``c - c_i`` before the optimizer step
  (:meth:`Scaffold.before_step`);
* after ``K`` steps: ``c_i+ = c_i - c + (x - y_i) / (K eta_l)`` (Eq. option II),
  ``Delta c_i = c_i+ - c_i`` goes to the server with ``Delta y_i = y_i - x``,
  and the client keeps ``c_i <- c_i+`` (persisted in :meth:`state_dict`).

Server (Algorithm 1, lines 16-17), as pure functions here:
``x <- x + eta_g * mean_S(Delta y_i)`` (:func:`scaffold_server_model_update`) and
``c <- c + |S|/N * mean_S(Delta c_i)`` (:func:`scaffold_server_control_update`).

Conventions (documented choices, not in the paper):

* ``x``, ``c``, ``c_i`` cover the shared trainable parameters
  (:func:`~fedreid.fl.local.base.shared_parameters`); ``c`` and ``c_i`` start
  at zero (Algorithm 1 takes the initial ``c``, ``c_i`` as inputs; zero is the
  usual choice).
* ``K eta_l`` is taken as the sum of the learning rates actually used by the
  steps, per parameter (read from the optimizer's param groups in
  :meth:`Scaffold.after_step`). With one constant rate it is exactly ``K eta_l``;
  with the backbone/head groups at different rates, or a schedule, each
  parameter gets its own sum. Momentum and weight decay make ``(x - y_i)/(K eta_l)``
  an approximation of the mean corrected gradient, as in every SGD-momentum
  SCAFFOLD implementation.
* A parameter that received no gradient this step (unused in the forward)
  still gets the correction ``c - c_i`` as its gradient, as the update rule
  prescribes.

No official code was released by the authors; the widely used re-implementation
in the FedDyn repository (``alpemreacar/FedDyn``, ``utils_methods.py``
``train_SCAFFOLD``) scales ``c`` and ``Delta c`` by client size weights and
divides by the *initial* learning rate; those are not reproduced.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.local.base import (
    LocalObjective,
    ObjectiveError,
    cpu_clone,
    reference_point,
    shared_parameters,
)
from fedreid.fl.state import weighted_average

#: Key of the server control variate in the round payload.
CONTROL_KEY = "control"
#: Key of ``Delta c_i`` in the metadata returned by :meth:`Scaffold.end_round`.
DELTA_C_KEY = "scaffold_delta_c"


def option_ii_control(
    c_i: Mapping[str, Tensor],
    c: Mapping[str, Tensor],
    x: Mapping[str, Tensor],
    y: Mapping[str, Tensor],
    lr_sum: Mapping[str, float],
) -> "OrderedDict[str, Tensor]":
    """``c_i+ = c_i - c + (x - y) / (K eta_l)`` per name (option II), ``K eta_l`` = ``lr_sum[name]``.

    A parameter that never moved under a positive rate (``lr_sum == 0``) gets
    ``c_i - c`` (its step term is 0/0; no information).
    """
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name in x:
        base = c_i[name] - c[name]
        denom = float(lr_sum[name])
        out[name] = base + (x[name] - y[name]) / denom if denom > 0 else base
    return out


def scaffold_server_control_update(
    c: Optional[Mapping[str, Tensor]],
    delta_cs: Sequence[Mapping[str, Tensor]],
    num_clients: int,
) -> "OrderedDict[str, Tensor]":
    """``c + |S|/N * mean_S(Delta c_i)`` (Algorithm 1, line 17); ``c=None`` means zeros.

    ``delta_cs``: the sampled clients' ``Delta c_i`` (``|S|`` of them);
    ``num_clients``: ``N``, all clients of the federation.
    """
    if not delta_cs:
        raise ObjectiveError("scaffold: no client control deltas to aggregate")
    n = int(num_clients)
    if n < len(delta_cs):
        raise ObjectiveError(f"scaffold: num_clients={n} is smaller than the {len(delta_cs)} deltas received")
    mean = weighted_average(delta_cs, [1.0] * len(delta_cs))
    frac = len(delta_cs) / n
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for name, d in mean.items():
        prev = c[name].to(d) if c is not None and name in c else torch.zeros_like(d)
        out[name] = prev + frac * d
    return out


def scaffold_server_model_update(
    x: Mapping[str, Tensor],
    delta_ys: Sequence[Mapping[str, Tensor]],
    global_lr: float = 1.0,
) -> "OrderedDict[str, Tensor]":
    """``x + eta_g * mean_S(Delta y_i)`` (Algorithm 1, line 17) over the names of ``delta_ys``."""
    if not delta_ys:
        raise ObjectiveError("scaffold: no client model deltas to aggregate")
    mean = weighted_average(delta_ys, [1.0] * len(delta_ys))
    return OrderedDict((name, x[name].to(d) + float(global_lr) * d) for name, d in mean.items())


class Scaffold(LocalObjective):
    """SCAFFOLD client with option II control variates; client state ``c_i``."""

    name = "scaffold"

    def __init__(self) -> None:
        super().__init__()
        self.c_i: "OrderedDict[str, Tensor]" = OrderedDict()  # CPU, persisted
        self._params: dict[str, nn.Parameter] = {}
        self._x: dict[str, Tensor] = {}
        self._c: dict[str, Tensor] = {}
        self._ci: dict[str, Tensor] = {}
        self._correction: dict[str, Tensor] = {}
        self._lr_sum: dict[str, float] = {}

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._params = shared_parameters(model, global_state)
        self._x = reference_point(self._params, global_state)
        server_c = (payload or {}).get(CONTROL_KEY)
        self._c = OrderedDict()
        self._ci = OrderedDict()
        for name, p in self._params.items():
            self._c[name] = self._on(p, server_c.get(name) if server_c else None, f"server control {name}")
            self._ci[name] = self._on(p, self.c_i.get(name), f"client control {name}")
        # g - c_i + c: the correction is the same every step of the round
        self._correction = OrderedDict((n, self._c[n] - self._ci[n]) for n in self._params)
        self._lr_sum = {n: 0.0 for n in self._params}

    @staticmethod
    def _on(p: Tensor, value: Optional[Tensor], what: str) -> Tensor:
        if value is None:
            return torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
        if tuple(value.shape) != tuple(p.shape):
            raise ObjectiveError(f"scaffold: {what} has shape {tuple(value.shape)}, parameter has {tuple(p.shape)}")
        return value.detach().to(device=p.device, dtype=p.dtype, copy=True)

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``g <- g - c_i + c`` on every method parameter (unused ones get ``c - c_i``)."""
        self._check_in_round("before_step")
        with torch.no_grad():
            for name, p in self._params.items():
                if p.grad is None:
                    p.grad = self._correction[name].clone()
                else:
                    p.grad.add_(self._correction[name])

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Count the step and add each parameter's current learning rate to its ``K eta_l`` sum."""
        super().after_step(model, optimizer)
        lr_of = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        for name, p in self._params.items():
            self._lr_sum[name] += lr_of.get(id(p), 0.0)

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """``c_i+`` (option II), ``c_i <- c_i+``; returns ``{"scaffold_delta_c": Delta c_i}`` (CPU)."""
        self._check_in_round("end_round")
        if self.steps == 0:
            raise ObjectiveError("scaffold: end_round() after zero local steps; option II needs K >= 1")
        y = OrderedDict((n, p.detach()) for n, p in self._params.items())
        new_ci = option_ii_control(self._ci, self._c, self._x, y, self._lr_sum)
        delta = OrderedDict((n, new_ci[n] - self._ci[n]) for n in new_ci)
        self.c_i = cpu_clone(new_ci)
        self._params, self._x, self._c, self._ci, self._correction = {}, {}, {}, {}, {}
        meta = super().end_round(model)
        meta[DELTA_C_KEY] = cpu_clone(delta)
        return meta

    def state_dict(self) -> dict[str, Any]:
        return {"c_i": cpu_clone(self.c_i)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"c_i"}
        if unknown:
            raise ObjectiveError(f"scaffold: unknown state keys {sorted(unknown)}")
        self.c_i = cpu_clone(state.get("c_i", {}))


__all__ = [
    "CONTROL_KEY",
    "DELTA_C_KEY",
    "Scaffold",
    "option_ii_control",
    "scaffold_server_control_update",
    "scaffold_server_model_update",
]
