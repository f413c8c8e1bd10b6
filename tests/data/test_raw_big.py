"""Raw-layout parsers of the four big datasets, on tiny copies of their layouts."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path
from typing import Callable

import pytest

from fedreid.data.prepared import PreparedDataset, PrepareError, prepare_dataset
from fedreid.data.raw.base import SPLITS, ParseResult, RawDataset, RawLayoutError, RawRecord, summarize_skips
from fedreid.data.raw.cuhk03np import CUHK03NP
from fedreid.data.raw.dukemtmc import DukeMTMCreID
from fedreid.data.raw.market1501 import Market1501
from fedreid.data.raw.msmt17 import MSMT17

try:
    import raw_fixtures as fx
except ImportError:  # tests/ collected as a package
    from tests import raw_fixtures as fx


def table(result: ParseResult, root: Path) -> dict[str, tuple[int, int, str]]:
    """``relative path -> (pid, camid, split)`` of every record."""
    out = {r.path.relative_to(root).as_posix(): (r.pid, r.camid, r.split) for r in result.records}
    assert len(out) == len(result.records), "an image was recorded twice"
    return out


def skip_rules(result: ParseResult, root: Path) -> dict[str, str]:
    return {s.path.relative_to(root).as_posix(): s.rule for s in result.skipped}


def assert_val_carved(records: list[RawRecord]) -> None:
    """Exactly one val image per training id: its first by sorted path."""
    by_pid: dict[int, list[RawRecord]] = defaultdict(list)
    for rec in records:
        if rec.split in ("train", "val"):
            by_pid[rec.pid].append(rec)
    assert by_pid
    for recs in by_pid.values():
        first = min(recs, key=lambda r: str(r.path))
        assert first.split == "val"
        assert sum(r.split == "val" for r in recs) == 1


def count(result: ParseResult, split: str) -> int:
    return sum(r.split == split for r in result.records)


# -- behaviour shared by every parser ------------------------------------------
#: (parser factory, fixture writer, folder whose removal must be reported).
CASES: dict[str, tuple[Callable[[Path], RawDataset], Callable[[Path], Path], str]] = {
    "market1501": (Market1501, fx.make_market1501_tree, "query"),
    "dukemtmc": (DukeMTMCreID, fx.make_dukemtmc_tree, "bounding_box_test"),
    "cuhk03np": (CUHK03NP, fx.make_cuhk03np_tree, "detected/bounding_box_train"),
    "cuhk03np-labeled": (
        lambda raw: CUHK03NP(raw, boxes="labeled"),
        fx.make_cuhk03np_tree,
        "labeled/query",
    ),
    "msmt17": (MSMT17, fx.make_msmt17_tree, "test"),
    "msmt17-v2": (MSMT17, lambda raw: fx.make_msmt17_tree(raw, layout="v2"), "mask_test_v2"),
    "msmt17-repack": (
        MSMT17,
        lambda raw: fx.make_msmt17_tree(raw, layout="repack"),
        "bounding_box_train",
    ),
}


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    factory, make, folder = CASES[request.param]
    root = make(tmp_path)
    return factory(tmp_path), root, folder


def test_records_are_well_formed(case):
    parser, root, _ = case
    result = parser.parse()
    assert result.records and result.id_split is None
    for rec in result.records:
        assert rec.split in SPLITS
        assert rec.camid >= 0
        assert rec.path.is_absolute() and rec.path.is_file()
        assert root in rec.path.parents
    # Every split is present, and the training ids have a val image.
    assert {r.split for r in result.records} == set(SPLITS)


def test_parse_is_deterministic(case):
    parser, _, _ = case
    first, second = parser.parse(), parser.parse()
    assert first.records == second.records
    assert first.skipped == second.skipped
    assert first.records == sorted(first.records, key=lambda r: (r.split, str(r.path)))


def test_missing_folder_names_the_path(case):
    parser, root, folder = case
    shutil.rmtree(root / folder)
    with pytest.raises(RawLayoutError) as err:
        parser.parse()
    assert str(root / folder) in str(err.value)


def test_missing_release_names_the_path(tmp_path):
    for cls in (Market1501, DukeMTMCreID, CUHK03NP):
        with pytest.raises(RawLayoutError) as err:
            cls(tmp_path).parse()
        assert str(tmp_path / cls.dataset_dir) in str(err.value)


def test_parsers_are_registered():
    from fedreid.data.raw import PARSERS as _REGISTRY

    for cls in (Market1501, DukeMTMCreID, CUHK03NP, MSMT17):
        assert _REGISTRY[cls.name] is cls
    assert [cls.name for cls in (Market1501, DukeMTMCreID, CUHK03NP, MSMT17)] == [
        "market1501",
        "dukemtmc",
        "cuhk03np",
        "msmt17",
    ]


def test_create_raw_dataset_passes_options(tmp_path):
    from fedreid.data.raw import create_raw_dataset

    parser = create_raw_dataset("cuhk03np", tmp_path, boxes="labeled", seed=3)
    assert isinstance(parser, CUHK03NP) and parser.boxes == "labeled" and parser.seed == 3


def test_create_raw_dataset_names_a_misspelt_option(tmp_path):
    from fedreid.config import ConfigError
    from fedreid.data.raw import create_raw_dataset

    with pytest.raises(ConfigError) as err:
        create_raw_dataset("cuhk03np", tmp_path, box="labeled")
    assert str(err.value).startswith("cuhk03np: 'box' is not an option")
    assert "allowed options: boxes" in str(err.value)


@pytest.mark.parametrize("name", ["market1501", "dukemtmc", "cuhk03np", "msmt17"])
def test_prepare_checks_the_fixture_against_table_1(tmp_path, name):
    # The tiny fixtures cannot have the paper's counts: preparing one must warn,
    # naming the dataset, the count found and Table 1's (the parser's ``expected``).
    from fedreid.data.prepared import card_counts, prepare_dataset

    factory, make, _ = CASES[name]
    make(tmp_path / "raw")
    parser = factory(tmp_path / "raw")
    report = prepare_dataset(parser, tmp_path / "out", progress=False)
    found, table_1 = card_counts(report.card), parser.expected
    assert table_1 is not None and table_1.train_images > found.train_images
    assert f"{name}: train images is {found.train_images:,}, expected {table_1.train_images:,}" in report.warnings
    assert f"{name}: query ids is {found.query_ids:,}, expected {table_1.query_ids:,}" in report.warnings
    assert all(w.startswith(f"{name}: ") for w in report.warnings)
    assert len(report.warnings) == 5  # every Table 1 count differs on a fixture


# -- Market-1501 ---------------------------------------------------------------
def test_market1501_records(tmp_path):
    root = fx.make_market1501_tree(tmp_path)
    result = Market1501(tmp_path).parse()
    assert table(result, root) == {
        "bounding_box_train/0002_c1s1_000451_03.jpg": (2, 0, "val"),
        "bounding_box_train/0002_c2s1_000301_01.jpg": (2, 1, "train"),
        "bounding_box_train/0007_c3s3_000401_02.jpg": (7, 2, "val"),
        "bounding_box_train/0007_c6s1_001001_01.jpg.jpg": (7, 5, "train"),
        "bounding_box_train/0011_c5s1_000101_01.jpg": (11, 4, "val"),
        "bounding_box_test/-1_c1s1_000401_03.jpg": (-1, 0, "gallery"),
        "bounding_box_test/0000_c1s1_000151_01.jpg": (0, 0, "gallery"),
        "bounding_box_test/0000_c6s4_000501_02.jpg": (0, 5, "gallery"),
        "bounding_box_test/0001_c2s1_000101_02.jpg": (1, 1, "gallery"),
        "bounding_box_test/0003_c4s2_000101_02.jpg": (3, 3, "gallery"),
        "bounding_box_test/0003_c5s1_000201_01.jpg": (3, 4, "gallery"),
        "query/0001_c1s1_001051_00.jpg": (1, 0, "query"),
        "query/0003_c6s2_000201_00.jpg": (3, 5, "query"),
    }
    assert_val_carved(result.records)


def test_market1501_skips_are_counted_with_their_rule(tmp_path):
    root = fx.make_market1501_tree(tmp_path)
    rules = skip_rules(Market1501(tmp_path).parse(), root)
    assert set(rules) == {
        f"{folder}/{name}"
        for folder in ("bounding_box_train", "bounding_box_test")
        for name in fx.QUIRK_FILES
    }
    assert rules["bounding_box_train/Thumbs.db"] == "system file"
    assert rules["bounding_box_test/README.txt"].startswith("not an image")
    assert "does not match" in rules["bounding_box_train/misnamed.jpg"]
    # gt_bbox/ and gt_query/ are not read at all, so nothing of theirs is skipped.
    assert not any(path.startswith("gt_") for path in rules)


def test_names_whose_ids_a_manifest_cannot_hold_are_counted_skips_and_the_rest_prepares(tmp_path):
    # camera c0 (cameras count from 1) and pid -2 (below junk's -1) would make a manifest its loader refuses
    root = fx.make_market1501_tree(tmp_path / "raw", quirks=False)
    fx.write_image(root / "bounding_box_train" / "0002_c0s1_000999_01.jpg")
    fx.write_image(root / "bounding_box_test" / "-2_c1s1_000999_01.jpg")
    result = Market1501(tmp_path / "raw").parse()
    rules = skip_rules(result, root)
    assert rules == {
        "bounding_box_train/0002_c0s1_000999_01.jpg": "camera number below the release's first camera",
        "bounding_box_test/-2_c1s1_000999_01.jpg": "pid below -1 (-2; -1 marks junk, identities count from 0)",
    }
    assert all(r.pid >= -1 and r.camid >= 0 for r in result.records)
    prepare_dataset(Market1501(tmp_path / "raw"), tmp_path / "out", progress=False)
    assert len(PreparedDataset.load(tmp_path / "out" / "market1501").records) == len(result.records)


def test_a_release_extracted_one_level_too_deep_names_the_nested_files(tmp_path):
    root = fx.make_market1501_tree(tmp_path / "raw", quirks=False)
    train = root / "bounding_box_train"
    train.rename(root / "moved")
    train.mkdir()
    (root / "moved").rename(train / "bounding_box_train")
    result = Market1501(tmp_path / "raw").parse()
    nested = [s for s in result.skipped if s.path.parent == train / "bounding_box_train"]
    assert len(nested) == len(fx.MARKET1501_FILES["bounding_box_train"]) == len(result.skipped)
    assert {s.rule for s in nested} == {
        "in a subfolder of an image folder, not read (images belong directly in bounding_box_train/)"}
    with pytest.raises(PrepareError, match=r"train split is empty .* most often \d+ x in a subfolder of an image "
                                           r"folder, not read \(e\.g\. .*bounding_box_train/bounding_box_train/"):
        prepare_dataset(Market1501(tmp_path / "raw"), tmp_path / "out", progress=False)


def test_market1501_doubled_extension_is_used(tmp_path):
    root = fx.make_market1501_tree(tmp_path, quirks=False)
    result = Market1501(tmp_path).parse()
    doubled = [r for r in result.records if r.path.name.endswith(".jpg.jpg")]
    assert [r.path for r in doubled] == [
        root / "bounding_box_train" / "0007_c6s1_001001_01.jpg.jpg"
    ]
    assert result.skipped == []
    assert count(result, "train") + count(result, "val") == len(
        fx.MARKET1501_FILES["bounding_box_train"]
    )


# -- DukeMTMC-reID -------------------------------------------------------------
def test_dukemtmc_records(tmp_path):
    root = fx.make_dukemtmc_tree(tmp_path)
    result = DukeMTMCreID(tmp_path).parse()
    assert table(result, root) == {
        "bounding_box_train/0001_c2_f0046182.jpg": (1, 1, "val"),
        "bounding_box_train/0001_c5_f0051341.jpg": (1, 4, "train"),
        "bounding_box_train/0005_c1_f0001234.jpg": (5, 0, "val"),
        "bounding_box_train/0005_c8_f0032001.jpg": (5, 7, "train"),
        "bounding_box_test/0002_c1_f0044158.jpg": (2, 0, "gallery"),
        "bounding_box_test/0002_c7_f0101001.jpg": (2, 6, "gallery"),
        "bounding_box_test/0004_c8_f0199990.jpg": (4, 7, "gallery"),
        "bounding_box_test/0701_c3_f0003000.jpg": (701, 2, "gallery"),
        "query/0002_c3_f0044200.jpg": (2, 2, "query"),
        "query/0004_c6_f0199000.jpg": (4, 5, "query"),
    }
    assert_val_carved(result.records)
    rules = skip_rules(result, root)
    folders = ("bounding_box_train", "query")
    assert set(rules) == {f"{f}/{n}" for f in folders for n in fx.QUIRK_FILES}


# -- CUHK03-NP -----------------------------------------------------------------
def test_cuhk03np_detected_by_default(tmp_path):
    root = fx.make_cuhk03np_tree(tmp_path)
    parser = CUHK03NP(tmp_path)
    assert parser.boxes == "detected"
    assert parser.expected.train_images == 7365 and parser.expected.gallery_images == 5332
    result = parser.parse()
    assert table(result, root / "detected") == {
        "bounding_box_train/0001_c1_1.png": (1, 0, "val"),
        "bounding_box_train/0001_c2_6.png": (1, 1, "train"),
        "bounding_box_train/0003_c1_2.png": (3, 0, "val"),
        "bounding_box_train/0003_c2_7.png": (3, 1, "train"),
        "bounding_box_test/0002_c2_6.png": (2, 1, "gallery"),
        "bounding_box_test/0004_c2_7.png": (4, 1, "gallery"),
        "query/0002_c1_1.png": (2, 0, "query"),
        "query/0004_c1_2.png": (4, 0, "query"),
    }
    rules = skip_rules(result, root / "detected")
    assert set(rules) == {f"bounding_box_train/{n}" for n in fx.QUIRK_FILES}


def test_cuhk03np_labeled_reads_the_labeled_folder(tmp_path):
    root = fx.make_cuhk03np_tree(tmp_path)
    parser = CUHK03NP(tmp_path, boxes="labeled")
    assert parser.expected.train_images == 7368 and parser.expected.gallery_images == 5328
    # The class default is left alone for other instances.
    assert CUHK03NP.expected.train_images == 7365
    result = parser.parse()
    assert all((root / "labeled") in r.path.parents for r in result.records)
    files = fx.CUHK03NP_FILES["labeled"]
    assert count(result, "train") + count(result, "val") == len(files["bounding_box_train"])
    assert count(result, "gallery") == len(files["bounding_box_test"])
    assert_val_carved(result.records)


def test_cuhk03np_bad_boxes_value(tmp_path):
    with pytest.raises(ValueError) as err:
        CUHK03NP(tmp_path, boxes="manual")
    assert "detected" in str(err.value) and "labeled" in str(err.value)
    assert "manual" in str(err.value)


# -- MSMT17, original release --------------------------------------------------
def test_msmt17_original_records(tmp_path):
    root = fx.make_msmt17_tree(tmp_path)
    result = MSMT17(tmp_path).parse()
    assert table(result, root) == {
        "train/0000/0000_000_01_0303morning_0015_0.jpg": (0, 0, "train"),
        "train/0000/0000_001_15_0303morning_0042_1.jpg": (0, 14, "train"),
        "train/0001/0001_000_07_0113noon_0100_0.jpg": (1, 6, "train"),
        "train/0000/0000_002_03_0303noon_0017_0.jpg": (0, 2, "val"),
        "train/0001/0001_001_12_0114afternoon_0200_2.jpg": (1, 11, "val"),
        "test/0000/0000_000_10_0113morning_0016_0.jpg": (0, 9, "query"),
        "test/0002/0002_000_15_0302noon_0300_0.jpg": (2, 14, "query"),
        "test/0000/0000_003_02_0113morning_0900_0.jpg": (0, 1, "gallery"),
        "test/0002/0002_004_14_0302noon_0400_0.jpg": (2, 13, "gallery"),
        "test/0003/0003_000_05_0303afternoon_0500_0.jpg": (3, 4, "gallery"),
    }


def test_msmt17_original_uses_the_official_val_list(tmp_path):
    fx.make_msmt17_tree(tmp_path, quirks=False)
    result = MSMT17(tmp_path).parse()
    train_dir = tmp_path / "MSMT17_V1" / "train"
    val = {r.path.relative_to(train_dir).as_posix() for r in result.records if r.split == "val"}
    assert val == {rel for rel, _ in fx.MSMT17_LISTS["val"]}
    assert result.skipped == []


def test_msmt17_original_skips(tmp_path):
    root = fx.make_msmt17_tree(tmp_path)
    result = MSMT17(tmp_path).parse()
    rules = skip_rules(result, root)

    missing_line, malformed_line = (line for _, line, _ in fx.MSMT17_BAD_LINES)
    missing_rel = "train/" + missing_line.split()[0]
    n = fx.msmt17_list_line_number("train", missing_line)
    assert rules[missing_rel] == f"listed file is missing (list_train.txt line {n})"

    n = fx.msmt17_list_line_number("gallery", malformed_line)
    assert rules["list_gallery.txt"] == (f"malformed line, expected '<pid>/<file> <pid>' inside the image folder "
                                         f"(list_gallery.txt line {n}: {malformed_line!r})")

    assert "not named by any list" in rules["train/" + fx.MSMT17_UNLISTED]
    assert rules["train/0000/Thumbs.db"] == "system file"
    assert rules["test/README.txt"].startswith("not an image")
    assert len(result.skipped) == 5


def test_msmt17_camera_00_is_a_counted_skip_and_a_listed_file_nested_deeper_says_so(tmp_path):
    root = fx.make_msmt17_tree(tmp_path, quirks=False)
    fx.write_image(root / "train" / "0001" / "0001_007_00_0113noon_0777_0.jpg")
    fx.write_image(root / "train" / "0001" / "deep" / "0001_008_04_0113noon_0888_0.jpg")
    with open(root / "list_train.txt", "a") as handle:
        handle.write("0001/0001_007_00_0113noon_0777_0.jpg 1\n0001/deep/0001_008_04_0113noon_0888_0.jpg 1\n")
    n = len(fx.MSMT17_LISTS["train"])
    result = MSMT17(tmp_path).parse()
    rules = [(s.path.relative_to(root).as_posix(), s.rule) for s in result.skipped]
    assert rules == [
        ("train/0001/deep/0001_008_04_0113noon_0888_0.jpg",
         "in a subfolder of an image folder, not read (images belong directly in 0001/)"),
        ("train/0001/0001_007_00_0113noon_0777_0.jpg",
         f"camera number below the release's first camera (list_train.txt line {n + 1})"),
        ("train/0001/deep/0001_008_04_0113noon_0888_0.jpg",
         f"listed file is below the <pid>/<file> folders (list_train.txt line {n + 2})"),
    ]
    assert all(r.camid >= 0 for r in result.records)


def test_msmt17_duplicate_list_line_is_skipped(tmp_path):
    root = fx.make_msmt17_tree(tmp_path, quirks=False)
    rel, label = fx.MSMT17_LISTS["train"][0]
    with open(root / "list_val.txt", "a") as handle:
        handle.write(f"{rel} {label}\n")
    result = MSMT17(tmp_path).parse()
    [skip] = result.skipped
    n = len(fx.MSMT17_LISTS["val"]) + 1
    assert skip.rule == f"listed twice (list_val.txt line {n}; first at list_train.txt line 1)"
    assert table(result, root)[f"train/{rel}"] == (label, 0, "train")


def test_msmt17_list_skips_group_by_rule_with_their_place_in_the_reason(tmp_path):
    # A partly extracted release: thousands of listed files missing must print as one line.
    root = fx.make_msmt17_tree(tmp_path)
    missing = [f"0100/0100_{i:03d}_02_0303morning_0015_0.jpg 100" for i in range(40)]
    malformed = ["0000/a (copy).jpg zero", "/abs/0000_000_01_x.jpg 0", "../0000/0000_000_01_x.jpg 0"]
    with open(root / "list_train.txt", "a") as handle:
        handle.write("\n".join(missing + malformed) + "\n")
    result = MSMT17(tmp_path).parse()
    groups = {rule: (count, example) for rule, count, example in summarize_skips(result.skipped)}
    first_missing = len(fx.MSMT17_LISTS["train"]) + 2  # after the fixture's own missing line
    assert groups["listed file is missing"] == (41, root / "train" / fx.MSMT17_BAD_LINES[0][1].split()[0])
    assert first_missing == fx.msmt17_list_line_number("train", fx.MSMT17_BAD_LINES[0][1]) + 1
    assert groups["malformed line, expected '<pid>/<file> <pid>' inside the image folder"] == (
        4, root / "list_train.txt")
    skipped_rules = [s.rule for s in result.skipped]
    assert f"listed file is missing (list_train.txt line {first_missing})" in skipped_rules


def test_msmt17_missing_list_file(tmp_path):
    root = fx.make_msmt17_tree(tmp_path)
    (root / "list_query.txt").unlink()
    with pytest.raises(RawLayoutError) as err:
        MSMT17(tmp_path).parse()
    assert str(root / "list_query.txt") in str(err.value)


def test_msmt17_neither_layout_names_both_paths(tmp_path):
    with pytest.raises(RawLayoutError) as err:
        MSMT17(tmp_path).parse()
    assert str(tmp_path / "MSMT17_V1") in str(err.value)
    assert str(tmp_path / "MSMT17") + " " in str(err.value)


def test_msmt17_second_release_reads_as_the_first_from_its_mask_folders(tmp_path):
    fx.make_msmt17_tree(tmp_path / "a")
    v1 = MSMT17(tmp_path / "a").parse()
    v2_root = fx.make_msmt17_tree(tmp_path / "b", layout="v2")
    parser = MSMT17(tmp_path / "b")
    v2 = parser.parse()
    assert parser.source_dir == v2_root
    assert {r.path.relative_to(v2_root).parts[0] for r in v2.records} == {"mask_train_v2", "mask_test_v2"}

    def rows(result, root):  # each record by its path below its image folder
        return {r.path.relative_to(root).parts[1:]: (r.pid, r.camid, r.split) for r in result.records}

    assert len(rows(v2, v2_root)) == len(v2.records) == len(v1.records)
    assert rows(v2, v2_root) == rows(v1, tmp_path / "a" / "MSMT17_V1")
    assert len(v2.skipped) == len(v1.skipped) == 5  # the same quirks, counted the same way


def test_msmt17_first_release_wins_over_the_second_and_the_repack(tmp_path):
    fx.make_msmt17_tree(tmp_path, layout="v2")
    fx.make_msmt17_tree(tmp_path, layout="repack")
    original = fx.make_msmt17_tree(tmp_path)
    assert all(original in r.path.parents for r in MSMT17(tmp_path).parse().records)


def test_msmt17_original_wins_over_repack(tmp_path):
    fx.make_msmt17_tree(tmp_path, layout="repack")
    original = fx.make_msmt17_tree(tmp_path)
    result = MSMT17(tmp_path).parse()
    assert all(original in r.path.parents for r in result.records)


# -- MSMT17, Market-style repack -----------------------------------------------
def test_msmt17_repack_records(tmp_path):
    root = fx.make_msmt17_tree(tmp_path, layout="repack")
    result = MSMT17(tmp_path).parse()
    assert table(result, root) == {
        "bounding_box_train/0000_c15_0303morning_0042_1.jpg": (0, 14, "val"),
        "bounding_box_train/0000_c1_0303morning_0015_0.jpg": (0, 0, "train"),
        "bounding_box_train/0000_c3_0303noon_0017_0.jpg": (0, 2, "train"),
        "bounding_box_train/0001_c12_0114afternoon_0200_2.jpg": (1, 11, "val"),
        "bounding_box_train/0001_c7_0113noon_0100_0.jpg": (1, 6, "train"),
        "bounding_box_test/0000_c2_0113morning_0900_0.jpg": (0, 1, "gallery"),
        "bounding_box_test/0002_c14_0302noon_0400_0.jpg": (2, 13, "gallery"),
        "bounding_box_test/0003_c5_0303afternoon_0500_0.jpg": (3, 4, "gallery"),
        "query/0000_c10_0113morning_0016_0.jpg": (0, 9, "query"),
        "query/0002_c15_0302noon_0300_0.jpg": (2, 14, "query"),
    }
    assert_val_carved(result.records)
    assert set(skip_rules(result, root)) == {f"bounding_box_train/{n}" for n in fx.QUIRK_FILES}


def test_msmt17_camera_15_is_camid_14_in_both_layouts(tmp_path):
    for layout in ("original", "repack"):
        raw = tmp_path / layout
        fx.make_msmt17_tree(raw, layout=layout, quirks=False)
        cams = {r.camid for r in MSMT17(raw).parse().records}
        assert 14 in cams and max(cams) == 14
        # A one-digit camera regex would read c15 / 15 as camera 1 (camid 0)
        # and keep camid 0 for the first camera too; 0 must come only from c1.
        assert cams <= set(range(15))
