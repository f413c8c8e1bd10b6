"""k-reciprocal re-ranking against a dense, loop-by-loop statement of Zhong et al. (CVPR 2017)."""

import numpy as np
import pytest

from fedreid.eval.rerank import k_reciprocal_rerank


def _dense_rerank(qf: np.ndarray, gf: np.ndarray, k1: int, k2: int, lam: float) -> np.ndarray:
    """Eqs. 3, 9-13 written out over dense matrices, in float64 (the oracle)."""
    x = np.concatenate([qf, gf]).astype(np.float64)
    n, n_q = x.shape[0], qf.shape[0]
    dist = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    dist /= dist.max(axis=1, keepdims=True)
    order = np.argsort(dist, axis=1, kind="stable")

    def reciprocal(p: int, k: int) -> set:
        return {int(q) for q in order[p, : k + 1] if p in order[q, : k + 1]}

    half = int(np.around(k1 / 2))
    weights = np.zeros((n, n))
    for p in range(n):
        base = reciprocal(p, k1)
        expanded = set(base)
        for q in base:
            candidate = reciprocal(q, half)
            if len(candidate & base) > 2 / 3 * len(candidate):
                expanded |= candidate
        cols = sorted(expanded)
        w = np.exp(-dist[p, cols])
        weights[p, cols] = w / w.sum()
    if k2 > 1:
        weights = np.stack([weights[order[p, :k2]].mean(axis=0) for p in range(n)])
    result = np.empty((n_q, n - n_q))
    for i in range(n_q):
        for j in range(n_q, n):
            shared = np.minimum(weights[i], weights[j]).sum()
            result[i, j - n_q] = (1 - lam) * (1 - shared / (2 - shared)) + lam * dist[i, j]
    return result


@pytest.mark.parametrize(
    "n_query, n_gallery, k1, k2",
    [(6, 30, 20, 6), (5, 25, 7, 3), (4, 20, 5, 1), (2, 3, 20, 6), (1, 2, 4, 6)],
    ids=["paper-defaults", "odd-k1", "no-expansion", "fewer-items-than-k2", "three-items"],
)
def test_rerank_equals_the_dense_statement(n_query, n_gallery, k1, k2):
    rng = np.random.default_rng(n_query * 100 + n_gallery)
    x = rng.standard_normal((n_query + n_gallery, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ours = k_reciprocal_rerank(x[:n_query], x[n_query:], k1=k1, k2=k2, lambda_value=0.3)
    oracle = _dense_rerank(x[:n_query], x[n_query:], k1, k2, 0.3)
    assert ours.shape == (n_query, n_gallery) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, oracle, rtol=0, atol=1e-5)
    assert (np.argsort(ours, axis=1, kind="stable") == np.argsort(oracle, axis=1, kind="stable")).all()
