"""FedCurv's client (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data",
NeurIPS 2019 workshop on federated learning, arXiv:1910.07796).

The paper's FedCurv loss of client ``s`` in round ``t`` (an EWC penalty
towards every other client's last local model)::

    L~_s(theta) = L_s(theta) + lambda * sum_{j != s} (theta - theta_j)^T diag(F_j) (theta - theta_j)

with ``theta_j`` client ``j``'s parameters at the end of its last local
training and ``F_j`` the diagonal of its empirical Fisher information there.
Expanded per parameter entry ``p`` (the paper's communication-efficient form)::

    sum_{j != s} F_{j,p} (theta_p - theta_{j,p})^2 = theta_p^2 U'_p - 2 theta_p V'_p + W'_p
    U' = U - F_s,   V' = V - F_s theta_s,   W' = W - sum_p F_{s,p} theta_{s,p}^2
    U  = sum_j F_j,  V  = sum_j F_j theta_j,  W  = sum_j sum_p F_{j,p} theta_{j,p}^2

``U``, ``V`` (per parameter) and ``W`` (one number per parameter tensor) are
what the server broadcasts (:class:`fedreid.fl.server_hooks.fedcurv.FedCurvHook`,
``instructions()[OBJECTIVE_PAYLOAD]``); ``W`` only shifts the loss by a
constant (no gradient) and is sent so that the logged ``fedcurv`` term is the
penalty itself. The gradient of the term is ``2 lambda (theta U' - V')``.

Own contribution. The sums run over ``j != s``. Every client is sent the same
sums over all clients (the server's instructions are the same for all
sampled clients), so each client keeps the ``(F_s, F_s theta_s, W_s)`` it
last sent in its objective state (:meth:`FedCurv.state_dict`) and subtracts
them itself, which is what the reference implementation does on the server
(``Lee-Gihun/FedNTD``, the code base of the FedLMD comparison,
``algorithms/fedcurv/Server.py``: ``Pt = Ut - u_k``, ``Qt = Vt - v_k``). A
client that has not contributed yet subtracts nothing. Should the server
leave a client's update out of a round (rejected, lost), that client has
already replaced its kept contribution while the server still holds the
previous one; the subtraction is then off by their difference until the
client's next accepted update (``U'`` is clamped at 0, so the penalty stays
a sum of non-negative quadratics up to the constant).

Which ``j``: the server keeps the latest contribution of every client that
has sent one (not only of this round's participants), as the reference
code's ``updated_local_uts`` dictionary. In the first round nothing has been
sent: no penalty.

Parameters: the penalty covers the method parameters, i.e. the model's
trainable parameters named in the received global state
(:func:`~fedreid.fl.local.base.shared_parameters`; buffers and a private
identity head have no global value and get none). The reference penalises
``model.parameters()``, which is the same set for a fully shared classifier.

The Fisher (the paper leaves the estimator open, so the reference code's is
the default). After local training (:meth:`FedCurv.end_round`), at the final
local parameters ``theta_s``, over ``m`` mini-batches::

    F_{s,p} = (1/m) sum_{b=1..m} ( d CE_b / d theta_p )^2

``CE_b`` is the batch-mean cross-entropy (negative log-likelihood of the true
labels: the empirical Fisher) of batch ``b`` under the final model, its
gradient taken with ``torch.autograd.grad`` (``.grad`` of the parameters is
not touched). Which batches, ``fisher_estimate``:

* ``official`` (default): the reference's ``ClientTrainer.upload_local_fisher``
  (``Lee-Gihun/FedNTD``, ``algorithms/fedcurv/ClientTrainer.py``): a fresh
  pass over the client's training loader (shuffled and augmented, seeded by
  the client's round seed), model in train mode (BatchNorm on batch
  statistics, dropout on, from a seeded generator), batches taken until more
  than ``fisher_samples`` images have been seen (the reference config's
  ``size: 500``: 11 batches of 50), or the whole loader if it holds fewer.
  The reference uploads the model before this pass, so the BatchNorm running
  statistics the pass moves are put back: the update is the trained model.
  The client hands the pass in (:attr:`LocalObjective.wants_training_pass`).
* ``last_batches``: the last ``fisher_batches`` batches local training saw
  (their images and labels are kept, not their graphs), model in eval mode
  (running statistics, no dropout): no extra pass over the data, and the
  estimate draws no random numbers.

Squared gradients are accumulated neither in ``before_step`` (that gradient
includes the penalty's and is taken at parameters that keep moving) nor in
``after_step``.

Which sums, ``penalty_sums``:

* ``paper`` (default): ``j != s`` as written, every sampled client gets the
  sums over all clients and subtracts its own.
* ``official``: the reference server subtracts in place (``Pt = Ut`` is an
  alias, then ``Pt -= u_k``, ``algorithms/fedcurv/Server.py:_clients_training``),
  so the sums a client gets also lack the terms of every client sampled
  before it in the round that had sent some. The server hook sends each such
  client its running sums (``ServerHook.client_instructions``, the round's
  sampling order), and the client subtracts its own as above: the same
  float operations in the same order as the reference.

Default ``lam = 1.0``: the reference config ``config/fedcurv.json``
(``{"size": 500, "lam": 1.0}``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.local.base import (
    AnchoredObjective,
    ObjectiveError,
    check_choice,
    check_positive,
    cpu_clone,
    register_objective,
)
from fedreid.options import ConfigError

#: Update metadata: the client's diagonal Fisher ``F_s`` per parameter name.
FISHER_KEY = "fedcurv_fisher"
#: Update metadata: ``F_s * theta_s`` per parameter name.
FISHER_THETA_KEY = "fedcurv_fisher_theta"
#: Update metadata: ``sum(F_s * theta_s^2)`` per parameter name (0-d tensors).
FISHER_THETA_SQ_KEY = "fedcurv_fisher_theta_sq"
#: The metadata keys of a FedCurv update, in the order above.
CONTRIBUTION_KEYS: tuple[str, ...] = (FISHER_KEY, FISHER_THETA_KEY, FISHER_THETA_SQ_KEY)
#: Payload keys (``begin_round(payload=...)``): the sums ``U``, ``V``, ``W`` over the clients.
U_KEY, V_KEY, W_KEY = "fisher_sum", "fisher_theta_sum", "fisher_theta_sq_sum"
#: Objective state keys of the client's own last contribution.
STATE_KEYS: tuple[str, ...] = ("fisher", "fisher_theta", "fisher_theta_sq")


def fedcurv_penalty(
    params: Mapping[str, Tensor],
    u: Mapping[str, Tensor],
    v: Mapping[str, Tensor],
    w: Mapping[str, Tensor],
    lam: float,
) -> Tensor:
    """``lam * sum_names sum(theta^2 U - 2 theta V) + lam * sum_names W`` over the names of ``u``.

    Equals ``lam * sum_j sum_p F_{j,p} (theta_p - theta_{j,p})^2`` when
    ``U = sum_j F_j``, ``V = sum_j F_j theta_j`` and ``W = sum_j sum_p F_j theta_j^2``
    (per name); its gradient is ``2 lam (theta U - V)``.
    """
    total: Optional[Tensor] = None
    for name, un in u.items():
        p = params[name]
        term = (p.pow(2) * un - 2.0 * p * v[name]).sum() + w[name]
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return float(lam) * total


def diagonal_fisher(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    train_mode: bool = False,
) -> "OrderedDict[str, Tensor]":
    """``(1/m) sum_b (d CE_b / d theta)^2`` per name over the ``m`` batches ``(images, labels)``.

    ``CE_b``: the batch-mean cross-entropy of ``model(images)``. Runs with
    gradients enabled in eval mode, or in train mode with ``train_mode``
    (the mode is restored after; BatchNorm statistics a train-mode pass moves
    are the caller's to keep or restore). Returns detached tensors on the
    parameters' devices. A parameter the loss does not reach gets 0.
    """
    batches = list(batches)
    if not batches:
        raise ObjectiveError("fedcurv: the Fisher needs at least one batch")
    names = list(params)
    tensors = [params[n] for n in names]
    if not tensors:
        return OrderedDict()
    sums = [torch.zeros_like(p, memory_format=torch.contiguous_format).detach() for p in tensors]
    was_training = model.training
    model.train(train_mode)
    try:
        with torch.enable_grad():
            for images, labels in batches:
                ce = F.cross_entropy(model(images), labels.long())
                grads = torch.autograd.grad(ce, tensors, allow_unused=True)
                for acc, g in zip(sums, grads):
                    if g is not None:
                        acc.add_(g.detach().pow(2))
    finally:
        model.train(was_training)
    return OrderedDict((n, s / len(batches)) for n, s in zip(names, sums))


def batches_past(batches: Iterable[tuple[Tensor, Tensor]], samples: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches of ``batches`` until more than ``samples`` images have been seen (the last one included).

    The reference's stopping rule (``upload_local_fisher``: append, then
    ``if samples_so_far > size: break``); all of them if they hold fewer.
    """
    seen = 0
    for images, labels in batches:
        yield images, labels
        seen += int(labels.shape[0])
        if seen > samples:
            return


#: ``fisher_estimate`` values (module docstring).
FISHER_ESTIMATES: tuple[str, ...] = ("official", "last_batches")
#: ``penalty_sums`` values (module docstring).
PENALTY_SUMS: tuple[str, ...] = ("paper", "official")


@dataclass
class FedCurvOptions:
    """Options of ``train.objective: fedcurv`` (its server half is the ``fedcurv`` hook)."""

    #: Weight lambda of the penalty ``sum_{j != s} (theta - theta_j)^T diag(F_j) (theta - theta_j)``
    #: (Shoham et al. 2019; reference config ``lam: 1.0``).
    lam: float = 1.0
    #: Which batches the diagonal empirical Fisher is averaged over, at the final local parameters:
    #: ``official`` (a fresh train-mode pass over the training loader until more than
    #: ``fisher_samples`` images, as FedNTD's ``upload_local_fisher``) or ``last_batches``
    #: (the last ``fisher_batches`` batches of local training, eval mode).
    fisher_estimate: str = "official"
    #: ``official`` only: the pass stops once more than this many images were seen
    #: (unset: 500, the reference config's ``size``).
    fisher_samples: Optional[int] = None
    #: ``last_batches`` only: how many of the round's last training batches (unset: 10).
    fisher_batches: Optional[int] = None
    #: The sums a client's penalty runs over: ``paper`` (every other client's last terms, ``j != s``)
    #: or ``official`` (FedNTD's server subtracts in place, so a client also lacks the terms of the
    #: clients sampled before it in the round).
    penalty_sums: str = "paper"

    def validate(self, prefix: str) -> None:
        if not float(self.lam) >= 0:
            raise ConfigError(f"{prefix}.lam: must be >= 0, got {self.lam!r}")
        if self.fisher_estimate not in FISHER_ESTIMATES:
            raise ConfigError(f"{prefix}.fisher_estimate: must be one of {', '.join(FISHER_ESTIMATES)}, "
                              f"got {self.fisher_estimate!r}")
        if self.penalty_sums not in PENALTY_SUMS:
            raise ConfigError(f"{prefix}.penalty_sums: must be one of {', '.join(PENALTY_SUMS)}, "
                              f"got {self.penalty_sums!r}")
        for key, applies in (("fisher_samples", "official"), ("fisher_batches", "last_batches")):
            value = getattr(self, key)
            if value is None:
                continue
            if self.fisher_estimate != applies:
                raise ConfigError(f"{prefix}.{key}: applies to fisher_estimate={applies} only, "
                                  f"not {self.fisher_estimate}")
            if int(value) < 1:
                raise ConfigError(f"{prefix}.{key}: must be >= 1, got {value!r}")


@register_objective
class FedCurv(AnchoredObjective):
    """``CE + lam * sum_{j != s} (theta - theta_j)^T diag(F_j) (theta - theta_j)`` (module docstring).

    Client state: its own last contribution ``(F_s, F_s theta_s, W_s)``, which it
    subtracts from the server's sums. :meth:`end_round` estimates ``F_s`` and
    returns the new contribution as update metadata.
    """

    name = "fedcurv"
    Options: ClassVar[type] = FedCurvOptions
    server_hook: ClassVar[Optional[str]] = "fedcurv"
    keeps_reference: ClassVar[bool] = False

    def __init__(self, lam: float = 1.0, fisher_estimate: str = "official", fisher_samples: Optional[int] = None,
                 fisher_batches: Optional[int] = None, penalty_sums: str = "paper") -> None:
        super().__init__()
        self.lam = check_positive("fedcurv lam", lam)
        self.fisher_estimate = check_choice("fedcurv fisher_estimate", fisher_estimate, FISHER_ESTIMATES)
        # the server's choice (the fedcurv hook sends the sums); kept so the options round-trip
        self.penalty_sums = check_choice("fedcurv penalty_sums", penalty_sums, PENALTY_SUMS)
        self.wants_training_pass = self.fisher_estimate == "official"
        for key, value, applies in (("fisher_samples", fisher_samples, "official"),
                                    ("fisher_batches", fisher_batches, "last_batches")):
            if value is not None and self.fisher_estimate != applies:
                raise ObjectiveError(f"fedcurv {key} applies to fisher_estimate={applies} only")
            if value is not None and int(value) < 1:
                raise ObjectiveError(f"fedcurv {key} must be >= 1, got {value!r}")
        self.fisher_samples = 500 if fisher_samples is None else int(fisher_samples)
        self.fisher_batches = 10 if fisher_batches is None else int(fisher_batches)
        # the client's own last contribution (CPU, persisted)
        self.own: dict[str, "OrderedDict[str, Tensor]"] = {k: OrderedDict() for k in STATE_KEYS}
        self._u: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}
        self._w: dict[str, Tensor] = {}
        self._batches: deque[tuple[Tensor, Tensor]] = deque(maxlen=self.fisher_batches)

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Take ``U - F_s``, ``V - F_s theta_s``, ``W - W_s`` from ``payload`` (no penalty without the sums)."""
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._batches = deque(maxlen=self.fisher_batches)
        self._u, self._v, self._w = OrderedDict(), OrderedDict(), OrderedDict()
        sums = payload or {}
        u, v, w = sums.get(U_KEY), sums.get(V_KEY), sums.get(W_KEY)
        if not u:
            return
        if not isinstance(v, Mapping) or not isinstance(w, Mapping):
            raise ObjectiveError(f"fedcurv: the payload has {U_KEY} but not both {V_KEY} and {W_KEY}")
        for name, p in self._params.items():
            if name not in u:
                continue
            if name not in v or name not in w:
                raise ObjectiveError(f"fedcurv: the payload has {U_KEY}[{name}] but no {V_KEY} or {W_KEY} for it")
            un, vn = self._on(p, u[name], f"{U_KEY}[{name}]"), self._on(p, v[name], f"{V_KEY}[{name}]")
            wn = w[name].detach().to(device=p.device, dtype=p.dtype).reshape(())
            fisher = self.own["fisher"].get(name)
            if fisher is not None:
                un = un - self._on(p, fisher, f"own fisher {name}")
                vn = vn - self._on(p, self.own["fisher_theta"][name], f"own fisher_theta {name}")
                wn = wn - self.own["fisher_theta_sq"][name].to(device=p.device, dtype=p.dtype).reshape(())
            self._u[name] = un.clamp_min(0.0)  # rounding (or a dropped update) must not make it concave
            self._v[name] = vn
            self._w[name] = wn

    @staticmethod
    def _on(p: Tensor, value: Any, what: str) -> Tensor:
        if not isinstance(value, Tensor):
            raise ObjectiveError(f"fedcurv: {what} is not a tensor")
        if tuple(value.shape) != tuple(p.shape):
            raise ObjectiveError(f"fedcurv: {what} has shape {tuple(value.shape)}, parameter has {tuple(p.shape)}")
        return value.detach().to(device=p.device, dtype=p.dtype, copy=True)

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        """``CE + penalty``; under ``last_batches`` keeps ``(images, labels)`` among the last ``fisher_batches``."""
        ce = super().loss(model, images, labels, logits, features)
        if not self.wants_training_pass:
            self._batches.append((images.detach(), labels.detach()))
        if not self._u:
            return ce
        penalty = fedcurv_penalty(self._params, self._u, self._v, self._w, self.lam).to(ce.device)
        self.last_terms["fedcurv"] = penalty.detach()
        return ce + penalty

    def end_round(
        self,
        model: nn.Module,
        *,
        training_batches: Optional[Callable[[], Iterable[tuple[Tensor, Tensor]]]] = None,
    ) -> dict[str, Any]:
        """Estimate ``F_s`` at the trained parameters; keep and return ``(F_s, F_s theta_s, W_s)`` (CPU).

        ``official`` needs ``training_batches``: a fresh, seeded pass over the
        client's training data as ``(images, labels)`` on the model's device.
        """
        self._check_in_round("end_round")
        if self.wants_training_pass:
            if training_batches is None:
                raise ObjectiveError("fedcurv: fisher_estimate=official needs the client's training_batches "
                                     "in end_round()")
            fisher = self._fresh_pass_fisher(model, training_batches)
        else:
            if not self._batches:
                raise ObjectiveError("fedcurv: end_round() after no training batch; the Fisher needs at least one")
            fisher = diagonal_fisher(model, self._params, self._batches)
        with torch.no_grad():
            theta = OrderedDict((n, p.detach()) for n, p in self._params.items())
            fisher_theta = OrderedDict((n, fisher[n] * theta[n]) for n in fisher)
            fisher_theta_sq = OrderedDict((n, (fisher_theta[n] * theta[n]).sum()) for n in fisher)
        self.own = {"fisher": cpu_clone(fisher), "fisher_theta": cpu_clone(fisher_theta),
                    "fisher_theta_sq": cpu_clone(fisher_theta_sq)}
        self._params, self._u, self._v, self._w = {}, {}, {}, {}
        self._batches = deque(maxlen=self.fisher_batches)
        meta = super().end_round(model)
        meta[FISHER_KEY] = cpu_clone(self.own["fisher"])
        meta[FISHER_THETA_KEY] = cpu_clone(self.own["fisher_theta"])
        meta[FISHER_THETA_SQ_KEY] = cpu_clone(self.own["fisher_theta_sq"])
        return meta

    def _fresh_pass_fisher(
        self, model: nn.Module, training_batches: Callable[[], Iterable[tuple[Tensor, Tensor]]]
    ) -> "OrderedDict[str, Tensor]":
        """The official estimate: train mode over the fresh pass; BatchNorm statistics put back after."""
        kept = [(b, b.detach().clone()) for b in model.buffers()]
        try:
            return diagonal_fisher(model, self._params, batches_past(training_batches(), self.fisher_samples),
                                   train_mode=True)
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        return {k: cpu_clone(self.own[k]) for k in STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - set(STATE_KEYS)
        if unknown:
            raise ObjectiveError(f"fedcurv: unknown state keys {sorted(unknown)}")
        own = {k: cpu_clone(state.get(k, {})) for k in STATE_KEYS}
        if not (own["fisher"].keys() == own["fisher_theta"].keys() == own["fisher_theta_sq"].keys()):
            raise ObjectiveError("fedcurv: the kept fisher, fisher_theta and fisher_theta_sq name different parameters")
        self.own = own

    def __repr__(self) -> str:
        if self.wants_training_pass:
            return f"FedCurv(lam={self.lam}, fisher_estimate='official', fisher_samples={self.fisher_samples})"
        return f"FedCurv(lam={self.lam}, fisher_estimate='last_batches', fisher_batches={self.fisher_batches})"


def sums_without(sums: Mapping[str, Mapping[str, Tensor]],
                 contribution: Mapping[str, Mapping[str, Tensor]]) -> dict[str, "OrderedDict[str, Tensor]"]:
    """New sums ``{U_KEY, V_KEY, W_KEY}``: ``sums`` less one client's ``contribution`` (:data:`CONTRIBUTION_KEYS`)."""
    out: dict[str, "OrderedDict[str, Tensor]"] = {}
    for key, target in zip(CONTRIBUTION_KEYS, (U_KEY, V_KEY, W_KEY)):
        part = contribution[key]
        out[target] = OrderedDict((name, t - part[name] if name in part else t.clone())
                                  for name, t in sums[target].items())
    return out


