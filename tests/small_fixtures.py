"""Writers of tiny fixture trees that reproduce the small datasets' layouts.

Images are valid 8x4 pictures (cv2.imwrite) unless ``empty=True``, which
writes 0-byte files: the parsers only list names, so the real-size trees
(thousands of files) can be written quickly.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import cv2
import numpy as np


def write_image(path: Path, empty: bool = False, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if empty:
        path.touch()
    else:
        pixels = np.full((8, 4, 3), value % 256, dtype=np.uint8)
        if not cv2.imwrite(str(path), pixels):
            raise OSError(f"cv2 could not write {path}")
    return path


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width x height`` RGB 8-bit pixels and holds almost no data.

    OpenCV refuses to decode more than ``CV_IO_MAX_IMAGE_PIXELS`` (2^30) pixels before allocating them.
    """

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 100))
            + chunk(b"IEND", b""))


def write_viper(root: Path, num_ids: int, empty: bool = False) -> Path:
    """``VIPeR/cam_a/NNN_45.bmp`` and ``cam_b/NNN_90.bmp`` (person numbers with gaps)."""
    base = root / "VIPeR"
    for i in range(num_ids):
        number = 2 * i + 1  # gaps, as in the release: only the sorted position counts
        write_image(base / "cam_a" / f"{number:03d}_45.bmp", empty, i)
        write_image(base / "cam_b" / f"{number:03d}_90.bmp", empty, i)
    return base


def write_cuhk01(root: Path, num_ids: int, empty: bool = False) -> Path:
    """``CUHK01/campus/PPPPVVV.png``, persons numbered from 0001, views 001-004."""
    base = root / "CUHK01" / "campus"
    for person in range(1, num_ids + 1):
        for view in range(1, 5):
            write_image(base / f"{person:04d}{view:03d}.png", empty, person)
    return base


def write_prid(
    root: Path,
    num_shared: int,
    num_a_only: int,
    num_b_only: int,
    frames: int | Mapping[tuple[str, int], int] = 3,
    empty: bool = False,
) -> Path:
    """``prid_2011/{single_shot,multi_shot}/{cam_a,cam_b}/...``.

    Camera A holds persons 1..num_shared+num_a_only, camera B
    1..num_shared+num_b_only (the first ``num_shared`` are the same people).
    ``frames`` is the sequence length, or a mapping ``(cam, number) -> length``
    (default 3 for unmapped ones).
    """
    base = root / "prid_2011"
    counts = {"cam_a": num_shared + num_a_only, "cam_b": num_shared + num_b_only}
    for cam, count in counts.items():
        for number in range(1, count + 1):
            write_image(base / "single_shot" / cam / f"person_{number:04d}.png", empty, number)
            length = frames if isinstance(frames, int) else frames.get((cam, number), 3)
            for frame in range(1, length + 1):
                write_image(
                    base / "multi_shot" / cam / f"person_{number:04d}" / f"{frame:04d}.png",
                    empty,
                    frame,
                )
    return base


def write_3dpes(
    root: Path, views_per_person: Mapping[int, Sequence[int]], images_per_view: int = 2,
    empty: bool = False,
) -> Path:
    """``3DPeS/RGB/<pid>_<view>_FRAME_<n>_RGB.bmp`` for the given persons and views."""
    base = root / "3DPeS" / "RGB"
    for person, views in views_per_person.items():
        for view in views:
            for n in range(images_per_view):
                frame = 10 * view + n
                write_image(base / f"{person}_{view}_FRAME_{frame}_RGB.bmp", empty, person)
    return base


def write_ilids(root: Path, images_per_person: Mapping[int, int], empty: bool = False) -> Path:
    """``i-LIDS_Pedestrian/Persons/NNNNxxx.jpg``."""
    base = root / "i-LIDS_Pedestrian" / "Persons"
    for person, count in images_per_person.items():
        for n in range(1, count + 1):
            write_image(base / f"{person:04d}{n:03d}.jpg", empty, person)
    return base


def write_cuhk02(
    root: Path, persons_per_pair: Sequence[int] = (3, 2, 2, 1, 1), images_per_cam: int = 2,
    empty: bool = False,
) -> Path:
    """``cuhk02/Dataset/P{1..5}/{cam1,cam2}/<pid>_<n>.png`` (numbers restart per pair)."""
    base = root / "cuhk02" / "Dataset"
    for pair, persons in enumerate(persons_per_pair, start=1):
        for cam in (1, 2):
            for person in range(1, persons + 1):
                for n in range(1, images_per_cam + 1):
                    write_image(base / f"P{pair}" / f"cam{cam}" / f"{person:03d}_{n}.png",
                                empty, person)
    return base


def write_pytorch_layout(
    root: Path, folder: str, subsets: Mapping[str, Mapping[str, Iterable[str]]],
    empty: bool = False,
) -> Path:
    """``<folder>/pytorch/<subset>/<label>/<file>`` from ``{subset: {label: [files]}}``."""
    base = root / folder / "pytorch"
    for subset, labels in subsets.items():
        (base / subset).mkdir(parents=True, exist_ok=True)
        for label, files in labels.items():
            for name in files:
                write_image(base / subset / label / name, empty)
    return base


def write_dgd(
    root: Path, folder: str, meta: dict, split: dict, empty: bool = True,
    skip_files: Iterable[str] = (),
) -> Path:
    """``<folder>/{meta.json,split.json}`` and a file at every path in ``meta``
    (except ``skip_files``)."""
    base = root / folder
    base.mkdir(parents=True, exist_ok=True)
    (base / "meta.json").write_text(json.dumps(meta))
    (base / "split.json").write_text(json.dumps(split))
    missing = set(skip_files)
    for person in meta["identities"]:
        for files in person:
            for rel in files:
                if rel not in missing:
                    write_image(base / rel, empty)
    return base


def copy_dgd_metadata(source: Path, root: Path, folder: str) -> Path:
    """Copies a real ``meta.json``/``split.json`` and writes 0-byte images at its paths."""
    base = root / folder
    base.mkdir(parents=True)
    for name in ("meta.json", "split.json"):
        shutil.copyfile(source / name, base / name)
    meta = json.loads((base / "meta.json").read_text())
    for folder_name in {rel.split("/")[0] for p in meta["identities"] for v in p for rel in v}:
        (base / folder_name).mkdir(exist_ok=True)
    for person in meta["identities"]:
        for files in person:
            for rel in files:
                (base / rel).touch()
    return base
