"""Server hooks: run after aggregation, may change the global model.

A hook has a ``name``, ``instructions(round) -> dict`` (what the clients must
add to their updates this round, e.g. ``{"kd": True}``) and
``after_aggregate(round, model, updates) -> dict | None`` (may train
``model`` in place; returns metrics to log).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

from torch import nn

from fedreid.fl.server_hooks.kd import KDHook
from fedreid.fl.update import Update


class ServerHook(Protocol):
    name: str

    def instructions(self, round_index: int) -> dict[str, Any]: ...

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]: ...


__all__ = ["KDHook", "ServerHook"]