def contribution_sums(
    contributions: Sequence[Mapping[str, Mapping[str, Tensor]]],
) -> dict[str, "OrderedDict[str, Tensor]"]:
    """``{U_KEY: sum F, V_KEY: sum F theta, W_KEY: sum W}`` over ``contributions``, in their order.

    Each contribution maps :data:`CONTRIBUTION_KEYS` to ``{name: tensor}``; a
    name missing from one contribution is a sum over those that have it.
    Empty input gives empty sums.
    """
    out: dict[str, "OrderedDict[str, Tensor]"] = {U_KEY: OrderedDict(), V_KEY: OrderedDict(), W_KEY: OrderedDict()}
    for c in contributions:
        for key, target in zip(CONTRIBUTION_KEYS, (U_KEY, V_KEY, W_KEY)):
            for name, t in c[key].items():
                acc = out[target].get(name)
                out[target][name] = t.detach().clone() if acc is None else acc + t.detach()
    return out


__all__ = [
    "CONTRIBUTION_KEYS",
    "FISHER_ESTIMATES",
    "FISHER_KEY",
    "FISHER_THETA_KEY",
    "FISHER_THETA_SQ_KEY",
    "FedCurv",
    "FedCurvOptions",
    "PENALTY_SUMS",
    "STATE_KEYS",
    "U_KEY",
    "V_KEY",
    "W_KEY",
    "batches_past",
    "contribution_sums",
    "diagonal_fisher",
    "fedcurv_penalty",
    "sums_without",
]
