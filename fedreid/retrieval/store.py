"""A gallery store: a FAISS index chosen by factory string, stable 64-bit ids, SQLite metadata.

A store is a folder of immutable segments (format version 4)::

    <folder>/header.json        the manifest: format ``fedreid-gallery-store``, version 4, factory, kind, dim,
                                ntotal, next_id, search parameters, the last verify result, ``meta`` (the
                                caller's: the model fingerprint is ``meta.model_fingerprint``, where
                                :func:`fedreid.inference.model_io.check_index_model` reads it), ``segments`` (name and
                                item count of each, in id order), ``next_segment`` (the next segment number) and
                                ``files``: the size and SHA-256 of every data file below
    <folder>/template.faiss     the trained, empty ``IndexIDMap2`` (inner-product metric) every segment's index is
                                a copy of
    <folder>/seg-<n>.faiss      one segment's index: the template filled with the segment's items under their ids
    <folder>/seg-<n>.vectors.npy   its float32 features [items, d], row i has id ids[i]
    <folder>/seg-<n>.ids.npy    its int64 ids, increasing, all above the previous segment's
    <folder>/seg-<n>.sqlite     its rows: table ``gallery(id INTEGER PRIMARY KEY, path TEXT UNIQUE NOT NULL,
                                camera INTEGER, site TEXT, timestamp REAL, identity)``
    <folder>/.fedreid-index.json   the folder's marker (:func:`fedreid.utils.io.claim_output_dir`)
    <folder>/skipped.csv        optional (:data:`SIDE_FILES`): the index tool's list of unreadable
                                images; carried over by updates unless the update replaces it

A segment's files are never changed: a name (``seg-<n>``, numbered from
``next_segment``, never reused) always holds the same bytes. A path is unique
across the store (checked before an add). Version 3 (one ``index.faiss``,
``vectors.npy``, ``ids.npy``, ``meta.sqlite``) still opens and searches, read as
one segment; its first update converts it (those files become ``seg-<n>`` by
hard links, ``template.faiss`` is written). Other versions are refused with a
one-line error that says how to rebuild the store.

Updates cost what they change. :meth:`GalleryStore.add` writes the new items
as new segments (of at most :data:`SEGMENT_ITEMS`, indexed with the
template: no retraining); :meth:`GalleryStore.remove` rewrites only the segments
holding a removed item, without it (a segment left empty is dropped); every
other file of the new save is a hard link to the current one, so it is
neither written nor hashed again (a file system without hard links gets a
copy: correct, not cheap). When there are more than :data:`MAX_SEGMENTS`
segments, adjacent ones are merged, the smallest pair first. Searches run
each segment's index and merge the top-k by (score descending, id ascending);
where items tie at a segment's place k (FAISS keeps any of them; quantised
scores such as a fast-scan PQ's tie often) the segment is searched deeper, so
the lower ids are kept. With every IVF list probed, a store therefore ranks as
one index over all its items (same training) ranked by that rule.

The header holds no wall-clock time: the same inputs give the same files.

Ids are assigned increasing from ``next_id`` and never reused, so an id names one
gallery item for the store's lifetime. The index is trained once, on the first
gallery (:meth:`GalleryStore.create`); later additions are encoded with that
training (the template). After a removal every remaining item keeps its id, for
every kind: the rewritten segment's index comes from ``remove_ids`` on a copy
(an IVF's inverted lists hold ``IndexIDMap2`` positions, which ``remove_ids``
shifts, so they are renumbered: O(items)); HNSW cannot remove ids in FAISS, so
the segment's graph is rebuilt from its remaining stored vectors (cost: an HNSW
build of that segment). :meth:`GalleryStore.open` checks that each segment's
index maps each item to its id and, where an earlier version's removal shifted
them, searches an index rebuilt in memory from the stored vectors (saved by the
next update).

Index kinds (:data:`SUPPORTED_FACTORIES`): Flat; IVF with Flat, PQ (also fast-scan)
or SQ codes; HNSW over Flat or SQ; PQ; SQ; each optionally behind a pre-transform
(OPQ, PCA, ...). A factory string building anything else (NSG, a plain fast-scan
PQ, ``RFlat`` refinement, HNSW over PQ, which FAISS builds with the L2 metric) is
refused when the store is built, before any training. ``header.json``'s search
parameters (``nprobe``, ``efSearch``, ``refine``: integers >= 1, the kind's own
keys only) are checked when the store opens.

Erasure: :meth:`GalleryStore.remove` rewrites the segments holding the items
into new files without them (a fresh table, written by inserts of the kept
rows only: no deleted record, journal or free page of the removed ones), and
the new save replaces the folder before ``remove`` returns; the previous
segment files are unlinked with the set-aside copy. So no byte of a removed
item's path or vector remains in the store's files. (Copies outside the store,
e.g. backups or the file system's free blocks, are not addressed.)

Refinement: a store created with ``refine=R`` (a search parameter, like
``nprobe``) asks the index for ``R * k`` candidates and orders them by their
exact inner product with the stored vectors; a PQ index then keeps its small
size and speed without the ranking errors of its codes.

Filters (:meth:`GalleryStore.search` with ``cameras``/``sites``/``time_window``):
the allowed ids come from one SQL query. When they are at most
:data:`EXACT_FILTER_MAX`, or the index is HNSW (whose filtered graph search can
return fewer than k items), the filtered search is exact over the stored vectors of
those items; otherwise the index is searched with a FAISS ``IDSelectorBatch``
restricting it to them. Either way, every result satisfies the filter.

Search: ``k`` is cut to the number of items (a result has at most that many
columns, whatever k is asked). Unfiltered search of a Flat store is exact with the tie rule of
:func:`fedreid.eval.retrieval.search` (equal scores: lower id first), so it
ranks exactly as an ``IndexFlatIP`` over the same vectors does.

Crash safety: every update of the items stages the complete new save in a
hidden sibling (``.<name>.tmp-<hex>``: hard links to the kept files, the new
segment files, the new header) and swaps it in with
:func:`fedreid.utils.io.replace_dir_atomically`, so a kill leaves the previous
store or the new one, never a mix; the in-memory store changes only after the
swap. :meth:`GalleryStore.verify` and :meth:`GalleryStore.tune` change only
``header.json``, replaced on its own with one ``os.replace`` (its file records
are unchanged). Leftovers are cleaned up by the next open or update
(:func:`clean_swap_leftovers`): hidden siblings that are marked, or that hold
nothing but a store's file names, since a deletion killed part-way may have
removed the marker first. So a removal's erased items do not outlive a kill
either: the copy set aside by the swap, whole or partly deleted, goes at the
next open or update of the store (the store's own deletions remove the marker last).

Writers: an update holds an exclusive ``flock`` on the store's parent folder
(:data:`LOCK_TIMEOUT_S` to wait for another), and refuses to go on when the
header on disk is no longer the one this object read or wrote (another
process updated the store since): no update is lost to a stale copy.
:meth:`GalleryStore.update_lock` holds the lock across several steps (reopen,
then update), so a long-lived process can update the store without losing
that race to another process.

Memory: an opened store maps each segment's vectors read-only (``mmap``)
rather than reading them into RAM; refinement and filtered search read the rows they need.

Loading (:meth:`GalleryStore.open`) reads the header as JSON, checks every
file's size against it and its SHA-256 before parsing any of them, reads the
NumPy files without pickles, checks the SQLite and faiss file signatures, and
only then gives the index files to ``faiss.read_index``. Nothing is ever
unpickled. Checksums are verified once per file and process: when the store
writes the file, or the first time this process reads it. A verified file is
then trusted while its device, inode, size and modification time are the ones
seen at that check, and that time was more than :data:`RACY_NS` before it (a
same-size rewrite within a coarse timestamp's tick is still hashed). Hard
links keep a kept segment's inode, so a reopen after an update hashes only the
new files; ``open(folder, previous=store)`` (the search service) also takes
over the unchanged segments as they are, without reading them.
:meth:`GalleryStore.check_files` (``index --verify`` is about recall, not
files) hashes every file again whatever was trusted. As for the v2 index, the
checksums detect damage and mix-ups, not forgery.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import faiss
import numpy as np

from fedreid.errors import FedReIDError
from fedreid.retrieval import fields
from fedreid.utils.filecheck import check_recorded_file, describe_kind, file_kind, read_format_header, sha256_file
from fedreid.utils.io import (
    claim_output_dir,
    marker_path,
    owns_folder,
    replace_dir_atomically,
    swap_leftovers,
    swap_sibling,
    write_json_atomic,
)

__all__ = [
    "EXACT_FILTER_MAX",
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

STORE_FORMAT = "fedreid-gallery-store"
STORE_VERSION = 4
#: The earlier single-segment format this code still opens and searches (its first update converts it).
LEGACY_VERSION = 3
HEADER_FILE, TEMPLATE_FILE = "header.json", "template.faiss"
#: A version-3 store's data files, which a version-4 store reads as its one segment.
INDEX_FILE, VECTORS_FILE, IDS_FILE, DB_FILE = "index.faiss", "vectors.npy", "ids.npy", "meta.sqlite"
LEGACY_FILES = (INDEX_FILE, VECTORS_FILE, IDS_FILE, DB_FILE)
#: A segment's files: role -> suffix after the segment's name (``seg-000003.faiss`` ...).
SEGMENT_SUFFIXES = {"index": ".faiss", "vectors": ".vectors.npy", "ids": ".ids.npy", "rows": ".sqlite"}
_SEGMENT_NAME = re.compile(r"^seg-\d{6,}$")
_SEGMENT_FILE = re.compile(r"^seg-\d{6,}(\.faiss|\.vectors\.npy|\.ids\.npy|\.sqlite)$")
#: A build or an add writes segments of at most this many items (a removal rewrites only the segments it hits).
SEGMENT_ITEMS = 65_536
#: After an update, adjacent segments are merged (the smallest pair first) while there are more than this.
MAX_SEGMENTS = 32
#: A file verified less than this long after its modification time is hashed again when next read (see
#: :func:`_check_file`): a file system's coarse timestamps could hide a same-size rewrite within that window.
RACY_NS = 2_000_000_000
#: Files a store folder may hold besides its own, carried over by updates unless replaced.
SIDE_FILES = ("skipped.csv",)
MARKER_KIND = "index"
TOOL = "tools/eval_reid.py index"
#: A filtered search over at most this many allowed items is exact over their stored vectors.
EXACT_FILTER_MAX = 20_000
#: Seconds an update waits for another process's update of a store in the same folder.
LOCK_TIMEOUT_S = 60.0
DEFAULT_NPROBE = 8
DEFAULT_EF_SEARCH = 64
NPROBE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
EF_SEARCH_CANDIDATES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
_IDMAP2_TAG = b"IxM2"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_HEADER_TEMP = re.compile(r"^\.header\.json\..+\.tmp$")  # left by a kill during a header-only update
_SCHEMA = (
    "CREATE TABLE gallery (id INTEGER PRIMARY KEY, path TEXT UNIQUE NOT NULL, camera INTEGER, "
    "site TEXT, timestamp REAL, identity)"
)
_COLUMNS = ("id", "path", "camera", "site", "timestamp", "identity")


class GalleryStoreError(FedReIDError, ValueError):
    """A gallery store cannot be built, read or updated as asked; the message names the folder or file."""


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


#: The index classes a store accepts (below any pre-transform such as OPQ or PCA), by kind: each searches with
#: the store's parameters and filters, and removes items keeping every other item's id. Exact classes: a
#: subclass (e.g. IndexIVFPQR of "IVF,PQ+R") searches or removes differently. (HNSW,PQ is left out: FAISS
#: builds it with the L2 metric whatever the metric asked for.)
_SUPPORTED_CLASSES = {
    "flat": ("IndexFlat", "IndexFlatIP"),
    "ivf": ("IndexIVFFlat", "IndexIVFPQ", "IndexIVFScalarQuantizer", "IndexIVFPQFastScan"),
    "hnsw": ("IndexHNSWFlat", "IndexHNSWSQ"),
    "other": ("IndexPQ", "IndexScalarQuantizer"),
}
#: The factory strings of :data:`_SUPPORTED_CLASSES`, for error messages.
SUPPORTED_FACTORIES = (
    "Flat; IVF<lists>[_HNSW<M>],Flat|PQ<m>[x<bits>][fs]|SQ<bits>; HNSW<M>[,Flat|SQ<bits>]; PQ<m>; SQ<bits>; "
    "each optionally after OPQ<m>[_<d>], PCA[R]<d>, RR<d> or L2norm (e.g. Flat, IVF1024,PQ64, OPQ64,IVF1024,PQ64, "
    "HNSW32)"
)


def _innermost(index: Any) -> Any:
    """The index below the store's ``IndexIDMap2`` and any ``IndexPreTransform`` (downcast)."""
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return inner


