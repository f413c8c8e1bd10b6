"""Metadata rows of gallery images for a gallery store: defaults from the files, overrides from a CSV.

A row (what :meth:`fedreid.retrieval.GalleryStore.create` and ``add`` take) is
``{"path", "camera", "site", "timestamp", "identity"}``:

* ``path``: the image's absolute path with symbolic links resolved;
* ``camera`` and ``identity``: from a Market-1501-style file name
  (:func:`fedreid.inference.images.parse_market_name`):
  ``0002_c3s1_000451_01.jpg`` is identity 2, camera 3 (the number as written in
  the name; the 0-based ``camid`` of evaluation is ``camera - 1``); both None
  when the name does not parse;
* ``site``: the caller's (``index --site NAME``), default None;
* ``timestamp``: the file's modification time, in seconds since the epoch.

A metadata CSV (``index --metadata FILE.csv``) overrides these per image. Its
first row names the columns: ``path`` and any of ``camera``, ``site``,
``timestamp``, ``identity`` (no others, none twice). Each further row names
one image of the folder being indexed (a relative ``path`` is relative to that
folder; at most one row per image) and sets the values of its non-empty cells;
an empty cell keeps the default above, and images without a row keep all
their defaults. Every value, from a cell, a file name, a modification time or
``--site``, must pass the rules of :mod:`fedreid.retrieval.fields` (``camera``
and ``identity`` 32-bit integers; ``timestamp`` seconds since the epoch or an
ISO 8601 date/time within years 1 to 9999; ``site`` a name of at most 200
characters), checked before any image is read. Every error names the file
(and the row).

Gallery roots: a store's header records in ``meta.gallery_roots``
(:data:`GALLERY_ROOTS_KEY`) the folders its image files lie in, links
resolved (:func:`gallery_roots`); the search service serves an item's image
only from inside them (or its own uploads folder), so a file later replaced by
a link to anything else is not served (:func:`recorded_gallery_roots`).
"""

from __future__ import annotations

import csv
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Optional, Sequence

from fedreid.retrieval import fields
from fedreid.retrieval.fields import GalleryMetadataError

__all__ = [
    "GALLERY_ROOTS_KEY",
    "METADATA_COLUMNS",
    "GalleryMetadataError",
    "apply_metadata",
    "format_time",
    "gallery_roots",
    "image_rows",
    "parse_time",
    "read_metadata_csv",
    "recorded_gallery_roots",
    "roots_after_removal",
]

#: The columns a metadata CSV may have (``path`` required).
METADATA_COLUMNS = ("path", "camera", "site", "timestamp", "identity")
#: The store header's ``meta`` key listing the folders its items' files lie in (:func:`gallery_roots`).
GALLERY_ROOTS_KEY = "gallery_roots"


def gallery_roots(paths: Iterable[str], also: Iterable[str | Path] = ()) -> list[str]:
    """The fewest folders holding every file of ``paths`` and every folder of ``also``, sorted.

    ``paths``: stored item paths (absolute, links resolved, as :func:`image_rows`
    writes them); ``also``: folders to keep listed (the resolved gallery
    folder, the roots recorded before an addition). A folder inside another
    listed one is left out, so a gallery indexed from one folder is one root,
    and a folder of links to files elsewhere lists the folders they point into.
    """
    found = {os.path.dirname(str(p)) for p in paths} | {os.path.normpath(str(a)) for a in also}
    kept: set[str] = set()
    for folder in sorted(found, key=lambda f: (len(Path(f).parts), f)):  # ancestors before their descendants
        if not any(str(parent) in kept for parent in Path(folder).parents):
            kept.add(folder)
    return sorted(kept)


def recorded_gallery_roots(header: Mapping[str, Any]) -> list[Path]:
    """The folders a store header records its files in: ``meta.gallery_roots``, else ``meta.gallery`` (an earlier
    build's single folder), else none. Absolute paths as recorded (links were resolved when they were written)."""
    meta = header.get("meta") if isinstance(header.get("meta"), dict) else {}
    roots = meta.get(GALLERY_ROOTS_KEY)
    if not isinstance(roots, list):
        roots = [meta["gallery"]] if isinstance(meta.get("gallery"), str) else []
    return [Path(r) for r in roots if isinstance(r, str) and os.path.isabs(r)]


def roots_after_removal(store: Any, ids: Iterable[int]) -> Optional[dict[str, list[str]]]:
    """The header ``meta`` update for removing ``ids`` from ``store`` (a GalleryStore), or None when nothing changes.

    A recorded gallery root (:func:`recorded_gallery_roots`) that no other
    item lies under is dropped, so that the service serves nothing from it
    and the header names no folder where only erased items lay; so is
    ``meta.gallery`` (what ``index --gallery`` was given: a folder, or one
    image) when no other item lies under it or is it.
    """
    ids = [int(i) for i in ids]
    roots = recorded_gallery_roots(store.header)
    kept = [str(r) for r in roots if store.holds_under(str(r), excluding=ids)]
    update: dict[str, Any] = {GALLERY_ROOTS_KEY: kept} if len(kept) != len(roots) else {}
    gallery = (store.header.get("meta") or {}).get("gallery")
    if isinstance(gallery, str) and not store.holds_under(gallery, excluding=ids):
        update["gallery"] = None
    return update or None


