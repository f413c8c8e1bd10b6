"""QMUL i-LIDS (the re-id subset of the i-LIDS MCTS data)."""

from __future__ import annotations

import re
from collections import defaultdict
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
class ILIDS(RawDataset):
    """QMUL i-LIDS (Zheng, Gong and Xiang, "Associating Groups of People",
    BMVC 2009), cut from the i-LIDS Multiple-Camera Tracking Scenario.

    119 persons, 476 images, captured at an airport by non-overlapping
    cameras; the release has no camera labels. From the QMUL page
    (i-LIDS_Pedestrian.tgz).

    Layout::

        i-LIDS_Pedestrian/Persons/0001001.jpg   NNNN person, xxx image

    The FedReID paper's Table 1 calls it "iLIDS-VID"; its counts (119 ids)
    are this QMUL i-LIDS set. Each person's sorted images are halved into two
    pseudo-cameras, a deterministic stand-in for DGD's random choice (same
    counts). The benchmark's DGD ``split.json`` applies as a split file. 59 ids
    (seeded) train; the other 60 give query (camera 0) and gallery (camera 1).
    Details: ``docs/datasets.md``.
    """

    name = "ilids"
    dataset_dir = "i-LIDS_Pedestrian"
    #: The DGD converter indexed persons in sorted order too: its split.json applies as is.
    dgd_split_ids = True
    # Image counts depend on which ids are drawn; only the id counts are fixed.
    expected = ExpectedCounts(train_ids=59, query_ids=60)

    PAPER_TRAIN, PAPER_TOTAL = 59, 119
    _NAME = re.compile(r"^(\d{4})(\d{3})\.jpg$", re.IGNORECASE)

    def parse(self) -> ParseResult:
        skipped: list[Skip] = []
        persons: dict[int, list[Path]] = defaultdict(list)
        for path in list_files(self.require_dir("Persons"), skipped):
            match = self._NAME.match(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r}"))
                continue
            persons[int(match.group(1))].append(path)  # list_files yields sorted paths

        pid_of = {num: i for i, num in enumerate(sorted(persons))}
        train, _test, id_split = self.choose_id_split(
            pid_of.values(), self.PAPER_TRAIN, self.PAPER_TOTAL, skipped
        )
        train_set = set(train)
        records = []
        for num, paths in persons.items():
            pid = pid_of[num]
            for i, path in enumerate(paths):
                camid = 0 if i < len(paths) // 2 else 1
                split = "train" if pid in train_set else ("query", "gallery")[camid]
                records.append(RawRecord(path, pid, camid, split))
        return ParseResult(carve_val(records), skipped, id_split)
