"""Shared vocabulary of the raw-layout parsers.

A parser turns one dataset's official release layout into a list of
:class:`RawRecord` (source image, person id, camera id, split). It never
touches the raw files beyond listing and reading them; copying, validation of
pixels and the prepared format live in :mod:`fedreid.data.prepared`.

Conventions every parser follows:

* ``pid`` is the dataset's own identity number, parsed as a whole integer.
  ``-1`` means junk (removed at evaluation), ``0`` is a real id or, for
  Market-1501, a distractor (kept as a negative). A release that numbers its
  test identities afresh (MSMT17: train and test both start at ``0000`` and
  are different people) sets :attr:`RawDataset.test_pid_offset`; the prepared
  manifest adds it to the query and gallery pids (:func:`offset_test_ids`), so
  that there one pid is one person and train and test identities are disjoint.
* ``camid`` is **0-based** and parsed as a whole integer (MSMT17's ``c15`` is
  camera 14, never camera 0 from a one-digit regex).
* ``split`` is one of :data:`SPLITS`. ``train_all`` is not stored: it is
  ``train`` + ``val``.

A parser's options (``data.options.<name>`` in the config, keyword arguments
of its constructor) are the fields of its :attr:`RawDataset.Options`
dataclass, built and checked by :func:`build_parser_options`. How each
release is converted, and why, is told in ``docs/datasets.md``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from fedreid.errors import FedReIDError
from fedreid.options import ConfigError, NoOptions, from_dict

SPLITS: tuple[str, ...] = ("train", "val", "query", "gallery")
#: Names a user may ask for; ``train_all`` is the union of ``train`` and ``val``.
SPLIT_NAMES: tuple[str, ...] = ("train_all",) + SPLITS

IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp")
#: Files that operating systems drop into image folders (the Market-1501
#: release ships ``Thumbs.db``); they are skipped and counted, never parsed.
SYSTEM_FILES: frozenset[str] = frozenset({"thumbs.db", ".ds_store", "desktop.ini"})


class RawLayoutError(FedReIDError, ValueError):
    """The raw folder does not look like the dataset's release.

    The message always names the path and what was expected there.
    """


@dataclass(frozen=True)
class RawRecord:
    path: Path  # absolute path of the source image under the raw root
    pid: int
    camid: int  # 0-based
    split: str


@dataclass(frozen=True)
class Skip:
    """A file that was not used, and the rule that excluded it."""

    path: Path
    rule: str


@dataclass(frozen=True)
class ExpectedCounts:
    """Counts of the FedReID benchmark's Table 1 (None where not fixed).

    ``train_*`` refer to ``train_all``; ``query_ids`` counts query identities.
    """

    train_ids: Optional[int] = None
    train_images: Optional[int] = None
    query_ids: Optional[int] = None
    query_images: Optional[int] = None
    gallery_images: Optional[int] = None


@dataclass
class ParseResult:
    records: list[RawRecord]
    skipped: list[Skip] = field(default_factory=list)
    #: The identity split that was used, written as ``split.json`` next to the
    #: prepared data so that it can be reused (``--split-file``). None when the
    #: release fixes the split.
    id_split: Optional[dict] = None


#: Constructor arguments that are not parser options, and the config key that
#: sets each (empty where no config key does).
NOT_OPTIONS: dict[str, str] = {
    "self": "",
    "raw_root": "data.raw_root",
    "dataset": "",
    "seed": "data.split_seed",
    "split_file": "data.split_files",
}
#: Parser attributes that an option field must not shadow (each option is
#: also an attribute of the parser, see :class:`RawDataset`).
_RESERVED = frozenset(NOT_OPTIONS) | {"root", "options"}


def build_parser_options(
    parser: type["RawDataset"], name: str, values: Mapping[str, Any], *, where: Optional[str] = None
) -> Any:
    """``parser.Options`` built from ``values``, every key and value checked.

    An unknown key is a :class:`ConfigError` naming the dataset, the key, the
    parser's layout and the allowed options (without it a misspelt ``box``
    for ``boxes`` would surface as ``__init__() got an unexpected keyword
    argument``); types and values are then checked by
    :func:`fedreid.options.from_dict`. ``where`` is the config key of
    ``values`` (e.g. ``data.options.cuhk03np``); without it errors name the
    dataset.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"{where or name}: expected a mapping of options, got {type(values).__name__} {values!r}"
        )
    allowed = [f.name for f in dataclasses.fields(parser.Options)]
    for key in values:
        if key in allowed:
            continue
        hint = f"; set it with {NOT_OPTIONS[key]}" if NOT_OPTIONS.get(key) else ""
        what = f"{where}.{key}: not an option" if where else f"{name}: {key!r} is not an option"
        raise ConfigError(
            f"{what} of the {name} parser (layout {parser.layout}); "
            f"allowed options: {', '.join(allowed) or 'none'}{hint}"
        )
    return from_dict(parser.Options, values, where or name)


