"""The synthetic world: release layouts, parser counts, determinism, identity signal, safety."""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path

import cv2
import numpy as np
import pytest

from fedreid.data.prepared import find_split_conflict
from fedreid.data.raw import create_raw_dataset
from fedreid.data.raw.base import offset_test_ids
from fedreid.data.synthetic import DATASETS, RELEASE_DIRS, WORLD_FILE, generate_world

FIXED_SPLIT = {"market1501", "dukemtmc", "cuhk03np", "msmt17", "cuhk02"}
COUNT_KEYS = {"train_ids", "train_images", "query_ids", "query_images", "gallery_images"}

_MARKET = r"\d{4}_c[1-6]s[1-6]_\d{6}_\d{2}\.jpg"
_DUKE = r"\d{4}_c[1-8]_f\d{7}\.jpg"
_CUHK03 = r"\d{4}_c[12]_\d+\.png"
_MSMT = r"(\d{4})/\2_\d{3}_(0[1-9]|1[0-5])_\d{4}(morning|noon|afternoon)_\d{4}_\d\.jpg"

#: Per dataset, regexes (full match on the path relative to the release folder)
#: mirroring datasets/README.md: every file matches one, every regex matches a file.
LAYOUTS: dict[str, list[str]] = {
    "market1501": [
        rf"bounding_box_train/{_MARKET}",
        rf"bounding_box_train/{_MARKET}\.jpg",  # the doubled extension
        rf"bounding_box_test/{_MARKET}",
        r"bounding_box_test/-1_c[1-6]s[1-6]_\d{6}_\d{2}\.jpg",  # junk
        r"bounding_box_test/0000_c[1-6]s[1-6]_\d{6}_\d{2}\.jpg",  # distractors
        r"bounding_box_test/Thumbs\.db",
        rf"query/{_MARKET}",
        rf"gt_bbox/{_MARKET}",
    ],
    "dukemtmc": [rf"{f}/{_DUKE}" for f in ("bounding_box_train", "bounding_box_test", "query")],
    "cuhk03np": [
        rf"{boxes}/{f}/{_CUHK03}"
        for boxes in ("detected", "labeled")
        for f in ("bounding_box_train", "bounding_box_test", "query")
    ],
    "msmt17": [rf"(train)/{_MSMT}", rf"(test)/{_MSMT}"]
    + [rf"list_{s}\.txt" for s in ("train", "val", "query", "gallery")],
    "prid2011": [
        r"single_shot/cam_a/person_\d{4}\.png",
        r"single_shot/cam_b/person_\d{4}\.png",
        r"multi_shot/cam_a/person_\d{4}/\d{4}\.png",
        r"multi_shot/cam_b/person_\d{4}/\d{4}\.png",
    ],
    "cuhk01": [r"campus/\d{4}00[12]\.png", r"campus/\d{4}00[34]\.png"],
    "viper": [r"cam_a/\d{3}_(0|45|90|135|180)\.bmp", r"cam_b/\d{3}_(0|45|90|135|180)\.bmp"],
    "3dpes": [r"RGB/[1-9]\d*_[1-8]_FRAME_\d+_RGB\.bmp"],
    "ilids": [r"Persons/\d{4}\d{3}\.jpg"],
    "cuhk02": [rf"Dataset/P{p}/cam{c}/\d{{3}}_\d+\.png" for p in range(1, 6) for c in (1, 2)],
}

#: Skips a parser makes by design on a complete release (PRID2011 trains on
#: multi-shot frames and tests on single-shot images).
DESIGN_SKIPS = {
    "prid2011": ("single-shot image of a training id", "multi-shot frame of a test or distractor"),
}

_MAGIC = {".jpg": b"\xff\xd8", ".png": b"\x89PNG", ".bmp": b"BM"}


def files_of(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for rel in files_of(root):
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict]:
    """The default world (all ten datasets), generated once."""
    root = tmp_path_factory.mktemp("world")
    return root, generate_world(root)


