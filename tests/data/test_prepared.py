import hashlib
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedreid.data import prepared as prepared_mod
from fedreid.data.prepared import (
    PreparedDataset,
    PreparedDatasetError,
    PrepareError,
    load_prepared,
    prepare_dataset,
)
from fedreid.data.raw.base import ExpectedCounts, ParseResult, RawDataset, RawRecord, Skip


def write_image(path: Path, seed: int = 0, h: int = 16, w: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    assert cv2.imwrite(str(path), img)
    return path


class ToyParser(RawDataset):
    """Two train ids, one val image each, query/gallery with junk."""

    name = "toy"
    dataset_dir = "Toy"
    expected = ExpectedCounts(train_ids=2, train_images=6, query_ids=1, query_images=1, gallery_images=3)

    def parse(self) -> ParseResult:
        specs = [
            ("train", 1, 0), ("train", 1, 1), ("val", 1, 0),
            ("train", 2, 0), ("train", 2, 1), ("val", 2, 1),
            ("query", 5, 0),
            ("gallery", 5, 1), ("gallery", 6, 0), ("gallery", -1, 1),
        ]
        records = []
        for i, (split, pid, cam) in enumerate(specs):
            path = self.root / split / f"{pid}_c{cam}_{i}.jpg"
            records.append(RawRecord(path, pid, cam, split))
        skipped = [Skip(self.root / "train" / "Thumbs.db", "system file")]
        return ParseResult(sorted(records, key=lambda r: str(r.path)), skipped, {"seed": self.seed})


def make_toy_raw(root: Path) -> Path:
    parser = ToyParser(root)
    for i, rec in enumerate(parser.parse().records):
        write_image(rec.path, seed=i)
    (root / "Toy" / "train" / "Thumbs.db").write_bytes(b"\x00junk")
    return root


@pytest.fixture
def raw_root(tmp_path):
    return make_toy_raw(tmp_path / "raw")


def tree_digest(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_prepare_writes_manifest_card_and_copies(raw_root, tmp_path):
    before = tree_digest(raw_root)
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert tree_digest(raw_root) == before, "raw data must never change"
    assert report.num_images == 10 and not report.warnings
    ds = load_prepared(tmp_path / "out", "toy")
    assert len(ds) == 10
    assert len(ds.split("train_all")) == 6 and len(ds.split("train")) == 4
    assert {r.pid for r in ds.split("gallery")} == {5, 6, -1}
    # prepared copies are byte-identical to their sources when not resized
    source = {row.split(",")[0]: row.split(",")[4] for row in
              (tmp_path / "out/toy/manifest.csv").read_text().splitlines()[1:]}
    for rec in ds.records:
        rel = rec.path.relative_to(ds.root).as_posix()
        assert rec.path.read_bytes() == (raw_root / source[rel]).read_bytes()
    card = json.loads((tmp_path / "out/toy/card.json").read_text())
    assert card["train_all"] == {"ids": 2, "images": 6, "cameras": [0, 1]}
    assert card["gallery"]["junk_images"] == 1 and card["gallery"]["ids"] == 2
    assert json.loads((tmp_path / "out/toy/split.json").read_text()) == {"seed": 0}
    skipped = (tmp_path / "out/toy/skipped.csv").read_text()
    assert "Thumbs.db" in skipped and "system file" in skipped
    assert "| train_all | 2 | 6 | 0, 1 |" in (tmp_path / "out/toy/card.md").read_text()


def test_truncated_image_is_a_named_skip(raw_root, tmp_path):
    victim = sorted((raw_root / "Toy" / "gallery").glob("6_*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:40])
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert report.num_images == 9
    bad = [s for s in report.skipped if s.path == victim]
    assert bad and "unreadable or truncated image" in bad[0].rule
    assert any("gallery images is 2, expected 3" in w for w in report.warnings)
    assert str(victim) in (tmp_path / "out/toy/skipped.csv").read_text()


def test_missing_image_is_a_named_skip(raw_root, tmp_path):
    victim = sorted((raw_root / "Toy" / "train").glob("1_*.jpg"))[0]
    victim.unlink()
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert [s.path for s in report.skipped if "unreadable" in s.rule] == [victim]


def test_empty_split_is_an_error_naming_dataset_and_split(raw_root, tmp_path):
    for path in (raw_root / "Toy" / "query").glob("*.jpg"):
        path.write_bytes(b"")
    with pytest.raises(PrepareError, match="toy: the query split is empty"):
        prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "toy").exists()
    assert not list((tmp_path / "out").glob(".toy.tmp-*"))


class MisnamedParser(ToyParser):
    """Every query and gallery file misnamed: those splits parse empty, with the skips."""

    def parse(self) -> ParseResult:
        result = super().parse()
        kept = [r for r in result.records if r.split in ("train", "val")]
        misnamed = [Skip(r.path, "name does not match '^(\\d+)_c(\\d+)'")
                    for r in result.records if r not in kept]
        return ParseResult(kept, result.skipped + misnamed, result.id_split)


def test_empty_split_error_names_the_most_common_skip_rule(raw_root, tmp_path):
    with pytest.raises(PrepareError) as info:
        prepare_dataset(MisnamedParser(raw_root), tmp_path / "out", progress=False)
    message = str(info.value)
    first_gallery = sorted((raw_root / "Toy" / "gallery").glob("*.jpg"))[0]
    assert message.startswith("toy: the query, gallery split is empty after parsing")
    assert "5 file(s) skipped, most often 4 x name does not match" in message
    assert f"(e.g. {first_gallery})" in message and "\n" not in message
    assert not (tmp_path / "out" / "toy").exists()


class ToyParserWithImpossibleIds(ToyParser):
    """A parser from outside that gives a pid below junk's -1."""

    def parse(self) -> ParseResult:
        result = ToyParser.parse(self)
        records = [RawRecord(r.path, -2, r.camid, r.split) if r.pid == 6 else r for r in result.records]
        return ParseResult(records, result.skipped, result.id_split)


def test_a_parser_that_gives_ids_a_manifest_cannot_hold_is_stopped_before_anything_is_written(raw_root, tmp_path):
    gallery_six = next(p for p in sorted((raw_root / "Toy" / "gallery").glob("6_*.jpg")))
    with pytest.raises(PrepareError) as info:
        prepare_dataset(ToyParserWithImpossibleIds(raw_root), tmp_path / "out", progress=False)
    assert str(info.value) == (f"toy: the parser gives {gallery_six} pid -2, camid 0: pid below -1 (-2; -1 marks "
                               "junk, identities count from 0) (a prepared manifest holds pid -1 and up, camid 0 "
                               "and up)")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_idempotent_and_force(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    manifest = out / "toy" / "manifest.csv"
    stamp = manifest.stat().st_mtime_ns
    again = prepare_dataset(ToyParser(raw_root), out, progress=False)
    assert again.skipped_existing and manifest.stat().st_mtime_ns == stamp
    assert again.card["train_all"]["images"] == 6
    changed = prepare_dataset(ToyParser(raw_root, seed=5), out, progress=False)
    assert changed.skipped_existing
    assert any("split_seed=0" in w and "--force" in w for w in changed.warnings)
    forced = prepare_dataset(ToyParser(raw_root, seed=5), out, force=True, progress=False)
    assert not forced.skipped_existing
    assert json.loads((out / "toy" / "split.json").read_text()) == {"seed": 5}
    assert sorted(p.name for p in out.iterdir()) == ["toy"], "no temporary folders left"


class FixedSplitParser(ToyParser):
    """The toy layout with the release's own split, as Market-1501's: no seed is drawn."""

    def parse(self) -> ParseResult:
        return ParseResult(super().parse().records, [], None)


def test_a_fixed_split_is_not_called_stale_for_another_seed(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(FixedSplitParser(raw_root), out, progress=False)
    assert not (out / "toy" / "split.json").exists()
    again = prepare_dataset(FixedSplitParser(raw_root, seed=5), out, progress=False)
    assert again.skipped_existing and again.warnings == []
    resized = prepare_dataset(FixedSplitParser(raw_root, seed=5), out, resize=(8, 4), progress=False)
    assert any("resize=None" in w for w in resized.warnings), "other options are still compared"


def test_interrupted_run_leaves_no_half_dataset(raw_root, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = prepared_mod._copy_checked

    def flaky(src, dst, resize):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(src, dst, resize)

    monkeypatch.setattr(prepared_mod, "_copy_checked", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(ToyParser(raw_root), tmp_path / "out", workers=1, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_interrupted_force_keeps_the_old_copy(raw_root, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    before = tree_digest(out / "toy")
    monkeypatch.setattr(prepared_mod, "_write_metadata", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        prepare_dataset(ToyParser(raw_root, seed=3), out, force=True, progress=False)
    assert tree_digest(out / "toy") == before
    assert sorted(p.name for p in out.iterdir()) == ["toy"]


def test_resize(raw_root, tmp_path):
    prepare_dataset(ToyParser(raw_root), tmp_path / "out", resize=(32, 12), progress=False)
    ds = load_prepared(tmp_path / "out", "toy")
    for rec in ds.records:
        assert cv2.imread(str(rec.path)).shape == (32, 12, 3)


def test_refuses_to_write_inside_raw_root(raw_root):
    with pytest.raises(PrepareError, match="inside the raw root"):
        prepare_dataset(ToyParser(raw_root), raw_root / "prepared", progress=False)


def test_count_mismatch_warning_names_dataset_and_numbers(raw_root, tmp_path):
    class Wrong(ToyParser):
        expected = ExpectedCounts(train_ids=751, train_images=12936)

    report = prepare_dataset(Wrong(raw_root), tmp_path / "out", progress=False)
    assert "toy: train ids is 2, expected 751" in report.warnings
    assert "toy: train images is 6, expected 12,936" in report.warnings


def test_synthetic_counts_replace_table1(raw_root, tmp_path):
    (raw_root / "synthetic_world.json").write_text(json.dumps({"counts": {"toy": {"train_ids": 3}}}))
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert report.warnings == ["toy: train ids is 2, expected 3"]


def test_load_errors(tmp_path):
    with pytest.raises(PreparedDatasetError, match="manifest.csv is missing"):
        PreparedDataset.load(tmp_path)
    (tmp_path / "manifest.csv").write_text("path,pid\nx.jpg,1\n")
    with pytest.raises(PreparedDatasetError, match="missing columns camid, split"):
        PreparedDataset.load(tmp_path)
    (tmp_path / "manifest.csv").write_text("path,pid,camid,split\nx.jpg,1,0,test\n")
    with pytest.raises(PreparedDatasetError, match="line 2: split 'test'"):
        PreparedDataset.load(tmp_path)
    (tmp_path / "manifest.csv").write_text("path,pid,camid,split\nx.jpg,one,0,train\n")
    with pytest.raises(PreparedDatasetError, match="line 2"):
        PreparedDataset.load(tmp_path)


def test_unknown_split_name(raw_root, tmp_path):
    prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        load_prepared(tmp_path / "out", "toy").split("test")


# -- the raw data and foreign folders are never moved or deleted ------------------
@pytest.mark.parametrize("inside", ["", "downloads/toy"])
def test_refuses_raw_root_inside_the_target_folder(tmp_path, inside):
    # The raw root is <out>/toy itself, or a folder below it: replacing the
    # target would move the raw data aside and delete it.
    out = tmp_path / "data"
    raw = make_toy_raw(out / "toy" / inside)
    before = tree_digest(out)
    for force in (False, True):
        with pytest.raises(PrepareError) as err:
            prepare_dataset(ToyParser(raw), out, force=force, progress=False)
        msg = str(err.value)
        assert str(raw) in msg and str(out / "toy") in msg and "nothing was moved or deleted" in msg
    assert tree_digest(out) == before, "raw data must never change"
    assert sorted(p.name for p in out.iterdir()) == ["toy"]


@pytest.mark.parametrize("force", [False, True])
def test_never_replaces_a_folder_it_did_not_prepare(raw_root, tmp_path, force):
    out = tmp_path / "out"
    (out / "toy").mkdir(parents=True)
    (out / "toy" / "thesis.tex").write_text("precious")
    # a prepare.json of another dataset does not make the folder ours either
    (out / "toy" / "prepare.json").write_text(json.dumps({"dataset": "viper"}))
    with pytest.raises(PrepareError, match="was not prepared by tools/prepare_datasets.py") as err:
        prepare_dataset(ToyParser(raw_root), out, force=force, progress=False)
    assert str(out / "toy") in str(err.value)
    assert (out / "toy" / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["toy"], "no temporary folder left"


def test_move_into_place_checks_the_target_itself(tmp_path):
    # the last line of defence, whatever its caller checked before
    tmp, target = tmp_path / ".toy.tmp-00000000", tmp_path / "toy"
    tmp.mkdir()
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="not replaced"):
        prepared_mod._move_into_place(tmp, target)
    assert (target / "notes.txt").read_text() == "mine"
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(PrepareError, match="symbolic link"):
        prepared_mod._move_into_place(tmp, link)
    assert (target / "notes.txt").read_text() == "mine"


def test_an_empty_target_folder_is_used(raw_root, tmp_path):
    (tmp_path / "out" / "toy").mkdir(parents=True)
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert report.num_images == 10 and (tmp_path / "out/toy/manifest.csv").is_file()


def test_rerun_from_another_raw_root_warns(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    other = make_toy_raw(tmp_path / "other")
    again = prepare_dataset(ToyParser(other), out, progress=False)
    assert again.skipped_existing
    [warning] = again.warnings
    assert str(raw_root.resolve()) in warning and str(other.resolve()) in warning
    assert "--force" in warning
    assert json.loads((out / "toy" / "prepare.json").read_text())["raw_root"] == str(raw_root.resolve())
    assert not prepare_dataset(ToyParser(raw_root), out, progress=False).warnings


def test_leftovers_of_a_killed_run_are_removed_and_reported(raw_root, tmp_path):
    out = tmp_path / "out"
    leftovers = [out / ".toy.tmp-0123abcd", out / ".toy.old-89abcdef"]
    kept = [out / ".other.tmp-0123abcd", out / ".toy.tmp-mine", out / "toy-notes"]
    for folder in leftovers + kept:
        (folder / "images").mkdir(parents=True)
        (folder / "images" / "x.jpg").write_bytes(b"x")
    report = prepare_dataset(ToyParser(raw_root), out, progress=False)
    assert not any(p.exists() for p in leftovers)
    assert all((p / "images" / "x.jpg").is_file() for p in kept)
    [note] = report.notes
    assert "removed 2 temporary folder(s)" in note and ".toy.tmp-0123abcd" in note
    # also when the dataset is already prepared and otherwise skipped
    leftovers[0].mkdir()
    again = prepare_dataset(ToyParser(raw_root), out, progress=False)
    assert again.skipped_existing and not leftovers[0].exists() and len(again.notes) == 1


def test_temp_folder_of_a_running_process_is_left_alone(raw_root, tmp_path):
    import os
    import socket

    busy = tmp_path / "out" / ".toy.tmp-0123abcd"
    busy.mkdir(parents=True)
    (busy / ".owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert busy.is_dir()
    assert any("being written by running process" in n and str(busy) in n for n in report.notes)
    assert not (tmp_path / "out" / "toy" / ".owner.json").exists()


def test_temp_folder_of_another_host_is_left_alone_and_named(raw_root, tmp_path):
    import os

    theirs = tmp_path / "out" / ".toy.tmp-0123abcd"
    (theirs / "images").mkdir(parents=True)
    (theirs / ".owner.json").write_text(json.dumps({"pid": os.getpid(), "host": "node-b.invalid"}))
    report = prepare_dataset(ToyParser(raw_root), tmp_path / "out", progress=False)
    assert theirs.is_dir() and (theirs / ".owner.json").is_file()
    [note] = [n for n in report.notes if str(theirs) in n]
    assert "node-b.invalid" in note and "left alone" in note and "\n" not in note
    assert load_prepared(tmp_path / "out", "toy").records


def test_whole_previous_copy_left_aside_is_moved_back(raw_root, tmp_path):
    """A --force run killed between the two renames: old copy whole aside, no target."""
    import shutil

    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    before = tree_digest(out / "toy")
    aside = out / ".toy.old-0123abcd"
    (out / "toy").rename(aside)
    shutil.rmtree(raw_root / "Toy")  # the raw release is gone: the copy is all there is
    report = prepare_dataset(ToyParser(raw_root), out, progress=False)
    assert report.skipped_existing and not aside.exists()
    assert tree_digest(out / "toy") == before
    assert any("restored the previous prepared copy" in n and aside.name in n for n in report.notes)
    assert len(load_prepared(out, "toy")) == 10


def test_partial_or_foreign_old_leftover_is_not_moved_back(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    aside = out / ".toy.old-0123abcd"
    (out / "toy").rename(aside)
    next(iter(sorted((aside / "images" / "gallery").iterdir()))).unlink()  # partly deleted
    report = prepare_dataset(ToyParser(raw_root), out, progress=False)
    assert not report.skipped_existing and not aside.exists(), "a partial copy is a leftover"
    assert not any("restored" in n for n in report.notes)
    assert len(load_prepared(out, "toy")) == 10


def test_prepared_cards_lists_every_prepared_dataset(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    (out / "not-prepared").mkdir()
    (out / "broken").mkdir()
    for name in ("manifest.csv", "prepare.json", "card.json"):
        (out / "broken" / name).write_text("{")
    cards, problems = prepared_mod.prepared_cards(out)
    assert list(cards) == ["toy"] and cards["toy"]["train_all"]["images"] == 6
    assert len(problems) == 1 and str(out / "broken" / "card.json") in problems[0]


def test_a_resized_copy_is_what_the_test_transform_makes_of_the_original(tmp_path):
    from fedreid.data.images import read_image
    from fedreid.data.transforms import build_test_array_transform

    y, x = np.mgrid[0:96, 0:48]
    smooth = np.stack([y * 2, x * 5, x + y], axis=-1).astype(np.uint8)  # photo-like: smooth, no edge
    height, width = 32, 16
    resize_only = build_test_array_transform(height, width, mean=(0, 0, 0), std=(1 / 255,) * 3)  # pixel values
    for ext, mean_bound in ((".png", 0.0), (".jpg", 1.5)):
        src = tmp_path / f"src{ext}"
        assert cv2.imwrite(str(src), smooth, [cv2.IMWRITE_JPEG_QUALITY, 100] if ext == ".jpg" else [])
        dst = tmp_path / f"resized{ext}"
        assert prepared_mod._copy_checked(src, dst, (height, width)) is None
        copy = read_image(dst)
        assert copy.shape == (height, width, 3)
        # the test transform's resize of the copy is the identity: its input equals the original's,
        # exactly for PNG, within JPEG quality 95 (4:4:4) for JPEG
        difference = np.abs(resize_only(read_image(src)) - resize_only(copy))
        assert difference.mean() <= mean_bound and (ext == ".jpg" or difference.max() == 0), ext


def test_a_copy_resized_another_way_is_named_on_a_rerun(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, resize=(32, 12), progress=False)
    record = json.loads((out / "toy" / "prepare.json").read_text())
    assert record["resize_method"] == prepared_mod.RESIZE_METHOD
    assert prepare_dataset(ToyParser(raw_root), out, resize=(32, 12), progress=False).warnings == []
    del record["resize_method"]  # as an earlier version (PIL bilinear, JPEG quality 75) wrote it
    (out / "toy" / "prepare.json").write_text(json.dumps(record))
    again = prepare_dataset(ToyParser(raw_root), out, resize=(32, 12), progress=False)
    assert again.skipped_existing and any("resize_method=None" in w and "--force" in w for w in again.warnings)


def test_market_distractors_are_gallery_images_not_an_identity(tmp_path):
    from raw_fixtures import make_market1501_tree

    from fedreid.data.raw.market1501 import Market1501

    make_market1501_tree(tmp_path / "raw")
    report = prepare_dataset(Market1501(tmp_path / "raw"), tmp_path / "out", progress=False)
    gallery = report.card["gallery"]
    # bounding_box_test: pids 1 and 3 (identities), 0000 twice (distractors), -1 (junk)
    assert gallery["ids"] == 2
    assert (gallery["images"], gallery["junk_images"], gallery["distractor_images"]) == (6, 1, 2)
    assert json.loads((tmp_path / "out/market1501/card.json").read_text())["gallery"]["ids"] == 2
    assert "2 gallery images are distractors" in (tmp_path / "out/market1501/card.md").read_text()
    # elsewhere pid 0 is a person (CUHK01, VIPeR... count from 0)
    records = [RawRecord(Path(f"{k}.jpg"), pid, 0, "gallery") for k, pid in enumerate((0, 0, 4, -1))]
    assert prepared_mod.dataset_card(records)["gallery"]["ids"] == 2
    assert prepared_mod.dataset_card(records, 0)["gallery"]["ids"] == 1


@pytest.mark.parametrize(
    "text, fragment",
    [
        (None, "card.json is missing"),
        ("{oops", "card.json is not valid JSON (Expecting property name"),
        ("[]", "card.json holds a JSON list, not an object"),
        ('{"train_all": {"ids": 2, "images": 6}, "query": {"ids": "2", "images": 1}}',
         "card.json is not a dataset card (query.ids is '2', expected an integer)"),
    ],
)
def test_a_damaged_card_json_is_a_prepare_error_naming_it(raw_root, tmp_path, text, fragment):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    card = out / "toy" / "card.json"
    card.unlink() if text is None else card.write_text(text)
    with pytest.raises(PrepareError) as err:
        prepare_dataset(ToyParser(raw_root), out, progress=False)
    msg = str(err.value)
    assert msg.startswith(f"toy: {out / 'toy'}/{fragment}") and "--force" in msg and "\n" not in msg
    cards, problems = prepared_mod.prepared_cards(out)
    assert cards == {} and problems == [f"{msg}; left out of cards.md"]
    if text is not None:  # the loader names it too
        with pytest.raises(PreparedDatasetError, match="card.json"):
            load_prepared(out, "toy")
    report = prepare_dataset(ToyParser(raw_root), out, force=True, progress=False)
    assert report.num_images == 10 and report.card["train_all"]["images"] == 6


def test_a_damaged_prepare_json_names_it_and_says_force_cannot_replace_it(raw_root, tmp_path):
    out = tmp_path / "out"
    prepare_dataset(ToyParser(raw_root), out, progress=False)
    (out / "toy" / "prepare.json").write_text("{oops")
    with pytest.raises(PrepareError) as err:
        prepare_dataset(ToyParser(raw_root), out, progress=False)
    msg = str(err.value)
    assert msg.startswith(f"toy: {out / 'toy' / 'prepare.json'} is not valid JSON") and "move the folder away" in msg
    before = tree_digest(out / "toy")
    with pytest.raises(PrepareError, match="not prepared by tools/prepare_datasets.py"):
        prepare_dataset(ToyParser(raw_root), out, force=True, progress=False)
    assert tree_digest(out / "toy") == before, "--force never deletes a folder it cannot tell is its own"
