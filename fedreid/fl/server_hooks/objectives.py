"""The server halves of SCAFFOLD and FedDyn, as server hooks.

Their client halves live in :mod:`fedreid.fl.local.scaffold` and
:mod:`fedreid.fl.local.feddyn`; the math of both halves is there too (pure
functions), these hooks only carry the server state across rounds and apply
it after the usual aggregation:

* :class:`ScaffoldHook` (Karimireddy et al., ICML 2020, Algorithm 1 lines
  16-17): sends the server control variate ``c`` to every sampled client; after
  the round, ``x <- x + eta_g * mean_S(y_i - x)`` and
  ``c <- c + |S|/N * mean_S(Delta c_i)``. The means are unweighted, as in the
  paper, unless the client option ``server_weighting: size`` weighs the
  models' by client size (FedNTD's official code); the parameters replace the
  average the server computed (``fl.weighting``), buffers (BatchNorm
  statistics) keep it. With the client option
  ``reference: average`` it also sends the parameters it aggregated last
  round, as they were before any ``after_aggregate`` hook (FedFTG) changed
  them (the official FedFTG code's ``prev_params``, see
  :mod:`fedreid.fl.local.scaffold`).
* :class:`FedDynHook` (Acar et al., ICLR 2021, Algorithm 1 server step):
  ``h <- h - alpha * (1/m) sum_k (theta_k - theta^{t-1})`` and
  ``theta^t = mean_k(theta_k) - h / alpha`` over the parameters (the mean
  size-weighted under ``server_weighting: size``); buffers keep the usual
  average.

Both act on the trainable parameters named in the global state (the shared
part: with FedPav the private identity heads stay out, as everywhere).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.aggregate import Aggregate, size_weights, uniform_weights
from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, SERVER_WEIGHTINGS, check_choice, cpu_clone
from fedreid.fl.local.feddyn import feddyn_server_update
from fedreid.fl.local.scaffold import (
    AVERAGE_KEY,
    CONTROL_KEY,
    DELTA_C_KEY,
    scaffold_server_control_update,
    scaffold_server_model_update,
)
from fedreid.fl.server_hooks.base import AggregationInput, HookContext, ServerHook, register_hook
from fedreid.fl.update import Update


def _parameter_names(model: nn.Module, state: Mapping[str, Tensor]) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad and name in state]


def _with_parameters(
    average: Mapping[str, Tensor], parameters: Mapping[str, Tensor]
) -> "OrderedDict[str, Tensor]":
    """``average`` with the entries of ``parameters`` replaced (cast to the average's dtype and device)."""
    return OrderedDict((k, parameters[k].to(v) if k in parameters else v) for k, v in average.items())


def _client_weights(updates: Sequence[Update], weighting: str) -> list[float]:
    """The normalised ``p_i`` of the server's model mean: ``n_i / n`` (``size``) or ``1 / |S|`` (``uniform``)."""
    return size_weights(updates) if weighting == "size" else uniform_weights(updates)


def _norm(tensors: Mapping[str, Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values()))) if tensors else 0.0


class _RoundStart(ServerHook):
    """Remembers the parameters the clients received this round (``x`` / ``theta^{t-1}``)."""

    def __init__(self) -> None:
        self._sent: "OrderedDict[str, Tensor]" = OrderedDict()

    def begin_round(self, round_index: int, global_state: Mapping[str, Tensor]) -> None:
        self._sent = OrderedDict((k, v.detach().clone()) for k, v in global_state.items())


