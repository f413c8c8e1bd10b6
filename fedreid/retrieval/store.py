"""A gallery store: a FAISS index chosen by factory string, stable 64-bit ids, SQLite metadata.

:class:`GalleryStore` is a folder of immutable segments (``seg-<n>.faiss``,
``.vectors.npy``, ``.ids.npy``, ``.sqlite``), a trained empty template and a
``header.json`` manifest with every file's size and SHA-256. The contract:

* ids are assigned increasing, never reused, and stay with their item after
  any removal, for every index kind;
* :meth:`GalleryStore.add` writes new segments only and
  :meth:`GalleryStore.remove` rewrites only the segments it touches, unless
  the index was trained on a removed item (IVF centroids, PQ codebooks, SQ
  ranges): then it is trained again without it and every segment rewritten;
  after ``remove`` returns, no byte of a removed item remains in the store's
  files, nor anything the index learned from it;
* every update is staged beside the folder and swapped in whole (a kill leaves
  the old store or the new), under an exclusive lock that refuses a stale copy;
* a search returns at most the item count of results, ranked by score then id;
  every score is the inner product of the query with the item's stored vector
  (an approximate index only picks the candidates: its recall stays
  approximate, its scores never reach an answer); filtered results always
  satisfy the filter;
* nothing is unpickled; every file is checked against the header before it is
  parsed (once per file and process).

The file format, the reasons and the costs: ``docs/retrieval-internals.md``.
File names, checks and the lock: :mod:`fedreid.retrieval.store_files`; what
differs by index family: :mod:`fedreid.retrieval.index_kinds`.
"""

from __future__ import annotations

import collections.abc
import contextlib
import json
import math
import os
import re
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Mapping, Optional, Sequence

import faiss
import numpy as np

from fedreid.errors import FedReIDError
from fedreid.retrieval import fields, index_kinds
from fedreid.retrieval.index_kinds import (
    DEFAULT_EF_SEARCH,
    DEFAULT_NPROBE,
    EF_SEARCH_CANDIDATES,
    NPROBE_CANDIDATES,
    accepts_search_parameters,
    inner_ivf,
    kind_named,
    rebuilds_on_remove,
    supported_factories,
    unsupported_reason,
)
from fedreid.retrieval.store_files import (
    _COLUMNS,
    _HEADER_TEMP,
    _SCHEMA,
    _SEGMENT_FILE,
    _SEGMENT_NAME,
    HEADER_FILE,
    LEGACY_FILES,
    LEGACY_VERSION,
    MARKER_KIND,
    SEGMENT_SUFFIXES,
    SIDE_FILES,
    STORE_FORMAT,
    STORE_VERSION,
    TEMPLATE_FILE,
    TOOL,
    GalleryStoreError,
    _check_file,
    _check_search_params,
    _check_store_location,
    _Conn,
    _connect_ro,
    _connect_rw,
    _db_ids,
    _delete_marker_last,
    _link_or_copy,
    _read_faiss,
    _read_header,
    _read_npy,
    _remove_leftovers,
    _segment_files,
    _segment_key,
    _segment_layout,
    _written_record,
    clean_swap_leftovers,
    header_stamp,
    is_store_folder,
    writer_lock,
)
from fedreid.utils.filecheck import sha256_file
from fedreid.utils.io import claim_output_dir, replace_dir_atomically, swap_sibling, write_json_atomic

__all__ = [
    "EXACT_FILTER_MAX",
    "NORM_TOLERANCE",
    "SIDE_FILES",
    "STORE_FORMAT",
    "SUPPORTED_FACTORIES",
    "STORE_VERSION",
    "GalleryStore",
    "GalleryStoreError",
    "SearchResult",
    "check_factory_string",
    "clean_swap_leftovers",
    "factory_kind",
    "is_store_folder",
]

#: A build or an add writes segments of at most this many items (a removal rewrites only the segments it hits).
SEGMENT_ITEMS = 65_536
#: After an update, adjacent segments are merged (the smallest pair first) while there are more than this.
MAX_SEGMENTS = 32
#: A filtered search over at most this many allowed items is exact over their stored vectors.
EXACT_FILTER_MAX = 20_000
#: Seconds an update waits for another process's update of a store in the same folder.
LOCK_TIMEOUT_S = 60.0
#: Reads of a store that another process saved meanwhile are started again, up to this many times in all.
OPEN_ATTEMPTS = 5
#: Pause before the first repeated read, doubled each time.
OPEN_RETRY_PAUSE_S = 0.05
#: How far from 1 the L2 norm of a stored feature may be: scores are cosines (a federated search's
#: ``NORM_TOLERANCE`` for queries is the same). float32 rounding, and features extracted in fp16 or bf16
#: then normalised in float32, stay within about 1e-6 of it.
NORM_TOLERANCE = 1e-3
#: Names kept here for their earlier importers (the files' names live in :mod:`fedreid.retrieval.store_files`).
_REEXPORTED = (DEFAULT_EF_SEARCH, DEFAULT_NPROBE, EF_SEARCH_CANDIDATES, NPROBE_CANDIDATES, SEGMENT_SUFFIXES,
               LEGACY_FILES, LEGACY_VERSION, STORE_FORMAT, _SEGMENT_FILE, is_store_folder, sha256_file)


@dataclass
class SearchResult:
    """Top-k of each query: ``scores`` [Q, k] float32 and ``ids`` [Q, k] int64, best first; -1 pads.

    ``k`` is the asked k cut to the store's item count (so a huge k costs no
    more than k = the number of items); a filter may leave fewer: -1 pads.
    """

    scores: np.ndarray
    ids: np.ndarray


# --------------------------------------------------------------------------
# Index construction
# --------------------------------------------------------------------------


#: The factory strings of the registered index kinds (:mod:`fedreid.retrieval.index_kinds`), for error messages.
SUPPORTED_FACTORIES = supported_factories()


def _index_kind(index: Any) -> str:
    return index_kinds.index_kind(index)


def _check_supported(index: Any, factory: str) -> str:
    """The kind of ``index`` (the store's IndexIDMap2 over ``factory``); raises for a class the store cannot run."""
    name = unsupported_reason(index)
    if name is not None:
        hint = " (for exact re-scoring use the store's refine, e.g. index --refine 4)" if "Refine" in name else ""
        raise GalleryStoreError(
            f"factory {factory!r} builds a faiss {name}, which a gallery store cannot search or update{hint}; "
            f"supported: {supported_factories()}"
        )
    return _index_kind(index)


def _accepts_search_parameters(index: Any) -> bool:
    return accepts_search_parameters(index)


