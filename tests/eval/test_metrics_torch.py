"""The torch backend of evaluate() (fedreid.eval.ranking) against the numpy path and the oracles.

On this CPU-only machine the torch backend runs on CPU tensors; the same code
runs on CUDA, where the ``gpu``-marked tests compare it with the numpy path.
The oracle tests of tests/eval/test_metrics.py are rerun here with evaluate()
switched to ``backend="torch"``.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_metrics
import torch
from test_metrics import random_case

from fedreid.eval import ranking as ranking_torch
from fedreid.eval.metrics import EvalDataError, evaluate

PER_QUERY_EXACT = ("first_match_rank", "num_matches", "valid")
# AP and INP: the same float64 terms, summed in another order (row sums vs bincount).
PER_QUERY_TOL = 1e-12
SUMMARY_KEYS = ("rank1", "rank5", "rank10", "mAP", "mINP")
# How a run went rather than what it found: these may differ between backends.
RUN_KEYS = ("backend", "block_size", "device", "num_threads")


def evaluate_torch(*args, **kwargs):
    """evaluate() forced onto the torch backend, checking that it really ran there."""
    result = evaluate(*args, backend="torch", **kwargs)
    assert result["backend"] == "torch"
    return result


@pytest.fixture
def torch_backend(monkeypatch):
    """tests/eval/test_metrics.py's evaluate() switched to the torch backend."""
    monkeypatch.setattr(test_metrics, "evaluate", evaluate_torch)


def assert_same_results(numpy_result, torch_result):
    """Metrics equal to 1e-12, counts and per-query ranks exactly, the same keys."""
    assert set(numpy_result) == set(torch_result)
    for key, value in numpy_result.items():
        if key in RUN_KEYS or key == "per_query":
            continue
        if key in SUMMARY_KEYS:
            assert torch_result[key] == pytest.approx(value, abs=PER_QUERY_TOL), key
        else:
            assert torch_result[key] == value, key
    if "per_query" in numpy_result:
        expected, got = numpy_result["per_query"], torch_result["per_query"]
        assert set(expected) == set(got)
        for key in PER_QUERY_EXACT:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
            assert got[key].dtype == expected[key].dtype, key
        for key in ("ap", "inp"):
            np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=PER_QUERY_TOL, err_msg=key)
            assert got[key].dtype == expected[key].dtype, key


def valid_cases(n_seeds: int, **kwargs):
    """random_case() problems with at least one query that has a true match."""
    for seed in range(n_seeds):
        case = random_case(seed, **kwargs)
        qf, gf, q_pids, g_pids, q_cams, g_cams = case
        if any(x is not None for x in test_metrics.reference_per_query(qf @ gf.T, *case[2:])):
            yield seed, case


# --------------------------------------------------------------------------
# The oracle tests of tests/eval/test_metrics.py on the torch backend
# --------------------------------------------------------------------------

HAND_CHECKS = [
    test_metrics.test_hand_example_both_ap_forms_and_minp,
    test_metrics.test_official_ap_uses_precision_one_before_a_first_rank_match,
    test_metrics.test_junk_items_are_removed,
    test_metrics.test_same_identity_same_camera_items_are_removed_but_other_cameras_match,
    test_metrics.test_distractors_stay_as_negatives,
    test_metrics.test_queries_without_match_are_skipped_and_counted,
    test_metrics.test_query_whose_matches_are_all_in_its_own_camera_is_skipped,
    test_metrics.test_no_valid_query_at_all_is_an_error,
    test_metrics.test_ties_lower_gallery_index_ranks_first,
    test_metrics.test_negative_zero_ties_with_positive_zero,
    test_metrics.test_gallery_shorter_than_max_rank_saturates,
    test_metrics.test_result_reports_options_and_fractions,
]