def _index_kind(index: Any) -> str:
    inner = _innermost(index)
    name = type(inner).__name__
    for kind, names in _SUPPORTED_CLASSES.items():
        if name in names:
            return kind
    return "unsupported"


def _check_supported(index: Any, factory: str) -> str:
    """The kind of ``index`` (the store's IndexIDMap2 over ``factory``); raises for a class the store cannot run."""
    kind = _index_kind(index)
    if kind != "unsupported" and _innermost(index).metric_type != faiss.METRIC_INNER_PRODUCT:
        kind = "unsupported"
    if kind == "unsupported":
        name = type(_innermost(index)).__name__
        hint = " (for exact re-scoring use the store's refine, e.g. index --refine 4)" if "Refine" in name else ""
        raise GalleryStoreError(
            f"factory {factory!r} builds a faiss {name}, which a gallery store cannot search or update{hint}; "
            f"supported: {SUPPORTED_FACTORIES}"
        )
    return kind


def _accepts_search_parameters(index: Any) -> bool:
    """Whether the store's index takes ``SearchParameters`` (with a selector): a plain PQ takes none."""
    return not isinstance(_innermost(index), faiss.IndexPQ)


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


def check_factory_string(factory: str) -> None:
    """Raise :class:`GalleryStoreError` when FAISS cannot parse ``factory`` (tried at a dimension most accept).

    A string that parses may still not fit the features' dimension (e.g. PQ7
    for 16-d features): :meth:`GalleryStore.create` says so.
    """
    try:
        _new_index(factory, _PROBE_DIM)
    except GalleryStoreError as exc:
        text = str(exc).replace(f" for dim {_PROBE_DIM}", "")
        if "such as" not in text and "supported:" not in text:
            text += "; expected a FAISS factory string such as Flat, IVF1024,Flat, IVF1024,PQ64 or HNSW32"
        raise GalleryStoreError(text) from None