def _new_index(factory: str, dim: int) -> Any:
    if not isinstance(factory, str) or not factory.strip():
        raise GalleryStoreError(f"factory must be a FAISS factory string such as 'IVF1024,PQ64', got {factory!r}")
    if factory.startswith("IDMap"):
        raise GalleryStoreError(f"factory {factory!r}: leave out the IDMap prefix, the store adds IDMap2 itself")
    try:
        index = faiss.index_factory(int(dim), "IDMap2," + factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", text[-1]) if text else str(exc)
        raise GalleryStoreError(f"FAISS cannot build the factory string {factory!r} for dim {dim}: {reason}") from None
    _check_supported(index, factory)
    return index  # already an IndexIDMap2 (a downcast proxy would not own the object)


#: A dimension divisible by 1-8, 10, 12, 14, 16, 32, 64 and 128: :func:`check_factory_string` builds at it.
_PROBE_DIM = 40320


def check_factory_string(factory: str, images: Optional[int] = None) -> None:
    """Raise :class:`GalleryStoreError` when FAISS cannot parse ``factory`` (tried at a dimension most accept).

    A string that parses may still not fit the features' dimension (e.g. PQ7
    for 16-d features): :meth:`GalleryStore.create` says so. With ``images``
    (a gallery's image count, before its features are extracted), also when
    that many are too few to train the index: IVF and PQ needs do not depend
    on the dimension.
    """
    try:
        index = _new_index(factory, _PROBE_DIM)
    except GalleryStoreError as exc:
        text = str(exc).replace(f" for dim {_PROBE_DIM}", "")
        if "such as" not in text and "supported:" not in text:
            text += "; expected a FAISS factory string such as Flat, IVF1024,Flat, IVF1024,PQ64 or HNSW32"
        raise GalleryStoreError(text) from None
    if images is not None and not index.is_trained:
        _check_training_need(index, factory, images, "images")


def factory_kind(factory: str, dim: int) -> str:
    """``flat``, ``ivf``, ``hnsw``, ``other`` (or another registered kind): the kind of index ``factory`` builds.

    Raises :class:`GalleryStoreError` for a string FAISS cannot build or a class no kind has.
    """
    return _index_kind(_new_index(factory, dim))


def _check_training_need(index: Any, factory: str, count: int, what: str) -> None:
    need, why = kind_named(_index_kind(index)).training_need(index)
    if count < need:
        raise GalleryStoreError(
            f"factory {factory!r} needs at least {need} training vectors ({why}); the gallery has "
            f"{count} {what}: choose a smaller factory (e.g. fewer IVF lists) or 'Flat'"
        )


def _train(index: Any, features: np.ndarray, factory: str, seed: int, clustering_index: Any = None) -> None:
    if index.is_trained:
        return
    kind = kind_named(_index_kind(index))
    _check_training_need(index, factory, features.shape[0], "vectors")
    kind.before_training(index, seed, clustering_index)
    try:
        index.train(features)
    except RuntimeError as exc:  # a need training_need does not foresee (e.g. OPQ's own 256-centroid PQ)
        text = str(exc).strip().splitlines()
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", text[-1]) if text else type(exc).__name__
        raise GalleryStoreError(
            f"factory {factory!r} cannot be trained on the gallery's {features.shape[0]} vectors: {reason}"
        ) from None
    finally:
        kind.after_training(index)


def _with_refine(params: dict[str, int], refine: int) -> dict[str, int]:
    if int(refine) < 1:
        raise GalleryStoreError(f"refine must be >= 1 (1: off), got {refine}")
    return dict(params, refine=int(refine)) if int(refine) > 1 else params


def _search_params(kind: str, search: Mapping[str, int], selector: Any = None) -> Any:
    params = kind_named(kind).search_parameters(search)
    if selector is not None:
        params.sel = selector
    return params


def _as_features(name: str, x: Any, dim: Optional[int] = None, *, unit: bool = False) -> np.ndarray:
    """``x`` as a checked float32 ``[N, d]`` array; ``unit``: every row's L2 norm within :data:`NORM_TOLERANCE` of 1."""
    try:
        x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    except (TypeError, ValueError) as exc:
        raise GalleryStoreError(f"{name} must be a numeric [N, d] array: {str(exc).splitlines()[0]:.120}") from None
    if x.ndim != 2 or x.shape[0] == 0:
        raise GalleryStoreError(f"{name} must be a non-empty [N, d] array, got shape {x.shape}")
    if dim is not None and x.shape[1] != dim:
        raise GalleryStoreError(f"{name} have {x.shape[1]} columns but the store holds {dim}-d features")
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise GalleryStoreError(f"{name} hold NaN or inf values (row {row})")
    if unit:
        norms = np.sqrt(np.einsum("nd,nd->n", x, x, dtype=np.float64))
        off = np.flatnonzero(np.abs(norms - 1.0) > NORM_TOLERANCE)
        if off.size:
            row = int(off[0])
            raise GalleryStoreError(
                f"{name} row {row} has L2 norm {norms[row]:.6g} ({off.size} of {x.shape[0]} rows are off): "
                f"expected L2-normalised features (norm 1 within {NORM_TOLERANCE:g}), whose inner products are "
                "cosines; normalise each row"
            )
    return x


def _check_meta(meta: Mapping[str, Any], where: str = "meta") -> None:
    """Refuse a non-finite number anywhere in ``meta``, naming its key (``meta['a']['b']``).

    JSON has no NaN or infinity (Python writes tokens other JSON readers
    refuse), and a NaN never equals itself, which the check that a store is
    unchanged on disk relies on.
    """
    items = meta.items() if isinstance(meta, Mapping) else enumerate(meta)
    for key, value in items:
        here = f"{where}[{key!r}]"
        if isinstance(value, (float, np.floating)) and not math.isfinite(float(value)):
            raise GalleryStoreError(f"{here} is {value!r}: header meta values must be finite numbers (not NaN or inf)")
        if isinstance(value, (Mapping, list, tuple)):
            _check_meta(value, here)


def _item_id(value: Any, where: str) -> int:
    """``value`` as an item id: a Python or NumPy integer (not a bool), else :class:`GalleryStoreError` naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GalleryStoreError(f"{where}: {value!r:.60} is not an item id (expected an integer)")
    return int(value)


def _item_ids(values: Iterable[Any], where: str) -> list[int]:
    """Each of ``values`` as an item id (:func:`_item_id`); an integer NumPy array passes whole."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return [int(v) for v in values.ravel()]
    if isinstance(values, (str, bytes)):
        raise GalleryStoreError(f"{where}: expected a sequence of item ids (integers), got {values!r:.60}")
    return [_item_id(v, where) for v in values]


def _check_filter_list(values: Any, name: str, expected: str) -> None:
    """Refuse a ``cameras``/``sites`` filter that is neither text nor a collection of values (None: no filter)."""
    if values is None or isinstance(values, str):
        return
    if isinstance(values, (bytes, Mapping)) or not isinstance(values, collections.abc.Iterable):
        raise GalleryStoreError(f"{name} filter: expected {expected}, got {values!r:.60}")


def _normalise_rows(rows: Sequence[Mapping[str, Any]], n: int) -> list[tuple]:
    if len(rows) != n:
        raise GalleryStoreError(f"got {n} feature rows but {len(rows)} metadata rows")
    out, seen = [], set()
    for i, row in enumerate(rows):
        path = row.get("path")
        if not isinstance(path, str) or not path:
            raise GalleryStoreError(f"metadata row {i} has no path")
        if path in seen:
            raise GalleryStoreError(f"path {path} appears twice among the items to add")
        seen.add(path)
        unknown = set(row) - set(_COLUMNS[1:])
        if unknown:
            raise GalleryStoreError(f"metadata row {i} has unknown fields {sorted(unknown)}")
        checked = fields.item_values(row, f"metadata row {i} ({path})")
        out.append((path, *(checked.get(key) for key in ("camera", "site", "timestamp", "identity"))))
    return out


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------


@dataclass
class _Segment:
    """One immutable segment in memory: its files (role -> file name), ids, mapped vectors and FAISS index.

    ``dirty``: its index was rebuilt in memory (an earlier version's shifted ids); the next update writes it.
    """

    name: str
    files: dict[str, str]
    ids: np.ndarray
    vectors: Any
    index: Any
    dirty: bool = False

    @property
    def ntotal(self) -> int:
        return int(self.ids.size)


@dataclass(frozen=True)
class _FlatIndexStamp:
    """Which store state an index from :meth:`GalleryStore.flat_faiss_index` describes (see ``_state``)."""

    state: tuple[str, tuple[str, ...]]


@dataclass
class _NewSegment:
    """A segment to write: ids, vectors, its filled index and its table rows ``(id, path, camera, ...)``."""

    ids: np.ndarray
    vectors: np.ndarray
    index: Any
    rows: list[tuple]




class _Rows:
    """The stored vectors of every segment as one read-only ``[ntotal, d]`` array-like (row i: id ``ids[i]``).

    Indexing with an int, a slice, an integer or boolean array gathers the
    rows from the segments' memory maps; ``np.asarray`` concatenates them all.
    """

    def __init__(self, parts: Sequence[Any], dim: int):
        self._parts = list(parts)
        self._starts = np.cumsum([0] + [int(p.shape[0]) for p in self._parts])
        self.shape = (int(self._starts[-1]), int(dim))
        self.dtype = np.dtype(np.float32)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if not self._parts:
            out = np.empty(self.shape, np.float32)
        elif len(self._parts) == 1:
            out = np.asarray(self._parts[0])
        else:
            out = np.concatenate([np.asarray(p) for p in self._parts])
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, key: Any) -> np.ndarray:
        if len(self._parts) == 1:
            return self._parts[0][key]
        n = self.shape[0]
        if isinstance(key, (int, np.integer)):
            row = int(key) + (n if int(key) < 0 else 0)
            if not 0 <= row < n:
                raise IndexError(f"row {key} out of range for {n} stored vectors")
            s = int(np.searchsorted(self._starts, row, side="right")) - 1
            return self._parts[s][row - self._starts[s]]
        if isinstance(key, slice):
            rows = np.arange(*key.indices(n), dtype=np.int64)
        else:
            rows = np.asarray(key)
            rows = np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64)
            rows = np.where(rows < 0, rows + n, rows)
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                raise IndexError(f"rows out of range for {n} stored vectors")
        flat = rows.ravel()
        out = np.empty((flat.size, self.shape[1]), np.float32)
        seg = np.searchsorted(self._starts, flat, side="right") - 1
        for s in np.unique(seg):
            sel = seg == s
            out[sel] = self._parts[s][flat[sel] - self._starts[s]]
        return out.reshape(*rows.shape, self.shape[1])


def _merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], nq: int, k: int) -> SearchResult:
    """The best ``k`` of per-segment results ``(scores, ids)`` by score (descending), then id; -1 pads last."""
    out = _empty_result(nq, k)
    if not parts or k == 0:
        return out
    if len(parts) == 1 and parts[0][1].shape[1] <= k:
        scores, ids = parts[0]
    else:
        scores = np.concatenate([p[0] for p in parts], axis=1)
        ids = np.concatenate([p[1] for p in parts], axis=1)
    valid = ids >= 0
    order = np.lexsort((np.where(valid, ids, np.iinfo(np.int64).max), -scores, ~valid), axis=-1)[:, :k]
    width = order.shape[1]
    taken_ids = np.take_along_axis(ids, order, axis=1)
    out.scores[:, :width] = np.take_along_axis(scores, order, axis=1)
    out.ids[:, :width] = np.where(taken_ids >= 0, taken_ids, -1)
    return out




def _new_file(path: Path) -> BinaryIO:
    """``path`` created (opened for binary writing); :class:`GalleryStoreError` when a file of that name exists.

    In a staging folder the kept files are hard links to the live store's, so
    writing through an existing name would change a live file: a new file never
    takes an existing name.
    """
    try:
        return open(path, "xb")
    except FileExistsError:
        raise GalleryStoreError(
            f"{path.name} already exists in the staging folder of the store's next save (its {HEADER_FILE} field "
            "next_segment may be damaged): a new file never overwrites another; nothing was changed"
        ) from None


