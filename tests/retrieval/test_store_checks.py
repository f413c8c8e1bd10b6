"""Gallery store checks at the door: supported index kinds, the header's search parameters, k, folder names."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from fedreid.retrieval import store as store_mod
from fedreid.retrieval.store import GalleryStore, GalleryStoreError, check_factory_string

N, D = 84, 16


def unit_rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rows(n: int) -> list[dict]:
    return [{"path": f"/gallery/img_{i:05d}.jpg", "camera": i % 3, "site": "north", "timestamp": 1000.0 + i}
            for i in range(n)]


@pytest.fixture(scope="module")
def feats() -> np.ndarray:
    return unit_rows(N, D)


# --------------------------------------------------------------------------
# Factory strings that would build a store that cannot search
# --------------------------------------------------------------------------


@pytest.mark.parametrize("factory", ["NSG32", "PQ8x4fs", "Flat,RFlat", "IVF4,Flat,RFlat", "HNSW8,PQ4"])
def test_a_factory_the_store_cannot_search_is_refused_at_build_time(tmp_path, feats, factory):
    with pytest.raises(GalleryStoreError) as caught:
        GalleryStore.create(tmp_path / "st", feats, rows(N), factory=factory)
    message = str(caught.value)
    assert "\n" not in message and f"factory {factory!r}" in message
    assert "cannot search" in message and "supported: Flat; IVF<lists>" in message
    assert not (tmp_path / "st").exists()
    with pytest.raises(GalleryStoreError, match="supported: Flat"):  # what index --factory checks before any work
        check_factory_string(factory)


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "IVF4,PQ4x4fs", "HNSW8,SQ8", "PQ4x4", "SQ8", "PCA8,PQ4x4"])
def test_every_supported_factory_searches_filtered_and_unfiltered(tmp_path, feats, factory):
    s = GalleryStore.create(tmp_path / "st", feats, rows(N), factory=factory)
    assert s.search(feats[:3], 5).ids.shape == (3, 5)
    got = s.search(feats[:3], 5, cameras=[1])
    assert set(got.ids[got.ids >= 0].tolist()) <= set(range(1, N, 3))


def test_a_factory_that_cannot_be_trained_on_the_gallery_is_one_line(tmp_path, feats):
    with pytest.raises(GalleryStoreError) as caught:  # OPQ trains a PQ of 256 centroids of its own
        GalleryStore.create(tmp_path / "st", feats, rows(N), factory="OPQ4,PQ4x4")
    assert "\n" not in str(caught.value) and "cannot be trained on the gallery's 84 vectors" in str(caught.value)
    assert not (tmp_path / "st").exists()


# --------------------------------------------------------------------------
# The header's search parameters
# --------------------------------------------------------------------------


@pytest.mark.parametrize("search, words", [
    ({"nprobe": -3}, "search parameter nprobe must be an integer >= 1, got -3"),
    ({"nprobe": "8"}, "search parameter nprobe must be an integer >= 1, got '8'"),
    ({"nprobe": True}, "search parameter nprobe must be an integer >= 1, got True"),
    ({"nprobe": 2.5}, "search parameter nprobe must be an integer >= 1, got 2.5"),
    ({}, "search parameter nprobe is missing"),
    ({"nprobe": 4, "efSearch": 16}, "search parameter 'efSearch' does not apply to a ivf index"),
    ({"nprobe": 4, "refine": 0}, "search parameter refine must be an integer >= 1, got 0"),
    ("nprobe=4", "search parameters must be an object"),
])
def test_a_hand_edited_header_search_parameter_is_one_line_naming_the_file_and_field(tmp_path, feats, search, words):
    GalleryStore.create(tmp_path / "st", feats, rows(N), factory="IVF4,Flat")
    path = tmp_path / "st" / "header.json"
    header = json.loads(path.read_text())
    path.write_text(json.dumps(dict(header, search=search)))
    with pytest.raises(GalleryStoreError) as caught:
        GalleryStore.open(tmp_path / "st")
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "field search" in message and words in message


def test_hnsw_header_and_overrides_are_checked_too(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats, rows(N), factory="HNSW8")
    with pytest.raises(GalleryStoreError, match="search parameter efSearch must be an integer >= 1, got 0"):
        s.search(feats[:1], 3, search_params={"efSearch": 0})
    with pytest.raises(GalleryStoreError, match="'nprobe' does not apply to a hnsw index"):
        s.recall(sample=5, search_params={"nprobe": 4})
    path = tmp_path / "st" / "header.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), search={"efSearch": None})))
    with pytest.raises(GalleryStoreError, match="field search: search parameter efSearch must be an integer"):
        GalleryStore.open(tmp_path / "st")


# --------------------------------------------------------------------------
# k
# --------------------------------------------------------------------------


def test_k_is_cut_to_the_item_count_without_allocating_for_the_asked_k(tmp_path, feats):
    s = GalleryStore.create(tmp_path / "st", feats, rows(N), factory="IVF4,Flat")
    huge = 100_000_000
    tracemalloc.start()
    try:
        unfiltered = s.search(feats[:2], huge)
        filtered = s.search(feats[:2], huge, cameras=[0, 1, 2])
        exact = s.exact_search(feats[:2], huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20, peak  # not the 1.2 GB of [Q, 10^8] arrays
    for got in (unfiltered, filtered, exact):
        assert got.ids.shape == (2, N) and got.scores.shape == (2, N)
    assert sorted(filtered.ids[0].tolist()) == list(range(N))
    assert s.search(feats[:2], huge, cameras=[1]).ids.shape == (2, N)  # a filter pads with -1 up to the items
    with pytest.raises(GalleryStoreError, match="k must be an integer >= 1"):
        s.search(feats[:1], 0)
    s.remove(list(range(N)))
    assert s.search(feats[:2], 5).ids.shape == (2, 0)


# --------------------------------------------------------------------------
# Folder names that mean something in a URI
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a#b", "what?mode=rw", "100%25 sure", "mix #?% &=;"])
def test_a_store_under_a_folder_named_with_uri_characters_works(tmp_path, feats, name):
    parent = tmp_path / name
    parent.mkdir()
    s = GalleryStore.create(parent / "st", feats, rows(N))
    before = sorted(p.name for p in tmp_path.rglob("*") if not p.name.startswith("seg-"))
    segment_files = len(list((parent / "st").glob("seg-*")))
    again = GalleryStore.open(parent / "st")
    assert again.rows([3])[0]["path"] == "/gallery/img_00003.jpg"
    assert again.find_paths(["/gallery/img_00004.jpg"]) == {"/gallery/img_00004.jpg": 4}
    assert again.find_file_name("img_00005.jpg") == [(5, "/gallery/img_00005.jpg")]
    got = again.search(feats[:2], 3, sites=["north"], cameras=[0, 1, 2])
    assert got.ids[0, 0] == 0 and got.ids[1, 0] == 1
    s.remove([7])
    assert GalleryStore.open(parent / "st").rows([7]) == [None]
    assert sorted(p.name for p in tmp_path.rglob("*") if not p.name.startswith("seg-")) == before  # no stray database file
    assert len(list((parent / "st").glob("seg-*"))) == segment_files  # the compacted segment replaced the old one
    assert all(store_mod._SEGMENT_FILE.match(p.name) for p in tmp_path.rglob("seg-*"))  # no journal beside a table


# --------------------------------------------------------------------------
# One rule set for metadata and filter values, whichever door they come through
# --------------------------------------------------------------------------


def test_out_of_range_values_are_refused_by_the_store_itself(tmp_path, feats):
    from fedreid.retrieval.fields import GalleryMetadataError

    s = GalleryStore.create(tmp_path / "st", feats, rows(N))
    for bad in ({"camera": 2**70}, {"identity": "alice"}, {"timestamp": 1e15}, {"site": ""}, {"camera": True},
                {"site": "Paris, lobby"}):
        with pytest.raises(GalleryMetadataError, match="metadata row 0 \\(/new.jpg\\): (camera|identity|timestamp|site) must"):
            s.add(feats[:1], [{"path": "/new.jpg", **bad}])
    for kwargs in ({"cameras": [99999999999999999999]}, {"cameras": [-(2**31) - 1]}, {"sites": ["x" * 201]},
                   {"time_window": (1e300, None)}, {"time_window": (5.0, 1.0)}):
        with pytest.raises(GalleryMetadataError, match="must|expected since <= until"):
            s.search(feats[:1], 3, **kwargs)
    assert s.ntotal == N and s.search(feats[:1], 3, cameras=[2**31 - 1]).ids.tolist() == [[-1, -1, -1]]


def test_a_site_name_holds_no_comma_a_filter_would_split():
    from fedreid.retrieval import fields

    assert fields.site_list("Paris lobby, Lyon") == ["Paris lobby", "Lyon"]
    with pytest.raises(fields.GalleryMetadataError, match="--site must be a name .* or commas .*got 'Paris, lobby'"):
        fields.site("Paris, lobby", "--site")


def test_every_door_checks_with_the_same_rules(tmp_path, feats, monkeypatch):
    """Tightening a rule in fedreid.retrieval.fields tightens the CSV, the store, the filters of federated search."""
    from fedreid.flower.search_codec import SearchCodecError, SearchFilters
    from fedreid.retrieval import fields
    from fedreid.retrieval.gallery_rows import read_metadata_csv

    s = GalleryStore.create(tmp_path / "st", feats, rows(N))
    image = tmp_path / "a.jpg"
    image.write_bytes(b"")
    table = tmp_path / "meta.csv"
    table.write_text("path,camera\na.jpg,11\n")
    assert read_metadata_csv(table, base=tmp_path, images=[str(image.resolve())])[str(image.resolve())] == {"camera": 11}
    assert SearchFilters(cameras=[11]).cameras == (11,)
    monkeypatch.setattr(fields, "INT_MAX", 10)
    with pytest.raises(fields.GalleryMetadataError, match="row 2: camera must be an integer from -2147483648 to 10"):
        read_metadata_csv(table, base=tmp_path, images=[str(image.resolve())])
    with pytest.raises(SearchCodecError, match="filters.cameras .* to 10, got 11"):
        SearchFilters(cameras=[11])
    with pytest.raises(SearchCodecError, match="filters.cameras"):
        SearchFilters(cameras=[10**40])
    with pytest.raises(fields.GalleryMetadataError, match="cameras filter .* to 10, got 11"):
        s.search(feats[:1], 3, cameras=[11])


# --------------------------------------------------------------------------
# The update lock held across several steps
# --------------------------------------------------------------------------


def test_update_lock_keeps_other_writers_out_and_lets_its_own_thread_update(tmp_path, feats, monkeypatch):
    import threading

    from fedreid.retrieval import store as store_module

    store = GalleryStore.create(tmp_path / "st", feats[:20], rows(20))
    other = GalleryStore.open(tmp_path / "st")
    monkeypatch.setattr(store_module, "LOCK_TIMEOUT_S", 0.3)
    refused: list[str] = []

    def other_writer() -> None:  # another thread (or process): waits for the lock, here in vain
        try:
            other.add(feats[30:31], [{"path": "/gallery/other.jpg"}])
        except GalleryStoreError as exc:
            refused.append(str(exc))

    with store.update_lock():
        reopened = GalleryStore.open(tmp_path / "st")  # open and this thread's updates take the lock again at once
        assert reopened.add(feats[20:22], rows(22)[20:]).tolist() == [20, 21]
        reopened.remove([3])
        thread = threading.Thread(target=other_writer)
        thread.start()
        thread.join()
    assert len(refused) == 1 and "holds the update lock" in refused[0]
    assert GalleryStore.open(tmp_path / "st").ntotal == 21
    other = GalleryStore.open(tmp_path / "st")
    other.add(feats[30:31], [{"path": "/gallery/other.jpg"}])  # the lock was released
    assert GalleryStore.open(tmp_path / "st").ntotal == 22
