"""Federated training: state helpers, Update, Client, aggregation, server hooks, Server, simulation.

Import the pieces from their modules (``fedreid.fl.client``, ...); the most
used names are re-exported lazily here so ``import fedreid.fl`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Update": "fedreid.fl.update",
    "PrivateStateError": "fedreid.fl.update",
    "check_no_private": "fedreid.fl.update",
    "weighted_average": "fedreid.fl.state",
    "aggregate": "fedreid.fl.aggregate",
    "cdw_distance": "fedreid.fl.aggregate",
    "Client": "fedreid.fl.client",
    "ClientError": "fedreid.fl.client",
    "Server": "fedreid.fl.server",
    "KDHook": "fedreid.fl.server_hooks.kd",
    "Evaluator": "fedreid.fl.evaluation",
    "run_simulation": "fedreid.fl.simulation",
    "resume": "fedreid.fl.simulation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fedreid.fl' has no attribute {name!r}")
