"""Prepared data is never silently wrong: manifest checks, stale copies, stable reports."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from raw_fixtures import make_msmt17_tree, write_bytes, write_image
from test_prepared import ToyParser, make_toy_raw, tree_digest

from fedreid.data import prepared as prepared_mod
from fedreid.data.prepared import (
    PreparedDataset,
    PreparedDatasetError,
    PrepareError,
    load_prepared,
    prepare_dataset,
    raw_fingerprint,
)
from fedreid.data.raw.base import ParseResult, RawRecord
from fedreid.data.raw.msmt17 import MSMT17

HEADER = "path,pid,camid,split,source\n"


def write_manifest(root: Path, rows: list[str], header: str = HEADER) -> Path:
    """``root/manifest.csv`` with ``rows``, and an (empty) image file for each row's path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.csv").write_text(header + "".join(row + "\n" for row in rows))
    for row in rows:
        rel = row.split(",")[0]
        if rel and not rel.startswith("/") and ".." not in rel.split("/"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).touch()
    return root


def load_error(root: Path) -> str:
    with pytest.raises(PreparedDatasetError) as err:
        PreparedDataset.load(root)
    return str(err.value)


GOOD = [
    "images/train/0_1_c0.jpg,1,0,train,Toy/train/1_c0.jpg",
    "images/val/1_1_c1.jpg,1,1,val,Toy/val/1_c1.jpg",
    "images/query/2_5_c0.jpg,5,0,query,Toy/query/5_c0.jpg",
    "images/gallery/3_5_c1.jpg,5,1,gallery,Toy/gallery/5_c1.jpg",
    "images/gallery/4_-1_c1.jpg,-1,1,gallery,Toy/gallery/junk.jpg",
    "images/gallery/5_0_c0.jpg,0,0,gallery,Toy/gallery/0000_c0.jpg",
]


# -- the manifest loader ---------------------------------------------------------
def test_a_benchmark_manifest_with_junk_and_distractors_loads(tmp_path):
    ds = PreparedDataset.load(write_manifest(tmp_path, GOOD))
    assert len(ds) == 6 and {r.pid for r in ds.split("gallery")} == {5, -1, 0}


def test_duplicate_row_names_file_and_both_lines(tmp_path):
    root = write_manifest(tmp_path, GOOD + [GOOD[0]])
    msg = load_error(root)
    assert f"{root / 'manifest.csv'}, line 8: duplicate of line 2 (images/train/0_1_c0.jpg)" in msg


def test_same_image_in_train_and_query_is_an_error(tmp_path):
    rows = GOOD + ["./images/train/0_1_c0.jpg,5,0,query,Toy/query/other.jpg"]
    msg = load_error(write_manifest(tmp_path, rows))
    assert "line 8:" in msg and "line 2" in msg
    assert "images/train/0_1_c0.jpg" in msg and "train" in msg and "query" in msg


def test_same_source_image_twice_is_an_error(tmp_path):
    rows = GOOD + ["images/gallery/9_5_c1.jpg,5,1,gallery,Toy/gallery/5_c1.jpg"]
    msg = load_error(write_manifest(tmp_path, rows))
    assert "line 8:" in msg and "line 5" in msg and "Toy/gallery/5_c1.jpg" in msg


@pytest.mark.parametrize("split, line", [("query", 4), ("gallery", 5)])
def test_identity_in_train_and_test_is_an_error(tmp_path, split, line):
    rows = list(GOOD)
    rows[line - 2] = rows[line - 2].replace(",5,", ",1,")
    root = write_manifest(tmp_path, rows)
    msg = load_error(root)
    assert f"{root / 'manifest.csv'}, line 2: identity 1 is in train and in {split} (line {line})" in msg
    assert "disjoint" in msg


def test_junk_may_be_in_train_and_gallery(tmp_path):
    rows = GOOD + ["images/train/9_-1_c0.jpg,-1,0,train,Toy/train/junk.jpg"]
    assert len(PreparedDataset.load(write_manifest(tmp_path, rows))) == 7