def factory_kind(factory: str, dim: int) -> str:
    """``flat``, ``ivf``, ``hnsw`` or ``other``: the kind of index ``factory`` builds (raises for a bad string)."""
    return _index_kind(_new_index(factory, dim))


def _training_need(index: Any) -> tuple[int, str]:
    """The fewest training vectors the untrained ``index`` can be trained on, and why."""
    inner = faiss.downcast_index(index.index)
    need, why = 1, ""
    ivf = faiss.try_extract_index_ivf(inner)
    if ivf is not None:
        need, why = int(ivf.nlist), f"IVF with {ivf.nlist} lists"
    ivf_d = faiss.downcast_index(ivf) if ivf is not None else inner
    pq = getattr(ivf_d, "pq", None)
    if pq is not None and int(pq.ksub) > need:
        need, why = int(pq.ksub), f"PQ with {pq.ksub} centroids per sub-quantizer"
    return need, why


def _train(index: Any, features: np.ndarray, factory: str, seed: int, clustering_index: Any = None) -> None:
    if index.is_trained:
        return
    need, why = _training_need(index)
    if features.shape[0] < need:
        raise GalleryStoreError(
            f"factory {factory!r} needs at least {need} training vectors ({why}); the gallery has "
            f"{features.shape[0]}: choose a smaller factory (e.g. fewer IVF lists) or 'Flat'"
        )
    inner = faiss.downcast_index(index.index)
    ivf = faiss.try_extract_index_ivf(inner)
    if ivf is not None:
        ivf.cp.seed = int(seed)
        pq = getattr(faiss.downcast_index(ivf), "pq", None)
        if pq is not None:
            pq.cp.seed = int(seed)
        if clustering_index is not None:
            ivf.clustering_index = clustering_index
    try:
        index.train(features)
    except RuntimeError as exc:  # a need _training_need does not foresee (e.g. OPQ's own 256-centroid PQ)
        text = str(exc).strip().splitlines()
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", text[-1]) if text else type(exc).__name__
        raise GalleryStoreError(
            f"factory {factory!r} cannot be trained on the gallery's {features.shape[0]} vectors: {reason}"
        ) from None
    finally:
        if ivf is not None:
            ivf.clustering_index = None  # never written with the index


def _set_default_params(kind: str, index: Any) -> dict[str, int]:
    if kind == "ivf":
        ivf = faiss.try_extract_index_ivf(faiss.downcast_index(index.index))
        return {"nprobe": int(min(DEFAULT_NPROBE, ivf.nlist))}
    if kind == "hnsw":
        return {"efSearch": DEFAULT_EF_SEARCH}
    return {}


#: The search parameters each kind of store takes (``refine``: any kind).
_SEARCH_KEYS = {"flat": (), "ivf": ("nprobe",), "hnsw": ("efSearch",), "other": ()}


def _check_search_params(kind: str, params: Any, where: str, *, complete: bool = True) -> dict[str, int]:
    """``params`` as the search parameters of a ``kind`` store, or :class:`GalleryStoreError` naming ``where``.

    Each value must be an integer >= 1 (not a bool); keys are the kind's own
    (``nprobe`` for IVF, ``efSearch`` for HNSW) and ``refine``. ``complete``:
    the kind's own key must be there (a header's ``search``; an override may
    give any subset).
    """
    if not isinstance(params, Mapping):
        raise GalleryStoreError(f"{where}: search parameters must be an object such as {{\"nprobe\": 8}}, got {params!r:.60}")
    own = _SEARCH_KEYS.get(kind, ())
    allowed = (*own, "refine")
    for key, value in params.items():
        if key not in allowed:
            raise GalleryStoreError(
                f"{where}: search parameter {key!r} does not apply to a {kind} index (expected {', '.join(allowed)})"
            )
        if type(value) is not int or value < 1:
            raise GalleryStoreError(f"{where}: search parameter {key} must be an integer >= 1, got {value!r:.40}")
    missing = [key for key in own if key not in params] if complete else []
    if missing:
        raise GalleryStoreError(f"{where}: search parameter {missing[0]} is missing (an integer >= 1)")
    return dict(params)


