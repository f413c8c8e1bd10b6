"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021).

Paper, Algorithm 1. Client ``k`` in the active set ``P_t``:

* local objective (the ``argmin`` line)::

      theta_k^t = argmin_theta  L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2

  here ``L_k`` is the batch's mean cross-entropy, ``theta^{t-1}`` the received
  server model and ``g_k := grad L_k(theta_k^{t-1})`` the client state
  (zero before the client's first round);
* state update (next line)::

      grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})

Server (:func:`feddyn_server_update`)::

      h^t     = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
      theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

with ``m`` the number of all clients and ``h^0 = 0``.

Sign conventions checked against the official code (``alpemreacar/FedDyn``,
``utils_general.py`` ``train_feddyn_mdl`` and ``utils_methods.py``
``train_FedDyn``): the client stores ``hist_k = sum_rounds (theta_k - theta_server)``
(= ``-g_k / alpha_k``; "They are -nabla/alpha"), minimises
``CE + alpha_k <theta, -theta_server + hist_k>`` with SGD ``weight_decay = alpha_k + wd``
(the ``alpha_k/2 ||theta||^2`` half of the quadratic), i.e. exactly
``CE - <g_k, theta> + alpha_k/2 ||theta - theta_server||^2`` up to a constant; and
the server sets ``theta = mean_{P_t}(theta_k) + mean_{all k}(hist_k)``, which is
the paper's ``mean - h/alpha`` because ``h^t = -alpha mean_{all k}(hist_k)``. So
the signs agree. Differences of the official code, and how to get them here:

* **adaptive alpha**: the client uses ``alpha_k = alpha / w_k`` with
  ``w_k = n_k / mean_j n_j`` (``alpha_coef / weight_list[clnt]``). Pass
  ``client_weight=feddyn_official_client_weight(n_k, counts)``; the paper's
  (and the default) ``client_weight=1`` uses ``alpha``. The server update is
  the same either way (``hist_k`` does not depend on ``alpha_k``), so
  :func:`feddyn_server_update` takes the global ``alpha``.
* gradient-norm clipping at 10 (``max_norm``) in the local loop, and the
  server's plain (unweighted) mean over ``P_t`` (as the paper) -- the first is
  a training-loop option, not part of the objective.
* FedNTD's and FedLMD's official FedDyn (Lee-Gihun/FedNTD
  ``algorithms/feddyn/Server.py:_aggregation``) weighs the mean of the models
  by client size, ``theta^t = sum_k (n_k / n) theta_k - h^t / alpha``, with the
  same ``h`` update (an unweighted sum over ``P_t``): ``server_weighting: size``.
* only ``model.parameters()`` take part (buffers are averaged separately); the
  same here: the method parameters are the shared trainable parameters
  (:func:`~fedreid.fl.local.base.shared_parameters`).

The official example (``example_cifar_10.py``) uses ``alpha = 1e-2``, the default here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.local.base import (
    SERVER_WEIGHTINGS,
    AnchoredObjective,
    ObjectiveError,
    check_choice,
    check_positive,
    cpu_clone,
    mean_weights,
    register_objective,
)
from fedreid.fl.state import weighted_average


def feddyn_official_client_weight(num_samples: int, all_counts: Sequence[int]) -> float:
    """The official code's ``weight_list[k] = n_k / sum(n) * N`` (= ``n_k / mean(n)``); ``alpha_k = alpha / it``."""
    counts = [float(c) for c in all_counts]
    if not counts or sum(counts) <= 0:
        raise ObjectiveError("feddyn: client sample counts must be non-empty with a positive sum")
    return float(num_samples) / (sum(counts) / len(counts))


def feddyn_terms(
    params: Mapping[str, Tensor],
    reference: Mapping[str, Tensor],
    grad_state: Mapping[str, Tensor],
    alpha: float,
) -> tuple[Tensor, Tensor]:
    """``(-sum <g_k, theta>, alpha/2 sum ||theta - theta^{t-1}||^2)`` -- the two FedDyn terms."""
    linear: Optional[Tensor] = None
    quad: Optional[Tensor] = None
    for name, p in params.items():
        lin = -(grad_state[name] * p).sum()
        sq = (p - reference[name]).pow(2).sum()
        linear = lin if linear is None else linear + lin
        quad = sq if quad is None else quad + sq
    if linear is None or quad is None:
        return torch.zeros(()), torch.zeros(())
    return linear, 0.5 * alpha * quad


def feddyn_client_state_update(
    grad_state: Mapping[str, Tensor],
    theta_k: Mapping[str, Tensor],
    theta_server: Mapping[str, Tensor],
    alpha: float,
) -> "OrderedDict[str, Tensor]":
    """``g_k <- g_k - alpha (theta_k^t - theta^{t-1})`` (Algorithm 1)."""
    return OrderedDict(
        (n, grad_state[n] - alpha * (theta_k[n].to(grad_state[n]) - theta_server[n].to(grad_state[n])))
        for n in grad_state
    )


