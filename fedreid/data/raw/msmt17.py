"""MSMT17 raw-layout parser (original release or Market-style repack)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Optional

from . import register
from .base import ExpectedCounts, ParseResult, RawLayoutError, RawRecord, Skip, id_problem, list_files
from .market_style import MarketStyleDataset


@register
class MSMT17(MarketStyleDataset):
    """MSMT17.

    Reference:
        Wei et al. "Person Transfer GAN to Bridge Domain Gap for Person
        Re-Identification." CVPR 2018.

    Statistics:
        4,101 identities, 15 cameras, 126,441 boxes.
        Train 1,041 ids / 32,621 images (train + official val); query 3,060
        ids / 11,659 images; gallery 82,161 images.

    Obtain it by request to the authors and unpack it unchanged under the raw
    root. Three layouts are read, the first one present:

    1. The original release, ``<raw_root>/MSMT17_V1`` (:attr:`dataset_dir`)::

           MSMT17_V1/train/0000/0000_000_01_0303morning_0015_0.jpg
           MSMT17_V1/test/0000/...
           MSMT17_V1/list_{train,val,query,gallery}.txt   "<pid>/<file> <pid>" per line

    2. The second release, faces blurred, ``<raw_root>/MSMT17_V2``
       (:attr:`v2_dir`): the same lists and names, images under
       ``mask_train_v2/`` and ``mask_test_v2/``.

    3. The Market-style repack, ``<raw_root>/MSMT17`` (:attr:`repack_dir`)::

           MSMT17/{bounding_box_train,bounding_box_test,query}/0000_c1_0303morning_0015_0.jpg

    Cameras are whole integers (``c15`` is camid 14). Test identities restart
    at ``0000``; the prepared manifest adds :attr:`test_pid_offset` (10000) to
    query and gallery pids. The lists, the skips and the renumbering:
    ``docs/datasets.md``.
    """

    name = "msmt17"
    dataset_dir = "MSMT17_V1"
    #: Folder of the second release (faces blurred), read only when ``MSMT17_V1`` is absent.
    v2_dir = "MSMT17_V2"
    #: Folder of the Market-style repack, read only when neither release folder is there.
    repack_dir = "MSMT17"
    #: Image folders of each release, by the lists' two folders ("train": train and val, "test").
    _IMAGE_DIRS: dict[str, dict[str, str]] = {
        "MSMT17_V1": {"train": "train", "test": "test"},
        "MSMT17_V2": {"train": "mask_train_v2", "test": "mask_test_v2"},
    }
    expected = ExpectedCounts(
        train_ids=1041,
        train_images=32621,
        query_ids=3060,
        query_images=11659,
        gallery_images=82161,
    )
    test_pid_offset = 10000

    #: (list file, image folder its paths are relative to, split).
    _LISTS: tuple[tuple[str, str, str], ...] = (
        ("list_train.txt", "train", "train"),
        ("list_val.txt", "train", "val"),
        ("list_query.txt", "test", "query"),
        ("list_gallery.txt", "test", "gallery"),
    )
    #: ``<pid>/<file> <label>``; anything else on a line makes it malformed.
    _LINE = re.compile(r"^\s*(\S+)\s+(-?\d+)\s*$")
    #: ``pid_seq_cam_datetime_frame_n``; the pid comes from the list label.
    _NAME = re.compile(r"^(\d+)_(\d+)_(\d+)_")
    #: The repack's names, ``<pid>_c<cam>_<date+time>_<frame>_<n>``.
    pattern = re.compile(r"^(-?\d+)_c(\d+)_")

    def _release(self) -> Optional[Path]:
        """The release folder :meth:`parse` reads (``MSMT17_V1``, else ``MSMT17_V2``), or None for the repack."""
        return next((folder for folder in (self.root, self.raw_root / self.v2_dir) if folder.is_dir()), None)

    @property
    def source_dir(self) -> Path:
        """``MSMT17_V1`` when present, else ``MSMT17_V2``, else the repack folder (the one :meth:`parse` reads)."""
        return self._release() or self.raw_root / self.repack_dir

    def parse(self) -> ParseResult:
        release = self._release()
        if release is not None:
            return self._parse_original(release)
        repack = self.raw_root / self.repack_dir
        if repack.is_dir():
            return super().parse()  # the Market-style reader, over split_dir
        raise RawLayoutError(
            f"{self.name}: expected the original release folder {self.root} "
            f"(train/ test/ list_*.txt), the second release {self.raw_root / self.v2_dir} "
            f"(mask_train_v2/ mask_test_v2/ list_*.txt) or the Market-style repack folder {repack} "
            f"(bounding_box_train/ bounding_box_test/ query/); see datasets/README.md"
        )

    # -- original release ----------------------------------------------------
    def _parse_original(self, release: Path) -> ParseResult:
        """The four lists of ``release`` name every record; ``list_val.txt`` is the official val (none carved)."""
        bases = {key: self.require_dir(folder, release=release) for key, folder in self._IMAGE_DIRS[release.name].items()}
        lists = []
        for list_name, folder, split in self._LISTS:
            list_path = release / list_name
            if not list_path.is_file():
                raise RawLayoutError(
                    f"{self.name}: expected the list file {list_path} "
                    f"(the {release.name} release layout; see datasets/README.md)"
                )
            lists.append((list_path, bases[folder], split))

        skipped: list[Skip] = []
        # One listing of the image folders answers every "is it there?" of the
        # lists without a stat per line, and reveals the images no list names.
        present: set[Path] = set()
        for base in bases.values():
            present.update(list_files(base, skipped, subfolders=True))
            for sub in sorted(p for p in base.iterdir() if p.is_dir()):
                present.update(list_files(sub, skipped))

        records: list[RawRecord] = []
        listed: dict[Path, str] = {}
        for list_path, base, split in lists:
            records += self.process_list(list_path, base, split, present, listed, skipped)
        for path in sorted(present - listed.keys()):
            skipped.append(Skip(path, "not named by any list_*.txt"))
        records.sort(key=lambda r: (r.split, str(r.path)))
        return ParseResult(records, skipped)

    def process_list(
        self,
        list_path: Path,
        base: Path,
        split: str,
        present: set[Path],
        listed: dict[Path, str],
        skipped: list[Skip],
    ) -> list[RawRecord]:
        """Records of one ``list_*.txt``; every unusable line is a counted skip.

        A skip's reason ends with its place, ``(list_train.txt line 7)``, after
        the rule, so that :func:`~fedreid.data.raw.base.summarize_skips` groups
        the lines by rule (a partly extracted release skips thousands).
        """
        records = []
        lines = list_path.read_text(encoding="utf-8", errors="replace").splitlines()
        for lineno, line in enumerate(lines, start=1):
            where = f"{list_path.name} line {lineno}"
            if not line.strip():
                continue  # blank lines (a trailing newline) carry no entry
            entry = self._LINE.match(line)
            rel = PurePosixPath(entry.group(1)) if entry else None
            if entry is None or rel is None or rel.is_absolute() or ".." in rel.parts:
                # Paths must stay inside the image folder the list belongs to.
                skipped.append(
                    Skip(
                        list_path,
                        f"malformed line, expected '<pid>/<file> <pid>' inside the image folder "
                        f"({where}: {line.strip()!r})",
                    )
                )
                continue
            path = base.joinpath(*rel.parts)
            if path not in present:
                # Only failures pay for a stat, to say which kind of failure it is.
                if not path.is_file():
                    reason = "missing"
                elif len(rel.parts) > 2:
                    reason = "below the <pid>/<file> folders"
                else:
                    reason = "not an image"
                skipped.append(Skip(path, f"listed file is {reason} ({where})"))
                continue
            if path in listed:
                skipped.append(Skip(path, f"listed twice ({where}; first at {listed[path]})"))
                continue
            match = self._NAME.search(path.name)
            if match is None:
                skipped.append(Skip(path, f"name does not match {self._NAME.pattern!r} ({where})"))
                continue
            listed[path] = where
            pid, camid = int(entry.group(2)), int(match.group(3)) - 1
            problem = id_problem(pid, camid)
            if problem is not None:
                skipped.append(Skip(path, f"{problem} ({where})"))
                continue
            records.append(RawRecord(path, pid, camid, split))
        return records

    # -- Market-style repack -------------------------------------------------
    def split_dir(self, folder: str) -> Path:
        path = self.raw_root / self.repack_dir / folder
        if not path.is_dir():
            # require_dir would name MSMT17_V1; the user holds the repack.
            raise RawLayoutError(
                f"{self.name}: expected the folder {path} "
                f"(the Market-style {self.repack_dir} repack; see datasets/README.md)"
            )
        return path
