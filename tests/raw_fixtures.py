"""Tiny copies of the big datasets' release layouts, for parser tests.

Every ``make_<dataset>_tree(raw_root)`` writes a handful of identities under
``raw_root`` with the release's exact folder and file names, plus (with
``quirks=True``) the files a parser must skip and count: a ``Thumbs.db``, a
``README.txt`` and an image whose name does not follow the pattern. Images
are real, decodable 8x4 pictures so that a later pixel check passes.

The module-level tables name every file written, so tests can derive their
expectations instead of repeating names.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

#: Files every quirky folder gets and every parser must skip.
QUIRK_FILES: tuple[str, ...] = ("Thumbs.db", "README.txt", "misnamed.jpg")


def write_image(path: str | Path, h: int = 8, w: int = 4, seed: int = 0) -> Path:
    """A small random colour image at ``path`` (format from the extension)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    # cv2 picks the encoder from the last suffix, so ``x.jpg.jpg`` is a JPEG.
    if not cv2.imwrite(str(path), pixels):
        raise OSError(f"cv2 could not write {path}")
    return path


def write_bytes(path: str | Path, data: bytes = b"\x00not an image\x00") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _write_quirks(folder: Path, seed: int) -> None:
    write_bytes(folder / "Thumbs.db")
    write_bytes(folder / "README.txt", b"release notes\n")
    write_image(folder / "misnamed.jpg", seed=seed)


def _write_folders(
    root: Path, files: dict[str, tuple[str, ...]], quirks: bool, quirk_folders: tuple[str, ...]
) -> None:
    seed = 0
    for folder, names in files.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            write_image(root / folder / name, seed=seed)
            seed += 1
        if quirks and folder in quirk_folders:
            _write_quirks(root / folder, seed)
            seed += 1


# -- Market-1501 -------------------------------------------------------------
MARKET1501_DIR = "Market-1501-v15.09.15"
MARKET1501_FILES: dict[str, tuple[str, ...]] = {
    "bounding_box_train": (
        "0002_c1s1_000451_03.jpg",
        "0002_c2s1_000301_01.jpg",
        "0007_c3s3_000401_02.jpg",
        # The release's doubled extension: a real image, used.
        "0007_c6s1_001001_01.jpg.jpg",
        "0011_c5s1_000101_01.jpg",
    ),
    "bounding_box_test": (
        "-1_c1s1_000401_03.jpg",
        "0000_c1s1_000151_01.jpg",
        "0000_c6s4_000501_02.jpg",
        "0001_c2s1_000101_02.jpg",
        "0003_c4s2_000101_02.jpg",
        "0003_c5s1_000201_01.jpg",
    ),
    "query": (
        "0001_c1s1_001051_00.jpg",
        "0003_c6s2_000201_00.jpg",
    ),
}
#: Folders of the release the parser must not read.
MARKET1501_IGNORED: dict[str, tuple[str, ...]] = {
    "gt_bbox": ("0001_c1s1_001051_00.jpg",),
    "gt_query": ("0001_c1s1_001051_good.mat",),
}


def make_market1501_tree(raw_root: str | Path, *, quirks: bool = True) -> Path:
    """``raw_root/Market-1501-v15.09.15`` with :data:`MARKET1501_FILES`."""
    root = Path(raw_root) / MARKET1501_DIR
    _write_folders(root, MARKET1501_FILES, quirks, ("bounding_box_train", "bounding_box_test"))
    write_image(root / "gt_bbox" / MARKET1501_IGNORED["gt_bbox"][0])
    write_bytes(root / "gt_query" / MARKET1501_IGNORED["gt_query"][0])
    return root


# -- DukeMTMC-reID -----------------------------------------------------------
DUKEMTMC_DIR = "DukeMTMC-reID"
DUKEMTMC_FILES: dict[str, tuple[str, ...]] = {
    "bounding_box_train": (
        "0001_c2_f0046182.jpg",
        "0001_c5_f0051341.jpg",
        "0005_c8_f0032001.jpg",
        "0005_c1_f0001234.jpg",
    ),
    "bounding_box_test": (
        "0002_c1_f0044158.jpg",
        "0002_c7_f0101001.jpg",
        "0004_c8_f0199990.jpg",
        # An id only in the gallery: DukeMTMC's 408 distractors look like this.
        "0701_c3_f0003000.jpg",
    ),
    "query": (
        "0002_c3_f0044200.jpg",
        "0004_c6_f0199000.jpg",
    ),
}


def make_dukemtmc_tree(raw_root: str | Path, *, quirks: bool = True) -> Path:
    """``raw_root/DukeMTMC-reID`` with :data:`DUKEMTMC_FILES`."""
    root = Path(raw_root) / DUKEMTMC_DIR
    _write_folders(root, DUKEMTMC_FILES, quirks, ("bounding_box_train", "query"))
    return root


# -- CUHK03-NP ---------------------------------------------------------------
CUHK03NP_DIR = "cuhk03-np"
CUHK03NP_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "detected": {
        "bounding_box_train": (
            "0001_c1_1.png",
            "0001_c2_6.png",
            "0003_c1_2.png",
            "0003_c2_7.png",
        ),
        "bounding_box_test": (
            "0002_c2_6.png",
            "0004_c2_7.png",
        ),
        "query": (
            "0002_c1_1.png",
            "0004_c1_2.png",
        ),
    },
    # Different box counts, as in the release, so a test can tell them apart.
    "labeled": {
        "bounding_box_train": (
            "0001_c1_1.png",
            "0001_c2_6.png",
            "0001_c2_7.png",
            "0003_c1_2.png",
            "0003_c2_7.png",
        ),
        "bounding_box_test": ("0002_c2_6.png",),
        "query": (
            "0002_c1_1.png",
            "0004_c1_2.png",
        ),
    },
}


