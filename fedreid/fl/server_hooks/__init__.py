"""Server hooks: run after aggregation, may change the global model.

A hook has a ``name``, ``instructions(round) -> dict`` (what the clients must
add to their updates this round, e.g. ``{"kd": True}``) and
``after_aggregate(round, model, updates) -> dict | None`` (may train
``model`` in place; returns metrics to log). Optional: ``begin_round(round,
global_state)`` (called before the clients train, with the state they get)
and ``state_dict()``/``load_state_dict()`` for state that persists across
rounds (checkpointed with the server).

Optional too: ``check_update(round, update, model) -> str | None``, the
reason the metadata this hook needs from ``update`` is unusable (missing,
wrong shape or length, negative counts), or None. The server calls it on every
update before aggregating (:meth:`fedreid.fl.server.Server.finish_round`,
after :func:`fedreid.fl.update.check_update`), so one bad client is logged
under ``failed`` and left out of the round instead of making the hook raise
after aggregation and stop the run. ``model`` is the global model (e.g. its
feature size). Hooks without it accept every update that passed the generic
checks (:func:`hook_problem`).
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


def hook_problem(hook: Any, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
    """``hook.check_update(...)`` prefixed with the hook's name, or None (also for hooks without the method)."""
    check = getattr(hook, "check_update", None)
    problem = check(round_index, update, model) if check is not None else None
    return f"{hook.name}: {problem}" if problem else None


__all__ = ["FedDynHook", "KDHook", "ScaffoldHook", "ServerHook", "hook_problem"]
