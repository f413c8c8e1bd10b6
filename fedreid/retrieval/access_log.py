"""The search service's access log, with item ids left out.

uvicorn logs every request line, and an item's id sits in its paths
(``/items/<id>``, ``/items/<id>/image``). A log that kept them would outlive
an erasure (``DELETE /items/<id>``) in whatever collects the server's output,
so the access log writes ``/items/{item_id}`` instead: method, route, status
and client address stay for operations. :func:`redact_item_ids` is that rule
for any other log line that names a request path (the service's 500 handler).
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

#: An item path's id segment (up to the next ``/``, ``?`` or the end).
_ITEM_PATH = re.compile(r"^/items/[^/?]+")
#: What an item id is logged as.
REDACTED = "/items/{item_id}"


def redact_item_ids(path: str) -> str:
    """``path`` (a request path, its query string allowed) with an item route's id written as ``{item_id}``.

    Only paths under ``/items/`` change: ``/items/42/image?x=1`` becomes
    ``/items/{item_id}/image?x=1``; ``/search`` or ``/web/items/42`` stay.
    """
    return _ITEM_PATH.sub(REDACTED, path)


class RedactItemIds(logging.Filter):
    """Replaces the id in a uvicorn access record's path (its third argument) with ``{item_id}``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_item_ids(args[2]), *args[3:])
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration with :class:`RedactItemIds` on its access handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["item_ids"] = {"()": f"{__name__}.RedactItemIds"}
    config["handlers"]["access"].setdefault("filters", []).append("item_ids")
    return config


__all__ = ["REDACTED", "RedactItemIds", "log_config", "redact_item_ids"]
