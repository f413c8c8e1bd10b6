"""Ranked-list pictures show the ranking the metrics computed, bit for bit."""

from __future__ import annotations

import numpy as np

from fedreid.eval.protocols import evaluate_dataset
from fedreid.eval.query_picking import query_scores, ranked_lists
from fedreid.eval.ranking import prepare_features, score_rows
from fedreid.inference.dataset_features import DatasetFeatures
from fedreid.inference.features import FeatureSet


def _near_twins(n_query: int = 200, n_gallery: int = 2000, dim: int = 256) -> DatasetFeatures:
    """Gallery pairs with nearly equal features under different identities: near-ties everywhere."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((n_gallery // 2, dim)).astype(np.float32)
    gallery = np.concatenate([base, base + 1e-7 * rng.standard_normal(base.shape).astype(np.float32)])
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    g_pids = np.concatenate([np.arange(n_gallery // 2), np.arange(n_gallery // 2) + n_gallery])
    picked = rng.integers(0, n_gallery // 2, n_query)
    query = base[picked] + 0.5 * rng.standard_normal((n_query, dim)).astype(np.float32)
    query /= np.linalg.norm(query, axis=1, keepdims=True)
    paths = [f"{i}.jpg" for i in range(max(n_query, n_gallery))]
    return DatasetFeatures(
        "twins",
        FeatureSet(query, picked, np.zeros(n_query, dtype=np.int64), paths[:n_query]),
        FeatureSet(gallery, g_pids, np.ones(n_gallery, dtype=np.int64), paths[:n_gallery]),
        source="test",
    )


def test_pictures_show_the_rows_the_metrics_ranked():
    feats = _near_twins()
    block_rows = 48  # several blocks, the last one partial
    result, _ = evaluate_dataset(feats, max_block_bytes=block_rows * feats.gallery.features.shape[0] * 4)
    assert result["block_size"] == block_rows
    everyone = range(feats.query.features.shape[0])

    qf, gf = prepare_features(feats.query.features, feats.gallery.features)
    ranked = np.concatenate([block.copy() for _, block in score_rows(qf, gf, block_rows)])
    assert np.array_equal(query_scores(feats, list(everyone)[::-1], block_size=block_rows), ranked[::-1])

    first_match = result["per_query"]["first_match_rank"]
    for listed in ranked_lists(feats, result, pictures=0, queries=everyone):
        shown = int(np.argmax(listed.correct)) + 1 if listed.correct.any() else None
        expected = int(first_match[listed.query]) if first_match[listed.query] <= 10 else None
        assert shown == expected, f"query {listed.query}: the picture's first match is at {shown}, the metrics' at {expected}"
