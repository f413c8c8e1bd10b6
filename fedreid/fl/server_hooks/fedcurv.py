"""FedCurv's server half (Shoham et al., arXiv:1910.07796): keep the clients' Fisher terms, broadcast their sums.

The client half and the math are in :mod:`fedreid.fl.local.fedcurv`. The
server only carries state:

* after each round (:meth:`FedCurvHook.after_aggregate`) it stores every
  accepted update's contribution ``(F_j, F_j theta_j, W_j)`` (update metadata
  :data:`~fedreid.fl.local.fedcurv.CONTRIBUTION_KEYS`) under the client's
  name, replacing that client's previous one -- the latest contribution of
  every client that has sent one, as the reference implementation's
  ``updated_local_uts`` / ``updated_local_vts`` dictionaries
  (``Lee-Gihun/FedNTD``, ``algorithms/fedcurv/Server.py``);
* before the next round (:meth:`FedCurvHook.begin_round`) it sums them, in
  the order of the client names (so the float sums, and a resumed run, are
  reproducible): ``U = sum_j F_j``, ``V = sum_j F_j theta_j``,
  ``W = sum_j W_j``, and sends them to every sampled client as
  ``instructions()[OBJECTIVE_PAYLOAD]``; each client subtracts its own
  contribution (see the client module). Nothing is sent before the first
  contribution (no penalty in the first round). Under the objective's
  ``penalty_sums: official`` (:meth:`FedCurvHook.client_instructions`) a
  client gets instead the sums less the contributions of the clients
  sampled before it in the round, as the reference's in-place ``Pt -= u_k``.

Aggregation is the server's usual weighted average (the reference averages
FedAvg-style); the hook does not implement ``aggregate``, so it combines with
any server step. Its state (every stored contribution, on CPU) is
checkpointed: ``3 x`` the shared parameters' size per client that has
contributed, and ``2 x`` that size in each client's objective state and
sent to each sampled client per round.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

from torch import Tensor, nn

from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, cpu_clone
from fedreid.fl.local.fedcurv import (
    CONTRIBUTION_KEYS,
    FISHER_KEY,
    FISHER_THETA_SQ_KEY,
    PENALTY_SUMS,
    U_KEY,
    contribution_sums,
    sums_without,
)
from fedreid.fl.server_hooks.base import HookContext, ServerHook, register_hook
from fedreid.fl.update import Update


@register_hook
class FedCurvHook(ServerHook):
    """FedCurv's server: stores each client's latest ``(F, F theta, W)``, sends the sums (module docstring).

    Built with the ``fedcurv`` client objective (``train.objective: fedcurv``).
    """

    name = "fedcurv"

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "FedCurvHook":
        return cls(penalty_sums=getattr(context.objective, "penalty_sums", "paper"))

    def __init__(self, penalty_sums: str = "paper") -> None:
        if penalty_sums not in PENALTY_SUMS:
            raise ValueError(f"fedcurv penalty_sums must be one of {', '.join(PENALTY_SUMS)}, got {penalty_sums!r}")
        self.penalty_sums = penalty_sums
        #: client name -> {metadata key -> {parameter name -> CPU tensor}}
        self.contributions: dict[str, dict[str, "OrderedDict[str, Tensor]"]] = {}
        self._sums: dict[str, "OrderedDict[str, Tensor]"] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def begin_round(self, round_index: int, global_state: Mapping[str, Tensor]) -> None:
        """Remember the shared state's shapes and sum the stored contributions (client-name order)."""
        self._shapes = {k: tuple(v.shape) for k, v in global_state.items()}
        self._sums = contribution_sums([self.contributions[c] for c in sorted(self.contributions)])

    def instructions(self, round_index: int) -> dict[str, Any]:
        """``{OBJECTIVE_PAYLOAD: {U, V, W}}`` once some client has contributed; nothing before."""
        if not self._sums or not self._sums[U_KEY]:
            return {}
        return {OBJECTIVE_PAYLOAD: self._sums}

    def client_instructions(self, round_index: int, clients: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Under ``penalty_sums: official``, each client after one that had contributed gets its running sums.

        The reference keeps one running ``Ut`` per round and subtracts, in the
        sampling order, the stored terms of every client it serves (``Pt = Ut;
        Pt -= u_k``): a client's sums lack those of the clients before it. The
        client then subtracts its own (its running sums are sent before that).
        """
        if self.penalty_sums != "official" or not self._sums or not self._sums[U_KEY]:
            return {}
        out: dict[str, dict[str, Any]] = {}
        running = None  # the sums less the terms of the clients served so far, once one had any
        for name in clients:
            if running is not None:
                out[name] = {OBJECTIVE_PAYLOAD: running}
            if name in self.contributions:
                running = sums_without(self._sums if running is None else running, self.contributions[name])
        return out

    def required_metadata(self, round_index: int) -> tuple[str, ...]:
        return CONTRIBUTION_KEYS

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s contribution is unusable (a parameter missing or reshaped, negative Fisher), or None.

        Every trainable parameter of the shared state needs ``F`` and ``F theta``
        of its shape and a one-element ``W``; non-finite values are rejected
        before (:func:`fedreid.fl.update.check_update`).
        """
        names = self._names(model)
        for key in CONTRIBUTION_KEYS:
            value = update.metadata.get(key)
            if not isinstance(value, Mapping):
                return f"{key} is not a dict of tensors"
            for name in names:
                t = value.get(name)
                if not isinstance(t, Tensor):
                    return f"{key} has no tensor for {name}"
                if key == FISHER_THETA_SQ_KEY:
                    if t.numel() != 1:
                        return f"{key}[{name}] has {t.numel()} elements, expected one"
                elif tuple(t.shape) != self._shapes[name]:
                    return f"{key}[{name}] has shape {tuple(t.shape)}, expected {self._shapes[name]}"
                if key == FISHER_KEY and bool((t < 0).any()):
                    return f"{key}[{name}] has negative entries (a diagonal Fisher is >= 0)"
        return None

    def _names(self, model: nn.Module) -> list[str]:
        return [n for n, p in model.named_parameters() if p.requires_grad and n in self._shapes]

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        """Store each accepted update's contribution under its client (replacing the previous one)."""
        names = self._names(model)
        for u in updates:
            entry: dict[str, "OrderedDict[str, Tensor]"] = {}
            for key in CONTRIBUTION_KEYS:
                value = u.metadata[key]
                part = OrderedDict((n, value[n]) for n in names)
                if key == FISHER_THETA_SQ_KEY:
                    part = OrderedDict((n, t.reshape(())) for n, t in part.items())
                entry[key] = cpu_clone(part)
            self.contributions[u.client] = entry
        held = [self.contributions[c][FISHER_KEY] for c in sorted(self.contributions)]  # a fixed order of sums
        fisher_entries = sum(t.numel() for fisher in held for t in fisher.values())
        fisher_total = sum(float(t.double().sum()) for fisher in held for t in fisher.values())
        return {"clients_held": len(self.contributions),
                "fisher_mean": fisher_total / fisher_entries if fisher_entries else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"contributions": {c: {k: cpu_clone(v) for k, v in entry.items()}
                                  for c, entry in sorted(self.contributions.items())}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"contributions"}
        if unknown:
            raise ValueError(f"server hook 'fedcurv': unknown state keys {sorted(unknown)}")
        contributions: dict[str, dict[str, "OrderedDict[str, Tensor]"]] = {}
        for client, entry in dict(state.get("contributions", {})).items():
            missing = [k for k in CONTRIBUTION_KEYS if k not in entry]
            if missing:
                raise ValueError(f"server hook 'fedcurv': the contribution of {client!r} has no {missing[0]}")
            contributions[str(client)] = {k: cpu_clone(entry[k]) for k in CONTRIBUTION_KEYS}
        self.contributions = contributions
        self._sums = {}

    def __repr__(self) -> str:
        return f"FedCurvHook(clients_held={len(self.contributions)}, penalty_sums={self.penalty_sums!r})"


__all__ = ["FedCurvHook"]
