"""Evaluation protocols over one dataset's features: CMC/mAP, re-ranked or CUHK03 single-gallery-shot.

Metrics come from :func:`fedreid.eval.metrics.evaluate` / ``evaluate_scores``
(after :func:`fedreid.eval.rerank.k_reciprocal_rerank` when asked) or
:func:`~fedreid.eval.metrics.evaluate_cuhk03_single_shot` (the protocol of
torchreid's ``eval_cuhk03``).

Memory: metrics come from the block-wise :func:`~fedreid.eval.metrics.evaluate`
(no query x gallery matrix); the ranked-list pictures need the scores of the
few drawn queries only (:func:`fedreid.eval.query_picking.query_scores`). The
one exception is re-ranking, whose algorithm needs the full matrices (guarded
by :func:`fedreid.eval.rerank.estimate_rerank_bytes`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from fedreid.eval.metrics import DEFAULT_BLOCK_BYTES, EvalDataError
from fedreid.inference.dataset_features import DatasetFeatures, _check_dataset_features
from fedreid.inference.errors import EvalInputError

__all__ = ["CMC_RANKS", "PROTOCOLS", "CUHK03_REPEATS", "evaluate_dataset", "summary_row"]

#: Ranks evaluated (rank 1..CMC_RANKS for the CMC plot; the table shows 1/5/10).
CMC_RANKS = 20
#: ``standard``: single-query CMC/mAP over the whole filtered gallery;
#: ``cuhk03``: the old CUHK03 single-gallery-shot CMC (standard mAP).
PROTOCOLS = ("standard", "cuhk03")
#: Samplings averaged by the CUHK03 protocol (as torchreid's ``eval_cuhk03``).
CUHK03_REPEATS = 10


def _check_protocol(protocol: str, ap: str, rerank: bool) -> None:
    if protocol not in PROTOCOLS:
        raise EvalInputError(f"unknown protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "cuhk03" and rerank:
        raise EvalInputError("--rerank is not available with --protocol cuhk03 (it samples the raw feature scores)")
    if protocol == "cuhk03" and ap != "standard":
        raise EvalInputError(f"--protocol cuhk03 reports the standard AP (as torchreid's eval_cuhk03), not --ap {ap}")


def evaluate_dataset(
    feats: DatasetFeatures,
    *,
    ap: str = "standard",
    rerank: bool = False,
    protocol: str = "standard",
    seed: int = 0,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[dict[str, Any], Optional[np.ndarray]]:
    """``(result, reranked)``: the metrics dict (rank1..rank20, mAP, counts, per_query) and re-ranked scores.

    ``reranked`` is the query x gallery similarity (minus the re-ranked
    distance) when ``rerank``: the re-ranker builds it anyway, and the
    pictures must show that ranking. Otherwise it is None: the metrics run
    block-wise in :func:`~fedreid.eval.metrics.evaluate` (peak memory set by
    ``max_block_bytes``, not by Q x G), and :func:`~fedreid.eval.query_picking.query_scores` later
    computes the rows of the few queries drawn.

    ``protocol="cuhk03"``: the single-gallery-shot CMC
    (:func:`~fedreid.eval.metrics.evaluate_cuhk03_single_shot`,
    :data:`CUHK03_REPEATS` samplings from ``numpy.random.default_rng(seed)``,
    a fresh generator per dataset so the figures do not depend on which other
    datasets are evaluated); standard AP only, no re-ranking.

    Bad features or ids raise :class:`~fedreid.eval.metrics.EvalDataError`
    naming the dataset and :attr:`DatasetFeatures.source`; degenerate
    features (:func:`~fedreid.inference.features.check_features`) are among them.
    """
    from fedreid.eval.metrics import evaluate, evaluate_cuhk03_single_shot, evaluate_scores

    _check_protocol(protocol, ap, rerank)
    q, g = feats.query, feats.gallery
    ranks = tuple(range(1, CMC_RANKS + 1))
    ids = (q.pids, g.pids, q.camids, g.camids)
    common = {"ranks": ranks, "return_per_query": True, "max_block_bytes": max_block_bytes}
    reranked = None
    try:
        _check_dataset_features(feats)
        if rerank:
            from fedreid.eval.rerank import k_reciprocal_rerank

            reranked = k_reciprocal_rerank(q.features, g.features)
            np.negative(reranked, out=reranked)  # distance -> similarity, in place (no second Q x G array)
            result = evaluate_scores(reranked, *ids, ap=ap, **common)
        elif protocol == "cuhk03":
            rng = np.random.default_rng(seed)
            result = evaluate_cuhk03_single_shot(
                q.features, g.features, *ids, rng=rng, num_repeats=CUHK03_REPEATS, **common
            )
        else:
            result = evaluate(q.features, g.features, *ids, ap=ap, **common)
    except EvalDataError as exc:
        where = feats.source or "features given in memory"
        raise type(exc)(f"dataset {feats.name!r} ({where}): {exc}") from None
    result["num_gallery"] = int(g.features.shape[0])
    result["protocol"] = protocol
    return result, reranked


def summary_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of an :func:`evaluate_dataset` result."""
    row: dict[str, Any] = {k: float(result[k]) for k in ("rank1", "rank5", "rank10", "mAP")}
    row["cmc"] = [float(result[f"rank{k}"]) for k in result["ranks"]]
    for key in ("num_queries", "num_valid_queries", "num_queries_without_match", "num_gallery"):
        row[key] = int(result[key])
    return row
