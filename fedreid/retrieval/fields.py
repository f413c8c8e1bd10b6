"""The values a gallery item's metadata and a search filter may hold: one rule set for every way in.

The service's forms (:mod:`fedreid.retrieval.service`), the metadata CSV and
the rows taken from image files (:mod:`fedreid.retrieval.gallery_rows`), the
command line (``tools/eval_reid.py``), federated search filters
(:mod:`fedreid.flower.search_codec`) and the store itself
(:class:`fedreid.retrieval.store.GalleryStore`) all check with these
functions, so a value one of them accepts every reader of the store can use:

* ``camera`` and ``identity``: an integer from :data:`INT_MIN` to
  :data:`INT_MAX` (32-bit signed: SQLite, NumPy, JSON and the web page hold it
  exactly); text must be decimal digits with an optional sign;
* ``timestamp`` (and a filter's ``since``/``until``): seconds since the epoch
  from :data:`TIME_MIN` (0001-01-01T00:00:00Z) to :data:`TIME_MAX`
  (9999-12-31T23:59:59Z), the range Python's ``datetime`` and the page's
  JavaScript ``Date`` both show; text is a number or an ISO 8601 date or
  date/time (UTC unless it names an offset);
* ``site``: text of 1 to :data:`SITE_MAX_CHARS` characters after stripping
  surrounding blanks, without control characters or commas (a filter's
  separator).

Each function takes ``what``, the words naming the value for the error (a
form field, ``--cameras``, ``metadata file F row 3: camera``), and raises
:class:`GalleryMetadataError` with one line: ``<what> must be ..., got <value>``.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any, Mapping, Optional

import numpy as np

from fedreid.errors import FedReIDError

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "SITE_MAX_CHARS",
    "TIME_MAX",
    "TIME_MIN",
    "GalleryMetadataError",
    "camera",
    "camera_list",
    "identity",
    "is_integer_text",
    "item_values",
    "site",
    "site_list",
    "time_window",
    "timestamp",
]

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
#: 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z in seconds since the epoch.
TIME_MIN, TIME_MAX = -62_135_596_800.0, 253_402_300_799.0
SITE_MAX_CHARS = 200
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TIME_WORDS = (
    "seconds since the epoch or an ISO 8601 date/time from year 1 to 9999 (e.g. 1714550400, 2024-05-01, "
    "2024-05-01T08:00:00+02:00; UTC unless it names an offset)"
)


class GalleryMetadataError(FedReIDError, ValueError):
    """A metadata or filter value outside its rule (or a bad metadata CSV); the message names where it came from."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_integer_text(text: str) -> bool:
    """Whether ``text`` is an integer as every way in writes one: ASCII digits with an optional sign.

    Python's ``int`` also takes ``1_0`` and non-ASCII digits (``"\u0663"``);
    this rule does not, so one number has one spelling.
    """
    return _INTEGER_TEXT.fullmatch(text) is not None


def _integer(value: Any, what: str) -> int:
    expected = f"{what} must be an integer from {INT_MIN} to {INT_MAX}, got {_shown(value)}"
    if isinstance(value, (bool, np.bool_)):
        raise GalleryMetadataError(expected)
    if isinstance(value, str):
        text = value.strip()
        if not is_integer_text(text) or len(text) > 40:
            raise GalleryMetadataError(expected)
        value = int(text)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
    else:
        raise GalleryMetadataError(expected)
    if not INT_MIN <= value <= INT_MAX:
        raise GalleryMetadataError(expected)
    return value


def camera(value: Any, what: str = "camera") -> int:
    """A camera number (an int, or its decimal text) within the rule, or :class:`GalleryMetadataError`."""
    return _integer(value, what)


def identity(value: Any, what: str = "identity") -> int:
    """An identity (an int, or its decimal text) within the rule, or :class:`GalleryMetadataError`."""
    return _integer(value, what)


def timestamp(value: Any, what: str = "timestamp") -> float:
    """Seconds since the epoch of ``value`` (a number, or a number or ISO 8601 text), within the rule.

    A date/time without an offset (``2024-05-01T08:00``) is UTC, as is a bare
    date (its midnight). Raises :class:`GalleryMetadataError` for anything else,
    NaN, infinities and moments outside years 1 to 9999.
    """
    expected = f"{what} must be {_TIME_WORDS}, got {_shown(value)}"
    if isinstance(value, (bool, np.bool_)):
        raise GalleryMetadataError(expected)
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float (10**400) is out of range too
            raise GalleryMetadataError(expected) from None
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                moment = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text)
            except ValueError:
                raise GalleryMetadataError(expected) from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            try:
                seconds = moment.timestamp()
            except (OverflowError, ValueError):  # year 1 with a positive offset: before the range
                raise GalleryMetadataError(expected) from None
    else:
        raise GalleryMetadataError(expected)
    if not math.isfinite(seconds) or not TIME_MIN <= seconds <= TIME_MAX:
        raise GalleryMetadataError(expected)
    return seconds


def site(value: Any, what: str = "site") -> str:
    """A site name: text, stripped, 1 to :data:`SITE_MAX_CHARS` characters, no control characters, no comma.

    A comma separates the names of a site filter (:func:`site_list`), so a
    name holding one could be stored but never asked for.
    """
    expected = (f"{what} must be a name of 1 to {SITE_MAX_CHARS} characters without control characters or "
                f"commas (a site filter separates names with commas), got {_shown(value)}")
    if not isinstance(value, str):
        raise GalleryMetadataError(expected)
    text = value.strip()
    if not text or len(text) > SITE_MAX_CHARS or _CONTROL.search(text) or "," in text:
        raise GalleryMetadataError(expected)
    return text


def _parts(values: Any) -> list[Any]:
    if isinstance(values, str):
        return [p for p in (p.strip() for p in values.split(",")) if p]
    return list(values)


def camera_list(values: Any, what: str = "cameras") -> Optional[list[int]]:
    """A camera filter: comma-separated text or an iterable of cameras; None when the text names none.

    An empty iterable stays an empty list (it lets no item pass).
    """
    parts = _parts(values)
    if isinstance(values, str) and not parts:
        return None
    return [camera(p, f"{what} (each a camera)") for p in parts]


def site_list(values: Any, what: str = "sites") -> Optional[list[str]]:
    """A site filter: comma-separated text or an iterable of names; None when the text names none."""
    parts = _parts(values)
    if isinstance(values, str) and not parts:
        return None
    return [site(p, f"{what} (each a site)") for p in parts]


def time_window(since: Any, until: Any, what: str = "") -> Optional[tuple[Optional[float], Optional[float]]]:
    """``(since, until)`` in seconds (either None for open; None for both: no window), ``since <= until``.

    ``what``: a prefix naming the pair (``--`` gives ``--since``/``--until``).
    """
    if since is None and until is None:
        return None
    start = None if since is None else timestamp(since, f"{what}since")
    end = None if until is None else timestamp(until, f"{what}until")
    if start is not None and end is not None and start > end:
        raise GalleryMetadataError(f"{what}since {start} is after {what}until {end}: expected since <= until")
    return start, end


def item_values(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``row``'s ``camera``, ``site``, ``timestamp`` and ``identity`` checked (None stays None), other keys as is.

    ``where`` names the row for the error (``metadata row 3``, an image's path).
    """
    out = dict(row)
    checks = {"camera": camera, "site": site, "timestamp": timestamp, "identity": identity}
    for key, check in checks.items():
        if out.get(key) is not None:
            out[key] = check(out[key], f"{where}: {key}")
    return out
