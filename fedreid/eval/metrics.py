"""Retrieval metrics for person re-identification: CMC, mAP, mINP.

Protocol (single-query Market-1501 / DukeMTMC-reID / MSMT17 evaluation, Zheng
et al., "Scalable Person Re-identification: A Benchmark", ICCV 2015; the
``evaluate_rank`` semantics of torchreid and fast-reid):

* similarity is the inner product of the features (the cosine for
  L2-normalised features); a higher score ranks earlier;
* per query, a gallery item is removed when it is junk (pid -1) or shows the
  query's identity in the query's camera (:func:`gallery_masks` is the one
  place that states this rule); distractors (pid 0 in Market-1501) stay as
  ordinary negatives;
* the true matches of a query are the remaining items with its pid; a query
  without any is skipped with ``ap="standard"`` and counted in
  ``num_skipped_queries``.

Ties: the ranking of a query is the *stable* sort of its gallery by
descending score, i.e. among equal scores the lower gallery index ranks
first (:func:`ranking_order`). Every path here, the top-k search in
:mod:`fedreid.retrieval.exact` and the pictures in
:mod:`fedreid.eval.visualize` follow that rule.

Speed and memory: the full query x gallery score matrix is never
materialised. Queries are scored in blocks of at most ``max_block_bytes``
(one reused buffer), and instead of sorting each row, the rank of every true
match is counted: the match at descending position ``i`` among a query's
matches has rank ``i + #negatives ranked before it``. Only negatives scoring
at least the query's hardest match can precede a match, so each row is cut
down to those (usually a few percent) and only they are sorted. Exact score
ties between a match and a negative are detected and recounted with the index
rule. bench/eval_speed.py measures this against a bare matmul and a
full-sort implementation.

On a GPU the same rules run in torch (:mod:`fedreid.eval.ranking_torch`,
``evaluate(..., backend="torch")``, the default for CUDA features): a stable
descending sort of each score row, removed items at ``-inf``, blocks sized
from the free device memory, and only per-query results copied back.
bench/gpu_eval.py measures it against a bare block matmul + full sort.
"""

from __future__ import annotations

import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from fedreid.errors import FedReIDError

#: torch, once an input needs it (:func:`_load_torch`). Numpy inputs never import it: a process that only
#: reads a gallery store (a federated search site's ClientApp, started per query) saves a second of start-up.
torch: Any = None

__all__ = [
    "AP_MODES",
    "BACKENDS",
    "DEFAULT_BLOCK_BYTES",
    "EvalDataError",
    "JUNK_PID",
    "accuracy",
    "cmc_curve",
    "evaluate",
    "evaluate_cuhk03_single_shot",
    "evaluate_scores",
    "gallery_masks",
    "junk_mask",
    "ranking_order",
    "score_blocks",
]

#: Gallery pid of junk images (Market-1501 ``-1``): removed for every query.
JUNK_PID = -1
#: ``"standard"``: torchreid/fast-reid AP; ``"official"``: Market-1501 MATLAB/layumi AP.
AP_MODES = ("standard", "official")
#: :func:`evaluate` backends: ``"auto"`` is torch for CUDA features, numpy otherwise.
BACKENDS = ("auto", "numpy", "torch")
#: Default bound on one block of scores (float32 queries x gallery).
DEFAULT_BLOCK_BYTES = 64 * 2**20
_FINITE_CHECK_ELEMENTS = 1 << 22  # elements per chunk of the NaN/inf check
# Above this share of candidates per block, sorting whole rows beats compacting
# them first (numpy's SIMD sort ~2 ns/score vs compaction ~1-2 ns/kept score).
_DENSE_SORT_FRACTION = 0.5


class EvalDataError(FedReIDError, ValueError):
    """Bad evaluation input (empty sets, mismatched lengths, NaN/inf features, no query with a match...).

    A :class:`~fedreid.errors.FedReIDError`, so the tools print it as one
    line, and a ``ValueError``, so library callers catching that keep working.
    The message names the array or option and what was expected.
    """


# --------------------------------------------------------------------------
# The protocol's rules: filtering and ties
# --------------------------------------------------------------------------


def junk_mask(g_pids: np.ndarray) -> np.ndarray:
    """Gallery items that are junk for every query (pid ``JUNK_PID``)."""
    return np.asarray(g_pids) == JUNK_PID


