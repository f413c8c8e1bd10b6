"""The prepared format: one folder per dataset, images plus a manifest.

``prepare_dataset`` turns a raw parser's records into::

    <out>/<name>/
      images/<split>/<index>_<pid>_c<camid>.<ext>
      manifest.csv   path,pid,camid,split,source
      card.json, card.md, split.json (when the split was drawn), skipped.csv, prepare.json

It writes into a hidden temporary folder and renames it into place at the end,
so an interrupted run leaves no half dataset, and it never writes under the raw
root. It only ever replaces or deletes folders it made itself: a target that
holds its ``prepare.json`` naming the dataset, and its own hidden temporary
folders (``.<name>.tmp-*``, ``.<name>.old-*``), which a killed run may leave
behind and the next run of the same dataset removes (except one that another
host's run may still own, and a whole previous copy left aside without a
target, which is moved back). ``PreparedDataset.load``
reads the result back.

Every prepared dataset is one benchmark's split: its train (and val)
identities and its test (query and gallery) identities are disjoint, and each
image is in one split. Preparing refuses parser output that breaks this, and
loading refuses a manifest that does (:func:`read_manifest`). ``prepare.json``
records the raw folder's file list (:func:`raw_fingerprint`), so that a re-run
on a raw folder that changed says the prepared copy is stale.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from fedreid import __version__
from fedreid.data.raw.base import (
    IMAGE_EXTENSIONS,
    SPLIT_NAMES,
    SPLITS,
    ExpectedCounts,
    RawDataset,
    RawRecord,
    Skip,
    id_problem,
    offset_test_ids,
    skips_in_brief,
)
from fedreid.errors import FedReIDError
from fedreid.utils.io import (
    replace_dir_atomically,
    swap_leftovers,
    swap_sibling,
    write_json_atomic,
    write_text_atomic,
)

MANIFEST = "manifest.csv"
MANIFEST_FIELDS = ("path", "pid", "camid", "split", "source")
#: Written by the synthetic generator: counts its releases must parse to.
SYNTHETIC_COUNTS_FILE = "synthetic_world.json"
#: Written last into every prepared folder. A folder holding it (naming its
#: dataset) is this tool's own, the only kind of target it replaces.
PREPARE_RECORD = "prepare.json"
#: Inside a temporary folder while a run fills it: which process owns it, so a
#: concurrent run of the same dataset does not delete it as a leftover.
OWNER_FILE = ".owner.json"
#: The two sides of a benchmark split, whose identities must be disjoint.
TRAIN_SPLITS: tuple[str, ...] = ("train", "val")
TEST_SPLITS: tuple[str, ...] = ("query", "gallery")
#: The pid that pools a release's distractors (people outside the benchmark,
#: each image its own unknown person), by dataset: a label, not an identity,
#: so the card does not count it among the ids. Market-1501's ``0000``; pid 0
#: is a real identity everywhere else (CUHK01, VIPeR, PRID... count from 0).
DISTRACTOR_PIDS: dict[str, int] = {"market1501": 0}
#: The JPEG quality of images resized by ``data.resize`` (chroma not subsampled).
RESIZE_JPEG_QUALITY = 95
#: How ``data.resize`` resizes, as ``prepare.json`` records it: a copy made
#: otherwise (an earlier version's PIL bilinear, JPEG quality 75) is named on a rerun.
RESIZE_METHOD = f"opencv-bicubic, jpeg-q{RESIZE_JPEG_QUALITY}-444 or png"


class PreparedDatasetError(FedReIDError, ValueError):
    """A prepared folder is missing, incomplete or malformed."""


class PrepareError(FedReIDError, RuntimeError):
    """Preparing a dataset failed; the message names the dataset and the cause."""


@dataclass(frozen=True)
class Record:
    path: Path  # absolute path of the prepared image
    pid: int
    camid: int  # 0-based
    split: str


@dataclass
class PrepareReport:
    name: str
    out_dir: Path
    skipped_existing: bool = False
    num_images: int = 0
    skipped: list[Skip] = field(default_factory=list)
    card: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: Housekeeping worth one line (e.g. leftovers of a killed run removed).
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


class PreparedDataset:
    """A prepared dataset: its records and its card."""

    def __init__(self, root: Path, records: list[Record], card: dict) -> None:
        self.root = root
        self.name = root.name
        self.records = records
        self.card = card

    @classmethod
    def load(cls, root: str | Path) -> "PreparedDataset":
        """The dataset in ``root``: its ``manifest.csv``, checked (:func:`read_manifest`), and card.

        The card is ``card.json`` (:func:`read_card`; a damaged one is a
        :class:`PreparedDatasetError` naming it), else counted from the records.
        """
        root = Path(root)
        manifest = root / MANIFEST
        if not manifest.is_file():
            raise PreparedDatasetError(
                f"{root} is not a prepared dataset: {MANIFEST} is missing "
                f"(run tools/prepare_datasets.py first)"
            )
        records = read_manifest(manifest)
        card_path = root / "card.json"
        if card_path.is_file():
            try:
                card = read_card(card_path)
            except PrepareError as exc:
                raise PreparedDatasetError(str(exc)) from None
        else:
            card = dataset_card(records, DISTRACTOR_PIDS.get(root.name))
        return cls(root, records, card)

    def split(self, name: str) -> list[Record]:
        """Records of one split; ``train_all`` is ``train`` + ``val``."""
        if name not in SPLIT_NAMES:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLIT_NAMES)}")
        wanted = {"train", "val"} if name == "train_all" else {name}
        return [r for r in self.records if r.split in wanted]

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"PreparedDataset({self.name!r}, {len(self.records)} images)"


def load_prepared(prepared_root: str | Path, name: str) -> PreparedDataset:
    return PreparedDataset.load(Path(prepared_root) / name)


def read_manifest(path: Path) -> list[Record]:
    """The records of the manifest at ``path`` (image paths made absolute).

    Raises :class:`PreparedDatasetError`, in one line naming the file and the
    line(s), for: a missing column; a row with more or fewer fields than the
    header; an empty, absolute or ``..``-containing path (an image lies inside
    the dataset's folder); a pid or camid that is not a whole number (named),
    a camid below 0 or a pid below -1 (-1 is junk, 0 and up identities); an
    unknown split; a row whose image file does not exist (the first one, with
    how many more); a manifest without rows; a row listing an image that an
    earlier row lists (the same ``path``, or the same ``source`` where the
    column is filled), and an identity in both train/val and query/gallery.
    Junk (pid -1) is exempt from the last check. Every prepared dataset is one
    benchmark's split, whose train and test identities are disjoint: scenarios
    train only on train/val (by-camera clients share identities with each
    other, never with the test) and evaluation ranks query against gallery, so
    a test identity seen in training would inflate the scores silently.
    Blank lines are ignored; a UTF-8 byte-order mark is allowed.
    """
    root = path.parent
    root_str = str(root)
    records = []
    entries: list[tuple[tuple[tuple[str, str], ...], int, str]] = []
    lines: list[int] = []
    missing_files: list[tuple[int, str]] = []
    # utf-8-sig: a spreadsheet's UTF-8 export starts with a byte-order mark,
    # which would otherwise become part of the first column's name.
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        missing = [name for name in MANIFEST_FIELDS[:4] if name not in header]
        if missing:
            raise PreparedDatasetError(
                f"{path}: missing columns {', '.join(sorted(missing))}; "
                f"expected {','.join(MANIFEST_FIELDS)}"
            )
        column = {name: header.index(name) for name in MANIFEST_FIELDS if name in header}
        for fields in reader:
            if not fields:
                continue  # a blank line
            line = reader.line_num  # the physical line: a quoted field may span lines
            where = f"{path}, line {line}"
            if len(fields) != len(header):
                raise PreparedDatasetError(
                    f"{where}: {len(fields)} field(s), expected {len(header)} as in the header "
                    f"({','.join(header)})"
                )
            row = {name: fields[index] for name, index in column.items()}
            rel = row["path"]
            problem = _path_problem(rel)
            if problem is not None:
                raise PreparedDatasetError(f"{where}: {problem}")
            pid = _int_field(where, row, "pid")
            camid = _int_field(where, row, "camid")
            if pid < -1:
                raise PreparedDatasetError(
                    f"{where}: pid {pid} is below -1 (-1 marks junk, identities are 0 or more)"
                )
            if camid < 0:
                raise PreparedDatasetError(f"{where}: camid {camid} is negative (cameras count from 0)")
            if row["split"] not in SPLITS:
                raise PreparedDatasetError(
                    f"{where}: split {row['split']!r} is not one of {', '.join(SPLITS)}"
                )
            # One stat per row: a missing image fails here, naming the manifest's line,
            # rather than mid-training or mid-evaluation when it is first decoded.
            # On a string: Path.is_file formats the path first, which costs as much as the stat.
            if not os.path.isfile(os.path.join(root_str, rel)):
                missing_files.append((line, rel))
            rec = Record(root / rel, pid, camid, row["split"])
            keys = [("path", posixpath.normpath(rel))]
            if row.get("source"):
                keys.append(("source", posixpath.normpath(row["source"])))
            records.append(rec)
            entries.append((tuple(keys), rec.pid, rec.split))
            lines.append(line)
    if not records:
        raise PreparedDatasetError(
            f"{path}: no rows, only the header; a prepared dataset lists at least one image "
            "(if tools/prepare_datasets.py made it, prepare it again with --force)"
        )
    if missing_files:
        line, rel = missing_files[0]
        more = f" (and {len(missing_files) - 1:,} more row(s)' images)" if len(missing_files) > 1 else ""
        raise PreparedDatasetError(
            f"{path}, line {line}: the image file {rel} is missing from {root}{more} "
            "(if tools/prepare_datasets.py made it, prepare it again with --force)"
        )
    conflict = find_split_conflict(entries)
    if conflict is not None:
        raise PreparedDatasetError(_manifest_conflict(path, conflict, entries, lines))
    return records


#: A manifest's pid or camid: a whole number as the prepare step writes it, nothing else.
_INTEGER = re.compile(r"-?[0-9]+")


def _int_field(where: str, row: dict[str, str], name: str) -> int:
    value = row[name]
    if not _INTEGER.fullmatch(value):
        raise PreparedDatasetError(f"{where}: {name} {value!r} is not an integer")
    return int(value)


def _path_problem(rel: str) -> Optional[str]:
    """Why the manifest path ``rel`` cannot name an image inside the dataset's folder; None if it can."""
    if not rel:
        return "path is empty"
    # Plain string tests: a PurePosixPath per row costs more than the row's stat.
    if rel.startswith("/"):
        return f"path {rel!r} is absolute; paths are relative to the manifest's folder"
    if ".." in rel.split("/"):
        return f"path {rel!r} contains '..'; images lie inside the manifest's folder"
    return None


def _manifest_conflict(
    path: Path, conflict: SplitConflict, entries: Sequence[tuple], lines: Sequence[int]
) -> str:
    first, second = lines[conflict.first], lines[conflict.second]
    split_a, split_b = entries[conflict.first][2], entries[conflict.second][2]
    if conflict.kind == "identity":
        return (
            f"{path}, line {first}: identity {conflict.pid} is in {split_a} and in {split_b} "
            f"(line {second}); a benchmark's train and test identities must be disjoint "
            "(if tools/prepare_datasets.py made it, prepare it again with --force)"
        )
    what, key = conflict.key
    if what == "source":
        return (
            f"{path}, line {second}: source image {key} is already on line {first}; "
            "each raw image is prepared once"
        )
    if split_a == split_b:
        return f"{path}, line {second}: duplicate of line {first} ({key})"
    return (
        f"{path}, line {second}: {key} is listed as {split_b} here and as {split_a} on "
        f"line {first}; an image belongs to one split"
    )


@dataclass(frozen=True)
class SplitConflict:
    """Two entries given to :func:`find_split_conflict` that cannot both hold.

    ``kind`` is ``"image"`` (both list the image ``key``; ``first`` is the
    earlier entry) or ``"identity"`` (``pid`` is in training and in the test;
    ``first`` is the training entry, ``second`` the test one).
    """

    kind: str
    first: int
    second: int
    key: tuple[str, str] = ("", "")
    pid: int = 0


def find_split_conflict(
    entries: Sequence[tuple[Sequence[tuple[str, str]], int, str]],
) -> Optional[SplitConflict]:
    """The first conflict (in entry order) among ``(image keys, pid, split)`` entries.

    An image key (e.g. ``("path", "images/train/x.jpg")``) listed by two
    entries is a conflict, whatever their splits; so is a pid other than -1
    (junk) found in :data:`TRAIN_SPLITS` and in :data:`TEST_SPLITS`.
    """
    seen: dict[tuple[str, str], int] = {}
    train_ids: dict[int, int] = {}
    test_ids: dict[int, int] = {}
    for index, (keys, pid, split) in enumerate(entries):
        for key in keys:
            if key in seen:
                return SplitConflict("image", seen[key], index, key=key)
            seen[key] = index
        if pid == -1:
            continue
        if split in TRAIN_SPLITS:
            train_ids.setdefault(pid, index)
            if pid in test_ids:
                return SplitConflict("identity", index, test_ids[pid], pid=pid)
        elif split in TEST_SPLITS:
            test_ids.setdefault(pid, index)
            if pid in train_ids:
                return SplitConflict("identity", train_ids[pid], index, pid=pid)
    return None


# ---------------------------------------------------------------------------
# Cards and counts
# ---------------------------------------------------------------------------


def dataset_card(
    records: Sequence[Record | RawRecord], distractor_pid: Optional[int] = None
) -> dict:
    """Ids, images and cameras per split (``train_all`` included).

    ``ids`` counts identities: junk (pid -1) and ``distractor_pid`` (the
    dataset's pooled distractor label, :data:`DISTRACTOR_PIDS`) are images,
    not identities, so Market-1501's gallery has 750 ids, as its release says.
    ``gallery.junk_images`` counts the junk images; with a ``distractor_pid``,
    ``gallery.distractor_images`` counts its images.
    """
    not_ids = {-1} if distractor_pid is None else {-1, distractor_pid}
    card = {}
    for split in SPLIT_NAMES:
        wanted = {"train", "val"} if split == "train_all" else {split}
        recs = [r for r in records if r.split in wanted]
        card[split] = {
            "ids": len({r.pid for r in recs} - not_ids),
            "images": len(recs),
            "cameras": sorted({r.camid for r in recs}),
        }
    gallery = [r for r in records if r.split == "gallery"]
    card["gallery"]["junk_images"] = sum(r.pid == -1 for r in gallery)
    if distractor_pid is not None:
        card["gallery"]["distractor_images"] = sum(r.pid == distractor_pid for r in gallery)
    return card


def card_counts(card: dict) -> ExpectedCounts:
    return ExpectedCounts(
        train_ids=card["train_all"]["ids"],
        train_images=card["train_all"]["images"],
        query_ids=card["query"]["ids"],
        query_images=card["query"]["images"],
        gallery_images=card["gallery"]["images"],
    )


def count_mismatches(name: str, card: dict, expected: Optional[ExpectedCounts]) -> list[str]:
    """One warning per count that differs from ``expected`` (None fields are not checked)."""
    if expected is None:
        return []
    found = card_counts(card)
    out = []
    for key, want in asdict(expected).items():
        got = getattr(found, key)
        if want is not None and got != want:
            out.append(f"{name}: {key.replace('_', ' ')} is {got:,}, expected {want:,}")
    return out


def synthetic_world(raw_root: str | Path) -> Optional[dict]:
    """The synthetic generator's summary if ``raw_root`` holds its output."""
    path = Path(raw_root) / SYNTHETIC_COUNTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def expected_counts(parser: RawDataset) -> Optional[ExpectedCounts]:
    """The counts to check: the synthetic world's own, else the paper's Table 1."""
    world = synthetic_world(parser.raw_root)
    if world is not None:
        counts = world.get("counts", {}).get(parser.name)
        return ExpectedCounts(**counts) if counts else None
    return parser.expected


def format_card(name: str, card: dict) -> str:
    """The card as a small markdown table."""
    lines = [
        f"### {name}",
        "",
        "| split | ids | images | cameras |",
        "|---|---:|---:|---|",
    ]
    for split in SPLIT_NAMES:
        row = card[split]
        if split != "train_all" and row["images"] == 0:
            continue
        cams = _format_cameras(row["cameras"])
        lines.append(f"| {split} | {row['ids']:,} | {row['images']:,} | {cams} |")
    junk = card["gallery"].get("junk_images", 0)
    if junk:
        lines.append(f"\n{junk:,} gallery images are junk (pid -1), removed at evaluation.")
    distractors = card["gallery"].get("distractor_images", 0)
    if distractors:
        lines.append(
            f"\n{distractors:,} gallery images are distractors (their shared pid is not counted as an id), "
            "kept as negatives at evaluation."
        )
    return "\n".join(lines) + "\n"


def format_summary(cards: dict[str, dict]) -> str:
    """One table over several datasets, in the layout of the paper's Table 1."""
    lines = [
        "| dataset | train ids | train imgs | query ids | query imgs | gallery imgs | cameras |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, card in cards.items():
        c = card_counts(card)
        cams = len({cam for split in SPLITS for cam in card[split]["cameras"]})
        lines.append(
            f"| {name} | {c.train_ids:,} | {c.train_images:,} | {c.query_ids:,} "
            f"| {c.query_images:,} | {c.gallery_images:,} | {cams} |"
        )
    return "\n".join(lines) + "\n"


def _format_cameras(cams: list[int]) -> str:
    if not cams:
        return "-"
    if cams == list(range(cams[0], cams[-1] + 1)) and len(cams) > 2:
        return f"{cams[0]}-{cams[-1]}"
    return ", ".join(map(str, cams))


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def is_prepared(out_dir: Path) -> bool:
    return (out_dir / MANIFEST).is_file() and (out_dir / PREPARE_RECORD).is_file()


def read_json_object(path: Path, hint: str) -> dict:
    """The JSON object in ``path``, a file of a prepared folder.

    Raises :class:`PrepareError`, one line naming the dataset (the folder's
    name), the file, what is wrong (missing, unreadable, not JSON, not an
    object) and ``hint`` (what to do about it).
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = "is missing"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # not JSON, or not UTF-8
        why = f"is not valid JSON ({exc})"
    else:
        if isinstance(value, dict):
            return value
        why = f"holds a JSON {type(value).__name__}, not an object"
    raise PrepareError(f"{path.parent.name}: {path} {why}; {hint}")


def read_prepare_record(folder: Path) -> dict:
    """``folder``'s ``prepare.json`` (:func:`read_json_object`).

    Its hint is to move the folder away, not ``--force``: a folder whose
    record cannot be read may not be this tool's, and ``--force`` replaces
    only folders whose record names the dataset (:func:`_check_replaceable`).
    """
    return read_json_object(
        folder / PREPARE_RECORD,
        "the tool cannot tell that it prepared this folder, so --force will not replace it either: "
        "move the folder away (or restore the file) and run again",
    )


def read_card(path: Path) -> dict:
    """The dataset card at ``path`` with what :func:`format_summary` reads.

    Raises :class:`PrepareError` naming the file and the first missing or
    mistyped entry; the hint is ``--force``, which remakes the whole folder.
    """
    hint = "use --force to prepare the dataset again"
    card = read_json_object(path, hint)
    needed = [(split, key) for split in ("train_all", "query") for key in ("ids", "images")]
    needed += [("gallery", "images")] + [(split, "cameras") for split in SPLITS]
    for split, key in needed:
        entry = card.get(split)
        value = entry.get(key) if isinstance(entry, dict) else None
        if key == "cameras":
            ok, expected = isinstance(value, list) and all(type(v) is int for v in value), "a list of integers"
        else:
            ok, expected = type(value) is int, "an integer"
        if not ok:
            raise PrepareError(
                f"{path.parent.name}: {path} is not a dataset card ({split}.{key} is "
                f"{'missing' if value is None else repr(value)}, expected {expected}); {hint}"
            )
    return card


def prepared_cards(out_root: str | Path) -> tuple[dict[str, dict], list[str]]:
    """The card of every prepared dataset under ``out_root``, and problems reading them.

    Used for the combined ``cards.md``, so that it lists the datasets of
    earlier runs too, not only the latest run's.
    """
    out_root = Path(out_root)
    cards: dict[str, dict] = {}
    problems: list[str] = []
    if not out_root.is_dir():
        return cards, problems
    for folder in sorted(out_root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir() or not is_prepared(folder):
            continue
        try:
            card = read_card(folder / "card.json")
        except PrepareError as exc:
            problems.append(f"{exc}; left out of cards.md")
            continue
        cards[folder.name] = card
    return cards, problems


def prepare_dataset(
    parser: RawDataset,
    out_root: str | Path,
    *,
    resize: Optional[Sequence[int]] = None,
    workers: int = 2,
    force: bool = False,
    progress: bool = True,
) -> PrepareReport:
    """Parse, check and copy one dataset into ``out_root/<name>``.

    Already prepared datasets are left alone unless ``force``; the report
    then warns about options that differ and about a raw folder whose file
    list changed since (the copy is stale), or says that an older copy without
    a recorded file list cannot be checked. Images that cannot be decoded are
    reported as skips naming the file (the reason text is the same on every
    run); an error writing the copy aborts the run. A split that ends up empty,
    an image the parser puts in two splits, and an identity in both train/val
    and query/gallery are :class:`PrepareError`. A raw root that lies inside
    (or is) the target folder, and a target that this tool did not prepare,
    are refused before anything is moved or deleted.
    """
    started = time.perf_counter()
    out_root = Path(out_root)
    target = out_root / parser.name
    report = PrepareReport(parser.name, target)
    # First, before anything is moved or deleted: the raw data must be out of reach.
    _refuse_overlap(out_root, target, parser.raw_root)
    # A --force run killed mid-swap may have left the previous copy whole aside: put it back
    # before the leftovers are cleaned up and before the raw data is looked at.
    report.notes = _restore_previous_copy(out_root, target, parser.raw_root)
    report.notes += _remove_leftovers(out_root, parser.name, parser.raw_root)
    if is_prepared(target) and not force:
        report.skipped_existing = True
        # prepare.json first: when it is damaged, --force cannot help, and the card's hint says --force.
        report.warnings = _option_changes(target, parser, resize)
        report.card = read_card(target / "card.json")
        stale, notes = _raw_changes(target, parser)
        report.warnings += stale
        report.notes += notes
        return report
    # Fail before the (long) copy, not after it, when the target is not ours to replace.
    _check_replaceable(target, parser.name)

    # Listed before parsing: a file that changes meanwhile makes the next run say "stale".
    fingerprint = raw_fingerprint(parser.source_dir)
    result = parser.parse()
    raw_records = offset_test_ids(result.records, parser.test_pid_offset)
    _check_splits(parser, raw_records)
    _check_not_empty(parser, raw_records, result.skipped)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = swap_sibling(target, "tmp")
    try:
        tmp.mkdir()
        write_json_atomic(tmp / OWNER_FILE, {"pid": os.getpid(), "host": socket.gethostname()})
        records, bad = _copy_images(parser, raw_records, tmp, resize, workers, progress)
        skipped = list(result.skipped) + bad
        _check_not_empty(parser, records, skipped)
        card = dataset_card(records, DISTRACTOR_PIDS.get(parser.name))
        warnings = count_mismatches(parser.name, card, expected_counts(parser))
        _write_metadata(
            tmp, parser, records, skipped, card, warnings, result.id_split, resize, fingerprint
        )
        (tmp / OWNER_FILE).unlink()
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    report.num_images = len(records)
    report.skipped = skipped
    report.card = card
    report.warnings = warnings
    report.seconds = time.perf_counter() - started
    return report


def _option_changes(
    target: Path, parser: RawDataset, resize: Optional[Sequence[int]]
) -> list[str]:
    """Warnings for options that differ from those the existing copy was made with."""
    made = read_prepare_record(target)
    warnings = []
    # A copy made from other raw data is the most surprising thing to keep silently.
    raw_root = str(parser.raw_root.resolve())
    if made.get("raw_root") is not None and made["raw_root"] != raw_root:
        warnings.append(
            f"{parser.name}: already prepared from the raw root {made['raw_root']}, "
            f"not {raw_root}; kept as is (use --force to prepare again)"
        )
    wanted = {
        "layout": type(parser).__name__,
        "split_seed": parser.seed,
        "split_file": str(parser.split_file) if parser.split_file else None,
        "resize": list(resize) if resize is not None else None,
        "resize_method": RESIZE_METHOD if resize is not None else None,
    }
    if not _split_was_drawn(target):  # a release's fixed split: the seed changed nothing
        del wanted["split_seed"]
    warnings += [
        f"{parser.name}: already prepared with {key}={made.get(key)!r}, not {value!r}; "
        "kept as is (use --force to prepare again)"
        for key, value in wanted.items()
        if made.get(key) != value
    ]
    warnings += _recorded_changes(target, made, parser)
    return warnings


def parser_options_record(parser: RawDataset) -> dict:
    """The parser's options as ``prepare.json`` records them (JSON values; ``{}`` for none)."""
    options = getattr(parser, "options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return {}
    return json.loads(json.dumps(asdict(options), default=str))


def _split_file_sha256(parser: RawDataset) -> Optional[str]:
    """The sha256 of the split file's bytes; None without a split file or when it cannot be read."""
    if parser.split_file is None:
        return None
    try:
        return hashlib.sha256(parser.split_file.read_bytes()).hexdigest()
    except OSError:
        return None


def _recorded_changes(target: Path, made: dict, parser: RawDataset) -> list[str]:
    """Warnings for parser options and split-file contents that differ from the copy's record.

    A record written before these were kept (no ``options`` or
    ``split_file_sha256`` key) cannot be compared: as for a missing raw file
    list (:func:`_raw_changes`), one warning says so where the run gives
    options or a split file, and the copy is kept.
    """
    warnings = []
    keep = "kept as is (use --force to prepare again)"
    record = target / PREPARE_RECORD
    options = parser_options_record(parser)
    if "options" not in made:
        if options:
            warnings.append(
                f"{parser.name}: {record} does not record the parser options (prepared by an older "
                f"version), so whether they were {options!r} cannot be checked; {keep}"
            )
    elif made["options"] != options:
        warnings.append(
            f"{parser.name}: already prepared with options={made['options']!r}, not {options!r}; {keep}"
        )
    if parser.split_file is None or made.get("split_file") != str(parser.split_file):
        return warnings  # no split file, or another path: the split_file comparison says so
    now = _split_file_sha256(parser)
    if "split_file_sha256" not in made:
        warnings.append(
            f"{parser.name}: {record} does not record the contents of the split file "
            f"{parser.split_file} (prepared by an older version), so whether it changed cannot "
            f"be checked; {keep}"
        )
    elif now is None:
        warnings.append(f"{parser.name}: the split file {parser.split_file} cannot be read; {keep}")
    elif made["split_file_sha256"] != now:
        warnings.append(
            f"{parser.name}: the split file {parser.split_file} has other contents than when the "
            f"copy was prepared (sha256 {str(made['split_file_sha256'])[:12]}..., now {now[:12]}...); {keep}"
        )
    return warnings


def _split_was_drawn(target: Path) -> bool:
    """Whether the copy in ``target`` split its identities with the seed (its ``split.json`` records one)."""
    try:
        split = json.loads((target / "split.json").read_text())
    except FileNotFoundError:
        return False
    return isinstance(split, dict) and "seed" in split


def raw_fingerprint(folder: str | Path) -> dict:
    """``{"files", "images", "sha256"}`` of the files under ``folder`` (recursive).

    ``sha256`` hashes the sorted ``relative/path<TAB>size`` lines: a file
    added, removed, renamed or resized changes it; contents and times are not
    read, so it costs one listing of the folder. ``images`` counts the files
    with an image extension. Links to folders are followed, each folder once.
    """
    folder = Path(folder)
    entries: list[tuple[bytes, int]] = []
    visited: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in visited:
            dirnames[:] = []  # a link back to a folder already listed
            continue
        visited.add((st.st_dev, st.st_ino))
        rel_dir = os.path.relpath(dirpath, folder)
        for name in filenames:
            try:
                size = os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                size = -1  # a broken link
            rel = name if rel_dir == os.curdir else os.path.join(rel_dir, name)
            entries.append((os.fsencode(Path(rel).as_posix()), size))
    digest = hashlib.sha256()
    for rel, size in sorted(entries):
        digest.update(rel + b"\t" + str(size).encode() + b"\n")
    extensions = tuple(ext.encode() for ext in IMAGE_EXTENSIONS)
    images = sum(rel.lower().endswith(extensions) for rel, _ in entries)
    return {"files": len(entries), "images": images, "sha256": digest.hexdigest()}


def _raw_changes(target: Path, parser: RawDataset) -> tuple[list[str], list[str]]:
    """(warnings, notes) on the raw folder's files since ``target`` was prepared."""
    record = target / PREPARE_RECORD
    made = read_prepare_record(target)
    if made.get("raw_root") not in (None, str(parser.raw_root.resolve())):
        return [], []  # prepared from another raw root: _option_changes says so
    folder = parser.source_dir
    then = made.get("raw_files")
    if not isinstance(then, dict) or not {"files", "images", "sha256"} <= set(then):
        return [
            f"{parser.name}: {record} does not record the raw folder's file list (prepared by "
            f"an older version), so whether {folder} changed since cannot be checked; "
            "rerun with --force to be sure the prepared copy is current"
        ], []
    if not folder.is_dir():
        return [], [
            f"{parser.name}: the raw folder {folder} is gone; the prepared copy is kept as is"
        ]
    now = raw_fingerprint(folder)
    if now["sha256"] == then["sha256"] and now["files"] == then["files"]:
        return [], []
    stale = "the prepared copy is stale, rerun with --force to redo it"
    if now["images"] != then["images"]:
        change = f"now has {now['images']} images, {then['images']} when prepared"
    elif now["files"] != then["files"]:
        change = f"now has {now['files']} files, {then['files']} when prepared"
    else:
        change = f"has the same {now['files']} files as when prepared, but other names or sizes"
    return [f"{parser.name}: raw folder {folder} {change}; {stale}"], []


def _check_splits(parser: RawDataset, records: Sequence[RawRecord]) -> None:
    """A :class:`PrepareError` for ids a manifest cannot hold, an image in two splits or an identity in train and test.

    The built-in parsers skip names with impossible ids (``id_problem``); a
    parser registered from outside that gives one is stopped here, before a
    manifest its loader would refuse is written.
    """
    for rec in records:
        problem = id_problem(rec.pid, rec.camid)
        if problem is not None:
            raise PrepareError(
                f"{parser.name}: the parser gives {rec.path} pid {rec.pid}, camid {rec.camid}: {problem} "
                "(a prepared manifest holds pid -1 and up, camid 0 and up)"
            )
    conflict = find_split_conflict([((("path", str(r.path)),), r.pid, r.split) for r in records])
    if conflict is None:
        return
    a, b = records[conflict.first], records[conflict.second]
    if conflict.kind == "identity":
        raise PrepareError(
            f"{parser.name}: identity {conflict.pid} is in {a.split} ({a.path}) and in {b.split} "
            f"({b.path}); a benchmark's train and test identities must be disjoint (check the "
            f"release under {parser.source_dir} and the split file, if one is given)"
        )
    where = f"twice in {a.split}" if a.split == b.split else f"as {a.split} and as {b.split}"
    raise PrepareError(
        f"{parser.name}: the parser lists {a.path} {where}; each raw image belongs to one split"
    )


def _refuse_overlap(out_root: Path, target: Path, raw_root: Path) -> None:
    """Refuse outputs that could touch the raw data, before anything is written or moved.

    The output root must not lie inside the raw root (we would write there),
    and the raw root must not be, or lie inside, the dataset's target folder
    (replacing the target would move the raw data aside and delete it).
    """
    out, tgt, raw = out_root.resolve(), target.resolve(), raw_root.resolve()
    if out == raw or raw in out.parents:
        raise PrepareError(
            f"the output folder {out_root} lies inside the raw root {raw_root}; "
            "prepared data must be written elsewhere so raw data is never modified"
        )
    if raw == tgt or tgt in raw.parents:

        def shown(given: Path, real: Path) -> str:  # the real path too when a link hides it
            return str(given) if given.absolute() == real else f"{given} (= {real})"

        where = "is" if raw == tgt else "lies inside"
        raise PrepareError(
            f"{target.name}: the raw root {shown(raw_root, raw)} {where} the folder "
            f"{shown(target, tgt)} that the prepared copy would replace; choose an output "
            f"root whose '{target.name}' subfolder does not hold the raw data (e.g. a separate "
            "'prepared' folder); nothing was moved or deleted"
        )


def _check_replaceable(target: Path, name: str) -> None:
    """Raise unless ``target`` is absent, an empty folder, or a folder this tool prepared.

    Only such folders are ever moved aside and deleted; anything else (the
    user's own files, a link, a folder without our ``prepare.json``) is refused.
    """
    if target.is_symlink():
        raise PrepareError(
            f"{name}: {target} is a symbolic link, not a folder this tool prepared; "
            "remove the link or choose another output root (nothing was deleted)"
        )
    if not target.exists():
        return
    if not target.is_dir():
        raise PrepareError(
            f"{name}: {target} exists and is not a folder; move it away or choose another "
            "output root (nothing was deleted)"
        )
    if not any(target.iterdir()):
        return
    record = target / PREPARE_RECORD
    try:
        made = json.loads(record.read_text())
    except (OSError, ValueError):
        made = None
    if not isinstance(made, dict) or made.get("dataset") != name:
        raise PrepareError(
            f"{name}: {target} exists but was not prepared by tools/prepare_datasets.py "
            f"(no {PREPARE_RECORD} naming dataset {name!r}); it is not replaced: move it away "
            "or choose another output root (nothing was deleted)"
        )


def _restore_previous_copy(out_root: Path, target: Path, raw_root: Path) -> list[str]:
    """Move a whole previous copy left at ``.<name>.old-*`` back to an absent ``target``.

    :func:`~fedreid.utils.io.replace_dir_atomically` killed between its two
    renames leaves the previous copy whole aside and no target. A leftover is
    moved back only if it is a folder (not a link) holding a ``prepare.json``
    for this dataset and a manifest whose images all exist (a copy partly
    deleted after a finished swap is not whole); the newest such one wins, the
    others are left to :func:`_remove_leftovers`. One note says so.
    """
    name = target.name
    if target.exists() or target.is_symlink() or not out_root.is_dir():
        return []
    raw = raw_root.resolve()
    whole = []
    for path in swap_leftovers(out_root, name):
        if not path.name.startswith(f".{name}.old-") or path.is_symlink() or not path.is_dir():
            continue
        if raw == path.resolve() or path.resolve() in raw.parents:
            continue
        created = _whole_copy(path, name)
        if created is not None:
            whole.append((created, path))
    if not whole:
        return []
    _, path = max(whole)
    os.replace(path, target)
    return [
        f"{name}: restored the previous prepared copy from {path.name} (a run that was "
        f"replacing it was interrupted before the new copy was in place)"
    ]


def _whole_copy(folder: Path, name: str) -> Optional[tuple[str, int]]:
    """A sort key (creation time) if ``folder`` is a complete prepared copy of ``name``, else None."""
    try:
        made = json.loads((folder / PREPARE_RECORD).read_text())
        if not isinstance(made, dict) or made.get("dataset") != name:
            return None
        records = read_manifest(folder / MANIFEST)
    except (OSError, ValueError):
        return None
    if made.get("images") not in (None, len(records)):
        return None
    if not (folder / "card.json").is_file():  # the images: read_manifest checked them
        return None
    return str(made.get("created", "")), (folder / PREPARE_RECORD).stat().st_mtime_ns


def _remove_leftovers(out_root: Path, name: str, raw_root: Path) -> list[str]:
    """Remove this dataset's temporary folders left by a killed run; one line saying so.

    Only hidden folders named exactly as :func:`prepare_dataset` names them are
    touched; one still owned by a running process (or by a process on another
    host, which cannot be checked), a link, or one holding the raw root is left
    alone and reported.
    """
    if not out_root.is_dir():
        return []
    raw = raw_root.resolve()
    removed, notes = [], []
    for path in swap_leftovers(out_root, name):
        if path.is_symlink() or not path.is_dir():
            notes.append(f"{name}: {path} is not a folder this tool made; left alone")
            continue
        if raw == path.resolve() or path.resolve() in raw.parents:
            notes.append(f"{name}: {path} holds the raw root {raw_root}; left alone")
            continue
        owner = _owner(path)
        if owner is not None:
            pid, host = owner
            if host is None:
                notes.append(f"{name}: {path} is being written by running process {pid}; left alone")
            else:
                notes.append(
                    f"{name}: {path} belongs to process {pid} on host {host}, whose state cannot be "
                    "checked from here; left alone (delete it by hand if no run is active there)"
                )
            continue
        shutil.rmtree(path)
        removed.append(path.name)
    if removed:
        notes.insert(
            0,
            f"{name}: removed {len(removed)} temporary folder(s) left in {out_root} by an "
            f"interrupted run ({', '.join(removed)})",
        )
    return notes


def _owner(tmp: Path) -> Optional[tuple[int, Optional[str]]]:
    """Who may still be filling ``tmp``: ``(pid, None)`` for a running process on this
    machine, ``(pid, host)`` for a process on another host (whose state cannot be
    checked, so the folder must be kept), None when nobody is (no owner recorded,
    or the owner on this machine is gone)."""
    try:
        owner = json.loads((tmp / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return pid, host  # cannot tell: a run on another node of a shared output root
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, owned by another user
    return pid, None


def _check_not_empty(
    parser: RawDataset, records: Iterable[RawRecord], skipped: Sequence[Skip] = ()
) -> None:
    splits = {r.split for r in records}
    required = ("train",) if parser.public else ("train", "query", "gallery")
    empty = [s for s in required if s not in splits and not (s == "train" and "val" in splits)]
    if empty:
        raise PrepareError(
            f"{parser.name}: the {', '.join(empty)} split is empty after parsing {parser.root}"
            f"{skips_in_brief(skipped)} (check the layout described in datasets/README.md)"
        )


def _copy_images(
    parser: RawDataset,
    raw_records: Sequence[RawRecord],
    tmp: Path,
    resize: Optional[Sequence[int]],
    workers: int,
    progress: bool,
) -> tuple[list[Record], list[Skip]]:
    for split in SPLITS:
        (tmp / "images" / split).mkdir(parents=True, exist_ok=True)
    jobs = []
    for index, rec in enumerate(raw_records):
        ext = rec.path.suffix.lower()
        if resize is not None and ext not in (".jpg", ".jpeg", ".png"):
            ext = ".png"  # a resized BMP, TIFF...: written losslessly
        rel = Path("images") / rec.split / f"{index:06d}_{rec.pid}_c{rec.camid}{ext}"
        jobs.append((rec, rel))

    def copy_one(job: tuple[RawRecord, Path]) -> Optional[str]:
        rec, rel = job
        return _copy_checked(rec.path, tmp / rel, resize)

    records, bad = [], []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = pool.map(copy_one, jobs)
        bar = tqdm(results, total=len(jobs), desc=f"prepare {parser.name}", unit="img",
                   disable=not progress, leave=False)
        for (rec, rel), error in zip(jobs, bar):
            if error is None:
                records.append((Record(tmp / rel, rec.pid, rec.camid, rec.split), rel, rec))
            else:
                bad.append(Skip(rec.path, f"unreadable or truncated image ({error})"))
    _write_manifest(tmp, records, parser.raw_root)
    final = [Record(r.path, r.pid, r.camid, r.split) for r, _, _ in records]
    return final, bad


def _copy_checked(src: Path, dst: Path, resize: Optional[Sequence[int]]) -> Optional[str]:
    """Copy ``src`` to ``dst`` after decoding it fully.

    Returns None, or why ``src`` cannot be read or decoded, in words that are
    the same on every run (no object addresses). An error writing ``dst``
    (e.g. a full disk) is raised, not blamed on the image.
    """
    try:
        data = src.read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # a truncated file fails here, not at training time
    except UnidentifiedImageError:
        # PIL's own text names the in-memory buffer by its address.
        return "cannot identify image file"
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        return _OBJECT_REPR.sub("<object>", str(exc)) or type(exc).__name__
    if resize is None:
        dst.write_bytes(data)
        return None
    return _write_resized(data, dst, resize)


def _write_resized(data: bytes, dst: Path, resize: Sequence[int]) -> Optional[str]:
    """Write the image ``data`` resized as :data:`RESIZE_METHOD` says; None, or why it cannot be decoded.

    Decoded and resized as the loaders do (:func:`fedreid.data.images.decode_image`,
    OpenCV bicubic without antialiasing), so a copy resized to the model's input
    size is what the training and test transforms would have made of the
    original, less the JPEG re-encoding at quality 95 (4:4:4). PNG is lossless.
    """
    import cv2
    import numpy as np

    from fedreid.data.images import ImageReadError, decode_image

    height, width = (int(v) for v in resize)
    try:
        image = decode_image(np.frombuffer(data, np.uint8), "the image")
    except ImageReadError as exc:
        return str(exc)
    resized = cv2.cvtColor(cv2.resize(image, (width, height), interpolation=cv2.INTER_CUBIC), cv2.COLOR_RGB2BGR)
    if dst.suffix.lower() in (".jpg", ".jpeg"):
        params = [cv2.IMWRITE_JPEG_QUALITY, RESIZE_JPEG_QUALITY,
                  cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]
        ext = ".jpg"
    else:
        params, ext = [], ".png"
    ok, encoded = cv2.imencode(ext, resized, params)
    if not ok:
        raise OSError(f"OpenCV could not encode {dst}")
    dst.write_bytes(encoded.tobytes())
    return None


#: ``<_io.BytesIO object at 0x7f...>``: an address differs from run to run.
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def _write_manifest(tmp: Path, records: list, raw_root: Path) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(MANIFEST_FIELDS)
    for rec, rel, raw in records:
        source = os.path.relpath(raw.path, raw_root)
        writer.writerow([rel.as_posix(), rec.pid, rec.camid, rec.split, Path(source).as_posix()])
    (tmp / MANIFEST).write_text(buf.getvalue())


def _write_metadata(
    tmp: Path,
    parser: RawDataset,
    records: list[Record],
    skipped: list[Skip],
    card: dict,
    warnings: list[str],
    id_split: Optional[dict],
    resize: Optional[Sequence[int]],
    fingerprint: Optional[dict] = None,
) -> None:
    card = dict(card, warnings=warnings)
    write_json_atomic(tmp / "card.json", card)
    write_text_atomic(tmp / "card.md", format_card(parser.name, card))
    if id_split is not None:
        write_json_atomic(tmp / "split.json", id_split)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["file", "rule"])
    for skip in skipped:
        writer.writerow([str(skip.path), skip.rule])
    write_text_atomic(tmp / "skipped.csv", buf.getvalue())
    # Written last: it is the mark of a complete folder of ours (see PREPARE_RECORD).
    write_json_atomic(
        tmp / PREPARE_RECORD,
        {
            "dataset": parser.name,
            "layout": type(parser).__name__,
            "raw_root": str(parser.raw_root.resolve()),
            "source": str(parser.source_dir.resolve()),
            # What raw_fingerprint(source) gave before parsing; a re-run compares it.
            "raw_files": fingerprint,
            "split_seed": parser.seed,
            "split_file": str(parser.split_file) if parser.split_file else None,
            # The split file's contents: the same path may hold another split on a re-run.
            "split_file_sha256": _split_file_sha256(parser),
            # The parser's options (data.options.<name>), e.g. cuhk03np's boxes.
            "options": parser_options_record(parser),
            "resize": list(resize) if resize is not None else None,
            "resize_method": RESIZE_METHOD if resize is not None else None,
            "images": len(records),
            "skipped": len(skipped),
            "fedreid_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def _move_into_place(tmp: Path, target: Path) -> None:
    """Swap ``tmp`` in for ``target``; an old prepared copy is removed only after.

    The target is checked again right here, so that nothing but a folder this
    tool prepared (or an empty one) is ever moved aside and deleted; the swap
    and its crash guarantees are :func:`fedreid.utils.io.replace_dir_atomically`'s.
    """
    _check_replaceable(target, target.name)
    replace_dir_atomically(tmp, target)