def make_cuhk03np_tree(raw_root: str | Path, *, quirks: bool = True) -> Path:
    """``raw_root/cuhk03-np/{detected,labeled}`` with :data:`CUHK03NP_FILES`."""
    root = Path(raw_root) / CUHK03NP_DIR
    for boxes, files in CUHK03NP_FILES.items():
        _write_folders(root / boxes, files, quirks, ("bounding_box_train",))
    return root


# -- MSMT17 ------------------------------------------------------------------
MSMT17_DIR = "MSMT17_V1"
MSMT17_REPACK_DIR = "MSMT17"
#: ``list_<name>.txt`` -> entries ``(relative path, label)``, in file order.
MSMT17_LISTS: dict[str, tuple[tuple[str, int], ...]] = {
    "train": (
        ("0000/0000_000_01_0303morning_0015_0.jpg", 0),
        ("0000/0000_001_15_0303morning_0042_1.jpg", 0),
        ("0001/0001_000_07_0113noon_0100_0.jpg", 1),
    ),
    "val": (
        ("0000/0000_002_03_0303noon_0017_0.jpg", 0),
        ("0001/0001_001_12_0114afternoon_0200_2.jpg", 1),
    ),
    "query": (
        ("0000/0000_000_10_0113morning_0016_0.jpg", 0),
        ("0002/0002_000_15_0302noon_0300_0.jpg", 2),
    ),
    "gallery": (
        ("0000/0000_003_02_0113morning_0900_0.jpg", 0),
        ("0002/0002_004_14_0302noon_0400_0.jpg", 2),
        ("0003/0003_000_05_0303afternoon_0500_0.jpg", 3),
    ),
}
#: Bad lines appended to a list with ``quirks=True``: (list, line text, why).
MSMT17_BAD_LINES: tuple[tuple[str, str, str], ...] = (
    ("train", "0001/0001_009_04_0113noon_0999_0.jpg 1", "missing"),
    ("gallery", "this line is malformed", "malformed"),
)
#: An image in ``train/`` that no list names (quirks only).
MSMT17_UNLISTED = "0001/0001_005_06_0113noon_0555_0.jpg"
#: The repack: one folder per split of Market-style names.
MSMT17_REPACK_FILES: dict[str, tuple[str, ...]] = {
    "bounding_box_train": (
        "0000_c1_0303morning_0015_0.jpg",
        "0000_c15_0303morning_0042_1.jpg",
        "0000_c3_0303noon_0017_0.jpg",
        "0001_c7_0113noon_0100_0.jpg",
        "0001_c12_0114afternoon_0200_2.jpg",
    ),
    "bounding_box_test": (
        "0000_c2_0113morning_0900_0.jpg",
        "0002_c14_0302noon_0400_0.jpg",
        "0003_c5_0303afternoon_0500_0.jpg",
    ),
    "query": (
        "0000_c10_0113morning_0016_0.jpg",
        "0002_c15_0302noon_0300_0.jpg",
    ),
}


def msmt17_list_line_number(list_name: str, text: str) -> int:
    """1-based line of ``text`` in ``list_<list_name>.txt`` as written by the fixture."""
    bad = [line for name, line, _ in MSMT17_BAD_LINES if name == list_name]
    return len(MSMT17_LISTS[list_name]) + bad.index(text) + 1


def make_msmt17_tree(
    raw_root: str | Path, *, layout: str = "original", quirks: bool = True
) -> Path:
    """MSMT17 under ``raw_root``: ``layout`` is ``"original"`` (``MSMT17_V1``
    with lists), ``"v2"`` (``MSMT17_V2``: the same lists, images under
    ``mask_{train,test}_v2``) or ``"repack"`` (``MSMT17/bounding_box_*``)."""
    raw_root = Path(raw_root)
    if layout == "repack":
        root = raw_root / MSMT17_REPACK_DIR
        _write_folders(root, MSMT17_REPACK_FILES, quirks, ("bounding_box_train",))
        return root
    if layout not in ("original", "v2"):
        raise ValueError(f"unknown MSMT17 fixture layout {layout!r}")

    root = raw_root / (MSMT17_DIR if layout == "original" else "MSMT17_V2")
    train, test = ("train", "test") if layout == "original" else ("mask_train_v2", "mask_test_v2")
    seed = 0
    for list_name, entries in MSMT17_LISTS.items():
        folder = root / (train if list_name in ("train", "val") else test)
        lines = []
        for rel, label in entries:
            write_image(folder / rel, seed=seed)
            seed += 1
            lines.append(f"{rel} {label}")
        if quirks:
            lines += [line for name, line, _ in MSMT17_BAD_LINES if name == list_name]
        (root / f"list_{list_name}.txt").write_text("\n".join(lines) + "\n")
    if quirks:
        write_image(root / train / MSMT17_UNLISTED, seed=seed)
        write_bytes(root / train / "0000" / "Thumbs.db")
        write_bytes(root / test / "README.txt", b"release notes\n")
    return root
