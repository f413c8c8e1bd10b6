"""CUHK01 (CUHK Campus)."""

from __future__ import annotations

import re
from pathlib import Path

from . import register
from .base import (
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawRecord,
    Skip,
    carve_val,
    list_files,
)


@register
class CUHK01(RawDataset):
    """CUHK01 (Li, Zhao and Wang, "Human Reidentification with Transferred
    Metric Learning", ACCV 2012).

    971 identities seen by two disjoint campus cameras, two images each
    (3,884 images, 160x60). By request to the CUHK group (CUHK01 / "CUHK
    Campus" dataset).

    Layout::

        CUHK01/campus/0001001.png   PPPP person (0001-0971), VVV view (001-004)

    Views 001-002 are camera A (camid 0), 003-004 camera B (camid 1). 485 ids
    (seeded) train; the other 486 give query (camera A) and gallery (camera B).
    Details: ``docs/datasets.md``.
    """

    name = "cuhk01"
    dataset_dir = "CUHK01"
    #: The DGD converter indexed persons in sorted order too: its split.json applies as is.
    dgd_split_ids = True
    expected = ExpectedCounts(
        train_ids=485, train_images=1940, query_ids=486, query_images=972, gallery_images=972
    )

    PAPER_TRAIN, PAPER_TOTAL = 485, 971
    _NAME = re.compile(r"^(\d{4})(\d{3})\.png$", re.IGNORECASE)
    #: view number -> camera: the first two views are camera A, the last two B.
    _VIEW_CAMERA = {1: 0, 2: 0, 3: 1, 4: 1}

    def parse(self) -> ParseResult:
        skipped: list[Skip] = []
        images: list[tuple[int, int, Path]] = []  # (person number, camid, path)
        for path in list_files(self.require_dir("campus"), skipped):
            match = self._NAME.match(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r}"))
                continue
            view = int(match.group(2))
            if view not in self._VIEW_CAMERA:
                skipped.append(Skip(path, "view number outside 001-004"))
                continue
            images.append((int(match.group(1)), self._VIEW_CAMERA[view], path))

        # Index in sorted person order: stable ids whatever the numbering gaps.
        pid_of = {num: i for i, num in enumerate(sorted({num for num, _, _ in images}))}
        train, _test, id_split = self.choose_id_split(
            pid_of.values(), self.PAPER_TRAIN, self.PAPER_TOTAL, skipped
        )
        train_set = set(train)
        records = []
        for num, camid, path in images:
            pid = pid_of[num]
            split = "train" if pid in train_set else ("query", "gallery")[camid]
            records.append(RawRecord(path, pid, camid, split))
        return ParseResult(carve_val(records), skipped, id_split)
