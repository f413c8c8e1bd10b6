"""CUHK02, the unlabeled public set of the FedReID knowledge distillation."""

from __future__ import annotations

import re

from . import register
from .base import (
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawLayoutError,
    RawRecord,
    Skip,
    list_files,
)


@register
class CUHK02(RawDataset):
    """CUHK02 (Li and Wang, "Locally Aligned Feature Transforms across Views",
    CVPR 2013).

    1,816 persons, 7,264 images, five camera pairs (P1-P5: 971, 306, 107, 193
    and 239 persons), two images per person and camera; P1 is CUHK01, so the
    public set overlaps CUHK01's test persons (as in the paper). By request to the
    CUHK group.

    Layout::

        cuhk02/Dataset/P1/cam1/<pid>_<n>.png   P1..P5, each with cam1 and cam2

    The unlabeled public set of the server-side knowledge distillation: every
    image is ``train``; pid ``pair * 100000 + number``, camid ``2 * (pair - 1)
    + (cam - 1)``. Details: ``docs/datasets.md``.
    """

    name = "cuhk02"
    dataset_dir = "cuhk02"
    expected = ExpectedCounts(train_ids=1816, train_images=7264)
    public = True

    PAIRS = (1, 2, 3, 4, 5)
    PID_STRIDE = 100000  # larger than any person number of one pair
    _NAME = re.compile(r"^(\d+)_(\d+)\.png$", re.IGNORECASE)

    def parse(self) -> ParseResult:
        if self.split_file is not None:
            raise RawLayoutError(
                f"{self.name}: the public set has no identity split; "
                f"the split file {self.split_file} cannot apply"
            )
        skipped: list[Skip] = []
        records = []
        for pair in self.PAIRS:
            for cam in (1, 2):
                folder = self.require_dir("Dataset", f"P{pair}", f"cam{cam}")
                for path in list_files(folder, skipped):
                    match = self._NAME.match(path.name)
                    if match is None:
                        skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r}"))
                        continue
                    number = int(match.group(1))
                    if number >= self.PID_STRIDE:
                        skipped.append(Skip(path, f"person number >= {self.PID_STRIDE} "
                                                  "would collide with the next pair's ids"))
                        continue
                    camid = 2 * (pair - 1) + (cam - 1)
                    records.append(
                        RawRecord(path, pair * self.PID_STRIDE + number, camid, "train")
                    )
        return ParseResult(records, skipped, None)
