"""Raw parsers of the small datasets (VIPeR, CUHK01, PRID2011, 3DPeS, i-LIDS, CUHK02)."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from small_fixtures import (
    write_3dpes,
    write_cuhk01,
    write_cuhk02,
    write_ilids,
    write_image,
    write_prid,
    write_viper,
)

from fedreid.data.raw.base import ParseResult, RawLayoutError
from fedreid.data.raw.cuhk01 import CUHK01
from fedreid.data.raw.cuhk02 import CUHK02
from fedreid.data.raw.ilids import ILIDS
from fedreid.data.raw.prid2011 import PRID2011
from fedreid.data.raw.threedpes import ThreeDPeS
from fedreid.data.raw.viper import VIPeR


def by_split(result: ParseResult) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for rec in result.records:
        out[rec.split].append(rec)
    return out


def ids(records) -> set[int]:
    return {r.pid for r in records}


def train_all(result: ParseResult) -> list:
    return [r for r in result.records if r.split in ("train", "val")]


def write_split(tmp_path: Path, content) -> Path:
    path = tmp_path / "my_split.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# -- registry -----------------------------------------------------------------
def test_registry_names():
    from fedreid.data.raw import get_raw_dataset

    for name, cls in [("viper", VIPeR), ("cuhk01", CUHK01), ("prid2011", PRID2011),
                      ("3dpes", ThreeDPeS), ("ilids", ILIDS), ("cuhk02", CUHK02)]:
        assert get_raw_dataset(name) is cls
    assert CUHK02.public and not VIPeR.public


# -- VIPeR --------------------------------------------------------------------
def test_viper_pairs_and_splits(tmp_path):
    write_viper(tmp_path, 10)
    result = VIPeR(tmp_path, seed=0).parse()
    s = by_split(result)
    train_ids, test_ids = ids(train_all(result)), ids(s["query"])
    assert len(train_ids) == 5 and train_ids.isdisjoint(test_ids)
    assert test_ids == ids(s["gallery"]) and len(test_ids) == 5
    assert len(train_all(result)) == 10 and len(s["val"]) == 5 and len(s["train"]) == 5
    for rec in result.records:
        # file number 2i+1 is the i-th sorted file, i.e. pid i
        assert int(rec.path.name.split("_")[0]) == 2 * rec.pid + 1
        assert rec.camid == (0 if rec.path.parent.name == "cam_a" else 1)
    assert all(r.camid == 0 for r in s["query"]) and all(r.camid == 1 for r in s["gallery"])
    assert result.id_split == {"train": sorted(train_ids), "test": sorted(test_ids), "seed": 0}
    assert result.skipped == []


def test_viper_seeded_split_is_deterministic(tmp_path):
    write_viper(tmp_path, 20)
    a = VIPeR(tmp_path, seed=3).parse().id_split
    b = VIPeR(tmp_path, seed=3).parse().id_split
    c = VIPeR(tmp_path, seed=4).parse().id_split
    assert a == b
    assert a["train"] != c["train"] and len(c["train"]) == 10


def test_viper_unequal_cameras_and_bad_names(tmp_path):
    base = write_viper(tmp_path, 4)
    write_image(base / "cam_a" / "notes.bmp")
    (base / "cam_a" / "readme.txt").write_text("x")
    write_image(base / "cam_a" / "Thumbs.db", empty=True)
    result = VIPeR(tmp_path).parse()
    rules = {s.path.name: s.rule for s in result.skipped}
    assert set(rules) == {"notes.bmp", "readme.txt", "Thumbs.db"}
    assert "does not match" in rules["notes.bmp"] and rules["Thumbs.db"] == "system file"
    assert len(result.records) == 8

    (base / "cam_b" / "007_90.bmp").unlink()
    with pytest.raises(RawLayoutError, match=r"only in .*cam_a: 007_45\.bmp"):
        VIPeR(tmp_path).parse()


def test_a_release_whose_names_all_differ_from_the_pattern_names_the_skips_in_its_error(tmp_path):
    base = tmp_path / "VIPeR"
    for cam in ("cam_a", "cam_b"):
        for i in range(3):
            write_image(base / cam / f"img{i}.jpg")
    with pytest.raises(RawLayoutError) as info:
        VIPeR(tmp_path).parse()
    message = str(info.value)
    assert message.startswith(f"viper: cannot split 0 identities into 0 train ids (under {base}); 6 file(s) skipped, "
                              "most often 6 x name does not match ") and "\n" not in message
    assert str(base / "cam_a" / "img0.jpg") in message


def test_viper_pairs_cameras_on_the_person_number(tmp_path):
    """One file missing from each camera must not shift the later identities."""
    base = write_viper(tmp_path, 6)  # numbers 001, 003, ..., 011
    (base / "cam_a" / "001_45.bmp").unlink()
    (base / "cam_b" / "007_90.bmp").unlink()
    with pytest.raises(RawLayoutError) as info:
        VIPeR(tmp_path).parse()
    message = str(info.value)
    assert f"only in {base / 'cam_a'}: 007_45.bmp" in message
    assert f"only in {base / 'cam_b'}: 001_90.bmp" in message and "\n" not in message
    (base / "cam_a" / "007_45.bmp").unlink()
    (base / "cam_b" / "001_90.bmp").unlink()
    result = VIPeR(tmp_path).parse()
    for pid in ids(result.records):
        numbers = {r.path.name.split("_")[0] for r in result.records if r.pid == pid}
        assert len(numbers) == 1, f"pid {pid} pairs different persons: {numbers}"
    write_image(base / "cam_a" / "003_0.bmp")
    with pytest.raises(RawLayoutError, match=r"003_0\.bmp and 003_45\.bmp both show person 3"):
        VIPeR(tmp_path).parse()


def test_viper_missing_folder(tmp_path):
    (tmp_path / "VIPeR" / "cam_a").mkdir(parents=True)
    with pytest.raises(RawLayoutError, match=r"VIPeR[/\\]cam_b"):
        VIPeR(tmp_path).parse()
    with pytest.raises(RawLayoutError, match="expected the folder"):
        VIPeR(tmp_path / "nowhere").parse()


def test_viper_split_file_override(tmp_path):
    write_viper(tmp_path, 6)
    path = write_split(tmp_path, {"train": [0, 1, 5], "test": [2, 3, 4], "seed": 99})
    result = VIPeR(tmp_path, split_file=path).parse()
    s = by_split(result)
    assert ids(train_all(result)) == {0, 1, 5}
    assert ids(s["query"]) == ids(s["gallery"]) == {2, 3, 4}
    assert result.id_split["train"] == [0, 1, 5] and result.id_split["test"] == [2, 3, 4]
    assert result.id_split["split_file"] == str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ({"train": [0, 1, 9], "test": [2, 3, 4, 5]}, "unknown identities \\[9\\]"),
        ({"train": [0, 1, 2], "test": [2, 3, 4, 5]}, "in both train and test: \\[2\\]"),
        ({"train": [0, 1], "test": [2, 3, 4]}, "in neither train nor test: \\[5\\]"),
        ({"train": [0, 1, 2]}, "'test' is missing"),
        ({"train": ["0", 1, 2], "test": [3, 4, 5]}, "'train' is missing or not a list of integers"),
        ([0, 1, 2], "expected a JSON object"),
        ("{not json", "cannot read the split file"),
    ],
)
def test_split_file_errors(tmp_path, content, message):
    write_viper(tmp_path, 6)
    path = write_split(tmp_path, content)
    with pytest.raises(RawLayoutError, match=message) as info:
        VIPeR(tmp_path, split_file=path).parse()
    assert str(path) in str(info.value)


def test_benchmark_dgd_split_file_is_accepted(tmp_path):
    """The benchmark's split.json: train = trainval, test = test_probe | test_gallery."""
    write_viper(tmp_path, 6)
    path = write_split(tmp_path, {"trainval": [0, 1, 5], "test_probe": [2, 3], "test_gallery": [2, 3, 4]})
    result = VIPeR(tmp_path, split_file=path).parse()
    s = by_split(result)
    assert ids(train_all(result)) == {0, 1, 5}
    assert ids(s["query"]) == ids(s["gallery"]) == {2, 3, 4}
    assert result.id_split["train"] == [0, 1, 5] and result.id_split["test"] == [2, 3, 4]
    bad = write_split(tmp_path, {"trainval": [0, 1, 5], "test_probe": [2, 3, 4]})
    with pytest.raises(RawLayoutError, match="'test_gallery' is missing") as info:
        VIPeR(tmp_path, split_file=bad).parse()
    assert "test_probe" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["prid2011", "3dpes"])
