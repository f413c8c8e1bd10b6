"""Server hooks: run after aggregation, may change the global model.

A hook has a ``name``, ``instructions(round) -> dict`` (what the clients must
add to their updates this round, e.g. ``{"kd": True}``) and
``after_aggregate(round, model, updates) -> dict | None`` (may train
``model`` in place; returns metrics to log). Optional: ``begin_round(round,
global_state)`` (called before the clients train, with the state they get)
and ``state_dict()``/``load_state_dict()`` for state that persists across
rounds (checkpointed with the server).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

from torch import nn

from fedreid.fl.server_hooks.kd import KDHook
from fedreid.fl.server_hooks.objectives import FedDynHook, ScaffoldHook
from fedreid.fl.update import Update


class ServerHook(Protocol):
    name: str

    def instructions(self, round_index: int) -> dict[str, Any]: ...

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]: ...


__all__ = ["FedDynHook", "KDHook", "ScaffoldHook", "ServerHook"]