def _with_refine(params: dict[str, int], refine: int) -> dict[str, int]:
    if int(refine) < 1:
        raise GalleryStoreError(f"refine must be >= 1 (1: off), got {refine}")
    return dict(params, refine=int(refine)) if int(refine) > 1 else params


def _search_params(kind: str, search: Mapping[str, int], selector: Any = None) -> Any:
    if kind == "ivf":
        params = faiss.SearchParametersIVF(nprobe=int(search["nprobe"]))
    elif kind == "hnsw":
        params = faiss.SearchParametersHNSW(efSearch=int(search["efSearch"]))
    else:
        params = faiss.SearchParameters()
    if selector is not None:
        params.sel = selector
    return params


def _as_features(name: str, x: Any, dim: Optional[int] = None) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2 or x.shape[0] == 0:
        raise GalleryStoreError(f"{name} must be a non-empty [N, d] array, got shape {x.shape}")
    if dim is not None and x.shape[1] != dim:
        raise GalleryStoreError(f"{name} have {x.shape[1]} columns but the store holds {dim}-d features")
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise GalleryStoreError(f"{name} hold NaN or inf values (row {row})")
    return x


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


@dataclass
class _NewSegment:
    """A segment to write: ids, vectors, its filled index and its table rows ``(id, path, camera, ...)``."""

    ids: np.ndarray
    vectors: np.ndarray
    index: Any
    rows: list[tuple]