def _write_faiss_new(index: Any, path: Path) -> None:
    with _new_file(path) as f:
        faiss.write_index(index, faiss.PyCallbackIOWriter(f.write))


def _write_segment(stage: Path, files: dict[str, str], seg: _NewSegment) -> None:
    """Write a new segment's four files into ``stage``, each a new file (a fresh table: only the segment's own rows)."""
    _write_faiss_new(seg.index, stage / files["index"])
    with _new_file(stage / files["vectors"]) as f:
        np.save(f, np.ascontiguousarray(seg.vectors, dtype=np.float32), allow_pickle=False)
    with _new_file(stage / files["ids"]) as f:
        np.save(f, np.ascontiguousarray(seg.ids, dtype=np.int64), allow_pickle=False)
    _new_file(stage / files["rows"]).close()  # SQLite then fills the empty file it is given
    with _connect_rw(stage / files["rows"]) as conn:
        conn.execute("PRAGMA secure_delete = ON")
        conn.execute(_SCHEMA)
        conn.executemany(
            "INSERT INTO gallery (id, path, camera, site, timestamp, identity) VALUES (?, ?, ?, ?, ?, ?)", seg.rows,
        )
    if _db_ids(stage / files["rows"]).size != seg.ids.size:
        raise GalleryStoreError(f"internal error: a segment table would hold other items than its {seg.ids.size}")