def feddyn_server_update(
    theta_prev: Mapping[str, Tensor],
    client_thetas: Sequence[Mapping[str, Tensor]],
    h: Optional[Mapping[str, Tensor]],
    alpha: float,
    num_clients: int,
    weights: Optional[Sequence[float]] = None,
) -> tuple["OrderedDict[str, Tensor]", "OrderedDict[str, Tensor]"]:
    """``(theta^t, h^t)`` from Algorithm 1's server step; ``h=None`` means ``h^{t-1} = 0``.

    ``client_thetas``: the active clients' trained parameters (``|P_t|`` of
    them, the names of ``theta_prev``; pass parameters only -- buffers are
    aggregated as usual); ``num_clients``: ``m``, all clients. ``weights``
    (one per client, normalised here) replace the plain mean in
    ``theta^t = sum_k p_k theta_k - h^t / alpha``; ``h^t`` keeps the plain
    ``(1/m) sum`` either way, as the official code (module docstring).
    """
    a = check_positive("feddyn alpha", alpha, allow_zero=False)
    if not client_thetas:
        raise ObjectiveError("feddyn: no client models to aggregate")
    m = int(num_clients)
    if m < len(client_thetas):
        raise ObjectiveError(f"feddyn: num_clients={m} is smaller than the {len(client_thetas)} models received")
    names = list(theta_prev)
    thetas = [OrderedDict((n, t[n]) for n in names) for t in client_thetas]
    mean = weighted_average(thetas, [1.0] * len(thetas))
    models = mean if weights is None else weighted_average(
        thetas, mean_weights(weights, len(thetas), "feddyn server mean"))
    frac = len(client_thetas) / m  # (1/m) sum = (|P_t|/m) mean
    new_h: "OrderedDict[str, Tensor]" = OrderedDict()
    new_theta: "OrderedDict[str, Tensor]" = OrderedDict()
    for n in names:
        prev = theta_prev[n].to(mean[n])
        h_prev = h[n].to(mean[n]) if h is not None and n in h else torch.zeros_like(mean[n])
        new_h[n] = h_prev - a * frac * (mean[n] - prev)
        new_theta[n] = models[n] - new_h[n] / a
    return new_theta, new_h


@dataclass
class FedDynOptions:
    """Options of ``train.objective: feddyn``; the server uses the same ``alpha``."""

    #: The regulariser weight alpha (Acar et al. 2021, Algorithm 1).
    alpha: float = 0.01
    #: Client weight ``w_k``: a client's term uses ``alpha / w_k`` (1 for the paper's equal weights).
    client_weight: float = 1.0
    #: The server's mean of the client models in ``theta^t = sum_k p_k theta_k - h / alpha``:
    #: ``uniform`` (``p_k = 1/|P_t|``, Algorithm 1) or ``size`` (``p_k = n_k / n``, FedNTD's and
    #: FedLMD's official ``feddyn/Server.py:_aggregation``). ``h`` is the same either way.
    server_weighting: Literal["uniform", "size"] = "uniform"


@register_objective
class FedDyn(AnchoredObjective):
    """``CE - <g_k, theta> + alpha_k/2 ||theta - theta^{t-1}||^2``; client state ``g_k``.

    ``client_weight``: ``alpha_k = alpha / client_weight`` (1 = the paper; see
    :func:`feddyn_official_client_weight` for the official adaptive alpha).
    """

    name = "feddyn"
    Options: ClassVar[type] = FedDynOptions
    server_hook: ClassVar[Optional[str]] = "feddyn"

    def __init__(self, alpha: float = 0.01, *, client_weight: float = 1.0, server_weighting: str = "uniform") -> None:
        super().__init__()
        #: read by the server half (:class:`~fedreid.fl.server_hooks.objectives.FedDynHook`), not here
        self.server_weighting = check_choice("feddyn server_weighting", server_weighting, SERVER_WEIGHTINGS)
        self.alpha = check_positive("feddyn alpha", alpha, allow_zero=False)
        self.client_weight = check_positive("feddyn client_weight", client_weight, allow_zero=False)
        self.grad: "OrderedDict[str, Tensor]" = OrderedDict()  # g_k on CPU, persisted
        self._g: dict[str, Tensor] = {}

    @property
    def alpha_k(self) -> float:
        return self.alpha / self.client_weight

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._g = OrderedDict()
        for name, p in self._params.items():
            g = self.grad.get(name)
            if g is not None and tuple(g.shape) != tuple(p.shape):
                raise ObjectiveError(f"feddyn: stored gradient {name} has shape {tuple(g.shape)}, parameter {tuple(p.shape)}")
            self._g[name] = torch.zeros_like(p).detach() if g is None else g.to(device=p.device, dtype=p.dtype)

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        ce = super().loss(model, images, labels, logits, features)
        linear, quad = feddyn_terms(self._params, self._ref, self._g, self.alpha_k)
        self.last_terms["linear"] = linear.detach()
        self.last_terms["quadratic"] = quad.detach()
        return ce + linear.to(ce.device) + quad.to(ce.device)

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        """``g_k <- g_k - alpha_k (theta_k^t - theta^{t-1})``; no metadata (the server needs ``theta_k`` only)."""
        self._check_in_round("end_round")
        theta = OrderedDict((n, p.detach()) for n, p in self._params.items())
        self.grad = cpu_clone(feddyn_client_state_update(self._g, theta, self._ref, self.alpha_k))
        self._params, self._ref, self._g = {}, {}, {}
        return super().end_round(model)

    def state_dict(self) -> dict[str, Any]:
        return {"grad": cpu_clone(self.grad)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"grad"}
        if unknown:
            raise ObjectiveError(f"feddyn: unknown state keys {sorted(unknown)}")
        self.grad = cpu_clone(state.get("grad", {}))

    def __repr__(self) -> str:
        return (f"FedDyn(alpha={self.alpha}, client_weight={self.client_weight}, "
                f"server_weighting={self.server_weighting!r})")


__all__ = [
    "FedDyn",
    "feddyn_client_state_update",
    "feddyn_official_client_weight",
    "feddyn_server_update",
    "feddyn_terms",
]