def test_benchmark_dgd_split_file_is_refused_where_ids_differ(tmp_path, name):
    from fedreid.data.raw import get_raw_dataset

    options = {}
    if name == "prid2011":
        write_prid(tmp_path, 4, 1, 2)
        options = {"num_shared": 4}
    else:
        write_3dpes(tmp_path, {1: [1, 2], 2: [1, 2], 3: [1, 2], 4: [1, 2]})
    path = write_split(tmp_path, {"trainval": [0, 1], "test_probe": [2, 3], "test_gallery": [2, 3]})
    with pytest.raises(RawLayoutError, match="--layout fedreid") as info:
        get_raw_dataset(name)(tmp_path, split_file=path, **options).parse()
    assert str(path) in str(info.value) and "\n" not in str(info.value)


DGD_ILIDS = Path("/work/shared/data/fedreid_dgd/ilids")


@pytest.mark.skipif(not (DGD_ILIDS / "split.json").is_file() or not (DGD_ILIDS / "meta.json").is_file(),
                    reason=f"the benchmark's i-LIDS split.json and meta.json are not in {DGD_ILIDS}")
def test_ilids_with_the_benchmark_split_gives_table1(tmp_path):
    from fedreid.data.prepared import card_counts, dataset_card

    meta = json.loads((DGD_ILIDS / "meta.json").read_text())["identities"]
    # The release's image count per person (DGD's meta lists every image, in person order).
    write_ilids(tmp_path, {i + 1: sum(map(len, views)) for i, views in enumerate(meta)}, empty=True)
    result = ILIDS(tmp_path, split_file=DGD_ILIDS / "split.json").parse()
    c = card_counts(dataset_card(result.records))
    assert (c.train_ids, c.train_images, c.query_ids, c.query_images, c.gallery_images) == (
        59, 248, 60, 98, 130)


