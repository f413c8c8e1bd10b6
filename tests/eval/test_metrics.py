"""Retrieval metrics: hand-computed rules, a full-sort reference, and bad inputs.

Most hand examples use 1-D features: the query is ``[[1.0]]`` and each gallery
"feature" is the score it should get, since evaluate() ranks by inner product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedreid.eval.ranking as ranking
from fedreid.errors import FedReIDError
from fedreid.eval.metrics import (
    EvalDataError,
    accuracy,
    cmc_curve,
    evaluate,
    evaluate_cuhk03_single_shot,
    evaluate_scores,
    gallery_masks,
    ranking_order,
)

# --------------------------------------------------------------------------
# A plain reference: filter, stable full sort, cumulative matches (torchreid style)
# --------------------------------------------------------------------------


def reference_per_query(scores, q_pids, g_pids, q_camids, g_camids, ap="standard"):
    """Per query: (AP, first-match rank, INP), or None without a true match."""
    out = []
    for i in range(len(q_pids)):
        keep = (g_pids != -1) & ~((g_pids == q_pids[i]) & (g_camids == q_camids[i]))
        kept_scores = scores[i][keep]
        order = np.argsort(-kept_scores, kind="stable")
        raw_cmc = (g_pids[keep] == q_pids[i])[order].astype(np.int64)
        if not raw_cmc.any():
            out.append(None)
            continue
        hits = raw_cmc.cumsum()
        precision = hits / np.arange(1, raw_cmc.size + 1)
        match_ranks = np.flatnonzero(raw_cmc) + 1
        if ap == "standard":
            q_ap = (precision * raw_cmc).sum() / raw_cmc.sum()
        else:  # layumi compute_mAP, written as its loop
            q_ap, n_good = 0.0, raw_cmc.sum()
            for j, row in enumerate(match_ranks - 1):
                p = (j + 1) / (row + 1)
                old = j / row if row != 0 else 1.0
                q_ap += (1.0 / n_good) * (old + p) / 2
        out.append((q_ap, match_ranks[0], raw_cmc.sum() / match_ranks[-1]))
    return out


def reference_summary(per_query, ap, ranks=(1, 5, 10)):
    valid = [x for x in per_query if x is not None]
    denom = len(valid) if ap == "standard" else len(per_query)
    result = {f"rank{k}": sum(first <= k for _, first, _ in valid) / denom for k in ranks}
    result["mAP"] = sum(a for a, _, _ in valid) / denom
    result["mINP"] = sum(inp for _, _, inp in valid) / denom
    return result


def random_case(seed: int, *, exact_ties: bool = False, dim: int = 8):
    """Clustered features with junk, distractors and several cameras."""
    rng = np.random.default_rng(seed)
    n_ids, n_cams = int(rng.integers(2, 10)), 3
    centres = rng.standard_normal((n_ids + 1, dim))
    q_pids = np.repeat(np.arange(1, n_ids + 1), rng.integers(1, 4, n_ids))
    g_pids = np.concatenate(
        [
            np.repeat(np.arange(1, n_ids + 1), rng.integers(0, 6, n_ids)),
            np.full(int(rng.integers(0, 5)), -1),
            np.zeros(int(rng.integers(0, 5)), dtype=np.int64),
        ]
    )
    g_pids = g_pids[rng.permutation(g_pids.size)]
    noise = float(rng.uniform(0.3, 2.0))

    def feats(pids):
        x = centres[np.maximum(pids, 0)] + noise * rng.standard_normal((pids.size, dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        if exact_ties:  # quarter steps: every dot product is exact, so ties are real
            x = np.round(x * 4) / 4
        return x.astype(np.float32)

    return (
        feats(q_pids),
        feats(g_pids),
        q_pids,
        g_pids,
        rng.integers(0, n_cams, q_pids.size),
        rng.integers(0, n_cams, g_pids.size),
    )


def one_query(scores, g_pids, g_camids, q_pid=1, q_camid=0, **kwargs):
    """evaluate() of one query whose gallery scores are ``scores``."""
    gf = np.asarray(scores, dtype=np.float32)[:, None]
    return evaluate(np.ones((1, 1), np.float32), gf, [q_pid], g_pids, [q_camid], g_camids, **kwargs)


# --------------------------------------------------------------------------
# Hand-computed rules
# --------------------------------------------------------------------------


def test_hand_example_both_ap_forms_and_minp():
    # Ranking after removing the same-camera pid-1 item (score .5):
    # .9 (pid 2), .8 (match), .7 (pid 3), .6 (match): matches at ranks 2 and 4.
    scores = [0.9, 0.8, 0.7, 0.6, 0.5]
    g_pids = [2, 1, 3, 1, 1]
    g_cams = [1, 1, 1, 1, 0]
    r = one_query(scores, g_pids, g_cams, minp=True)
    assert r["mAP"] == pytest.approx((1 / 2 + 2 / 4) / 2)
    assert r["mINP"] == pytest.approx(2 / 4)
    assert (r["rank1"], r["rank5"], r["rank10"]) == (0.0, 1.0, 1.0)
    # official: (p_before + p_at) / 2 per match: (0 + 1/2)/2 and (1/3 + 2/4)/2, over 2 matches.
    official = one_query(scores, g_pids, g_cams, ap="official")
    assert official["mAP"] == pytest.approx(((0 + 1 / 2) / 2 + (1 / 3 + 1 / 2) / 2) / 2)


def test_official_ap_uses_precision_one_before_a_first_rank_match():
    # Matches at ranks 1 and 3: ((1 + 1)/2 + (1/2 + 2/3)/2) / 2.
    r = one_query([0.9, 0.8, 0.7], [1, 2, 1], [1, 1, 1], ap="official")
    assert r["mAP"] == pytest.approx(((1 + 1) / 2 + (1 / 2 + 2 / 3) / 2) / 2)
    assert one_query([0.9, 0.8, 0.7], [1, 2, 1], [1, 1, 1])["mAP"] == pytest.approx((1 + 2 / 3) / 2)


def test_junk_items_are_removed():
    r = one_query([0.9, 0.8], [-1, 1], [1, 1])
    assert r["rank1"] == 1.0 and r["mAP"] == 1.0


def test_same_identity_same_camera_items_are_removed_but_other_cameras_match():
    # The top item is the query's identity in the query's camera: removed.
    r = one_query([0.9, 0.8, 0.7], [1, 2, 1], [0, 1, 2])
    assert r["rank1"] == 0.0 and r["mAP"] == pytest.approx(1 / 2)
    # Same camera but another identity is an ordinary negative.
    r = one_query([0.9, 0.8], [2, 1], [0, 1])
    assert r["mAP"] == pytest.approx(1 / 2)


def test_distractors_stay_as_negatives():
    r = one_query([0.9, 0.8], [0, 1], [1, 1])
    assert r["rank1"] == 0.0 and r["mAP"] == pytest.approx(1 / 2)


def test_gallery_masks_is_the_rule():
    keep, good = gallery_masks(1, 0, np.array([1, 1, -1, 0, 2]), np.array([0, 1, 1, 0, 0]))
    assert keep.tolist() == [False, True, False, True, True]
    assert good.tolist() == [False, True, False, False, False]


def test_queries_without_match_are_skipped_and_counted():
    qf = np.ones((2, 1), np.float32)
    gf = np.array([[0.9], [0.8]], np.float32)
    # Query pid 1 matches the second item; query pid 5 has nothing in the gallery.
    args = (qf, gf, [1, 5], [2, 1], [0, 0], [1, 1])
    r = evaluate(*args)
    assert r["mAP"] == pytest.approx(1 / 2)
    assert (r["num_valid_queries"], r["num_skipped_queries"], r["num_queries_without_match"]) == (1, 1, 1)
    # official: every query is averaged, the unmatched one scoring 0.
    o = evaluate(*args, ap="official")
    assert o["mAP"] == pytest.approx(((0 + 1 / 2) / 2) / 2)
    assert (o["num_valid_queries"], o["num_skipped_queries"], o["num_queries_without_match"]) == (2, 0, 1)


def test_query_whose_matches_are_all_in_its_own_camera_is_skipped():
    # Query pid 1 (camera 0) has its only image in camera 0; query pid 2 matches first.
    gf = np.array([[0.9], [0.8]], np.float32)
    r = evaluate(np.ones((2, 1), np.float32), gf, [1, 2], [2, 1], [0, 0], [1, 0])
    assert r["num_skipped_queries"] == 1 and r["rank1"] == 1.0


def test_no_valid_query_at_all_is_an_error():
    with pytest.raises(ValueError, match="none of the 1 queries has a true match"):
        one_query([0.9], [2], [1])


def test_ties_lower_gallery_index_ranks_first():
    # Equal scores: the negative at index 0 ranks before the match at index 1...
    assert one_query([0.5, 0.5], [2, 1], [1, 1])["mAP"] == pytest.approx(1 / 2)
    # ...and the match at index 0 before the negative at index 1.
    assert one_query([0.5, 0.5], [1, 2], [1, 1])["mAP"] == 1.0
    # Three-way tie m, n, m (indices 0, 1, 2): ranks 1 and 3.
    r = one_query([0.5, 0.5, 0.5, 0.9], [1, 2, 1, 3], [1, 1, 1, 1])
    # The pid-3 item scores .9, so ranks are 2 and 4.
    assert r["mAP"] == pytest.approx((1 / 2 + 2 / 4) / 2)
    assert ranking_order(np.array([0.5, 0.9, 0.5, 0.9])).tolist() == [1, 3, 0, 2]


def test_negative_zero_ties_with_positive_zero():
    # -0.0 == 0.0: a tie, so the lower index (the negative) ranks first.
    assert one_query([0.0, -0.0], [2, 1], [1, 1])["mAP"] == pytest.approx(1 / 2)
    assert one_query([-0.0, 0.0], [1, 2], [1, 1])["mAP"] == 1.0


def test_gallery_shorter_than_max_rank_saturates():
    r = one_query([0.9, 0.8, 0.7], [2, 3, 1], [1, 1, 1], ranks=(1, 2, 5, 10, 50))
    assert [r[f"rank{k}"] for k in (1, 2, 5, 10, 50)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert cmc_curve(r).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert r["ranks"] == (1, 2, 5, 10, 50)


def test_result_reports_options_and_fractions():
    r = one_query([0.9, 0.8], [1, 2], [1, 1], ranks=(10, 1))
    assert set(r) >= {"rank1", "rank10", "mAP", "num_valid_queries", "num_skipped_queries", "ap", "ranks"}
    assert "rank5" not in r and "mINP" not in r
    assert r["ap"] == "standard" and r["ranks"] == (1, 10)
    assert all(0.0 <= r[k] <= 1.0 for k in ("rank1", "rank10", "mAP"))


# --------------------------------------------------------------------------
# Random cases against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("ap", ["standard", "official"])
@pytest.mark.parametrize("exact_ties", [False, True])
def test_random_cases_match_full_sort_reference(ap, exact_ties):
    checked = 0
    for seed in range(60):
        qf, gf, q_pids, g_pids, q_cams, g_cams = random_case(seed, exact_ties=exact_ties)
        per_query = reference_per_query(qf @ gf.T, q_pids, g_pids, q_cams, g_cams, ap=ap)
        if all(x is None for x in per_query):
            continue
        expected = reference_summary(per_query, ap)
        got = evaluate(qf, gf, q_pids, g_pids, q_cams, g_cams, ap=ap, minp=True, block_size=1 + seed % 4)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-9), (seed, key)
        assert got["num_queries_without_match"] == sum(x is None for x in per_query)
        checked += 1
    assert checked > 40


@pytest.mark.parametrize("ap", ["standard", "official"])
def test_per_query_results_match_full_sort_reference(ap):
    """The per-query AP / first-match rank / valid mask (what the pictures pick by) are exact."""
    for seed in range(30):
        case = random_case(seed, exact_ties=seed % 2 == 1)
        qf, gf, q_pids, g_pids, q_cams, g_cams = case
        reference = reference_per_query(qf @ gf.T, q_pids, g_pids, q_cams, g_cams, ap=ap)
        if all(x is None for x in reference):
            continue
        per_query = evaluate(*case, ap=ap, return_per_query=True, block_size=2)["per_query"]
        np.testing.assert_array_equal(per_query["valid"], [x is not None for x in reference])
        np.testing.assert_array_equal(per_query["valid"], per_query["num_matches"] > 0)
        for i, ref in enumerate(reference):
            if ref is None:
                assert per_query["ap"][i] == 0 and per_query["first_match_rank"][i] == 0
            else:
                assert per_query["ap"][i] == pytest.approx(ref[0], abs=1e-12), (seed, i)
                assert per_query["first_match_rank"][i] == ref[1]


@pytest.mark.parametrize("dense_fraction", [0.0, 2.0])
def test_gather_and_whole_row_sort_paths_agree(monkeypatch, dense_fraction):
    for seed in range(20):
        case = random_case(seed, exact_ties=seed % 2 == 0)
        expected = evaluate(*case, return_per_query=True)["per_query"]
        monkeypatch.setattr(ranking, "_DENSE_SORT_FRACTION", dense_fraction)
        got = evaluate(*case, return_per_query=True)["per_query"]
        monkeypatch.undo()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])


def test_uneven_blocks_and_threads_rank_the_same_scores_identically():
    case = random_case(3, dim=16)
    qf, gf, *ids = case
    scores = qf @ gf.T  # fixed scores: the ranking and counting are exact whatever the blocks and threads
    expected = evaluate_scores(scores, *ids, minp=True, return_per_query=True)
    options_list = (
        {"block_size": 1},
        {"block_size": 3},
        {"block_size": 7, "num_threads": 3},
        {"block_size": 10_000},
        {"max_block_bytes": 4 * gf.shape[0] * 2},
        {"num_threads": 1},
    )
    for options in options_list:
        got = evaluate_scores(scores, *ids, minp=True, return_per_query=True, **options)
        for key in ("rank1", "rank5", "rank10", "mAP", "mINP"):
            assert got[key] == expected[key], options
        for key, value in expected["per_query"].items():
            np.testing.assert_array_equal(got["per_query"][key], value)
    # From features the blocks also shape the float32 matmul, whose last bits may move near ties:
    # the same call gives the same numbers; other blocks agree to float32 rounding.
    assert evaluate(*case, minp=True) == evaluate(*case, minp=True)
    direct = evaluate(*case, minp=True)
    for options in options_list:
        got = evaluate(*case, minp=True, **options)
        for key in ("rank1", "rank5", "rank10", "mAP", "mINP"):
            assert got[key] == pytest.approx(direct[key], abs=1e-3), options


def test_torch_and_numpy_inputs_give_identical_results():
    qf, gf, q_pids, g_pids, q_cams, g_cams = random_case(5)
    a = evaluate(qf, gf, q_pids, g_pids, q_cams, g_cams, minp=True)
    b = evaluate(
        torch.from_numpy(qf),
        torch.from_numpy(gf).requires_grad_(),
        torch.from_numpy(q_pids),
        torch.from_numpy(g_pids),
        torch.from_numpy(q_cams),
        torch.from_numpy(g_cams),
        minp=True,
    )
    assert a == b


def test_evaluate_scores_matches_evaluate():
    qf, gf, *ids = random_case(7)
    a = evaluate(qf, gf, *ids, minp=True)
    b = evaluate_scores(qf @ gf.T, *ids, minp=True, block_size=2)
    for key in ("rank1", "rank5", "rank10", "mAP", "mINP"):
        assert b[key] == pytest.approx(a[key], abs=1e-12)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "torch"])
def test_evaluate_scores_ranks_float64_scores_in_float64(as_tensor):
    # Gallery 0 is a negative, gallery 1 the true match scoring 1e-9 higher:
    # equal in float32, where the tie rule would put the negative first.
    scores = np.array([[0.5, 0.5 + 1e-9]], dtype=np.float64)
    given = torch.from_numpy(scores) if as_tensor else scores
    result = evaluate_scores(given, [1], [2, 1], [0], [1, 1])
    assert (result["rank1"], result["mAP"]) == (1.0, 1.0)
    tied = evaluate_scores(scores.astype(np.float32), [1], [2, 1], [0], [1, 1])
    assert (tied["rank1"], tied["mAP"]) == (0.0, 0.5)
    # a float64 block costs 8 bytes a score: the budget holds half the rows
    ids = ([1] * 4, [2, 1], [0] * 4, [1, 1])
    assert evaluate_scores(np.repeat(scores, 4, axis=0), *ids, max_block_bytes=32)["block_size"] == 2
    assert evaluate_scores(np.repeat(scores, 4, axis=0).astype(np.float32), *ids, max_block_bytes=32)["block_size"] == 4


# --------------------------------------------------------------------------
# CUHK03 single-gallery-shot
# --------------------------------------------------------------------------


def reference_single_shot(scores, q_pids, g_pids, q_cams, g_cams, rng, repeats, ranks):
    """Per valid query and repeat: draw as documented, rank the sampled gallery by full sort."""
    usable = np.flatnonzero(g_pids != -1)
    by_pid = usable[np.argsort(g_pids[usable], kind="stable")]
    group_pids, starts, sizes = np.unique(g_pids[by_pid], return_index=True, return_counts=True)
    hits = []
    for i in range(len(q_pids)):
        keep, good = gallery_masks(q_pids[i], q_cams[i], g_pids, g_cams)
        goods = np.flatnonzero(good)
        if goods.size == 0:
            continue
        draws = rng.random((repeats, group_pids.size))
        q_hits = np.zeros(len(ranks))
        for rep in range(repeats):
            picked = []
            for g, (pid, start, size) in enumerate(zip(group_pids, starts, sizes)):
                members = goods if pid == q_pids[i] else by_pid[start : start + size]
                picked.append(members[min(int(draws[rep, g] * members.size), members.size - 1)])
            picked = np.sort(picked)  # gallery order, so the stable sort applies the index rule
            order = picked[ranking_order(scores[i][picked])]
            first = 1 + int(np.flatnonzero(g_pids[order] == q_pids[i])[0])
            q_hits += [first <= k for k in ranks]
        hits.append(q_hits / repeats)
    return np.mean(hits, axis=0)


def test_cuhk03_single_shot_by_hand():
    # Identity 1: matches scoring .9 and .1; identity 2: .5 and .4. A one-shot
    # gallery puts the match first exactly when the .9 image is drawn.
    gf = np.array([[0.9], [0.5], [0.4], [0.1]], np.float32)
    args = (np.ones((1, 1), np.float32), gf, [1], [1, 2, 2, 1], [0], [1, 1, 1, 1])
    r = evaluate_cuhk03_single_shot(*args, rng=np.random.default_rng(0), num_repeats=10, ranks=(1, 2))
    draws = np.random.default_rng(0).random((10, 2))
    assert r["rank1"] == pytest.approx(np.mean(draws[:, 0] < 0.5))
    assert r["rank2"] == 1.0
    assert r["mAP"] == pytest.approx((1 + 2 / 4) / 2)  # standard AP over the whole gallery
    assert r["num_repeats"] == 10 and r["protocol"] == "cuhk03-single-gallery-shot"
    many = evaluate_cuhk03_single_shot(*args, rng=np.random.default_rng(1), num_repeats=4000, ranks=(1,))
    assert many["rank1"] == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("exact_ties", [False, True])
def test_cuhk03_single_shot_matches_reference(exact_ties):
    for seed in range(15):
        case = random_case(seed, exact_ties=exact_ties)
        qf, gf, q_pids, g_pids, q_cams, g_cams = case
        if all(x is None for x in reference_per_query(qf @ gf.T, q_pids, g_pids, q_cams, g_cams)):
            continue
        got = evaluate_cuhk03_single_shot(
            *case, rng=np.random.default_rng(seed), num_repeats=5, ranks=(1, 3), block_size=2
        )
        expected = reference_single_shot(
            qf @ gf.T, q_pids, g_pids, q_cams, g_cams, np.random.default_rng(seed), 5, (1, 3)
        )
        assert [got["rank1"], got["rank3"]] == pytest.approx(list(expected), abs=1e-12), seed
        assert got["mAP"] == pytest.approx(evaluate(*case)["mAP"], abs=1e-12)


def test_cuhk03_is_deterministic_for_a_seed():
    case = random_case(11)
    a = evaluate_cuhk03_single_shot(*case, rng=np.random.default_rng(4))
    b = evaluate_cuhk03_single_shot(*case, rng=np.random.default_rng(4))
    assert a == b
    with_rows = evaluate_cuhk03_single_shot(*case, rng=np.random.default_rng(4), return_per_query=True)
    assert {k: v for k, v in with_rows.items() if k != "per_query"} == a
    for key, value in evaluate(*case, return_per_query=True)["per_query"].items():
        np.testing.assert_array_equal(with_rows["per_query"][key], value)
    with pytest.raises(ValueError, match="numpy.random.Generator"):
        evaluate_cuhk03_single_shot(*case, rng=4)


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------


def good_args():
    qf = np.eye(2, 4, dtype=np.float32)
    gf = np.eye(3, 4, dtype=np.float32)
    return [qf, gf, np.array([1, 2]), np.array([1, 2, 3]), np.array([0, 0]), np.array([1, 1, 1])]


@pytest.mark.parametrize(
    "position, value, message",
    [
        (0, np.zeros((0, 4), np.float32), "query set is empty"),
        (1, np.zeros((0, 4), np.float32), "gallery is empty"),
        (2, np.array([1, 2, 3]), r"mismatched lengths \(query features: 2, q_pids: 3, q_camids: 2\)"),
        (5, np.array([1, 1]), r"mismatched lengths \(gallery features: 3, g_pids: 3, g_camids: 2\)"),
        (1, np.eye(3, 5, dtype=np.float32), "feature dims differ: qf has 4 columns, gf has 5"),
        (0, np.array([[np.nan, 0, 0, 1], [0, 1, 0, 0]], np.float32), "qf contains NaN or inf"),
        (1, np.array([[np.inf, 0, 0, 0]] * 3, np.float32), "gf contains NaN or inf"),
        (0, np.zeros(4, np.float32), "qf must be 2-D"),
        (2, np.array([1.5, 2.0]), "q_pids must hold integers"),
        (2, np.array([True, False]), "q_pids must hold integers, got dtype bool"),
        (3, np.array([1, 2, 2**64 - 1], np.uint64), "g_pids holds 18446744073709551615, above the largest id"),
        # finite features whose inner products overflow float32 would rank inf/NaN scores
        (0, np.eye(2, 4, dtype=np.float32) * 1e38, "too large to score in float32"),
    ],
)
def test_bad_inputs_raise_clear_errors(position, value, message):
    args = good_args()
    args[position] = value
    # EvalDataError: a FedReIDError (the tools print one line) and a ValueError (callers' except clauses).
    with pytest.raises(EvalDataError, match=message) as exc:
        evaluate(*args)
    assert isinstance(exc.value, FedReIDError) and isinstance(exc.value, ValueError)


def test_nan_error_names_the_first_bad_row(monkeypatch):
    monkeypatch.setattr(ranking, "_FINITE_CHECK_ELEMENTS", 100)  # 50-row chunks: the row is found inside one
    qf = np.zeros((5000, 2), np.float32)
    qf[4321, 1] = np.nan
    with pytest.raises(EvalDataError, match="qf contains NaN or inf values \\(first at row 4321\\)"):
        evaluate(qf, np.ones((2, 2), np.float32), np.ones(5000, int), [1, 1], np.zeros(5000, int), [1, 1])


def test_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown ap='map'"):
        evaluate(*good_args(), ap="map")
    with pytest.raises(ValueError, match="ranks must be"):
        evaluate(*good_args(), ranks=(0, 5))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        evaluate(*good_args(), block_size=0)


# --------------------------------------------------------------------------
# Classification accuracy
# --------------------------------------------------------------------------


def test_accuracy_from_logits_and_predictions():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert accuracy(logits, [1, 0, 0]) == pytest.approx(2 / 3)
    assert accuracy(torch.tensor([1, 0, 0]), torch.tensor([1, 0, 0])) == 1.0
    with pytest.raises(ValueError, match="mismatched lengths"):
        accuracy([1, 0], [1])
    with pytest.raises(ValueError, match="empty"):
        accuracy(np.zeros(0), np.zeros(0))
