"""MOON's server half under ``first_previous: initial``: the run's initial model for clients yet to train.

MOON's client (:mod:`fedreid.fl.local.moon`) contrasts the local model with
the client's previous local model. Before a client has trained there is none;
FedNTD's code, the code base of FedLMD's tables, starts every client's
previous model as the initial global model
(``Lee-Gihun/FedNTD``, ``algorithms/moon/Server.py:_init_prev_locals``).
With partial participation most clients first train long after round 0, so
the server has to keep that model:

* at the first round (:meth:`MoonHook.begin_round`) it keeps the global
  state the clients receive, the run's initial model;
* each sampled client that has not returned an accepted update yet gets it
  in its objective payload (:meth:`MoonHook.client_instructions`, key
  :data:`~fedreid.fl.local.moon.INITIAL_KEY`); the others get nothing,
  their previous model is their own client state;
* after each round (:meth:`MoonHook.after_aggregate`) it notes who returned
  an accepted update. A client whose update was rejected has a previous model
  of its own already and ignores a second copy.

The initial state and the names are checkpointed (one shared model's size),
and the traffic record counts the copies sent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

from torch import Tensor, nn

from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, cpu_clone
from fedreid.fl.local.moon import INITIAL_KEY
from fedreid.fl.server_hooks.base import HookContext, ServerHook, register_hook
from fedreid.fl.update import Update


@register_hook
class MoonHook(ServerHook):
    """Keeps the run's initial global state and sends it to the sampled clients yet to train.

    Built with the ``moon`` client objective when its ``first_previous`` is ``initial``.
    """

    name = "moon"

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "MoonHook":
        return cls()

    def __init__(self) -> None:
        self.initial: "OrderedDict[str, Tensor]" = OrderedDict()
        #: clients that have returned an accepted update (they hold a previous model)
        self.trained: set[str] = set()

    def begin_round(self, round_index: int, global_state: Mapping[str, Tensor]) -> None:
        if not self.initial:
            if round_index != 0:
                raise ValueError(f"server hook 'moon': round {round_index + 1} began without the run's initial "
                                 "model (a checkpoint written without this hook cannot switch to it)")
            self.initial = cpu_clone(global_state)

    def client_instructions(self, round_index: int, clients: Sequence[str]) -> dict[str, dict[str, Any]]:
        return {name: {OBJECTIVE_PAYLOAD: {INITIAL_KEY: self.initial}} for name in clients
                if name not in self.trained}

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        self.trained.update(u.client for u in updates)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"initial": cpu_clone(self.initial), "trained": sorted(self.trained)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"initial", "trained"}
        if unknown:
            raise ValueError(f"server hook 'moon': unknown state keys {sorted(unknown)}")
        self.initial = cpu_clone(state.get("initial", {}))
        self.trained = {str(name) for name in state.get("trained", [])}

    def __repr__(self) -> str:
        return f"MoonHook(trained={len(self.trained)})"


__all__ = ["MoonHook"]
