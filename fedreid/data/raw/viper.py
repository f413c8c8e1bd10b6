"""VIPeR, and the seeded identity split shared by the small two-camera sets."""

from __future__ import annotations

import re
from pathlib import Path

from . import register
from .base import (
    ExpectedCounts,
    ParseResult,
    RawDataset,
    RawLayoutError,
    RawRecord,
    Skip,
    carve_val,
    list_files,
)


@register
class VIPeR(RawDataset):
    """VIPeR (Gray and Tao, "Viewpoint Invariant Pedestrian Recognition with
    an Ensemble of Localized Features", ECCV 2008).

    632 identities, one image per camera (1,264 images, 128x48). Available
    from the authors' page at UC Santa Cruz (VIPeR.v1.0.zip).

    Layout::

        VIPeR/cam_a/000_45.bmp    <number>_<viewing angle>.bmp
        VIPeR/cam_b/000_90.bmp

    Images are paired on the person number before ``_``; the i-th number in
    sorted order is pid ``i`` (as the DGD converter's sorted file lists, so the
    benchmark's ``split.json`` applies). A number found in one camera only is a
    :class:`RawLayoutError` naming the files. 316 ids (seeded) train;
    the other 316 give query (``cam_a``) and gallery (``cam_b``). Details:
    ``docs/datasets.md``.
    """

    name = "viper"
    dataset_dir = "VIPeR"
    #: The DGD converter indexed persons in sorted order too: its split.json applies as is.
    dgd_split_ids = True
    expected = ExpectedCounts(
        train_ids=316, train_images=632, query_ids=316, query_images=316, gallery_images=316
    )

    PAPER_TRAIN, PAPER_TOTAL = 316, 632
    _NAME = re.compile(r"^(\d+)_(\d+)\.bmp$", re.IGNORECASE)

    def parse(self) -> ParseResult:
        skipped: list[Skip] = []
        cams = [self._camera_files(self.require_dir(c), skipped) for c in ("cam_a", "cam_b")]
        # Paired on the person number in the file name, so that a missing file is named
        # instead of shifting every later identity.
        unmatched = [sorted(set(cams[c]) - set(cams[1 - c])) for c in (0, 1)]
        if unmatched[0] or unmatched[1]:
            only = "; ".join(
                f"only in {self.root / folder}: {self._shown(cams[c], numbers)}"
                for c, (folder, numbers) in enumerate(zip(("cam_a", "cam_b"), unmatched))
                if numbers
            )
            raise RawLayoutError(
                f"{self.name}: person numbers without an image in the other camera ({only}); "
                "each person needs one <number>_<angle>.bmp in cam_a and one in cam_b"
            )
        numbers = sorted(cams[0])
        train, _test, id_split = self.choose_id_split(
            range(len(numbers)), self.PAPER_TRAIN, self.PAPER_TOTAL, skipped
        )
        train_set = set(train)
        records = []
        for pid, number in enumerate(numbers):
            for camid in (0, 1):
                split = "train" if pid in train_set else ("query", "gallery")[camid]
                records.append(RawRecord(cams[camid][number], pid, camid, split))
        return ParseResult(carve_val(records), skipped, id_split)

    @staticmethod
    def _shown(files: dict[int, Path], numbers: list[int]) -> str:
        names = ", ".join(files[n].name for n in numbers[:10])
        return names + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")

    def _camera_files(self, folder: Path, skipped: list[Skip]) -> dict[int, Path]:
        """Person number -> image of ``folder``; two images of one number are an error."""
        files: dict[int, Path] = {}
        for path in list_files(folder, skipped):
            match = self._NAME.match(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r}"))
                continue
            number = int(match.group(1))
            if number in files:
                raise RawLayoutError(
                    f"{self.name}: {files[number]} and {path.name} both show person {number} "
                    f"in {folder}; each camera holds one image per person"
                )
            files[number] = path
        return files