def test_manifest_without_source_column_is_checked_on_paths(tmp_path):
    header = "path,pid,camid,split\n"
    rows = [",".join(r.split(",")[:4]) for r in GOOD]
    assert len(PreparedDataset.load(write_manifest(tmp_path, rows, header))) == 6
    msg = load_error(write_manifest(tmp_path, rows + [rows[2]], header))
    assert "line 8: duplicate of line 4" in msg


def test_a_row_whose_image_file_is_missing_is_refused_naming_the_line(tmp_path):
    root = write_manifest(tmp_path, GOOD)
    (root / "images/val/1_1_c1.jpg").unlink()
    msg = load_error(root)
    assert msg.startswith(f"{root / 'manifest.csv'}, line 3: the image file images/val/1_1_c1.jpg is missing")
    assert "--force" in msg and "\n" not in msg
    (root / "images/gallery/5_0_c0.jpg").unlink()
    assert "line 3:" in load_error(root) and "(and 1 more row(s)' images)" in load_error(root)


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("/etc/hostname", "path '/etc/hostname' is absolute"),
        ("../outside.jpg", "path '../outside.jpg' contains '..'"),
        ("images/../../outside.jpg", "path 'images/../../outside.jpg' contains '..'"),
        ("", "path is empty"),
    ],
)
def test_a_path_outside_the_dataset_folder_is_refused_even_if_the_file_exists(tmp_path, path, fragment):
    (tmp_path / "outside.jpg").touch()
    root = write_manifest(tmp_path / "ds", GOOD + [f"{path},7,0,train,Toy/train/7.jpg"])
    msg = load_error(root)
    assert msg.startswith(f"{root / 'manifest.csv'}, line 8: {fragment}") and "\n" not in msg


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pid", "1.0", "pid '1.0' is not an integer"),
        ("pid", "1_000", "pid '1_000' is not an integer"),
        ("pid", " 3 ", "pid ' 3 ' is not an integer"),
        ("camid", "one", "camid 'one' is not an integer"),
        ("camid", "", "camid '' is not an integer"),
        ("pid", "-7", "pid -7 is below -1 (-1 marks junk, identities are 0 or more)"),
        ("camid", "-3", "camid -3 is negative (cameras count from 0)"),
    ],
)
def test_a_bad_pid_or_camid_is_refused_naming_the_field(tmp_path, field, value, message):
    fields = GOOD[2].split(",")
    fields[1 if field == "pid" else 2] = value
    rows = GOOD[:2] + [",".join(fields)] + GOOD[3:]
    root = write_manifest(tmp_path, rows)
    assert load_error(root) == f"{root / 'manifest.csv'}, line 4: {message}"


@pytest.mark.parametrize("row, count", [("images/train/9.jpg,5", 2), ("images/train/9.jpg", 1),
                                        ("images/train/9_1_c0.jpg,1,0,train,Toy/train/9.jpg,extra,more", 7)])
def test_a_row_with_too_few_or_too_many_fields_is_refused(tmp_path, row, count):
    root = write_manifest(tmp_path, GOOD[:3] + [row] + GOOD[3:])
    assert load_error(root) == (f"{root / 'manifest.csv'}, line 5: {count} field(s), expected 5 as in the header "
                                "(path,pid,camid,split,source)")


def test_a_manifest_without_rows_is_refused(tmp_path):
    root = write_manifest(tmp_path, [])
    msg = load_error(root)
    assert msg.startswith(f"{root / 'manifest.csv'}: no rows, only the header") and "--force" in msg


