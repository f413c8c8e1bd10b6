"""Exact inner-product top-k search: a FAISS ``IndexFlatIP`` wrapper and a FAISS-free twin.

Both paths return, per query, the ``k`` best gallery items by descending
inner product with the tie rule of :mod:`fedreid.eval.metrics` (equal scores:
lower gallery index first). FAISS orders ties by its heap, so :func:`search`
re-sorts each result and recomputes the rare rows where a tie straddles the
k-th place.

An index can be saved to a folder with the gallery's ids, cameras and paths::

    <folder>/index.faiss   faiss.write_index of the (CPU) index
    <folder>/meta.npz      ids, cameras, paths (no pickles)
    <folder>/header.json   format, version, dim, ntotal, the size and SHA-256
                           of both other files, caller's meta: written last,
                           so a folder with a header is complete

Each file is written to a temporary file in the folder and renamed into place
(``os.replace``), so readers never see half a file. :func:`load_index` reads
nothing but JSON and NumPy arrays without pickles, and checks each file's
size and SHA-256 against the header, and that ``index.faiss`` has the exact
layout of the header's flat inner-product index, before ``faiss.read_index``
sees it: a damaged file, a mix of two saves or a foreign file planted in the
folder is one :class:`IndexFileError` naming the file, never a crash inside
faiss. (The checksums detect damage and mix-ups; they are no signature:
whoever can write the header can write matching checksums, so the layout
check stays.)
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import faiss
import numpy as np

from fedreid.errors import FedReIDError
from fedreid.eval.ranking import (
    DEFAULT_BLOCK_BYTES,
    EvalDataError,
    as_features,
    block_rows,
    is_torch,
    order_by_rule,
    prepare_features,
    score_rows,
    top_k_rows,
)
from fedreid.utils.filecheck import check_recorded_file, describe_kind, file_kind, read_format_header, sha256_file
from fedreid.utils.io import atomic_path, write_json_atomic

__all__ = [
    "INDEX_FORMAT",
    "FaissGpuUnavailableError",
    "IndexFileError",
    "LoadedIndex",
    "block_topk",
    "build_index",
    "faiss_gpu_available",
    "is_index_folder",
    "load_index",
    "require_faiss_gpu",
    "save_index",
    "search",
]

INDEX_FORMAT = "fedreid-faiss-index"
INDEX_VERSION = 2
#: Versions :func:`is_index_folder` recognises as this code's own (1: sizes only, no checksums).
KNOWN_INDEX_VERSIONS = (1, 2)
INDEX_FILE, META_FILE, HEADER_FILE = "index.faiss", "meta.npz", "header.json"
META_KEYS = ("ids", "cameras", "paths")
DEFAULT_SEARCH_BLOCK = 4096  # queries per FAISS call: bounds the k-best buffers
#: faiss's fourcc of IndexFlatIP, the first bytes of every index.faiss written here.
FLAT_IP_TAG = b"IxFI"
_FLAT_IP_HEAD = struct.Struct("<4siqqqBiq")  # tag, d, ntotal, 2 placeholders, is_trained, metric, float count
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_TEMP_NAME = re.compile(r"^\.(index\.faiss|meta\.npz|header\.json)\..+\.tmp$")  # atomic_path's temporaries


class IndexFileError(FedReIDError, ValueError):
    """A saved index folder is corrupt or inconsistent; the message names the file."""


class FaissGpuUnavailableError(FedReIDError, RuntimeError):
    """A GPU index was required (``use_gpu=True``) but faiss has no GPU support or sees no GPU."""


@dataclass
class LoadedIndex:
    """What :func:`load_index` returns: the index and the gallery it was built from."""

    index: Any
    ids: np.ndarray
    cameras: np.ndarray
    paths: np.ndarray
    header: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# Building and searching
# --------------------------------------------------------------------------


def faiss_gpu_available() -> bool:
    """True when this faiss build has GPU support and sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _as_float32_rows(name: str, x: Any) -> np.ndarray:
    x = as_features(name, x)
    if is_torch(x):  # a GPU tensor: faiss takes host memory
        x = x.cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def build_index(features: Any, use_gpu: bool | str = "auto", *, gpu_id: int = 0) -> Any:
    """An exact inner-product index (``faiss.IndexFlatIP``) over ``features`` [N, d].

    ``use_gpu``: ``"auto"`` (default) puts the index on GPU 0 when faiss has
    GPU support and a GPU is present, else keeps it on the CPU; ``True``
    requires a GPU (:class:`FaissGpuUnavailableError`, a RuntimeError,
    otherwise); ``False`` keeps the CPU. ``gpu_id``: which GPU.
    Features are used as given: L2-normalise them for cosine similarity.
    """
    if use_gpu not in ("auto", True, False):
        raise EvalDataError(f"use_gpu must be 'auto', True or False, got {use_gpu!r}")
    features = _as_float32_rows("features", features)
    if features.shape[0] == 0:
        raise EvalDataError("cannot build an index over 0 features")
    index = faiss.IndexFlatIP(features.shape[1])
    index.add(features)
    return _maybe_to_gpu(index, use_gpu, gpu_id)


