"""The gallery store (fedreid.retrieval.store): factories, stable ids, erasure, filters, crash safety, checks."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from fedreid.retrieval import store as store_mod
from fedreid.retrieval.store import GalleryStore, GalleryStoreError

N, D = 2000, 32
CAMERAS, SITES = 4, ("north", "south", "east")


def clustered(n: int, d: int, seed: int, centers: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + 0.35 * rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def make_rows(n: int, start: int = 0, prefix: str = "img") -> list[dict]:
    return [
        {"path": f"/gallery/{prefix}_{start + i:05d}.jpg", "camera": (start + i) % CAMERAS,
         "site": SITES[(start + i) % len(SITES)], "timestamp": float(1000 + start + i),
         "identity": (start + i) % 97}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def feats() -> np.ndarray:
    return clustered(N, D, seed=0)


FACTORIES = ["Flat", "IVF16,Flat", "IVF16,PQ8x4", "OPQ8,IVF16,PQ8x4", "HNSW16"]


@pytest.mark.parametrize("factory", FACTORIES)
def test_each_factory_builds_searches_and_reopens(tmp_path, feats, factory):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory=factory, seed=0)
    assert s.ntotal == N
    res = s.search(feats[:20], 5)
    assert res.ids.shape == (20, 5) and (res.ids >= 0).all()
    if factory in ("Flat", "IVF16,Flat", "HNSW16"):  # un-quantised: each vector finds itself first
        assert (res.ids[:, 0] == np.arange(20)).mean() >= 0.9
    again = GalleryStore.open(tmp_path / "st")
    assert again.factory == factory and again.kind == s.kind
    np.testing.assert_array_equal(again.search(feats[:20], 5).ids, res.ids)
    header = json.loads((tmp_path / "st" / "header.json").read_text())
    assert header["version"] == 4 and header["ntotal"] == N and header["dim"] == D


def test_flat_recall_is_one_and_verify_is_recorded(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory="Flat")
    r = s.verify(sample=100, k=10, seed=3)
    assert r["recall"] == 1.0
    assert json.loads((tmp_path / "st" / "header.json").read_text())["verify"]["recall"] == 1.0
    assert GalleryStore.open(tmp_path / "st").header["verify"] == r


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,PQ8x4"])
def test_verify_matches_a_recomputation(tmp_path, feats, factory):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory=factory, seed=0)
    r = s.verify(sample=150, k=10, seed=7)
    rows = np.sort(np.random.default_rng(7).choice(N, size=150, replace=False))
    q = feats[rows]
    exact = np.argsort(-(q @ feats.T), axis=1, kind="stable")[:, :10]  # ids == rows at creation
    approx = s.search(q, 10).ids
    mine = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx.tolist(), exact.tolist())])
    assert r["recall"] == pytest.approx(mine)
    assert 0 < r["recall"] <= 1
    assert r["search"] == s.search_params


@pytest.mark.parametrize("factory,name", [("IVF32,Flat", "nprobe"), ("HNSW8", "efSearch")])
def test_tune_picks_the_smallest_value_reaching_the_target(tmp_path, feats, factory, name):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory=factory, seed=0)
    t = s.tune(0.95, sample=100, k=10, seed=1)
    assert t["reached"] and t["recall"] >= 0.95
    chosen = s.search_params[name]
    assert t["tried"][-1][name] == chosen
    assert all(x["recall"] < 0.95 for x in t["tried"][:-1])
    assert GalleryStore.open(tmp_path / "st").search_params == {name: chosen}


def test_too_few_vectors_for_the_factory_is_refused(tmp_path, feats):
    with pytest.raises(GalleryStoreError, match="needs at least 64 training vectors.*IVF with 64 lists.*has 50"):
        GalleryStore.create(tmp_path / "st", feats[:50], make_rows(50), factory="IVF64,Flat")
    with pytest.raises(GalleryStoreError, match="needs at least 256 training vectors.*PQ"):
        GalleryStore.create(tmp_path / "st", feats[:100], make_rows(100), factory="IVF4,PQ8")
    assert not (tmp_path / "st").exists()
    with pytest.raises(GalleryStoreError, match="factory string"):
        GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory="NoSuchThing12")


@pytest.mark.parametrize("factory", ["Flat", "IVF16,PQ8x4", "HNSW16"])
def test_add_then_remove_leaves_no_trace_and_ids_are_stable(tmp_path, feats, factory):
    base, extra = feats[:1500], feats[1500:]
    s = GalleryStore.create(tmp_path / "st", base, make_rows(1500), factory=factory, seed=0)
    before = s.search(base[:30], 5).ids
    new = s.add(extra, make_rows(500, start=1500))
    np.testing.assert_array_equal(new, np.arange(1500, 2000))
    secret = "/gallery/img_01700.jpg"
    assert s.rows([1700])[0]["path"] == secret
    gone = s.remove([secret, 1701, 3])
    np.testing.assert_array_equal(gone, [3, 1700, 1701])
    reopened = GalleryStore.open(tmp_path / "st")
    for st in (s, reopened):
        assert st.ntotal == 1997
        res = st.search(np.concatenate([feats[[1700, 1701, 3]], base[:30]]), 20).ids
        assert not np.isin(res, gone).any()
        assert st.rows([1700, 1701, 3]) == [None, None, None]
        # ids stable: untouched items keep their ids and metadata
        assert st.rows([4, 1999])[0]["path"] == "/gallery/img_00004.jpg"
        assert st.rows([1999])[0]["camera"] == 1999 % CAMERAS
    tables = sorted((tmp_path / "st").glob("seg-*.sqlite"))
    assert tables
    for table in tables:
        con = sqlite3.connect(f"file:{table}?mode=ro", uri=True)
        assert con.execute("SELECT COUNT(*) FROM gallery WHERE id IN (3, 1700, 1701)").fetchone()[0] == 0
        con.close()
    for f in (tmp_path / "st").iterdir():
        data = f.read_bytes()
        assert secret.encode() not in data and b"img_00003.jpg" not in data, f.name
    assert not np.isin(reopened.ids, gone).any()
    if factory == "Flat":
        keep = ~np.isin(np.arange(30), gone)
        np.testing.assert_array_equal(reopened.search(base[:30], 1).ids[keep, 0], before[keep, 0])
    # a removed id is never reused
    fresh = feats[:2] * 0.5 + 0.1
    again = s.add(fresh / np.linalg.norm(fresh, axis=1, keepdims=True), make_rows(2, prefix="new"))
    assert again.min() >= 2000


def test_remove_unknown_or_duplicate_add_changes_nothing(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:300], make_rows(300))
    header = (tmp_path / "st" / "header.json").read_bytes()
    with pytest.raises(GalleryStoreError, match="holds no item /nope.jpg, 99999"):
        s.remove(["/nope.jpg", 99999, 5])
    with pytest.raises(GalleryStoreError, match="already holds 1 of these paths"):
        s.add(feats[300:302], make_rows(2, start=299))
    assert (tmp_path / "st" / "header.json").read_bytes() == header and s.ntotal == 300


@pytest.mark.parametrize("factory", ["Flat", "IVF16,Flat", "HNSW16"])
def test_filters_by_camera_site_and_time(tmp_path, feats, factory, monkeypatch):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory=factory, seed=0)
    q = feats[:10]
    for exact_max in (store_mod.EXACT_FILTER_MAX, 0):  # exact path and the IDSelector path
        monkeypatch.setattr(store_mod, "EXACT_FILTER_MAX", exact_max)
        res = s.search(q, 10, cameras=[1, 2])
        assert (res.ids >= 0).all() and set((res.ids % CAMERAS).ravel()) <= {1, 2}
        res = s.search(q, 10, sites=["east"])
        assert (res.ids >= 0).all() and all(r["site"] == "east" for r in s.rows(res.ids.ravel()))
        res = s.search(q, 10, time_window=(1100.0, 1199.0))
        assert (res.ids >= 0).all() and ((res.ids >= 100) & (res.ids <= 199)).all()
        res = s.search(q, 10, cameras=[0], sites=["north"], time_window=(None, 1059.0))
        allowed = [i for i in range(60) if i % CAMERAS == 0 and i % 3 == 0]  # 0, 12, 24, 36, 48
        got = res.ids[0][res.ids[0] >= 0].tolist()
        if exact_max or factory == "Flat":  # exact: all of them; IVF with a selector probes nprobe lists only
            assert sorted(got) == allowed and (res.ids[:, len(allowed):] == -1).all()
        else:
            assert set(got) <= set(allowed)
    # the exact filtered result equals a brute-force search of the allowed items
    monkeypatch.setattr(store_mod, "EXACT_FILTER_MAX", 10**9)
    res = s.search(q, 5, cameras=[3])
    allowed = np.arange(N)[np.arange(N) % CAMERAS == 3]
    want = allowed[np.argsort(-(q @ feats[allowed].T), axis=1, kind="stable")[:, :5]]
    np.testing.assert_array_equal(res.ids, want)
    assert (s.search(q, 5, cameras=[]).ids == -1).all()


def test_a_crash_during_an_update_leaves_the_previous_store(tmp_path, feats, monkeypatch):
    s = GalleryStore.create(tmp_path / "st", feats[:500], make_rows(500), factory="IVF8,Flat", seed=0)
    snapshot = {p.name: p.read_bytes() for p in (tmp_path / "st").iterdir()}

    def crash(*a, **k):
        raise KeyboardInterrupt("killed during the swap")

    monkeypatch.setattr(store_mod, "replace_dir_atomically", crash)
    with pytest.raises(KeyboardInterrupt):
        s.add(feats[500:600], make_rows(100, start=500))
    with pytest.raises(KeyboardInterrupt):
        s.remove([1, 2])
    assert {p.name: p.read_bytes() for p in (tmp_path / "st").iterdir()} == snapshot
    assert s.ntotal == 500 and s.rows([1])[0] is not None  # memory unchanged too
    monkeypatch.undo()
    reopened = GalleryStore.open(tmp_path / "st")
    assert reopened.ntotal == 500
    np.testing.assert_array_equal(reopened.search(feats[:10], 5).ids, s.search(feats[:10], 5).ids)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".st.")]  # staging removed
    reopened.add(feats[500:600], make_rows(100, start=500))  # a later update works
    assert GalleryStore.open(tmp_path / "st").ntotal == 600


def test_a_kill_between_the_renames_is_repaired_by_the_next_update(tmp_path, feats, monkeypatch):
    import os

    s = GalleryStore.create(tmp_path / "st", feats[:300], make_rows(300))
    real = os.replace
    calls = []

    def first_rename_only(src, dst):
        if str(dst) == str(tmp_path / "st") and str(src).startswith(str(tmp_path / ".st.tmp-")):
            calls.append(src)
            raise KeyboardInterrupt("killed between the renames")
        return real(src, dst)

    monkeypatch.setattr(store_mod.replace_dir_atomically.__globals__["os"], "replace", first_rename_only)
    with pytest.raises(KeyboardInterrupt):
        s.add(feats[300:310], make_rows(10, start=300))
    monkeypatch.undo()
    assert calls and not (tmp_path / "st").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".st.old-")]
    GalleryStore(tmp_path / "st", s.header, s.segments, s.template).add(
        feats[300:310], make_rows(10, start=300)
    )
    assert GalleryStore.open(tmp_path / "st").ntotal == 310
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".st.")]


def test_a_partly_deleted_unmarked_old_copy_is_deleted_by_the_next_open_or_update(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:50], make_rows(50))
    partial = tmp_path / ".st.old-0123abcd"  # what a kill inside rmtree leaves: the marker went first
    partial.mkdir()
    np.save(partial / "vectors.npy", feats[:50])
    np.save(partial / "ids.npy", np.arange(50))
    (partial / ".meta.sqlite.ab12_x9.tmp").write_text("")
    mine = tmp_path / ".st.tmp-89abcdef"  # named like a staging folder, but holding a file the store never writes
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    GalleryStore.open(tmp_path / "st")
    assert not partial.exists() and (mine / "notes.txt").read_text() == "keep"
    partial.mkdir()
    np.save(partial / "vectors.npy", feats[:50])
    s.add(feats[50:51], make_rows(1, start=50))
    assert not partial.exists() and (mine / "notes.txt").read_text() == "keep"


def test_tampering_is_refused_with_a_clear_error(tmp_path, feats):
    GalleryStore.create(tmp_path / "st", feats[:300], make_rows(300))
    folder = tmp_path / "st"
    header = json.loads((folder / "header.json").read_text())

    h = dict(header, ntotal=299, segments=[dict(header["segments"][0], ntotal=299)])
    (folder / "header.json").write_text(json.dumps(h))
    with pytest.raises(GalleryStoreError, match=r"seg-000000\.ids\.npy: expected ids of shape"):
        GalleryStore.open(folder)

    (folder / "header.json").write_text(json.dumps(dict(header, version=2)))
    with pytest.raises(GalleryStoreError, match="version 2; this code reads 4"):
        GalleryStore.open(folder)

    (folder / "header.json").write_text("{not json")
    with pytest.raises(GalleryStoreError, match="not a readable JSON header"):
        GalleryStore.open(folder)

    (folder / "header.json").write_text(json.dumps(header))
    good = (folder / "seg-000000.faiss").read_bytes()
    data = bytearray(good)
    data[-5] ^= 0xFF
    (folder / "seg-000000.faiss").write_bytes(bytes(data))
    with pytest.raises(GalleryStoreError, match=r"seg-000000\.faiss does not match the SHA-256"):
        GalleryStore.open(folder)
    (folder / "seg-000000.faiss").write_bytes(good)
    GalleryStore.open(folder)  # restored: loads again

    # a planted pickle with a matching header is refused before anything parses it
    import pickle

    vectors = folder / "seg-000000.vectors.npy"
    vectors.write_bytes(pickle.dumps({"x": 1}))
    rec = {"bytes": vectors.stat().st_size, "sha256": store_mod.sha256_file(vectors)}
    header["files"][vectors.name] = rec
    (folder / "header.json").write_text(json.dumps(header))
    with pytest.raises(GalleryStoreError, match="seg-000000.vectors.npy is not a NumPy .npy file"):
        GalleryStore.open(folder)


def test_foreign_folders_are_refused(tmp_path, feats):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(GalleryStoreError, match="holds files .* did not write .*notes.txt"):
        GalleryStore.create(tmp_path / "mine", feats[:50], make_rows(50))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    s = GalleryStore.create(tmp_path / "st", feats[:50], make_rows(50), model_fingerprint={"weights_sha256": "ab"})
    assert GalleryStore.open(tmp_path / "st").header["meta"]["model_fingerprint"] == {"weights_sha256": "ab"}
    (tmp_path / "st" / "extra.txt").write_text("x")
    with pytest.raises(GalleryStoreError, match="also holds files .*extra.txt"):
        s.add(feats[50:51], make_rows(1, start=50))


def test_a_planted_index_file_never_reaches_faiss(tmp_path, feats, monkeypatch):
    import pickle

    GalleryStore.create(tmp_path / "st", feats[:100], make_rows(100))
    folder = tmp_path / "st"
    header = json.loads((folder / "header.json").read_text())
    planted = folder / "seg-000000.faiss"
    planted.write_bytes(pickle.dumps([1, 2, 3]))
    header["files"][planted.name] = {"bytes": planted.stat().st_size, "sha256": store_mod.sha256_file(planted)}
    (folder / "header.json").write_text(json.dumps(header))
    seen = []
    monkeypatch.setattr(store_mod.faiss, "read_index", lambda *a: seen.append(a))
    with pytest.raises(GalleryStoreError, match="seg-000000.faiss is not a faiss IndexIDMap2"):
        GalleryStore.open(folder)
    assert seen == []


def test_refine_orders_pq_candidates_by_their_exact_scores(tmp_path, feats):
    plain = GalleryStore.create(tmp_path / "pq", feats, make_rows(N), factory="IVF16,PQ4x4", seed=0)
    refineed = GalleryStore.create(tmp_path / "rr", feats, make_rows(N), factory="IVF16,PQ4x4", seed=0, refine=20)
    assert refineed.search_params["refine"] == 20 and "refine" not in plain.search_params
    queries = feats[:50]
    got = refineed.search(queries, 10)
    for q, ids, scores in zip(queries, got.ids, got.scores):  # scores are the exact inner products, best first
        rows = np.searchsorted(refineed.ids, ids)
        np.testing.assert_allclose(scores, refineed.vectors[rows] @ q, rtol=1e-5, atol=1e-6)
        assert np.all(np.diff(scores) <= 0)
    coarse = plain.recall(sample=200, k=10, seed=1)["recall"]
    fine = refineed.recall(sample=200, k=10, seed=1)["recall"]
    assert fine > coarse and fine >= 0.9
    assert GalleryStore.open(tmp_path / "rr").search_params["refine"] == 20
    with pytest.raises(GalleryStoreError, match="refine"):
        GalleryStore.create(tmp_path / "bad", feats, make_rows(N), factory="Flat", refine=0)


@pytest.mark.parametrize("factory", ["IVF16,PQ4x4", "PQ8x4", "IVF16,SQ4", "SQ4", "PCA8,Flat"])
def test_every_score_is_the_stored_vectors_inner_product(tmp_path, feats, factory):
    s = GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory=factory, seed=0)  # no refine
    assert "refine" not in s.search_params
    queries = feats[:60]
    got = s.search(queries, 10)
    true = np.einsum("qkd,qd->qk", s.vectors[np.searchsorted(s.ids, got.ids)], queries)
    np.testing.assert_allclose(got.scores, true, rtol=0, atol=1e-6)
    for scores, ids in zip(got.scores, got.ids):  # the candidates ranked by their true scores, then id
        assert all(a > b or (a == b and i < j) for a, b, i, j in zip(scores, scores[1:], ids, ids[1:]))
    # an item scores the same whether the search was filtered (exact over the allowed items) or not
    cams = [0, 1]
    filtered = s.search(queries, 10, cameras=cams)
    shared = 0
    for q in range(len(queries)):
        plain = dict(zip(got.ids[q].tolist(), got.scores[q].tolist()))
        for i, score in zip(filtered.ids[q].tolist(), filtered.scores[q].tolist()):
            if i in plain:
                assert plain[i] == score, (q, i)
                shared += 1
    assert shared > 100


def test_refine_over_every_item_ranks_exactly_with_the_tie_rule(tmp_path, feats):
    twins = np.concatenate([feats[:300], feats[:300]])  # item i and i + 300 tie on every query
    s = GalleryStore.create(tmp_path / "st", twins, make_rows(600), factory="IVF16,PQ4x4", seed=0, refine=60)
    got = s.search(feats[:40], 10, search_params={"nprobe": 16})  # 600 candidates: every item
    exact = s.exact_search(feats[:40], 10)
    np.testing.assert_array_equal(got.ids, exact.ids)
    np.testing.assert_allclose(got.scores, exact.scores, rtol=1e-5, atol=1e-6)
    assert (got.ids[:, 0] == np.arange(40)).all() and (got.ids[:, 1] == np.arange(40) + 300).all()


def test_refine_with_fewer_items_than_k_returns_every_item(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:3], make_rows(3), factory="HNSW8", refine=4)
    got = s.search(feats[:2], 5)  # k is cut to the 3 items
    assert got.ids.shape == (2, 3) and np.isfinite(got.scores).all()
    assert sorted(got.ids[0].tolist()) == [0, 1, 2]


def test_an_opened_store_maps_its_vectors_instead_of_reading_them(tmp_path, feats):
    GalleryStore.create(tmp_path / "st", feats, make_rows(N), factory="Flat")
    s = GalleryStore.open(tmp_path / "st")
    assert all(isinstance(seg.vectors, np.memmap) and not seg.vectors.flags.writeable for seg in s.segments)
    s.add(feats[5:10], make_rows(5, start=N))
    assert all(isinstance(seg.vectors, np.memmap) and not seg.vectors.flags.writeable for seg in s.segments)
    assert s.vectors.shape == (N + 5, D) and len(s.segments) == 2


def test_an_update_from_a_stale_store_object_is_refused(tmp_path, feats):
    GalleryStore.create(tmp_path / "st", feats[:100], make_rows(100), factory="Flat")
    first, second = GalleryStore.open(tmp_path / "st"), GalleryStore.open(tmp_path / "st")
    first.add(feats[100:105], make_rows(5, start=100))
    for update in (lambda: second.add(feats[105:110], make_rows(5, start=105)),
                   lambda: second.remove([0]),
                   lambda: second.verify(sample=10)):
        with pytest.raises(GalleryStoreError, match="changed on disk since it was opened"):
            update()
    again = GalleryStore.open(tmp_path / "st")
    assert again.ntotal == 105 and again.rows([0])[0] is not None
    again.add(feats[105:110], make_rows(5, start=105))
    assert GalleryStore.open(tmp_path / "st").ntotal == 110


def test_an_update_waits_for_another_processs_lock_then_gives_up(tmp_path, feats, monkeypatch):
    import subprocess
    import sys

    GalleryStore.create(tmp_path / "st", feats[:100], make_rows(100), factory="Flat")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(store_mod, "LOCK_TIMEOUT_S", 0.3)
        s = GalleryStore.open(tmp_path / "st")
        with pytest.raises(GalleryStoreError, match="another process is updating a store in"):
            s.add(feats[100:101], make_rows(1, start=100))
        assert GalleryStore.open(tmp_path / "st").ntotal == 100
    finally:
        holder.kill()
        holder.wait()
    s.add(feats[100:101], make_rows(1, start=100))  # the lock died with its process
    assert GalleryStore.open(tmp_path / "st").ntotal == 101


def test_a_filtered_search_of_a_stale_object_uses_only_the_items_it_holds(tmp_path, feats):
    GalleryStore.create(tmp_path / "st", feats[:100], make_rows(100), factory="Flat")
    stale = GalleryStore.open(tmp_path / "st")
    GalleryStore.open(tmp_path / "st").add(feats[100:150], make_rows(50, start=100))  # another process's update
    got = stale.search(feats[120:121], 5, cameras=range(CAMERAS))
    assert (got.ids[0] >= 0).all() and (got.ids[0] < 100).all()
    rows = np.searchsorted(stale.ids, got.ids[0])
    np.testing.assert_allclose(got.scores[0], stale.vectors[rows] @ feats[120], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# Erasure from a trained index: the template forgets the erased items too
# --------------------------------------------------------------------------


def _template_bytes(folder) -> bytes:
    return (folder / store_mod.TEMPLATE_FILE).read_bytes()


def _trained_template(factory: str, vectors: np.ndarray, seed: int = 0) -> bytes:
    import faiss

    template = store_mod._new_index(factory, vectors.shape[1])
    store_mod._train(template, vectors, factory, seed)
    return faiss.serialize_index(template).tobytes()


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,PQ8x4", "SQ8"])
def test_removing_a_training_item_trains_the_index_again_without_it(tmp_path, feats, factory):
    base = feats[:600].copy()
    base[7] = -base[8]  # an outlier: it shapes its IVF list's centroid, its PQ codewords, an SQ range end
    s = GalleryStore.create(tmp_path / "st", base, make_rows(600), factory=factory, seed=3)
    s.add(feats[600:700], make_rows(100, start=600))
    s.remove([7])
    kept = np.concatenate([base[:7], base[8:]])  # the items the store was trained on, less the erased one
    assert _template_bytes(tmp_path / "st") == _trained_template(factory, np.concatenate([kept, feats[600:700]]), seed=3)
    reopened = GalleryStore.open(tmp_path / "st")
    assert reopened.factory == factory and reopened.header["trained_below"] == 700
    found = reopened.search(feats[600:700], 1)
    assert not np.isin(found.ids, [7]).any()
    if factory == "IVF16,Flat":  # un-quantised: each kept item still finds itself under its own id
        assert (reopened.search(feats[600:700], 1, search_params={"nprobe": 16}).ids[:, 0] == np.arange(600, 700)).all()


def test_removing_an_item_the_index_was_not_trained_on_keeps_the_template(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:600], make_rows(600), factory="IVF16,Flat", seed=0)
    s.add(feats[600:700], make_rows(100, start=600))
    template = _template_bytes(tmp_path / "st")
    s.remove([650])
    assert _template_bytes(tmp_path / "st") == template and s.header["trained_below"] == 600
    # a store that does not record what it was trained on (an earlier version's) retrains on any removal
    header = dict(s.header)
    del header["trained_below"]
    s._commit_header(header)
    s.remove([651])
    assert _template_bytes(tmp_path / "st") != template and s.header["trained_below"] == 700


def test_too_few_items_left_to_train_again_make_the_store_exact(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:20], make_rows(20), factory="IVF16,Flat", seed=0)
    with pytest.warns(UserWarning, match="the 15 items left are too few to train 'IVF16,Flat' again.*now an exact 'Flat'"):
        s.remove([0, 1, 2, 3, 4])
    reopened = GalleryStore.open(tmp_path / "st")
    assert (reopened.factory, reopened.kind, reopened.ntotal) == ("Flat", "flat", 15)
    exact = np.argsort(-(feats[5:20] @ feats[5:20].T), axis=1, kind="stable")[:, :5] + 5
    np.testing.assert_array_equal(reopened.search(feats[5:20], 5).ids, exact)


def test_a_store_emptied_by_erasure_trains_again_on_its_next_items(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:50], make_rows(50), factory="SQ8", seed=0)
    s.remove(list(range(50)))
    assert s.ntotal == 0 and not GalleryStore.open(tmp_path / "st").template.is_trained
    new = s.add(feats[100:160], make_rows(60, start=100))
    np.testing.assert_array_equal(new, np.arange(50, 110))
    assert _template_bytes(tmp_path / "st") == _trained_template("SQ8", feats[100:160])
    assert s.header["trained_below"] == 110 and GalleryStore.open(tmp_path / "st").ntotal == 60


def test_an_erased_item_that_was_a_centroid_leaves_no_byte(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats[:40], make_rows(40), factory="IVF16,Flat", seed=0)
    template = _template_bytes(tmp_path / "st")
    centroids = [i for i in range(40) if feats[i].tobytes() in template]
    assert centroids, "with 40 items some IVF list holds one item, whose vector is then its centroid"
    s.remove([centroids[0]])
    for f in (tmp_path / "st").iterdir():
        assert feats[centroids[0]].tobytes() not in f.read_bytes(), f.name
