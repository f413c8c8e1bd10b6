"""Exact top-k search: FAISS vs block matmul, the tie rule, and the saved index folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedreid.errors import FedReIDError
from fedreid.eval.metrics import evaluate, gallery_masks
from fedreid.eval.retrieval import (
    FaissGpuUnavailableError,
    IndexFileError,
    block_topk,
    build_index,
    faiss_gpu_available,
    is_index_folder,
    load_index,
    save_index,
    search,
)


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
    folder = save_index(tmp_path / "i", build_index(np.eye(2, dtype=np.float32), use_gpu=False),
                        ids=[0, 1], cameras=[0, 0], paths=["a", "b"])
    with pytest.raises(FaissGpuUnavailableError):
        load_index(folder, use_gpu=True)
    assert load_index(folder, use_gpu="auto").index.ntotal == 2  # auto falls back to the CPU


# --------------------------------------------------------------------------
# Saved index folders
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


def test_save_and_load_round_trip(tmp_path):
    folder, gallery, rng = saved(tmp_path)
    queries = unit_rows(rng, 4)
    loaded = load_index(folder)
    assert loaded.index.ntotal == 20 and loaded.header["meta"] == {"dataset": "synthetic"}
    np.testing.assert_array_equal(loaded.ids, np.arange(20))
    np.testing.assert_array_equal(loaded.cameras, np.arange(20) % 3)
    assert loaded.paths[5] == "img/005.jpg"
    a = search(build_index(gallery, use_gpu=False), queries, 5)
    b = search(loaded.index, queries, 5)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], b[0])
    # Only the three files: no temporary leftovers; saving again replaces them.
    assert sorted(p.name for p in folder.iterdir()) == ["header.json", "index.faiss", "meta.npz"]
    small = build_index(gallery[:3], use_gpu=False)
    save_index(folder, small, ids=[1, 2, 3], cameras=[0, 0, 0], paths=["a", "b", "c"])
    assert load_index(folder).index.ntotal == 3
    assert sorted(p.name for p in folder.iterdir()) == ["header.json", "index.faiss", "meta.npz"]


def test_save_rejects_mismatched_metadata(tmp_path):
    index = build_index(np.eye(3, dtype=np.float32), use_gpu=False)
    with pytest.raises(ValueError, match=r"mismatched lengths \(index: 3, ids: 2"):
        save_index(tmp_path / "x", index, ids=[1, 2], cameras=[0, 0, 0], paths=["a", "b", "c"])


@pytest.mark.parametrize("name", ["header.json", "index.faiss", "meta.npz"])
def test_missing_file_is_named(tmp_path, name):
    folder, _, _ = saved(tmp_path)
    (folder / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        load_index(folder)


def _rewrite_header(folder, name):
    """Make header.json vouch for the current bytes of ``name`` (what a hostile folder would do)."""
    import hashlib

    header = json.loads((folder / "header.json").read_text())
    data = (folder / name).read_bytes()
    header["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "header.json").write_text(json.dumps(header))


def test_corrupt_index_file_is_named(tmp_path):
    folder, _, _ = saved(tmp_path)
    path = folder / "index.faiss"
    size = path.stat().st_size
    path.write_bytes(b"\0" * size)  # same size: only the checksum can notice
    with pytest.raises(IndexFileError, match="index.faiss does not match the SHA-256 in .*header.json"):
        load_index(folder)
    _rewrite_header(folder, "index.faiss")  # checksums vouch for it: the layout check still refuses
    with pytest.raises(IndexFileError, match=r"index.faiss is not a flat inner-product faiss index .*IxFI"):
        load_index(folder)


def test_index_file_with_a_forged_layout_never_reaches_faiss(tmp_path, monkeypatch):
    import struct

    import faiss

    from fedreid.eval import retrieval

    folder, _, _ = saved(tmp_path)
    path = folder / "index.faiss"
    good = path.read_bytes()
    read, real = [], faiss.read_index
    monkeypatch.setattr(retrieval.faiss, "read_index", lambda p: read.append(p) or real(p))
    # Claims 10**12 vectors (faiss would try to allocate them), or a wrong dim, metric or length.
    head = struct.Struct("<4siqqqBiq")
    fields = list(head.unpack(good[: head.size]))
    for change, message in (
        ({2: 10**12}, "ntotal=1000000000000"),
        ({1: 17}, "dim=17"),
        ({6: 1}, "metric 1"),
        ({7: 5}, "do not hold 20 vectors of dim 16"),
    ):
        forged = list(fields)
        for i, v in change.items():
            forged[i] = v
        path.write_bytes(head.pack(*forged) + good[head.size :])
        _rewrite_header(folder, "index.faiss")
        with pytest.raises(IndexFileError, match=message):
            load_index(folder)
    path.write_bytes(good[:-4])  # one vector short
    _rewrite_header(folder, "index.faiss")
    with pytest.raises(IndexFileError, match="do not hold 20 vectors"):
        load_index(folder)
    assert read == []
    path.write_bytes(good)
    _rewrite_header(folder, "index.faiss")
    assert load_index(folder).index.ntotal == 20 and len(read) == 1


def test_index_of_an_earlier_version_asks_for_a_rebuild(tmp_path):
    folder, _, _ = saved(tmp_path)
    header = json.loads((folder / "header.json").read_text())
    header["version"] = 1
    header["files"] = {name: rec["bytes"] for name, rec in header["files"].items()}  # version 1: sizes only
    (folder / "header.json").write_text(json.dumps(header))
    with pytest.raises(IndexFileError, match="version 1, written by an earlier fedreid without checksums"):
        load_index(folder)
    assert is_index_folder(folder)  # still recognised as an index folder (so `index` may rebuild it)
    del header["files"]["index.faiss"]
    header["version"] = 2
    (folder / "header.json").write_text(json.dumps(header))
    with pytest.raises(IndexFileError, match="lacks the size and SHA-256 of index.faiss, meta.npz"):
        load_index(folder)


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


def test_corrupt_meta_file_is_named(tmp_path):
    folder, _, _ = saved(tmp_path)
    path = folder / "meta.npz"
    path.write_bytes(b"x" * path.stat().st_size)
    with pytest.raises(IndexFileError, match="meta.npz does not match the SHA-256"):
        load_index(folder)
    _rewrite_header(folder, "meta.npz")
    with pytest.raises(IndexFileError, match="meta.npz is not a NumPy .npz of the gallery's ids.*a text file"):
        load_index(folder)
    np.savez(path, ids=np.array([object()] * 20, dtype=object), cameras=np.zeros(20, int), paths=np.array(["a"] * 20))
    _rewrite_header(folder, "meta.npz")
    with pytest.raises(IndexFileError, match="pickled Python objects, which are never loaded") as exc:
        load_index(folder)
    assert "allow_pickle" not in str(exc.value)


def test_file_from_another_save_is_detected(tmp_path):
    folder, _, _ = saved(tmp_path)
    (folder / "index.faiss").write_bytes(b"short")
    with pytest.raises(IndexFileError, match="index.faiss has 5 bytes but .*header.json says"):
        load_index(folder)


def test_corrupt_or_foreign_header_is_named(tmp_path):
    folder, _, _ = saved(tmp_path)
    header = folder / "header.json"
    header.write_text("{not json")
    with pytest.raises(IndexFileError, match="header.json is not a readable JSON header"):
        load_index(folder)
    header.write_text(json.dumps({"format": "other"}))
    with pytest.raises(IndexFileError, match="header.json is not a fedreid-faiss-index header"):
        load_index(folder)


# --------------------------------------------------------------------------
# k-reciprocal re-ranking (its tests live here: re-ranking is a retrieval step)
# --------------------------------------------------------------------------


def reference_rerank(qf, gf, k1, k2, lam):
    """Zhong et al. 2017 written densely and step by step, loops included."""
    feats = np.concatenate([qf, gf]).astype(np.float64)
    n, n_q = feats.shape[0], qf.shape[0]
    dist = ((feats[:, None, :] - feats[None, :, :]) ** 2).sum(-1)
    dist = dist / dist.max(axis=1, keepdims=True)
    rank = np.argsort(dist, axis=1, kind="stable")

    def reciprocal(p, k):
        forward = rank[p, : k + 1]
        return [q for q in forward if p in rank[q, : k + 1]]

    V = np.zeros((n, n))
    for p in range(n):
        base = reciprocal(p, k1)
        expanded = list(base)
        for q in base:
            candidate = reciprocal(q, int(np.around(k1 / 2)))
            if len(set(candidate) & set(base)) > 2 / 3 * len(candidate):
                expanded += candidate
        expanded = sorted(set(expanded))
        w = np.exp(-dist[p, expanded])
        V[p, expanded] = w / w.sum()
    if k2 > 1:
        V = np.stack([V[rank[p, :k2]].mean(axis=0) for p in range(n)])
    out = np.zeros((n_q, n - n_q))
    for i in range(n_q):
        for j in range(n_q, n):
            shared = np.minimum(V[i], V[j]).sum()
            out[i, j - n_q] = (1 - lam) * (1 - shared / (2 - shared)) + lam * dist[i, j]
    return out


def clustered(seed, n_ids=8, per_id=6, dim=12, noise=1.1):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_ids, dim))
    q_pids, g_pids = np.repeat(np.arange(1, n_ids + 1), 2), np.repeat(np.arange(1, n_ids + 1), per_id)

    def feats(pids):
        x = centres[pids - 1] + noise * rng.standard_normal((pids.size, dim))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return feats(q_pids), feats(g_pids), q_pids, g_pids, np.zeros(q_pids.size, int), np.ones(g_pids.size, int)


@pytest.mark.parametrize("k1, k2, lam", [(20, 6, 0.3), (5, 3, 0.3), (4, 1, 0.5), (3, 2, 0.0)])
def test_rerank_matches_the_straightforward_formulation(k1, k2, lam):
    from fedreid.eval.rerank import k_reciprocal_rerank

    qf, gf, *_ = clustered(k1 + k2)
    got = k_reciprocal_rerank(qf, gf, k1=k1, k2=k2, lambda_value=lam)
    assert got.shape == (qf.shape[0], gf.shape[0]) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference_rerank(qf, gf, k1, k2, lam), atol=2e-5)


def test_rerank_improves_map_when_identities_form_neighbourhoods():
    from fedreid.eval.metrics import evaluate, evaluate_scores
    from fedreid.eval.rerank import k_reciprocal_rerank

    # 20 identities x 12 gallery images around noisy centres: single-feature
    # similarity confuses identities, mutual neighbourhoods do not.
    qf, gf, *ids = clustered(0, n_ids=20, per_id=12, dim=32, noise=1.2)
    before = evaluate(qf, gf, *ids)["mAP"]
    after = evaluate_scores(-k_reciprocal_rerank(qf, gf), *ids)["mAP"]
    assert after > before + 0.1, (before, after)


def test_rerank_memory_guard_names_sizes_and_limit():
    from fedreid.eval.rerank import RerankMemoryError, estimate_rerank_bytes, k_reciprocal_rerank

    qf, gf, *_ = clustered(1)
    needed = estimate_rerank_bytes(qf.shape[0], gf.shape[0])
    with pytest.raises(RerankMemoryError, match=r"16 queries \+ 48 gallery items \(N = 64\).*max_bytes=1000"):
        k_reciprocal_rerank(qf, gf, max_bytes=1000)
    assert k_reciprocal_rerank(qf, gf, max_bytes=needed).shape == (16, 48)
    # Market-1501 fits the default 4 GiB; MSMT17 does not.
    assert estimate_rerank_bytes(3368, 19732) < 4 * 2**30 < estimate_rerank_bytes(11659, 82161)
