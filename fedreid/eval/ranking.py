"""The ranking kernel of re-ID evaluation: block scoring, the tie rule, top-k and ranks of true matches, CPU and GPU.

Everything that turns features into *ranks* lives here, once;
:mod:`fedreid.eval.metrics` turns ranks into CMC / mAP / mINP, the top-k
search of :mod:`fedreid.retrieval.exact`, re-ranking
(:mod:`fedreid.eval.rerank`) and the pictures (:mod:`fedreid.eval.visualize`)
use the same rules from here.

The contract, for every function of this module:

* **Scores.** The similarity of a query and a gallery item is the inner
  product of their float32 features (the cosine for L2-normalised features);
  a higher score ranks earlier. Features are checked first
  (:func:`as_features`, :func:`prepare_features`): 2-D, numeric, finite, equal
  dims, non-empty sets; a violation raises :class:`EvalDataError`.
* **Filtering** (:func:`gallery_masks`, the one place that states it): per
  query, a gallery item is removed when it is junk (pid :data:`JUNK_PID`) or
  shows the query's identity in the query's camera; distractors (pid 0 in
  Market-1501) stay as ordinary negatives; the true matches are the remaining
  items with the query's pid.
* **Ties** (:func:`ranking_order`): a query's ranking is the *stable* sort of
  its gallery by descending score, i.e. among equal scores the lower gallery
  index ranks first. :func:`top_k_rows`, :func:`order_by_rule`,
  :func:`match_ranks` and the torch path all follow it; ``-0.0`` and ``+0.0``
  are equal scores. The rule decides scores that come out bit-equal: a BLAS
  (or cuBLAS) float32 matmul rounds in an order set by the block's shape and
  a column's place in it, so identical features can score an ulp or two
  apart, and another block size can reorder items that close. Blocks are a
  function of the inputs and options (and, on CUDA, of the card:
  :func:`device_budget`), so a rerun gets the same scores.
* **Memory.** The full query x gallery score matrix is never materialised:
  queries are scored in blocks (:func:`score_blocks`, at most
  ``max_block_bytes`` of float32 scores in one reused buffer; on the torch
  path :data:`BYTES_PER_SCORE` per score of the working set).

Speed (the numpy path, :func:`match_ranks`): instead of sorting each row, the
rank of every true match is counted: the match at descending position ``i``
among a query's matches has rank ``i + #negatives ranked before it``. Only
negatives scoring at least the query's hardest match can precede a match, so
each row is cut down to those (usually a few percent) and only they are
sorted. Exact score ties between a match and a negative are detected and
recounted with the index rule. bench/eval_speed.py measures this against a
bare matmul and a full-sort implementation.

The torch path (:func:`torch_per_query_metrics`; ``evaluate(...,
backend="torch")``, the default for CUDA features) runs on whatever device
the features live: per query block, the score block (one matmul), removed
items set to ``-inf`` (finite scores are checked beforehand, so every kept
item ranks before every removed one), one stable descending sort of each row,
the sorted positions of the true matches, and from them the first-match rank,
AP and INP of each query. The AP terms come from the caller
(:func:`fedreid.eval.metrics`'s AP formula, either form), so the formula lives
once. Only the per-query numbers are copied to the host, once, at the end; no
score row ever leaves the device. It is plain torch, so the same code runs on
CPU tensors, which is how the tests compare it with the numpy path.
bench/gpu_eval.py measures it against a bare block matmul + full sort.

torch is imported on first need only (:func:`load_torch`): numpy inputs never
import it, so a process that only reads a gallery store (a federated search
site's ClientApp, started per query) saves a second of start-up.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from fedreid.errors import EvalDataError

if TYPE_CHECKING:
    import torch as torch_module

#: torch, once an input needs it (:func:`load_torch`).
torch: Any = None

__all__ = [
    "BYTES_PER_SCORE",
    "CUDA_FREE_SHARE",
    "DEFAULT_BLOCK_BYTES",
    "JUNK_PID",
    "MAX_BLOCK_ELEMENTS",
    "APTerms",
    "EvalDataError",
    "MatchIndex",
    "as_device_features",
    "as_features",
    "block_rows",
    "build_match_index",
    "check_sets",
    "default_workers",
    "device_budget",
    "gallery_masks",
    "given_score_blocks",
    "is_torch",
    "junk_mask",
    "load_torch",
    "match_ranks",
    "order_by_rule",
    "prepare_features",
    "ranking_order",
    "rows_within",
    "score_blocks",
    "score_rows",
    "top_k_rows",
    "torch_block_rows",
    "torch_per_query_metrics",
]

#: Gallery pid of junk images (Market-1501 ``-1``): removed for every query.
JUNK_PID = -1
#: Default bound on one block of scores (float32 queries x gallery).
DEFAULT_BLOCK_BYTES = 64 * 2**20
_FINITE_CHECK_ELEMENTS = 1 << 22  # elements per chunk of the NaN/inf check
# Above this share of candidates per block, sorting whole rows beats compacting
# them first (numpy's SIMD sort ~2 ns/score vs compaction ~1-2 ns/kept score).
_DENSE_SORT_FRACTION = 0.5

#: Device memory one query x gallery score costs while a block is ranked: the
#: float32 scores, the sort's float32 values and int64 indices, the sort's own
#: double buffers (keys and int64 values), two bool masks, and slack for the
#: allocator's rounding.
BYTES_PER_SCORE = 48
#: Share of the card's total memory one block of the torch path uses on CUDA: fixed per card, so
#: the same card scores the same blocks (the float32 matmul's last bits depend on the block's shape).
CUDA_TOTAL_SHARE = 1 / 8
#: At most this share of the free CUDA memory (plus the allocator's unused cache) goes to one block;
#: the rest stays for whatever else lives on the card (a model, its optimiser).
CUDA_FREE_SHARE = 0.5
#: Elements of one score block at most: sort and nonzero index with 32-bit
#: offsets in some torch kernels, so a block stays below 2**31 scores.
MAX_BLOCK_ELEMENTS = 2**31 - 1


#: ``terms(i, r)``: per-match AP terms from 1-based match positions and ranks
#: (float64 tensors); :mod:`fedreid.eval.metrics` passes its AP formula for one AP form.
APTerms = Callable[["torch_module.Tensor", "torch_module.Tensor"], "torch_module.Tensor"]


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


def order_by_rule(scores: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, indices)`` with each row sorted by descending score, then ascending gallery index.

    ``indices`` are the gallery indices of ``scores`` (same shape); the tie
    rule of :func:`ranking_order` for candidates gathered from anywhere (a
    top-k, a faiss search).
    """
    order = np.lexsort((indices, -scores), axis=-1)
    return np.take_along_axis(scores, order, -1), np.take_along_axis(indices, order, -1)


