"""k-reciprocal re-ranking (Zhong, Zheng, Cao, Li: "Re-ranking Person Re-identification
with k-reciprocal Encoding", CVPR 2017).

For the N = Q + G query and gallery features together:

1. d(p, q) = ||x_p - x_q||^2 (squared Euclidean; ``2 - 2 cos`` for unit
   features), each row divided by its maximum, as in the authors' code;
2. N(p, k): the k+1 nearest items of p (itself included); the k-reciprocal
   set R(p, k1) = {q in N(p, k1) : p in N(q, k1)} (Eq. 3);
3. R*(p): R(p, k1) plus the set R(q, k1/2) of every q in it that shares more
   than 2/3 of its items with R(p, k1) (Eq. 9);
4. V_p: Gaussian-kernel weights exp(-d(p, q)) on R*(p), summing to 1 (Eq. 10);
   local query expansion replaces V_p by the mean of V over p's k2 nearest
   items (Eq. 11);
5. Jaccard distance d_J(p, g) = 1 - sum_k min(V_pk, V_gk) / sum_k max(V_pk, V_gk)
   (Eq. 12, with sum max = 2 - sum min for rows summing to 1);
6. final distance = (1 - lambda) d_J + lambda d (Eq. 13), for queries x gallery.

Ties among distances go to the lower item index (queries first, then
gallery), like the ranking rule of :mod:`fedreid.eval.metrics`.

Memory: the N x N distance matrix is needed (the neighbour lists of every
item, gallery included), so the estimate of :func:`estimate_rerank_bytes` is
checked against ``max_bytes`` first and a :class:`RerankMemoryError` names
the sizes instead of exhausting memory. V is kept sparse (each row has only
about k1 non-zeros), so the N x N matrix is the only quadratic allocation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedreid.errors import FedReIDError
from fedreid.eval.ranking import EvalDataError, is_torch, prepare_features, top_k_rows

__all__ = ["RerankMemoryError", "check_rerank_memory", "estimate_rerank_bytes", "k_reciprocal_rerank"]

DEFAULT_MAX_BYTES = 4 * 2**30
_ROW_CHUNK = 2048  # rows per step when finding neighbours (bounds the temporaries)
# Bytes per distance of a row chunk while its neighbours are found: the chunk negated here and again in
# top_k_rows (float32 each) and argpartition's int64 indices (16 measured), plus top_k_rows' bool tie mask.
_CHUNK_BYTES_PER_ITEM = 17


class RerankMemoryError(FedReIDError, MemoryError):
    """Re-ranking would need more memory than the caller allowed.

    ``needs``: what the sizes need, in words (the message's head), for a tool
    that names its own limit.
    """

    needs: str = ""


def check_rerank_memory(n_query: int, n_gallery: int, k1: int = 20, k2: int = 6,
                        max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Raise :class:`RerankMemoryError` when :func:`estimate_rerank_bytes` of these sizes exceeds ``max_bytes``.

    What :func:`k_reciprocal_rerank` checks first; a tool calls it with the
    manifests' counts before extracting any feature.
    """
    needed = estimate_rerank_bytes(n_query, n_gallery, k1, k2)
    if needed > max_bytes:
        n = n_query + n_gallery
        needs = (f"k-reciprocal re-ranking of {n_query} queries + {n_gallery} gallery items (N = {n}) needs about "
                 f"{needed / 2**30:.2f} GiB (the N x N distance matrix alone is {4 * n * n / 2**30:.2f} GiB)")
        exc = RerankMemoryError(f"{needs}, above the limit max_bytes={max_bytes} ({max_bytes / 2**30:.2f} GiB); "
                                "raise max_bytes or re-rank a subset")
        exc.needs = needs
        raise exc


def estimate_rerank_bytes(n_query: int, n_gallery: int, k1: int = 20, k2: int = 6) -> int:
    """Rough peak bytes of :func:`k_reciprocal_rerank` for these sizes.

    The N x N float32 distances dominate; add the Q x G result, the
    neighbour lists with the temporaries of one row chunk of the neighbour
    search (about 17 bytes per distance of the chunk), and the sparse weights
    with their query-expansion temporaries (allowing 2 (k1 + 1) non-zeros per
    row before expansion; about k1 + 1 on average in practice).
    """
    n = n_query + n_gallery
    dense = 4 * n * n + 4 * n_query * n_gallery
    neighbours = (8 * n * (k1 + 1) + 8 * _ROW_CHUNK * (k1 + 1) ** 2
                  + _CHUNK_BYTES_PER_ITEM * min(_ROW_CHUNK, n) * n)
    sparse = 32 * n * 2 * (k1 + 1) * max(1, k2)
    return int(dense + neighbours + sparse)


def _distances(features: np.ndarray) -> np.ndarray:
    """Row-normalised squared Euclidean distances, N x N float32, built in place."""
    n = features.shape[0]
    dist = np.empty((n, n), dtype=np.float32)
    np.matmul(features, features.T, out=dist)
    sq = np.einsum("ij,ij->i", features, features)
    dist *= -2
    dist += sq[:, None]
    dist += sq[None, :]
    np.maximum(dist, 0, out=dist)
    row_max = dist.max(axis=1, keepdims=True)
    dist /= np.where(row_max > 0, row_max, 1)  # identical features would give 0 / 0
    return dist


def _nearest(dist: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k smallest distances, nearest first (ties: lower index)."""
    out = np.empty((dist.shape[0], min(k, dist.shape[1])), dtype=np.int64)
    for start in range(0, dist.shape[0], _ROW_CHUNK):
        out[start : start + _ROW_CHUNK] = top_k_rows(-dist[start : start + _ROW_CHUNK], k)[1]
    return out


def _reciprocal_mask(neighbours: np.ndarray) -> np.ndarray:
    """mask[p, a]: p is among the neighbours of its a-th neighbour (Eq. 3)."""
    n = neighbours.shape[0]
    mask = np.empty(neighbours.shape, dtype=bool)
    for start in range(0, n, _ROW_CHUNK):
        rows = np.arange(start, min(n, start + _ROW_CHUNK))
        mask[rows] = (neighbours[neighbours[rows]] == rows[:, None, None]).any(axis=2)
    return mask


def _expanded_sets(dist: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """R*(p) for every p as CSR (ptr, columns ascending, weights summing to 1 per row)."""
    n = dist.shape[0]
    half = int(np.around(k1 / 2))  # the authors' rounding (banker's for odd k1 / 2)
    near = _nearest(dist, k1 + 1)
    near_half = near[:, : half + 1]
    recip = _reciprocal_mask(near)
    recip_half = _reciprocal_mask(near_half)
    columns, weights, ptr = [], [], np.zeros(n + 1, dtype=np.int64)
    for p in range(n):
        base = near[p][recip[p]]
        cand_sets = near_half[base]
        cand_mask = recip_half[base]
        shared = (np.isin(cand_sets, base) & cand_mask).sum(axis=1)
        accepted = shared > 2 / 3 * cand_mask.sum(axis=1)
        expanded = np.unique(np.concatenate([base, cand_sets[accepted][cand_mask[accepted]]]))
        w = np.exp(-dist[p, expanded].astype(np.float64))
        columns.append(expanded)
        weights.append(w / w.sum())
        ptr[p + 1] = ptr[p] + expanded.size
    return ptr, np.concatenate(columns), np.concatenate(weights)


def _offsets_within(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ..., n_0 - 1, 0, 1, ..., n_1 - 1, ...: positions inside consecutive runs."""
    return np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _query_expansion(
    ptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, near: np.ndarray, k2: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """V_p := mean of V over p's k2 nearest items (Eq. 11), sparse in and out.

    With fewer than ``k2`` items in all, the mean is over those there are,
    as the reference's ``np.mean(V[initial_rank[i, :k2]], axis=0)``.
    """
    n = ptr.size - 1
    sources = near[:, :k2]  # [n, min(k2, n)]
    lengths = (ptr[1:] - ptr[:-1])[sources]  # non-zeros each source row contributes
    owner = np.repeat(np.arange(n), lengths.sum(axis=1))
    starts = np.repeat(ptr[:-1][sources].ravel(), lengths.ravel())
    flat = starts + _offsets_within(lengths.ravel())
    keys, inverse = np.unique(owner * n + cols[flat], return_inverse=True)
    summed = np.bincount(inverse.ravel(), weights=vals[flat]) / sources.shape[1]
    new_owner, new_cols = np.divmod(keys, n)
    new_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(new_owner, minlength=n), out=new_ptr[1:])
    return new_ptr, new_cols, summed


def k_reciprocal_rerank(
    qf: Any,
    gf: Any,
    *,
    k1: int = 20,
    k2: int = 6,
    lambda_value: float = 0.3,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """Re-ranked query x gallery *distances* [Q, G] float32 (lower is better).

    Defaults are the paper's (k1=20, k2=6, lambda=0.3). Evaluate with
    ``fedreid.eval.metrics.evaluate_scores(-dist, ...)``. Raises
    :class:`RerankMemoryError` when :func:`estimate_rerank_bytes` exceeds
    ``max_bytes`` (default 4 GiB), before allocating anything large.
    """
    if int(k1) < 1 or int(k2) < 1:
        raise EvalDataError(f"k1 and k2 must be >= 1, got k1={k1}, k2={k2}")
    if not 0.0 <= lambda_value <= 1.0:
        raise EvalDataError(f"lambda_value must be in [0, 1], got {lambda_value}")
    qf, gf = prepare_features(qf, gf)
    if is_torch(qf):
        qf, gf = qf.cpu().numpy(), gf.cpu().numpy()
    n_q, n_g = qf.shape[0], gf.shape[0]
    check_rerank_memory(n_q, n_g, k1, k2, max_bytes)

    dist = _distances(np.concatenate([qf, gf]))
    ptr, cols, vals = _expanded_sets(dist, int(k1))
    if k2 > 1:  # the authors skip the expansion for k2 = 1
        ptr, cols, vals = _query_expansion(ptr, cols, vals, _nearest(dist, int(k2)), int(k2))

    # Column-major copy of V: for each item k, the rows with V[row, k] > 0.
    owner = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))
    by_col = np.argsort(cols, kind="stable")
    col_ptr = np.zeros(ptr.size, dtype=np.int64)
    np.cumsum(np.bincount(cols, minlength=ptr.size - 1), out=col_ptr[1:])
    col_rows, col_vals = owner[by_col], vals[by_col]

    n = ptr.size - 1
    result = np.empty((n_q, n_g), dtype=np.float32)
    for i in range(n_q):
        ks, v = cols[ptr[i] : ptr[i + 1]], vals[ptr[i] : ptr[i + 1]]
        lengths = col_ptr[ks + 1] - col_ptr[ks]
        flat = np.repeat(col_ptr[ks], lengths) + _offsets_within(lengths)
        mins = np.minimum(np.repeat(v, lengths), col_vals[flat])
        shared = np.bincount(col_rows[flat], weights=mins, minlength=n)[n_q:]
        jaccard = 1 - shared / (2 - shared)
        result[i] = (1 - lambda_value) * jaccard + lambda_value * dist[i, n_q:]
    return result
