"""Federated search messages as plain Flower records, and back (no pickle, every field checked).

A query (server -> site, message type ``query``)::

    "fedreid.search.query"    ConfigRecord  version (int), k (int), thumbnails (bool: asked for),
                                            fingerprint (str: JSON object of the query's model
                                            fingerprint, "" for none), filters (str: JSON object,
                                            see :class:`SearchFilters`)
    "fedreid.search.feature"  ArrayRecord   feature: float32 [d], the query's feature vector

The site's answer (site -> server, the reply)::

    "fedreid.search.reply"       ConfigRecord  version, site (str), status ("ok" | "error"),
                                               error (str, "" when ok), rows (str: JSON list, one
                                               object per hit: camera, timestamp, name, row_site)
    "fedreid.search.hits"        ArrayRecord   ids: int64 [n] (the site's store ids),
                                               scores: float32 [n]
    "fedreid.search.thumbnails"  ConfigRecord  only when a thumbnail is sent: "<hit index>" -> JPEG bytes

What travels: the query carries a feature vector, ``k``, the filters and a
model fingerprint, never an image. An answer carries, per hit, the store id,
the score, the camera, the timestamp, the row's site column and the image's
*file name* (no folder); a JPEG thumbnail only where the site's policy allows
it and the query asked. Identities, stored vectors, full images and paths
never travel.

Scores are cosine similarities: the query's feature is L2-normalised (its
norm within :data:`NORM_TOLERANCE` of 1, else the query is refused), the
stores hold L2-normalised features (a store refuses others), the store
re-scores every hit exactly, and a site clips only float32 rounding to
[-1, 1] (a larger overshoot is an error answer,
:func:`fedreid.flower.search.answer_query`). So a score outside
[-1 - :data:`COSINE_EPS`, 1 + :data:`COSINE_EPS`] is no cosine: the answer is
refused, since one made-up score (1e30) would otherwise rank first.

Decoding refuses anything else (wrong version, types, sizes, non-finite
numbers, scores outside the cosine range, more hits than ``k``, a hit that
fails the query's filters (given to :func:`decode_hits`), a site name
outside :func:`fedreid.retrieval.fields.site`'s rule, thumbnails that are
not small JPEGs) with a :class:`SearchCodecError` that names what was
expected. File names, the rows' site column and error texts are kept as sent
(JSON carries them exactly); whoever prints them shows them through
:func:`fedreid.utils.text.printable`.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedreid.flower.codec import CodecError
from fedreid.retrieval import fields as field_rules

__all__ = [
    "SEARCH_VERSION",
    "MAX_K",
    "MAX_DIM",
    "MAX_THUMBNAIL_BYTES",
    "COSINE_EPS",
    "NORM_TOLERANCE",
    "QUERY_RECORD",
    "FEATURE_RECORD",
    "REPLY_RECORD",
    "HITS_RECORD",
    "THUMBNAILS_RECORD",
    "SearchCodecError",
    "SearchFilters",
    "SearchQuery",
    "Hit",
    "SiteAnswer",
    "is_search_query",
    "encode_query",
    "decode_query",
    "encode_hits",
    "decode_hits",
    "file_name",
]

SEARCH_VERSION = 1
#: The largest ``k`` a query may ask for (a site never sends more hits than ``k``).
MAX_K = 1000
#: The largest feature dimension a query may carry.
MAX_DIM = 65536
#: The largest thumbnail a server accepts (a JPEG of at most 256 px a side is far smaller).
MAX_THUMBNAIL_BYTES = 64 * 1024
MAX_NAME_CHARS = 255
#: How far past +-1 a score may be and still count as a cosine (float32 rounding of unit vectors is ~1e-6).
COSINE_EPS = 1e-3
#: How far from 1 the norm of a query's feature may be (it is L2-normalised).
NORM_TOLERANCE = 1e-3
QUERY_RECORD = "fedreid.search.query"
FEATURE_RECORD = "fedreid.search.feature"
REPLY_RECORD = "fedreid.search.reply"
HITS_RECORD = "fedreid.search.hits"
THUMBNAILS_RECORD = "fedreid.search.thumbnails"
_JPEG_START = b"\xff\xd8\xff"
_ROW_FIELDS = ("camera", "timestamp", "name", "row_site")


class SearchCodecError(CodecError):
    """A search message did not hold what this side expected; the message names the field."""


def file_name(path: str) -> str:
    """The last component of ``path`` (``/`` or ``\\`` separated): the only part of a path that travels."""
    return re.split(r"[\\/]", str(path))[-1]


# --------------------------------------------------------------------------- values


def _int(value: Any, what: str, *, low: Optional[int] = None, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SearchCodecError(f"{what}: expected an integer, got {type(value).__name__} {value!r:.80}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise SearchCodecError(f"{what}: expected an integer in [{low}, {high}], got {value}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SearchCodecError(f"{what}: expected a number, got {type(value).__name__} {value!r:.80}")
    try:
        value = float(value)
    except OverflowError:  # JSON integers have no size limit: 10**400 is no float
        raise SearchCodecError(f"{what}: expected a finite number, got an integer of {len(str(abs(value)))} "
                               "digits") from None
    if not math.isfinite(value):
        raise SearchCodecError(f"{what}: expected a finite number, got {value}")
    return value


def _text(value: Any, what: str, *, max_chars: int = 1024, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > max_chars:
        raise SearchCodecError(f"{what}: expected a {'' if empty else 'non-empty '}string of at most "
                               f"{max_chars} characters, got {value!r:.80}")
    return value


def _by_rule(prefix: str, rule: Any, *args: Any) -> Any:
    """``rule(*args)`` (a :mod:`fedreid.retrieval.fields` check), its error as a :class:`SearchCodecError`."""
    try:
        return rule(*args)
    except field_rules.GalleryMetadataError as exc:
        raise SearchCodecError(f"{prefix}{exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _json(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        raise SearchCodecError(f"{what}: expected JSON text, got {type(text).__name__}")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise SearchCodecError(f"{what}: not valid JSON ({exc})") from None


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))


def _fingerprint(value: Any, what: str = "fingerprint") -> Optional[dict[str, Any]]:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise SearchCodecError(f"{what}: expected a non-empty JSON object (a model fingerprint), got {value!r:.80}")
    for key, item in value.items():
        if not isinstance(key, str) or not (item is None or isinstance(item, (str, int, float, bool))):
            raise SearchCodecError(f"{what}: expected string keys and plain values, got {key!r}: {item!r:.40}")
    return dict(value)


# --------------------------------------------------------------------------- query


@dataclass(frozen=True)
class SearchFilters:
    """What a site restricts its search to, as :meth:`GalleryStore.search` takes it (None: no filter).

    ``cameras`` and ``sites`` (the store's ``site`` column) are allow-lists;
    ``time_window`` is ``(since, until)``, both ends inclusive, either None for
    open (items without a timestamp fail any window).
    """

    cameras: Optional[tuple[int, ...]] = None
    sites: Optional[tuple[str, ...]] = None
    time_window: Optional[tuple[Optional[float], Optional[float]]] = None

    def __post_init__(self) -> None:
        # JSON types here; the values' ranges are the gallery's own rules (fedreid.retrieval.fields).
        if self.cameras is not None:
            cameras = [_int(c, "filters.cameras[]") for c in self.cameras]
            object.__setattr__(self, "cameras", tuple(_by_rule("", field_rules.camera_list, cameras, "filters.cameras")))
        if self.sites is not None:
            if isinstance(self.sites, str):
                raise SearchCodecError(f"filters.sites: expected a list of site names, got the string {self.sites!r}")
            names = [_text(s, "filters.sites[]", max_chars=MAX_NAME_CHARS) for s in self.sites]
            object.__setattr__(self, "sites", tuple(_by_rule("", field_rules.site_list, names, "filters.sites")))
        if self.time_window is not None:
            window = tuple(self.time_window)
            if len(window) != 2:
                raise SearchCodecError(f"filters.time_window: expected [since, until], got {self.time_window!r}")
            since, until = (None if w is None else _float(w, "filters.time_window[]") for w in window)
            checked = _by_rule("filters.time_window: ", field_rules.time_window, since, until)
            object.__setattr__(self, "time_window", checked if checked is not None else (None, None))

    def to_plain(self) -> dict[str, Any]:
        return {"cameras": None if self.cameras is None else list(self.cameras),
                "sites": None if self.sites is None else list(self.sites),
                "time_window": None if self.time_window is None else list(self.time_window)}

    @classmethod
    def from_plain(cls, value: Any) -> "SearchFilters":
        """From a JSON object with keys among ``cameras``, ``sites``, ``time_window`` (absent or null: no filter)."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise SearchCodecError(f"filters: expected a JSON object with cameras, sites, time_window; got {value!r:.80}")
        unknown = sorted(set(value) - {"cameras", "sites", "time_window"})
        if unknown:
            raise SearchCodecError(f"filters: unknown key(s) {', '.join(map(str, unknown))}; "
                                   "allowed: cameras, sites, time_window")
        for key in ("cameras", "sites", "time_window"):
            if value.get(key) is not None and not isinstance(value[key], (list, tuple)):
                raise SearchCodecError(f"filters.{key}: expected a list, got {value[key]!r:.80}")
        return cls(cameras=value.get("cameras"), sites=value.get("sites"), time_window=value.get("time_window"))

    def store_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`fedreid.retrieval.store.GalleryStore.search`."""
        return {"cameras": self.cameras, "sites": self.sites, "time_window": self.time_window}

    def refusal(self, camera: Optional[int], timestamp: Optional[float], site: Optional[str]) -> Optional[str]:
        """Why an item of ``camera``, ``timestamp`` and ``site`` (its row's site column) fails these filters; None.

        The rule is the store's own (:meth:`fedreid.retrieval.store.GalleryStore.filtered_ids`,
        an SQL ``WHERE``): ``camera IN cameras``, ``site IN sites`` (exact,
        case-sensitive), ``since <= timestamp <= until``; an item whose value
        is None (SQL NULL) fails any filter on that field, and a window of two
        open ends still asks for a timestamp. An empty list lets nothing pass.
        """
        if self.cameras is not None and (camera is None or camera not in self.cameras):
            return f"camera {camera!r} is not among the query's cameras {list(self.cameras)}"
        if self.sites is not None and (site is None or site not in self.sites):
            return f"site column {site!r:.80} is not among the query's sites {list(self.sites)!r:.200}"
        if self.time_window is not None:
            since, until = self.time_window
            if timestamp is None or (since is not None and timestamp < since) or (until is not None and timestamp > until):
                return f"timestamp {timestamp!r} is outside the query's time window [{since}, {until}]"
        return None


@dataclass(frozen=True, eq=False)
class SearchQuery:
    """One query: a float32 feature [d], ``k`` (1..:data:`MAX_K`), filters, the model fingerprint, thumbnails asked.

    The feature must be L2-normalised (norm within :data:`NORM_TOLERANCE` of
    1), as the stores' features are, so that every site's scores are cosines
    on one scale.
    """

    feature: np.ndarray
    k: int
    filters: SearchFilters = field(default_factory=SearchFilters)
    fingerprint: Optional[Mapping[str, Any]] = None
    thumbnails: bool = False

    def __post_init__(self) -> None:
        feature = np.asarray(self.feature)
        if feature.ndim == 2 and feature.shape[0] == 1:
            feature = feature[0]
        if feature.ndim != 1 or not 1 <= feature.shape[0] <= MAX_DIM:
            raise SearchCodecError(f"feature: expected one vector [d] (1 <= d <= {MAX_DIM}), got shape {feature.shape}")
        if not np.issubdtype(feature.dtype, np.floating) and not np.issubdtype(feature.dtype, np.integer):
            raise SearchCodecError(f"feature: expected float32 numbers, got dtype {feature.dtype}")
        feature = np.ascontiguousarray(feature, dtype=np.float32)
        if not np.isfinite(feature).all():
            raise SearchCodecError("feature: expected finite numbers, got NaN or inf")
        norm = float(np.linalg.norm(feature.astype(np.float64)))
        if abs(norm - 1.0) > NORM_TOLERANCE:
            raise SearchCodecError(f"feature: expected an L2-normalised vector (norm 1, as the stores' features), "
                                   f"got norm {norm:.6g}")
        feature.setflags(write=False)
        object.__setattr__(self, "feature", feature)
        object.__setattr__(self, "k", _int(self.k, "k", low=1, high=MAX_K))
        if not isinstance(self.filters, SearchFilters):
            object.__setattr__(self, "filters", SearchFilters.from_plain(self.filters))
        object.__setattr__(self, "fingerprint", _fingerprint(self.fingerprint))
        if not isinstance(self.thumbnails, bool):
            raise SearchCodecError(f"thumbnails: expected true or false, got {self.thumbnails!r}")


def is_search_query(content: RecordDict) -> bool:
    """Whether a ``query`` message's content is a search (and not, e.g., the training "which client?" hello)."""
    return QUERY_RECORD in content.keys()


def encode_query(query: SearchQuery) -> RecordDict:
    """The records of a :class:`SearchQuery` (see the module docstring)."""
    config = ConfigRecord({
        "version": SEARCH_VERSION,
        "k": int(query.k),
        "thumbnails": bool(query.thumbnails),
        "fingerprint": "" if query.fingerprint is None else _dump(dict(query.fingerprint)),
        "filters": _dump(query.filters.to_plain()),
    })
    feature = ArrayRecord({"feature": Array(np.array(query.feature, dtype=np.float32))})
    return RecordDict({QUERY_RECORD: config, FEATURE_RECORD: feature})


def _record(content: RecordDict, name: str, kind: type) -> Any:
    if name not in content.keys():
        raise SearchCodecError(f"the message has no {name!r} record (has {', '.join(sorted(content.keys())) or 'none'})")
    record = content[name]
    if not isinstance(record, kind):
        raise SearchCodecError(f"{name}: expected a {kind.__name__}, got a {type(record).__name__}")
    return record


def _array(record: ArrayRecord, name: str, dtype: Any, where: str) -> np.ndarray:
    if name not in record.keys():
        raise SearchCodecError(f"{where}: expected an array {name!r} (has {', '.join(sorted(record.keys())) or 'none'})")
    try:
        arr = record[name].numpy()  # numpy.load(allow_pickle=False)
    except (TypeError, ValueError, OSError) as exc:
        raise SearchCodecError(f"{where}.{name}: not a NumPy array ({exc})") from None
    if arr.dtype != np.dtype(dtype) or arr.ndim != 1:
        raise SearchCodecError(f"{where}.{name}: expected a 1-d {np.dtype(dtype)} array, got {arr.dtype} {arr.shape}")
    return arr


def _version(config: ConfigRecord, where: str) -> None:
    version = config.get("version")
    if version != SEARCH_VERSION:
        raise SearchCodecError(f"{where}: expected version {SEARCH_VERSION}, got {version!r} "
                               "(run the same fedreid version on the server and the sites)")


def decode_query(content: RecordDict) -> SearchQuery:
    """The :class:`SearchQuery` of a message's content; :class:`SearchCodecError` names what is wrong."""
    config = _record(content, QUERY_RECORD, ConfigRecord)
    _version(config, QUERY_RECORD)
    feature = _array(_record(content, FEATURE_RECORD, ArrayRecord), "feature", np.float32, FEATURE_RECORD)
    fingerprint_text = config.get("fingerprint", "")
    fingerprint = None if fingerprint_text == "" else _json(fingerprint_text, "fingerprint")
    thumbnails = config.get("thumbnails", False)
    return SearchQuery(feature=feature, k=config.get("k"),
                       filters=SearchFilters.from_plain(_json(config.get("filters", "{}"), "filters")),
                       fingerprint=_fingerprint(fingerprint), thumbnails=thumbnails)


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Hit:
    """One gallery item a site found: where it is (``site``, ``id``), its score and what may be shown of it.

    ``score`` is the float32 inner product; ``name`` is the image's file name
    only; ``row_site`` the store's own ``site`` column (None when unset);
    ``thumbnail`` a small JPEG or None.
    """

    site: str
    id: int
    score: float
    camera: Optional[int] = None
    timestamp: Optional[float] = None
    name: str = ""
    row_site: Optional[str] = None
    thumbnail: Optional[bytes] = None

    def to_plain(self) -> dict[str, Any]:
        """A JSON-ready dict (the thumbnail as base64 text, or None)."""
        return {"site": self.site, "id": self.id, "score": self.score, "camera": self.camera,
                "timestamp": self.timestamp, "name": self.name, "row_site": self.row_site,
                "thumbnail_jpeg_base64": None if self.thumbnail is None else base64.b64encode(self.thumbnail).decode()}


@dataclass(frozen=True)
class SiteAnswer:
    """A site's answer: its hits, best first, or an ``error`` (why it did not search: no ranking then)."""

    site: str
    hits: tuple[Hit, ...] = ()
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


def encode_hits(answer: SiteAnswer) -> RecordDict:
    """The records of a site's answer (see the module docstring); an error answer carries no hits."""
    hits = () if answer.error is not None else tuple(answer.hits)
    rows = [{"camera": h.camera, "timestamp": h.timestamp, "name": file_name(h.name), "row_site": h.row_site}
            for h in hits]
    reply = ConfigRecord({
        "version": SEARCH_VERSION,
        "site": str(answer.site),
        "status": "ok" if answer.error is None else "error",
        "error": "" if answer.error is None else str(answer.error),
        "rows": _dump(rows),
    })
    arrays = ArrayRecord({"ids": Array(np.array([h.id for h in hits], dtype=np.int64)),
                          "scores": Array(np.array([h.score for h in hits], dtype=np.float32))})
    content = RecordDict({REPLY_RECORD: reply, HITS_RECORD: arrays})
    thumbs = {str(i): bytes(h.thumbnail) for i, h in enumerate(hits) if h.thumbnail is not None}
    if thumbs:
        content[THUMBNAILS_RECORD] = ConfigRecord(thumbs)
    return content


def _optional(value: Any, what: str, convert) -> Any:
    return None if value is None else convert(value, what)


def decode_hits(content: RecordDict, *, k: Optional[int] = None, thumbnails: bool = True,
                filters: Optional[SearchFilters] = None) -> SiteAnswer:
    """A site's :class:`SiteAnswer` from a reply's content, every field checked.

    ``k``: the query's k (more hits is refused). ``thumbnails=False`` (the
    query did not ask for them) drops any thumbnail sent anyway. A score
    outside [-1 - :data:`COSINE_EPS`, 1 + :data:`COSINE_EPS`] is refused (see
    the module docstring). ``filters``: the query's; a hit whose camera,
    timestamp or row site fails them (:meth:`SearchFilters.refusal`, the
    store's own rule) is refused, since an honest site never returns one.
    """
    reply = _record(content, REPLY_RECORD, ConfigRecord)
    _version(reply, REPLY_RECORD)
    site = _by_rule("", field_rules.site, reply.get("site"), "site")  # the gallery's rule: no control characters
    status = reply.get("status")
    if status == "error":
        return SiteAnswer(site, error=_text(reply.get("error"), "error", max_chars=4096))
    if status != "ok":
        raise SearchCodecError(f"status: expected 'ok' or 'error', got {status!r}")
    arrays = _record(content, HITS_RECORD, ArrayRecord)
    ids = _array(arrays, "ids", np.int64, HITS_RECORD)
    scores = _array(arrays, "scores", np.float32, HITS_RECORD)
    rows = _json(reply.get("rows"), "rows")
    if not isinstance(rows, list) or not (len(rows) == ids.size == scores.size):
        raise SearchCodecError(f"hits: expected as many rows as ids and scores, got {len(rows) if isinstance(rows, list) else rows!r:.40}"
                               f", {ids.size} ids and {scores.size} scores")
    if k is not None and ids.size > k:
        raise SearchCodecError(f"hits: expected at most k={k}, got {ids.size}")
    if (ids < 0).any() or np.unique(ids).size != ids.size:
        raise SearchCodecError("hits.ids: expected distinct store ids >= 0")
    if not np.isfinite(scores).all():
        raise SearchCodecError("hits.scores: expected finite numbers")
    outside = np.flatnonzero(np.abs(scores.astype(np.float64)) > 1.0 + COSINE_EPS)
    if outside.size:
        first = int(outside[0])
        raise SearchCodecError(f"hits.scores: expected cosine similarities in [{-1 - COSINE_EPS:g}, "
                               f"{1 + COSINE_EPS:g}], got {float(scores[first]):.6g} (hit {first}) and "
                               f"{outside.size - 1} more outside")
    thumbs: dict[int, bytes] = {}
    if THUMBNAILS_RECORD in content.keys():
        record = _record(content, THUMBNAILS_RECORD, ConfigRecord)
        for key in record.keys():
            index = int(key) if re.fullmatch(r"\d{1,4}", key) else -1
            data = record[key]
            if not 0 <= index < ids.size:
                raise SearchCodecError(f"thumbnails: key {key!r} is not the index of a hit (0..{ids.size - 1})")
            if not isinstance(data, bytes) or not data.startswith(_JPEG_START) or len(data) > MAX_THUMBNAIL_BYTES:
                raise SearchCodecError(f"thumbnails[{key}]: expected a JPEG of at most {MAX_THUMBNAIL_BYTES} bytes")
            if thumbnails:
                thumbs[index] = data
    hits = []
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        if not isinstance(row, dict) or set(row) != set(_ROW_FIELDS):
            raise SearchCodecError(f"{where}: expected an object with exactly {', '.join(_ROW_FIELDS)}, got {row!r:.80}")
        name = _text(row["name"], f"{where}.name", max_chars=MAX_NAME_CHARS, empty=True)
        if file_name(name) != name:
            raise SearchCodecError(f"{where}.name: expected a file name without folders, got {name!r}")
        hits.append(Hit(site=site, id=int(ids[i]), score=float(scores[i]),
                        camera=_optional(row["camera"], f"{where}.camera", _int),
                        timestamp=_optional(row["timestamp"], f"{where}.timestamp", _float),
                        name=name,
                        row_site=_optional(row["row_site"], f"{where}.row_site",
                                           lambda v, w: _text(v, w, max_chars=MAX_NAME_CHARS, empty=True)),
                        thumbnail=thumbs.get(i)))
        why = None if filters is None else filters.refusal(hits[-1].camera, hits[-1].timestamp, hits[-1].row_site)
        if why is not None:
            raise SearchCodecError(f"{where}: {why}")
    return SiteAnswer(site, tuple(hits))