def _segment_files(name: str) -> dict[str, str]:
    return {role: name + suffix for role, suffix in SEGMENT_SUFFIXES.items()}


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


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src`` (a hard link: nothing written); a copy where links are not possible."""
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links (or across devices): correct, but it costs a copy
        shutil.copyfile(src, dst)


def _write_segment(stage: Path, files: dict[str, str], seg: _NewSegment) -> None:
    """Write a new segment's four files into ``stage`` (a fresh table: only the segment's own rows)."""
    faiss.write_index(seg.index, str(stage / files["index"]))
    np.save(stage / files["vectors"], np.ascontiguousarray(seg.vectors, dtype=np.float32), allow_pickle=False)
    np.save(stage / files["ids"], np.ascontiguousarray(seg.ids, dtype=np.int64), allow_pickle=False)
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

        ``folder`` must be new, empty, or a store folder (marked): an existing store
        is replaced as a whole; ``replaces`` names other files a marked folder
        may hold that the new store replaces (e.g. an earlier index format's).
        The index is trained on ``features`` when the factory needs training
        (IVF/PQ/OPQ; seeded with ``seed``); too few vectors for the factory
        raises :class:`GalleryStoreError` before anything is written.
        ``clustering_index``: the index the IVF k-means assigns with (e.g. a
        GPU ``IndexFlatIP``; default: the CPU quantizer); the stored index is
        a CPU index either way. ``meta`` goes into the header as is, with
        ``model_fingerprint`` (when given) as ``meta["model_fingerprint"]``.
        ``side_files``: {name in :data:`SIDE_FILES`: a function writing the
        file at the path it is given}. ``refine`` R > 1: searches take the
        index's top ``R * k`` and re-score them exactly from the stored vectors
        (search parameter ``refine``; for compressed factories such as PQ,
        whose codes alone lose the order of close neighbours). The items are
        written as segments of at most :data:`SEGMENT_ITEMS`.
        """
        _with_refine({}, refine)
        folder = Path(os.path.abspath(folder))
        features = _as_features("features", features)
        values = _normalise_rows(rows, features.shape[0])
        template = _new_index(factory, features.shape[1])
        _train(template, features, factory, seed, clustering_index)
        kind = _index_kind(template)
        meta = dict(meta or {})
        if model_fingerprint:
            if meta.get("model_fingerprint") not in (None, dict(model_fingerprint)):
                raise GalleryStoreError("model_fingerprint and meta['model_fingerprint'] differ: give one fingerprint")
            meta["model_fingerprint"] = dict(model_fingerprint)
        ids = np.arange(features.shape[0], dtype=np.int64)
        header = {
            "format": STORE_FORMAT, "version": STORE_VERSION, "factory": factory, "kind": kind,
            "metric": "inner_product", "dim": int(features.shape[1]), "ntotal": int(features.shape[0]),
            "next_id": int(features.shape[0]), "seed": int(seed),
            "search": _with_refine(_set_default_params(kind, template), refine), "verify": None, "meta": meta,
        }
        store = cls(folder, header, [], template)
        plan = store._new_segments(features, ids, values)
        store._commit(plan, header, fresh=True, side_files=side_files, replaces=replaces)
        return store

    def _new_segments(self, features: np.ndarray, ids: np.ndarray, values: Sequence[tuple]) -> list[_NewSegment]:
        """``features`` under ``ids`` as new segments of at most :data:`SEGMENT_ITEMS`, indexed with the template."""
        out = []
        for start in range(0, int(ids.size), SEGMENT_ITEMS):
            part = slice(start, start + SEGMENT_ITEMS)
            vectors, seg_ids = np.ascontiguousarray(features[part]), ids[part]
            out.append(_NewSegment(seg_ids, vectors, _rebuilt_index(self.template, vectors, seg_ids),
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
        """
        folder = Path(os.path.abspath(folder))
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
        """Add items (features [n, d] and their metadata rows) as new segments; returns their new ids.

        The index is not retrained: the new segments' indexes are the store's
        trained template filled with the new items. The existing segments'
        files are kept as they are (hard links into the new save). A path
        already in the store, or twice in ``rows``, raises
        :class:`GalleryStoreError` before anything changes. ``meta`` updates
        the header's ``meta`` (key by key); ``side_files`` as in :meth:`create`
        (None for a name deletes that file; names not given are kept).
        """
        features = _as_features("features", features, self.dim)
        values = _normalise_rows(rows, features.shape[0])
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
        plan: list[Any] = list(self.segments) + self._new_segments(features, new_ids, values)
        header = dict(self.header, ntotal=self.ntotal + int(new_ids.size), next_id=int(new_ids[-1]) + 1, verify=None)
        if meta:
            header["meta"] = dict(self.header.get("meta") or {}, **meta)
        self._commit(self._merged(plan), header, side_files=side_files)
        return new_ids

    def remove(self, ids_or_paths: Iterable[int | str]) -> np.ndarray:
        """Erase items given by id (int) or path (str): the segments holding them are rewritten without them.

        Unknown ids or paths raise :class:`GalleryStoreError` naming them, and
        nothing changes. Returns the removed ids (sorted). Only the segments
        holding a removed item are rewritten (their index, vectors, ids and
        table, fresh files); the others are kept as they are. HNSW segments
        are rebuilt from their remaining stored vectors (FAISS cannot remove from HNSW).
        """
        wanted = list(ids_or_paths)
        if not wanted:
            raise GalleryStoreError("nothing to remove: give ids or paths")
        with _writer_lock(self.folder):
            self._before_update()
            return self._remove(wanted)

    def _before_update(self) -> None:
        """(The update lock held.) Refuse a foreign or changed folder; clean up what a killed update left."""
        _check_store_location(self.folder, fresh=False)
        _remove_leftovers(self.folder)
        self._check_unchanged_on_disk()

    def _remove(self, wanted: list[Any]) -> np.ndarray:
        paths = [w for w in wanted if isinstance(w, str)]
        numbers = [int(w) for w in wanted if not isinstance(w, str)]
        found = self._lookup_paths(paths)
        held = set(self.ids.tolist()) if numbers else set()
        unknown = [p for p in paths if p not in found] + [i for i in numbers if i not in held]
        if unknown:
            shown = ", ".join(str(u) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise GalleryStoreError(f"store {self.folder} holds no item {shown} (nothing was removed)")
        gone = np.unique(np.array(numbers + list(found.values()), dtype=np.int64))
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
            index = _index_without(seg.index, self.kind, seg.ids[hit], vectors, ids)
            plan.append(_NewSegment(ids, vectors, index, self._segment_rows(seg, ids)))
        header = dict(self.header, ntotal=self.ntotal - int(gone.size), verify=None)
        self._commit(self._merged(plan), header)
        return gone

    def _merged(self, plan: list[Any]) -> list[Any]:
        """``plan`` with adjacent segments merged (the smallest pair first) while it has more than :data:`MAX_SEGMENTS`."""
        plan = list(plan)
        while len(plan) > MAX_SEGMENTS:
            sizes = [int(p.ids.size) for p in plan]
            j = int(np.argmin([a + b for a, b in zip(sizes, sizes[1:])]))
            a, b = plan[j], plan[j + 1]
            ids = np.concatenate([a.ids, b.ids])
            vectors = np.concatenate([np.asarray(a.vectors), np.asarray(b.vectors)])
            rows = [r for p in (a, b) for r in (p.rows if isinstance(p, _NewSegment) else self._segment_rows(p, p.ids))]
            plan[j : j + 2] = [_NewSegment(ids, vectors, _rebuilt_index(self.template, vectors, ids), rows)]
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
        """The metadata rows of ``ids`` in that order (None for -1 or an unknown id)."""
        ids = [int(i) for i in ids]
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
        :class:`~fedreid.retrieval.fields.GalleryMetadataError` (a camera of 2**70 names no camera).
        """
        where, args = [], []
        if cameras is not None:
            cams = fields.camera_list(cameras, "cameras filter")
            where.append(f"camera IN ({','.join('?' * len(cams))})" if cams else "0")
            args += cams
        if sites is not None:
            ss = fields.site_list(sites, "sites filter")
            where.append(f"site IN ({','.join('?' * len(ss))})" if ss else "0")
            args += ss
        if time_window is not None:
            since, until = tuple(time_window)
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

        ``search_params`` overrides the stored ``nprobe``/``efSearch`` for this call.
        ``flat_index``: for a Flat store, an index to run unfiltered searches on
        instead of the segments' (e.g. a GPU copy of :meth:`flat_faiss_index`; same vectors, same order).
        """
        queries = _as_features("queries", queries, self.dim)
        k = _capped_k(k, self.ntotal)
        allowed = self.filtered_ids(cameras, sites, time_window)
        params = dict(self.search_params, **_check_search_params(self.kind, search_params or {}, "search_params",
                                                                   complete=False))
        if allowed is None:
            return self._index_search(queries, k, params, flat_index=flat_index)
        if allowed.size == 0 or self.ntotal == 0:
            return _empty_result(queries.shape[0], k)
        if allowed.size <= EXACT_FILTER_MAX or self.kind == "hnsw" or not _accepts_search_parameters(self.template):
            # Only ids this object holds: the table on disk may be a newer store's (another process's update).
            ids = self.ids
            rows = np.minimum(np.searchsorted(ids, allowed), max(ids.size - 1, 0))
            held = ids[rows] == allowed
            if not held.any():
                return _empty_result(queries.shape[0], k)
            return _exact_search(queries, self.vectors[rows[held]], allowed[held], k)
        return self._index_search(queries, k, params, selector=faiss.IDSelectorBatch(allowed))

    def flat_faiss_index(self) -> Any:
        """An ``IndexFlatIP`` over a Flat store's vectors (row i holds id ``ids[i]``).

        With one segment, the segment's own index; with several, one index
        built over all their vectors (a copy, made once per store object).
        """
        if self.kind != "flat":
            raise GalleryStoreError(f"store {self.folder} holds a {self.kind} index ({self.factory}), not a flat one")
        if len(self.segments) == 1:
            return faiss.downcast_index(self.segments[0].index.index)
        if self._flat is None:
            flat = faiss.IndexFlatIP(self.dim)
            for seg in self.segments:
                if seg.ntotal:
                    flat.add(np.ascontiguousarray(seg.vectors, dtype=np.float32))
            self._flat = flat
        return self._flat

    def _index_search(self, queries: np.ndarray, k: int, params: Mapping[str, int], selector: Any = None,
                      flat_index: Any = None) -> SearchResult:
        """Each segment's index searched, the results merged by (score desc, id asc)."""
        nq = queries.shape[0]
        if self.ntotal == 0:
            return _empty_result(nq, k)
        if self.kind == "flat" and selector is None:
            from fedreid.eval.retrieval import search

            if flat_index is not None:
                scores, rows = search(flat_index, queries, k)
                out = _empty_result(nq, k)
                out.scores[:, : rows.shape[1]], out.ids[:, : rows.shape[1]] = scores, self.ids[rows]
                return out
            parts = []
            for seg in self.segments:
                if seg.ntotal:
                    scores, rows = search(faiss.downcast_index(seg.index.index), queries, min(k, seg.ntotal))
                    parts.append((scores, seg.ids[rows]))
            return _merge_topk(parts, nq, k)
        p = _search_params(self.kind, params, selector) if _accepts_search_parameters(self.template) else None
        refine = int(params.get("refine", 1) or 1)
        want = k if refine <= 1 else min(k * refine, self.ntotal)
        parts = []
        for seg in self.segments:
            if seg.ntotal:
                parts.append(_segment_topk(seg.index, queries, min(want, seg.ntotal), seg.ntotal, p))
        merged = _merge_topk(parts, nq, want)
        if refine <= 1:
            return merged
        return self._rescore(queries, merged.ids, k)

    def _rescore(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> SearchResult:
        """Exact inner products of ``candidates`` (ids, -1 pads) from the stored vectors; the best ``k`` of each row.

        Equal scores: the smaller id first; pads rank last. Queries are done
        in blocks so the gathered candidate vectors stay under about 64 MB.
        """
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
            scores = np.einsum("qcd,qd->qc", gathered, queries[s : s + block])
            scores[~valid] = -np.inf
            order = np.lexsort((np.where(valid, cand, np.iinfo(np.int64).max), -scores), axis=-1)[:, :kk]
            out.scores[s : s + block, :kk] = np.take_along_axis(scores, order, axis=1)
            out.ids[s : s + block, :kk] = np.where(
                np.isfinite(out.scores[s : s + block, :kk]), np.take_along_axis(cand, order, axis=1), -1
            )
        return out

    def exact_search(self, queries: Any, k: int) -> SearchResult:
        """Exact top-``k`` over the stored vectors (the reference :meth:`verify` compares with)."""
        from fedreid.eval.retrieval import block_topk

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
        if self.kind == "ivf":
            nlist = int(_inner_ivf(self.template).nlist)
            name, values = "nprobe", sorted({min(v, nlist) for v in NPROBE_CANDIDATES})
        elif self.kind == "hnsw":
            name, values = "efSearch", list(EF_SEARCH_CANDIDATES)
        else:
            name, values = None, []
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
                side_files: Optional[Mapping[str, Any]] = None, replaces: Sequence[str] = ()) -> None:
        """Stage the new save (kept segments linked, new ones written), swap it in, then adopt it in memory.

        Side files: those in ``side_files`` are written by their function (None:
        left out); the others are carried over from the current folder (not on ``fresh``).
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
            self._write_and_swap(plan, header, fresh=fresh, side_files=side_files)

    def _write_and_swap(self, plan: list[Any], header: dict, *, fresh: bool, side_files: dict[str, Any]) -> None:
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
            if TEMPLATE_FILE in old_files:
                _link_or_copy(folder / TEMPLATE_FILE, stage / TEMPLATE_FILE)
                files[TEMPLATE_FILE] = old_files[TEMPLATE_FILE]
            else:
                faiss.write_index(self.template, str(stage / TEMPLATE_FILE))
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
        self.header, self.segments, self._ids, self._flat = header, segments, None, None

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


def _capped_k(k: Any, ntotal: int) -> int:
    """``k`` (an integer >= 1, else :class:`GalleryStoreError`) cut to ``ntotal``: no result has more columns."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) < 1:
        raise GalleryStoreError(f"k must be an integer >= 1, got {k!r:.40}")
    return min(int(k), int(ntotal))


def _empty_result(nq: int, k: int) -> SearchResult:
    return SearchResult(scores=np.full((nq, k), -np.inf, np.float32), ids=np.full((nq, k), -1, np.int64))


def _exact_search(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int) -> SearchResult:
    from fedreid.eval.retrieval import block_topk

    kk = min(k, vectors.shape[0])
    scores, rows = block_topk(queries, vectors, kk)
    out = _empty_result(queries.shape[0], k)
    out.scores[:, :kk], out.ids[:, :kk] = scores, ids[rows]
    return out


#: The update locks this thread holds: parent folder -> nesting depth (see :func:`_writer_lock`).
_HELD = threading.local()


@contextlib.contextmanager
def _writer_lock(folder: Path, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the update lock of the store at ``folder``: an exclusive ``flock`` on its parent folder.

    The lock is on the parent because an update replaces the store folder
    itself; it leaves no file behind and is released when the process dies.
    Waits up to ``timeout`` seconds (default :data:`LOCK_TIMEOUT_S`) for
    another writer, then raises :class:`GalleryStoreError`. A thread that
    already holds it (:meth:`GalleryStore.update_lock`) takes it again at
    once: a second ``flock`` from this process would wait for the first.
    Other threads and processes wait as for any writer.
    """
    parent = folder.parent
    held: dict[str, int] = getattr(_HELD, "depth", None) or {}
    _HELD.depth = held
    key = os.path.abspath(parent)
    if held.get(key):
        held[key] += 1
        try:
            yield
        finally:
            held[key] -= 1
        return
    parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY)
    try:
        deadline = time.monotonic() + (LOCK_TIMEOUT_S if timeout is None else timeout)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise GalleryStoreError(
                        f"another process is updating a store in {parent} (it holds the update lock); "
                        f"try again when it has finished (nothing was changed in {folder})"
                    ) from None
                time.sleep(0.05)
        held[key] = 1
        try:
            yield
        finally:
            held.pop(key, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
    return faiss.try_extract_index_ivf(faiss.downcast_index(index.index))


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


def _index_without(index: Any, kind: str, gone: np.ndarray, vectors: np.ndarray, ids: np.ndarray) -> Any:
    """A copy of the store's ``index`` without the ids ``gone``; ``vectors``/``ids``: the items that remain.

    Every remaining item keeps its id: HNSW (no removal in FAISS) is rebuilt
    from the remaining stored vectors; an IVF's inner ids are renumbered after
    ``remove_ids`` (see :func:`_renumber_inner_ids`); flat and flat-code indexes
    compact their rows as ``IndexIDMap2`` does. Should the result still not map
    its inner ids one to one (an inverted-list kind this code does not know),
    it is rebuilt from the stored vectors instead.
    """
    if kind == "hnsw":
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


#: Files this process has verified: (device, inode) -> (size, mtime ns, SHA-256, when verified in ns). See
#: :func:`_check_file`.
_VERIFIED: dict[tuple[int, int], tuple[int, int, str, int]] = {}
_VERIFIED_LOCK = threading.Lock()


def _remember(path: Path, sha256: str) -> None:
    st = path.stat()
    with _VERIFIED_LOCK:
        _VERIFIED[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, sha256, time.time_ns())


def _trusted(path: Path, record: Mapping[str, Any]) -> bool:
    """Whether ``path`` was verified against ``record``'s SHA-256 by this process and has not changed since.

    Unchanged: the same device, inode, size and modification time, and that
    time more than :data:`RACY_NS` before the verification (otherwise a rewrite
    within the file system's timestamp granularity could keep it).
    """
    try:
        st = path.stat()
    except OSError:
        return False
    with _VERIFIED_LOCK:
        seen = _VERIFIED.get((st.st_dev, st.st_ino))
    return seen is not None and seen[0] == st.st_size and seen[1] == st.st_mtime_ns and seen[2] == record["sha256"] \
        and st.st_mtime_ns < seen[3] - RACY_NS


def _written_record(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file the store has just written (hashed from disk; verified as written)."""
    record = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    _remember(path, record["sha256"])
    return record


class _Conn:
    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.conn.commit()
        self.conn.close()


def _connect_rw(path: Path) -> _Conn:
    return _Conn(sqlite3.connect(str(path)))


def _connect_ro(path: Path) -> _Conn:
    # A URI: '#', '?' and '%' in a folder name would end or escape its path part, so the path is quoted.
    return _Conn(sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True))


def _db_ids(path: Path) -> np.ndarray:
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise GalleryStoreError(f"{path} is not an SQLite database: {describe_kind(file_kind(path))}")
    try:
        with _connect_ro(path) as conn:
            got = conn.execute("SELECT id FROM gallery ORDER BY id").fetchall()
    except sqlite3.DatabaseError as exc:
        raise GalleryStoreError(f"{path} is not a gallery store table: {exc}") from None
    return np.array([r[0] for r in got], dtype=np.int64)


def is_store_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s ``header.json`` is a gallery store header (reads that JSON only; never raises)."""
    try:
        header = json.loads((Path(folder) / HEADER_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == STORE_FORMAT


def _own_names() -> set[str]:
    """The fixed names a store folder may hold (besides its segments' files, :data:`_SEGMENT_FILE`)."""
    return {HEADER_FILE, TEMPLATE_FILE, *LEGACY_FILES, *SIDE_FILES, marker_path(".", MARKER_KIND).name}


def _is_own_name(name: str) -> bool:
    return name in _own_names() or _SEGMENT_FILE.match(name) is not None


def _check_store_location(folder: Path, *, fresh: bool, replaces: Sequence[str] = ()) -> None:
    """Refuse (changing nothing) a folder that is not new/empty/a store, or that holds other files."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise GalleryStoreError(f"{folder} is not a folder {TOOL} made; choose another folder")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not owns_folder(folder, MARKER_KIND):
        entries = sorted(p.name for p in folder.iterdir())
        raise GalleryStoreError(
            f"{folder} holds files {TOOL} did not write ({', '.join(entries[:5])}); choose another folder "
            "(nothing was changed)"
        )
    if fresh is False and not is_store_folder(folder):
        raise GalleryStoreError(f"{folder} is not a gallery store (no store header.json)")
    own = set(replaces) if fresh else set()
    foreign = sorted(
        p.name for p in folder.iterdir() if not _is_own_name(p.name) and p.name not in own and not _HEADER_TEMP.match(p.name)
    )
    if foreign:
        raise GalleryStoreError(
            f"store folder {folder} also holds files that are not the store's ({', '.join(foreign[:5])}); an "
            "update replaces the whole folder: move them elsewhere (nothing was changed)"
        )


#: SQLite's own files beside a database it was writing (a kill during VACUUM leaves them in a staging folder).
_SQLITE_SIDE = re.compile(r"^(meta\.sqlite|seg-\d{6,}\.sqlite)-(journal|wal|shm)$")
_ATOMIC_TEMP = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]+\.tmp$")  # fedreid.utils.io.atomic_path's temporaries


def _is_store_entry_name(name: str) -> bool:
    """Whether ``name`` is a file a store folder, or the staging of one, holds (its own, or a writer's temporary)."""
    if _is_own_name(name) or _SQLITE_SIDE.match(name):
        return True
    temporary = _ATOMIC_TEMP.match(name)
    return temporary is not None and _is_own_name(temporary.group("name"))


def _is_swap_leftover(path: Path) -> bool:
    """Whether a hidden sibling named like a swap's (``.<name>.tmp-*``/``.old-*``) is a store's staging or old copy.

    Marked ones are. So are unmarked ones holding nothing but a store's file
    names (or nothing): a deletion (``shutil.rmtree``) may remove the marker
    before the data files, and a copy set aside by a removal holds the erased
    items' vectors, which must not outlive a kill.
    """
    if path.is_symlink() or not path.is_dir():
        return False
    if owns_folder(path, MARKER_KIND):
        return True
    return all(q.is_file() and not q.is_symlink() and _is_store_entry_name(q.name) for q in path.iterdir())


def _is_whole_store(path: Path) -> bool:
    if not owns_folder(path, MARKER_KIND):
        return False
    try:
        header = json.loads((path / HEADER_FILE).read_text())
        names = list(header["files"])
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return all(isinstance(name, str) and _is_own_name(name) and (path / name).is_file() for name in names)


def _delete_marker_last(path: Path) -> None:
    """Delete the folder ``path``, its marker last: a kill part-way leaves a folder still marked as the store's."""
    marker = marker_path(path, MARKER_KIND)
    for entry in path.iterdir():
        if entry.name == marker.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    marker.unlink(missing_ok=True)
    path.rmdir()


def _remove_leftovers(folder: Path) -> None:
    """Clean up hidden siblings a killed update left (moving a whole ``.old-*`` back when the store is gone).

    The caller holds the update lock (no update is under way).
    """
    for p in swap_leftovers(folder.parent, folder.name):
        if not _is_swap_leftover(p):
            continue
        if p.name.startswith(f".{folder.name}.old-") and _is_whole_store(p) and not folder.exists():
            os.replace(p, folder)
        else:
            _delete_marker_last(p)


def clean_swap_leftovers(folder: str | Path) -> None:
    """Delete what a killed update of the store at ``folder`` left beside it, unless an update is under way.

    Moves a whole set-aside copy back when the store folder is missing (a kill
    between the two renames of a swap) and deletes staging and set-aside
    copies, whole or partly deleted, marked or not (:func:`_is_swap_leftover`):
    so a removal's erased vectors do not outlive a kill. Never waits: when
    another process holds the update lock, or the parent folder is not
    writable, nothing is done (the next open or update cleans up).
    """
    folder = Path(os.path.abspath(folder))
    if not swap_leftovers(folder.parent, folder.name):
        return
    try:
        with _writer_lock(folder, timeout=0):
            _remove_leftovers(folder)
    except (GalleryStoreError, OSError):
        pass


def _read_header(folder: Path) -> dict:
    """The checked header of the store at ``folder``: version 4 (segments), or version 3 (one set of files)."""
    path = folder / HEADER_FILE
    header = read_format_header(path, STORE_FORMAT, GalleryStoreError, f"no gallery store at {folder}: {path} is missing")
    version = header.get("version")
    if version not in (STORE_VERSION, LEGACY_VERSION):
        raise GalleryStoreError(
            f"{path} has version {version!r}; this code reads {STORE_VERSION} (and {LEGACY_VERSION}, converted by "
            f"its first update): rebuild the store with {TOOL} --model MODEL --gallery GALLERY --index {folder}"
        )
    bad = [key for key in ("dim", "ntotal", "next_id") if type(header.get(key)) is not int or header[key] < 0]
    if not isinstance(header.get("factory"), str) or header.get("kind") not in ("flat", "ivf", "hnsw", "other"):
        bad.append("factory/kind")
    files = header.get("files")
    if version == STORE_VERSION:
        segments = header.get("segments")
        ok = isinstance(segments, list) and type(header.get("next_segment")) is int and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and _SEGMENT_NAME.match(e["name"])
            and type(e.get("ntotal")) is int and e["ntotal"] >= 0 for e in segments
        ) and len({e["name"] for e in segments}) == len(segments)
        if not ok:
            bad.append("segments")
        names = [TEMPLATE_FILE] + ([f for e in segments for f in _segment_files(e["name"]).values()] if ok else [])
        if isinstance(files, dict) and set(files) != set(names):
            bad.append("files (exactly the template's and the segments')")
    else:
        names = list(LEGACY_FILES)
    for name in names:
        rec = files.get(name) if isinstance(files, dict) else None
        if not isinstance(rec, dict) or type(rec.get("bytes")) is not int or not isinstance(rec.get("sha256"), str) \
                or not _SHA256_HEX.match(rec["sha256"]):
            bad.append(f"size and SHA-256 of {name}")
    if bad or header.get("dim", 0) < 1:
        raise GalleryStoreError(f"{path} lacks valid {', '.join(bad) or 'dim'}: it is damaged or was not written by fedreid")
    _check_search_params(header["kind"], header.get("search"), f"{path} field search")
    return header


def _segment_layout(header: dict) -> list[tuple[str, dict[str, str], int]]:
    """``(name, files by role, item count)`` of each segment, in id order (a version-3 store: its one set of files)."""
    if header["version"] == LEGACY_VERSION:
        return [("v3", dict(zip(SEGMENT_SUFFIXES, LEGACY_FILES)), int(header["ntotal"]))]
    return [(e["name"], _segment_files(e["name"]), int(e["ntotal"])) for e in header["segments"]]


def _segment_key(folder: Path, files: Mapping[str, str]) -> Optional[tuple]:
    """What identifies a segment's files on disk: (name, device, inode, size, mtime) of each; None if one is missing."""
    out = []
    for role in SEGMENT_SUFFIXES:
        try:
            st = (folder / files[role]).stat()
        except OSError:
            return None
        out.append((files[role], st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


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


def _check_file(folder: Path, name: str, header: dict, *, full: bool = False) -> None:
    """``folder/name`` against its record: the size always; the SHA-256 unless this process verified it unchanged.

    ``full``: hash it whatever was verified before. A file that matches is
    remembered as verified (see :func:`_trusted`).
    """
    path, record = folder / name, header["files"][name]
    if not full and path.is_file() and path.stat().st_size == record["bytes"] and _trusted(path, record):
        return
    check_recorded_file(
        path, record, folder / HEADER_FILE, GalleryStoreError,
        what="gallery store file", fix="after the store was saved",
    )
    _remember(path, record["sha256"])


def _read_npy(path: Path, what: str, dtype: Any, shape: tuple, mmap: bool = False) -> np.ndarray:
    """The array in ``path`` (never unpickled); ``mmap``: a read-only memory map instead of a copy in RAM."""
    kind = file_kind(path)
    if kind != "npy":
        raise GalleryStoreError(f"{path} is not a NumPy .npy file of {what}: {describe_kind(kind)}")
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as exc:
        text = str(exc).strip()
        why = (
            "it holds pickled Python objects, which are never loaded (loading them can run code)"
            if "pickle" in text.lower() or "python objects" in text.lower() else (text.splitlines()[0] if text else type(exc).__name__)
        )
        raise GalleryStoreError(f"{path} is not a readable .npy of {what}: {why}") from None
    if arr.dtype != np.dtype(dtype) or tuple(arr.shape) != tuple(shape):
        raise GalleryStoreError(f"{path}: expected {what} of shape {shape} and dtype {np.dtype(dtype)}, got {arr.shape} {arr.dtype}")
    return arr


def _read_faiss(path: Path, header: dict, ntotal: int) -> Any:
    with open(path, "rb") as f:
        tag = f.read(4)
    if tag != _IDMAP2_TAG:
        raise GalleryStoreError(f"{path} is not a faiss IndexIDMap2 as written by the store: it starts with {tag!r}")
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()
        raise GalleryStoreError(f"{path} is not a readable faiss index: {text[-1] if text else exc}") from None
    if not isinstance(index, faiss.IndexIDMap2) or index.ntotal != ntotal or index.d != header["dim"] \
            or index.metric_type != faiss.METRIC_INNER_PRODUCT or _index_kind(index) != header["kind"]:
        raise GalleryStoreError(
            f"{path} holds a {type(index).__name__} of dim {index.d} with {index.ntotal} vectors; "
            f"{path.parent / HEADER_FILE} says a {header['kind']} index of dim {header['dim']} with {ntotal}"
        )
    return index
