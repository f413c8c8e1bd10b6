"""The evaluation extras against their references: re-ranking against the authors' code
(zhunzhong07/person-re-ranking), its memory check, the ranked lists' filter, the picked
queries, the report's round selection and its plots leaving the process's backend alone."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedreid.eval.metrics import evaluate
from fedreid.eval.query_picking import picked_queries
from fedreid.eval.report import format_table, paper_summary
from fedreid.eval.rerank import RerankMemoryError, estimate_rerank_bytes, k_reciprocal_rerank
from fedreid.eval.visualize import filtered_top_k


def _authors_rerank(probFea, galFea, k1, k2, lambda_value):  # noqa: N803 - the reference's names
    """zhunzhong07/person-re-ranking python-version re_ranking (feature input), statement by statement.

    Float64 instead of float16 and a stable argsort (random inputs have no
    ties), otherwise the reference: squared Euclidean distances, each column
    divided by its maximum then transposed, loops over items.
    """
    query_num = probFea.shape[0]
    feat = np.append(probFea, galFea, axis=0).astype(np.float64)
    original_dist = ((feat[:, None, :] - feat[None, :, :]) ** 2).sum(-1)
    all_num = gallery_num = original_dist.shape[0]
    original_dist = np.transpose(original_dist / np.max(original_dist, axis=0))
    V = np.zeros_like(original_dist)  # noqa: N806
    initial_rank = np.argsort(original_dist, kind="stable")
    for i in range(all_num):
        forward_k_neigh_index = initial_rank[i, : k1 + 1]
        backward_k_neigh_index = initial_rank[forward_k_neigh_index, : k1 + 1]
        fi = np.where(backward_k_neigh_index == i)[0]
        k_reciprocal_index = forward_k_neigh_index[fi]
        k_reciprocal_expansion_index = k_reciprocal_index
        for candidate in k_reciprocal_index:
            half = int(np.around(k1 / 2)) + 1
            candidate_forward = initial_rank[candidate, :half]
            candidate_backward = initial_rank[candidate_forward, :half]
            candidate_k_reciprocal_index = candidate_forward[np.where(candidate_backward == candidate)[0]]
            if len(np.intersect1d(candidate_k_reciprocal_index, k_reciprocal_index)) > 2 / 3 * len(
                candidate_k_reciprocal_index
            ):
                k_reciprocal_expansion_index = np.append(k_reciprocal_expansion_index, candidate_k_reciprocal_index)
        k_reciprocal_expansion_index = np.unique(k_reciprocal_expansion_index)
        weight = np.exp(-original_dist[i, k_reciprocal_expansion_index])
        V[i, k_reciprocal_expansion_index] = weight / np.sum(weight)
    original_dist = original_dist[:query_num]
    if k2 != 1:
        V = np.stack([np.mean(V[initial_rank[i, :k2], :], axis=0) for i in range(all_num)])  # noqa: N806
    inv_index = [np.where(V[:, i] != 0)[0] for i in range(gallery_num)]
    jaccard_dist = np.zeros_like(original_dist)
    for i in range(query_num):
        temp_min = np.zeros(gallery_num)
        for ind in np.where(V[i, :] != 0)[0]:
            temp_min[inv_index[ind]] += np.minimum(V[i, ind], V[inv_index[ind], ind])
        jaccard_dist[i] = 1 - temp_min / (2 - temp_min)
    final_dist = jaccard_dist * (1 - lambda_value) + original_dist * lambda_value
    return final_dist[:query_num, query_num:]


@pytest.mark.parametrize("seed", range(12))
def test_rerank_equals_the_authors_code(seed):
    rng = np.random.default_rng(seed)
    n_query, n_gallery, dim = int(rng.integers(1, 10)), int(rng.integers(2, 45)), int(rng.integers(2, 12))
    k1, k2, lam = int(rng.integers(1, 24)), int(rng.integers(1, 8)), float(rng.uniform())
    x = (rng.standard_normal((n_query + n_gallery, dim)) * rng.uniform(0.2, 4.0)).astype(np.float32)
    if seed % 2:  # unit features as the pipeline gives, and raw ones
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    ours = k_reciprocal_rerank(x[:n_query], x[n_query:], k1=k1, k2=k2, lambda_value=lam)
    reference = _authors_rerank(x[:n_query], x[n_query:], k1, k2, lam)
    assert ours.shape == (n_query, n_gallery)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-5)
    assert (np.argsort(ours, 1, kind="stable") == np.argsort(reference, 1, kind="stable")).all()


def test_rerank_defaults_are_the_papers():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    np.testing.assert_allclose(k_reciprocal_rerank(x[:8], x[8:]), _authors_rerank(x[:8], x[8:], 20, 6, 0.3),
                               rtol=0, atol=2e-5)


@pytest.mark.parametrize("clustered", [False, True], ids=["random", "identities"])
def test_rerank_memory_estimate_bounds_the_measured_peak(clustered):
    """The estimate the memory check compares with max_bytes covers what re-ranking allocates."""
    rng = np.random.default_rng(0)
    n_query, n = 300, 3000
    if clustered:  # 20 images per identity, as a ReID gallery
        x = np.repeat(rng.standard_normal((n // 20, 32)), 20, 0) + rng.standard_normal((n, 32))
    else:
        x = rng.standard_normal((n, 32))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    qf, gf = x[:n_query].copy(), x[n_query:].copy()
    tracemalloc.start()
    try:
        k_reciprocal_rerank(qf, gf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= estimate_rerank_bytes(n_query, n - n_query)


def test_rerank_memory_error_comes_before_any_large_allocation():
    x = np.random.default_rng(1).standard_normal((2000, 16)).astype(np.float32)
    needed = estimate_rerank_bytes(200, 1800)
    tracemalloc.start()
    try:
        with pytest.raises(RerankMemoryError, match=r"200 queries \+ 1800 gallery items \(N = 2000\)") as info:
            k_reciprocal_rerank(x[:200], x[200:], max_bytes=needed - 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(info.value, MemoryError) and "max_bytes" in str(info.value)
    assert peak < 4 * 2000 * 2000 / 4  # not even a quarter of the N x N matrix
    k_reciprocal_rerank(x[:200], x[200:], max_bytes=needed)  # at the estimate itself: runs


def test_pictures_filter_gives_the_metrics_first_match_and_marks():
    """Every query's ranked list (junk, same-id-same-camera dropped) puts its first green tile where CMC does."""
    rng = np.random.default_rng(3)
    n_q, n_g = 40, 120
    qf = rng.standard_normal((n_q, 8)).astype(np.float32)
    gf = rng.standard_normal((n_g, 8)).astype(np.float32)
    q_pids, q_cams = rng.integers(1, 8, n_q), rng.integers(0, 3, n_q)
    g_pids, g_cams = rng.integers(-1, 8, n_g), rng.integers(0, 3, n_g)  # -1 junk, 0 distractor
    r = evaluate(qf, gf, q_pids, g_pids, q_cams, g_cams, ranks=tuple(range(1, n_g + 1)), return_per_query=True)
    scores = qf @ gf.T
    for i in range(n_q):
        top, correct = filtered_top_k(scores[i], q_pids[i], q_cams[i], g_pids, g_cams, k=n_g)
        assert (g_pids[top] != -1).all() and not ((g_pids[top] == q_pids[i]) & (g_cams[top] == q_cams[i])).any()
        assert (correct == (g_pids[top] == q_pids[i])).all()
        first = int(np.argmax(correct)) + 1 if correct.any() else 0
        assert first == r["per_query"]["first_match_rank"][i]


