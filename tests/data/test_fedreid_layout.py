"""Importer of the FedReID benchmark's processed folders (``layout="fedreid"``)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from small_fixtures import (
    copy_dgd_metadata,
    write_dgd,
    write_image,
    write_pytorch_layout,
)

from fedreid.data.raw import create_raw_dataset, get_raw_dataset
from fedreid.data.raw.base import ParseResult, RawLayoutError
from fedreid.data.raw.fedreid_layout import FOLDERS, FedReIDLayout

# The shared test data sits beside the checkout (../shared/data); FEDREID_SHARED_DATA
# points elsewhere when the checkout lives somewhere else.
SHARED_DATA = Path(os.environ.get("FEDREID_SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
DGD_DATA = SHARED_DATA / "fedreid_dgd"


def by_split(result: ParseResult) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for rec in result.records:
        out[rec.split].append(rec)
    return out


def summary(result: ParseResult) -> dict[str, set]:
    return {split: {(r.path.name, r.pid, r.camid) for r in recs}
            for split, recs in by_split(result).items()}


# -- construction ---------------------------------------------------------------
def test_folders_and_metadata(tmp_path):
    parser = FedReIDLayout(tmp_path, dataset="cuhk03np")
    assert parser.root == tmp_path / "cuhk03-np-detected" and parser.name == "cuhk03np"
    assert FedReIDLayout(tmp_path, dataset="3dpes").root == tmp_path / "3dpes"
    assert FedReIDLayout(tmp_path, dataset="market1501").root == tmp_path / "Market"
    for name in FOLDERS:
        raw = get_raw_dataset(name)
        parser = FedReIDLayout(tmp_path, dataset=name)
        assert parser.expected == raw.expected and parser.public == raw.public
    assert FedReIDLayout(tmp_path, dataset="cuhk02").public
    with pytest.raises(KeyError, match="unknown dataset 'nope'"):
        FedReIDLayout(tmp_path, dataset="nope")


def test_create_raw_dataset_fedreid_layout(tmp_path):
    parser = create_raw_dataset("viper", tmp_path, layout="fedreid", seed=3)
    assert isinstance(parser, FedReIDLayout)
    assert parser.root == tmp_path / "viper" and parser.seed == 3


def test_neither_form(tmp_path):
    with pytest.raises(RawLayoutError) as info:
        FedReIDLayout(tmp_path, dataset="viper").parse()
    message = str(info.value)
    assert str(tmp_path / "viper" / "pytorch") in message
    assert str(tmp_path / "viper" / "meta.json") in message


# -- (a) pytorch/ ---------------------------------------------------------------
MARKET = {
    "train": {"0002": ["0002_c1s1_000451_03.jpg", "0002_c2s1_000301_01.jpg"],
              "0007": ["0007_c6s3_094317_01.jpg"]},
    "val": {"0002": ["0002_c1s1_000401_03.jpg"], "0007": ["0007_c2s3_070952_01.jpg"]},
    "query": {"0002": ["0002_c5s1_000551_00.jpg"]},
    "gallery": {"-1": ["-1_c3s1_000401_03.jpg"], "0000": ["0000_c6s1_000001_00.jpg"],
                "0002": ["0002_c4s1_000076_01.jpg"]},
}


def test_pytorch_market_names(tmp_path):
    subsets = dict(MARKET)
    subsets["train_all"] = {lab: MARKET["train"].get(lab, []) + MARKET["val"].get(lab, [])
                            for lab in ("0002", "0007")}
    write_pytorch_layout(tmp_path, "Market", subsets)
    result = FedReIDLayout(tmp_path, dataset="market1501").parse()
    assert result.skipped == [] and result.id_split is None
    assert summary(result) == {
        "train": {("0002_c1s1_000451_03.jpg", 2, 0), ("0002_c2s1_000301_01.jpg", 2, 1),
                  ("0007_c6s3_094317_01.jpg", 7, 5)},
        "val": {("0002_c1s1_000401_03.jpg", 2, 0), ("0007_c2s3_070952_01.jpg", 7, 1)},
        "query": {("0002_c5s1_000551_00.jpg", 2, 4)},
        "gallery": {("-1_c3s1_000401_03.jpg", -1, 2), ("0000_c6s1_000001_00.jpg", 0, 5),
                    ("0002_c4s1_000076_01.jpg", 2, 3)},
    }


def test_pytorch_train_all_mismatch_is_reported(tmp_path):
    subsets = dict(MARKET)
    subsets["train_all"] = {"0002": MARKET["train"]["0002"] + ["0002_c3s1_999999_01.jpg"],
                            "0007": MARKET["train"]["0007"] + MARKET["val"]["0007"]}
    base = write_pytorch_layout(tmp_path, "Market", subsets)
    result = FedReIDLayout(tmp_path, dataset="market1501").parse()
    rules = {s.path.relative_to(base).as_posix(): s.rule for s in result.skipped}
    assert set(rules) == {"train_all/0002/0002_c3s1_999999_01.jpg",
                          "train_all/0002/0002_c1s1_000401_03.jpg"}
    assert "not in train/ or val/" in rules["train_all/0002/0002_c3s1_999999_01.jpg"]
    assert "missing from train_all/" in rules["train_all/0002/0002_c1s1_000401_03.jpg"]
    # train and val are what is used
    assert len(by_split(result)["train"]) == 3 and len(by_split(result)["val"]) == 2


def test_pytorch_msmt_names(tmp_path):
    write_pytorch_layout(tmp_path, "MSMT17", {
        "train": {"0000": ["0000_000_01_0303morning_0015_0.jpg",
                           "0000_001_15_0303noon_1000_1.jpg"]},
        "val": {"0000": ["0000_002_07_0303noon_1010_0.jpg"]},
        "query": {"0001": ["0001_c15_0303morning_0015_0.jpg"]},  # Market-style repack
        "gallery": {"0001": ["0001_000_10_0113afternoon_0001_0.jpg"]},
    })
    result = FedReIDLayout(tmp_path, dataset="msmt17").parse()
    assert summary(result) == {
        "train": {("0000_000_01_0303morning_0015_0.jpg", 0, 0),
                  ("0000_001_15_0303noon_1000_1.jpg", 0, 14)},
        "val": {("0000_002_07_0303noon_1010_0.jpg", 0, 6)},
        "query": {("0001_c15_0303morning_0015_0.jpg", 1, 14)},
        "gallery": {("0001_000_10_0113afternoon_0001_0.jpg", 1, 9)},
    }


def test_pytorch_small_dataset_names_and_skips(tmp_path):
    base = write_pytorch_layout(tmp_path, "viper", {
        "train": {"0000": ["cam_1_00000_00000.bmp"], "0003": ["cam_1_00003_00000.bmp"]},
        "val": {"0000": ["cam_0_00000_00000.bmp"], "0003": ["cam_0_00003_00000.bmp"]},
        "query": {"0001": ["cam_0_00001_00000.bmp"], "abc": ["cam_0_00009_00000.bmp"]},
        "gallery": {"0001": ["cam_1_00001_00000.bmp", "photo.bmp", "0001_c0_x.bmp"],
                    "-2": ["cam_1_00002_00000.bmp"]},
    })
    write_image(base / "query" / "loose.bmp")
    result = FedReIDLayout(tmp_path, dataset="viper").parse()
    assert summary(result) == {
        "train": {("cam_1_00000_00000.bmp", 0, 1), ("cam_1_00003_00000.bmp", 3, 1)},
        "val": {("cam_0_00000_00000.bmp", 0, 0), ("cam_0_00003_00000.bmp", 3, 0)},
        "query": {("cam_0_00001_00000.bmp", 1, 0)},
        "gallery": {("cam_1_00001_00000.bmp", 1, 1)},
    }
    rules = {s.path.name: s.rule for s in result.skipped}
    assert set(rules) == {"loose.bmp", "cam_0_00009_00000.bmp", "photo.bmp", "0001_c0_x.bmp", "cam_1_00002_00000.bmp"}
    assert "outside an identity folder" in rules["loose.bmp"]
    assert "'abc' is not an integer" in rules["cam_0_00009_00000.bmp"]
    assert "none of the camera patterns" in rules["photo.bmp"] and "cam_" in rules["photo.bmp"]
    assert "camera 0" in rules["0001_c0_x.bmp"]
    assert rules["cam_1_00002_00000.bmp"] == "pid below -1 (-2; -1 marks junk, identities count from 0)"


def test_pytorch_train_all_only(tmp_path):
    write_pytorch_layout(tmp_path, "cuhk02", {
        "train_all": {"0001": ["cam_0_00001_00000.png", "cam_1_00001_00000.png"],
                      "0002": ["cam_2_00002_00000.png"]},
    })
    result = FedReIDLayout(tmp_path, dataset="cuhk02").parse()
    assert {r.split for r in result.records} == {"train"} and len(result.records) == 3
    assert {r.camid for r in result.records} == {0, 1, 2}

    # a labeled dataset given only train_all gets the usual val images
    write_pytorch_layout(tmp_path, "ilids", {
        "train_all": {"0001": ["cam_0_00001_00000.jpg", "cam_1_00001_00000.jpg"]},
        "query": {"0005": ["cam_0_00005_00000.jpg"]},
        "gallery": {"0005": ["cam_1_00005_00000.jpg"]},
    })
    s = by_split(FedReIDLayout(tmp_path, dataset="ilids").parse())
    assert [r.path.name for r in s["val"]] == ["cam_0_00001_00000.jpg"]
    assert [r.path.name for r in s["train"]] == ["cam_1_00001_00000.jpg"]


def test_pytorch_missing_folders(tmp_path):
    write_pytorch_layout(tmp_path, "viper", {"train": {"0000": ["cam_1_00000_00000.bmp"]},
                                             "query": {}})
    with pytest.raises(RawLayoutError, match=r"pytorch[/\\]gallery"):
        FedReIDLayout(tmp_path, dataset="viper").parse()
    write_pytorch_layout(tmp_path, "ilids", {"query": {}, "gallery": {}})
    with pytest.raises(RawLayoutError, match=r"pytorch[/\\]train"):
        FedReIDLayout(tmp_path, dataset="ilids").parse()
    with pytest.raises(RawLayoutError, match="fixes the split"):
        FedReIDLayout(tmp_path, dataset="viper", split_file=tmp_path / "s.json").parse()


# -- (b) cam_0/ cam_1/ meta.json split.json ---------------------------------------
SMALL_META = {
    "name": "tiny", "shot": "multiple", "num_cameras": 2,
    "identities": [
        [["cam_0/00000_00000.bmp", "cam_0/00000_00001.bmp"], ["cam_1/00000_00000.bmp"]],
        [["cam_0/00001_00000.bmp"], ["cam_1/00001_00000.bmp"]],
        [[], ["cam_1/00002_00000.bmp", "cam_1/00002_00001.bmp"]],
        [["cam_0/00003_00000.bmp"], ["cam_1/00003_00000.bmp"]],
        [[], ["cam_1/00004_00000.bmp"]],
        [["cam_0/00005_00000.bmp"], []],
    ],
}
SMALL_SPLIT = {"trainval": [0, 5], "test_probe": [1, 2, 3], "test_gallery": [1, 2, 3, 4]}


def test_dgd_procedure(tmp_path):
    base = write_dgd(tmp_path, "3dpes", SMALL_META, SMALL_SPLIT,
                     skip_files=["cam_1/00003_00000.bmp"])
    write_image(base / "cam_0" / "99999_00000.bmp", empty=True)
    result = FedReIDLayout(tmp_path, dataset="3dpes").parse()
    assert summary(result) == {
        "train": {("00000_00001.bmp", 0, 0), ("00000_00000.bmp", 0, 1)},
        "val": {("00000_00000.bmp", 0, 0), ("00005_00000.bmp", 5, 0)},
        # cam_0 of the probes (id 2 has none)
        "query": {("00001_00000.bmp", 1, 0), ("00003_00000.bmp", 3, 0)},
        # cam_1 of the probes + every image of gallery-only id 4
        "gallery": {("00001_00000.bmp", 1, 1), ("00002_00000.bmp", 2, 1),
                    ("00002_00001.bmp", 2, 1), ("00004_00000.bmp", 4, 1)},
    }
    assert result.id_split == SMALL_SPLIT
    rules = {s.path.relative_to(base).as_posix(): s.rule for s in result.skipped}
    assert rules == {"cam_1/00003_00000.bmp": "listed in meta.json but missing",
                     "cam_0/99999_00000.bmp": "not listed in meta.json"}


def test_dgd_split_file_override(tmp_path):
    write_dgd(tmp_path, "viper", SMALL_META, SMALL_SPLIT)
    other = {"trainval": [1, 2, 3, 4, 5], "test_probe": [0], "test_gallery": [0]}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    result = FedReIDLayout(tmp_path, dataset="viper", split_file=path).parse()
    assert result.id_split == other
    assert {r.pid for r in by_split(result)["query"]} == {0}


@pytest.mark.parametrize("meta, message", [
    ({"name": "x"}, "identities"),
    ({"identities": [["cam_0/a.bmp"]]}, "identity 0 is not a list of file lists"),
    ({"identities": [[["../outside.bmp"], []]]}, "not inside the folder"),
    ({"identities": [[["cam_0/a.bmp"]]], "num_cameras": 2}, "num_cameras is 2"),
    ("not json", "cannot read"),
])
def test_dgd_bad_meta(tmp_path, meta, message):
    base = tmp_path / "viper"
    base.mkdir()
    (base / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    (base / "split.json").write_text(json.dumps(SMALL_SPLIT))
    with pytest.raises(RawLayoutError, match=message) as info:
        FedReIDLayout(tmp_path, dataset="viper").parse()
    assert str(base / "meta.json") in str(info.value)
    assert '"identities"' in str(info.value)


@pytest.mark.parametrize("split, message", [
    ({"trainval": [0], "test_probe": [1]}, "'test_gallery' is missing"),
    ({"trainval": [0], "test_probe": [1], "test_gallery": [6]}, "'test_gallery'"),
    ({"trainval": [0, 1], "test_probe": [1], "test_gallery": [1]}, "both trainval and test"),
    ([0, 1], "expected a JSON object"),
])
def test_dgd_bad_split(tmp_path, split, message):
    base = write_dgd(tmp_path, "viper", SMALL_META, SMALL_SPLIT)
    (base / "split.json").write_text(json.dumps(split))
    with pytest.raises(RawLayoutError, match=message) as info:
        FedReIDLayout(tmp_path, dataset="viper").parse()
    assert str(base / "split.json") in str(info.value)
    assert '"trainval", "test_probe", "test_gallery"' in str(info.value)


def test_dgd_missing_split_and_camera_folder(tmp_path):
    base = write_dgd(tmp_path, "viper", SMALL_META, SMALL_SPLIT)
    (base / "split.json").unlink()
    with pytest.raises(RawLayoutError, match="split.json"):
        FedReIDLayout(tmp_path, dataset="viper").parse()
    base = write_dgd(tmp_path, "ilids", SMALL_META, SMALL_SPLIT)
    for path in (base / "cam_1").iterdir():
        path.unlink()
    (base / "cam_1").rmdir()
    with pytest.raises(RawLayoutError, match=r"ilids[/\\]cam_1"):
        FedReIDLayout(tmp_path, dataset="ilids").parse()


# -- the benchmark's real metadata: Table 1 ----------------------------------------
TABLE_1 = {  # folder: (dataset, train ids, train_all imgs, query ids, query imgs, gallery imgs)
    "3dpes": ("3dpes", 93, 450, 86, 246, 316),
    "cuhk01": ("cuhk01", 485, 1940, 486, 972, 972),
    "ilids": ("ilids", 59, 248, 60, 98, 130),
    "prid": ("prid2011", 285, 3744, 100, 100, 649),
    "viper": ("viper", 316, 632, 316, 316, 316),
}


@pytest.mark.parametrize("folder", sorted(TABLE_1))
def test_dgd_reproduces_table_1(tmp_path, folder):
    source = DGD_DATA / folder
    if not (source / "meta.json").is_file() or not (source / "split.json").is_file():
        pytest.skip(f"the benchmark's metadata is not at {source} (shared test data, set FEDREID_SHARED_DATA or "
                    "see ../shared/data/README.md; absent outside CI)")
    dataset, train_ids, train_imgs, query_ids, query_imgs, gallery_imgs = TABLE_1[folder]
    copy_dgd_metadata(source, tmp_path, folder)
    result = FedReIDLayout(tmp_path, dataset=dataset).parse()
    s = by_split(result)
    train_all = s["train"] + s["val"]
    assert result.skipped == []
    assert len({r.pid for r in train_all}) == train_ids
    assert len(train_all) == train_imgs
    assert len({r.pid for r in s["query"]}) == query_ids
    assert len(s["query"]) == query_imgs
    assert len(s["gallery"]) == gallery_imgs
    assert len(s["val"]) == train_ids  # one val image per training id
    assert result.id_split == json.loads((source / "split.json").read_text())
    # the registered raw parser's Table 1 counts agree wherever it fixes them
    expected = FedReIDLayout(tmp_path, dataset=dataset).expected
    actual = (train_ids, train_imgs, query_ids, query_imgs, gallery_imgs)
    for field, value in zip(("train_ids", "train_images", "query_ids", "query_images",
                             "gallery_images"), actual):
        assert getattr(expected, field) in (None, value)