class GalleryStore:
    """An updatable gallery index in a folder (see the module docstring for the files and guarantees)."""

    def __init__(self, folder: Path, header: dict, segments: Sequence[_Segment], template: Any):
        self.folder = folder
        self.header = header
        self.segments = list(segments)
        self.template = template
        self._ids: Optional[np.ndarray] = None
        self._flat: Any = None
        self._norm: Optional[float] = None

    # -- properties ---------------------------------------------------------

    @property
    def factory(self) -> str:
        return self.header["factory"]

    @property
    def dim(self) -> int:
        return int(self.header["dim"])

    @property
    def ntotal(self) -> int:
        return int(self.header["ntotal"])

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def search_params(self) -> dict[str, int]:
        return dict(self.header["search"])

    @property
    def model_fingerprint(self) -> Optional[dict[str, Any]]:
        """The fingerprint of the model the features came from (``header["meta"]["model_fingerprint"]``)."""
        return (self.header.get("meta") or {}).get("model_fingerprint")

    @property
    def ids(self) -> np.ndarray:
        """Every item's id, increasing (the segments' ids in order)."""
        if self._ids is None:
            parts = [s.ids for s in self.segments]
            self._ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return self._ids

    @property
    def vectors(self) -> _Rows:
        """The stored vectors, row i of id ``ids[i]`` (a read-only view over the segments' memory maps)."""
        return _Rows([s.vectors for s in self.segments], self.dim)

    # -- building -----------------------------------------------------------

    @classmethod
    def create(
        cls,
        folder: str | Path,
        features: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        factory: str = "Flat",
        model_fingerprint: Optional[Mapping[str, Any]] = None,
        seed: int = 0,
        meta: Optional[Mapping[str, Any]] = None,
        side_files: Optional[Mapping[str, Any]] = None,
        replaces: Sequence[str] = (),
        clustering_index: Any = None,
        refine: int = 1,
    ) -> "GalleryStore":
        """Build a store over ``features`` [N, d] (one metadata row per feature) into ``folder``.

        Every feature row must be L2-normalised (norm within
        :data:`NORM_TOLERANCE` of 1: scores are cosines), else
        :class:`GalleryStoreError` names the first row that is not.
        ``folder`` must be new, empty, or a store folder (marked): an existing store
        is replaced as a whole; ``replaces`` names other files a marked folder
        may hold that the new store replaces (e.g. an earlier index format's).
        The index is trained on ``features`` when the factory needs training
        (IVF/PQ/OPQ; seeded with ``seed``); too few vectors for the factory
        raises :class:`GalleryStoreError` before anything is written.
        ``clustering_index``: the index the IVF k-means assigns with (e.g. a
        GPU ``IndexFlatIP``; default: the CPU quantizer); the stored index is
        a CPU index either way. ``meta`` goes into the header as is, with
        ``model_fingerprint`` (when given) as ``meta["model_fingerprint"]``;
        a NaN or infinite number in it is refused, naming its key.
        ``side_files``: {name in :data:`SIDE_FILES`: a function writing the
        file at the path it is given}. Searches of any index but a plain
        ``Flat`` re-score the index's candidates exactly from the stored
        vectors; ``refine`` R > 1 makes them the index's top ``R * k`` instead
        of ``k`` (search parameter ``refine``; for compressed factories such
        as PQ, whose codes alone lose close neighbours). The items are
        written as segments of at most :data:`SEGMENT_ITEMS`.
        """
        _with_refine({}, refine)
        folder = Path(os.path.abspath(folder))
        features = _as_features("features", features, unit=True)
        values = _normalise_rows(rows, features.shape[0])
        meta = dict(meta or {})
        if model_fingerprint:
            if meta.get("model_fingerprint") not in (None, dict(model_fingerprint)):
                raise GalleryStoreError("model_fingerprint and meta['model_fingerprint'] differ: give one fingerprint")
            meta["model_fingerprint"] = dict(model_fingerprint)
        _check_meta(meta)
        template = _new_index(factory, features.shape[1])
        _train(template, features, factory, seed, clustering_index)
        kind = _index_kind(template)
        ids = np.arange(features.shape[0], dtype=np.int64)
        header = {
            "format": STORE_FORMAT, "version": STORE_VERSION, "factory": factory, "kind": kind,
            "metric": "inner_product", "dim": int(features.shape[1]), "ntotal": int(features.shape[0]),
            "next_id": int(features.shape[0]), "trained_below": int(features.shape[0]), "seed": int(seed),
            "search": _with_refine(kind_named(kind).default_params(template), refine), "verify": None, "meta": meta,
        }
        store = cls(folder, header, [], template)
        plan = store._new_segments(features, ids, values)
        store._commit(plan, header, fresh=True, side_files=side_files, replaces=replaces)
        return store

    def _new_segments(self, features: np.ndarray, ids: np.ndarray, values: Sequence[tuple],
                      template: Any = None) -> list[_NewSegment]:
        """``features`` under ``ids`` as new segments of at most :data:`SEGMENT_ITEMS`, indexed with ``template`` (the store's)."""
        template = self.template if template is None else template
        out = []
        for start in range(0, int(ids.size), SEGMENT_ITEMS):
            part = slice(start, start + SEGMENT_ITEMS)
            vectors, seg_ids = np.ascontiguousarray(features[part]), ids[part]
            out.append(_NewSegment(seg_ids, vectors, _rebuilt_index(template, vectors, seg_ids),
                                   [(int(i), *v) for i, v in zip(seg_ids, values[part])]))
        return out

    @classmethod
    def open(cls, folder: str | Path, *, previous: Optional["GalleryStore"] = None) -> "GalleryStore":
        """Read a store folder after checking its files against the header (see the module docstring).

        First, when no update is under way, what a killed update left beside the
        folder is cleaned up (:func:`clean_swap_leftovers`). A file this process
        verified before and that has not changed since (same inode, size and
        modification time) is not hashed again. ``previous``: an open store of
        the same folder (e.g. the one a service searches) whose unchanged
        segments are taken over as they are, without reading them again.

        Another process may save the store while it is read (its files are then
        missing, or do not match the header read first): when ``header.json``
        changed during a failed read, the read starts again, up to
        :data:`OPEN_ATTEMPTS` times. A failure with the header unchanged is
        the store's state and is raised at once.
        """
        folder = Path(os.path.abspath(folder))
        for attempt in range(OPEN_ATTEMPTS):
            stamp = header_stamp(folder)
            try:
                return cls._open_once(folder, previous)
            except (OSError, ValueError, FedReIDError):
                if attempt + 1 == OPEN_ATTEMPTS or header_stamp(folder) == stamp:
                    raise
            time.sleep(OPEN_RETRY_PAUSE_S * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @classmethod
    def _open_once(cls, folder: Path, previous: Optional["GalleryStore"]) -> "GalleryStore":
        clean_swap_leftovers(folder)
        header = _read_header(folder)
        for name in header["files"]:
            _check_file(folder, name, header)
        reuse = {}
        if previous is not None and previous.folder == folder and previous.dim == header["dim"] \
                and previous.kind == header["kind"] and previous.factory == header["factory"]:
            for seg in previous.segments:
                if not seg.dirty:
                    reuse[_segment_key(folder, seg.files)] = seg
        segments, last = [], -1
        for name, files, n in _segment_layout(header):
            key = _segment_key(folder, files)
            if key is not None and key in reuse and reuse[key].ntotal == n:
                seg = reuse[key]
                segments.append(_Segment(name, files, seg.ids, seg.vectors, seg.index))
                last = int(seg.ids[-1]) if n else last
                continue
            seg = _read_segment(folder, header, name, files, n, last)
            last = int(seg.ids[-1]) if n else last
            segments.append(seg)
        if sum(s.ntotal for s in segments) != header["ntotal"]:
            raise GalleryStoreError(
                f"{folder / HEADER_FILE} says {header['ntotal']} items but its segments hold "
                f"{sum(s.ntotal for s in segments)}: it is damaged"
            )
        if TEMPLATE_FILE in header["files"]:
            template = _read_faiss(folder / TEMPLATE_FILE, header, 0)
        else:  # a version-3 store: its index, emptied, is the template of new segments
            template = _rebuilt_index(segments[0].index, np.empty((0, header["dim"]), np.float32), np.empty(0, np.int64))
        return cls(folder, header, segments, template)

    def check_files(self) -> dict[str, int]:
        """Hash every file of the store against its header now, whatever this process verified before.

        Raises :class:`GalleryStoreError` naming the first file that differs
        (``index --check``). The files are those of the last save this object
        read or wrote. Returns ``{"files": number checked, "bytes": their total size}``.
        """
        for name in self.header["files"]:
            _check_file(self.folder, name, self.header, full=True)
        records = self.header["files"].values()
        return {"files": len(records), "bytes": int(sum(int(r["bytes"]) for r in records))}

    # -- updates ------------------------------------------------------------

    def add(
        self,
        features: Any,
        rows: Sequence[Mapping[str, Any]],
        *,
        meta: Optional[Mapping[str, Any]] = None,
        side_files: Optional[Mapping[str, Any]] = None,
    ) -> np.ndarray:
        """Add items (features [n, d], L2-normalised as in :meth:`create`, and their metadata rows) as new segments.

        Returns their new ids. The index is not retrained: the new segments'
        indexes are the store's trained template filled with the new items (a store whose every item
        was erased trains its template again on these). The existing segments'
        files are kept as they are (hard links into the new save). A path
        already in the store, or twice in ``rows``, raises
        :class:`GalleryStoreError` before anything changes. ``meta`` updates
        the header's ``meta`` (key by key; finite numbers only); ``side_files`` as in :meth:`create`
        (None for a name deletes that file; names not given are kept).
        """
        features = _as_features("features", features, self.dim, unit=True)
        values = _normalise_rows(rows, features.shape[0])
        _check_meta(meta or {})
        with _writer_lock(self.folder):
            self._before_update()
            return self._add(features, values, meta, side_files)

    def _add(self, features: np.ndarray, values: list[tuple], meta: Optional[Mapping[str, Any]],
             side_files: Optional[Mapping[str, Any]]) -> np.ndarray:
        existing = self._lookup_paths([v[0] for v in values])
        if existing:
            shown = ", ".join(sorted(existing)[:5])
            raise GalleryStoreError(f"store {self.folder} already holds {len(existing)} of these paths ({shown})")
        start = int(self.header["next_id"])
        new_ids = np.arange(start, start + features.shape[0], dtype=np.int64)
        header = dict(self.header, ntotal=self.ntotal + int(new_ids.size), next_id=int(new_ids[-1]) + 1, verify=None)
        template = None
        if not self.template.is_trained:  # every item it was trained on was erased
            template = _new_index(self.factory, self.dim)
            _train(template, features, self.factory, int(self.header.get("seed", 0)))
            header["trained_below"] = header["next_id"]
        plan: list[Any] = list(self.segments) + self._new_segments(features, new_ids, values, template)
        if meta:
            header["meta"] = dict(self.header.get("meta") or {}, **meta)
        self._commit(self._merged(plan, template), header, side_files=side_files, template=template)
        return new_ids

    def remove(self, ids_or_paths: Iterable[int | str], *, meta: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        """Erase items given by id (int) or path (str): the segments holding them are rewritten without them.

        An id is a Python or NumPy integer (not a bool); any other value (a
        float, bytes, None), and unknown ids or paths, raise
        :class:`GalleryStoreError` naming them, and nothing changes. Returns
        the removed ids (sorted). Only the segments holding a removed item are
        rewritten (their index, vectors, ids and table, fresh files); the
        others are kept as they are. HNSW and fast-scan segments are rebuilt
        from their remaining stored vectors (FAISS cannot remove from HNSW,
        and its fast-scan removal leaves codes behind).
        When the index learned from a removed item (a factory that trains,
        and an item it was trained on: ids below ``header["trained_below"]``),
        the template is trained again, seeded as before, on the remaining
        items and every segment is rewritten with it; with fewer items left
        than the factory trains on, the store becomes an exact ``Flat`` one
        (a warning says so), and with none left its template waits untrained
        for the next :meth:`add`.
        ``meta`` updates the header's ``meta`` (key by key; finite numbers only) in the same save.
        """
        if isinstance(ids_or_paths, (str, bytes)):
            raise GalleryStoreError(f"remove: expected a list of item ids or paths, got {ids_or_paths!r:.60} (put one "
                                    "path in a list)")
        wanted = [w if isinstance(w, str) else _item_id(w, "remove") for w in ids_or_paths]
        _check_meta(meta or {})
        if not wanted:
            raise GalleryStoreError("nothing to remove: give ids or paths")
        with _writer_lock(self.folder):
            self._before_update()
            return self._remove(wanted, meta)

    def _before_update(self) -> None:
        """(The update lock held.) Refuse a foreign or changed folder; clean up what a killed update left."""
        _check_store_location(self.folder, fresh=False)
        _remove_leftovers(self.folder)
        self._check_unchanged_on_disk()

    def _remove(self, wanted: list[Any], meta: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        paths = [w for w in wanted if isinstance(w, str)]
        numbers = [w for w in wanted if not isinstance(w, str)]
        found = self._lookup_paths(paths)
        held = set(self.ids.tolist()) if numbers else set()
        unknown = [p for p in paths if p not in found] + [i for i in numbers if i not in held]
        if unknown:
            shown = ", ".join(str(u) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise GalleryStoreError(f"store {self.folder} holds no item {shown} (nothing was removed)")
        gone = np.unique(np.array(numbers + list(found.values()), dtype=np.int64))
        header = dict(self.header, ntotal=self.ntotal - int(gone.size), verify=None)
        if meta:
            header["meta"] = dict(self.header.get("meta") or {}, **meta)
        if self._trained_on_any(gone):
            plan, header, template = self._retrained_without(gone, header)
            self._commit(self._merged(plan, template), header, template=template)
            return gone
        plan: list[Any] = []
        for seg in self.segments:
            hit = np.isin(seg.ids, gone)
            if not hit.any():
                plan.append(seg)
                continue
            keep = ~hit
            if not keep.any():
                continue  # the whole segment goes
            ids, vectors = seg.ids[keep], np.ascontiguousarray(seg.vectors[keep])
            index = _index_without(seg.index, seg.ids[hit], vectors, ids)
            plan.append(_NewSegment(ids, vectors, index, self._segment_rows(seg, ids)))
        self._commit(self._merged(plan), header)
        return gone

    def _trained_on_any(self, ids: np.ndarray) -> bool:
        """Whether the template learned from any of ``ids`` (a store without ``trained_below`` may have from any)."""
        if _new_index(self.factory, self.dim).is_trained:
            return False  # Flat, HNSW over flat codes: nothing is fitted to the items
        below = self.header.get("trained_below")
        return below is None or bool((ids < int(below)).any())

    def _retrained_without(self, gone: np.ndarray, header: dict) -> tuple[list[_NewSegment], dict, Any]:
        """Every remaining item re-encoded with a template trained without ``gone``: ``(plan, header, template)``."""
        ids, vectors, rows = [], [], []
        for seg in self.segments:
            keep = ~np.isin(seg.ids, gone)
            if keep.any():
                ids.append(seg.ids[keep])
                vectors.append(np.asarray(seg.vectors[keep]))
                rows += [r[1:] for r in self._segment_rows(seg, seg.ids[keep])]  # without the id: re-added
        kept_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
        kept = np.concatenate(vectors) if vectors else np.empty((0, self.dim), np.float32)
        template = _new_index(self.factory, self.dim)
        need, why = kind_named(self.kind).training_need(template)
        if 0 < kept_ids.size < need:
            warnings.warn(
                f"store {self.folder}: the {kept_ids.size} items left are too few to train {self.factory!r} again "
                f"without the erased ones (it needs {need}: {why}); the store is now an exact 'Flat' one",
                UserWarning, stacklevel=4,
            )
            template = _new_index("Flat", self.dim)
            refine = {"refine": header["search"]["refine"]} if "refine" in header["search"] else {}
            header.update(factory="Flat", kind=_index_kind(template),
                          search=dict(kind_named(_index_kind(template)).default_params(template), **refine))
        elif kept_ids.size:
            _train(template, kept, self.factory, int(header.get("seed", 0)))
        header["trained_below"] = int(header["next_id"])
        return self._new_segments(kept, kept_ids, rows, template), header, template

    def _merged(self, plan: list[Any], template: Any = None) -> list[Any]:
        """``plan`` with adjacent segments merged (the smallest pair first) while it has more than :data:`MAX_SEGMENTS`.

        Merged segments are indexed with ``template`` (the store's).
        """
        template = self.template if template is None else template
        plan = list(plan)
        while len(plan) > MAX_SEGMENTS:
            sizes = [int(p.ids.size) for p in plan]
            j = int(np.argmin([a + b for a, b in zip(sizes, sizes[1:])]))
            a, b = plan[j], plan[j + 1]
            ids = np.concatenate([a.ids, b.ids])
            vectors = np.concatenate([np.asarray(a.vectors), np.asarray(b.vectors)])
            rows = [r for p in (a, b) for r in (p.rows if isinstance(p, _NewSegment) else self._segment_rows(p, p.ids))]
            plan[j : j + 2] = [_NewSegment(ids, vectors, _rebuilt_index(template, vectors, ids), rows)]
        return plan

    def _segment_rows(self, seg: _Segment, ids: np.ndarray) -> list[tuple]:
        """The table rows of ``ids`` (held by ``seg``), ordered by id, as insert tuples."""
        wanted = [int(i) for i in ids]
        out = []
        with self._table(seg) as conn:
            for chunk in range(0, len(wanted), 500):
                part = wanted[chunk : chunk + 500]
                q = f"SELECT {', '.join(_COLUMNS)} FROM gallery WHERE id IN ({','.join('?' * len(part))}) ORDER BY id"
                out += conn.execute(q, part).fetchall()
        if len(out) != len(wanted):
            raise GalleryStoreError(f"{self.folder / seg.files['rows']} lacks rows of its segment: the store is inconsistent")
        return [tuple(r) for r in out]

    def update_lock(self, timeout: Optional[float] = None) -> contextlib.AbstractContextManager[None]:
        """The store's update lock, held for a block: other processes' (and threads') updates wait until it ends.

        For a caller that must reopen the store and update it with no other
        update in between (e.g. a long-lived service that another process
        updates too): :meth:`open` and this thread's own :meth:`add`/:meth:`remove`
        inside the block take the lock again without waiting. Waits up to
        ``timeout`` seconds (default :data:`LOCK_TIMEOUT_S`), then raises
        :class:`GalleryStoreError`.
        """
        return _writer_lock(self.folder, timeout)

    # -- queries ------------------------------------------------------------

    def _table(self, seg: _Segment) -> _Conn:
        """A read-only connection to ``seg``'s table; a table another process's update removed is a one-line error."""
        path = self.folder / seg.files["rows"]
        try:
            return _connect_ro(path)
        except sqlite3.OperationalError:
            if path.is_file():
                raise
            raise GalleryStoreError(
                f"store {self.folder} changed on disk since this object read it (another process updated it and "
                f"its segment table {path.name} is gone): open the store again"
            ) from None

    def _query_segments(self, sql: str, args: Sequence[Any], segments: Optional[Sequence[_Segment]] = None) -> list[tuple]:
        out: list[tuple] = []
        for seg in self.segments if segments is None else segments:
            with self._table(seg) as conn:
                out += conn.execute(sql, list(args)).fetchall()
        return out

    def rows(self, ids: Iterable[int]) -> list[Optional[dict[str, Any]]]:
        """The metadata rows of ``ids`` in that order (None for -1 or an unknown id).

        Each id is a Python or NumPy integer (not a bool), else :class:`GalleryStoreError` names the value.
        """
        ids = _item_ids(ids, "rows")
        wanted = np.array(sorted({i for i in ids if i >= 0}), dtype=np.int64)
        found = {}
        for seg in self.segments:
            if not seg.ntotal or not wanted.size:
                continue
            part = wanted[(wanted >= seg.ids[0]) & (wanted <= seg.ids[-1])].tolist()
            for chunk in range(0, len(part), 500):
                some = part[chunk : chunk + 500]
                q = f"SELECT {', '.join(_COLUMNS)} FROM gallery WHERE id IN ({','.join('?' * len(some))})"
                for r in self._query_segments(q, some, [seg]):
                    found[r[0]] = dict(zip(_COLUMNS, r))
        return [found.get(i) for i in ids]

    def filtered_ids(
        self,
        cameras: Optional[Iterable[int]] = None,
        sites: Optional[Iterable[str]] = None,
        time_window: Optional[tuple[Optional[float], Optional[float]]] = None,
    ) -> Optional[np.ndarray]:
        """Sorted ids of the items passing the filters (None when no filter is given).

        ``time_window``: ``(since, until)`` in seconds since the epoch, either
        end None for open; both ends inclusive; items without a timestamp fail any window.
        Values outside the rules of :mod:`fedreid.retrieval.fields` raise
        :class:`~fedreid.retrieval.fields.GalleryMetadataError` (a camera of 2**70 names no camera);
        a filter of the wrong shape (``cameras=5``, ``time_window=(5,)``) raises :class:`GalleryStoreError`.
        """
        where, args = [], []
        _check_filter_list(cameras, "cameras", "a list of camera numbers, or comma-separated text")
        _check_filter_list(sites, "sites", "a list of site names, or comma-separated text")
        if cameras is not None:
            cams = fields.camera_list(cameras, "cameras filter")
            where.append(f"camera IN ({','.join('?' * len(cams))})" if cams else "0")
            args += cams
        if sites is not None:
            ss = fields.site_list(sites, "sites filter")
            where.append(f"site IN ({','.join('?' * len(ss))})" if ss else "0")
            args += ss
        if time_window is not None:
            pair = tuple(time_window) if isinstance(time_window, (tuple, list, np.ndarray)) else ()
            if len(pair) != 2:
                raise GalleryStoreError(f"time_window: expected (since, until), each seconds since the epoch or None, "
                                        f"got {time_window!r:.60}")
            since, until = pair
            window = fields.time_window(since, until, "time window ")
            if window is None:
                where.append("timestamp IS NOT NULL")
            else:
                for bound, value in zip(("timestamp >= ?", "timestamp <= ?"), window):
                    if value is not None:
                        where.append(bound)
                        args.append(value)
        if not where:
            return None
        got = self._query_segments(f"SELECT id FROM gallery WHERE {' AND '.join(where)}", args)
        return np.unique(np.array([r[0] for r in got], dtype=np.int64))

    def search(
        self,
        queries: Any,
        k: int,
        *,
        cameras: Optional[Iterable[int]] = None,
        sites: Optional[Iterable[str]] = None,
        time_window: Optional[tuple[Optional[float], Optional[float]]] = None,
        search_params: Optional[Mapping[str, int]] = None,
        flat_index: Any = None,
    ) -> SearchResult:
        """Top-``k`` ids and scores of each query, optionally filtered (see the module docstring).

        Scores are the exact inner products with the stored vectors for every
        index kind; which items are candidates is the index's (approximate) choice.
        ``search_params`` overrides the stored ``nprobe``/``efSearch`` for this call.
        ``flat_index``: for an :attr:`exact` store, an index that picks the candidates of
        unfiltered searches instead of the segments' (e.g. a GPU copy of :meth:`flat_faiss_index`);
        the ids and scores are those of a search without it. One that does not
        hold the store's current vectors in order (taken before an update, or
        another store's) raises :class:`GalleryStoreError`. Other stores ignore it.
        """
        queries = _as_features("queries", queries, self.dim)
        k = _capped_k(k, self.ntotal)
        allowed = self.filtered_ids(cameras, sites, time_window)
        params = dict(self.search_params, **_check_search_params(self.kind, search_params or {}, "search_params",
                                                                   complete=False))
        if allowed is None:
            if flat_index is not None and self.exact:
                self._check_flat_index(flat_index)
            return self._index_search(queries, k, params, flat_index=flat_index)
        if allowed.size == 0 or self.ntotal == 0:
            return _empty_result(queries.shape[0], k)
        if allowed.size <= EXACT_FILTER_MAX or kind_named(self.kind).exact_filters \
                or not _accepts_search_parameters(self.template):
            # Only ids this object holds: the table on disk may be a newer store's (another process's update).
            ids = self.ids
            rows = np.minimum(np.searchsorted(ids, allowed), max(ids.size - 1, 0))
            held = ids[rows] == allowed
            if not held.any():
                return _empty_result(queries.shape[0], k)
            return _exact_search(queries, self.vectors[rows[held]], allowed[held], k)
        return self._index_search(queries, k, params, selector=faiss.IDSelectorBatch(allowed))

    @property
    def exact(self) -> bool:
        """Whether the index itself finds the true top-k: a bare ``Flat`` (no pre-transform such as ``PCA8,Flat``)."""
        return self.kind == "flat" and self._plain_flat()

    def flat_faiss_index(self) -> Any:
        """An ``IndexFlatIP`` over an :attr:`exact` store's vectors (row i holds id ``ids[i]``), for :meth:`search`.

        With one segment, the segment's own index; with several, one index
        built over all their vectors (a copy, made once per store state). The
        returned object keeps what it points into alive, so it stays valid
        after an update; but it describes the store as it is now: after an
        update :meth:`search` refuses it, and any copy of it (take a new one).
        A store whose index is not a bare Flat is refused: its search picks
        candidates in the transformed space (then re-scores them), which a
        flat index over the vectors would not reproduce.
        """
        if not self.exact:
            raise GalleryStoreError(f"store {self.folder} holds a {self.kind} index ({self.factory}), not a bare Flat one")
        stamp = _FlatIndexStamp(self._state())
        if len(self.segments) == 1:
            seg = self.segments[0]
            flat = faiss.downcast_index(seg.index.index)
            # The segment's IndexIDMap2 owns this index's memory and an update drops the segment: FAISS's
            # referenced_objects (the one attribute it lets Python add) keeps it alive with the returned object.
            flat.referenced_objects = [seg.index, stamp]
            return flat
        if self._flat is None:
            self._flat = faiss.IndexFlatIP(self.dim)
            for seg in self.segments:
                if seg.ntotal:
                    self._flat.add(np.ascontiguousarray(seg.vectors, dtype=np.float32))
        self._flat.referenced_objects = [stamp]
        return self._flat

    def _state(self) -> tuple[str, tuple[str, ...]]:
        """What names this object's items in a stamp: the folder and its segments (a name never holds two contents)."""
        return str(self.folder), tuple(seg.name for seg in self.segments)

    def _check_flat_index(self, flat_index: Any) -> None:
        """Refuse a ``flat_index`` that does not hold this store's vectors as they are now, row i that of ``ids[i]``.

        Its dimension, metric and item count must be the store's; one that
        :meth:`flat_faiss_index` returned must be of the store's current
        segments; and, for copies (e.g. on a GPU), up to 16 evenly spread rows,
        the first and the last among them, must be the stored vectors bit for
        bit (an update appends its items last, or shifts the rows after a removed one).
        """
        try:
            n, d, metric = int(flat_index.ntotal), int(flat_index.d), flat_index.metric_type
        except (AttributeError, TypeError):
            raise GalleryStoreError(
                f"flat_index must be a faiss flat index (store.flat_faiss_index() or a GPU copy of it), got "
                f"{type(flat_index).__name__}"
            ) from None
        stale = "it was taken before an update of the store, or from another store: take store.flat_faiss_index() again"
        if d != self.dim or metric != faiss.METRIC_INNER_PRODUCT:
            raise GalleryStoreError(f"flat_index is a {d}-d index of metric {metric}, but store {self.folder} searches "
                                    f"{self.dim}-d features by inner product ({faiss.METRIC_INNER_PRODUCT})")
        if n != self.ntotal:
            raise GalleryStoreError(f"flat_index holds {n} vectors but store {self.folder} holds {self.ntotal}: {stale}")
        stamps = [r for r in getattr(flat_index, "referenced_objects", None) or () if isinstance(r, _FlatIndexStamp)]
        state = stamps[0].state if stamps else None
        if state is not None and state != self._state():
            if state[0] == str(self.folder):
                raise GalleryStoreError(f"flat_index was taken from store {self.folder} before an update of it: take "
                                        "store.flat_faiss_index() again")
            raise GalleryStoreError(f"flat_index belongs to store {state[0]}, not to store {self.folder}: take this "
                                    "store's flat_faiss_index()")
        vectors = self.vectors
        for row in np.unique(np.linspace(0, n - 1, min(n, 16)).round().astype(np.int64)):
            try:
                got = np.asarray(flat_index.reconstruct(int(row)), dtype=np.float32)
            except RuntimeError:
                raise GalleryStoreError(f"flat_index (a {type(flat_index).__name__}) cannot return its vectors: "
                                        "expected a flat index (store.flat_faiss_index() or a GPU copy of it)") from None
            if not np.array_equal(got, vectors[int(row)]):
                raise GalleryStoreError(f"flat_index row {int(row)} is not the stored vector of item "
                                        f"{int(self.ids[row])} of store {self.folder}: {stale}")

    def _max_norm(self) -> float:
        """The largest L2 norm among the stored vectors (cached until the next update)."""
        if self._norm is None:
            from fedreid.retrieval.exact import max_row_norm

            self._norm = max((max_row_norm(seg.vectors) for seg in self.segments if seg.ntotal), default=0.0)
        return self._norm

    def _exact_flat_search(self, queries: np.ndarray, k: int, flat_index: Any = None) -> SearchResult:
        """A bare Flat store's top-``k``: the ids and scores of :meth:`exact_search`, whatever the batch.

        FAISS (the segments' indexes, or ``flat_index``) only picks each
        query's best candidates: its scores depend on the batch (for 20
        queries or more it runs a BLAS matmul, which sums each product in an
        order set by the item's place in the kernel), so two equal vectors
        could score a unit in the last place apart and break the tie rule.
        The candidates are scored again per pair (:meth:`_rescore`, as a
        filtered search scores them); a query whose ``k``-th exact score is
        within the two computations' error bound
        (:func:`~fedreid.retrieval.exact.score_error_bound`) of the last
        candidate's FAISS score, where an item left out could tie or beat
        it, is searched again exactly (:meth:`exact_search`).
        """
        from fedreid.retrieval.exact import score_error_bound

        nq, n = queries.shape[0], self.ntotal
        # Twice k plus a margin leaves room for ties at the k-th place; a GPU index returns at most 2048.
        want = min(n, max(k, min(2 * k + 16, 2048)))
        if flat_index is not None:
            scores, rows = _faiss_topk(flat_index, queries, want)
            candidates, last = np.where(rows >= 0, self.ids[np.maximum(rows, 0)], -1), scores[:, -1]
        else:
            parts = []
            for seg in self.segments:
                if seg.ntotal:
                    scores, rows = _faiss_topk(faiss.downcast_index(seg.index.index), queries, min(want, seg.ntotal))
                    parts.append((scores, np.where(rows >= 0, seg.ids[np.maximum(rows, 0)], -1)))
            merged = _merge_topk(parts, nq, want)  # an item left out scores at most the last kept one
            candidates, last = merged.ids, merged.scores[:, -1]
        out = self._rescore(queries, candidates, k)
        if want < n:
            bound = score_error_bound(queries, self._max_norm())
            doubt = np.flatnonzero(out.scores[:, k - 1].astype(np.float64) <= last.astype(np.float64) + bound)
            if doubt.size:
                again = self.exact_search(queries[doubt], k)
                out.scores[doubt], out.ids[doubt] = again.scores, again.ids
        return out

    def _index_search(self, queries: np.ndarray, k: int, params: Mapping[str, int], selector: Any = None,
                      flat_index: Any = None) -> SearchResult:
        """Each segment's index searched, the results merged by (score desc, id asc).

        A plain ``Flat`` index (or its ``flat_index``) gives the exact top-k
        (:meth:`_exact_flat_search`). Any other index (compressed codes, a
        pre-transform such as PCA, a graph) only picks each query's ``refine * k`` candidates; those are re-scored
        from the stored vectors (:meth:`_rescore`), so every score returned is
        the true inner product and the same item scores the same whether the
        search was filtered or not.
        """
        nq = queries.shape[0]
        if self.ntotal == 0:
            return _empty_result(nq, k)
        if selector is None and self.exact:
            return self._exact_flat_search(queries, k, flat_index)
        p = _search_params(self.kind, params, selector) if _accepts_search_parameters(self.template) else None
        refine = int(params.get("refine", 1) or 1)
        want = min(k * max(refine, 1), self.ntotal)
        parts = []
        for seg in self.segments:
            if seg.ntotal:
                parts.append(_segment_topk(seg.index, queries, min(want, seg.ntotal), seg.ntotal, p))
        merged = _merge_topk(parts, nq, want)
        return self._rescore(queries, merged.ids, k)

    def _plain_flat(self) -> bool:
        """Whether the index is a bare ``IndexFlat`` (no pre-transform): its scores are the stored vectors' own."""
        return isinstance(faiss.downcast_index(self.template.index), faiss.IndexFlat)

    def _rescore(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> SearchResult:
        """Exact inner products of ``candidates`` (ids, -1 pads) from the stored vectors; the best ``k`` of each row.

        Equal scores: the smaller id first; pads rank last. Queries are done
        in blocks so the gathered candidate vectors stay under about 64 MB.
        """
        from fedreid.retrieval.exact import pair_scores

        out = _empty_result(queries.shape[0], k)
        nq, nc = candidates.shape
        kk = min(k, nc)
        ids, vectors = self.ids, self.vectors
        block = max(1, (64 << 20) // max(1, nc * self.dim * 4))
        for s in range(0, nq, block):
            cand = candidates[s : s + block]
            valid = cand >= 0
            rows = np.searchsorted(ids, np.where(valid, cand, ids[0] if ids.size else 0))
            gathered = np.asarray(vectors[rows.ravel()], dtype=np.float32).reshape(*cand.shape, self.dim)
            scores = pair_scores(queries[s : s + block], gathered)
            scores[~valid] = -np.inf
            order = np.lexsort((np.where(valid, cand, np.iinfo(np.int64).max), -scores), axis=-1)[:, :kk]
            out.scores[s : s + block, :kk] = np.take_along_axis(scores, order, axis=1)
            out.ids[s : s + block, :kk] = np.where(
                np.isfinite(out.scores[s : s + block, :kk]), np.take_along_axis(cand, order, axis=1), -1
            )
        return out

    def exact_search(self, queries: Any, k: int) -> SearchResult:
        """Exact top-``k`` over the stored vectors (the reference :meth:`verify` compares with)."""
        from fedreid.retrieval.exact import block_topk

        queries = _as_features("queries", queries, self.dim)
        k = _capped_k(k, self.ntotal)
        if k == 0:
            return _empty_result(queries.shape[0], 0)
        parts = []
        for seg in self.segments:
            if seg.ntotal:
                scores, rows = block_topk(queries, seg.vectors, min(k, seg.ntotal))
                parts.append((scores, seg.ids[rows]))
        return _merge_topk(parts, queries.shape[0], k)

    # -- verification and tuning -------------------------------------------

    def recall(self, sample: int = 200, k: int = 10, seed: int = 0,
               search_params: Optional[Mapping[str, int]] = None) -> dict[str, Any]:
        """Recall@k of the index against exact search, on ``sample`` stored vectors drawn with ``seed``.

        recall@k = mean over queries of |approximate top-k ∩ exact top-k| / k
        (k cut to the store's size). Nothing is saved.
        """
        if self.ntotal == 0:
            raise GalleryStoreError(f"store {self.folder} is empty: nothing to verify")
        rng = np.random.default_rng(int(seed))
        n = min(int(sample), self.ntotal)
        rows = np.sort(rng.choice(self.ntotal, size=n, replace=False))
        queries = np.ascontiguousarray(self.vectors[rows], dtype=np.float32)
        k = min(int(k), self.ntotal)
        exact = self.exact_search(queries, k).ids
        params = dict(self.search_params, **_check_search_params(self.kind, search_params or {}, "search_params",
                                                                   complete=False))
        approx = self._index_search(queries, k, params).ids
        hits = [len(np.intersect1d(a[a >= 0], e)) for a, e in zip(approx, exact)]
        return {"recall": float(np.mean(hits) / k), "k": k, "sample": n, "seed": int(seed), "search": params}

    def verify(self, sample: int = 200, k: int = 10, seed: int = 0) -> dict[str, Any]:
        """:meth:`recall` with the stored search parameters, recorded in the header (an atomic update)."""
        result = self.recall(sample, k, seed)
        self._commit_header(dict(self.header, verify=result))
        return result

    def tune(self, target_recall: float, sample: int = 200, k: int = 10, seed: int = 0) -> dict[str, Any]:
        """Pick the smallest ``nprobe`` (IVF) or ``efSearch`` (HNSW) whose recall@k reaches ``target_recall``.

        Candidates are :data:`NPROBE_CANDIDATES` (up to the number of lists) or
        :data:`EF_SEARCH_CANDIDATES`; when none reaches the target the largest is
        kept and ``reached`` is False. The choice and its recall are saved in the
        header (``search``, ``verify``, ``tuned``). A flat index is exact: recall 1 with no parameter.
        """
        if not 0 < float(target_recall) <= 1:
            raise GalleryStoreError(f"target recall must be in (0, 1], got {target_recall}")
        name, values = kind_named(self.kind).tune_grid(self.template)
        tried = []
        result = self.recall(sample, k, seed)
        for v in values:
            result = self.recall(sample, k, seed, search_params={name: v})
            tried.append({name: v, "recall": result["recall"]})
            if result["recall"] >= float(target_recall):
                break
        reached = result["recall"] >= float(target_recall)
        tuned = {"target_recall": float(target_recall), "reached": bool(reached), "tried": tried}
        header = dict(self.header, search=result["search"], verify=result, tuned=tuned)
        self._commit_header(header)
        return dict(result, **tuned)

    # -- files --------------------------------------------------------------

    def find_paths(self, paths: Sequence[str]) -> dict[str, int]:
        """{path: id} of the given paths the store holds (exact, as stored)."""
        return self._lookup_paths(list(paths))

    def holds_under(self, folder: str, excluding: Iterable[int] = ()) -> bool:
        """Whether an item other than ``excluding`` has its file under ``folder``, or is that file (a stored, absolute path)."""
        prefix = folder.rstrip(os.sep) + os.sep
        skip = {int(i) for i in excluding}
        # substr, not LIKE: a folder name may hold % or _
        got = self._query_segments(
            "SELECT id FROM gallery WHERE substr(path, 1, length(?1)) = ?1 OR path = ?3 LIMIT ?2",
            (prefix, len(skip) + 1, folder),
        )
        return any(int(i) not in skip for (i,) in got)

    def find_file_name(self, name: str) -> list[tuple[int, str]]:
        """``(id, path)`` of the items whose path ends with the file name ``name`` (sorted by id)."""
        if not name or "/" in name or os.sep in name:
            raise GalleryStoreError(f"{name!r} is not a bare file name")
        got = self._query_segments(
            "SELECT id, path FROM gallery WHERE path = ?1 OR substr(path, -length(?2)) = ?2", (name, os.sep + name),
        )
        return sorted((int(i), str(p)) for i, p in got)

    def _lookup_paths(self, paths: Sequence[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for chunk in range(0, len(paths), 500):
            part = list(paths[chunk : chunk + 500])
            q = f"SELECT path, id FROM gallery WHERE path IN ({','.join('?' * len(part))})"
            found.update(dict(self._query_segments(q, part)))
        return found

    def _commit(self, plan: list[Any], header: dict, *, fresh: bool = False,
                side_files: Optional[Mapping[str, Any]] = None, replaces: Sequence[str] = (),
                template: Any = None) -> None:
        """Stage the new save (kept segments linked, new ones written), swap it in, then adopt it in memory.

        Side files: those in ``side_files`` are written by their function (None:
        left out); the others are carried over from the current folder (not on ``fresh``).
        ``template``: a new template, written instead of the current one's link.
        """
        folder = self.folder
        side_files = dict(side_files or {})
        unknown = sorted(set(side_files) - set(SIDE_FILES))
        if unknown:
            raise GalleryStoreError(f"not side files of a store: {unknown} (expected some of {list(SIDE_FILES)})")
        with _writer_lock(folder):
            _check_store_location(folder, fresh=fresh, replaces=replaces)
            _remove_leftovers(folder)
            if not fresh:
                self._check_unchanged_on_disk()
            self._write_and_swap(plan, header, fresh=fresh, side_files=side_files, template=template)

    def _write_and_swap(self, plan: list[Any], header: dict, *, fresh: bool, side_files: dict[str, Any],
                        template: Any = None) -> None:
        """Build the new save in a hidden sibling and swap it in (:func:`replace_dir_atomically`).

        Unchanged files (the template, kept segments, carried side files) are
        hard links to the current ones: nothing of them is written or hashed;
        their records are copied from the header. New segment files get fresh
        names (``seg-<n>``, ``next_segment`` counts up), so no name ever holds
        two contents.
        """
        folder = self.folder
        stage = swap_sibling(folder, "tmp")
        next_segment = 0 if fresh else int(self.header.get("next_segment", 0))
        old_files = {} if fresh else self.header["files"]
        files: dict[str, dict[str, Any]] = {}
        segments, entries = [], []
        try:
            claim_output_dir(stage, MARKER_KIND, tool=TOOL)
            if TEMPLATE_FILE in old_files and template is None:
                _link_or_copy(folder / TEMPLATE_FILE, stage / TEMPLATE_FILE)
                files[TEMPLATE_FILE] = old_files[TEMPLATE_FILE]
            else:
                _write_faiss_new(self.template if template is None else template, stage / TEMPLATE_FILE)
                files[TEMPLATE_FILE] = _written_record(stage / TEMPLATE_FILE)
            for item in plan:
                if isinstance(item, _Segment) and not item.dirty:
                    name = item.name
                    if not _SEGMENT_NAME.match(name):  # a version-3 store's files: linked under segment names
                        name, next_segment = f"seg-{next_segment:06d}", next_segment + 1
                    seg_files = _segment_files(name)
                    for role, old in item.files.items():
                        _link_or_copy(folder / old, stage / seg_files[role])
                        files[seg_files[role]] = old_files[old]
                    segments.append(_Segment(name, seg_files, item.ids, item.vectors, item.index))
                else:
                    if isinstance(item, _Segment):  # rebuilt in memory when opened: saved now
                        item = _NewSegment(item.ids, np.asarray(item.vectors), item.index,
                                           self._segment_rows(item, item.ids))
                    name, next_segment = f"seg-{next_segment:06d}", next_segment + 1
                    seg_files = _segment_files(name)
                    _write_segment(stage, seg_files, item)
                    for fname in seg_files.values():
                        files[fname] = _written_record(stage / fname)
                    segments.append(_Segment(name, seg_files, item.ids, None, item.index))
                entries.append({"name": name, "ntotal": int(item.ids.size)})
            for name in SIDE_FILES:
                if name in side_files:
                    if side_files[name] is not None:
                        side_files[name](stage / name)
                elif not fresh and (folder / name).is_file():
                    _link_or_copy(folder / name, stage / name)
            header = dict(header, version=STORE_VERSION, segments=entries, next_segment=next_segment, files=files)
            write_json_atomic(stage / HEADER_FILE, header)
            replace_dir_atomically(stage, folder, aside=swap_sibling(folder, "old"))
        finally:
            if stage.exists():
                _delete_marker_last(stage)
        for seg in segments:
            if seg.vectors is None:
                seg.vectors = _read_npy(folder / seg.files["vectors"], "vectors", np.float32, (seg.ntotal, self.dim),
                                        mmap=True)
        self.header, self.segments, self._ids, self._flat, self._norm = header, segments, None, None, None
        if template is not None:
            self.template = template

    def _check_unchanged_on_disk(self) -> None:
        """Refuse to update from a store object whose folder another process has changed since."""
        try:
            on_disk = json.loads((self.folder / HEADER_FILE).read_text())
        except (OSError, ValueError):
            on_disk = None
        if on_disk != json.loads(json.dumps(self.header)):
            raise GalleryStoreError(
                f"store {self.folder} changed on disk since it was opened (another process updated it): "
                "open it again and repeat the update (nothing was changed)"
            )

    def _commit_header(self, header: dict) -> None:
        """Replace ``header.json`` alone (one ``os.replace``): the data files and their records are unchanged."""
        folder = self.folder
        with _writer_lock(folder):
            _check_store_location(folder, fresh=False)
            self._check_unchanged_on_disk()
            for p in folder.iterdir():
                if _HEADER_TEMP.match(p.name) and p.is_file():
                    p.unlink()
            write_json_atomic(folder / HEADER_FILE, header)
        self.header = header


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _segment_topk(index: Any, queries: np.ndarray, k: int, n: int, params: Any) -> tuple[np.ndarray, np.ndarray]:
    """A segment index's top-``k`` by (score descending, id ascending); -1 pads (score -inf) last.

    FAISS keeps an arbitrary one of several items that tie at place k (common
    with quantised scores, e.g. a fast-scan PQ's): one extra result shows such
    a tie, and that query is searched again, deeper, until every item with the
    k-th score is in, so the segment's cut follows the store's tie rule.
    """
    deep = min(k + 1, n)
    scores, ids = index.search(queries, deep, params=params)
    out_s, out_i = np.array(scores[:, :k]), np.array(ids[:, :k])
    if deep > k:
        for r in np.flatnonzero((ids[:, k] >= 0) & (scores[:, k - 1] == scores[:, k])):
            row_s, row_i, depth = scores[r : r + 1], ids[r : r + 1], deep
            while depth < n and row_i[0, -1] >= 0 and row_s[0, -1] == scores[r, k - 1]:
                depth = min(2 * depth, n)
                row_s, row_i = index.search(queries[r : r + 1], depth, params=params)
            best = _merge_topk([(row_s, row_i)], 1, k)
            out_s[r], out_i[r] = best.scores[0], best.ids[0]
    valid = out_i >= 0
    order = np.lexsort((np.where(valid, out_i, np.iinfo(np.int64).max), -out_s, ~valid), axis=-1)
    out_s, out_i = np.take_along_axis(out_s, order, axis=1), np.take_along_axis(out_i, order, axis=1)
    out_s[out_i < 0] = -np.inf
    return out_s, out_i


def _faiss_topk(index: Any, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``index.search`` of ``queries`` in blocks (bounded result buffers): ``(scores, rows)``, ``k`` columns."""
    from fedreid.retrieval.exact import DEFAULT_SEARCH_BLOCK

    if queries.shape[0] <= DEFAULT_SEARCH_BLOCK:
        return index.search(queries, k)
    parts = [index.search(queries[s : s + DEFAULT_SEARCH_BLOCK], k) for s in range(0, queries.shape[0], DEFAULT_SEARCH_BLOCK)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _capped_k(k: Any, ntotal: int) -> int:
    """``k`` (an integer >= 1, else :class:`GalleryStoreError`) cut to ``ntotal``: no result has more columns."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) < 1:
        raise GalleryStoreError(f"k must be an integer >= 1, got {k!r:.40}")
    return min(int(k), int(ntotal))


def _empty_result(nq: int, k: int) -> SearchResult:
    return SearchResult(scores=np.full((nq, k), -np.inf, np.float32), ids=np.full((nq, k), -1, np.int64))


def _exact_search(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int) -> SearchResult:
    from fedreid.retrieval.exact import block_topk

    kk = min(k, vectors.shape[0])
    scores, rows = block_topk(queries, vectors, kk)
    out = _empty_result(queries.shape[0], k)
    out.scores[:, :kk], out.ids[:, :kk] = scores, ids[rows]
    return out






def _writer_lock(folder: Path, timeout: Optional[float] = None) -> contextlib.AbstractContextManager[None]:
    """The update lock of the store at ``folder`` (:func:`~fedreid.retrieval.store_files.writer_lock`).

    Waits up to ``timeout`` seconds (default :data:`LOCK_TIMEOUT_S`) for another writer.
    """
    return writer_lock(folder, LOCK_TIMEOUT_S if timeout is None else timeout)


def _copy_index(index: Any) -> Any:
    return faiss.deserialize_index(faiss.serialize_index(index))


def _rebuilt_index(index: Any, vectors: np.ndarray, ids: np.ndarray) -> Any:
    """A copy of ``index`` emptied (its training kept) and filled with ``vectors`` under ``ids``."""
    fresh = _copy_index(index)
    fresh.reset()
    if ids.size:
        fresh.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids)
    return fresh


def _inner_ivf(index: Any) -> Any:
    """The IVF inside an ``IndexIDMap2`` (through any pre-transform such as OPQ), or None."""
    return inner_ivf(index)


def _inner_ids_match_positions(index: Any) -> bool:
    """Whether an IVF's inner ids are exactly 0..ntotal-1, the positions of ``IndexIDMap2.id_map`` (True: no IVF).

    ``IndexIDMap2`` translates an inner id ``j`` to ``id_map[j]``; a flat or
    HNSW index numbers its rows by position itself, an IVF stores the inner id
    it was given in its inverted lists, so only an IVF can fall out of step.
    """
    ivf = _inner_ivf(index)
    if ivf is None:
        return True
    n = int(index.ntotal)
    if int(ivf.ntotal) != n:
        return False
    seen = np.zeros(n, dtype=bool)
    for inner in _inner_id_lists(ivf):
        if inner.min() < 0 or inner.max() >= n or seen[inner].any():
            return False
        seen[inner] = True
    return bool(seen.all())


def _inner_id_lists(ivf: Any) -> Iterator[np.ndarray]:
    """Each non-empty inverted list's inner ids, as a writable view released after its turn."""
    lists = ivf.invlists
    for list_no in range(int(ivf.nlist)):
        size = int(lists.list_size(list_no))
        if not size:
            continue
        pointer = lists.get_ids(list_no)
        try:
            yield faiss.rev_swig_ptr(pointer, size)
        finally:
            lists.release_ids(list_no, pointer)


def _renumber_inner_ids(ivf: Any, kept: np.ndarray) -> None:
    """Rewrite the inner ids of ``ivf``'s inverted lists from old to new ``IndexIDMap2`` positions.

    ``IndexIDMap2.remove_ids`` compacts ``id_map`` (position ``j`` moves to
    ``j - (removed positions before j)``) but an IVF keeps the inner ids it
    stored; ``kept`` [old ntotal] marks the old positions that remain. The ids
    are rewritten in place (a writable view of each list's id array): O(items).
    """
    new_position = np.cumsum(kept, dtype=np.int64) - 1
    for inner in _inner_id_lists(ivf):
        inner[:] = new_position[inner]


def _index_without(index: Any, gone: np.ndarray, vectors: np.ndarray, ids: np.ndarray) -> Any:
    """A copy of the store's ``index`` without the ids ``gone``; ``vectors``/``ids``: the items that remain.

    Every remaining item keeps its id, and nothing of a removed item stays in
    the index: HNSW (no removal in FAISS) and fast-scan indexes (whose FAISS
    removal leaves codes in freed slots) are rebuilt from the remaining stored
    vectors (:func:`~fedreid.retrieval.index_kinds.rebuilds_on_remove`),
    which gives the index a fresh build without the removed items would have;
    an IVF's inner ids are renumbered after
    ``remove_ids`` (see :func:`_renumber_inner_ids`); flat and flat-code indexes
    compact their rows as ``IndexIDMap2`` does. Should the result still not map
    its inner ids one to one (an inverted-list kind this code does not know),
    it is rebuilt from the stored vectors instead.
    """
    if rebuilds_on_remove(index):
        return _rebuilt_index(index, vectors, ids)
    fresh = _copy_index(index)
    kept = ~np.isin(faiss.vector_to_array(fresh.id_map), gone)
    fresh.remove_ids(faiss.IDSelectorBatch(gone))
    ivf = _inner_ivf(fresh)
    if ivf is not None:
        _renumber_inner_ids(ivf, kept)
    if not _inner_ids_match_positions(fresh) or not np.array_equal(faiss.vector_to_array(fresh.id_map), ids):
        return _rebuilt_index(index, vectors, ids)
    return fresh














































def _read_segment(folder: Path, header: dict, name: str, files: Mapping[str, str], n: int, last: int) -> _Segment:
    """A segment's files read (already checked against the header): ids, mapped vectors, table ids, index."""
    ids_path = folder / files["ids"]
    ids = _read_npy(ids_path, "ids", np.int64, (n,))
    vectors = _read_npy(folder / files["vectors"], "vectors", np.float32, (n, header["dim"]), mmap=True)
    if ids.size and (np.any(np.diff(ids) <= 0) or ids[0] <= last or ids[-1] >= header["next_id"]):
        raise GalleryStoreError(f"{ids_path}: ids are not increasing ids below next_id, after the previous segment's")
    db_ids = _db_ids(folder / files["rows"])
    if not np.array_equal(db_ids, ids):
        raise GalleryStoreError(
            f"{folder / files['rows']} lists {db_ids.size} items but {ids_path} {ids.size}, or other ids: "
            "the store is inconsistent"
        )
    index_path = folder / files["index"]
    index = _read_faiss(index_path, header, n)
    dirty = False
    if not np.array_equal(faiss.vector_to_array(index.id_map), ids) or not _inner_ids_match_positions(index):
        # An IVF store whose removal shifted its ids (fixed since): its vectors and ids are right, its index not.
        warnings.warn(
            f"{index_path} maps its items to the wrong ids (a removal by an earlier version shifted "
            f"them): searching an index rebuilt in memory from {files['vectors']}; the next update of the store "
            "saves it", UserWarning, stacklevel=3,
        )
        index, dirty = _rebuilt_index(index, np.asarray(vectors), ids), True
    return _Segment(name, dict(files), ids, vectors, index, dirty)






