"""3DPeS."""

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
class ThreeDPeS(RawDataset):
    """3DPeS (Baltieri, Vezzani and Cucchiara, "3DPeS: 3D People Dataset for
    Surveillance and Forensics", J-HGBU workshop 2011).

    About 200 persons (193 in the re-id release), 1,011 images, 8 outdoor
    cameras. From the Imagelab (University of Modena and Reggio Emilia) page.

    Layout::

        3DPeS/RGB/<pid>_<view>_FRAME_<n>_RGB.bmp

    Each person's sorted distinct views are halved into two pseudo-cameras,
    a deterministic stand-in for DGD's random choice (same counts); the
    benchmark's ``split.json`` does not apply (use ``--layout fedreid``).
    93 ids (seeded) train; the others give query (camera 0) and gallery
    (camera 1). Details: ``docs/datasets.md``.
    """

    name = "3dpes"
    dataset_dir = "3DPeS"
    # Only the train id count is fixed: image counts depend on which ids are drawn.
    expected = ExpectedCounts(train_ids=93)

    PAPER_TRAIN, PAPER_TOTAL = 93, 193
    _NAME = re.compile(r"^(\d+)_(\d+)_FRAME_(\d+)_RGB\.bmp$", re.IGNORECASE)

    def parse(self) -> ParseResult:
        skipped: list[Skip] = []
        # person number -> view number -> paths
        persons: dict[int, dict[int, list[Path]]] = defaultdict(lambda: defaultdict(list))
        for path in list_files(self.require_dir("RGB"), skipped):
            match = self._NAME.match(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r}"))
                continue
            persons[int(match.group(1))][int(match.group(2))].append(path)

        pid_of = {num: i for i, num in enumerate(sorted(persons))}
        train, _test, id_split = self.choose_id_split(
            pid_of.values(), self.PAPER_TRAIN, self.PAPER_TOTAL, skipped
        )
        train_set = set(train)
        records = []
        for num, views in persons.items():
            pid = pid_of[num]
            ordered = sorted(views)  # numeric order, so view 10 follows view 9
            for i, view in enumerate(ordered):
                camid = 0 if i < len(ordered) // 2 else 1
                split = "train" if pid in train_set else ("query", "gallery")[camid]
                records.extend(RawRecord(p, pid, camid, split) for p in views[view])
        return ParseResult(carve_val(records), skipped, id_split)
