"""PRID2011."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np

from fedreid.options import ConfigError

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


@dataclass
class PRID2011Options:
    """Options of the ``prid2011`` parser (``data.options.prid2011``)."""

    #: Most multi-shot frames per camera of a training id, evenly spaced over its sorted sequence.
    max_frames: int = 10
    #: Persons seen by both cameras, the lowest numbers of each (200 in the release; a scaled-down
    #: copy of the layout passes its own: file names cannot tell who is shared).
    num_shared: int = 200

    def validate(self, prefix: str) -> None:
        if self.max_frames < 1:
            raise ConfigError(f"{prefix}.max_frames: must be at least 1, got {self.max_frames}")
        if self.num_shared < 2:
            raise ConfigError(f"{prefix}.num_shared: must be at least 2, got {self.num_shared}")


@register
class PRID2011(RawDataset):
    """PRID2011 (Hirzer, Beleznai, Roth and Bischof, "Person Re-Identification
    by Descriptive and Discriminative Classification", SCIA 2011).

    Two static surveillance cameras: camera A shows 385 persons, camera B 749;
    persons 1-200 appear in both. Single-shot (one image per person and
    camera) and multi-shot (trajectories of 5-675 frames) versions. From the
    AIT/TU Graz page (prid_2011.zip).

    Layout::

        prid_2011/single_shot/{cam_a,cam_b}/person_0001.png
        prid_2011/multi_shot/{cam_a,cam_b}/person_0001/0001.png

    With the benchmark's counts: 100 of the 200 shared persons (seeded) are
    test ids (single-shot query from camera A, gallery from camera B); the
    other shared and the camera-A-only persons train on up to ``max_frames``
    multi-shot frames per camera (evenly spaced, a deterministic stand-in for
    DGD's random choice, same counts); the camera-B-only persons are gallery
    distractors. pids, the shared count and the split: ``docs/datasets.md``.
    """

    name = "prid2011"
    dataset_dir = "prid_2011"
    # Train image counts depend on the sequence lengths of the drawn ids.
    expected = ExpectedCounts(train_ids=285, query_ids=100, query_images=100, gallery_images=649)

    Options: ClassVar[type] = PRID2011Options
    max_frames: int  # set from the options
    num_shared: int  # set from the options

    PAPER_TRAIN, PAPER_TOTAL = 100, 200  # of the shared persons
    _SINGLE = re.compile(r"^person_(\d+)\.png$", re.IGNORECASE)
    _SEQUENCE = re.compile(r"^person_(\d+)$", re.IGNORECASE)
    _FRAME = re.compile(r"^(\d+)\.png$", re.IGNORECASE)

    def parse(self) -> ParseResult:
        skipped: list[Skip] = []
        single = [self._single_shot(c, skipped) for c in ("cam_a", "cam_b")]
        multi_dirs = [self.require_dir("multi_shot", c) for c in ("cam_a", "cam_b")]
        numbers_a, numbers_b = sorted(single[0]), sorted(single[1])
        # File names cannot tell who is shared (person_0300 exists in both
        # cameras but is two people), so the count comes from the release's
        # documentation; the shared persons must be the lowest numbers of both.
        k = self.num_shared
        if k > min(len(numbers_a), len(numbers_b)):
            raise RawLayoutError(
                f"{self.name}: {self.root / 'single_shot'} has {len(numbers_a)} camera-A and "
                f"{len(numbers_b)} camera-B persons, fewer than the {k} persons seen by both "
                "cameras (num_shared; 200 in the release)"
            )
        shared = numbers_a[:k]
        if numbers_b[:k] != shared:
            raise RawLayoutError(
                f"{self.name}: the {k} persons seen by both cameras must be the lowest numbers "
                f"of both {self.root / 'single_shot/cam_a'} and "
                f"{self.root / 'single_shot/cam_b'} (persons 1-200 in the release)"
            )
        a_only, b_only = numbers_a[k:], numbers_b[k:]
        # pid per (camera, person number): shared, then A-only, then B-only.
        order = [(None, n) for n in shared] + [(0, n) for n in a_only] + [(1, n) for n in b_only]
        pid_of = {key: pid for pid, key in enumerate(order)}

        train, _test, id_split = self.choose_id_split(
            range(len(shared)), self.PAPER_TRAIN, self.PAPER_TOTAL, skipped
        )
        train_set = set(train)
        records: list[RawRecord] = []
        # The multi-shot sequences to read, per camera: those of training ids.
        wanted: list[dict[int, int]] = [{}, {}]
        for pid, num in enumerate(shared):
            if pid in train_set:
                wanted[0][num] = wanted[1][num] = pid
                for cam in (0, 1):
                    skipped.append(Skip(single[cam][num], "single-shot image of a training id "
                                        "(training uses multi-shot frames)"))
            else:
                records.append(RawRecord(single[0][num], pid, 0, "query"))
                records.append(RawRecord(single[1][num], pid, 1, "gallery"))
        for num in a_only:
            wanted[0][num] = pid_of[(0, num)]
            skipped.append(Skip(single[0][num], "single-shot image of a training id "
                                "(training uses multi-shot frames)"))
        for num in b_only:
            records.append(RawRecord(single[1][num], pid_of[(1, num)], 1, "gallery"))

        for cam, folder in enumerate(multi_dirs):
            records.extend(self._multi_shot(folder, cam, wanted[cam], skipped))
        return ParseResult(carve_val(records), skipped, id_split)

    def _single_shot(self, cam: str, skipped: list[Skip]) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for path in list_files(self.require_dir("single_shot", cam), skipped):
            match = self._SINGLE.match(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._SINGLE.pattern!r}"))
                continue
            found[int(match.group(1))] = path
        return found

    def _multi_shot(
        self, folder: Path, camid: int, wanted: dict[int, int], skipped: list[Skip]
    ) -> list[RawRecord]:
        """Evenly spaced frames of the wanted sequences; every other frame is a skip."""
        records = []
        seen: set[int] = set()
        for path in list_files(folder, skipped, subfolders=True):  # frames belong in person folders
            skipped.append(Skip(path, "image outside a person_NNNN folder"))
        for seq in sorted(p for p in folder.iterdir() if p.is_dir()):
            match = self._SEQUENCE.match(seq.name)
            num: Optional[int] = int(match.group(1)) if match else None
            frames = []
            for path in list_files(seq, skipped):
                if self._FRAME.match(path.name):
                    frames.append(path)
                else:
                    skipped.append(Skip(path, f"name does not match {self._FRAME.pattern!r}"))
            if num not in wanted:
                rule = (f"folder name does not match {self._SEQUENCE.pattern!r}" if num is None
                        else "multi-shot frame of a test or distractor id "
                             "(the test uses single-shot images)")
                skipped.extend(Skip(p, rule) for p in frames)
                continue
            if frames:  # an empty folder would leave the training id without images
                seen.add(num)
            keep = set(self._spaced(len(frames)))
            for i, path in enumerate(frames):
                if i in keep:
                    records.append(RawRecord(path, wanted[num], camid, "train"))
                else:
                    skipped.append(Skip(path, f"multi-shot frame not among the "
                                              f"{self.max_frames} evenly spaced ones"))
        missing = sorted(set(wanted) - seen)
        if missing:
            raise RawLayoutError(
                f"{self.name}: expected the multi-shot folders "
                f"{', '.join(str(folder / f'person_{n:04d}') for n in missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} ({len(missing)} training ids have "
                "a single-shot image but no multi-shot frames)"
            )
        return records

    def _spaced(self, n: int) -> list[int]:
        """Indices of up to ``max_frames`` frames spread from the first to the last."""
        if n == 0:
            return []
        return sorted(set(np.linspace(0, n - 1, min(n, self.max_frames)).round().astype(int)))