def test_viper_real_size_gives_paper_numbers(tmp_path):
    write_viper(tmp_path, 632, empty=True)
    result = VIPeR(tmp_path, seed=7).parse()
    s = by_split(result)
    assert len(ids(train_all(result))) == 316 and len(train_all(result)) == 632
    assert len(ids(s["query"])) == 316 and len(s["query"]) == 316 and len(s["gallery"]) == 316
    assert VIPeR.expected.train_ids == 316


# -- CUHK01 -------------------------------------------------------------------
def test_cuhk01_views_cameras_and_splits(tmp_path):
    base = write_cuhk01(tmp_path, 8)
    for view in range(1, 5):  # a numbering gap: pid is the sorted index
        write_image(base / f"0020{view:03d}.png")
    write_image(base / "0001005.png")  # view 5 does not exist
    write_image(base / "001001.png")  # wrong name
    result = CUHK01(tmp_path, seed=1).parse()
    s = by_split(result)
    assert {(sk.path.name, sk.rule.split(" ")[0]) for sk in result.skipped} == {
        ("0001005.png", "view"), ("001001.png", "name")}
    pids = {int(r.path.name[:4]): r.pid for r in result.records}
    assert pids == {**{n: n - 1 for n in range(1, 9)}, 20: 8}
    for rec in result.records:
        assert rec.camid == (0 if int(rec.path.name[4:7]) <= 2 else 1)
    train_ids = ids(train_all(result))
    assert len(train_ids) == round(9 * 485 / 971)  # 4
    test_ids = set(range(9)) - train_ids
    assert ids(s["query"]) == ids(s["gallery"]) == test_ids
    assert len(s["query"]) == len(s["gallery"]) == 2 * len(test_ids)
    assert all(r.camid == 0 for r in s["query"]) and all(r.camid == 1 for r in s["gallery"])
    assert len(s["val"]) == len(train_ids)