def test_picked_queries_best_and_worst_by_ap_with_the_index_rule():
    per_query = {"ap": np.array([0.5, 1.0, 0.0, 0.2, 1.0, 0.2, 0.9]),
                 "valid": np.array([True, True, False, True, True, True, True])}
    assert picked_queries({"per_query": per_query}, 5) == [(1, "best"), (4, "best"), (6, "best"),
                                                           (3, "worst"), (5, "worst")]
    assert picked_queries({"per_query": per_query}, 1) == [(1, "best")]
    assert picked_queries({"per_query": per_query}, 0) == []


def test_paper_summary_means_the_three_best_rounds_by_big_four_rank1():
    def rec(rnd, m, d, extra):
        return {"round": rnd, "mode": "federated",
                "eval": {"market1501": {"rank1": m, "mAP": m / 2}, "dukemtmc": {"rank1": d, "mAP": d / 2},
                         "viper": {"rank1": extra, "mAP": extra / 2}}}
    # Big-four means: 0.3, 0.6, 0.5, 0.6, 0.2 -> rounds 2, 4 (tie with 2: both in) and 3; viper never selects.
    history = [rec(1, 0.2, 0.4, 0.9), rec(2, 0.6, 0.6, 0.1), rec(3, 0.5, 0.5, 0.1), rec(4, 0.7, 0.5, 0.1),
               rec(5, 0.1, 0.3, 1.0)]
    s = paper_summary(history)
    assert s["rounds"] == [2, 3, 4] and s["selected_by"] == ["dukemtmc", "market1501"]
    assert s["datasets"]["market1501"]["rank1"] == pytest.approx((0.6 + 0.5 + 0.7) / 3)
    assert s["datasets"]["viper"]["mAP"] == pytest.approx(0.15 / 3)
    table = format_table(s["datasets"])
    assert table.splitlines()[0] == "| dataset | Rank-1 | mAP |"
    assert "| market1501 | 60.0 | 30.0 |" in table


def test_report_curves_leave_the_process_matplotlib_backend_alone(tmp_path):
    import matplotlib

    from fedreid.eval.report import plot_curves

    history = [{"round": r, "mode": "federated", "train_loss": 1.0 / r, "comm": {"cumulative_bytes": r * 2**20},
                "client_metrics": {"a": {"train_loss": 1.0 / r}}, "weights": {"a": 1.0}, "time": {"round": 1.0},
                "eval": {"market1501": {"rank1": 0.1 * r, "mAP": 0.05 * r}}} for r in (1, 2, 3)]
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's choice (non-interactive, so it works headless)
    try:
        written = plot_curves(history, tmp_path)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert sorted(p.name for p in written) == ["curve_mAP.png", "curve_rank1.png", "curve_run.png",
                                               "curve_training.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)  # nothing temporary left
