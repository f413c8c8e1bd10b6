"""Exact top-k search: FAISS vs block matmul, the tie rule; index folders of the earlier format are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from old_index_format import save_index

from fedreid.errors import FedReIDError
from fedreid.eval.metrics import evaluate, gallery_masks
from fedreid.inference.errors import EvalInputError
from fedreid.retrieval.exact import (
    FaissGpuUnavailableError,
    IndexFileError,
    block_topk,
    build_index,
    faiss_gpu_available,
    is_index_folder,
    refuse_old_index_folder,
    search,
)
from fedreid.retrieval.folders import open_gallery_store


def unit_rows(rng, n, d=16):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force_topk(queries, gallery, k):
    scores = queries @ gallery.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), order


@pytest.mark.parametrize("block_size", [1, 7, 1000])
def test_faiss_and_block_paths_agree_with_brute_force(block_size):
    rng = np.random.default_rng(0)
    gallery, queries = unit_rows(rng, 300), unit_rows(rng, 23)
    index = build_index(gallery, use_gpu=False)
    f_scores, f_idx = search(index, queries, 10, block_size=block_size)
    b_scores, b_idx = block_topk(queries, gallery, 10, block_size=block_size)
    r_scores, r_idx = brute_force_topk(queries, gallery, 10)
    # Random unit vectors: no two scores within float error, so indices agree exactly.
    np.testing.assert_array_equal(f_idx, r_idx)
    np.testing.assert_array_equal(b_idx, r_idx)
    np.testing.assert_allclose(f_scores, r_scores, atol=1e-5)
    np.testing.assert_allclose(b_scores, r_scores, atol=1e-5)
    assert f_scores.dtype == np.float32 and f_idx.dtype == np.int64


def test_ties_go_to_the_lower_gallery_index_on_both_paths():
    # Gallery rows: 0..9 all equal to e0 (score 1), except 3 and 7 scoring 2.
    gallery = np.zeros((10, 4), np.float32)
    gallery[:, 0] = 1.0
    gallery[[3, 7], 0] = 2.0
    query = np.array([[1, 0, 0, 0]], np.float32)
    index = build_index(gallery, use_gpu=False)
    for k in (1, 2, 4, 10):
        expected = [3, 7, 0, 1, 2, 4, 5, 6, 8, 9][:k]
        assert search(index, query, k)[1][0].tolist() == expected
        assert block_topk(query, gallery, k)[1][0].tolist() == expected


def test_k_beyond_the_gallery_is_cut_to_its_size():
    rng = np.random.default_rng(1)
    gallery = unit_rows(rng, 5)
    scores, idx = search(build_index(gallery, use_gpu=False), unit_rows(rng, 2), 50)
    assert idx.shape == (2, 5) and sorted(idx[0]) == list(range(5))
    assert block_topk(unit_rows(rng, 2), gallery, 50)[1].shape == (2, 5)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_faiss_full_ranking_gives_the_same_cmc_as_evaluate(backend):
    """CMC from FAISS's complete ranking, filtered by the metrics rule, equals evaluate() on either backend."""
    rng = np.random.default_rng(2)
    centres = unit_rows(rng, 12)
    q_pids, g_pids = np.repeat(np.arange(12), 2), np.repeat(np.arange(12), 6)
    qf = unit_rows(rng, q_pids.size) * 0.8 + centres[q_pids]
    gf = unit_rows(rng, g_pids.size) * 0.8 + centres[g_pids]
    q_cams, g_cams = rng.integers(0, 3, q_pids.size), rng.integers(0, 3, g_pids.size)
    _, order = search(build_index(gf, use_gpu=False), qf, gf.shape[0])
    first = []
    for i, row in enumerate(order):
        keep, good = gallery_masks(q_pids[i], q_cams[i], g_pids[row], g_cams[row])
        matches = good[keep]
        if matches.any():
            first.append(np.flatnonzero(matches)[0] + 1)
    first = np.array(first)
    r = evaluate(qf, gf, q_pids, g_pids, q_cams, g_cams, ranks=(1, 3, 5), backend=backend)
    assert r["backend"] == backend
    for k in (1, 3, 5):
        assert r[f"rank{k}"] == pytest.approx(np.mean(first <= k), abs=1e-12)


def test_search_errors():
    index = build_index(np.eye(3, 4, dtype=np.float32), use_gpu=False)
    with pytest.raises(ValueError, match="feature dims differ"):
        search(index, np.ones((1, 5), np.float32), 1)
    with pytest.raises(ValueError, match="k and block_size must be >= 1"):
        search(index, np.ones((1, 4), np.float32), 0)
    with pytest.raises(ValueError, match="NaN or inf"):
        build_index(np.full((2, 4), np.nan, np.float32))
    with pytest.raises(ValueError, match="use_gpu"):
        build_index(np.eye(2, dtype=np.float32), use_gpu="yes")