def test_cuhk01_missing_folder(tmp_path):
    (tmp_path / "CUHK01").mkdir()
    with pytest.raises(RawLayoutError, match="campus"):
        CUHK01(tmp_path).parse()


def test_cuhk01_real_size_gives_paper_numbers(tmp_path):
    write_cuhk01(tmp_path, 971, empty=True)
    result = CUHK01(tmp_path, seed=0).parse()
    s = by_split(result)
    e = CUHK01.expected
    assert len(ids(train_all(result))) == e.train_ids == 485
    assert len(train_all(result)) == e.train_images == 1940
    assert len(ids(s["query"])) == e.query_ids == 486
    assert len(s["query"]) == e.query_images == 972
    assert len(s["gallery"]) == e.gallery_images == 972


# -- PRID2011 -----------------------------------------------------------------
def prid_tree(tmp_path):
    # 6 shared, 3 camera-A-only, 4 camera-B-only persons.
    frames = {("cam_a", 1): 7, ("cam_b", 1): 7, ("cam_a", 7): 2}
    return write_prid(tmp_path, 6, 3, 4, frames=frames)


def test_prid_halves_distractors_and_frames(tmp_path):
    prid_tree(tmp_path)
    result = PRID2011(tmp_path, seed=0, max_frames=4, num_shared=6).parse()
    s = by_split(result)
    test_ids = ids(s["query"])
    shared_train = set(range(6)) - test_ids
    assert len(test_ids) == 3 and result.id_split["test"] == sorted(test_ids)
    assert result.id_split["train"] == sorted(shared_train)
    # train: the other shared half + the camera-A-only persons (pids 6-8)
    assert ids(train_all(result)) == shared_train | {6, 7, 8}
    # query: one single-shot camera-A image per test id
    assert len(s["query"]) == 3
    assert all(r.camid == 0 and r.path.parent.name == "cam_a" and "single_shot" in str(r.path)
               for r in s["query"])
    # gallery: single-shot camera-B of the test ids + the 4 camera-B-only distractors
    assert len(s["gallery"]) == 7 and ids(s["gallery"]) == test_ids | {9, 10, 11, 12}
    assert all(r.camid == 1 and "single_shot" in str(r.path) for r in s["gallery"])
    distractors = {r.pid: r.path.name for r in s["gallery"] if r.pid >= 9}
    assert distractors == {9: "person_0007.png", 10: "person_0008.png",
                           11: "person_0009.png", 12: "person_0010.png"}
    # train images are multi-shot frames, per camera the person appears in
    for rec in train_all(result):
        assert "multi_shot" in str(rec.path)
        assert rec.camid == (0 if rec.path.parent.parent.name == "cam_a" else 1)
    cams = defaultdict(set)
    for rec in train_all(result):
        cams[rec.pid].add(rec.camid)
    assert all(cams[p] == {0, 1} for p in shared_train)
    assert all(cams[p] == {0} for p in (6, 7, 8))
    # camera-A-only person 7 (pid 6) has 2 frames; person 8/9 have 3 (<= max_frames)
    per_seq = defaultdict(list)
    for rec in train_all(result):
        per_seq[(rec.pid, rec.camid)].append(rec.path.name)
    assert sorted(per_seq[(6, 0)]) == ["0001.png", "0002.png"]
    assert sorted(per_seq[(7, 0)]) == ["0001.png", "0002.png", "0003.png"]
    # every file of the tree is either a record or a counted skip
    total = sum(1 for p in (tmp_path / "prid_2011").rglob("*.png"))
    assert len(result.records) + len(result.skipped) == total