class RawDataset:
    """Base class of a raw-layout parser.

    Subclasses set the class attributes and implement :meth:`parse`. They are
    registered by name with :func:`fedreid.data.raw.register`. Options are the
    fields of :attr:`Options`: the constructor takes them as keyword
    arguments, builds ``self.options`` and also sets each field as an
    attribute of the parser (``CUHK03NP(root, boxes="labeled").boxes``).
    """

    #: Registry key and prepared folder name, e.g. ``"market1501"``.
    name: ClassVar[str]
    #: Folder of the release under the raw root, e.g. ``"Market-1501-v15.09.15"``.
    dataset_dir: ClassVar[str]
    #: Counts of the FedReID benchmark's Table 1 for this dataset.
    expected: ClassVar[Optional[ExpectedCounts]] = None
    #: True for a set without identity labels used for knowledge distillation.
    public: ClassVar[bool] = False
    #: Added to every non-negative query and gallery pid in the prepared
    #: manifest; non-zero where the release numbers train and test identities
    #: independently (module docstring).
    test_pid_offset: ClassVar[int] = 0
    #: The dataclass of the parser's options (``data.options.<name>``), each
    #: field documented by a ``#:`` comment; :class:`NoOptions` for none.
    Options: ClassVar[type] = NoOptions
    #: The layout the parser reads (``raw`` or ``fedreid``), named in option errors.
    layout: ClassVar[str] = "raw"
    #: True where the benchmark's DGD converter numbered identities in sorted person
    #: order, as this parser does, so that a benchmark ``split.json``
    #: (``trainval``/``test_probe``/``test_gallery``) applies unchanged as a split file.
    dgd_split_ids: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        clash = sorted(
            f.name for f in dataclasses.fields(cls.Options)
            if f.name in _RESERVED or hasattr(RawDataset, f.name)
        )
        if clash:
            raise TypeError(f"{cls.__name__}.Options: option names {clash} shadow parser attributes")

    def __init__(
        self,
        raw_root: str | Path,
        *,
        seed: int = 0,
        split_file: str | Path | None = None,
        **options: Any,
    ) -> None:
        self.raw_root = Path(raw_root)
        self.root = self.raw_root / self.dataset_dir
        self.seed = seed
        self.split_file = Path(split_file) if split_file is not None else None
        self.options = build_parser_options(type(self), self.name, options)
        for f in dataclasses.fields(self.options):
            setattr(self, f.name, getattr(self.options, f.name))

    def parse(self) -> ParseResult:
        raise NotImplementedError

    @property
    def source_dir(self) -> Path:
        """The folder :meth:`parse` reads; the prepared copy records its file list."""
        return self.root

    # -- helpers shared by the parsers -------------------------------------
    def require_dir(self, *parts: str, release: Optional[Path] = None) -> Path:
        """``release`` (default :attr:`root`) joined with ``parts``; a missing folder raises, naming the release."""
        release = self.root if release is None else release
        path = release.joinpath(*parts)
        if not path.is_dir():
            raise RawLayoutError(
                f"{self.name}: expected the folder {path} "
                f"(the {release.name} release layout; see datasets/README.md)"
            )
        return path

    def rng(self) -> np.random.Generator:
        """The seeded generator for this dataset's random choices."""
        return np.random.default_rng(self.seed)

    def choose_id_split(
        self, ids: Iterable[int], paper_train: int, paper_total: int, skipped: Sequence[Skip] = ()
    ) -> tuple[list[int], list[int], dict]:
        """Train and test identities of ``ids``, and the ``id_split`` record.

        A user split file (``{"train": [...], "test": [...]}``, or the benchmark's
        DGD ``split.json`` where :attr:`dgd_split_ids`) wins; otherwise a
        seeded random split keeps the paper's proportion ``paper_train /
        paper_total``. The proportion (not a fixed count) lets a scaled-down copy
        of a layout split sensibly while the real data gives exactly the paper's
        numbers (``n * train / total`` is exact when ``n == total``).
        ``skipped``: the parse's skips so far, named in the error when too few
        identities were found to split (:func:`skips_in_brief`).
        """
        ids = sorted(set(ids))
        user = self.load_split_file()
        if user is not None:
            train, test = self._validate_split_file(user, ids)
            return train, test, {"train": train, "test": test, "split_file": str(self.split_file)}
        # Integer round-half-up, so the result never depends on float rounding.
        num_train = (2 * len(ids) * paper_train + paper_total) // (2 * paper_total)
        try:
            train, test = split_ids(ids, num_train, self.rng())
        except RawLayoutError as exc:
            # the usual cause: the images are not named as the release names them
            raise RawLayoutError(f"{self.name}: {exc} (under {self.root}){skips_in_brief(skipped)}") from exc
        return train, test, {"train": train, "test": test, "seed": self.seed}

    def _validate_split_file(
        self, user: object, ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Train and test ids of a split file, checked against ``ids``.

        Two formats: ours, ``{"train": [ids], "test": [ids]}``, and the FedReID
        benchmark's DGD ``split.json``, ``{"trainval", "test_probe",
        "test_gallery"}`` (train = ``trainval``, test = ``test_probe`` ∪
        ``test_gallery``), the latter only where :attr:`dgd_split_ids`.
        """
        where = f"{self.name}: split file {self.split_file}"
        dgd = isinstance(user, dict) and "train" not in user and "trainval" in user
        if dgd and not self.dgd_split_ids:
            raise RawLayoutError(
                f"{where} is in the benchmark's DGD format (trainval/test_probe/test_gallery), whose "
                f"identity numbers are not this parser's for {self.name} (the DGD converter ordered "
                "the persons its own way); prepare the benchmark's files with --layout fedreid, or "
                'give {"train": [ids], "test": [ids]} in this parser\'s ids'
            )
        expected = (
            '{"trainval": [ids], "test_probe": [ids], "test_gallery": [ids]}' if dgd
            else '{"train": [ids], "test": [ids]}'
        )

        def id_list(key: str) -> list[int]:
            value = user.get(key) if isinstance(user, dict) else None
            # bool is an int subclass; `true` in a split file is a mistake, not id 1.
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise RawLayoutError(
                    f"{where}: expected a JSON object {expected} "
                    f"with integer identity lists; {key!r} is missing or not a list of integers"
                )
            return sorted(set(value))

        if dgd:
            train = id_list("trainval")
            test = sorted(set(id_list("test_probe")) | set(id_list("test_gallery")))
        else:
            train, test = id_list("train"), id_list("test")
        known = set(ids)
        unknown = sorted((set(train) | set(test)) - known)
        if unknown:
            raise RawLayoutError(
                f"{where}: unknown identities {unknown[:10]} "
                f"(this dataset's ids are {ids[0]}..{ids[-1]})"
            )
        overlap = sorted(set(train) & set(test))
        if overlap:
            raise RawLayoutError(f"{where}: identities in both train and test: {overlap[:10]}")
        # A partial file would silently drop identities and change the counts.
        missing = sorted(known - set(train) - set(test))
        if missing:
            raise RawLayoutError(
                f"{where}: identities in neither train nor test: {missing[:10]} "
                f"({len(missing)} in all)"
            )
        return train, test

    def load_split_file(self) -> Optional[dict]:
        """The user-supplied identity split, or None."""
        if self.split_file is None:
            return None
        try:
            return json.loads(self.split_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RawLayoutError(
                f"{self.name}: cannot read the split file {self.split_file}: {exc}"
            ) from exc


def list_files(folder: Path, skipped: list[Skip], *, subfolders: bool = False) -> Iterator[Path]:
    """Image files of ``folder`` in sorted order (non-recursive).

    System files and non-image files are recorded in ``skipped``. Sorting makes
    every "i-th file" rule and every seeded choice independent of the file
    system's listing order. ``subfolders``: the caller reads ``folder``'s
    subfolders itself (identity or sequence folders); otherwise every file
    below a subfolder is a counted skip, so that a release extracted one
    level too deep says so instead of parsing as empty.
    """
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if not subfolders:
                for inner in sorted(p for p in path.rglob("*") if p.is_file()):
                    skipped.append(Skip(inner, f"in a subfolder of an image folder, not read (images belong "
                                               f"directly in {folder.name}/)"))
            continue
        lower = path.name.lower()
        if lower in SYSTEM_FILES:
            skipped.append(Skip(path, "system file"))
        elif not lower.endswith(IMAGE_EXTENSIONS):
            skipped.append(Skip(path, f"not an image ({', '.join(IMAGE_EXTENSIONS)})"))
        else:
            yield path


def summarize_skips(skipped: Sequence[Skip]) -> list[tuple[str, int, Path]]:
    """``(rule, count, example path)`` per skip rule, the most common first.

    The rule is the text before its first `` (`` (the detail, e.g. a decoder's
    message, differs from file to file); the example is the first file skipped
    by it.
    """
    counts: dict[str, int] = {}
    examples: dict[str, Path] = {}
    for skip in skipped:
        rule = skip.rule.split(" (")[0]
        counts[rule] = counts.get(rule, 0) + 1
        examples.setdefault(rule, skip.path)
    order = sorted(counts, key=lambda rule: -counts[rule])  # stable: first seen wins a tie
    return [(rule, counts[rule], examples[rule]) for rule in order]


def skips_in_brief(skipped: Sequence[Skip]) -> str:
    """``"; N file(s) skipped, most often C x RULE (e.g. PATH)"``, or ``""`` without skips: an error's reason."""
    if not skipped:
        return ""
    rule, count, example = summarize_skips(skipped)[0]
    return f"; {len(skipped):,} file(s) skipped, most often {count:,} x {rule} (e.g. {example})"


def id_problem(pid: int, camid: int) -> Optional[str]:
    """Why ``(pid, camid)`` (camid 0-based) cannot be a record, or ``None``.

    The prepared manifest allows pid -1 (junk) and up and camid 0 and up;
    a parser skips any other name with this rule instead of writing a
    manifest that its loader would refuse.
    """
    if pid < -1:
        return f"pid below -1 ({pid}; -1 marks junk, identities count from 0)"
    if camid < 0:
        return "camera number below the release's first camera"
    return None


def parse_named_images(
    folder: Path,
    pattern: re.Pattern[str],
    split: str,
    to_ids: Callable[[re.Match[str]], tuple[int, int]],
    skipped: list[Skip],
) -> list[RawRecord]:
    """Records for every image in ``folder`` whose name matches ``pattern``.

    ``to_ids`` maps the match to ``(pid, camid)`` (camid 0-based). A name that
    does not match is a counted skip naming the pattern; ids a manifest cannot
    hold (:func:`id_problem`) are a counted skip naming the rule.
    """
    records = []
    for path in list_files(folder, skipped):
        match = pattern.search(path.name)
        if match is None:
            skipped.append(Skip(path, f"name does not match {pattern.pattern!r}"))
            continue
        pid, camid = to_ids(match)
        problem = id_problem(pid, camid)
        if problem is not None:
            skipped.append(Skip(path, problem))
            continue
        records.append(RawRecord(path, pid, camid, split))
    return records


def carve_val(records: Sequence[RawRecord]) -> list[RawRecord]:
    """Move the first image (by sorted path) of each training id to ``val``.

    This is the rule of the FedReID/layumi ``prepare.py`` (the first image seen
    of each id is the validation image), made deterministic by sorting.
    ``train_all`` = ``train`` + ``val`` is unchanged by it. The result is
    sorted by (split, path).
    """
    seen: set[int] = set()
    out = []
    for rec in sorted(records, key=lambda r: (r.split, str(r.path))):
        if rec.split == "train" and rec.pid not in seen:
            seen.add(rec.pid)
            rec = RawRecord(rec.path, rec.pid, rec.camid, "val")
        out.append(rec)
    return sorted(out, key=lambda r: (r.split, str(r.path)))


def split_ids(
    ids: Iterable[int], num_train: int, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """A seeded random split of ``ids`` into ``num_train`` train and the rest test."""
    ids = sorted(ids)
    if not 0 < num_train < len(ids):
        raise RawLayoutError(
            f"cannot split {len(ids)} identities into {num_train} train ids"
        )
    order = rng.permutation(len(ids))
    train = sorted(ids[i] for i in order[:num_train])
    test = sorted(ids[i] for i in order[num_train:])
    return train, test


def offset_test_ids(records: Sequence[RawRecord], offset: int) -> list[RawRecord]:
    """``records`` with ``offset`` added to the non-negative pids of query and gallery.

    Junk (negative pids) keeps its pid; train and val records are unchanged.
    """
    if offset == 0:
        return list(records)
    return [
        RawRecord(r.path, r.pid + offset, r.camid, r.split)
        if r.split in ("query", "gallery") and r.pid >= 0
        else r
        for r in records
    ]