@pytest.mark.skipif(faiss_gpu_available(), reason="checks the no-GPU error")
def test_requiring_a_gpu_without_one_is_a_clear_error(tmp_path):
    # A FedReIDError (the tools print it as one line) and still a RuntimeError.
    assert issubclass(FaissGpuUnavailableError, FedReIDError) and issubclass(FaissGpuUnavailableError, RuntimeError)
    with pytest.raises(FaissGpuUnavailableError, match="GPU faiss index was required .*(no GPU support|sees no GPU)"):
        build_index(np.eye(2, dtype=np.float32), use_gpu=True)


# --------------------------------------------------------------------------
# Index folders of the earlier format: recognised, never read
# --------------------------------------------------------------------------


def saved(tmp_path, n=20):
    rng = np.random.default_rng(3)
    gallery = unit_rows(rng, n)
    folder = save_index(
        tmp_path / "idx",
        build_index(gallery, use_gpu=False),
        ids=np.arange(n),
        cameras=np.arange(n) % 3,
        paths=[f"img/{i:03d}.jpg" for i in range(n)],
        meta={"dataset": "synthetic"},
    )
    return folder, gallery, rng


def test_an_index_folder_of_the_earlier_format_is_refused_with_how_to_rebuild(tmp_path):
    folder, _, _ = saved(tmp_path)  # version 2, the last one with checksums
    for version in (2, 1):
        header = json.loads((folder / "header.json").read_text())
        header["version"] = version
        (folder / "header.json").write_text(json.dumps(header))
        with pytest.raises(IndexFileError) as exc:
            open_gallery_store(folder)
        message = str(exc.value)
        assert "\n" not in message and isinstance(exc.value, EvalInputError) and isinstance(exc.value, FedReIDError)
        assert f"index folder {folder} was built by an earlier version of fedreid" in message
        assert f"(fedreid-faiss-index version {version})" in message
        assert f"tools/eval_reid.py index --model MODEL --gallery GALLERY --index {folder}" in message
        assert is_index_folder(folder)  # still recognised, so that `index` may replace it with a store
    refuse_old_index_folder(tmp_path / "missing", "unused")  # not an earlier-format folder: nothing to refuse


def test_is_index_folder_tells_index_folders_from_user_folders(tmp_path):
    folder, _, _ = saved(tmp_path)
    assert is_index_folder(folder)
    (folder / ".index.faiss.abc123.tmp").write_bytes(b"")  # left by an interrupted save
    assert is_index_folder(folder)
    (folder / "skipped.csv").write_text("path,reason\n")
    assert not is_index_folder(folder) and is_index_folder(folder, extra_files=("skipped.csv",))
    (folder / "holiday.jpg").write_bytes(b"x")
    assert not is_index_folder(folder, extra_files=("skipped.csv",))
    user = tmp_path / "user"
    user.mkdir()
    (user / "header.json").write_text(json.dumps({"title": "my notes"}))
    assert not is_index_folder(user) and not is_index_folder(tmp_path / "missing")
    (user / "header.json").write_text(json.dumps({"format": "fedreid-faiss-index", "version": 9}))
    assert not is_index_folder(user)


def test_block_topk_ties_equal_gallery_vectors_wherever_they_sit():
    # A BLAS matmul can score two equal vectors a unit in the last place apart, depending on
    # their columns (OpenBLAS on AMD EPYC); the tie rule must still put the lower index first.
    rng = np.random.default_rng(0)
    base = rng.standard_normal((300, 48)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    gallery = np.concatenate([base, base, base[:7]])  # items i, i + 300 and, for i < 7, i + 600 are equal
    queries = base[:40] + 0.2 * rng.standard_normal((40, 48)).astype(np.float32)
    for k in (1, 6, 25):
        scores, idx = block_topk(queries, gallery, k, block_size=16)
        np.testing.assert_array_equal(scores, np.einsum("qcd,qd->qc", gallery[idx], queries))
        for r in range(40):
            for j, item in enumerate(idx[r]):
                lower_twins = range(item % 300, item, 300)
                assert all(t in idx[r, :j] for t in lower_twins), (k, r, j, item)
    top = block_topk(queries, gallery, 2)[1]
    assert (top[:, 1] == top[:, 0] + 300).sum() >= 30  # mostly the query's own item and its twin