def test_prid_evenly_spaced_frames(tmp_path):
    prid_tree(tmp_path)
    # person 1 is shared: force it into train
    path = write_split(tmp_path, {"train": [0, 1, 2], "test": [3, 4, 5]})
    result = PRID2011(tmp_path, split_file=path, max_frames=4, num_shared=6).parse()
    frames = sorted(r.path.name for r in train_all(result) if r.pid == 0 and r.camid == 0)
    # linspace(0, 6, 4) = 0, 2, 4, 6 -> frames 1, 3, 5, 7
    assert frames == ["0001.png", "0003.png", "0005.png", "0007.png"]
    rules = {s.rule for s in result.skipped if s.path.parent.name == "person_0001"}
    assert any("not among the 4 evenly spaced" in r for r in rules)
    assert ids(by_split(result)["query"]) == {3, 4, 5}
    # default max_frames is 10: all 7 frames
    result = PRID2011(tmp_path, split_file=path, num_shared=6).parse()
    assert len([r for r in train_all(result) if r.pid == 0 and r.camid == 0]) == 7


def test_prid_split_file_covers_shared_persons_only(tmp_path):
    prid_tree(tmp_path)
    path = write_split(tmp_path, {"train": [0, 1, 2, 6], "test": [3, 4, 5]})
    with pytest.raises(RawLayoutError, match="unknown identities \\[6\\]"):
        PRID2011(tmp_path, split_file=path, num_shared=6).parse()


def test_prid_layout_errors(tmp_path):
    base = prid_tree(tmp_path)
    shutil.rmtree(base / "multi_shot" / "cam_a" / "person_0008")  # camera-A-only: train
    with pytest.raises(RawLayoutError, match="person_0008"):
        PRID2011(tmp_path, num_shared=6).parse()
    # the release's 200 shared persons do not fit a 9/10-person tree
    with pytest.raises(RawLayoutError, match="fewer than the 200 persons seen by both"):
        PRID2011(tmp_path).parse()
    shutil.rmtree(base / "multi_shot")
    with pytest.raises(RawLayoutError, match="multi_shot"):
        PRID2011(tmp_path, num_shared=6).parse()


def test_prid_shared_persons_must_be_lowest_numbers(tmp_path):
    base = prid_tree(tmp_path)
    (base / "single_shot" / "cam_b" / "person_0002.png").unlink()
    with pytest.raises(RawLayoutError, match="lowest numbers"):
        PRID2011(tmp_path, num_shared=6).parse()


def test_prid_seeds(tmp_path):
    write_prid(tmp_path, 20, 2, 2, frames=1, empty=True)
    a = PRID2011(tmp_path, seed=1, num_shared=20).parse()
    b = PRID2011(tmp_path, seed=1, num_shared=20).parse()
    c = PRID2011(tmp_path, seed=2, num_shared=20).parse()
    assert a.id_split == b.id_split and a.id_split["train"] != c.id_split["train"]
    assert len(a.id_split["train"]) == 10


def test_prid_real_size_gives_paper_numbers(tmp_path):
    write_prid(tmp_path, 200, 185, 549, frames=12, empty=True)
    result = PRID2011(tmp_path, seed=0).parse()
    s = by_split(result)
    e = PRID2011.expected
    assert len(ids(train_all(result))) == e.train_ids == 285
    assert len(ids(s["query"])) == e.query_ids == 100
    assert len(s["query"]) == e.query_images == 100
    assert len(s["gallery"]) == e.gallery_images == 649
    # 10 frames per camera: 100 shared ids x 2 cameras + 185 camera-A-only ids
    assert len(train_all(result)) == 10 * (200 + 185)


# -- 3DPeS --------------------------------------------------------------------
VIEWS_3DPES = {1: [1, 2, 3], 2: [4], 3: [1, 2], 5: [10, 2, 9, 7]}


