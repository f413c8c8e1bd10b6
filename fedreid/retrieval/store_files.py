"""A gallery store's files: the format, checksums, the SQLite tables, the writer lock, swap leftovers.

The files and their guarantees are described in :mod:`fedreid.retrieval.store`
(the :class:`~fedreid.retrieval.store.GalleryStore` class, which reads and
writes a store through this module). Here: the format's names and versions,
reading and checking ``header.json`` and each data file (size and SHA-256 before
any parsing, once per file and process: :func:`_check_file`), the segment
tables (SQLite), the update lock (:func:`writer_lock`), the folder's own file
names (:func:`own_names`, :func:`is_own_name`) and the cleanup of what a killed
update left beside the folder (:func:`clean_swap_leftovers`).
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
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import faiss
import numpy as np

from fedreid.errors import FedReIDError
from fedreid.retrieval.index_kinds import index_kind, is_kind_name, search_keys
from fedreid.utils.filecheck import check_recorded_file, describe_kind, file_kind, read_format_header, sha256_file
from fedreid.utils.io import marker_path, owns_folder, swap_leftovers

__all__ = [
    "GalleryStoreError",
    "SIDE_FILES",
    "STORE_FORMAT",
    "STORE_VERSION",
    "clean_swap_leftovers",
    "header_stamp",
    "is_own_name",
    "is_store_folder",
    "own_names",
    "writer_lock",
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


#: A file verified less than this long after its modification time is hashed again when next read (see
#: :func:`_check_file`): a file system's coarse timestamps could hide a same-size rewrite within that window.
RACY_NS = 2_000_000_000


#: Files a store folder may hold besides its own, carried over by updates unless replaced.
SIDE_FILES = ("skipped.csv",)


MARKER_KIND = "index"


TOOL = "tools/eval_reid.py index"


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


def _check_search_params(kind: str, params: Any, where: str, *, complete: bool = True) -> dict[str, int]:
    """``params`` as the search parameters of a ``kind`` store, or :class:`GalleryStoreError` naming ``where``.

    Each value must be an integer >= 1 (not a bool); keys are the kind's own
    (``nprobe`` for IVF, ``efSearch`` for HNSW) and ``refine``. ``complete``:
    the kind's own key must be there (a header's ``search``; an override may
    give any subset).
    """
    if not isinstance(params, Mapping):
        raise GalleryStoreError(f"{where}: search parameters must be an object such as {{\"nprobe\": 8}}, got {params!r:.60}")
    own = search_keys(kind)
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


def _segment_files(name: str) -> dict[str, str]:
    return {role: name + suffix for role, suffix in SEGMENT_SUFFIXES.items()}


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src`` (a hard link: nothing written); a copy where links are not possible."""
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links (or across devices): correct, but it costs a copy
        shutil.copyfile(src, dst)


#: The update locks this thread holds: parent folder -> nesting depth (see :func:`writer_lock`).
_HELD = threading.local()


@contextlib.contextmanager
def writer_lock(folder: Path, timeout: float) -> Iterator[None]:
    """Hold the update lock of the store at ``folder``: an exclusive ``flock`` on its parent folder.

    The lock is on the parent because an update replaces the store folder
    itself; it leaves no file behind and is released when the process dies.
    Waits up to ``timeout`` seconds for another writer, then raises
    :class:`GalleryStoreError`. A thread that
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
        deadline = time.monotonic() + timeout
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


def own_names() -> set[str]:
    """The fixed names a store folder may hold (besides its segments' files, :data:`_SEGMENT_FILE`)."""
    return {HEADER_FILE, TEMPLATE_FILE, *LEGACY_FILES, *SIDE_FILES, marker_path(".", MARKER_KIND).name}


def is_own_name(name: str) -> bool:
    return name in own_names() or _SEGMENT_FILE.match(name) is not None


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
        p.name for p in folder.iterdir() if not is_own_name(p.name) and p.name not in own and not _HEADER_TEMP.match(p.name)
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
    if is_own_name(name) or _SQLITE_SIDE.match(name):
        return True
    temporary = _ATOMIC_TEMP.match(name)
    return temporary is not None and is_own_name(temporary.group("name"))


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
    return all(isinstance(name, str) and is_own_name(name) and (path / name).is_file() for name in names)


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
        with writer_lock(folder, timeout=0):
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
    if not isinstance(header.get("factory"), str) or not is_kind_name(header.get("kind")):
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
    _check_header_fields(path, header)
    return header


def _check_header_fields(path: Path, header: dict) -> None:
    """Refuse header fields an update relies on that hold the wrong type or value, naming ``path`` and the field.

    ``next_segment`` names the next new segment: it must lie above every
    segment's number, or an update would write a new segment under a kept
    one's name. ``trained_below`` (absent in early stores) is an integer
    >= 0, ``seed`` an integer; ``meta`` is an object (or null).
    """
    if header["version"] == STORE_VERSION:
        next_segment = header["next_segment"]
        numbers = [int(e["name"][len("seg-"):]) for e in header["segments"]]
        if next_segment < 0 or (numbers and next_segment <= max(numbers)):
            raise GalleryStoreError(
                f"{path} field next_segment is {next_segment}, but it must be above every segment's number "
                f"(at least {max(numbers, default=-1) + 1}): the header is damaged"
            )
    for key, low in (("trained_below", 0), ("seed", None)):
        value = header.get(key)
        if value is not None and (type(value) is not int or (low is not None and value < low)):
            expected = "an integer" + ("" if low is None else f" >= {low}")
            raise GalleryStoreError(f"{path} field {key} is {value!r:.40}: expected {expected}; the header is damaged")
    meta = header.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise GalleryStoreError(f"{path} field meta is {meta!r:.40}: expected an object; the header is damaged")


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
            or index.metric_type != faiss.METRIC_INNER_PRODUCT or index_kind(index) != header["kind"]:
        raise GalleryStoreError(
            f"{path} holds a {type(index).__name__} of dim {index.d} with {index.ntotal} vectors; "
            f"{path.parent / HEADER_FILE} says a {header['kind']} index of dim {header['dim']} with {ntotal}"
        )
    return index


def header_stamp(folder: str | Path) -> Optional[tuple[int, int, int]]:
    """(inode, mtime ns, size) of a store's ``header.json``: a save replaces it; None while it is missing."""
    try:
        st = os.stat(Path(folder) / HEADER_FILE)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
