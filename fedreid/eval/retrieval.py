"""Exact inner-product top-k search: a FAISS ``IndexFlatIP`` wrapper and a FAISS-free twin.

Both paths return, per query, the ``k`` best gallery items by descending
inner product with the tie rule of :mod:`fedreid.eval.metrics` (equal scores:
lower gallery index first). FAISS orders ties by its heap, so :func:`search`
re-sorts each result and recomputes the rare rows where a tie straddles the
k-th place.

An index can be saved to a folder with the gallery's ids, cameras and paths::

    <folder>/index.faiss   faiss.write_index of the (CPU) index
    <folder>/meta.npz      ids, cameras, paths (no pickles)
    <folder>/header.json   format, version, sizes: written last, so a folder
                           with a header is complete

Each file is written to a temporary file in the folder and renamed into place
(``os.replace``), so readers never see half a file; the header records the
other files' sizes so a mix of two saves is detected on load.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import faiss
import numpy as np

from fedreid.errors import FedReIDError
from fedreid.eval.metrics import (
    DEFAULT_BLOCK_BYTES,
    EvalDataError,
    _as_features,
    _block_rows,
    _is_torch,
    _order_by_rule,
    _prepare_features,
    _score_blocks,
    _top_k_rows,
)
from fedreid.utils.io import atomic_path, write_json_atomic

__all__ = [
    "INDEX_FORMAT",
    "FaissGpuUnavailableError",
    "IndexFileError",
    "LoadedIndex",
    "block_topk",
    "build_index",
    "faiss_gpu_available",
    "load_index",
    "require_faiss_gpu",
    "save_index",
    "search",
]

INDEX_FORMAT = "fedreid-faiss-index"
INDEX_VERSION = 1
INDEX_FILE, META_FILE, HEADER_FILE = "index.faiss", "meta.npz", "header.json"
META_KEYS = ("ids", "cameras", "paths")
DEFAULT_SEARCH_BLOCK = 4096  # queries per FAISS call: bounds the k-best buffers


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
    x = _as_features(name, x)
    if _is_torch(x):  # a GPU tensor: faiss takes host memory
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
        d, i = _order_by_rule(d[:, :k], i[:, :k])
        for r in straddling:
            cpu_index = cpu_index if cpu_index is not None else _cpu_index(index)
            full_d, full_i = cpu_index.search(block[r : r + 1], n_total)
            full_d, full_i = _order_by_rule(full_d, full_i)
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
    qf, gf = _prepare_features(queries, gallery)
    if int(k) < 1:
        raise EvalDataError(f"k must be >= 1, got {k}")
    k = min(int(k), gf.shape[0])
    rows = _block_rows(gf.shape[0], block_size, max_block_bytes)
    scores = np.empty((qf.shape[0], k), dtype=np.float32)
    indices = np.empty((qf.shape[0], k), dtype=np.int64)
    for start, block in _score_blocks(qf, gf, rows):
        stop = start + block.shape[0]
        scores[start:stop], indices[start:stop] = _top_k_rows(block, k)
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
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / INDEX_FILE) as tmp:
        faiss.write_index(_cpu_index(index), str(tmp))
    with atomic_path(folder / META_FILE) as tmp, open(tmp, "wb") as f:
        np.savez(f, ids=ids, cameras=cameras, paths=paths)
    header = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "metric": "inner_product",
        "ntotal": int(index.ntotal),
        "dim": int(index.d),
        "files": {
            INDEX_FILE: (folder / INDEX_FILE).stat().st_size,
            META_FILE: (folder / META_FILE).stat().st_size,
        },
        "meta": meta or {},
    }
    write_json_atomic(folder / HEADER_FILE, header)
    return folder


def _read_header(folder: Path) -> dict:
    path = folder / HEADER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no saved index at {folder}: {path} is missing")
    try:
        header = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexFileError(f"{path} is not a readable JSON header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != INDEX_FORMAT:
        raise IndexFileError(f"{path} is not a {INDEX_FORMAT} header")
    if header.get("version") != INDEX_VERSION:
        raise IndexFileError(f"{path} has version {header.get('version')!r}; this code reads {INDEX_VERSION}")
    return header


def _check_file(folder: Path, name: str, header: dict) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"saved index file {path} is missing")
    expected = header.get("files", {}).get(name)
    if expected is not None and path.stat().st_size != expected:
        raise IndexFileError(
            f"{path} has {path.stat().st_size} bytes but {folder / HEADER_FILE} says {expected}: "
            "the folder mixes two saves or the file is damaged"
        )
    return path


def _read_meta(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in META_KEYS if key not in data.files]
            if missing:
                raise IndexFileError(f"{path} is missing keys {missing} (has {sorted(data.files)})")
            return {key: data[key] for key in META_KEYS}
    except IndexFileError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise IndexFileError(f"{path} is not a readable .npz file: {exc}") from None


def load_index(folder: str | Path, *, use_gpu: bool | str = False, gpu_id: int = 0) -> LoadedIndex:
    """Read a folder written by :func:`save_index`.

    Raises FileNotFoundError (naming the missing path) or
    :class:`IndexFileError` (naming the corrupt or inconsistent file).
    ``use_gpu``/``gpu_id`` as in :func:`build_index`; the default keeps the CPU.
    """
    folder = Path(folder)
    header = _read_header(folder)
    index_path = _check_file(folder, INDEX_FILE, header)
    meta_path = _check_file(folder, META_FILE, header)
    try:
        index = faiss.read_index(str(index_path))
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise IndexFileError(f"{index_path} is not a readable faiss index: {message}") from None
    meta = _read_meta(meta_path)
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