def test_3dpes_views_halved(tmp_path):
    write_3dpes(tmp_path, VIEWS_3DPES)
    # person 2 (pid 1) is seen from one view only: put it in test
    path = write_split(tmp_path, {"train": [0, 2], "test": [1, 3]})
    result = ThreeDPeS(tmp_path, split_file=path).parse()
    s = by_split(result)
    cam = {(r.pid, int(r.path.name.split("_")[1])): r.camid for r in result.records}
    assert cam == {(0, 1): 0, (0, 2): 1, (0, 3): 1,   # 3 views: 1 to camera 0
                   (1, 4): 1,                          # single view: no camera-0 image
                   (2, 1): 0, (2, 2): 1,
                   (3, 2): 0, (3, 7): 0, (3, 9): 1, (3, 10): 1}  # numeric view order
    assert ids(s["query"]) == {3}  # pid 1 is a test id without a query image
    assert ids(s["gallery"]) == {1, 3}
    assert len(s["query"]) == 4 and len(s["gallery"]) == 2 + 4
    assert ids(train_all(result)) == {0, 2} and len(train_all(result)) == 10


def test_3dpes_seeded_split_and_skips(tmp_path):
    base = write_3dpes(tmp_path, {p: [1, 2] for p in range(1, 11)})
    write_image(base / "1_1_FRAME_5_DEPTH.bmp")
    result = ThreeDPeS(tmp_path, seed=5).parse()
    assert len(ids(train_all(result))) == round(10 * 93 / 193)  # 5
    assert [s.path.name for s in result.skipped] == ["1_1_FRAME_5_DEPTH.bmp"]
    assert ThreeDPeS(tmp_path, seed=5).parse().id_split == result.id_split
    assert ThreeDPeS(tmp_path, seed=6).parse().id_split["train"] != result.id_split["train"]
    with pytest.raises(RawLayoutError, match="RGB"):
        ThreeDPeS(tmp_path / "other").parse()


# -- i-LIDS -------------------------------------------------------------------
def test_ilids_images_halved(tmp_path):
    base = write_ilids(tmp_path, {1: 4, 2: 3, 3: 1, 4: 2, 7: 2})
    write_image(base / "01001.jpg")
    result = ILIDS(tmp_path, seed=0).parse()
    assert [s.path.name for s in result.skipped] == ["01001.jpg"]
    cams = defaultdict(list)
    for rec in sorted(result.records, key=lambda r: r.path):
        cams[rec.pid].append(rec.camid)
    assert cams == {0: [0, 0, 1, 1], 1: [0, 1, 1], 2: [1], 3: [0, 1], 4: [0, 1]}
    train_ids = ids(train_all(result))
    assert len(train_ids) == round(5 * 59 / 119)  # 2
    s = by_split(result)
    assert ids(s["query"]) == {0, 1, 3, 4} - train_ids
    assert ids(s["gallery"]) == set(range(5)) - train_ids
    assert result.id_split["seed"] == 0
    with pytest.raises(RawLayoutError, match="Persons"):
        ILIDS(tmp_path / "other").parse()


# -- CUHK02 -------------------------------------------------------------------
def test_cuhk02_public_train_only(tmp_path):
    base = write_cuhk02(tmp_path)
    write_image(base / "P1" / "cam1" / "x.png")
    result = CUHK02(tmp_path).parse()
    assert {r.split for r in result.records} == {"train"}
    assert len(result.records) == 9 * 2 * 2 and len(ids(result.records)) == 9
    assert [s.path.name for s in result.skipped] == ["x.png"]
    for rec in result.records:
        pair = int(rec.path.parent.parent.name[1:])
        cam = int(rec.path.parent.name[3:])
        assert rec.pid == pair * 100000 + int(rec.path.name.split("_")[0])
        assert rec.camid == 2 * (pair - 1) + (cam - 1)
    assert result.id_split is None
    with pytest.raises(RawLayoutError, match="no identity split"):
        CUHK02(tmp_path, split_file=tmp_path / "s.json").parse()
    shutil.rmtree(base / "P5" / "cam2")
    with pytest.raises(RawLayoutError, match=r"P5[/\\]cam2"):
        CUHK02(tmp_path).parse()
