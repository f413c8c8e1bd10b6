"""Market-1501 raw-layout parser."""

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
    parse_named_images,
)


@register
class Market1501(RawDataset):
    """Market-1501.

    Reference:
        Zheng et al. "Scalable Person Re-identification: A Benchmark." ICCV 2015.

    Statistics:
        1,501 identities (+ distractors), 6 cameras, 32,668 boxes.
        Train 751 ids / 12,936 images; query 750 ids / 3,368 images;
        gallery 19,732 images.

    Obtain it from the authors' project page and unpack it unchanged as
    ``<raw_root>/Market-1501-v15.09.15``.

    Layout::

        Market-1501-v15.09.15/
          bounding_box_train/0002_c1s1_000451_03.jpg   -> train (val carved)
          bounding_box_test/-1_c1s1_000401_03.jpg      -> gallery
          query/0001_c1s1_001051_00.jpg                -> query
          gt_bbox/ gt_query/                           not used

    Names are ``<pid>_c<cam>s<seq>_<frame>_<box>``; pid ``-1`` is junk and
    ``0000`` a distractor, both kept with their pid. The release ships
    ``Thumbs.db`` files (skipped, counted) and a few ``*.jpg.jpg`` files: those
    are real images and are used, as torchreid's ``*.jpg`` glob does and as
    Table 1's 12,936 training images count them.
    """

    name = "market1501"
    dataset_dir = "Market-1501-v15.09.15"
    expected = ExpectedCounts(
        train_ids=751,
        train_images=12936,
        query_ids=750,
        query_images=3368,
        gallery_images=19732,
    )

    #: Anchored at the start only, so a doubled ``.jpg.jpg`` extension still
    #: matches; the camera is a whole integer, never one digit.
    _PATTERN = re.compile(r"^(-?\d+)_c(\d+)s\d+_")
    _FOLDERS: tuple[tuple[str, str], ...] = (
        ("bounding_box_train", "train"),
        ("query", "query"),
        ("bounding_box_test", "gallery"),
    )

    def parse(self) -> ParseResult:
        # Check every folder before reading any, so a broken release fails fast.
        folders = [(self.require_dir(folder), split) for folder, split in self._FOLDERS]
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