def parse_time(text: str, what: str = "time") -> float:
    """Seconds since the epoch of ``text``: :func:`fedreid.retrieval.fields.timestamp` (a number or ISO 8601).

    Raises :class:`GalleryMetadataError` naming ``what``.
    """
    return fields.timestamp(text, what)


def format_time(seconds: Optional[float]) -> Optional[str]:
    """``seconds`` since the epoch as ISO 8601 UTC to the second (``2024-05-01T06:00:00Z``); None stays None."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(float(seconds), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def image_rows(paths: Sequence[str | Path], *, site: Optional[str] = None) -> list[dict[str, Any]]:
    """The default rows of image files (see the module docstring), in ``paths`` order.

    Two paths naming one file (through a symbolic link) raise
    :class:`GalleryMetadataError` naming both: a store keeps one item per file.
    """
    from fedreid.inference.images import parse_market_name

    if site is not None:
        site = fields.site(site, "--site")
    rows, seen = [], {}
    for p in paths:
        resolved = Path(p).resolve()
        key = str(resolved)
        if key in seen:
            raise GalleryMetadataError(
                f"images {seen[key]} and {p} are the same file ({key}): a gallery store keeps one item per file; "
                "remove the link or index the folders separately"
            )
        seen[key] = p
        pid, camid = parse_market_name(p)  # the name as listed (a link's own name)
        parsed = camid >= 0
        rows.append(fields.item_values({
            "path": key,
            "camera": camid + 1 if parsed else None,
            "site": site,
            "timestamp": float(os.stat(resolved).st_mtime),
            "identity": pid if parsed else None,
        }, f"image {p} (from its file name and modification time)"))
    return rows


def read_metadata_csv(file: str | Path, *, base: str | Path, images: Collection[str]) -> dict[str, dict[str, Any]]:
    """{resolved image path: {column: value}} of the non-empty cells of a metadata CSV.

    ``base``: the folder relative paths are resolved against (the folder being
    indexed); ``images``: the resolved paths of its images, the only paths a
    row may name. Raises :class:`GalleryMetadataError` (naming the file and
    row) for unknown or repeated columns, no ``path`` column, a path that is
    not one of ``images``, two rows for one image, or a value of the wrong kind;
    FileNotFoundError when the file does not exist.
    """
    file, base = Path(file), Path(base)
    if not file.is_file():
        raise FileNotFoundError(f"metadata file {file} does not exist")
    known = set(images)
    try:
        with open(file, newline="", encoding="utf-8-sig") as f:
            lines = list(csv.reader(f))
    except UnicodeDecodeError:
        raise GalleryMetadataError(f"metadata file {file} is not a UTF-8 text (CSV) file") from None
    except csv.Error as exc:
        raise GalleryMetadataError(f"metadata file {file} is not a readable CSV file: {exc}") from None
    if not lines or not any(cell.strip() for cell in lines[0]):
        raise GalleryMetadataError(
            f"metadata file {file} has no header row: expected the columns path and any of "
            f"{', '.join(METADATA_COLUMNS[1:])}"
        )
    columns = [c.strip() for c in lines[0]]
    unknown = [c for c in columns if c not in METADATA_COLUMNS]
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if unknown or twice or "path" not in columns:
        problem = (
            f"unknown columns {unknown}" if unknown else f"columns named twice {twice}" if twice else "no path column"
        )
        raise GalleryMetadataError(
            f"metadata file {file}: {problem}; expected path and any of {', '.join(METADATA_COLUMNS[1:])}"
        )
    out: dict[str, dict[str, Any]] = {}
    first_row: dict[str, int] = {}
    for number, cells in enumerate(lines[1:], start=2):
        where = f"metadata file {file} row {number}"
        if not any(cell.strip() for cell in cells):
            continue  # a blank line
        if len(cells) != len(columns):
            raise GalleryMetadataError(f"{where}: {len(cells)} cells for {len(columns)} columns ({','.join(columns)})")
        record = dict(zip(columns, cells))
        name = record.pop("path").strip()
        if not name:
            raise GalleryMetadataError(f"{where}: the path is empty")
        given = Path(name).expanduser()
        resolved = str((given if given.is_absolute() else base / given).resolve())
        if resolved not in known:
            raise GalleryMetadataError(f"{where}: {name} is not an image of {base} (resolved: {resolved})")
        if resolved in first_row:
            raise GalleryMetadataError(f"{where}: {name} is the image of row {first_row[resolved]} again")
        first_row[resolved] = number
        cells = {column: cell for column, cell in record.items() if cell.strip()}  # empty: keep the default
        out[resolved] = fields.item_values(cells, where)
    return out


def apply_metadata(
    rows: Sequence[dict[str, Any]], overrides: Optional[dict[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """``rows`` with each row's values replaced by its ``overrides[path]`` (new dicts; ``rows`` unchanged)."""
    overrides = overrides or {}
    return [dict(row, **overrides.get(row["path"], {})) for row in rows]
