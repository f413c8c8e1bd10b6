"""Exact re-ID ranking, CMC inputs and AP in torch, on whatever device the features live.

The device path of :func:`fedreid.eval.metrics.evaluate` (``backend="torch"``,
the default for CUDA features). It follows the rules of
:mod:`fedreid.eval.metrics` exactly: per query, junk (pid -1) and
same-pid-same-camera gallery items are removed, the kept items are ranked by
descending inner product with equal scores ordered by ascending gallery index
(the stable sort of :func:`~fedreid.eval.metrics.ranking_order`), and every
true match's rank is its 1-based position among the kept items.

Per query block, on the device: the score block (one matmul), removed items
set to ``-inf`` (finite scores are checked beforehand, so every kept item
ranks before every removed one), one stable descending sort of each row, the
sorted positions of the true matches, and from them the first-match rank, AP
and INP of each query. The AP terms come from the caller
(:func:`~fedreid.eval.metrics._ap_terms`, either form), so the formula lives
once. Only the per-query numbers are copied to the host, once, at the end;
no score row ever leaves the device.

Everything here is plain torch, so the same code runs on CPU tensors, which
is how the tests compare it with the numpy path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

if TYPE_CHECKING:  # the caller, fedreid.eval.metrics, imports this module
    from fedreid.eval.metrics import _MatchIndex

#: ``terms(i, r)``: per-match AP terms from 1-based match positions and ranks
#: (float64), :func:`fedreid.eval.metrics._ap_terms` for one AP form.
APTerms = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "BYTES_PER_SCORE",
    "CUDA_FREE_SHARE",
    "MAX_BLOCK_ELEMENTS",
    "APTerms",
    "as_device_features",
    "device_budget",
    "per_query_metrics",
    "rows_within",
]

#: Device memory one query x gallery score costs while a block is ranked: the
#: float32 scores, the sort's float32 values and int64 indices, the sort's own
#: double buffers (keys and int64 values), two bool masks, and slack for the
#: allocator's rounding.
BYTES_PER_SCORE = 48
#: Share of the free CUDA memory (plus the allocator's unused cache) one block may use;
#: the rest stays for whatever else lives on the card (a model, its optimiser).
CUDA_FREE_SHARE = 0.5
#: Elements of one score block at most: sort and nonzero index with 32-bit
#: offsets in some torch kernels, so a block stays below 2**31 scores.
MAX_BLOCK_ELEMENTS = 2**31 - 1


def rows_within(n_gallery: int, budget_bytes: int) -> int:
    """Query rows whose working set (:data:`BYTES_PER_SCORE` per score) fits ``budget_bytes``.

    0 when not even one row fits; never more than :data:`MAX_BLOCK_ELEMENTS`
    scores per block.
    """
    rows = int(budget_bytes) // (BYTES_PER_SCORE * max(1, n_gallery))
    return min(rows, MAX_BLOCK_ELEMENTS // max(1, n_gallery))


def device_budget(device: torch.device) -> int | None:
    """Bytes one block may use on ``device``: :data:`CUDA_FREE_SHARE` of the free memory on CUDA.

    Free memory is ``torch.cuda.mem_get_info`` plus what the caching
    allocator holds unused (it serves the block from there first). None for
    other devices, whose budget the caller fixes.
    """
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(CUDA_FREE_SHARE * (free + cached))


def _block_match_ranks(
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


def _block_per_query(
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


def per_query_metrics(
    qf: torch.Tensor, gf: torch.Tensor, index: _MatchIndex, rows: int, ap_terms: APTerms
) -> dict[str, np.ndarray]:
    """Per-query results of the exact evaluation, computed on ``qf``'s device.

    ``qf``/``gf``: float32 feature tensors on one device (inner product
    scores); ``index``: the protocol's CSR match index
    (:func:`~fedreid.eval.metrics._build_match_index`); ``rows``: queries per
    block; ``ap_terms``: the AP form's per-match terms. Returns numpy arrays laid out as
    :func:`fedreid.eval.metrics._per_query_metrics` returns them:
    ``first_match_rank`` (0 = no match), ``ap``, ``inp``, ``num_matches``,
    ``valid``.
    """
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
            torch.mm(qf[start:stop], gt, out=scores)
            g0, g1 = int(index.good_ptr[start]), int(index.good_ptr[stop])
            r0, r1 = int(index.removed_ptr[start]), int(index.removed_ptr[stop])
            owner = good_owner[g0:g1] - start
            ranks = _block_match_ranks(
                scores,
                owner,
                good_cols[g0:g1],
                removed_owner[r0:r1] - start,
                removed_cols[r0:r1],
                junk_cols,
            )
            first[start:stop], ap_q[start:stop], inp[start:stop] = _block_per_query(
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
    qf, gf = (x if isinstance(x, torch.Tensor) else torch.from_numpy(x) for x in (qf, gf))
    return qf, gf