def top_k_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each row of a score block under the tie rule: ``(scores, indices)``, best first.

    ``scores``: a 2-D block (higher is better). Returns two ``[rows, min(k,
    columns)]`` arrays, the scores and their int64 column indices, ordered as
    :func:`ranking_order` orders the row: descending score, lower index first
    among ties (also for ties across the k-th place).
    """
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
    return order_by_rule(vals, idx.astype(np.int64))



# --------------------------------------------------------------------------
# Feature inputs
# --------------------------------------------------------------------------


def load_torch() -> Any:
    """The torch module (imported here on first need), or None when it is not installed."""
    global torch
    if torch is None:
        try:
            import torch as module
        except ImportError:  # pragma: no cover - the project depends on torch
            return None
        torch = module
    return torch


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor; never imports torch (no torch imported: no tensor)."""
    # A tensor exists only once torch is imported, so an unimported torch means "not a tensor" (and no import).
    module = sys.modules.get("torch")
    if module is None or not isinstance(x, module.Tensor):
        return False
    load_torch()  # every torch.* use below follows a True from here
    return True


@contextmanager
def full_fp32_matmul() -> Iterator[None]:
    """Torch fp32 matmuls in full precision inside, whatever ``train.tf32`` set for the process.

    TF32 keeps 10 mantissa bits, which reorders near-tied gallery items: a
    ranking on a GPU would no longer equal the CPU path's. The settings are
    put back on exit, so training keeps its TF32
    (:func:`fedreid.utils.precision.full_fp32_matmul`, imported here on first
    use: this module imports no torch until a tensor needs it).
    """
    from fedreid.utils.precision import full_fp32_matmul as full_fp32

    with full_fp32():
        yield