def test_a_manifest_with_a_byte_order_mark_and_blank_lines_loads_with_true_line_numbers(tmp_path):
    root = write_manifest(tmp_path, GOOD, header="\ufeff" + HEADER)
    assert len(PreparedDataset.load(root)) == 6
    (root / "manifest.csv").write_text("\ufeff" + HEADER + GOOD[0] + "\n\n" + GOOD[1].replace(",1,1,", ",x,1,") + "\n")
    assert "line 4: pid 'x' is not an integer" in load_error(root)


# -- prepare refuses what the loader would refuse -----------------------------------
class LeakyParser(ToyParser):
    """The toy dataset with train identity 1 also in the gallery."""

    def parse(self) -> ParseResult:
        result = super().parse()
        records = [
            RawRecord(r.path, 1, r.camid, r.split) if r.split == "gallery" and r.pid == 6 else r
            for r in result.records
        ]
        return ParseResult(records, result.skipped, result.id_split)


class TwiceParser(ToyParser):
    """The toy dataset with one train image also listed as a query."""

    def parse(self) -> ParseResult:
        result = super().parse()
        train = next(r for r in result.records if r.split == "train")
        extra = RawRecord(train.path, 5, train.camid, "query")
        return ParseResult(result.records + [extra], result.skipped, result.id_split)