def gallery_masks(
    q_pid: Any, q_camid: Any, g_pids: np.ndarray, g_camids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(keep, good)`` masks of the gallery for one query (elementwise, broadcasts).

    ``keep`` drops junk (pid -1) and same-identity-same-camera items, as in the
    Market-1501 protocol; ``good`` marks the kept items of the query's identity
    (the true matches). Everything else kept is a negative, distractors
    (pid 0) included. The arguments may be arrays of equal shape, one entry
    per (query, gallery item) pair.
    """
    g_pids = np.asarray(g_pids)
    same_id = g_pids == q_pid
    removed = junk_mask(g_pids) | (same_id & (np.asarray(g_camids) == q_camid))
    keep = ~removed
    return keep, keep & same_id


def ranking_order(scores: np.ndarray) -> np.ndarray:
    """Gallery indices best first: descending score, lower index first among ties."""
    # Negating a float is exact, so a stable ascending sort of -score is the rule.
    return np.argsort(-np.asarray(scores), kind="stable")


def _order_by_rule(scores: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row by descending score, then ascending gallery index."""
    order = np.lexsort((indices, -scores), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(indices, order, -1)


def _top_k_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each row of a score block under the tie rule."""
    n_cols = scores.shape[1]
    if k >= n_cols:
        idx = np.argsort(-scores, axis=1, kind="stable")
        return np.take_along_axis(scores, idx, 1), idx
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(scores, idx, 1)
    kth = vals.min(axis=1)
    # argpartition picks among items tied with the k-th score arbitrarily;
    # those rows are redone with a stable sort.
    for r in np.flatnonzero(np.count_nonzero(scores >= kth[:, None], axis=1) > k):
        idx[r] = np.argsort(-scores[r], kind="stable")[:k]
        vals[r] = scores[r, idx[r]]
    return _order_by_rule(vals, idx.astype(np.int64))


# --------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------


def _load_torch() -> Any:
    """The torch module (imported here on first need), or None when it is not installed."""
    global torch
    if torch is None:
        try:
            import torch as module
        except ImportError:  # pragma: no cover - the project depends on torch
            return None
        torch = module
    return torch


def _is_torch(x: Any) -> bool:
    # A tensor exists only once torch is imported, so an unimported torch means "not a tensor" (and no import).
    module = sys.modules.get("torch")
    if module is None or not isinstance(x, module.Tensor):
        return False
    _load_torch()  # every torch.* use below follows a True from here
    return True


def _check_finite(name: str, x: Any) -> None:
    """Raise on NaN/inf, in chunks so a big gallery needs no full-size mask."""
    rows_per_chunk = max(1, _FINITE_CHECK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, x.shape[0], rows_per_chunk):
        chunk = x[start : start + rows_per_chunk]
        if _is_torch(chunk):
            finite = torch.isfinite(chunk).all(dim=1).cpu().numpy()
        else:
            finite = np.isfinite(chunk).all(axis=1)
        if not finite.all():
            bad = start + int(np.flatnonzero(~finite)[0])
            raise EvalDataError(f"{name} contains NaN or inf values (first at row {bad})")


def _as_features(name: str, x: Any) -> Any:
    """float32 2-D features: a numpy array, or a torch tensor when it lives on a GPU."""
    if _is_torch(x):
        x = x.detach()
        # float32 either way; .to() copies only when needed (bfloat16 has no numpy twin).
        x = x.float() if x.is_cuda else x.to("cpu", torch.float32).numpy()
    if not _is_torch(x):
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise EvalDataError(f"{name} must be a numeric feature matrix, got dtype {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise EvalDataError(f"{name} must be 2-D [num_items, dim], got shape {tuple(x.shape)}")
    _check_finite(name, x)
    return x


def _as_ids(name: str, x: Any) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim != 1:
        raise EvalDataError(f"{name} must be 1-D, got shape {x.shape}")
    if x.size and x.dtype.kind not in "iub":
        raise EvalDataError(f"{name} must hold integers, got dtype {x.dtype}")
    return x.astype(np.int64, copy=False)


def _check_lengths(pairs: Sequence[tuple[str, int]]) -> None:
    """All named lengths must agree; the message names every array and length."""
    if len({n for _, n in pairs}) > 1:
        listing = ", ".join(f"{name}: {n}" for name, n in pairs)
        raise EvalDataError(f"mismatched lengths ({listing})")


def _check_sets(n_query: int, n_gallery: int) -> None:
    if n_query == 0:
        raise EvalDataError("the query set is empty (0 queries)")
    if n_gallery == 0:
        raise EvalDataError("the gallery is empty (0 gallery items)")


def _check_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(k) for k in ranks}))
    except (TypeError, ValueError):
        raise EvalDataError(f"ranks must be positive integers, got {ranks!r}") from None
    if not out or out[0] < 1:
        raise EvalDataError(f"ranks must be a non-empty set of positive integers, got {ranks!r}")
    return out


def _check_threads(num_threads: int | None) -> int:
    if num_threads is None:
        return _default_workers()
    if int(num_threads) < 1:
        raise EvalDataError(f"num_threads must be >= 1, got {num_threads}")
    return int(num_threads)


def _check_ap(ap: str) -> str:
    if ap not in AP_MODES:
        raise EvalDataError(f"unknown ap={ap!r}: expected one of {', '.join(map(repr, AP_MODES))}")
    return ap


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise EvalDataError(
            f"unknown backend={backend!r}: expected one of {', '.join(map(repr, BACKENDS))}"
        )
    if backend == "torch" and _load_torch() is None:  # pragma: no cover - the project depends on torch
        raise EvalDataError("backend='torch' needs torch, which is not installed")
    return backend


def _prepare_ids(n_q: int, n_g: int, q_pids, g_pids, q_camids, g_camids):
    ids = {
        "q_pids": _as_ids("q_pids", q_pids),
        "q_camids": _as_ids("q_camids", q_camids),
        "g_pids": _as_ids("g_pids", g_pids),
        "g_camids": _as_ids("g_camids", g_camids),
    }
    for side, n in (("query", n_q), ("gallery", n_g)):
        p, c = f"{side[0]}_pids", f"{side[0]}_camids"
        _check_lengths([(f"{side} features", n), (p, ids[p].size), (c, ids[c].size)])
    return ids["q_pids"], ids["g_pids"], ids["q_camids"], ids["g_camids"]


def _prepare_features(qf: Any, gf: Any) -> tuple[Any, Any]:
    qf = _as_features("qf", qf)
    gf = _as_features("gf", gf)
    _check_sets(qf.shape[0], gf.shape[0])
    if qf.shape[1] != gf.shape[1]:
        raise EvalDataError(f"feature dims differ: qf has {qf.shape[1]} columns, gf has {gf.shape[1]}")
    # A GPU tensor on one side pulls the other side onto the same device.
    if _is_torch(qf) or _is_torch(gf):
        device = qf.device if _is_torch(qf) else gf.device
        qf = qf if _is_torch(qf) else torch.from_numpy(qf).to(device)
        gf = gf if _is_torch(gf) else torch.from_numpy(gf).to(device)
        if qf.device != gf.device:
            raise EvalDataError(f"qf is on {qf.device} but gf is on {gf.device}")
    return qf, gf


# --------------------------------------------------------------------------
# Scoring in query blocks
# --------------------------------------------------------------------------


def _block_rows(n_gallery: int, block_size: int | None, max_block_bytes: int) -> int:
    if block_size is not None:
        if int(block_size) < 1:
            raise EvalDataError(f"block_size must be >= 1, got {block_size}")
        return int(block_size)
    if max_block_bytes < 4 * n_gallery:
        raise EvalDataError(
            f"max_block_bytes={max_block_bytes} cannot hold one query row of {n_gallery} float32 scores"
        )
    return max(1, max_block_bytes // (4 * n_gallery))


def score_blocks(
    qf: Any,
    gf: Any,
    *,
    block_size: int | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(start, scores)`` with ``scores = qf[start:start+B] @ gf.T`` (float32, numpy).

    ``B`` is ``block_size`` or the most query rows whose scores fit in
    ``max_block_bytes``. The yielded array is one reused buffer (fresh pages
    for every block would cost page faults): it is valid until the next block
    and the consumer may overwrite it. Inputs are checked like
    :func:`evaluate`'s.

    On the CPU numpy's BLAS does the matmul: on the 2-core AMD development
    machine it reached ~196 GFLOP/s against ~123 for torch's MKL ``mm`` at
    512 x 19,732 x 512. Torch tensors on a GPU use ``torch.mm`` there and copy
    each block to the host.
    """
    qf, gf = _prepare_features(qf, gf)
    return _score_blocks(qf, gf, _block_rows(gf.shape[0], block_size, max_block_bytes))


def _score_blocks(qf: Any, gf: Any, block_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """:func:`score_blocks` for checked inputs."""
    n_q, n_g = qf.shape[0], gf.shape[0]
    rows = min(n_q, block_rows)
    buffer = np.empty((rows, n_g), dtype=np.float32)
    if _is_torch(qf):
        gpu_buffer = torch.empty((rows, n_g), dtype=torch.float32, device=qf.device)
        gt = gf.t()
        for start in range(0, n_q, rows):
            b = min(rows, n_q - start)
            torch.mm(qf[start : start + b], gt, out=gpu_buffer[:b])
            torch.from_numpy(buffer[:b]).copy_(gpu_buffer[:b])
            yield start, buffer[:b]
        return
    gt = gf.T
    for start in range(0, n_q, rows):
        b = min(rows, n_q - start)
        np.matmul(qf[start : start + b], gt, out=buffer[:b])
        yield start, buffer[:b]


def _torch_block_rows(
    device: Any, n_gallery: int, block_size: int | None, max_block_bytes: int | None
) -> int:
    """Query rows per block of the torch backend (see :func:`evaluate`)."""
    from fedreid.eval import ranking_torch

    if block_size is not None:
        return _block_rows(n_gallery, block_size, DEFAULT_BLOCK_BYTES)
    if max_block_bytes is not None:
        rows = ranking_torch.rows_within(n_gallery, max_block_bytes)
        if rows < 1:
            raise EvalDataError(
                f"max_block_bytes={max_block_bytes} cannot hold one query row of {n_gallery} scores "
                f"on the torch backend ({ranking_torch.BYTES_PER_SCORE} bytes a score while ranking)"
            )
        return rows
    budget = ranking_torch.device_budget(device)
    # At least one row: if even that does not fit the device, its allocator's error says so.
    return max(1, ranking_torch.rows_within(n_gallery, DEFAULT_BLOCK_BYTES if budget is None else budget))


def _given_score_blocks(scores: np.ndarray, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """Blocks of a precomputed score matrix, copied because the consumer overwrites them."""
    buffer = np.empty((min(rows, scores.shape[0]), scores.shape[1]), dtype=np.float32)
    for start in range(0, scores.shape[0], rows):
        b = min(rows, scores.shape[0] - start)
        buffer[:b] = scores[start : start + b]
        yield start, buffer[:b]


# --------------------------------------------------------------------------
# Ranks of the true matches
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _MatchIndex:
    """Per query, the gallery columns the protocol treats specially, in CSR form.

    Only gallery items of the query's own pid can be true matches or removed
    same-camera items; junk is the same for every query. So a query needs its
    same-pid columns only, and everything outside them (and outside junk) is a
    negative. Columns ascend within each query.
    """

    good_ptr: np.ndarray
    good_cols: np.ndarray
    removed_ptr: np.ndarray
    removed_cols: np.ndarray
    junk_cols: np.ndarray


def _csr_ptr(owner: np.ndarray, n: int) -> np.ndarray:
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n), out=ptr[1:])
    return ptr


def _build_match_index(q_pids, g_pids, q_camids, g_camids) -> _MatchIndex:
    junk = junk_mask(g_pids)
    usable = np.flatnonzero(~junk)
    by_pid = usable[np.argsort(g_pids[usable], kind="stable")]  # grouped by pid, index ascending
    sorted_pids = g_pids[by_pid]
    starts = np.searchsorted(sorted_pids, q_pids, side="left")
    lengths = np.searchsorted(sorted_pids, q_pids, side="right") - starts
    n_q = q_pids.size
    # Every (query, same-pid gallery column) pair, grouped by query.
    owner = np.repeat(np.arange(n_q), lengths)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = by_pid[np.repeat(starts, lengths) + np.arange(owner.size) - first]
    keep, good = gallery_masks(q_pids[owner], q_camids[owner], g_pids[cols], g_camids[cols])
    return _MatchIndex(
        good_ptr=_csr_ptr(owner[good], n_q),
        good_cols=cols[good],
        removed_ptr=_csr_ptr(owner[~keep], n_q),
        removed_cols=cols[~keep],
        junk_cols=np.flatnonzero(junk),
    )


def _exact_row_ranks(negatives: np.ndarray, cols: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Ranks of one query's matches by direct counting (rows with score ties).

    ``negatives`` is the score row with every non-negative item set to -inf;
    a negative ranks before match ``j`` if it scores higher, or equally with a
    lower gallery index.
    """
    order = np.argsort(-scores, kind="stable")  # cols ascend, so ties go to the lower index
    above = [
        np.count_nonzero(negatives > s) + np.count_nonzero(negatives[:c] == s)
        for c, s in zip(cols[order], scores[order])
    ]
    return np.arange(1, cols.size + 1) + np.asarray(above, dtype=np.int64)


def _count_above(
    negatives: np.ndarray, hardest: float, ascending: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per match score (ascending), #negatives strictly above it and at or above it.

    ``negatives`` is one query's score row with every non-negative item
    (matches, removed items, junk) at -inf. Only negatives scoring at least
    the hardest match matter; they are gathered and sorted, or, when they are
    most of the row, the whole row is sorted (cheaper than gathering first).
    """
    keep = negatives >= hardest
    n = np.count_nonzero(keep)
    if n > _DENSE_SORT_FRACTION * negatives.size:
        candidates = np.sort(negatives)[negatives.size - n :]
    else:
        candidates = negatives.compress(keep)
        candidates.sort()
    above = n - candidates.searchsorted(ascending, side="right")
    at_or_above = n - candidates.searchsorted(ascending, side="left")
    return above, at_or_above


def _block_match_ranks(
    scores: np.ndarray,
    good_ptr: np.ndarray,
    good_cols: np.ndarray,
    removed_ptr: np.ndarray,
    removed_cols: np.ndarray,
    junk_cols: np.ndarray,
    pool: ThreadPoolExecutor | None = None,
    workers: int = 1,
) -> np.ndarray:
    """1-based ranks of every true match of a block of queries, ascending per query.

    ``scores`` (B x G) is overwritten. ``good_ptr``/``removed_ptr`` are the
    block's CSR pointers, starting at 0. Returns ranks laid out like
    ``good_cols``.

    A match at descending position ``i`` among its query's matches has rank
    ``i + #negatives ranked before it``; without score ties between a match
    and a negative that is ``i + #negatives scoring strictly higher``.
    Rows are shared among ``pool``'s threads: numpy releases the GIL in the
    compare/compress/sort that dominate a row.
    """
    n_rows = scores.shape[0]
    row_ids = np.arange(n_rows)
    n_good = np.diff(good_ptr)
    good_rows = np.repeat(row_ids, n_good)
    match_scores = scores[good_rows, good_cols]

    # From here on the block holds negatives only: hide matches, removed items, junk.
    scores[good_rows, good_cols] = -np.inf
    scores[np.repeat(row_ids, np.diff(removed_ptr)), removed_cols] = -np.inf
    if junk_cols.size:
        scores[:, junk_cols] = -np.inf

    # Match scores ascending within each row, so position j of row r has
    # descending position i = good_ptr[r + 1] - j.
    ascending = match_scores[np.lexsort((match_scores, good_rows))]
    with_matches = np.flatnonzero(n_good)
    hardest = ascending[good_ptr[:-1][with_matches]]
    above = np.empty(ascending.size, dtype=np.int64)
    at_or_above = np.empty(ascending.size, dtype=np.int64)

    def count_rows(part: np.ndarray) -> None:
        for k in part:
            r = with_matches[k]
            a, b = good_ptr[r], good_ptr[r + 1]
            above[a:b], at_or_above[a:b] = _count_above(scores[r], hardest[k], ascending[a:b])

    parts = np.arange(with_matches.size)
    if pool is None or workers < 2 or with_matches.size < 2:
        count_rows(parts)
    else:  # interleaved, so hard and easy queries spread evenly over the threads
        list(pool.map(count_rows, [parts[i::workers] for i in range(workers)]))

    position = good_ptr[1:][good_rows] - np.arange(ascending.size)
    ranks = np.empty(ascending.size, dtype=np.int64)
    ranks[good_ptr[:-1][good_rows] + position - 1] = position + above
    # A negative scoring exactly like a match: the index rule decides, recount.
    for r in np.unique(good_rows[above != at_or_above]):
        a, b = good_ptr[r], good_ptr[r + 1]
        ranks[a:b] = _exact_row_ranks(scores[r], good_cols[a:b], match_scores[a:b])
    return ranks


def _match_ranks(
    blocks: Iterator[tuple[int, np.ndarray]],
    index: _MatchIndex,
    on_block: Callable[[int, np.ndarray], None] | None = None,
    workers: int = 1,
) -> np.ndarray:
    """Ranks of all true matches (CSR by ``index.good_ptr``) from score blocks."""
    ranks = np.empty(index.good_cols.size, dtype=np.int64)
    with ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(workers)) if workers > 1 else None
        for start, scores in blocks:
            stop = start + scores.shape[0]
            if on_block is not None:
                on_block(start, scores)  # sees the scores before they are overwritten
            g0, g1 = index.good_ptr[start], index.good_ptr[stop]
            r0, r1 = index.removed_ptr[start], index.removed_ptr[stop]
            ranks[g0:g1] = _block_match_ranks(
                scores,
                index.good_ptr[start : stop + 1] - g0,
                index.good_cols[g0:g1],
                index.removed_ptr[start : stop + 1] - r0,
                index.removed_cols[r0:r1],
                index.junk_cols,
                pool,
                workers,
            )
    return ranks


def _default_workers() -> int:
    """Threads for the per-row work: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


# --------------------------------------------------------------------------
# From ranks to CMC / AP / INP
# --------------------------------------------------------------------------


def _ap_terms(i: Any, r: Any, ap: str) -> Any:
    """Per-match AP terms; a query's AP is their mean over its matches.

    ``i``: 1-based position of each match among its query's matches, ``r``:
    its rank; float64 numpy arrays or torch tensors alike (the numpy and the
    torch backends share this formula).
    """
    precision = i / r
    if ap == "standard":
        # torchreid/fast-reid: mean over matches of the precision at each match.
        return precision
    # Market-1501 MATLAB code / layumi compute_mAP: trapezoid between the
    # precision just before the match (1.0 at rank 1) and at the match. At
    # r == 1 (so i == 1) the quotient reads 0 / 1 and the added bool gives 1.0;
    # elsewhere the bool adds an exact 0.
    before = (i - 1) / (r - 1).clip(min=1) + (r == 1)
    return (before + precision) / 2


def _per_query_metrics(ranks: np.ndarray, good_ptr: np.ndarray, ap: str) -> dict[str, np.ndarray]:
    """Per-query first-match rank, AP and INP (0 where a query has no match)."""
    n_q = good_ptr.size - 1
    n_good = np.diff(good_ptr)
    owner = np.repeat(np.arange(n_q), n_good)
    # i: 1-based position of each match among its query's matches.
    i = (np.arange(ranks.size) - good_ptr[:-1][owner] + 1).astype(np.float64)
    terms = _ap_terms(i, ranks.astype(np.float64), ap)
    has = n_good > 0
    ap_q = np.zeros(n_q)
    ap_q[has] = np.bincount(owner, weights=terms, minlength=n_q)[has] / n_good[has]
    first = np.zeros(n_q, dtype=np.int64)
    last = np.zeros(n_q, dtype=np.int64)
    first[has] = ranks[good_ptr[:-1][has]]
    last[has] = ranks[good_ptr[1:][has] - 1]
    inp = np.zeros(n_q)
    inp[has] = n_good[has] / last[has]  # Ye et al. 2021: matches / rank of the hardest match
    return {"first_match_rank": first, "ap": ap_q, "inp": inp, "num_matches": n_good, "valid": has}


def _summarise(
    per_query: dict[str, np.ndarray], *, ap: str, ranks: tuple[int, ...], minp: bool
) -> dict[str, Any]:
    has = per_query["num_matches"] > 0
    n_q, n_valid = has.size, int(has.sum())
    if n_valid == 0:
        raise EvalDataError(
            f"none of the {n_q} queries has a true match in the gallery (after junk/same-camera removal)"
        )
    # standard: average over queries with a match; official: over all queries,
    # a query without a match scoring 0 (what layumi's evaluate_gpu.py does).
    averaged = has if ap == "standard" else np.ones_like(has)
    first = per_query["first_match_rank"][averaged]
    found = first > 0
    result: dict[str, Any] = {f"rank{k}": float(np.mean(found & (first <= k))) for k in ranks}
    result["mAP"] = float(np.mean(per_query["ap"][averaged]))
    if minp:
        result["mINP"] = float(np.mean(per_query["inp"][averaged]))
    result.update(
        num_queries=n_q,
        num_valid_queries=int(averaged.sum()),
        num_skipped_queries=int(n_q - averaged.sum()),
        num_queries_without_match=int(n_q - n_valid),
        ap=ap,
        ranks=ranks,
        minp=minp,
    )
    return result


def cmc_curve(result: dict[str, Any]) -> np.ndarray:
    """The CMC values of an :func:`evaluate` result, in the order of ``result["ranks"]``.

    For a full curve evaluate with ``ranks=range(1, 51)``.
    """
    return np.array([result[f"rank{k}"] for k in result["ranks"]], dtype=np.float64)


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def evaluate(
    qf: Any,
    gf: Any,
    q_pids: Any,
    g_pids: Any,
    q_camids: Any,
    g_camids: Any,
    *,
    ap: str = "standard",
    ranks: Sequence[int] = (1, 5, 10),
    minp: bool = False,
    block_size: int | None = None,
    max_block_bytes: int | None = None,
    return_per_query: bool = False,
    num_threads: int | None = None,
    backend: str = "auto",
) -> dict[str, Any]:
    """Exact CMC and mAP of a query set against a gallery (see the module docstring).

    ``qf``/``gf``: features (numpy or torch, cast to float32), compared by inner
    product, so pass L2-normalised features for cosine similarity. Torch
    tensors on a GPU are scored and ranked there (``backend``); CPU tensors
    and numpy arrays go through the same numpy path, so they give identical
    results.

    Returns a dict with ``rank{k}`` for every k in ``ranks`` and ``mAP`` (and
    ``mINP`` when ``minp``), all fractions in [0, 1], plus the counts and the
    options used. CMC rank-k is the fraction of averaged queries whose first
    true match is within the top k of the filtered ranking; a gallery shorter
    than k simply saturates.

    ``ap="standard"``: AP is the mean, over a query's true matches, of the
    precision at each match's rank over the whole filtered gallery
    (torchreid / fast-reid ``evaluate_rank``); queries without a true match
    are skipped: ``num_valid_queries`` = queries with a match, and
    ``num_skipped_queries`` = ``num_queries_without_match``.

    ``ap="official"``: the Market-1501 MATLAB / layumi ``compute_mAP``
    trapezoid AP, ``sum_i (p_{i-1} + p_i) / 2 / n_good`` with ``p_0 = 1``
    (exactly ``1.0`` when the first match is at rank 1). As in layumi's
    ``evaluate_gpu.py``, queries without a true match are not skipped but
    score 0 for both CMC and AP, so averages run over all queries:
    ``num_valid_queries`` = ``num_queries``, ``num_skipped_queries`` = 0, and
    ``num_queries_without_match`` says how many scored 0. Junk is the same set
    (pid -1 plus same-pid-same-camera); ties follow this module's rule, where
    layumi's unstable ``argsort`` leaves them unspecified.

    ``minp``: adds mINP (Ye et al., "Deep Learning for Person Re-identification:
    A Survey and Outlook", TPAMI 2021): INP = #matches / rank of the hardest
    match, averaged like AP.

    ``backend``: ``"numpy"`` ranks on the host (torch features on a GPU are
    scored there and each score block is copied back); ``"torch"`` scores,
    ranks and computes first-match ranks, AP and INP on the features' device
    (:mod:`fedreid.eval.ranking_torch`; numpy inputs run on the CPU), and
    only per-query numbers come back; ``"auto"`` (default) is ``"torch"`` for
    CUDA features and ``"numpy"`` otherwise. Both follow the same rules,
    ties included; their results agree to float64 rounding of the AP sums.

    ``block_size`` (queries per block) or ``max_block_bytes`` bounds memory:
    with ``"numpy"`` the bytes of one float32 score block (default
    :data:`DEFAULT_BLOCK_BYTES`), with ``"torch"`` the working set of one
    block (:data:`~fedreid.eval.ranking_torch.BYTES_PER_SCORE` per score;
    default: a share of the free memory on CUDA, :data:`DEFAULT_BLOCK_BYTES`
    elsewhere). ``num_threads`` threads (default: the usable CPUs, at most 8)
    share the numpy backend's per-query counting (the torch backend uses
    torch's own threads and reports ``torch.get_num_threads()``). Results do
    not depend on either.
    ``return_per_query`` adds ``"per_query"``: arrays ``first_match_rank``
    (0 = no match), ``ap``, ``inp``, ``num_matches`` and ``valid`` (the query
    has a true match), one entry per query, computed in the same block pass
    (no second pass, no extra score memory): callers that pick queries by AP
    (``fedreid.eval.query_picking.picked_queries``) read them from here.

    Raises :class:`EvalDataError` (a ``ValueError``) for empty sets,
    mismatched lengths, NaN/inf features, differing feature dims, an unknown
    ``ap`` or ``backend``, or no query with a match.
    """
    ap = _check_ap(ap)
    backend = _check_backend(backend)
    ranks_t = _check_ranks(ranks)
    qf, gf = _prepare_features(qf, gf)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(
        qf.shape[0], gf.shape[0], q_pids, g_pids, q_camids, g_camids
    )
    workers = _check_threads(num_threads)
    if backend == "auto":
        backend = "torch" if _is_torch(qf) else "numpy"  # torch features here live on a GPU
    if backend == "torch":
        from fedreid.eval import ranking_torch

        qf, gf = ranking_torch.as_device_features(qf, gf)
        rows = min(qf.shape[0], _torch_block_rows(qf.device, gf.shape[0], block_size, max_block_bytes))
        index = _build_match_index(q_pids, g_pids, q_camids, g_camids)
        terms = functools.partial(_ap_terms, ap=ap)
        per_query = ranking_torch.per_query_metrics(qf, gf, index, rows, terms)
        workers = torch.get_num_threads()
    else:
        budget = DEFAULT_BLOCK_BYTES if max_block_bytes is None else max_block_bytes
        rows = min(qf.shape[0], _block_rows(gf.shape[0], block_size, budget))
        index = _build_match_index(q_pids, g_pids, q_camids, g_camids)
        match_ranks = _match_ranks(_score_blocks(qf, gf, rows), index, workers=workers)
        per_query = _per_query_metrics(match_ranks, index.good_ptr, ap)
    result = _summarise(per_query, ap=ap, ranks=ranks_t, minp=minp)
    result.update(
        block_size=rows,
        num_threads=workers,
        device=str(qf.device) if _is_torch(qf) else "cpu",
        backend=backend,
    )
    if return_per_query:
        result["per_query"] = per_query
    return result


def evaluate_scores(
    scores: Any,
    q_pids: Any,
    g_pids: Any,
    q_camids: Any,
    g_camids: Any,
    *,
    ap: str = "standard",
    ranks: Sequence[int] = (1, 5, 10),
    minp: bool = False,
    block_size: int | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    return_per_query: bool = False,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """:func:`evaluate` for a precomputed [Q, G] *similarity* matrix (higher is better).

    For a distance matrix (e.g. from :mod:`fedreid.eval.rerank`) pass ``-dist``.
    """
    ap = _check_ap(ap)
    ranks_t = _check_ranks(ranks)
    scores = _as_features("scores", scores)
    if _is_torch(scores):
        scores = scores.cpu().numpy()
    _check_sets(*scores.shape)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(*scores.shape, q_pids, g_pids, q_camids, g_camids)
    rows = min(scores.shape[0], _block_rows(scores.shape[1], block_size, max_block_bytes))
    index = _build_match_index(q_pids, g_pids, q_camids, g_camids)
    workers = _check_threads(num_threads)
    match_ranks = _match_ranks(_given_score_blocks(scores, rows), index, workers=workers)
    per_query = _per_query_metrics(match_ranks, index.good_ptr, ap)
    result = _summarise(per_query, ap=ap, ranks=ranks_t, minp=minp)
    result.update(block_size=rows, num_threads=workers)
    if return_per_query:
        result["per_query"] = per_query
    return result


def _single_shot_hits(
    row: np.ndarray,
    good: np.ndarray,
    group_start: np.ndarray,
    group_size: np.ndarray,
    by_pid: np.ndarray,
    own_group: int,
    ranks: tuple[int, ...],
    draws: np.ndarray,
) -> np.ndarray:
    """Mean CMC hits of one query over repeats of one-image-per-identity sampling.

    ``draws`` (repeats x groups) are uniform [0, 1) numbers; each picks one
    member of each gallery identity, the query's own identity drawing from its
    true matches only (its same-camera images are removed first).
    """
    # min() guards the float rounding of draw * size up to size.
    picked = by_pid[group_start + np.minimum((draws * group_size).astype(np.int64), group_size - 1)]
    match = good[np.minimum((draws[:, own_group] * good.size).astype(np.int64), good.size - 1)]
    picked_scores = row[picked]
    match_scores = row[match][:, None]
    # Tie rule: equal scores rank by lower gallery index.
    before = (picked_scores > match_scores) | ((picked_scores == match_scores) & (picked < match[:, None]))
    before[:, own_group] = False
    rank = 1 + np.count_nonzero(before, axis=1)
    return np.array([np.mean(rank <= k) for k in ranks])


def evaluate_cuhk03_single_shot(
    qf: Any,
    gf: Any,
    q_pids: Any,
    g_pids: Any,
    q_camids: Any,
    g_camids: Any,
    *,
    rng: np.random.Generator,
    num_repeats: int = 10,
    ranks: Sequence[int] = (1, 5, 10),
    block_size: int | None = None,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_threads: int | None = None,
    return_per_query: bool = False,
) -> dict[str, Any]:
    """Old CUHK03 single-gallery-shot CMC (Li et al., DeepReID, CVPR 2014).

    torchreid ``eval_cuhk03`` semantics: for each query, after the usual
    junk / same-camera removal, one gallery image per identity is sampled
    uniformly (``rng``; one ``rng.random((num_repeats, identities))`` draw
    per valid query, in query order), CMC is computed on that one-shot
    gallery, and this is averaged over ``num_repeats`` samplings. ``mAP`` is
    the standard AP over the whole filtered gallery, as torchreid reports it.
    Queries without a true match are skipped. ``return_per_query`` adds
    ``"per_query"`` as in :func:`evaluate` (standard AP, whole gallery).
    """
    if not isinstance(rng, np.random.Generator):
        raise EvalDataError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if int(num_repeats) < 1:
        raise EvalDataError(f"num_repeats must be >= 1, got {num_repeats}")
    ranks_t = _check_ranks(ranks)
    qf, gf = _prepare_features(qf, gf)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(
        qf.shape[0], gf.shape[0], q_pids, g_pids, q_camids, g_camids
    )
    rows = min(qf.shape[0], _block_rows(gf.shape[0], block_size, max_block_bytes))
    index = _build_match_index(q_pids, g_pids, q_camids, g_camids)

    usable = np.flatnonzero(~junk_mask(g_pids))
    by_pid = usable[np.argsort(g_pids[usable], kind="stable")]
    group_pids, group_start, group_size = np.unique(g_pids[by_pid], return_index=True, return_counts=True)
    hits = np.zeros((qf.shape[0], len(ranks_t)))

    def sample_block(start: int, scores: np.ndarray) -> None:
        for r in range(scores.shape[0]):
            q = start + r
            good = index.good_cols[index.good_ptr[q] : index.good_ptr[q + 1]]
            if good.size == 0:
                continue
            own = int(np.searchsorted(group_pids, q_pids[q]))
            draws = rng.random((int(num_repeats), group_pids.size))
            hits[q] = _single_shot_hits(scores[r], good, group_start, group_size, by_pid, own, ranks_t, draws)

    workers = _check_threads(num_threads)
    match_ranks = _match_ranks(_score_blocks(qf, gf, rows), index, sample_block, workers)
    per_query = _per_query_metrics(match_ranks, index.good_ptr, "standard")
    has = per_query["num_matches"] > 0
    if not has.any():
        raise EvalDataError(f"none of the {has.size} queries has a true match in the gallery")
    result: dict[str, Any] = {f"rank{k}": float(hits[has, c].mean()) for c, k in enumerate(ranks_t)}
    result.update(
        mAP=float(per_query["ap"][has].mean()),
        num_queries=int(has.size),
        num_valid_queries=int(has.sum()),
        num_skipped_queries=int((~has).sum()),
        num_queries_without_match=int((~has).sum()),
        num_repeats=int(num_repeats),
        ranks=ranks_t,
        protocol="cuhk03-single-gallery-shot",
    )
    if return_per_query:
        result["per_query"] = per_query
    return result


def accuracy(logits_or_preds: Any, labels: Any) -> float:
    """Top-1 classification accuracy in [0, 1].

    ``logits_or_preds``: [N, C] scores (argmax taken; ties to the lower class)
    or [N] predicted labels; numpy or torch.
    """
    preds, labels = (
        x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x) for x in (logits_or_preds, labels)
    )
    if preds.ndim == 2:
        preds = preds.argmax(axis=1)
    if preds.ndim != 1 or labels.ndim != 1:
        raise EvalDataError(
            f"expected [N, C] logits or [N] predictions and [N] labels, got {preds.shape} and {labels.shape}"
        )
    if preds.shape[0] != labels.shape[0]:
        raise EvalDataError(f"mismatched lengths (predictions: {preds.shape[0]}, labels: {labels.shape[0]})")
    if preds.shape[0] == 0:
        raise EvalDataError("accuracy of an empty batch is undefined (0 predictions)")
    return float(np.mean(preds == labels))
