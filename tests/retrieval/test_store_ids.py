"""Gallery store ids after removals: every index kind the store accepts keeps each item's id and path."""

from __future__ import annotations

import warnings

import faiss
import numpy as np
import pytest

from fedreid.retrieval import store as store_mod
from fedreid.retrieval.store import GalleryStore

N, D = 600, 16
#: A refine factor whose candidates are every item: compressed codes then rank exactly.
FULL = 2 * N

#: One factory per index class the store accepts (flat, IVF with each code kind and quantizer, HNSW with
#: each storage, flat codes, pre-transforms); compressed ones re-score every item exactly (refine).
KINDS = [
    ("Flat", 1), ("IVF16,Flat", 1), ("IVF16,PQ4x4", FULL), ("IVF16,SQ8", FULL), ("IVF16,PQ4x4fs", FULL),
    ("OPQ4,IVF16,PQ4x4", FULL), ("IVF16_HNSW8,Flat", 1), ("PCA8,IVF16,Flat", FULL), ("HNSW16", 1),
    ("HNSW16,SQ8", FULL), ("PQ4x4", FULL), ("SQ8", FULL),
]


def clustered(n: int, d: int, seed: int, centers: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centers, d)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + 0.35 * rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"path": f"/gallery/img_{start + i:05d}.jpg", "camera": (start + i) % 4} for i in range(n)]


def _wide_search(store: GalleryStore) -> dict:
    """Search parameters that look everywhere (every IVF list, a wide HNSW beam): what is left is the ids."""
    if store.kind == "ivf":
        return {"nprobe": int(store_mod._inner_ivf(store.template).nlist)}
    return {"efSearch": 256} if store.kind == "hnsw" else {}


def _check_every_item_finds_itself(store: GalleryStore, vectors_by_id: dict[int, np.ndarray]) -> None:
    ids = store.ids
    queries = np.stack([vectors_by_id[int(i)] for i in ids])
    found = store.search(queries, 1, search_params=_wide_search(store))
    wrong = ids[found.ids[:, 0] != ids]
    assert wrong.size == 0, f"{store.factory}: {wrong.size} of {ids.size} items come back under another id, e.g. {wrong[:5]}"
    got = store.rows(found.ids[:, 0])
    assert [r["path"] for r in got] == [f"/gallery/img_{int(i):05d}.jpg" for i in ids]
    np.testing.assert_allclose(found.scores[:, 0], 1.0, atol=2e-3 if store.search_params.get("refine") else 0.2)


@pytest.mark.parametrize("factory,refine", KINDS, ids=[k for k, _ in KINDS])
def test_after_removals_each_item_finds_itself_with_its_own_id(tmp_path, factory, refine):
    feats = clustered(N + 100, D, seed=0)
    vectors_by_id = {i: feats[i] for i in range(N + 100)}
    store = GalleryStore.create(tmp_path / "st", feats[:N], rows(N), factory=factory, seed=0, refine=refine)
    params = _wide_search(store)
    before = {"wide": store.recall(sample=200, k=10, seed=0, search_params=params)["recall"],
              "stored": store.recall(sample=200, k=10, seed=0)["recall"]}

    store.remove([0, 5, 6, 300, 477, N - 1])  # the first, neighbours, the middle, the last
    _check_every_item_finds_itself(store, vectors_by_id)
    store.add(feats[N:], rows(100, start=N))  # additions after a removal get fresh inner positions
    store.remove([1, 2, N + 3, N + 99])
    for st in (store, GalleryStore.open(tmp_path / "st")):
        assert st.ntotal == N + 100 - 10
        for seg in st.segments:
            assert np.array_equal(faiss.vector_to_array(seg.index.id_map), seg.ids)
            assert store_mod._inner_ids_match_positions(seg.index)
        _check_every_item_finds_itself(st, vectors_by_id)
        after = st.recall(sample=200, k=10, seed=0, search_params=params)["recall"]
        assert after == pytest.approx(before["wide"], abs=0.05), (factory, before, after)
    verified = GalleryStore.open(tmp_path / "st").verify(sample=200, k=10, seed=0)  # what index --verify records
    assert verified["recall"] == pytest.approx(before["stored"], abs=0.05), (factory, before, verified)


def test_a_store_whose_removal_shifted_ids_is_repaired_when_opened(tmp_path):
    feats = clustered(300, D, seed=1)
    store = GalleryStore.create(tmp_path / "st", feats, rows(300), factory="IVF4,Flat", seed=0)
    # What the earlier removal wrote: IndexIDMap2.remove_ids alone, the IVF's inner ids left as they were.
    shifted = store_mod._copy_index(store.segments[0].index)
    shifted.remove_ids(faiss.IDSelectorBatch(np.array([5])))
    assert not store_mod._inner_ids_match_positions(shifted)
    kept = np.delete(np.arange(300), 5)
    folder = tmp_path / "st"
    segment = store_mod._NewSegment(kept, feats[kept], shifted, store._segment_rows(store.segments[0], kept))
    store._commit([segment], dict(store.header, ntotal=299))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reopened = GalleryStore.open(folder)
    assert any("wrong ids" in str(w.message) for w in caught)
    found = reopened.search(feats[kept], 1, search_params={"nprobe": 4})
    np.testing.assert_array_equal(found.ids[:, 0], kept)
    reopened.add(-feats[:1], [{"path": "/gallery/new.jpg"}])  # the next update saves the repaired index
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(store_mod._inner_ids_match_positions(seg.index) for seg in GalleryStore.open(folder).segments)
