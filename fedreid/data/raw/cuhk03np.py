"""CUHK03-NP (new protocol) raw-layout parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import register
from .base import (
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawRecord,
    Skip,
    carve_val,
    parse_named_images,
)

#: Table 1 of the FedReID paper uses the detected boxes; the labeled set of
#: the same protocol differs by a few boxes in train and gallery.
_EXPECTED: dict[str, ExpectedCounts] = {
    "detected": ExpectedCounts(
        train_ids=767,
        train_images=7365,
        query_ids=700,
        query_images=1400,
        gallery_images=5332,
    ),
    "labeled": ExpectedCounts(
        train_ids=767,
        train_images=7368,
        query_ids=700,
        query_images=1400,
        gallery_images=5328,
    ),
}


@register
class CUHK03NP(RawDataset):
    """CUHK03-NP, the 767/700 "new protocol" split of CUHK03.

    Reference:
        Zhong et al. "Re-ranking Person Re-identification with k-reciprocal
        Encoding." CVPR 2017 (protocol), over Li et al. "DeepReID: Deep Filter
        Pairing Neural Network for Person Re-identification." CVPR 2014.

    Statistics:
        1,467 identities, 2 cameras; 767 train / 700 test ids.
        Detected: train 7,365 images; query 1,400; gallery 5,332.
        Labeled: train 7,368 images; query 1,400; gallery 5,328.

    Obtain ``cuhk03-np`` from the re-ranking authors' repository (CUHK03 itself
    is distributed by its authors on request) and unpack it unchanged as
    ``<raw_root>/cuhk03-np``.

    Layout::

        cuhk03-np/detected/
          bounding_box_train/0001_c1_1.png   -> train (val carved)
          bounding_box_test/                 -> gallery
          query/                             -> query
        cuhk03-np/labeled/...                same, hand-drawn boxes

    Names are ``<pid>_c<cam>_<n>``, cameras 1-2. ``boxes`` picks the set; the
    benchmark uses ``detected``.
    """

    name = "cuhk03np"
    dataset_dir = "cuhk03-np"
    expected = _EXPECTED["detected"]

    BOXES: tuple[str, ...] = ("detected", "labeled")

    _PATTERN = re.compile(r"^(-?\d+)_c(\d+)_\d+")
    _FOLDERS: tuple[tuple[str, str], ...] = (
        ("bounding_box_train", "train"),
        ("query", "query"),
        ("bounding_box_test", "gallery"),
    )

    def __init__(self, raw_root: str | Path, *, boxes: str = "detected", **kwargs: Any) -> None:
        super().__init__(raw_root, **kwargs)
        if boxes not in self.BOXES:
            raise ValueError(
                f"{self.name}: unknown boxes {boxes!r}; expected one of {', '.join(self.BOXES)}"
            )
        self.boxes = boxes
        # The two box sets have different counts, so the check must follow the choice.
        self.expected = _EXPECTED[boxes]  # type: ignore[misc]

    def parse(self) -> ParseResult:
        # Check every folder before reading any, so a broken release fails fast.
        folders = [
            (self.require_dir(self.boxes, folder), split) for folder, split in self._FOLDERS
        ]
        skipped: list[Skip] = []
        records: list[RawRecord] = []
        for folder, split in folders:
            records += self.process_dir(folder, split, skipped)
        # carve_val sorts by the split before carving; sort again by the final one.
        records = sorted(carve_val(records), key=lambda r: (r.split, str(r.path)))
        return ParseResult(records, skipped)

    def process_dir(self, folder: Path, split: str, skipped: list[Skip]) -> list[RawRecord]:
        return parse_named_images(
            folder,
            self._PATTERN,
            split,
            lambda m: (int(m.group(1)), int(m.group(2)) - 1),
            skipped,
        )
