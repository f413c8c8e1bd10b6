"""The segmented gallery store (issue 23 §4): updates cost what they change, reopening hashes only new files.

An add writes only its new segment files and the manifest (the kept segments
are hard links: same inode, same bytes); a removal rewrites only the segments
holding the removed items and leaves no byte of them in the folder; results
equal a store built in one go; a reopen hashes no unchanged file; a kill before
any write step of an update leaves the previous store or the new one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedreid.retrieval import store as store_mod
from fedreid.retrieval import store_files
from fedreid.retrieval.store import GalleryStore

D = 16
REPO = Path(__file__).resolve().parents[2]


def unit(n: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"path": f"/gallery/secret_{start + i:05d}.jpg", "camera": (start + i) % 3} for i in range(n)]


def file_states(folder: Path) -> dict[str, tuple]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(store_mod, "SEGMENT_ITEMS", 100)


def test_an_add_writes_only_its_segment_and_the_manifest(tmp_path, small_segments):
    feats = unit(520)
    folder = tmp_path / "st"
    GalleryStore.create(folder, feats[:500], rows(500))
    store = GalleryStore.open(folder)
    assert len(store.segments) == 5
    before = file_states(folder)
    total = sum(size for _, _, size in before.values())
    store.add(feats[500:], rows(20, start=500))
    after = file_states(folder)
    new = sorted(set(after) - set(before))
    assert new == [f"seg-000005{suffix}" for suffix in (".faiss", ".ids.npy", ".sqlite", ".vectors.npy")]
    for name, state in before.items():
        if name not in ("header.json", ".fedreid-index.json"):  # the manifest and the folder's marker
            assert after[name] == state, f"{name} was rewritten by an add"
    written = sum(after[n][2] for n in new) + after["header.json"][2] + after[".fedreid-index.json"][2]
    assert written < 0.15 * total, (written, total)
    reopened = GalleryStore.open(folder)
    assert reopened.ntotal == 520 and reopened.rows([510])[0]["path"] == "/gallery/secret_00510.jpg"


def test_a_remove_rewrites_only_the_segments_it_hits_and_leaves_no_trace(tmp_path, small_segments):
    feats = unit(500)
    folder = tmp_path / "st"
    store = GalleryStore.create(folder, feats, rows(500))
    before = file_states(folder)
    gone = [120, 150, 199]  # all in the second segment
    store.remove([gone[0], "/gallery/secret_00150.jpg", gone[2]])
    after = file_states(folder)
    assert not any(name.startswith("seg-000001.") for name in after)
    assert sorted(set(after) - set(before)) == [f"seg-000005{s}" for s in (".faiss", ".ids.npy", ".sqlite", ".vectors.npy")]
    for name, state in before.items():
        if name.startswith("seg-") and not name.startswith("seg-000001."):
            assert after[name] == state, f"{name} was rewritten by a removal that does not hit it"
    for f in folder.iterdir():
        data = f.read_bytes()
        for i in gone:
            assert feats[i].tobytes() not in data, f"{f.name} keeps the vector of {i}"
            assert f"secret_{i:05d}".encode() not in data, f"{f.name} keeps the path of {i}"
    reopened = GalleryStore.open(folder)
    assert reopened.ntotal == 497 and reopened.rows(gone) == [None] * 3
    assert reopened.search(feats[[121]], 1).ids[0, 0] == 121
    # a removal that empties a segment drops it
    reopened.remove(list(range(0, 100)))
    assert not any(p.name.startswith("seg-000000.") for p in folder.iterdir())
    assert GalleryStore.open(folder).ntotal == 397


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "IVF8,PQ4x4", "IVF8,PQ4x4fs", "HNSW16", "PQ4x4", "SQ8",
                                     "OPQ4,IVF8,PQ4x4"])
def test_updated_store_searches_as_one_built_in_one_go(tmp_path, small_segments, factory):
    """Ids and scores equal those of one index over the same items and training, re-scored exactly.

    For every kind, quantised ones included: each segment scores an item as the
    one-go index does (same template; every list probed), so the only freedom is
    which of several items tying at place k FAISS keeps, and the store keeps the
    lower ids. The reference therefore ranks all items of the one-go index by
    (score desc, id asc) (its own top-k cut may keep a higher id: fast-scan
    scores are quantised, so such ties happen), and, as the store does, ranks
    those k candidates again by their inner products with the stored vectors.
    """
    feats = unit(700, seed=1)
    queries = unit(30, seed=2)
    store = GalleryStore.create(tmp_path / "st", feats[:450], rows(450), factory=factory, seed=0)
    store.add(feats[450:600], rows(150, start=450))
    store.remove([3, 101, 455, 599])
    store.add(feats[600:], rows(100, start=600))
    store = GalleryStore.open(tmp_path / "st")
    assert len(store.segments) > 4
    keep = np.setdiff1d(np.arange(700), [3, 101, 455, 599])
    params = {"nprobe": 8} if store.kind == "ivf" else {"efSearch": 256} if store.kind == "hnsw" else {}
    got = store.search(queries, 10, search_params=params)
    if factory == "Flat":
        ref = GalleryStore.create(tmp_path / "one", feats[keep], rows(len(keep))).search(queries, 10)
        ref_ids = keep[ref.ids]
        ref_scores = ref.scores
    else:  # the same training (the store's template), all items in one index, ranked by the store's rule
        one = store_mod._rebuilt_index(store.template, feats[keep], keep)
        plain_pq = not store_mod._accepts_search_parameters(store.template)  # a plain PQ takes no parameters
        search_params = None if plain_pq else store_mod._search_params(store.kind, dict(params))
        # every item's score (nprobe 8 of 8 lists, a PQ or SQ scan all items): FAISS keeps an arbitrary one of
        # items tying at place k, the store the lower id (fast-scan scores are quantised: ties happen)
        scores, ids = one.search(queries, len(keep), params=search_params)
        assert (ids >= 0).all() if store.kind != "hnsw" else (ids >= 0).sum(1).min() >= 10
        order = np.lexsort((ids, -scores), axis=-1)[:, :10]
        candidates = np.take_along_axis(ids, order, 1)
        true = np.einsum("qkd,qd->qk", feats[candidates], queries)
        again = np.lexsort((candidates, -true), axis=-1)
        ref_ids, ref_scores = np.take_along_axis(candidates, again, 1), np.take_along_axis(true, again, 1)
    np.testing.assert_array_equal(got.ids, ref_ids)
    np.testing.assert_allclose(got.scores, ref_scores, rtol=1e-5, atol=1e-6)
    exact = store.exact_search(queries, 10)
    brute = queries @ feats[keep].T
    np.testing.assert_array_equal(exact.ids, keep[np.argsort(-brute, axis=1, kind="stable")[:, :10]])
    filtered = store.search(queries, 5, cameras=[1])
    assert (np.asarray([r["camera"] for r in store.rows(filtered.ids.ravel())]) == 1).all()


@pytest.mark.parametrize("factory", ["HNSW16", "IVF4,Flat", "SQ8"])
def test_items_tying_at_place_k_are_cut_by_id(tmp_path, small_segments, factory):
    feats = unit(260, seed=3)
    copies = np.sort(np.random.default_rng(4).permutation(260)[:40])
    feats[copies] = feats[copies[0]]  # 40 items with the same vector: equal scores for any query
    store = GalleryStore.create(tmp_path / "st", feats, rows(260), factory=factory)
    assert len(store.segments) == 3
    got = store.search(feats[copies[:1]], 5, search_params={"efSearch": 16} if store.kind == "hnsw" else None)
    assert got.ids[0].tolist() == copies[:5].tolist()  # FAISS alone may keep any 5 of the 40 (HNSW16 does)
    assert np.unique(got.scores[0]).size == 1


def test_a_stale_store_whose_table_was_compacted_away_says_to_reopen(tmp_path, small_segments):
    feats = unit(300)
    folder = tmp_path / "st"
    GalleryStore.create(folder, feats, rows(300))
    stale = GalleryStore.open(folder)
    GalleryStore.open(folder).remove([150])  # another object (process): seg-000001 is rewritten as seg-000003
    assert not (folder / "seg-000001.sqlite").exists()
    assert stale.rows([5])[0]["path"] == "/gallery/secret_00005.jpg"  # a kept segment still answers
    for call in (lambda: stale.rows([160]), lambda: stale.search(feats[:2], 3, cameras=[1]),
                 lambda: stale.find_paths(["/gallery/secret_00007.jpg"])):
        with pytest.raises(store_mod.GalleryStoreError) as caught:
            call()
        message = str(caught.value)
        assert "changed on disk" in message and "seg-000001.sqlite" in message and "open the store again" in message
        assert "\n" not in message and "unable to open" not in message
    with pytest.raises(store_mod.GalleryStoreError, match="changed on disk since it was opened"):
        stale.add(unit(1, seed=8), [{"path": "/gallery/late.jpg"}])  # an update from it is refused as before
    assert GalleryStore.open(folder).rows([160])[0]["path"] == "/gallery/secret_00160.jpg"


def test_a_reopen_hashes_no_unchanged_file(tmp_path, small_segments, monkeypatch):
    feats = unit(400)
    folder = tmp_path / "st"
    GalleryStore.create(folder, feats[:300], rows(300))
    old = 1_000_000_000  # files written long before they are verified: not "racy"
    for p in folder.iterdir():
        os.utime(p, (old, old))
    hashed: list[str] = []
    real = store_files.sha256_file
    monkeypatch.setattr(store_files, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    monkeypatch.setattr(store_files, "check_recorded_file", _counting(store_files.check_recorded_file, hashed))
    first = GalleryStore.open(folder)
    assert len(hashed) == 1 + 3 * 4  # template + 3 segments x 4 files: verified once, when first read
    hashed.clear()
    second = GalleryStore.open(folder, previous=first)
    assert hashed == [] and second.segments[0].index is first.segments[0].index  # taken over as they are
    second.add(feats[300:], rows(100, start=300))
    assert sorted(hashed) == sorted(f"seg-000003{s}" for s in (".faiss", ".ids.npy", ".sqlite", ".vectors.npy"))
    hashed.clear()
    for p in folder.glob("seg-000003*"):
        os.utime(p, (old, old))  # (changes the mtime: those four are hashed again once)
    GalleryStore.open(folder)
    assert sorted(hashed) == sorted(f"seg-000003{s}" for s in (".faiss", ".ids.npy", ".sqlite", ".vectors.npy"))
    hashed.clear()
    third = GalleryStore.open(folder)
    assert hashed == []
    third.check_files()  # the full check hashes everything
    assert len(hashed) == 1 + 4 * 4
    # damage that keeps the size and the modification time is not seen by a reopen, but by the full check
    path = folder / "seg-000001.vectors.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(store_mod.GalleryStoreError, match="does not match the SHA-256"):
        third.check_files()


def _counting(check, hashed):
    def counted(path, *args, **kwargs):
        hashed.append(Path(path).name)
        return check(path, *args, **kwargs)
    return counted


def test_a_recently_changed_file_is_hashed_again(tmp_path):
    folder = tmp_path / "st"
    GalleryStore.create(folder, unit(50), rows(50))
    GalleryStore.open(folder)
    path = folder / "seg-000000.vectors.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, within the racy window of its verification
    with pytest.raises(store_mod.GalleryStoreError, match="does not match the SHA-256"):
        GalleryStore.open(folder)


def test_a_version_3_store_opens_searches_and_is_converted_by_its_first_update(tmp_path):
    feats = unit(60)
    folder = tmp_path / "st"
    GalleryStore.create(folder, feats[:50], rows(50))
    # the version-3 layout of the same store: one set of files under the old names
    header = json.loads((folder / "header.json").read_text())
    for role, old in zip(store_mod.SEGMENT_SUFFIXES.values(), store_mod.LEGACY_FILES):
        os.replace(folder / f"seg-000000{role}", folder / old)
    (folder / "template.faiss").unlink()
    legacy = {k: v for k, v in header.items() if k not in ("segments", "next_segment")}
    legacy["version"] = 3
    legacy["files"] = {old: header["files"][f"seg-000000{role}"]
                       for role, old in zip(store_mod.SEGMENT_SUFFIXES.values(), store_mod.LEGACY_FILES)}
    (folder / "header.json").write_text(json.dumps(legacy))
    v3 = GalleryStore.open(folder)
    assert v3.search(feats[:5], 1).ids[:, 0].tolist() == [0, 1, 2, 3, 4]
    vector_inode = (folder / "vectors.npy").stat().st_ino
    v3.add(feats[50:], rows(10, start=50))
    converted = json.loads((folder / "header.json").read_text())
    assert converted["version"] == 4 and [e["name"] for e in converted["segments"]] == ["seg-000000", "seg-000001"]
    assert not (folder / "vectors.npy").exists() and (folder / "seg-000000.vectors.npy").stat().st_ino == vector_inode
    again = GalleryStore.open(folder)
    assert again.ntotal == 60 and again.search(feats[55:56], 1).ids[0, 0] == 55 and again.rows([3])[0]["camera"] == 0
    (folder / "header.json").write_text(json.dumps(dict(converted, version=2)))
    with pytest.raises(store_mod.GalleryStoreError, match="rebuild the store with"):
        GalleryStore.open(folder)


def test_many_adds_are_merged_into_at_most_max_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_SEGMENTS", 4)
    feats = unit(80)
    store = GalleryStore.create(tmp_path / "st", feats[:10], rows(10))
    for start in range(10, 80, 10):
        store.add(feats[start : start + 10], rows(10, start=start))
    again = GalleryStore.open(tmp_path / "st")
    assert len(again.segments) == 4 and again.ntotal == 80
    assert again.search(feats, 1).ids[:, 0].tolist() == list(range(80))
    assert [r["path"] for r in again.rows(range(80))] == [f"/gallery/secret_{i:05d}.jpg" for i in range(80)]


# --------------------------------------------------------------------------
# Kills at each write step of an update
# --------------------------------------------------------------------------

#: Runs an update of the store in ``argv[1]``, SIGKILLing itself before the n-th write step (``argv[2]``, 0: none):
#: os.link, os.replace, faiss.write_index, numpy.save, sqlite3.connect, os.unlink, os.rmdir. Logs each step.
KILLER = textwrap.dedent("""
    import os, signal, sqlite3, sys
    import faiss, numpy as np
    from fedreid.retrieval import store as store_mod
    folder, nth, log, action = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    count = [0]
    def step(name, real):
        def wrapped(*args, **kwargs):
            count[0] += 1
            with open(log, "a") as fh:
                fh.write(f"{count[0]} {name}\\n")
            if count[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return wrapped
    store_mod.SEGMENT_ITEMS = 100  # as the test's stores: several segments, some kept (linked), some rewritten
    store = store_mod.GalleryStore.open(folder)
    os.link, os.replace, os.unlink, os.rmdir = (step(n, f) for n, f in
        (("link", os.link), ("replace", os.replace), ("unlink", os.unlink), ("rmdir", os.rmdir)))
    store_mod.faiss = type("F", (), {k: getattr(faiss, k) for k in dir(faiss) if not k.startswith("__")})
    store_mod.faiss.write_index = staticmethod(step("write_index", faiss.write_index))
    np.save = step("np.save", np.save)
    sqlite3.connect = step("sqlite3.connect", sqlite3.connect)
    feats = np.random.default_rng(5).standard_normal((20, 16)).astype(np.float32)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    if action == "add":
        store.add(feats, [{"path": f"/gallery/new_{i}.jpg"} for i in range(20)])
    else:
        store.remove([3, 120])
""")


def _run_killer(work: Path, nth: int, action: str) -> tuple[bool, list[str]]:
    script, log = work / "killer.py", work / "steps.log"
    script.write_text(KILLER)
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(work / "st"), str(nth), str(log), action],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    killed = proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0, proc.stderr[-2000:]
    steps = log.read_text().splitlines() if log.is_file() else []
    script.unlink()
    log.unlink(missing_ok=True)
    return killed, steps


@pytest.mark.parametrize("action", ["add", "remove"])
def test_a_kill_at_each_write_step_leaves_the_previous_or_the_new_store(tmp_path, small_segments, action):
    feats = unit(300)
    reference = tmp_path / "reference"
    reference.mkdir()
    GalleryStore.create(reference / "st", feats, rows(300))
    killed, steps = _run_killer(reference, 0, action)
    assert not killed and len(steps) >= 8, steps
    kinds = {s.split()[1] for s in steps}
    assert {"link", "replace", "write_index", "np.save", "sqlite3.connect"} <= kinds, kinds
    previous = np.arange(300)
    new = GalleryStore.open(reference / "st").ids
    for nth in range(1, len(steps) + 1):
        work = tmp_path / f"kill{nth}"
        work.mkdir()
        GalleryStore.create(work / "st", feats, rows(300))
        killed, _ = _run_killer(work, nth, action)
        assert killed, f"step {nth} was not reached"
        store = GalleryStore.open(work / "st")  # cleans up what the kill left
        assert not list(work.glob(".st.*")), f"{steps[nth - 1]}: leftovers stay after the next open"
        ids = store.ids
        assert np.array_equal(ids, previous) or np.array_equal(ids, new), f"{steps[nth - 1]}: a mix"
        assert store.search(feats[[5]], 1).ids[0, 0] == 5 and store.rows([5])[0]["path"] == "/gallery/secret_00005.jpg"
        if action == "remove":
            if np.array_equal(ids, previous):
                store.remove([3, 120])
            for f in (f for f in work.rglob("*") if f.is_file()):
                data = f.read_bytes()
                assert feats[3].tobytes() not in data and b"secret_00120" not in data, f"{steps[nth - 1]}: {f}"
        else:
            store.add(unit(1, seed=9), [{"path": "/gallery/after.jpg"}])  # the store still updates


def test_an_open_that_meets_another_processs_save_starts_again(tmp_path, monkeypatch):
    """The first read finds a segment gone (the store was saved meanwhile): the open starts again and gets the new save."""
    folder = tmp_path / "store"
    GalleryStore.create(folder, unit(40), rows(40))
    real_read = store_mod._read_segment
    calls = []

    def read_during_a_save(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:  # another writer saves now; this read then misses its files
            other = GalleryStore.open(folder)
            other.add(unit(5, seed=1), rows(5, start=40))
            raise FileNotFoundError(folder / "seg-000000.ids.npy")
        return real_read(*args, **kwargs)

    monkeypatch.setattr(store_mod, "_read_segment", read_during_a_save)
    store = GalleryStore.open(folder)
    assert store.ntotal == 45 and len(calls) >= 2
    assert [r["path"] for r in store.rows(store.ids)][-1] == "/gallery/secret_00044.jpg"


def test_an_open_of_a_damaged_store_is_not_repeated(tmp_path, monkeypatch):
    folder = tmp_path / "store"
    GalleryStore.create(folder, unit(40), rows(40))
    vectors = next(folder.glob("seg-*.vectors.npy"))
    vectors.write_bytes(vectors.read_bytes()[:-4] + b"\0\0\0\1")  # same size, other bytes
    store_files_calls = []
    real_check = store_mod._check_file
    monkeypatch.setattr(store_mod, "_check_file",
                        lambda *a, **k: store_files_calls.append(a[1]) or real_check(*a, **k))
    with pytest.raises(store_files.GalleryStoreError, match="vectors.npy"):
        GalleryStore.open(folder)
    assert store_files_calls.count(vectors.name) == 1  # the header did not change: raised at once
