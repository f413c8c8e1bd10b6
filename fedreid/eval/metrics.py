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
first (:func:`~fedreid.eval.ranking.ranking_order`). Every path here, the
top-k search in :mod:`fedreid.retrieval.exact` and the pictures in
:mod:`fedreid.eval.visualize` follow that rule. It decides scores that come
out equal: the float32 matmul rounds in an order that depends on the block's
shape and a column's place in it, so identical gallery features may score an
ulp or two apart, and another ``block_size`` may order items that close
differently (the same inputs and options on the same machine always get the
same blocks, scores and results).

The ranking itself is :mod:`fedreid.eval.ranking`'s kernel: the rules above
(:func:`gallery_masks`, :func:`ranking_order`, re-exported here), query
blocks of at most ``max_block_bytes`` (the full query x gallery score matrix
is never materialised), the ranks of the true matches counted without
sorting whole rows, and, on a GPU (``evaluate(..., backend="torch")``, the
default for CUDA features), the same rules in torch with only per-query
results copied back. This module checks the ids and options, turns ranks
into CMC / AP / INP, and adds CUHK03's single-gallery-shot protocol and
classification accuracy. bench/eval_speed.py and bench/gpu_eval.py measure
the CPU and GPU paths.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from fedreid.eval import ranking
from fedreid.eval.ranking import (
    DEFAULT_BLOCK_BYTES,
    JUNK_PID,
    EvalDataError,
    as_features,
    block_rows,
    build_match_index,
    check_sets,
    default_workers,
    gallery_masks,
    given_score_blocks,
    is_torch,
    junk_mask,
    load_torch,
    match_ranks,
    prepare_features,
    ranking_order,
    score_blocks,
    score_rows,
    torch_block_rows,
)

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

#: ``"standard"``: torchreid/fast-reid AP; ``"official"``: Market-1501 MATLAB/layumi AP.
AP_MODES = ("standard", "official")
#: :func:`evaluate` backends: ``"auto"`` is torch for CUDA features, numpy otherwise.
BACKENDS = ("auto", "numpy", "torch")


# --------------------------------------------------------------------------
# Input checks (the features' own checks are ranking.as_features / prepare_features)
# --------------------------------------------------------------------------


def _as_ids(name: str, x: Any) -> np.ndarray:
    if is_torch(x):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim != 1:
        raise EvalDataError(f"{name} must be 1-D, got shape {x.shape}")
    if x.size and x.dtype.kind not in "iu":  # booleans are flags, not ids
        raise EvalDataError(f"{name} must hold integers, got dtype {x.dtype}")
    if x.size and x.dtype.kind == "u" and int(x.max()) > np.iinfo(np.int64).max:
        # the cast would wrap 2**64 - 1 to -1, the junk label
        raise EvalDataError(f"{name} holds {int(x.max())}, above the largest id ({np.iinfo(np.int64).max})")
    return x.astype(np.int64, copy=False)


def _check_lengths(pairs: Sequence[tuple[str, int]]) -> None:
    """All named lengths must agree; the message names every array and length."""
    if len({n for _, n in pairs}) > 1:
        listing = ", ".join(f"{name}: {n}" for name, n in pairs)
        raise EvalDataError(f"mismatched lengths ({listing})")


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
        return default_workers()
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
    if backend == "torch" and load_torch() is None:  # pragma: no cover - the project depends on torch
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
    (:mod:`fedreid.eval.ranking`; numpy inputs run on the CPU), and
    only per-query numbers come back; ``"auto"`` (default) is ``"torch"`` for
    CUDA features and ``"numpy"`` otherwise. Both follow the same rules,
    ties included; their results agree to float64 rounding of the AP sums.

    ``block_size`` (queries per block) or ``max_block_bytes`` bounds memory:
    with ``"numpy"`` the bytes of one float32 score block (default
    :data:`DEFAULT_BLOCK_BYTES`), with ``"torch"`` the working set of one
    block (:data:`~fedreid.eval.ranking.BYTES_PER_SCORE` per score;
    default: a share of the card's memory on CUDA (:func:`~fedreid.eval.ranking.device_budget`), :data:`DEFAULT_BLOCK_BYTES`
    elsewhere). ``num_threads`` threads (default: the usable CPUs, at most 8)
    share the numpy backend's per-query counting (the torch backend uses
    torch's own threads and reports ``torch.get_num_threads()``). Results do
    not depend on the threads; the blocks fix the float32 matmul's rounding,
    so another block size can reorder scores within a few ulp of each other
    (the module docstring's "Ties").
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
    qf, gf = prepare_features(qf, gf)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(
        qf.shape[0], gf.shape[0], q_pids, g_pids, q_camids, g_camids
    )
    workers = _check_threads(num_threads)
    if backend == "auto":
        backend = "torch" if is_torch(qf) else "numpy"  # torch features here live on a GPU
    if backend == "torch":
        qf, gf = ranking.as_device_features(qf, gf)
        rows = min(qf.shape[0], torch_block_rows(qf.device, gf.shape[0], block_size, max_block_bytes))
        index = build_match_index(q_pids, g_pids, q_camids, g_camids)
        terms = functools.partial(_ap_terms, ap=ap)
        per_query = ranking.torch_per_query_metrics(qf, gf, index, rows, terms)
        workers = ranking.torch.get_num_threads()
    else:
        budget = DEFAULT_BLOCK_BYTES if max_block_bytes is None else max_block_bytes
        rows = min(qf.shape[0], block_rows(gf.shape[0], block_size, budget))
        index = build_match_index(q_pids, g_pids, q_camids, g_camids)
        ranks_of_matches = match_ranks(score_rows(qf, gf, rows), index, workers=workers)
        per_query = _per_query_metrics(ranks_of_matches, index.good_ptr, ap)
    result = _summarise(per_query, ap=ap, ranks=ranks_t, minp=minp)
    result.update(
        block_size=rows,
        num_threads=workers,
        device=str(qf.device) if is_torch(qf) else "cpu",
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
    float64 scores are ranked in float64 (float32 would tie scores closer than
    its precision); anything else in float32.
    """
    ap = _check_ap(ap)
    ranks_t = _check_ranks(ranks)
    scores = as_features("scores", scores, keep_float64=True)
    if is_torch(scores):
        scores = scores.cpu().numpy()
    check_sets(*scores.shape)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(*scores.shape, q_pids, g_pids, q_camids, g_camids)
    rows = min(scores.shape[0], block_rows(scores.shape[1], block_size, max_block_bytes, scores.dtype.itemsize))
    index = build_match_index(q_pids, g_pids, q_camids, g_camids)
    workers = _check_threads(num_threads)
    ranks_of_matches = match_ranks(given_score_blocks(scores, rows), index, workers=workers)
    per_query = _per_query_metrics(ranks_of_matches, index.good_ptr, ap)
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
    qf, gf = prepare_features(qf, gf)
    q_pids, g_pids, q_camids, g_camids = _prepare_ids(
        qf.shape[0], gf.shape[0], q_pids, g_pids, q_camids, g_camids
    )
    rows = min(qf.shape[0], block_rows(gf.shape[0], block_size, max_block_bytes))
    index = build_match_index(q_pids, g_pids, q_camids, g_camids)

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
    ranks_of_matches = match_ranks(score_rows(qf, gf, rows), index, sample_block, workers)
    per_query = _per_query_metrics(ranks_of_matches, index.good_ptr, "standard")
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
        block_size=rows,
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
        x.detach().cpu().numpy() if is_torch(x) else np.asarray(x) for x in (logits_or_preds, labels)
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
