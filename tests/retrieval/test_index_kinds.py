"""Index kinds (fedreid.retrieval.index_kinds): every registered kind runs a store; a new kind is one registered class."""

from __future__ import annotations

import numpy as np
import pytest

from fedreid.retrieval import index_kinds
from fedreid.retrieval.index_kinds import INDEX_KINDS, IndexKind
from fedreid.retrieval.store import GalleryStore, GalleryStoreError

#: A small factory string of each registered kind: a kind added to the registry must be added here too.
FACTORIES = {"flat": "Flat", "ivf": "IVF4,Flat", "hnsw": "HNSW8", "other": "SQ8"}


def unit(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rows(n: int) -> list[dict]:
    return [{"path": f"/gallery/{i:04d}.jpg", "camera": i % 3 + 1} for i in range(n)]


def check_store(folder, factory: str, kind: str) -> None:
    feats = unit(300)
    store = GalleryStore.create(folder, feats, rows(300), factory=factory)
    assert store.kind == kind and index_kinds.index_kind(store.template) == kind
    found = store.search(feats[:5], 4)
    assert found.ids.shape == (5, 4) and (found.ids >= 0).all()
    assert set(store.search_params) == set(index_kinds.INDEX_KINDS[kind].search_keys)
    filtered = store.search(feats[:5], 4, cameras=[2])
    assert all(row["camera"] == 2 for row in store.rows(filtered.ids.ravel()) if row is not None)
    store.remove([0, 1])
    again = GalleryStore.open(folder)
    assert again.kind == kind and again.ntotal == 298 and 0 not in again.ids and 299 in again.ids
    np.testing.assert_array_equal(again.search(feats[5:8], 3).ids, store.search(feats[5:8], 3).ids)


def test_every_registered_kind_has_a_small_factory_here():
    assert sorted(INDEX_KINDS) == sorted(FACTORIES)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_every_registered_kind_builds_searches_and_updates_a_store(tmp_path, kind):
    check_store(tmp_path / "st", FACTORIES[kind], kind)


class ResidualQuantizerKind(IndexKind):
    """The example of docs/extending.md ("Add an index kind")."""

    name = "rq"
    classes = ("IndexResidualQuantizer",)
    factories = "RQ<m>x<bits>"
    takes_search_parameters = False  # FAISS's additive quantizers take no SearchParameters


def test_a_newly_registered_kind_is_picked_up_by_the_store(tmp_path, monkeypatch):
    with pytest.raises(GalleryStoreError, match="builds a faiss IndexResidualQuantizer, which a gallery store"):
        GalleryStore.create(tmp_path / "before", unit(300), rows(300), factory="RQ4x4")
    kinds = INDEX_KINDS.copy()
    kinds.register(ResidualQuantizerKind)
    monkeypatch.setattr(index_kinds, "INDEX_KINDS", kinds)
    check_store(tmp_path / "st", "RQ4x4", "rq")
    with pytest.raises(GalleryStoreError, match=r"supported: .*; RQ<m>x<bits>; each optionally after"):
        GalleryStore.create(tmp_path / "nsg", unit(300), rows(300), factory="NSG16")