# -- layouts ------------------------------------------------------------------
@pytest.mark.parametrize("name", DATASETS)
def test_release_layout(world, name):
    root, summary = world
    folder = root / RELEASE_DIRS[name]
    files = files_of(folder)
    patterns = [re.compile(p) for p in LAYOUTS[name]]
    strays = [f for f in files if not any(p.fullmatch(f) for p in patterns)]
    assert not strays, f"{name}: files outside the README layout: {strays[:5]}"
    for p in patterns:
        assert any(p.fullmatch(f) for f in files), f"{name}: nothing matches {p.pattern}"
    images = [f for f in files if not f.endswith(".txt") and not f.endswith("Thumbs.db")]
    assert len(images) == summary["datasets"][name]["images"]
    # Formats are real (bytes, not only names) and images have the asked size.
    for rel in images[:: max(1, len(images) // 10)]:
        data = (folder / rel).read_bytes()
        assert data.startswith(_MAGIC[Path(rel).suffix]), rel
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert img.shape == (64, 32, 3), rel


def test_market_quirks(world):
    folder = world[0] / RELEASE_DIRS["market1501"]
    train = files_of(folder / "bounding_box_train")
    test = files_of(folder / "bounding_box_test")
    assert sum(f.endswith(".jpg.jpg") for f in train) == 2
    assert "Thumbs.db" in test
    assert any(f.startswith("-1_") for f in test) and any(f.startswith("0000_") for f in test)
    for sub in ("bounding_box_train", "query"):  # junk and distractors live in the gallery only
        assert not any(f.startswith(("-1_", "0000_")) for f in files_of(folder / sub))
    assert (folder / "gt_query").is_dir()


def test_small_dataset_structures(world):
    root = world[0]
    # PRID2011: shared persons numbered lowest, then camera-A-only / camera-B-only.
    prid = root / RELEASE_DIRS["prid2011"]
    shared = world[1]["parser_options"]["prid2011"]["num_shared"]
    cams = {c: sorted(int(p.stem[7:]) for p in (prid / "single_shot" / c).glob("*.png"))
            for c in ("cam_a", "cam_b")}
    assert cams["cam_a"] == list(range(1, len(cams["cam_a"]) + 1))
    assert cams["cam_b"] == list(range(1, len(cams["cam_b"]) + 1))
    assert shared < len(cams["cam_a"]) < len(cams["cam_b"])
    for c, numbers in cams.items():
        seqs = sorted(int(p.name[7:]) for p in (prid / "multi_shot" / c).iterdir())
        assert seqs == numbers
    # VIPeR: the same person numbers in both cameras (pairing by sorted position).
    viper = root / RELEASE_DIRS["viper"]
    numbers = [sorted(p.name.split("_")[0] for p in (viper / c).iterdir())
               for c in ("cam_a", "cam_b")]
    assert numbers[0] == numbers[1]
    # CUHK01: every person has views of both cameras.
    views = defaultdict(set)
    for p in (root / RELEASE_DIRS["cuhk01"] / "campus").iterdir():
        views[p.name[:4]].add((int(p.name[4:7]) - 1) // 2)
    assert all(v == {0, 1} for v in views.values())
    # CUHK03-NP: the labeled set has the same people and frames, other crops.
    cuhk03 = root / RELEASE_DIRS["cuhk03np"]
    detected, labeled = files_of(cuhk03 / "detected"), files_of(cuhk03 / "labeled")
    assert detected == labeled
    assert any((cuhk03 / "detected" / f).read_bytes() != (cuhk03 / "labeled" / f).read_bytes()
               for f in detected)


def test_msmt17_lists_name_every_image_once(world):
    folder = world[0] / RELEASE_DIRS["msmt17"]
    listed: dict[str, list[str]] = {}
    for split, base in (("train", "train"), ("val", "train"), ("query", "test"),
                        ("gallery", "test")):
        lines = (folder / f"list_{split}.txt").read_text().splitlines()
        assert lines, split
        for line in lines:
            m = re.fullmatch(r"(\d{4})/(\S+\.jpg) (\d+)", line)
            assert m and int(m.group(1)) == int(m.group(3)), line
            listed.setdefault(f"{base}/{m.group(1)}/{m.group(2)}", []).append(split)
    images = [f for f in files_of(folder) if f.endswith(".jpg")]
    assert sorted(listed) == images
    assert all(len(v) == 1 for v in listed.values())


def test_summary_file(world):
    root, summary = world
    on_disk = json.loads((root / WORLD_FILE).read_text())
    assert on_disk == summary
    assert summary["complete"] and summary["version"] >= 1
    assert summary["parameters"] == {
        "id_scale": 0.02, "min_ids": 12, "images_per_camera": 2, "height": 64, "width": 32,
        "seed": 0, "datasets": list(DATASETS),
    }
    assert set(summary["counts"]) == FIXED_SPLIT
    assert all(set(c) == COUNT_KEYS for c in summary["counts"].values())
    ids = {n: d["identities"] for n, d in summary["datasets"].items()}
    # max(min_ids, round(real * id_scale)): the big sets scale, the small ones sit at min_ids.
    assert ids["msmt17"] == 82 and ids["market1501"] == 30 and ids["viper"] == 13
    assert ids["3dpes"] == ids["ilids"] == 12
    assert ids["msmt17"] > ids["market1501"] > ids["cuhk01"] > ids["ilids"]
    assert summary["total_images"] == sum(d["images"] for d in summary["datasets"].values())


# -- the real parsers read it -------------------------------------------------
@pytest.mark.parametrize("name", DATASETS)
def test_parsers_find_the_recorded_counts(world, name):
    root, summary = world
    options = summary["parser_options"].get(name, {})
    result = create_raw_dataset(name, root, **options).parse()
    allowed = DESIGN_SKIPS.get(name, ())
    for skip in result.skipped:
        assert skip.path.name == "Thumbs.db" or skip.rule.startswith(allowed), (
            skip.path, skip.rule)
    by_split = defaultdict(list)
    for rec in result.records:
        by_split[rec.split].append(rec)
    train = by_split["train"] + by_split["val"]
    found = {
        "train_ids": len({r.pid for r in train}),
        "train_images": len(train),
        "query_ids": len({r.pid for r in by_split["query"]}),
        "query_images": len(by_split["query"]),
        "gallery_images": len(by_split["gallery"]),
    }
    if name in FIXED_SPLIT:
        assert found == summary["counts"][name]
    assert found["train_ids"] > 0
    # Every query has a gallery image of the same person from another camera.
    gallery = {(r.pid, r.camid) for r in by_split["gallery"]}
    for q in by_split["query"]:
        assert any(pid == q.pid and cam != q.camid for pid, cam in gallery), q.path.name
    # Prepared, no image is in two splits and no test identity trains.
    parser = create_raw_dataset(name, root, **options)
    prepared = offset_test_ids(result.records, parser.test_pid_offset)
    assert find_split_conflict([((("path", str(r.path)),), r.pid, r.split) for r in prepared]) is None


def test_cuhk03_labeled_boxes_parse_like_detected(world):
    root = world[0]
    detected = create_raw_dataset("cuhk03np", root).parse().records
    labeled = create_raw_dataset("cuhk03np", root, boxes="labeled").parse().records
    assert [(r.path.name, r.pid, r.camid, r.split) for r in detected] == [
        (r.path.name, r.pid, r.camid, r.split) for r in labeled
    ]


# -- determinism ------------------------------------------------------------
SMALL = dict(id_scale=0.005, min_ids=6, height=32, width=16)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    some = ["market1501", "msmt17", "prid2011", "3dpes"]
    a = generate_world(tmp_path / "a", seed=3, datasets=some, **SMALL)
    b = generate_world(tmp_path / "b", seed=3, datasets=some, **SMALL)
    generate_world(tmp_path / "c", seed=4, datasets=some, **SMALL)
    assert a == b
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")
    assert tree_hash(tmp_path / "a") != tree_hash(tmp_path / "c")
    # A dataset does not depend on which others are generated with it.
    generate_world(tmp_path / "d", seed=3, datasets=["3dpes"], **SMALL)
    folder = RELEASE_DIRS["3dpes"]
    assert tree_hash(tmp_path / "a" / folder) == tree_hash(tmp_path / "d" / folder)
    # Regenerating over its own output rewrites the same bytes.
    before = tree_hash(tmp_path / "a")
    assert generate_world(tmp_path / "a", seed=3, datasets=some, **SMALL) == a
    assert tree_hash(tmp_path / "a") == before


# -- identity is in the pixels, not in a trivial cue -----------------------------
def _market_split(root: Path, folder: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pids, cams, images = [], [], []
    for path in sorted((root / RELEASE_DIRS["market1501"] / folder).glob("*.jpg")):
        pid, cam = re.match(r"(-?\d+)_c(\d+)", path.name).groups()
        pids.append(int(pid))
        cams.append(int(cam))
        images.append(cv2.imread(str(path))[..., ::-1].astype(np.float32))
    return np.array(pids), np.array(cams), np.stack(images)


def part_colour_histograms(img: np.ndarray, parts: int = 8) -> np.ndarray:
    """Colour histograms of horizontal body parts, central columns, grey-world normalised.

    Dividing by the mean colour undoes a camera's per-channel gain; the central
    columns are mostly person; 4 levels per channel give 64 bins per part.
    """
    w = img.shape[1]
    centre = img[:, w // 3: w - w // 3]
    norm = centre / (centre.reshape(-1, 3).mean(0) + 1e-3)
    levels = np.clip((norm * 2).astype(int), 0, 3)
    code = levels[..., 0] * 16 + levels[..., 1] * 4 + levels[..., 2]
    rows = np.linspace(0, img.shape[0], parts + 1).astype(int)
    hists = [np.bincount(code[a:b].ravel(), minlength=64) / code[a:b].size
             for a, b in zip(rows[:-1], rows[1:])]
    return np.sqrt(np.concatenate(hists))


def rank1(query, gallery, describe) -> float:
    """Cross-camera rank-1 (Market protocol: junk and same-camera matches ignored)."""
    qp, qc, qi = query
    gp, gc, gi = gallery
    qf = np.stack([describe(x) for x in qi]).astype(np.float64)
    gf = np.stack([describe(x) for x in gi]).astype(np.float64)
    dist = ((qf[:, None] - gf[None]) ** 2).sum(-1)
    hits = 0
    for i in range(len(qp)):
        ignore = (gp == -1) | ((gp == qp[i]) & (gc == qc[i]))
        hits += gp[np.argmin(np.where(ignore, np.inf, dist[i]))] == qp[i]
    return hits / len(qp)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identity_is_recoverable_but_not_from_trivial_cues(tmp_path, seed):
    generate_world(tmp_path, seed=seed, id_scale=0.1, datasets=["market1501"])
    query = _market_split(tmp_path, "query")
    gallery = _market_split(tmp_path, "bounding_box_test")
    chance = 1 / len(set(query[0]))  # about 0.013 (75 test ids)
    h, w = query[2].shape[1:3]

    described = rank1(query, gallery, part_colour_histograms)
    mean_colour = rank1(query, gallery, lambda x: x.reshape(-1, 3).mean(0))
    best_pixel = max(rank1(query, gallery, lambda x, y=y: x[int(y * h), w // 2])
                     for y in (0.3, 0.4, 0.5, 0.7))
    # Measured over seeds 0-15: descriptor 0.34-0.69, mean colour <= 0.02,
    # best fixed pixel <= 0.18, descriptor / best trivial cue >= 2.75.
    assert described >= max(0.25, 15 * chance)
    assert mean_colour <= 0.06
    assert best_pixel <= 0.22
    assert described >= 2 * max(mean_colour, best_pixel)


# -- safety ---------------------------------------------------------------------
def test_refuses_a_folder_it_did_not_write(tmp_path):
    real = tmp_path / "VIPeR" / "cam_a"
    real.mkdir(parents=True)
    (real / "000_45.bmp").write_bytes(b"user data")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "VIPeR"))):
        generate_world(tmp_path, datasets=["viper"], **SMALL)
    # Also when a world file exists but does not list that folder.
    generate_world(tmp_path, datasets=["ilids"], **SMALL)
    with pytest.raises(ValueError, match="VIPeR"):
        generate_world(tmp_path, datasets=["viper", "ilids"], **SMALL)
    assert (real / "000_45.bmp").read_bytes() == b"user data"
    assert files_of(tmp_path / "VIPeR") == ["cam_a/000_45.bmp"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="known: msmt17, dukemtmc"):
        generate_world(tmp_path, datasets=["market"])
    generate_world(tmp_path / "w", datasets=["viper"], **SMALL)
    with pytest.raises(ValueError, match="other parameters"):
        generate_world(tmp_path / "w", datasets=["ilids"], **{**SMALL, "seed": 1})
    with pytest.raises(ValueError):
        generate_world(tmp_path, images_per_camera=0)


def test_progress_bar(tmp_path, capsys):
    generate_world(tmp_path, datasets="viper", progress=True, **SMALL)
    assert "synthetic world" in capsys.readouterr().err