def _check_finite(name: str, x: Any) -> None:
    """Raise on NaN/inf, in chunks so a big gallery needs no full-size mask."""
    rows_per_chunk = max(1, _FINITE_CHECK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, x.shape[0], rows_per_chunk):
        chunk = x[start : start + rows_per_chunk]
        if is_torch(chunk):
            finite = torch.isfinite(chunk).all(dim=1).cpu().numpy()
        else:
            finite = np.isfinite(chunk).all(axis=1)
        if not finite.all():
            bad = start + int(np.flatnonzero(~finite)[0])
            raise EvalDataError(f"{name} contains NaN or inf values (first at row {bad})")


def as_features(name: str, x: Any, *, keep_float64: bool = False) -> Any:
    """float32 2-D features: a numpy array, or a torch tensor when it lives on a GPU.

    ``keep_float64``: float64 input stays float64 (on the host), for scores
    whose order float32 would turn into ties. Raises :class:`EvalDataError` naming ``name`` for a non-numeric dtype, a
    shape that is not 2-D, or a NaN/inf value (checked in chunks, so a big
    gallery needs no full-size mask).
    """
    if is_torch(x):
        x = x.detach()
        # float32 either way; .to() copies only when needed (bfloat16 has no numpy twin).
        if keep_float64 and x.dtype == torch.float64:
            x = x.cpu().numpy()
        else:
            x = x.float() if x.is_cuda else x.to("cpu", torch.float32).numpy()
    if not is_torch(x):
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise EvalDataError(f"{name} must be a numeric feature matrix, got dtype {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float64 if keep_float64 and x.dtype == np.float64 else np.float32)
    if x.ndim != 2:
        raise EvalDataError(f"{name} must be 2-D [num_items, dim], got shape {tuple(x.shape)}")
    _check_finite(name, x)
    return x


def check_sets(n_query: int, n_gallery: int) -> None:
    """Raise :class:`EvalDataError` when the query set or the gallery is empty."""
    if n_query == 0:
        raise EvalDataError("the query set is empty (0 queries)")
    if n_gallery == 0:
        raise EvalDataError("the gallery is empty (0 gallery items)")


def prepare_features(qf: Any, gf: Any) -> tuple[Any, Any]:
    """Checked query and gallery features (:func:`as_features`, :func:`check_sets`, equal dims) on one device.

    numpy arrays and CPU tensors come back as float32 numpy arrays; when
    either side is a GPU tensor both come back as float32 tensors on its
    device.
    """
    qf = as_features("qf", qf)
    gf = as_features("gf", gf)
    check_sets(qf.shape[0], gf.shape[0])
    if qf.shape[1] != gf.shape[1]:
        raise EvalDataError(f"feature dims differ: qf has {qf.shape[1]} columns, gf has {gf.shape[1]}")
    # A GPU tensor on one side pulls the other side onto the same device.
    if is_torch(qf) or is_torch(gf):
        device = qf.device if is_torch(qf) else gf.device
        qf = qf if is_torch(qf) else torch.from_numpy(qf).to(device)
        gf = gf if is_torch(gf) else torch.from_numpy(gf).to(device)
        if qf.device != gf.device:
            raise EvalDataError(f"qf is on {qf.device} but gf is on {gf.device}")
    _check_scores_fit(qf, gf)
    return qf, gf


def _largest_magnitude(x: Any) -> float:
    """``max |x|`` without a full-size copy (two reductions)."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return 0.0
    return max(float(x.max()), -float(x.min()))


def _check_scores_fit(qf: Any, gf: Any) -> None:
    """Refuse finite features whose inner products could overflow float32 (and rank inf/NaN scores).

    Every partial sum of a score is at most ``d * max|q| * max|g|`` in size,
    so below float32's largest value no score (nor its summation) overflows;
    features of any sensible scale (L2-normalised ones: 1) are far below it.
    """
    bound = qf.shape[1] * _largest_magnitude(qf) * _largest_magnitude(gf)
    if not bound < float(np.finfo(np.float32).max):
        raise EvalDataError(
            f"qf and gf are too large to score in float32: their largest entries "
            f"({_largest_magnitude(qf):.3g}, {_largest_magnitude(gf):.3g}) times the dimension {qf.shape[1]} "
            "could overflow an inner product; L2-normalise the features"
        )


# --------------------------------------------------------------------------
# Scoring in query blocks
# --------------------------------------------------------------------------


def block_rows(n_gallery: int, block_size: int | None, max_block_bytes: int, itemsize: int = 4) -> int:
    """Query rows per numpy score block: ``block_size``, else the most rows within ``max_block_bytes``.

    ``itemsize``: bytes a score (4: float32; 8: float64 scores given as such).

    Raises :class:`EvalDataError` for ``block_size < 1`` or a budget that
    cannot hold one row of ``n_gallery`` scores.
    """
    if block_size is not None:
        if int(block_size) < 1:
            raise EvalDataError(f"block_size must be >= 1, got {block_size}")
        return int(block_size)
    if max_block_bytes < itemsize * n_gallery:
        raise EvalDataError(
            f"max_block_bytes={max_block_bytes} cannot hold one query row of {n_gallery} "
            f"{'float64' if itemsize == 8 else 'float32'} scores"
        )
    return max(1, max_block_bytes // (itemsize * n_gallery))


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
    :func:`fedreid.eval.metrics.evaluate`'s.

    On the CPU numpy's BLAS does the matmul: on the 2-core AMD development
    machine it reached ~196 GFLOP/s against ~123 for torch's MKL ``mm`` at
    512 x 19,732 x 512. Torch tensors on a GPU use ``torch.mm`` there and copy
    each block to the host.
    """
    qf, gf = prepare_features(qf, gf)
    return score_rows(qf, gf, block_rows(gf.shape[0], block_size, max_block_bytes))


def score_rows(qf: Any, gf: Any, rows_per_block: int) -> Iterator[tuple[int, np.ndarray]]:
    """:func:`score_blocks` for inputs already checked by :func:`prepare_features`, ``rows_per_block`` queries a block."""
    n_q, n_g = qf.shape[0], gf.shape[0]
    rows = min(n_q, rows_per_block)
    buffer = np.empty((rows, n_g), dtype=np.float32)
    if is_torch(qf):
        gpu_buffer = torch.empty((rows, n_g), dtype=torch.float32, device=qf.device)
        gt = gf.t()
        for start in range(0, n_q, rows):
            b = min(rows, n_q - start)
            with full_fp32_matmul():
                torch.mm(qf[start : start + b], gt, out=gpu_buffer[:b])
            torch.from_numpy(buffer[:b]).copy_(gpu_buffer[:b])
            yield start, buffer[:b]
        return
    gt = gf.T
    for start in range(0, n_q, rows):
        b = min(rows, n_q - start)
        np.matmul(qf[start : start + b], gt, out=buffer[:b])
        yield start, buffer[:b]


def torch_block_rows(
    device: Any, n_gallery: int, block_size: int | None, max_block_bytes: int | None
) -> int:
    """Query rows per block of the torch path (see :func:`fedreid.eval.metrics.evaluate`).

    ``block_size`` when given; else the rows whose working set
    (:data:`BYTES_PER_SCORE` a score) fits ``max_block_bytes``, or, without
    it, :func:`device_budget` (:data:`DEFAULT_BLOCK_BYTES` off CUDA).
    """
    if block_size is not None:
        return block_rows(n_gallery, block_size, DEFAULT_BLOCK_BYTES)
    if max_block_bytes is not None:
        rows = rows_within(n_gallery, max_block_bytes)
        if rows < 1:
            raise EvalDataError(
                f"max_block_bytes={max_block_bytes} cannot hold one query row of {n_gallery} scores "
                f"on the torch backend ({BYTES_PER_SCORE} bytes a score while ranking)"
            )
        return rows
    budget = device_budget(device)
    # At least one row: if even that does not fit the device, its allocator's error says so.
    return max(1, rows_within(n_gallery, DEFAULT_BLOCK_BYTES if budget is None else budget))


def given_score_blocks(scores: np.ndarray, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, block)`` of ``rows`` rows of a precomputed score matrix, copied (the consumer overwrites them)."""
    buffer = np.empty((min(rows, scores.shape[0]), scores.shape[1]), dtype=scores.dtype)
    for start in range(0, scores.shape[0], rows):
        b = min(rows, scores.shape[0] - start)
        buffer[:b] = scores[start : start + b]
        yield start, buffer[:b]



# --------------------------------------------------------------------------
# Ranks of the true matches (numpy)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MatchIndex:
    """Per query (from :func:`build_match_index`), the gallery columns the protocol treats specially, in CSR form.

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


def build_match_index(q_pids, g_pids, q_camids, g_camids) -> MatchIndex:
    """The :class:`MatchIndex` of checked int64 id arrays, by the rule of :func:`gallery_masks`."""
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
    return MatchIndex(
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


def match_ranks(
    blocks: Iterator[tuple[int, np.ndarray]],
    index: MatchIndex,
    on_block: Callable[[int, np.ndarray], None] | None = None,
    workers: int = 1,
) -> np.ndarray:
    """1-based ranks of all true matches under the tie rule, from score blocks.

    ``blocks``: ``(start, scores)`` pairs covering the queries in order
    (:func:`score_rows`, :func:`given_score_blocks`); each block is
    overwritten. ``on_block(start, scores)`` sees every block first.
    ``workers`` threads share the rows. Returns int64 ranks laid out like
    ``index.good_cols`` (CSR by ``index.good_ptr``), ascending within each
    query.
    """
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


def default_workers() -> int:
    """Threads for the per-row work: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


# --------------------------------------------------------------------------
# The torch path: ranks, first match, AP and INP on the features' device
# --------------------------------------------------------------------------


def rows_within(n_gallery: int, budget_bytes: int) -> int:
    """Query rows whose working set (:data:`BYTES_PER_SCORE` per score) fits ``budget_bytes``.

    0 when not even one row fits; never more than :data:`MAX_BLOCK_ELEMENTS`
    scores per block.
    """
    rows = int(budget_bytes) // (BYTES_PER_SCORE * max(1, n_gallery))
    return min(rows, MAX_BLOCK_ELEMENTS // max(1, n_gallery))


def device_budget(device: torch.device) -> int | None:
    """Bytes one block may use on ``device``: :data:`CUDA_TOTAL_SHARE` of the card's memory on CUDA.

    The budget depends on the card only, so a run evaluates in the same
    blocks every time, whatever training left allocated: the float32 scores'
    last bits depend on the block's shape (cuBLAS, like any BLAS, picks its
    kernel and tiling by shape), and so, for near ties, do the ranks. Only
    when that budget exceeds :data:`CUDA_FREE_SHARE` of the free memory
    (``torch.cuda.mem_get_info`` plus what the caching allocator holds
    unused, which it serves the block from first) is it halved until it fits:
    a card that full gets smaller blocks rather than an out-of-memory error.
    None for other devices, whose budget the caller fixes.
    """
    if device.type != "cuda":
        return None
    load_torch()
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    budget = int(CUDA_TOTAL_SHARE * total)
    room = int(CUDA_FREE_SHARE * (free + cached))
    while budget > room and budget > 1:
        budget //= 2
    return budget


def _torch_block_match_ranks(
    scores: torch.Tensor,
    good_rows: torch.Tensor,
    good_cols: torch.Tensor,
    removed_rows: torch.Tensor,
    removed_cols: torch.Tensor,
    junk_cols: torch.Tensor,
) -> torch.Tensor:
    """1-based ranks of a block's true matches, ascending within each query, queries in order.

    ``scores`` (B x G) is overwritten. ``good_rows``/``removed_rows`` are
    block-local row numbers of the (row, column) pairs, grouped by row.
    """
    # -0.0 == +0.0 under the tie rule, but a radix sort (CUDA) orders by bit
    # pattern and would put -0.0 after +0.0: make every zero positive.
    scores.masked_fill_(scores == 0, 0.0)
    if junk_cols.numel():
        scores.index_fill_(1, junk_cols, float("-inf"))
    if removed_cols.numel():
        scores.index_put_((removed_rows, removed_cols), torch.tensor(float("-inf"), device=scores.device))
    # Stable + descending: equal scores keep ascending gallery order, the tie rule.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    good = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    good.index_put_((good_rows, good_cols), torch.tensor(True, device=scores.device))
    hit = torch.gather(good, 1, order)
    del order, good
    # Row-major order: rows ascending, positions ascending within a row. Every
    # kept item sorts before every removed (-inf) one, so a position is a rank - 1.
    return hit.nonzero(as_tuple=True)[1] + 1


def _torch_block_per_query(
    ranks: torch.Tensor, owner: torch.Tensor, ptr: torch.Tensor, n_good: np.ndarray, ap_terms: APTerms
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-match rank, AP and INP of a block's queries (0 where a query has no match).

    ``ranks`` ascend within each query, laid out by the block-local CSR
    pointers ``ptr`` (device) whose counts are ``n_good`` (host);
    ``owner`` is each match's block-local query.
    """
    device, n_rows = ranks.device, n_good.size
    n_good_t = torch.as_tensor(n_good, device=device)
    first = torch.zeros(n_rows, dtype=torch.int64, device=device)
    ap_q = torch.zeros(n_rows, dtype=torch.float64, device=device)
    inp = torch.zeros(n_rows, dtype=torch.float64, device=device)
    if ranks.numel() == 0:
        return first, ap_q, inp
    # 0-based position of each match among its query's matches.
    position = torch.arange(ranks.numel(), device=device) - ptr[:-1][owner]
    terms = ap_terms((position + 1).to(torch.float64), ranks.to(torch.float64))
    # One row per query, its terms left-aligned: a plain row sum is deterministic
    # on every device (index_add_/bincount with weights are not on CUDA).
    padded = torch.zeros((n_rows, int(n_good.max())), dtype=torch.float64, device=device)
    padded.index_put_((owner, position), terms)
    has = n_good_t > 0
    counts = n_good_t.clamp(min=1)
    ap_q = torch.where(has, padded.sum(dim=1) / counts, ap_q)
    first = torch.where(has, ranks[ptr[:-1].clamp(max=ranks.numel() - 1)], first)
    last = ranks[(ptr[1:] - 1).clamp(min=0)]
    # Ye et al. 2021: matches / rank of the hardest match.
    inp = torch.where(has, n_good_t.to(torch.float64) / last.to(torch.float64), inp)
    return first, ap_q, inp


def torch_per_query_metrics(
    qf: torch.Tensor, gf: torch.Tensor, index: MatchIndex, rows: int, ap_terms: APTerms
) -> dict[str, np.ndarray]:
    """Per-query results of the exact evaluation, computed on ``qf``'s device.

    ``qf``/``gf``: float32 feature tensors on one device (inner product
    scores); ``index``: the protocol's CSR match index
    (:func:`build_match_index`); ``rows``: queries per block; ``ap_terms``:
    the AP form's per-match terms. Returns numpy arrays laid out as the numpy
    path of :mod:`fedreid.eval.metrics` returns them:
    ``first_match_rank`` (0 = no match), ``ap``, ``inp``, ``num_matches``,
    ``valid``.
    """
    load_torch()
    device = qf.device
    n_q, n_g = qf.shape[0], gf.shape[0]
    n_good_all = np.diff(index.good_ptr)
    n_removed_all = np.diff(index.removed_ptr)

    def to_device(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(x, dtype=np.int64), device=device)

    # The index crosses to the device once; blocks slice it with host-known bounds (no sync).
    good_ptr = to_device(index.good_ptr)
    good_cols = to_device(index.good_cols)
    good_owner = to_device(np.repeat(np.arange(n_q), n_good_all))
    removed_cols = to_device(index.removed_cols)
    removed_owner = to_device(np.repeat(np.arange(n_q), n_removed_all))
    junk_cols = to_device(index.junk_cols)

    first = torch.zeros(n_q, dtype=torch.int64, device=device)
    ap_q = torch.zeros(n_q, dtype=torch.float64, device=device)
    inp = torch.zeros(n_q, dtype=torch.float64, device=device)
    rows = min(rows, n_q)
    buffer = torch.empty((rows, n_g), dtype=torch.float32, device=device)
    gt = gf.t()
    with torch.no_grad():
        for start in range(0, n_q, rows):
            stop = min(n_q, start + rows)
            scores = buffer[: stop - start]
            with full_fp32_matmul():
                torch.mm(qf[start:stop], gt, out=scores)
            g0, g1 = int(index.good_ptr[start]), int(index.good_ptr[stop])
            r0, r1 = int(index.removed_ptr[start]), int(index.removed_ptr[stop])
            owner = good_owner[g0:g1] - start
            ranks = _torch_block_match_ranks(
                scores,
                owner,
                good_cols[g0:g1],
                removed_owner[r0:r1] - start,
                removed_cols[r0:r1],
                junk_cols,
            )
            first[start:stop], ap_q[start:stop], inp[start:stop] = _torch_block_per_query(
                ranks, owner, good_ptr[start : stop + 1] - g0, n_good_all[start:stop], ap_terms
            )
    return {
        "first_match_rank": first.cpu().numpy(),
        "ap": ap_q.cpu().numpy(),
        "inp": inp.cpu().numpy(),
        "num_matches": n_good_all,
        "valid": n_good_all > 0,
    }


def as_device_features(qf: Any, gf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked features (numpy or tensors) as float32 tensors on one device (CPU for numpy)."""
    load_torch()
    qf, gf = (x if isinstance(x, torch.Tensor) else torch.from_numpy(x) for x in (qf, gf))
    return qf, gf
