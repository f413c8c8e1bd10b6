"""Importer of the FedReID benchmark's own processed folders (``--layout fedreid``).

Users who already hold the authors' processed data point the raw root at its
``data/`` folder; nothing is re-converted. Two forms exist:

(a) the layumi ``prepare.py`` output, for every dataset::

        <Folder>/pytorch/{train_all,train,val,query,gallery}/<label>/<file>

    ``<label>`` is the identity number (``0002``, ``-1``, ``0000``); the
    camera comes from the file name. CUHK02 has only ``train_all``.

(b) the Domain-Guided-Dropout (DGD) format the benchmark converted the small
    datasets from::

        <folder>/cam_0/00000_00001.bmp   <identity>_<image> per pseudo-camera
        <folder>/cam_1/...
        <folder>/meta.json    {"identities": [[cam0 files], [cam1 files]] per
                               identity, "num_cameras", "name", "shot"}
        <folder>/split.json   {"trainval", "test_probe", "test_gallery"}
                               (identity indices)

    read as the benchmark did: train = every image of the ``trainval`` ids;
    query = the first half of the views (``person[:len(person) // 2]``, i.e.
    ``cam_0``) of the ``test_probe`` ids; gallery = the second half of the
    views of the ``test_probe`` ids plus every image of the ``test_gallery``
    ids that are not probes (PRID's camera-B-only distractors). With the
    published metadata this reproduces Table 1 exactly.

Form (a) wins where both exist.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, Optional, Type

from .base import (
    ParseResult,
    RawDataset,
    RawLayoutError,
    RawRecord,
    Skip,
    carve_val,
    id_problem,
    list_files,
)

#: dataset name -> (folder of the benchmark's processed data, raw parser module)
FOLDERS: dict[str, tuple[str, str]] = {
    "msmt17": ("MSMT17", "msmt17"),
    "dukemtmc": ("DukeMTMC-reID", "dukemtmc"),
    "market1501": ("Market", "market1501"),
    "cuhk03np": ("cuhk03-np-detected", "cuhk03np"),
    "prid2011": ("prid", "prid2011"),
    "cuhk01": ("cuhk01", "cuhk01"),
    "viper": ("viper", "viper"),
    "3dpes": ("3dpes", "threedpes"),
    "ilids": ("ilids", "ilids"),
    "cuhk02": ("cuhk02", "cuhk02"),
}

PYTORCH_SUBSETS: tuple[str, ...] = ("train_all", "train", "val", "query", "gallery")
DGD_META_KEYS = (
    '"identities" (per identity, one list of files per camera, e.g. '
    '[["cam_0/00000_00000.bmp"], ["cam_1/00000_00000.bmp"]]), "num_cameras", "name", "shot"'
)
DGD_SPLIT_KEYS: tuple[str, ...] = ("trainval", "test_probe", "test_gallery")


def _raw_class(name: str) -> Optional[Type[RawDataset]]:
    """The registered raw parser of ``name``, whose metadata this importer shares.

    Only that dataset's module is imported (not the whole registry), so one
    parser that fails to import does not break the others. None when the
    module does not exist.
    """
    module_name = f"{__package__}.{FOLDERS[name][1]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, RawDataset) and getattr(
            value, "name", None
        ) == name:
            return value
    return None


class FedReIDLayout(RawDataset):
    """Reads one dataset from the FedReID benchmark's processed folders.

    Not registered: :func:`fedreid.data.raw.create_raw_dataset` builds it for
    ``layout="fedreid"``. ``expected``, ``public`` and ``test_pid_offset`` are
    those of the raw parser of the same name, so the prepared counts are
    checked, and the test identities renumbered, the same way.
    """

    dataset_dir = ""  # set per instance from FOLDERS
    layout = "fedreid"

    #: Market-1501 / DukeMTMC-reID / CUHK03-NP / MSMT17 repack: ``0002_c1s1_...``, 1-based camera.
    _MARKET = re.compile(r"^(-?\d+)_c(\d+)")
    #: The small datasets as the FedReID script names them: ``cam_0_00000_00000.bmp``, 0-based.
    _SMALL = re.compile(r"^cam_(\d+)_\d+_\d+\.\w+$")
    #: MSMT17's original names ``0000_000_01_0303morning_0015_0.jpg``: third field, 1-based.
    _MSMT = re.compile(r"^-?\d+_\d+_(\d+)_")
    _LABEL = re.compile(r"^-?\d+$")
    _DGD_CAM = re.compile(r"^cam_(\d+)$")

    def __init__(
        self,
        raw_root: str | Path,
        *,
        dataset: str,
        seed: int = 0,
        split_file: str | Path | None = None,
        **options: Any,
    ) -> None:
        if dataset not in FOLDERS:
            raise KeyError(
                f"unknown dataset {dataset!r} for the fedreid layout; known: "
                f"{', '.join(sorted(FOLDERS))}"
            )
        self.name = dataset
        self.dataset_dir = FOLDERS[dataset][0]
        super().__init__(raw_root, seed=seed, split_file=split_file, **options)
        raw_class = _raw_class(dataset)
        self.expected = raw_class.expected if raw_class is not None else None
        self.public = raw_class.public if raw_class is not None else dataset == "cuhk02"
        # The processed folders keep the release's numbers (MSMT17's test ids restart at 0).
        self.test_pid_offset = raw_class.test_pid_offset if raw_class is not None else 0

    def parse(self) -> ParseResult:
        pytorch = self.root / "pytorch"
        if pytorch.is_dir():
            if self.split_file is not None:
                raise RawLayoutError(
                    f"{self.name}: {pytorch} fixes the split in its folders; "
                    f"the split file {self.split_file} cannot apply"
                )
            return self._parse_pytorch(pytorch)
        if (self.root / "meta.json").is_file():
            return self._parse_dgd()
        raise RawLayoutError(
            f"{self.name}: expected either {pytorch}/{{train_all,train,val,query,gallery}}/ "
            f"(the FedReID prepare.py output) or {self.root}/meta.json with split.json "
            "and cam_0/ cam_1/ (the Domain-Guided-Dropout format); see datasets/README.md"
        )

    # -- (a) pytorch/<subset>/<label>/<file> --------------------------------
    def _parse_pytorch(self, base: Path) -> ParseResult:
        skipped: list[Skip] = []
        present = {s for s in PYTORCH_SUBSETS if (base / s).is_dir()}
        records: list[RawRecord] = []
        if "train" in present:
            train = self._read_subset(base / "train", "train", skipped)
            val = self._read_subset(base / "val", "val", skipped) if "val" in present else []
            records += train + val
            if "train_all" in present:
                self._check_train_all(base, skipped)
        elif "train_all" in present:
            train_all = self._read_subset(base / "train_all", "train", skipped)
            # The public set is unlabeled and never validated on; a labeled set
            # gets the usual first-image-per-id validation split.
            records += train_all if self.public else carve_val(train_all)
        else:
            raise RawLayoutError(
                f"{self.name}: expected the folder {base / 'train'} (with val/) or "
                f"{base / 'train_all'}"
            )
        for split in ("query", "gallery"):
            if split in present:
                records += self._read_subset(base / split, split, skipped)
            elif not self.public:
                raise RawLayoutError(f"{self.name}: expected the folder {base / split}")
        return ParseResult(records, skipped, None)

    def _labelled_files(self, folder: Path, skipped: list[Skip]) -> list[tuple[str, Path]]:
        """``(label, path)`` of every image in the label folders of ``folder``."""
        for path in list_files(folder, skipped, subfolders=True):
            skipped.append(Skip(path, "image outside an identity folder"))
        out = []
        for label_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
            for path in list_files(label_dir, skipped):
                out.append((label_dir.name, path))
        return out

    def _read_subset(self, folder: Path, split: str, skipped: list[Skip]) -> list[RawRecord]:
        records = []
        for label, path in self._labelled_files(folder, skipped):
            if not self._LABEL.match(label):
                skipped.append(Skip(path, f"identity folder {label!r} is not an integer"))
                continue
            problem = id_problem(int(label), 0)  # the camera is checked by _camid, with its own rule
            if problem is not None:
                skipped.append(Skip(path, problem))
                continue
            camid = self._camid(path, skipped)
            if camid is not None:
                records.append(RawRecord(path, int(label), camid, split))
        return records

    def _camid(self, path: Path, skipped: list[Skip]) -> Optional[int]:
        name = path.name
        if match := self._MARKET.match(name):
            camid = int(match.group(2)) - 1
        elif match := self._SMALL.match(name):
            camid = int(match.group(1))
        elif match := self._MSMT.match(name):
            camid = int(match.group(1)) - 1
        else:
            skipped.append(Skip(path, "name matches none of the camera patterns "
                                      f"{self._MARKET.pattern!r}, {self._SMALL.pattern!r}, "
                                      f"{self._MSMT.pattern!r}"))
            return None
        if camid < 0:
            skipped.append(Skip(path, "camera 0 in a name whose cameras are numbered from 1"))
            return None
        return camid

    def _check_train_all(self, base: Path, skipped: list[Skip]) -> None:
        """train_all must be train + val; record each file where they differ."""
        train_all = {
            f"{label}/{path.name}": path
            for label, path in self._labelled_files(base / "train_all", skipped)
        }
        # Listed again (skips already counted): compare every file, parsed or not.
        parts = {
            f"{label}/{path.name}": path
            for sub in ("train", "val") if (base / sub).is_dir()
            for label, path in self._labelled_files(base / sub, [])
        }
        for rel in sorted(set(train_all) - set(parts)):
            skipped.append(Skip(train_all[rel], "in train_all/ but not in train/ or val/ "
                                                "(train_all must be train + val); not used"))
        for rel in sorted(set(parts) - set(train_all)):
            # The skip names the missing train_all path; the train/val copy is used.
            skipped.append(Skip(base / "train_all" / rel,
                                f"missing from train_all/ but present as {parts[rel]} "
                                "(train_all must be train + val); that copy is used"))

    # -- (b) cam_0/ cam_1/ meta.json split.json -----------------------------
    def _parse_dgd(self) -> ParseResult:
        meta_path = self.root / "meta.json"
        split_path = self.split_file if self.split_file is not None else self.root / "split.json"
        identities = self._load_meta(meta_path)
        split = self._load_split(split_path, len(identities))
        skipped: list[Skip] = []

        # Every folder the metadata points into must be there.
        for folder in sorted({PurePosixPath(f).parts[0] for p in identities for v in p for f in v
                              if len(PurePosixPath(f).parts) > 1}):
            self.require_dir(folder)

        records: list[RawRecord] = []
        used: set[Path] = set()

        def add(pid: int, views: range, split_name: str) -> None:
            for camid in views:
                for rel in identities[pid][camid]:
                    path = self.root / rel
                    if not path.is_file():
                        skipped.append(Skip(path, f"listed in {meta_path.name} but missing"))
                        continue
                    used.add(path)
                    records.append(RawRecord(path, pid, camid, split_name))

        for pid in split["trainval"]:
            add(pid, range(len(identities[pid])), "train")
        probes = set(split["test_probe"])
        for pid in split["test_probe"]:
            half = len(identities[pid]) // 2
            add(pid, range(half), "query")
            add(pid, range(half, len(identities[pid])), "gallery")
        for pid in split["test_gallery"]:
            if pid not in probes:  # distractors: every view, never a query
                add(pid, range(len(identities[pid])), "gallery")

        # Account for every image on disk that was not used.
        listed = {self.root / f: pid for pid, p in enumerate(identities) for v in p for f in v}
        for cam_dir in sorted(p for p in self.root.iterdir()
                              if p.is_dir() and self._DGD_CAM.match(p.name)):
            for path in list_files(cam_dir, skipped):
                if path in used:
                    continue
                if path in listed:
                    rule = f"identity {listed[path]} is in no split of {split_path.name}"
                else:
                    rule = f"not listed in {meta_path.name}"
                skipped.append(Skip(path, rule))
        return ParseResult(carve_val(records), skipped, split)

    def _load_json(self, path: Path, what: str) -> object:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RawLayoutError(f"{self.name}: cannot read {path} ({what}): {exc}") from exc

    def _load_meta(self, path: Path) -> list[list[list[str]]]:
        meta = self._load_json(path, f"expected keys {DGD_META_KEYS}")
        bad = f"{self.name}: malformed {path}: expected a JSON object with {DGD_META_KEYS}"
        if not isinstance(meta, dict) or not isinstance(meta.get("identities"), list):
            raise RawLayoutError(bad)
        identities = meta["identities"]
        num_cameras = meta.get("num_cameras")
        for i, person in enumerate(identities):
            if not isinstance(person, list) or not all(
                isinstance(v, list) and all(isinstance(f, str) for f in v) for v in person
            ):
                raise RawLayoutError(f"{bad}; identity {i} is not a list of file lists")
            if isinstance(num_cameras, int) and len(person) != num_cameras:
                raise RawLayoutError(
                    f"{bad}; identity {i} has {len(person)} cameras, num_cameras is {num_cameras}"
                )
            for f in (f for v in person for f in v):
                rel = PurePosixPath(f)
                # The metadata must not point outside the dataset folder.
                if rel.is_absolute() or ".." in rel.parts:
                    raise RawLayoutError(f"{bad}; path {f!r} is not inside the folder")
        return identities

    def _load_split(self, path: Path, num_ids: int) -> dict:
        expected = ", ".join(f'"{k}"' for k in DGD_SPLIT_KEYS)
        split = self._load_json(path, f"expected keys {expected}")
        bad = (f"{self.name}: malformed {path}: expected a JSON object with {expected}, "
               f"each a list of identity indices 0..{num_ids - 1} of meta.json")
        if not isinstance(split, dict):
            raise RawLayoutError(bad)
        for key in DGD_SPLIT_KEYS:
            ids = split.get(key)
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_ids for i in ids
            ):
                raise RawLayoutError(f"{bad}; {key!r} is missing or holds other values")
        test = set(split["test_probe"]) | set(split["test_gallery"])
        overlap = sorted(set(split["trainval"]) & test)
        if overlap:
            raise RawLayoutError(f"{bad}; identities in both trainval and test: {overlap[:10]}")
        return split