def test_prepare_refuses_train_test_identity_overlap(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    with pytest.raises(PrepareError) as err:
        prepare_dataset(LeakyParser(raw), tmp_path / "out", progress=False)
    msg = str(err.value)
    assert msg.startswith("toy: identity 1 is in train") and "gallery" in msg and "disjoint" in msg
    assert str(raw / "Toy") in msg
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_prepare_refuses_an_image_in_two_splits(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    with pytest.raises(PrepareError) as err:
        prepare_dataset(TwiceParser(raw), tmp_path / "out", progress=False)
    msg = str(err.value)
    assert "toy:" in msg and "train" in msg and "query" in msg and str(raw / "Toy") in msg


@pytest.mark.parametrize("layout", ["original", "v2", "repack"])
def test_msmt17_test_ids_are_renumbered_apart_from_train_ids(tmp_path, layout):
    # The release numbers train and test identities from 0000 each: train 0 and
    # query 0 are two people, so the prepared manifest must tell them apart.
    make_msmt17_tree(tmp_path / "raw", layout=layout, quirks=False)
    raw_pids = {(r.path.name, r.pid) for r in MSMT17(tmp_path / "raw").parse().records}
    prepare_dataset(MSMT17(tmp_path / "raw"), tmp_path / "out", progress=False)
    ds = load_prepared(tmp_path / "out", "msmt17")
    train = {r.pid for r in ds.split("train_all")}
    test = {r.pid for r in ds.split("query") + ds.split("gallery")}
    assert train == {0, 1} and not train & test
    assert test == {MSMT17.test_pid_offset + pid for pid in (0, 2, 3)}
    assert {r.pid for r in ds.split("query")} <= test
    assert {0, 2, 3} <= {pid for _, pid in raw_pids}, "the parser keeps the release's numbers"


def test_msmt17_from_the_fedreid_processed_folders_is_renumbered_too(tmp_path):
    from fedreid.data.raw import create_raw_dataset

    base = tmp_path / "raw" / "MSMT17" / "pytorch"
    for subset, label, name in [
        ("train", "0000", "0000_000_01_0303morning_0015_0.jpg"),
        ("val", "0000", "0000_002_07_0303noon_1010_0.jpg"),
        ("query", "0000", "0000_000_10_0113afternoon_0001_0.jpg"),
        ("gallery", "0000", "0000_001_02_0113afternoon_0002_0.jpg"),
    ]:
        write_image(base / subset / label / name)
    prepare_dataset(create_raw_dataset("msmt17", tmp_path / "raw", layout="fedreid"),
                    tmp_path / "out", progress=False)
    ds = load_prepared(tmp_path / "out", "msmt17")
    assert {r.pid for r in ds.split("train_all")} == {0}
    assert {r.pid for r in ds.split("query") + ds.split("gallery")} == {MSMT17.test_pid_offset}


# -- a stale prepared copy is reported -------------------------------------------------
def test_prepare_records_the_raw_file_list(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    prepare_dataset(ToyParser(raw), tmp_path / "out", progress=False)
    made = json.loads((tmp_path / "out/toy/prepare.json").read_text())
    assert made["raw_files"] == raw_fingerprint(raw / "Toy")
    assert made["raw_files"]["files"] == 11 and made["raw_files"]["images"] == 10


def test_fingerprint_sees_names_and_sizes_not_times(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    first = raw_fingerprint(raw / "Toy")
    victim = sorted((raw / "Toy" / "train").glob("*.jpg"))[0]
    victim.touch()
    assert raw_fingerprint(raw / "Toy") == first
    victim.write_bytes(victim.read_bytes() + b"\0")
    assert raw_fingerprint(raw / "Toy")["sha256"] != first["sha256"]


def test_rerun_after_the_raw_folder_gained_an_image_warns_and_force_redoes_it(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw), out, progress=False)
    assert not prepare_dataset(ToyParser(raw), out, progress=False).warnings
    write_image(raw / "Toy" / "train" / "1_c0_99.jpg", seed=99)
    before = tree_digest(raw)
    again = prepare_dataset(ToyParser(raw), out, progress=False)
    assert again.skipped_existing
    [warning] = again.warnings
    assert warning.startswith(f"toy: raw folder {raw / 'Toy'} now has 11 images, 10 when prepared")
    assert "stale" in warning and "--force" in warning
    assert tree_digest(raw) == before, "raw data must never change"
    forced = prepare_dataset(ToyParser(raw), out, force=True, progress=False)
    assert not forced.skipped_existing
    assert not prepare_dataset(ToyParser(raw), out, progress=False).warnings


def test_rerun_after_the_raw_folder_lost_an_image_warns(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw), out, progress=False)
    sorted((raw / "Toy" / "gallery").glob("*.jpg"))[0].unlink()
    [warning] = prepare_dataset(ToyParser(raw), out, progress=False).warnings
    assert "now has 9 images, 10 when prepared" in warning and "stale" in warning


def test_rerun_after_a_file_was_replaced_warns(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw), out, progress=False)
    (raw / "Toy" / "train" / "Thumbs.db").write_bytes(b"a longer system file")
    [warning] = prepare_dataset(ToyParser(raw), out, progress=False).warnings
    assert "names or sizes" in warning and "stale" in warning and "--force" in warning


def test_old_prepare_record_without_fingerprint_cannot_be_checked(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw), out, progress=False)
    record = out / "toy" / "prepare.json"
    made = json.loads(record.read_text())
    del made["raw_files"]
    record.write_text(json.dumps(made))
    [warning] = prepare_dataset(ToyParser(raw), out, progress=False).warnings
    assert "cannot be checked" in warning and str(record) in warning and "--force" in warning