def require_faiss_gpu() -> None:
    """Raise :class:`FaissGpuUnavailableError`, saying what is missing, unless a GPU index can be made."""
    if not faiss_gpu_available():
        why = "sees no GPU" if hasattr(faiss, "StandardGpuResources") else "has no GPU support (faiss-cpu)"
        raise FaissGpuUnavailableError(
            f"a GPU faiss index was required but this faiss build {why}; "
            "install the [gpu] extra (faiss-gpu) on a CUDA machine, or use the CPU index"
        )


def _maybe_to_gpu(index: Any, use_gpu: bool | str, gpu_id: int = 0) -> Any:
    if use_gpu is False or (use_gpu == "auto" and not faiss_gpu_available()):
        return index
    require_faiss_gpu()
    resources = faiss.StandardGpuResources()
    gpu_index = faiss.index_cpu_to_gpu(resources, int(gpu_id), index)
    gpu_index.fedreid_resources = resources  # the GPU index must not outlive them
    return gpu_index


def _is_gpu_index(index: Any) -> bool:
    return hasattr(faiss, "GpuIndex") and isinstance(index, faiss.GpuIndex)


def _cpu_index(index: Any) -> Any:
    return faiss.index_gpu_to_cpu(index) if _is_gpu_index(index) else index


def search(
    index: Any, queries: Any, k: int, block_size: int = DEFAULT_SEARCH_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` ``(scores [Q, k] float32, indices [Q, k] int64)`` of each query, best first.

    Queries go to FAISS ``block_size`` at a time. ``k`` larger than the index
    is cut to its size. Ties follow the metrics rule (lower gallery index
    first): each result is re-sorted, and a row whose k-th and (k+1)-th
    scores tie is recomputed over the whole gallery (for a GPU index, on a
    CPU copy), since FAISS picks among tied items arbitrarily.
    """
    queries = _as_float32_rows("queries", queries)
    if queries.shape[1] != index.d:
        raise EvalDataError(f"feature dims differ: queries have {queries.shape[1]} columns, the index {index.d}")
    if int(k) < 1 or int(block_size) < 1:
        raise EvalDataError(f"k and block_size must be >= 1, got k={k}, block_size={block_size}")
    n_total = index.ntotal
    k = min(int(k), n_total)
    k_probe = min(k + 1, n_total)  # one extra to see whether a tie straddles place k
    scores = np.empty((queries.shape[0], k), dtype=np.float32)
    indices = np.empty((queries.shape[0], k), dtype=np.int64)
    cpu_index = None
    for start in range(0, queries.shape[0], int(block_size)):
        block = queries[start : start + int(block_size)]
        d, i = index.search(block, k_probe)
        straddling = np.flatnonzero(d[:, k - 1] == d[:, k]) if k_probe > k else np.empty(0, np.int64)
        d, i = order_by_rule(d[:, :k], i[:, :k])
        for r in straddling:
            cpu_index = cpu_index if cpu_index is not None else _cpu_index(index)
            full_d, full_i = cpu_index.search(block[r : r + 1], n_total)
            full_d, full_i = order_by_rule(full_d, full_i)
            d[r], i[r] = full_d[0, :k], full_i[0, :k]
        scores[start : start + len(block)], indices[start : start + len(block)] = d, i
    return scores, indices


def block_topk(
    queries: Any,
    gallery: Any,
    k: int,
    *,
    block_size: int | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """FAISS-free exact top-k by block matmul (the path ``evaluate`` scores with).

    Same output and tie rule as :func:`search`; memory is bounded by
    ``max_block_bytes`` per query block.
    """
    qf, gf = prepare_features(queries, gallery)
    if int(k) < 1:
        raise EvalDataError(f"k must be >= 1, got {k}")
    k = min(int(k), gf.shape[0])
    rows = block_rows(gf.shape[0], block_size, max_block_bytes)
    scores = np.empty((qf.shape[0], k), dtype=np.float32)
    indices = np.empty((qf.shape[0], k), dtype=np.int64)
    for start, block in score_rows(qf, gf, rows):
        stop = start + block.shape[0]
        scores[start:stop], indices[start:stop] = top_k_rows(block, k)
    return scores, indices


# --------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------


def save_index(
    folder: str | Path,
    index: Any,
    *,
    ids: Sequence[int] | np.ndarray,
    cameras: Sequence[int] | np.ndarray,
    paths: Sequence[str] | np.ndarray,
    meta: dict | None = None,
) -> Path:
    """Save ``index`` and its gallery's ids, cameras and paths into ``folder`` (atomically per file).

    ``meta`` (JSON-serialisable) goes into the header. Returns the folder.
    """
    folder = Path(folder)
    ids, cameras = np.asarray(ids, dtype=np.int64), np.asarray(cameras, dtype=np.int64)
    paths = np.asarray([str(p) for p in paths], dtype=str)
    lengths = {"index": index.ntotal, "ids": ids.size, "cameras": cameras.size, "paths": paths.size}
    if len(set(lengths.values())) > 1:
        raise EvalDataError("mismatched lengths (" + ", ".join(f"{k}: {v}" for k, v in lengths.items()) + ")")
    cpu_index = _cpu_index(index)
    if not isinstance(cpu_index, faiss.IndexFlatIP):
        raise EvalDataError(f"save_index saves a faiss.IndexFlatIP (build_index's), got {type(cpu_index).__name__}")
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    with atomic_path(folder / INDEX_FILE) as tmp:
        faiss.write_index(cpu_index, str(tmp))
        files[INDEX_FILE] = _file_record(tmp)
    with atomic_path(folder / META_FILE) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, ids=ids, cameras=cameras, paths=paths)
        files[META_FILE] = _file_record(tmp)
    header = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "metric": "inner_product",
        "ntotal": int(index.ntotal),
        "dim": int(index.d),
        "files": files,
        "meta": meta or {},
    }
    write_json_atomic(folder / HEADER_FILE, header)
    return folder


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def is_index_folder(folder: str | Path, *, extra_files: Sequence[str] = ()) -> bool:
    """Whether ``folder`` is an index folder :func:`save_index` wrote, of this or an earlier version.

    True when its ``header.json`` is an index header of a known version
    (format, version, integer ``ntotal``/``dim``, a ``files`` record naming
    only the index's own files) and the folder holds nothing but the index's
    files, ``extra_files`` and leftover temporaries of an interrupted save. A
    folder of the user's own files that merely has some ``header.json`` is
    not one. Reading nothing but that JSON, it never raises for a bad folder.
    """
    folder = Path(folder)
    try:
        header = json.loads((folder / HEADER_FILE).read_text())
        entries = [p.name for p in folder.iterdir()]
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
        return False
    if header.get("version") not in KNOWN_INDEX_VERSIONS or header.get("metric") != "inner_product":
        return False
    if not all(type(header.get(key)) is int for key in ("ntotal", "dim")):
        return False
    files = header.get("files")
    if not isinstance(files, dict) or not files or not set(files) <= {INDEX_FILE, META_FILE}:
        return False
    own = {HEADER_FILE, INDEX_FILE, META_FILE, *extra_files}
    return all(name in own or _TEMP_NAME.match(name) for name in entries)


def _read_header(folder: Path) -> dict:
    path = folder / HEADER_FILE
    header = read_format_header(path, INDEX_FORMAT, IndexFileError, f"no saved index at {folder}: {path} is missing")
    version = header.get("version")
    if version in KNOWN_INDEX_VERSIONS and version < INDEX_VERSION:
        raise IndexFileError(
            f"{path} is an index of version {version}, written by an earlier fedreid without checksums: "
            "build the index again (tools/eval_reid.py index with the same --index folder)"
        )
    if version != INDEX_VERSION:
        raise IndexFileError(f"{path} has version {version!r}; this code reads {INDEX_VERSION}")
    files = header.get("files")
    bad = [
        name for name in (INDEX_FILE, META_FILE)
        if not isinstance(files, dict) or not isinstance(files.get(name), dict)
        or type(files[name].get("bytes")) is not int
        or not isinstance(files[name].get("sha256"), str) or not _SHA256_HEX.match(files[name]["sha256"])
    ]
    if bad or not all(type(header.get(key)) is int for key in ("ntotal", "dim")):
        what = f"size and SHA-256 of {', '.join(bad)}" if bad else "integer ntotal and dim"
        raise IndexFileError(f"{path} lacks the {what}: it is damaged or was not written by save_index")
    return header


def _check_file(folder: Path, name: str, header: dict) -> Path:
    """``folder/name`` after its size and SHA-256 matched the header's record (checked before any parsing)."""
    return check_recorded_file(
        folder / name, header["files"][name], folder / HEADER_FILE, IndexFileError,
        what="saved index file", fix="after the index was saved; build the index again",
    )


def _flat_ip_layout_problem(path: Path, header: dict) -> str | None:
    """Why ``path`` is not byte for byte the ``IndexFlatIP`` the header describes; None when it is.

    faiss writes a flat index as the tag ``IxFI``, then (little-endian) d
    int32, ntotal int64, two int64 placeholders, is_trained uint8,
    metric_type int32, the number of stored floats uint64, then
    ntotal x d float32. Checking this before ``faiss.read_index`` means faiss
    never parses sizes it would allocate or read from blindly.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_FLAT_IP_HEAD.size)
    if not head.startswith(FLAT_IP_TAG):
        kind = file_kind(path)
        what = describe_kind(kind) if kind != "binary" else f"it starts with {head[:4]!r}"
        return f"expected the tag {FLAT_IP_TAG!r}: {what}"
    if len(head) < _FLAT_IP_HEAD.size:
        return f"it has {size} bytes, fewer than a flat index header"
    _, d, ntotal, _, _, _, metric, n_floats = _FLAT_IP_HEAD.unpack(head)
    if (d, ntotal) != (header["dim"], header["ntotal"]) or metric != faiss.METRIC_INNER_PRODUCT:
        return (
            f"it declares dim={d}, ntotal={ntotal}, metric {metric}; the header says dim={header['dim']}, "
            f"ntotal={header['ntotal']}, inner product ({faiss.METRIC_INNER_PRODUCT})"
        )
    if d < 1 or ntotal < 0 or n_floats != d * ntotal or size != _FLAT_IP_HEAD.size + 4 * n_floats:
        return f"its {size} bytes do not hold {ntotal} vectors of dim {d}"
    return None


def _read_faiss(path: Path, header: dict) -> Any:
    """``faiss.read_index`` of a checked file, only once its layout is that of the header's flat IP index."""
    problem = _flat_ip_layout_problem(path, header)
    if problem is not None:
        raise IndexFileError(f"{path} is not a flat inner-product faiss index as written by save_index: {problem}")
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise IndexFileError(f"{path} is not a readable faiss index: {message}") from None
    if not isinstance(index, faiss.IndexFlatIP):
        raise IndexFileError(f"{path} holds a faiss {type(index).__name__}, expected an IndexFlatIP")
    return index


def _read_meta(path: Path) -> dict[str, np.ndarray]:
    """ids, cameras and paths of a checked ``meta.npz``; read without pickles."""
    expected = "a NumPy .npz of the gallery's ids, cameras and paths"
    kind = file_kind(path)
    if kind != "zip":  # np.load would try anything else as a pickle
        raise IndexFileError(f"{path} is not {expected}: {describe_kind(kind)}")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in META_KEYS if key not in data.files]
            if missing:
                raise IndexFileError(f"{path} is missing keys {missing} (has {sorted(data.files)})")
            meta = {key: data[key] for key in META_KEYS}
    except IndexFileError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        text = str(exc).strip()
        why = (
            "it holds pickled Python objects, which are never loaded (loading them can run code)"
            if "pickle" in text.lower() else (text.splitlines()[0] if text else type(exc).__name__)
        )
        raise IndexFileError(f"{path} is not {expected}: {why}") from None
    kinds = {"ids": "iu", "cameras": "iu", "paths": "U"}
    for key, ok in kinds.items():
        if meta[key].ndim != 1 or (meta[key].size and meta[key].dtype.kind not in ok):
            raise IndexFileError(
                f"{path}: {key!r} should be a 1-D {'string' if ok == 'U' else 'integer'} array, "
                f"got shape {meta[key].shape} of dtype {meta[key].dtype}"
            )
    return meta


def load_index(folder: str | Path, *, use_gpu: bool | str = False, gpu_id: int = 0) -> LoadedIndex:
    """Read a folder written by :func:`save_index`.

    Raises FileNotFoundError (naming the missing path) or
    :class:`IndexFileError` (naming the corrupt, inconsistent or foreign
    file; an index of an earlier version asks to be built again). Every
    file's size and SHA-256 are checked against the header before it is
    parsed (see the module docstring).
    ``use_gpu``/``gpu_id`` as in :func:`build_index`; the default keeps the CPU.
    """
    folder = Path(folder)
    header = _read_header(folder)
    index_path = _check_file(folder, INDEX_FILE, header)
    meta_path = _check_file(folder, META_FILE, header)
    meta = _read_meta(meta_path)
    index = _read_faiss(index_path, header)
    found = {"index": index.ntotal, **{key: len(meta[key]) for key in META_KEYS}}
    if len(set(found.values())) > 1 or index.ntotal != header.get("ntotal") or index.d != header.get("dim"):
        raise IndexFileError(
            f"{folder} is inconsistent: header says ntotal={header.get('ntotal')}, dim={header.get('dim')}; "
            f"found dim={index.d} and " + ", ".join(f"{k}: {v}" for k, v in found.items())
        )
    return LoadedIndex(
        index=_maybe_to_gpu(index, use_gpu, gpu_id),
        ids=meta["ids"],
        cameras=meta["cameras"],
        paths=meta["paths"],
        header=header,
    )
