"""Exact inner-product top-k search: a FAISS ``IndexFlatIP`` wrapper and a FAISS-free twin.

Both paths return, per query, the ``k`` best gallery items by descending
inner product with the tie rule of :mod:`fedreid.eval.metrics` (equal scores:
lower gallery index first). FAISS orders ties by its heap, so :func:`search`
re-sorts each result and recomputes the rare rows where a tie straddles the
k-th place.

Index folders of the earlier format (``fedreid-faiss-index``: ``index.faiss``,
``meta.npz`` and ``header.json``, versions 1 and 2) are no longer read. They are
still recognised (:func:`is_index_folder`), so that ``tools/eval_reid.py index``
may replace one with a gallery store (:mod:`fedreid.retrieval.store`), and
:func:`refuse_old_index_folder` refuses one with a single line naming the
folder and how to rebuild it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import faiss
import numpy as np

from fedreid.errors import EvalDataError
from fedreid.eval.ranking import (
    DEFAULT_BLOCK_BYTES,
    as_features,
    block_rows,
    is_torch,
    order_by_rule,
    prepare_features,
    score_rows,
    top_k_rows,
)
from fedreid.inference.errors import EvalInputError
from fedreid.retrieval.faiss_gpu import FaissGpuUnavailableError, faiss_gpu_available, require_faiss_gpu

__all__ = [
    "INDEX_FORMAT",
    "FaissGpuUnavailableError",
    "IndexFileError",
    "block_topk",
    "build_index",
    "faiss_gpu_available",
    "is_index_folder",
    "max_row_norm",
    "old_index_header",
    "pair_scores",
    "refuse_old_index_folder",
    "require_faiss_gpu",
    "score_error_bound",
    "search",
]

#: The earlier index folder format (no longer read): its header's ``format``.
INDEX_FORMAT = "fedreid-faiss-index"
#: The versions of the earlier format :func:`is_index_folder` recognises (1: sizes only; 2: checksums).
KNOWN_INDEX_VERSIONS = (1, 2)
#: The earlier format's files.
INDEX_FILE, META_FILE, HEADER_FILE = "index.faiss", "meta.npz", "header.json"
DEFAULT_SEARCH_BLOCK = 4096  # queries per FAISS call: bounds the k-best buffers
_TEMP_NAME = re.compile(r"^\.(index\.faiss|meta\.npz|header\.json)\..+\.tmp$")  # atomic_path's temporaries


class IndexFileError(EvalInputError):
    """An index folder of the earlier format (no longer read); the message names it and how to rebuild it."""


# --------------------------------------------------------------------------
# Building and searching
# --------------------------------------------------------------------------


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


def _maybe_to_gpu(index: Any, use_gpu: bool | str, gpu_id: int = 0) -> Any:
    if use_gpu is False or (use_gpu == "auto" and not faiss_gpu_available()):
        return index
    require_faiss_gpu()
    resources = faiss.StandardGpuResources()
    gpu_index = faiss.index_cpu_to_gpu(resources, int(gpu_id), index)
    # The GPU index must not outlive them; FAISS refuses other new attributes on an index.
    gpu_index.referenced_objects = [*(getattr(gpu_index, "referenced_objects", None) or ()), resources]
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
    ``max_block_bytes`` per query block. With numpy inputs the scores are
    per-pair inner products (:func:`pair_scores`, as a store's refine
    computes them), so equal gallery vectors score equally wherever they sit;
    the matmul only picks the candidates (:func:`_rescored_topk`).
    """
    qf, gf = prepare_features(queries, gallery)
    if int(k) < 1:
        raise EvalDataError(f"k must be >= 1, got {k}")
    k = min(int(k), gf.shape[0])
    rows = block_rows(gf.shape[0], block_size, max_block_bytes)
    scores = np.empty((qf.shape[0], k), dtype=np.float32)
    indices = np.empty((qf.shape[0], k), dtype=np.int64)
    max_norm = None if is_torch(qf) else max_row_norm(gf)
    for start, block in score_rows(qf, gf, rows):
        stop = start + block.shape[0]
        if max_norm is None:
            scores[start:stop], indices[start:stop] = top_k_rows(block, k)
        else:
            scores[start:stop], indices[start:stop] = _rescored_topk(qf[start:stop], gf, block, k, max_norm)
    return scores, indices


