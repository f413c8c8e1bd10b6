"""Gallery store integrity: erasure in fast-scan indexes, the features door, flat indexes, ties, header fields, ids.

* a removal from a fast-scan (``PQ<m>x4fs``) segment writes the index a fresh
  build without the removed items writes: no byte of their codes remains;
* ``create``/``add`` refuse features that are not L2-normalised (scores are
  cosines) and NaN or infinity in the header's ``meta``;
* ``search(flat_index=...)`` refuses an index that does not hold the store's
  current vectors, and what ``flat_faiss_index`` returned stays valid;
* a Flat store's search gives the same ids and scores for a query alone, in a
  batch (FAISS's BLAS path), with a filter every item passes, or through its flat index;
* ``open`` refuses damaged header fields, and an update never writes onto a live file;
* ids are integers, filters have their shapes: anything else is a one-line error.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import warnings
from pathlib import Path

import faiss
import numpy as np
import pytest

from fedreid.retrieval.store import GalleryStore, GalleryStoreError

D = 8


def unit(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"path": f"/gallery/img_{start + i:05d}.jpg", "camera": (start + i) % 3 + 1} for i in range(n)]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- erasure from fast-scan indexes ---------------------------------------------


@pytest.mark.parametrize("factory", ["IVF4,PQ4x4fs", "OPQ4,IVF2,PQ4x4fs"])
@pytest.mark.parametrize("erased", [[265], [258], [256, 265]], ids=["list-tail", "mid-list", "two"])
def test_a_fast_scan_removal_writes_the_index_of_a_store_that_never_held_the_item(tmp_path, factory, erased):
    x = unit(266, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = GalleryStore.create(tmp_path / "st", x[:256], rows(256), factory=factory, seed=0, refine=300)
    store.add(x[256:], rows(10, 256))  # a second segment of items the index was not trained on
    assert store.remove(erased).tolist() == erased
    kept = np.setdiff1d(np.arange(256, 266), erased)
    seg = store.segments[1]
    np.testing.assert_array_equal(seg.ids, kept)
    written = (store.folder / seg.files["index"]).read_bytes()
    never_held = faiss.deserialize_index(faiss.serialize_index(store.template))
    never_held.add_with_ids(x[kept], kept)
    # FAISS's own removal keeps the freed slots of a code block (the erased item's code among them).
    assert written == bytes(faiss.serialize_index(never_held))
    found = store.search(x[kept], 1, search_params={"nprobe": 4})  # refine: every item re-scored exactly
    np.testing.assert_array_equal(found.ids[:, 0], kept)


# -- the features door -----------------------------------------------------------


def test_create_and_add_refuse_features_that_are_not_l2_normalised(tmp_path):
    x = unit(12, seed=2)
    bad = x.copy()
    bad[3] *= 1.01
    with pytest.raises(GalleryStoreError, match=r"features row 3 has L2 norm 1\.01 .*L2-normalised"):
        GalleryStore.create(tmp_path / "st", bad, rows(12))
    assert not (tmp_path / "st").exists()
    store = GalleryStore.create(tmp_path / "st", x[:10], rows(10))
    before = json.loads((store.folder / "header.json").read_text())
    with pytest.raises(GalleryStoreError, match=r"features row 1 has L2 norm 0\.5 "):
        store.add(np.stack([x[10], x[11] * 0.5]), rows(2, 10))
    with pytest.raises(GalleryStoreError, match=r"features row 0 has L2 norm 0 "):
        store.add(np.zeros((1, D), np.float32), rows(1, 10))
    assert json.loads((store.folder / "header.json").read_text()) == before
    assert GalleryStore.open(store.folder).ntotal == 10
    # Features extracted in fp16 or bf16, then normalised in float32, pass.
    y = unit(64, d=512, seed=3)
    half = y.astype(np.float16).astype(np.float32)
    brain = (y.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bfloat16's 8-bit mantissa
    for name, feats in (("fp16", half), ("bf16", brain)):
        feats = feats / np.linalg.norm(feats, axis=1, keepdims=True)
        assert GalleryStore.create(tmp_path / name, feats, rows(64)).ntotal == 64


# -- header meta ---------------------------------------------------------------


@pytest.mark.parametrize("meta,key", [({"calibration": math.nan}, "calibration"),
                                      ({"scale": {"low": -math.inf}}, "low"),
                                      ({"ranges": [1.0, math.inf]}, "ranges")])
def test_non_finite_meta_is_refused_at_every_door(tmp_path, meta, key):
    x = unit(12, seed=4)
    with pytest.raises(GalleryStoreError, match=rf"^meta\[\S*'{key}'\S* is -?(nan|inf): .*finite"):
        GalleryStore.create(tmp_path / "new", x[:10], rows(10), meta=meta)
    assert not (tmp_path / "new").exists()
    store = GalleryStore.create(tmp_path / "st", x[:10], rows(10))
    with pytest.raises(GalleryStoreError, match=rf"^meta\[\S*'{key}'\S* is -?(nan|inf): .*finite"):
        store.add(x[10:11], rows(1, 10), meta=meta)
    with pytest.raises(GalleryStoreError, match=rf"^meta\[\S*'{key}'\S* is -?(nan|inf): .*finite"):
        store.remove([0], meta=meta)
    assert GalleryStore.open(store.folder).ntotal == 10


# -- flat indexes ----------------------------------------------------------------


def test_search_refuses_a_flat_index_that_is_not_the_stores_current_one(tmp_path):
    x = unit(12, seed=6)
    store = GalleryStore.create(tmp_path / "st", x[:10], rows(10))
    before = store.flat_faiss_index()
    copy_before = faiss.clone_index(before)  # what a caller moves to a GPU once
    store.remove([0])
    q = x[5:6]
    for stale in (before, copy_before):
        with pytest.raises(GalleryStoreError, match="flat_index .*flat_faiss_index"):
            store.search(q, 3, flat_index=stale)
    other = GalleryStore.create(tmp_path / "other", unit(9, seed=7), rows(9))
    for foreign in (other.flat_faiss_index(), faiss.clone_index(other.flat_faiss_index())):
        with pytest.raises(GalleryStoreError, match="flat_index .*(another|not to store|not the stored)"):
            store.search(q, 3, flat_index=foreign)
    # Same item count as before the update (one removed, one added): the copy's rows are not the store's.
    with pytest.raises(GalleryStoreError, match="flat_index row .* is not the stored vector"):
        store2 = GalleryStore.create(tmp_path / "st2", x[:10], rows(10))
        taken = faiss.clone_index(store2.flat_faiss_index())
        store2.remove([3])
        store2.add(x[10:11], rows(1, 10))
        store2.search(q, 3, flat_index=taken)
    plain = store.search(q, 3)
    for current in (store.flat_faiss_index(), faiss.clone_index(store.flat_faiss_index())):
        got = store.search(q, 3, flat_index=current)
        np.testing.assert_array_equal(got.ids, plain.ids)
        np.testing.assert_array_equal(got.scores, plain.scores)
    assert plain.ids[0, 0] == 5


def test_a_flat_index_stays_valid_after_the_update_that_replaces_it(tmp_path):
    x = unit(12, seed=8)
    store = GalleryStore.create(tmp_path / "st", x[:6], rows(6))  # one segment: its own index is returned
    n = store.ntotal
    taken = store.flat_faiss_index()
    store.remove([1])
    store.add(x[10:12], rows(2, 10))
    gc.collect()
    assert (taken.ntotal, taken.d) == (n, D)  # not memory an update freed
    np.testing.assert_array_equal(taken.reconstruct(n - 1), x[n - 1])


# -- ties in batched exact search ------------------------------------------------------


def test_a_flat_store_scores_a_query_alike_alone_in_a_batch_filtered_or_on_its_flat_index(tmp_path):
    d, n = 2048, 3000
    g = unit(n, d=d, seed=1)
    copies = np.arange(0, n, 97)  # 31 items holding the same vector
    g[copies] = g[0]
    store = GalleryStore.create(tmp_path / "st", g[:2000], rows(2000))
    store.add(g[2000:], rows(1000, 2000))  # copies in two segments
    q = unit(64, d=d, seed=2) * 0.2 + g[0] * 0.8
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    k = 40
    batch = store.search(q, k)  # 64 queries: FAISS's BLAS path
    for r in range(q.shape[0]):
        found = [int(i) for i in batch.ids[r] if i in set(copies.tolist())]
        assert found == copies.tolist(), f"query {r}: equal vectors out of id order"
        assert len({float(s) for i, s in zip(batch.ids[r], batch.scores[r]) if i in set(copies.tolist())}) == 1
    everything = store.search(q, k, cameras=[1, 2, 3])
    on_index = store.search(q, k, flat_index=store.flat_faiss_index())
    for other in (everything, on_index):
        np.testing.assert_array_equal(other.ids, batch.ids)
        np.testing.assert_array_equal(other.scores, batch.scores)
    for r in (0, 17, 63):
        alone = store.search(q[r : r + 1], k)
        np.testing.assert_array_equal(alone.ids[0], batch.ids[r])
        np.testing.assert_array_equal(alone.scores[0], batch.scores[r])
    exact = store.exact_search(q, k)
    np.testing.assert_array_equal(exact.ids, batch.ids)
    np.testing.assert_array_equal(exact.scores, batch.scores)


# -- header fields and new files ---------------------------------------------------------


def _edited(folder: Path, **fields) -> None:
    header = json.loads((folder / "header.json").read_text())
    header.update(fields)
    (folder / "header.json").write_text(json.dumps(header))


@pytest.mark.parametrize("fields,named", [({"next_segment": 0}, "next_segment"), ({"next_segment": -1}, "next_segment"),
                                          ({"trained_below": "abc"}, "trained_below"),
                                          ({"trained_below": True}, "trained_below"),
                                          ({"seed": 1.5}, "seed"), ({"meta": ["x"]}, "meta")])
def test_open_refuses_a_damaged_header_field_naming_it(tmp_path, fields, named):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = GalleryStore.create(tmp_path / "st", unit(20, seed=9), rows(20), factory="IVF2,Flat")
    _edited(store.folder, **fields)
    with pytest.raises(GalleryStoreError, match=rf"header\.json .*{named}"):
        GalleryStore.open(store.folder)


def test_an_update_never_writes_a_new_segment_onto_a_live_file(tmp_path):
    x = unit(30, seed=10)
    store = GalleryStore.create(tmp_path / "st", x[:20], rows(20))
    live = {p.name: (p.stat().st_ino, sha(p)) for p in store.folder.glob("seg-*")}
    # A rewound next_segment that got past open (the object was opened before the header was damaged).
    store.header = dict(store.header, next_segment=0)
    (store.folder / "header.json").write_text(json.dumps(store.header, indent=2))
    with pytest.raises(GalleryStoreError, match=r"seg-000000\.\S+ already exists.*never overwrites"):
        store.add(x[20:30], rows(10, 20))
    assert {p.name: (p.stat().st_ino, sha(p)) for p in store.folder.glob("seg-*")} == live
    assert [p.name for p in tmp_path.iterdir()] == ["st"]  # the staging folder is gone


# -- ids and filters -------------------------------------------------------------------


@pytest.mark.parametrize("value", [3.7, 3.0, True, np.float32(5.0), b"3", None, np.bool_(True)],
                         ids=["float", "integral-float", "bool", "np-float", "bytes", "none", "np-bool"])
def test_remove_and_rows_refuse_an_id_that_is_not_an_integer(tmp_path, value):
    store = GalleryStore.create(tmp_path / "st", unit(10, seed=11), rows(10))
    with pytest.raises(GalleryStoreError, match=r"remove: .* is not an item id \(expected an integer\)"):
        store.remove([value])
    with pytest.raises(GalleryStoreError, match=r"rows: .* is not an item id \(expected an integer\)"):
        store.rows([value])
    assert store.ntotal == 10 and GalleryStore.open(store.folder).ntotal == 10


def test_integer_ids_of_any_kind_still_work(tmp_path):
    store = GalleryStore.create(tmp_path / "st", unit(10, seed=12), rows(10))
    assert [r and r["id"] for r in store.rows(np.array([2, -1, 99]))] == [2, None, None]
    assert [r["id"] for r in store.rows([np.int32(4), 5])] == [4, 5]
    assert store.remove([np.int64(3), 4, "/gallery/img_00006.jpg"]).tolist() == [3, 4, 6]
    with pytest.raises(GalleryStoreError, match="remove: expected a list"):
        store.remove("/gallery/img_00007.jpg")


@pytest.mark.parametrize("kwargs,field", [({"time_window": (5,)}, "time_window"), ({"time_window": 5}, "time_window"),
                                          ({"cameras": 5}, "cameras"), ({"sites": 7}, "sites"),
                                          ({"cameras": b"12"}, "cameras")])
def test_search_refuses_a_filter_of_the_wrong_shape_naming_it(tmp_path, kwargs, field):
    store = GalleryStore.create(tmp_path / "st", unit(10, seed=13), rows(10))
    with pytest.raises(GalleryStoreError, match=rf"^{field}( filter)?: expected") as caught:
        store.search(unit(1, seed=14), 3, **kwargs)
    assert "\n" not in str(caught.value)
    assert store.search(unit(1, seed=14), 3, time_window=(None, 2e9), cameras=[1, 2]).ids.shape == (1, 3)