def test_raw_folder_removed_after_preparing_keeps_the_copy_with_a_note(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw), out, progress=False)
    for path in sorted((raw / "Toy").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (raw / "Toy").rmdir()
    again = prepare_dataset(ToyParser(raw), out, progress=False)
    assert again.skipped_existing and not again.warnings
    assert any(str(raw / "Toy") in note and "kept as is" in note for note in again.notes)
    assert len(load_prepared(out, "toy")) == 10


# -- parser options and split-file contents are recorded ------------------------------
@dataclass
class ToyOptions:
    boxes: str = "detected"


class OptionToyParser(ToyParser):
    """The toy layout with a parser option, as cuhk03np's ``boxes``."""

    Options = ToyOptions


def test_rerun_with_other_parser_options_warns_and_keeps_the_copy(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    prepare_dataset(OptionToyParser(raw), out, progress=False)
    made = json.loads((out / "toy" / "prepare.json").read_text())
    assert made["options"] == {"boxes": "detected"}
    assert not prepare_dataset(OptionToyParser(raw), out, progress=False).warnings
    stamp = (out / "toy" / "manifest.csv").stat().st_mtime_ns
    again = prepare_dataset(OptionToyParser(raw, boxes="labeled"), out, progress=False)
    assert again.skipped_existing
    [warning] = again.warnings
    assert "options={'boxes': 'detected'}" in warning and "'labeled'" in warning
    assert "kept as is" in warning and "--force" in warning
    assert (out / "toy" / "manifest.csv").stat().st_mtime_ns == stamp
    forced = prepare_dataset(OptionToyParser(raw, boxes="labeled"), out, force=True, progress=False)
    assert not forced.skipped_existing
    assert not prepare_dataset(OptionToyParser(raw, boxes="labeled"), out, progress=False).warnings


def test_rerun_with_an_edited_split_file_warns(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [1, 2], "test": [5, 6]}))
    prepare_dataset(ToyParser(raw, split_file=split), out, progress=False)
    made = json.loads((out / "toy" / "prepare.json").read_text())
    assert made["split_file_sha256"] == hashlib.sha256(split.read_bytes()).hexdigest()
    assert not prepare_dataset(ToyParser(raw, split_file=split), out, progress=False).warnings
    split.write_text(json.dumps({"train": [5, 6], "test": [1, 2]}))
    again = prepare_dataset(ToyParser(raw, split_file=split), out, progress=False)
    assert again.skipped_existing
    [warning] = again.warnings
    assert f"the split file {split} has other contents" in warning and "--force" in warning


def test_old_prepare_record_without_options_or_split_hash_still_works(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    out = tmp_path / "out"
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [1, 2], "test": [5, 6]}))
    record = out / "toy" / "prepare.json"

    def age_record() -> None:
        made = json.loads(record.read_text())
        del made["options"], made["split_file_sha256"]
        record.write_text(json.dumps(made))

    prepare_dataset(ToyParser(raw), out, progress=False)
    age_record()
    assert not prepare_dataset(ToyParser(raw), out, progress=False).warnings, "nothing to compare"
    prepare_dataset(OptionToyParser(raw, split_file=split), out, force=True, progress=False)
    age_record()
    again = prepare_dataset(OptionToyParser(raw, split_file=split), out, progress=False)
    assert again.skipped_existing and len(again.warnings) == 2
    assert all("cannot be checked" in w and str(record) in w for w in again.warnings)
    assert "parser options" in again.warnings[0] and str(split) in again.warnings[1]
    assert len(load_prepared(out, "toy")) == 10


# -- reports are deterministic ----------------------------------------------------------
def test_skipped_csv_is_identical_across_runs_with_a_corrupt_image(tmp_path):
    raw = make_toy_raw(tmp_path / "raw")
    victim = sorted((raw / "Toy" / "gallery").glob("6_*.jpg"))[0]
    write_bytes(victim, b"this is not a JPEG at all")
    texts = []
    for out in ("out1", "out2"):
        report = prepare_dataset(ToyParser(raw), tmp_path / out, progress=False)
        assert [s.path for s in report.skipped if "unreadable" in s.rule] == [victim]
        texts.append((tmp_path / out / "toy" / "skipped.csv").read_bytes())
    assert texts[0] == texts[1]
    assert b"0x" not in texts[0] and b"object at" not in texts[0]
    assert b"cannot identify image file" in texts[0]


def test_a_write_failure_aborts_instead_of_blaming_the_image(tmp_path):
    src = write_image(tmp_path / "a.jpg")
    assert prepared_mod._copy_checked(src, tmp_path / "copy.jpg", None) is None
    assert "cannot identify" in prepared_mod._copy_checked(write_bytes(tmp_path / "b.jpg"), tmp_path / "x.jpg", None)
    with pytest.raises(OSError):
        prepared_mod._copy_checked(src, tmp_path / "no" / "such" / "folder.jpg", None)