@register_hook
class ScaffoldHook(_RoundStart):
    """SCAFFOLD's server: control variate ``c`` out, ``Delta c_i`` in (see the module docstring).

    Built with the ``scaffold`` client objective, whose ``server_weighting`` it
    follows; its step size ``eta_g`` is ``fl.server_lr``.
    """

    name = "scaffold"

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "ScaffoldHook":
        send_average = getattr(context.objective, "reference", "received") == "average"
        return cls(context.num_clients, global_lr=context.cfg.fl.server_lr, send_average=send_average,
                   weighting=getattr(context.objective, "server_weighting", "uniform"))

    def __init__(self, num_clients: int, *, global_lr: float = 1.0, send_average: bool = False,
                 weighting: str = "uniform") -> None:
        super().__init__()
        self.num_clients = int(num_clients)
        self.global_lr = float(global_lr)
        self.send_average = bool(send_average)
        self.weighting = check_choice("scaffold server_weighting", weighting, SERVER_WEIGHTINGS)
        self.control: "OrderedDict[str, Tensor]" = OrderedDict()
        #: the parameters aggregated last round, before after_aggregate hooks (``send_average`` only)
        self.average: "OrderedDict[str, Tensor]" = OrderedDict()

    def instructions(self, round_index: int) -> dict[str, Any]:
        payload: dict[str, Any] = {CONTROL_KEY: self.control}
        if self.send_average and self.average:
            payload[AVERAGE_KEY] = self.average
        return {OBJECTIVE_PAYLOAD: payload}

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s ``Delta c`` is unusable (missing, a parameter missing or reshaped), or None.

        Checked before aggregation (see :mod:`fedreid.fl.server_hooks`), so a
        bad client is left out of the round instead of stopping it here.
        """
        delta = update.metadata.get(DELTA_C_KEY)
        if not isinstance(delta, Mapping):
            return f"no {DELTA_C_KEY}" if delta is None else f"{DELTA_C_KEY} is not a dict of tensors"
        for name in _parameter_names(model, self._sent):
            value = delta.get(name)
            if not isinstance(value, Tensor):
                return f"{DELTA_C_KEY} has no tensor for {name}"
            if tuple(value.shape) != tuple(self._sent[name].shape):
                return f"{DELTA_C_KEY}[{name}] has shape {tuple(value.shape)}, expected {tuple(self._sent[name].shape)}"
        return None

    def aggregate(self, batch: AggregationInput) -> Aggregate:
        """``x + eta_g sum_i p_i (y_i - x)`` on the parameters, the server's average on the buffers; updates ``c``."""
        updates = batch.updates
        missing = [u.client for u in updates if DELTA_C_KEY not in u.metadata]
        if missing:
            raise ValueError(f"SCAFFOLD round {batch.round_index}: client {missing[0]!r} sent no {DELTA_C_KEY}")
        average = batch.average()
        names = [n for n in batch.parameters if n in self._sent]
        x = OrderedDict((n, self._sent[n]) for n in names)
        deltas = [OrderedDict((n, u.state[n].to(x[n]) - x[n]) for n in names) for u in updates]
        weights = _client_weights(updates, self.weighting)
        parameters = scaffold_server_model_update(x, deltas, self.global_lr,
                                                  None if self.weighting == "uniform" else weights)
        state = _with_parameters(average.state, parameters)
        if self.send_average:
            self.average = cpu_clone(parameters)
        self.control = cpu_clone(
            scaffold_server_control_update(self.control or None, [u.metadata[DELTA_C_KEY] for u in updates],
                                           self.num_clients)
        )
        return Aggregate(state, weights, self.weighting, [u.client for u in updates],
                         note=f"parameters: x + {self.global_lr:g} * {self.weighting}-weighted mean(y_i - x); "
                              f"buffers: {average.weighting} weights", stats={"control_norm": _norm(self.control)})

    def state_dict(self) -> dict[str, Any]:
        return {"control": cpu_clone(self.control), "average": cpu_clone(self.average)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.control = cpu_clone(state["control"])
        self.average = cpu_clone(state.get("average", {}))  # absent from checkpoints before the option


@register_hook
class FedDynHook(_RoundStart):
    """FedDyn's server: the state ``h`` and the corrected model (see the module docstring).

    Built with the ``feddyn`` client objective, whose ``alpha`` and ``server_weighting`` it shares.
    """

    name = "feddyn"

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "FedDynHook":
        alpha = getattr(context.objective, "alpha", None)
        if alpha is None:
            raise ValueError("the feddyn server hook runs with the feddyn client objective (train.objective=feddyn)")
        return cls(context.num_clients, alpha=float(alpha),
                   weighting=getattr(context.objective, "server_weighting", "uniform"))

    def __init__(self, num_clients: int, *, alpha: float = 0.01, weighting: str = "uniform") -> None:
        super().__init__()
        self.num_clients = int(num_clients)
        self.alpha = float(alpha)
        self.weighting = check_choice("feddyn server_weighting", weighting, SERVER_WEIGHTINGS)
        self.h: "OrderedDict[str, Tensor]" = OrderedDict()

    def aggregate(self, batch: AggregationInput) -> Aggregate:
        """``theta = sum_k p_k theta_k - h / alpha`` on the parameters, the server's average on the buffers."""
        average = batch.average()
        names = [n for n in batch.parameters if n in self._sent]
        theta_prev = OrderedDict((n, self._sent[n]) for n in names)
        thetas = [OrderedDict((n, u.state[n]) for n in names) for u in batch.updates]
        weights = _client_weights(batch.updates, self.weighting)
        theta, self.h = feddyn_server_update(theta_prev, thetas, self.h or None, self.alpha, self.num_clients,
                                             None if self.weighting == "uniform" else weights)
        self.h = cpu_clone(self.h)
        return Aggregate(_with_parameters(average.state, theta), weights, self.weighting,
                         [u.client for u in batch.updates],
                         note=f"parameters: {self.weighting}-weighted mean(theta_k) - h / alpha; "
                              f"buffers: {average.weighting} weights",
                         stats={"h_norm": _norm(self.h)})

    def state_dict(self) -> dict[str, Any]:
        return {"h": cpu_clone(self.h)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.h = cpu_clone(state["h"])


__all__ = ["FedDynHook", "ScaffoldHook"]