def pair_scores(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """``[q, c]`` inner products of ``queries [q, d]`` with their own candidates ``vectors [q, c, d]``.

    One pair at a time (``einsum``, no BLAS), so a score depends on the two
    vectors only, not on where a vector sits. The exact scores of
    :func:`block_topk` and of a store's refine
    (:meth:`fedreid.retrieval.store.GalleryStore._rescore`).
    """
    return np.einsum("qcd,qd->qc", vectors, queries)


def max_row_norm(vectors: np.ndarray) -> float:
    """The largest L2 norm among the rows of ``vectors`` [n, d] (0.0 for none): the ``max_norm`` of :func:`score_error_bound`."""
    return float(np.sqrt(np.max(np.einsum("gd,gd->g", vectors, vectors), initial=0.0)))


def score_error_bound(queries: np.ndarray, max_norm: float) -> np.ndarray:
    """Per query, how far two float32 computations of its inner product with one item may differ (float64).

    Any summation order (a BLAS kernel's, FAISS's, :func:`pair_scores`'s) of a
    length-``d`` dot product is within ``d * 2**-24 * |q| * |g|`` of the true
    value; twice that, with ``max_norm`` the largest ``|g|``, bounds the
    difference of two of them.
    """
    norms = np.linalg.norm(np.asarray(queries, dtype=np.float64), axis=1)
    return 2 * queries.shape[1] * 2.0**-24 * norms * float(max_norm)


def _rescored_topk(queries: np.ndarray, gallery: np.ndarray, block: np.ndarray, k: int,
                   max_norm: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` of each row of ``block`` (``queries @ gallery.T``) under the tie rule, with per-pair scores.

    A BLAS matmul sums each product in an order that depends on the gallery
    item's column (its place in the SIMD kernel), so two equal gallery
    vectors can score a unit in the last place apart and break the tie rule
    (seen with OpenBLAS on AMD EPYC). Every item whose matmul score lies
    within the two computations' error bound (:func:`score_error_bound`,
    ``max_norm`` the largest ``|g|``) of the row's ``k``-th is rescored by
    :func:`pair_scores`; the tie rule then orders those.
    """
    kth = np.partition(block, block.shape[1] - k, axis=1)[:, block.shape[1] - k]  # each row's k-th largest
    bound = score_error_bound(queries, max_norm)
    candidates = block >= (kth - bound)[:, None]
    scores = np.empty((block.shape[0], k), dtype=np.float32)
    indices = np.empty((block.shape[0], k), dtype=np.int64)
    for r in range(block.shape[0]):
        cols = np.flatnonzero(candidates[r])
        exact = pair_scores(queries[r : r + 1], gallery[cols][None])[0]
        order = np.lexsort((cols, -exact))[:k]
        scores[r], indices[r] = exact[order], cols[order]
    return scores, indices


# --------------------------------------------------------------------------
# Index folders of the earlier format (recognised, never read)
# --------------------------------------------------------------------------


def is_index_folder(folder: str | Path, *, extra_files: Sequence[str] = ()) -> bool:
    """Whether ``folder`` is an index folder of the earlier format (which ``index`` may replace with a store).

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


def old_index_header(folder: str | Path) -> Optional[dict]:
    """The ``header.json`` of ``folder`` when it is an index header of the earlier format; else None (never raises)."""
    try:
        header = json.loads((Path(folder) / HEADER_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return header if isinstance(header, dict) and header.get("format") == INDEX_FORMAT else None


def refuse_old_index_folder(folder: str | Path, rebuild: str) -> None:
    """Raise :class:`IndexFileError` (one line: the folder, its version, ``rebuild``) for a folder of the earlier format.

    Does nothing for any other folder. ``rebuild`` tells how to build the
    index again (the command line to run).
    """
    header = old_index_header(folder)
    if header is not None:
        raise IndexFileError(
            f"index folder {folder} was built by an earlier version of fedreid ({INDEX_FORMAT} version "
            f"{header.get('version')!r}): {rebuild}"
        )