@pytest.mark.parametrize("check", HAND_CHECKS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_hand_computed_rules_hold_on_the_torch_backend(torch_backend, check):
    check()


@pytest.mark.parametrize("ap", ["standard", "official"])
@pytest.mark.parametrize("exact_ties", [False, True])
def test_torch_backend_matches_the_full_sort_reference(torch_backend, ap, exact_ties):
    test_metrics.test_random_cases_match_full_sort_reference(ap, exact_ties)


@pytest.mark.parametrize("ap", ["standard", "official"])
def test_torch_backend_per_query_results_match_the_reference(torch_backend, ap):
    test_metrics.test_per_query_results_match_full_sort_reference(ap)


def test_torch_backend_bad_inputs_raise_the_same_errors(torch_backend):
    test_metrics.test_bad_options_raise_clear_errors()
    with pytest.raises(EvalDataError, match="unknown backend='cuda'"):
        evaluate(*test_metrics.good_args(), backend="cuda")
    huge = test_metrics.good_args()
    huge[0], huge[1] = huge[0] * 1e20, huge[1] * 1e20  # finite, but the scores would overflow float32
    with pytest.raises(EvalDataError, match="too large to score in float32"):
        evaluate(*huge, backend="torch")


# --------------------------------------------------------------------------
# Torch backend == numpy path
# --------------------------------------------------------------------------


@pytest.mark.parametrize("ap", ["standard", "official"])
@pytest.mark.parametrize("exact_ties", [False, True])
def test_torch_backend_equals_the_numpy_path(ap, exact_ties):
    checked = 0
    for seed, case in valid_cases(40, exact_ties=exact_ties):
        options = {"ap": ap, "minp": True, "return_per_query": True, "ranks": (1, 3, 5, 10, 100)}
        expected = evaluate(*case, **options)
        assert expected["backend"] == "numpy"
        assert_same_results(expected, evaluate_torch(*case, block_size=1 + seed % 5, **options))
        checked += 1
    assert checked > 25


def test_result_does_not_depend_on_the_block_size():
    # A bigger problem with many exact ties: quarter-step features in 4-D.
    case = random_case(3, dim=4, exact_ties=True)
    rng = np.random.default_rng(7)
    qf, gf, q_pids, g_pids, q_cams, g_cams = case
    reps = 30  # tile the gallery: every score repeats, so ties span blocks of rows and columns
    gf = np.tile(gf, (reps, 1))
    g_pids = np.tile(g_pids, reps)
    g_cams = rng.integers(0, 3, g_pids.size)
    case = (qf, gf, q_pids, g_pids, q_cams, g_cams)
    options = {"minp": True, "return_per_query": True}
    expected = evaluate(*case, **options)
    n_gallery = gf.shape[0]
    one_row = ranking_torch.BYTES_PER_SCORE * n_gallery
    blocks = set()
    for budget in (one_row, 2 * one_row + 5, 3 * one_row, 10**9):
        got = evaluate_torch(*case, max_block_bytes=budget, **options)
        blocks.add(got["block_size"])
        assert_same_results(expected, got)
    for block_size in (1, 4, qf.shape[0]):
        assert_same_results(expected, evaluate_torch(*case, block_size=block_size, **options))
    assert {1, 2, 3} <= blocks


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_float64_and_float32_inputs_agree(dtype):
    for seed, case in valid_cases(10, exact_ties=True):
        qf, gf, *ids = case
        expected = evaluate(qf, gf, *ids, return_per_query=True)
        as_dtype = [torch.from_numpy(qf.astype(dtype)), torch.from_numpy(gf.astype(dtype))]
        assert_same_results(expected, evaluate_torch(*as_dtype, *ids, return_per_query=True))
        # numpy inputs on the torch backend run on the CPU too.
        got = evaluate_torch(qf.astype(dtype), gf.astype(dtype), *ids, return_per_query=True)
        assert got["device"] == "cpu"
        assert_same_results(expected, got)


def test_auto_keeps_cpu_inputs_on_the_numpy_path():
    case = random_case(5)
    for qf, gf in ((case[0], case[1]), (torch.from_numpy(case[0]), torch.from_numpy(case[1]))):
        result = evaluate(qf, gf, *case[2:])
        assert result["backend"] == "numpy" and result["device"] == "cpu"
    assert evaluate(*case, backend="numpy") == evaluate(*case)


# --------------------------------------------------------------------------
# Block sizing
# --------------------------------------------------------------------------


def test_cpu_blocks_come_from_a_fixed_byte_budget():
    case = random_case(2)
    n_gallery = case[1].shape[0]
    one_row = ranking_torch.BYTES_PER_SCORE * n_gallery
    assert evaluate_torch(*case, max_block_bytes=2 * one_row)["block_size"] == 2
    with pytest.raises(EvalDataError, match="cannot hold one query row"):
        evaluate_torch(*case, max_block_bytes=one_row - 1)
    # Default: DEFAULT_BLOCK_BYTES, so this small problem is one block.
    assert evaluate_torch(*case)["block_size"] == case[0].shape[0]


def test_cuda_blocks_are_sized_from_the_card_not_from_what_is_allocated(monkeypatch):
    # No CUDA here: the memory queries are stubbed, the sizing rule is what is checked.
    memory = {"free": 60 * 2**30, "reserved": 3 * 2**30, "allocated": 1 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    cuda = torch.device("cuda", 0)
    budget = ranking_torch.device_budget(cuda)
    assert budget == 10 * 2**30  # an eighth of the 80 GiB card
    memory["free"] = 30 * 2**30  # training took more: the same blocks, so the same float32 scores
    assert ranking_torch.device_budget(cuda) == budget
    memory["free"] = 6 * 2**30  # half of 6 + 2 GiB cannot hold 10 GiB: halved until it fits
    assert ranking_torch.device_budget(cuda) == int(2.5 * 2**30)
    assert ranking_torch.device_budget(torch.device("cpu")) is None
    n_gallery = 82_161
    rows = ranking_torch.rows_within(n_gallery, budget)
    assert rows == budget // (ranking_torch.BYTES_PER_SCORE * n_gallery)
    # Huge budgets stop below 2**31 scores per block.
    assert ranking_torch.rows_within(n_gallery, 2**50) * n_gallery <= ranking_torch.MAX_BLOCK_ELEMENTS


# --------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------


def tied_problem(seed: int, n_query: int = 300, n_gallery: int = 4000, n_ids: int = 120):
    """Quantised features (many exact ties), junk, distractors, same-camera matches."""
    rng = np.random.default_rng(seed)
    g_pids = rng.integers(1, n_ids + 1, n_gallery)
    g_pids[rng.random(n_gallery) < 0.05] = -1
    g_pids[rng.random(n_gallery) < 0.05] = 0
    q_pids = rng.integers(1, n_ids + 5, n_query)  # a few pids with no gallery image
    centres = rng.standard_normal((n_ids + 6, 8))

    def feats(pids):
        x = centres[np.maximum(pids, 0)] + rng.standard_normal((pids.size, 8))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return (np.round(x * 4) / 4).astype(np.float32)

    q_cams, g_cams = rng.integers(0, 6, n_query), rng.integers(0, 6, n_gallery)
    return feats(q_pids), feats(g_pids), q_pids, g_pids, q_cams, g_cams


@pytest.mark.gpu
@pytest.mark.parametrize("ap", ["standard", "official"])
def test_cuda_evaluation_equals_the_numpy_path(ap):
    qf, gf, *ids = tied_problem(0)
    expected = evaluate(qf, gf, *ids, ap=ap, minp=True, return_per_query=True, ranks=(1, 5, 10, 50))
    cuda = [torch.from_numpy(x).cuda() for x in (qf, gf)]
    options = {"ap": ap, "minp": True, "return_per_query": True, "ranks": (1, 5, 10, 50)}
    got = evaluate(*cuda, *ids, **options)
    assert got["backend"] == "torch" and got["device"].startswith("cuda")
    assert_same_results(expected, got)
    # Several blocks, float64 features, and the host-ranking path give the same numbers.
    assert_same_results(expected, evaluate(*cuda, *ids, block_size=7, **options))
    assert_same_results(expected, evaluate(*(x.double() for x in cuda), *ids, **options))
    host = evaluate(*cuda, *ids, backend="numpy", **options)
    assert host["backend"] == "numpy"
    assert_same_results(expected, host)


def test_scores_are_full_fp32_while_training_runs_tf32(monkeypatch):
    # train.tf32 sets TF32 for the whole process; ranking must still score in
    # full fp32 (TF32's 10-bit mantissa reorders near ties), leave the
    # training's setting as it found it, and keep working once TF32 is turned
    # off again (torch refuses the process-wide reading after a mix of its
    # legacy and per-backend settings).
    from fedreid.utils.precision import adopt_fp32_settings, fp32_settings, set_tf32

    at_mm = []
    real_mm = torch.mm

    def spy_mm(*args, **kwargs):
        host = (torch.backends.mkldnn.matmul.fp32_precision if hasattr(torch.backends.mkldnn, "matmul")
                else {"highest": "ieee"}.get(torch.get_float32_matmul_precision(), "not ieee"))
        at_mm.append((torch.backends.cuda.matmul.allow_tf32, host))
        return real_mm(*args, **kwargs)

    saved = fp32_settings()
    qf, gf, *ids = random_case(2)
    q, g = torch.from_numpy(qf), torch.from_numpy(gf)
    try:
        set_tf32(True)
        training = fp32_settings()
        monkeypatch.setattr(torch, "mm", spy_mm)
        evaluate_torch(q, g, *ids, block_size=2)
        list(ranking_torch.score_blocks(q, g, block_size=2))
        after = fp32_settings()
        set_tf32(False)  # a later run in the same process without TF32
        evaluate_torch(q, g, *ids, block_size=2)
        process_wide = torch.get_float32_matmul_precision()
    finally:
        adopt_fp32_settings(saved)
    assert len(at_mm) > 2 and set(at_mm) == {(False, "ieee")}
    assert after == training and training != saved
    assert process_wide == "highest"


@pytest.mark.gpu
def test_cuda_evaluation_under_tf32_equals_the_evaluation_without_it():
    # On random unit features cuBLAS and the host's BLAS round float32 sums in
    # different orders, so near-tied items may swap between the GPU and the
    # CPU paths (the tied problem above is exact on both). On one card the
    # same blocks give the same scores: TF32 on must change nothing there.
    from fedreid.utils.precision import adopt_fp32_settings, fp32_settings, set_tf32

    rng = np.random.default_rng(3)
    qf = rng.standard_normal((300, 512)).astype(np.float32)
    gf = rng.standard_normal((3000, 512)).astype(np.float32)
    qf /= np.linalg.norm(qf, axis=1, keepdims=True)
    gf /= np.linalg.norm(gf, axis=1, keepdims=True)
    ids = (rng.integers(0, 50, 300), rng.integers(0, 50, 3000), rng.integers(0, 6, 300), rng.integers(0, 6, 3000))
    options = {"minp": True, "return_per_query": True, "block_size": 128}
    q, g = (torch.from_numpy(x).cuda() for x in (qf, gf))
    expected = evaluate(q, g, *ids, **options)
    full = q @ g.T
    saved = fp32_settings()
    set_tf32(True)
    try:
        # the case can tell: TF32's 10-bit mantissa moves these scores by about 1e-4
        assert (q @ g.T - full).abs().max().item() > 1e-5
        got = evaluate(q, g, *ids, **options)
    finally:
        adopt_fp32_settings(saved)
    assert got["device"].startswith("cuda")
    assert_same_results(expected, got)


class Embed(torch.nn.Module):
    """A model with ``embed``, what the training evaluator extracts features with."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 4)

    def embed(self, x):
        return self.fc(x.flatten(1))


def image_batches(n_batches: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.arange(5)
    return [
        {"image": torch.randn(5, 3, 2, 2, generator=generator), "pid": ids, "camid": torch.zeros_like(ids)}
        for _ in range(n_batches)
    ]


@pytest.mark.gpu
def test_training_evaluator_keeps_cuda_features_on_the_device():
    from fedreid.fl.evaluation import Evaluator

    evaluator = Evaluator({}, height=2, width=2, device="cuda")
    features = evaluator.features(Embed().cuda(), image_batches(2))
    assert features.is_cuda and features.shape == (10, 4) and features.dtype == torch.float32


def test_training_evaluator_features_stay_on_the_cpu_for_a_cpu_run():
    from fedreid.fl.evaluation import Evaluator

    features = Evaluator({}, height=2, width=2).features(Embed(), image_batches(1))
    assert features.device.type == "cpu" and features.shape == (5, 4)
