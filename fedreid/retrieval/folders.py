"""A gallery store of an image folder (build, add, remove), and searching it with query images.

The index folder is a :class:`fedreid.retrieval.GalleryStore` (files and
guarantees: :mod:`fedreid.retrieval.store`): a FAISS index chosen by factory
string (default ``Flat``: exact, ranking as an ``IndexFlatIP`` does), stable
item ids, and an SQLite table of each item's path, camera, site, timestamp and
identity (:mod:`fedreid.retrieval.gallery_rows`). The header's
``meta.model_fingerprint`` is the model the features came from
(:func:`~fedreid.inference.model_io.check_index_model` reads it there).

Index folders (:func:`build_gallery_store`): written only into a new, empty
or fedreid-marked folder (:func:`fedreid.utils.io.claim_output_dir`, kind
``index``; an unmarked index folder of an earlier version is adopted and
replaced), never into or under the gallery folder, and replaced as a whole
(:func:`fedreid.utils.io.replace_dir_atomically`); :func:`add_to_gallery_store`
and :func:`remove_from_gallery_store` update a store the same way. Unreadable
images abort with an error naming the image unless the caller collects them
(``skipped``), in which case they are left out and listed in ``skipped.csv``.
Queries (:func:`query_index`) check the store's recorded model fingerprint
first. An index folder of the earlier format (``fedreid-faiss-index``, see
:mod:`fedreid.retrieval.exact`) is not read: the error asks to rebuild it.
This module does not import torch: with an exported ONNX model
(:func:`fedreid.inference.export.load_exported_model`) stores are built, updated
and searched without PyTorch.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np

from fedreid.inference.errors import EvalInputError
from fedreid.inference.images import SKIPPED_FILE, SkippedImage, image_features, list_images, write_skipped_csv
from fedreid.inference.model_io import LoadedModel, check_index_model
from fedreid.retrieval import exact, fields
from fedreid.retrieval.faiss_gpu import _faiss_gpu_id
from fedreid.retrieval.gallery_rows import (
    GALLERY_ROOTS_KEY,
    apply_metadata,
    gallery_roots,
    image_rows,
    read_metadata_csv,
    recorded_gallery_roots,
    roots_after_removal,
)
from fedreid.retrieval.store import GalleryStore, check_factory_string, factory_kind
from fedreid.retrieval.store_files import clean_swap_leftovers, is_own_name, own_names

if TYPE_CHECKING:
    import torch

__all__ = [
    "index_action",
    "query_filters",
    "add_to_gallery_store",
    "build_gallery_index",
    "build_gallery_store",
    "open_gallery_store",
    "remove_from_gallery_store",
    "resolve_store_items",
    "QueryResult",
    "query_index",
    "draw_query_picture",
    "draw_query_pictures",
]

_TOOL_INDEX = "tools/eval_reid.py index"
#: The header ``meta`` key of the features' arithmetic (:func:`extraction_precision`).
PRECISION_KEY = "precision"
_EARLIER_TEMP = re.compile(r"^\.(index\.faiss|meta\.npz|header\.json)\..+\.tmp$")  # the earlier format's temporaries


def _check_index_location(gallery: Path, index_dir: Path, flag: str = "--gallery") -> None:
    """Refuse an index folder that is the image folder or lies inside it (symlinks resolved)."""
    if not gallery.is_dir():
        return
    g, i = gallery.resolve(), index_dir.resolve()
    if i == g or g in i.parents:
        where = "is the gallery folder" if i == g else f"is inside the gallery folder {gallery}"
        if flag != "--gallery":
            where = f"is the {flag} folder" if i == g else f"is inside the {flag} folder {gallery}"
        raise EvalInputError(
            f"--index {index_dir} {where}: the index files would be written among the images; "
            "choose a folder outside the gallery (nothing was changed)"
        )


def _rows_for(paths: Sequence[Path], folder: Path, site: Optional[str], metadata: Optional[str | Path]) -> dict:
    """{listed path as str: its row}, with the metadata CSV applied (read before any extraction)."""
    defaults = image_rows(paths, site=site)
    overrides = read_metadata_csv(metadata, base=folder, images=[r["path"] for r in defaults]) if metadata else None
    return dict(zip((str(p) for p in paths), apply_metadata(defaults, overrides)))


def _skipped_writer(entries: Sequence[SkippedImage]) -> Optional[Callable[[Path], Any]]:
    return (lambda path: write_skipped_csv(path, entries)) if entries else None


def _clustering_index(factory: str, dim: int, faiss_gpu: bool, device: str | torch.device) -> Any:
    """A GPU ``IndexFlatIP`` for the k-means of an IVF factory's training when ``faiss_gpu``; else None."""
    if not faiss_gpu:
        return None
    import faiss

    if factory_kind(factory, dim) != "ivf":
        return None
    return exact._maybe_to_gpu(faiss.IndexFlatIP(dim), True, _faiss_gpu_id(device))


def build_gallery_store(
    loaded: LoadedModel,
    gallery: str | Path,
    index_dir: str | Path,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    faiss_gpu: bool = False,
    skipped: Optional[list[SkippedImage]] = None,
    factory: str = "Flat",
    seed: int = 0,
    site: Optional[str] = None,
    metadata: Optional[str | Path] = None,
    refine: int = 1,
    progress: bool = False,
) -> tuple[GalleryStore, int]:
    """Build a gallery store of every image under ``gallery`` in ``index_dir``; returns ``(store, images indexed)``.

    ``index_dir`` must be new, empty, marked as a fedreid index folder holding
    nothing but the index's files, or an index folder of an earlier version
    (then adopted); anything else, and a folder that is or lies inside the
    gallery folder, raises before any work
    (:class:`~fedreid.utils.io.OutputDirError` / :class:`EvalInputError`) and
    changes nothing. The folder is replaced as a whole, so an interrupted
    build leaves the previous index or the new one, never a mix (a hidden
    sibling ``.<name>.tmp-*`` / ``.<name>.old-*`` it leaves is removed by the
    next build). Rows: :func:`~fedreid.retrieval.gallery_rows.image_rows`
    with ``site``, overridden by the CSV ``metadata`` (read, and its errors
    raised, before any image is). ``factory``/``seed``: the FAISS index and
    its training (:meth:`GalleryStore.create`; a string FAISS cannot parse,
    or one needing more training vectors than the gallery has images, is
    refused before any image is read); ``refine``: as there. The header's
    ``meta`` records the model (``model``, ``round``, ``model_fingerprint``), the ``gallery``,
    the number ``skipped`` and ``gallery_roots``, the folders the indexed
    files lie in (:func:`~fedreid.retrieval.gallery_rows.gallery_roots`). ``skipped``: as in :func:`image_features`;
    when given, the images left out are listed in ``index_dir/skipped.csv``.
    ``faiss_gpu`` runs the k-means of an IVF factory's training on the GPU
    (the stored index is a CPU index either way; other factories need no GPU).
    ``progress``: a bar of the images read, on stderr.
    """
    from fedreid.utils.io import claim_output_dir

    gallery, index_dir = Path(gallery), Path(index_dir)
    paths = list_images(gallery, "gallery")
    check_factory_string(factory, images=len(paths))  # before any image is read
    _check_index_location(gallery, index_dir)
    rows = _rows_for(paths, gallery, site, metadata)
    earlier = (
        index_dir.is_dir() and not index_dir.is_symlink() and exact.is_index_folder(index_dir, extra_files=(SKIPPED_FILE,))
    )
    claim_output_dir(index_dir, "index", tool=_TOOL_INDEX, adopt=earlier)
    _refuse_foreign_files(index_dir)
    _remove_index_temporaries(index_dir)
    first_skip = len(skipped) if skipped is not None else 0
    fs = image_features(
        loaded, paths, batch_size=batch_size, device=device, amp=amp, channels_last=channels_last,
        skipped=skipped, where=f"gallery {gallery}", progress=progress,
    )
    left_out = list(skipped[first_skip:]) if skipped is not None else []
    stored = [rows[str(p)]["path"] for p in fs.paths]
    meta = {"model": str(loaded.source), "round": loaded.round, "gallery": str(gallery.resolve()),
            "skipped": len(left_out), PRECISION_KEY: extraction_precision(loaded, amp),
            GALLERY_ROOTS_KEY: gallery_roots(stored, [gallery.resolve()] if gallery.is_dir() else [])}
    clustering = _clustering_index(factory, fs.features.shape[1], faiss_gpu, device)
    _refuse_foreign_files(index_dir)  # checked again right before anything is replaced
    for p in index_dir.iterdir():
        if _EARLIER_TEMP.match(p.name) and p.is_file():
            p.unlink()  # an interrupted save of the earlier format left it
    store = GalleryStore.create(
        index_dir, fs.features, [rows[str(p)] for p in fs.paths], factory=factory, seed=seed,
        model_fingerprint=loaded.fingerprint, meta=meta, side_files={SKIPPED_FILE: _skipped_writer(left_out)},
        replaces=("meta.npz",), clustering_index=clustering, refine=refine,
    )
    return store, len(fs.paths)


def extraction_precision(loaded: LoadedModel, amp: bool) -> str:
    """The arithmetic of a store's features, as its header's ``meta.precision`` records it.

    ``fp16`` (``--amp`` autocast, CUDA only), else ``fp32``; an exported file
    computes in its own float32. The features of one image differ slightly
    between the two, so a store extended in the other records both (``fp16, fp32``).
    """
    return "fp16" if amp and loaded.extractor is None else "fp32"


def build_gallery_index(
    loaded: LoadedModel,
    gallery: str | Path,
    index_dir: str | Path,
    **kwargs: Any,
) -> tuple[Path, int]:
    """:func:`build_gallery_store` (same arguments); returns ``(index_dir, number of images indexed)``."""
    _, n = build_gallery_store(loaded, gallery, index_dir, **kwargs)
    return Path(index_dir), n


def open_gallery_store(index_dir: str | Path) -> GalleryStore:
    """The gallery store in ``index_dir`` (checked as :meth:`GalleryStore.open` does).

    A missing folder raises FileNotFoundError; an index folder of the earlier
    format raises :class:`~fedreid.retrieval.exact.IndexFileError` (an :class:`EvalInputError`)
    asking to rebuild it with ``index``.
    """
    folder = Path(index_dir)
    if not folder.is_dir():
        # An update killed between the two renames of its swap leaves the store set aside beside the
        # folder: put it back (the store's own repair) before calling the folder missing.
        clean_swap_leftovers(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"index folder {folder} does not exist: build it with {_TOOL_INDEX}")
    meta = (exact.old_index_header(folder) or {}).get("meta")
    gallery = meta.get("gallery") if isinstance(meta, dict) else None
    exact.refuse_old_index_folder(
        folder, f"rebuild with index, i.e. build the index again with {_TOOL_INDEX} --model MODEL "
        f"--gallery {gallery or 'GALLERY'} --index {folder}",
    )
    return GalleryStore.open(folder)


def _read_skipped(folder: Path) -> list[SkippedImage]:
    path = folder / SKIPPED_FILE
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return [SkippedImage(r[0], r[1]) for r in rows[1:] if len(r) == 2]


def added_precision_meta(header: Mapping[str, Any], used: str) -> dict[str, Any]:
    """The header ``meta`` update recording that features computed in ``used`` were added to ``header``'s store.

    ``meta.precision`` becomes the sorted set of what it held and ``used``
    (``fp16, fp32`` for a mix); a header recording none (an index of an
    earlier version) is left without one, nothing being known of its features.
    """
    built_with = (header.get("meta") or {}).get(PRECISION_KEY)
    if built_with is None:
        return {}
    return {PRECISION_KEY: ", ".join(sorted({*built_with.split(", "), used}))}


def add_to_gallery_store(
    loaded: LoadedModel,
    index_dir: str | Path,
    images: str | Path,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    skipped: Optional[list[SkippedImage]] = None,
    site: Optional[str] = None,
    metadata: Optional[str | Path] = None,
    progress: bool = False,
) -> tuple[GalleryStore, np.ndarray]:
    """Add every image under ``images`` to the store in ``index_dir``; returns ``(store, their new ids)``.

    Checked before any image is read, each raising and changing nothing: the
    store's model is ``loaded``'s (:func:`check_index_model`:
    :class:`~fedreid.inference.model_io.ModelMismatchError`), the index folder does
    not lie inside ``images``, the metadata CSV (relative paths relative to
    ``images``) is valid, and no image is in the store already (an
    :class:`EvalInputError` naming them). The index is not retrained
    (:meth:`GalleryStore.add`). ``skipped``: as in :func:`image_features`;
    ``skipped.csv`` then lists the images this and earlier builds/adds left
    out that are not in the store. The folders of the added files join the
    header's ``meta.gallery_roots``. ``progress``: a bar of the images read, on stderr.
    """
    folder, images = Path(index_dir), Path(images)
    store = open_gallery_store(folder)
    check_index_model(store.header, loaded, folder)
    paths = list_images(images, "images to add")
    _check_index_location(images, folder, "--add")
    rows = _rows_for(paths, images if images.is_dir() else images.parent, site, metadata)
    held = store.find_paths([r["path"] for r in rows.values()])
    if held:
        shown = ", ".join(sorted(held)[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise EvalInputError(
            f"store {folder} already holds {len(held)} of the images of {images} ({shown}): add only new images, "
            "or remove those first with index --remove (nothing was changed)"
        )
    _refuse_foreign_files(folder)
    first_skip = len(skipped) if skipped is not None else 0
    fs = image_features(
        loaded, paths, batch_size=batch_size, device=device, amp=amp, channels_last=channels_last,
        skipped=skipped, where=f"images to add {images}", identical_ok=True, progress=progress,
    )
    if fs.features.shape[1] != store.dim:
        raise EvalInputError(
            f"store {folder} holds {store.dim}-d features but the model gives {fs.features.shape[1]}-d"
        )
    left_out = list(skipped[first_skip:]) if skipped is not None else []
    added = {rows[str(p)]["path"] for p in fs.paths}
    again = {str(Path(s.path).resolve()) for s in left_out}
    listed = [
        s for s in _read_skipped(folder) if str(Path(s.path).resolve()) not in added | again
    ] + left_out
    roots = gallery_roots(
        [rows[str(p)]["path"] for p in fs.paths],
        [*recorded_gallery_roots(store.header), *([images.resolve()] if images.is_dir() else [])],
    )
    meta: dict[str, Any] = {"skipped": len(listed), GALLERY_ROOTS_KEY: roots,
                            **added_precision_meta(store.header, extraction_precision(loaded, amp))}
    ids = store.add(
        fs.features, [rows[str(p)] for p in fs.paths], meta=meta, side_files={SKIPPED_FILE: _skipped_writer(listed)},
    )
    return store, ids


def resolve_store_items(store: GalleryStore, items: Sequence[str]) -> list[int]:
    """The ids of ``items``: ids (all digits), paths as stored, other paths, or bare file names.

    A token of digits only is an item id. Any other token is a path: as stored
    (absolute), else resolved from the working folder; a token without a
    folder separator that matches no path is a file name, naming the one item
    whose path ends with it. Unknown ids or paths and file names that several
    items share raise :class:`EvalInputError` naming every such token.
    """
    ids: list[int] = []
    unknown: list[str] = []
    ambiguous: list[str] = []
    held = set(store.ids.tolist())
    for token in items:
        token = str(token).strip()
        if token.isascii() and token.isdigit():
            (ids.append(int(token)) if int(token) in held else unknown.append(token))
            continue
        found = store.find_paths([token]) or store.find_paths([str(Path(token).expanduser().resolve())])
        if found:
            ids.extend(found.values())
            continue
        matches = store.find_file_name(token) if token and "/" not in token and os.sep not in token else []
        if len(matches) == 1:
            ids.append(matches[0][0])
        elif matches:
            shown = ", ".join(f"{i} ({p})" for i, p in matches[:3]) + (" ..." if len(matches) > 3 else "")
            ambiguous.append(f"{token} names {len(matches)} items: {shown}")
        else:
            unknown.append(token)
    problems = ([f"holds no item {', '.join(unknown)}"] if unknown else []) + ambiguous
    if problems:
        raise EvalInputError(
            f"store {store.folder} {'; '.join(problems)}: give item ids (query prints them), paths as stored, "
            "or file names that one item has (nothing was removed)"
        )
    return sorted(set(ids))


def remove_from_gallery_store(index_dir: str | Path, items: Sequence[str]) -> tuple[GalleryStore, np.ndarray]:
    """Erase ``items`` (:func:`resolve_store_items`) from the store; returns ``(store, removed ids)``.

    No model is needed. The removed items leave no trace in the store's files
    (:meth:`GalleryStore.remove`); nothing changes when any item is unknown.
    A folder of the header's ``meta.gallery_roots`` that no longer holds an
    item leaves it in the same save: the service serves no file from there,
    and the header names no folder only erased items lay in.
    """
    folder = Path(index_dir)
    store = open_gallery_store(folder)
    _refuse_foreign_files(folder)
    with store.update_lock():
        ids = resolve_store_items(store, items)
        return store, store.remove(ids, meta=roots_after_removal(store, ids))


# An index folder is replaced as a whole: staged in a hidden sibling ``.<name>.tmp-<hex>`` and
# swapped in by fedreid.utils.io.replace_dir_atomically (the old one moved aside to
# ``.<name>.old-<hex>``, then deleted; its docstring states the crash guarantees). A kill leaves
# the old index, the new one, or (between the two renames) none, the old one then moved back by
# the next open or update of the store; never a mix. The next open or update removes the hidden
# siblings a kill left: marked ones, and unmarked ones holding only the store's file names (a
# partly deleted set-aside copy may have lost its marker first, and may hold erased vectors).


def _index_own_names() -> set[str]:
    return own_names() | {exact.META_FILE, SKIPPED_FILE}


def _refuse_foreign_files(index_dir: Path) -> None:
    """An index folder is replaced as a whole: refuse (changing nothing) when it holds anyone else's files."""
    own = _index_own_names()
    foreign = sorted(
        p.name for p in index_dir.iterdir()
        if p.name not in own and not is_own_name(p.name) and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise EvalInputError(
            f"index folder {index_dir} also holds files that are not the index's ({shown}); the index replaces "
            "the whole folder: move them elsewhere or choose another folder (nothing was changed)"
        )


def _remove_index_temporaries(index_dir: Path) -> None:
    """Clean up the hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings an interrupted build left.

    The store's own rule (:func:`fedreid.retrieval.store_files.clean_swap_leftovers`):
    a whole set-aside copy is moved back when no index folder is in place, the
    rest deleted, marked or not (a partly deleted one may have lost its marker).
    """
    clean_swap_leftovers(index_dir)


@dataclass
class QueryResult:
    """One query image's top-k, best first.

    Each match: ``rank``, ``score``, ``path``, ``pid`` (identity, -1 when
    unknown), ``camid`` (0-based camera, -1 when unknown), ``correct`` (None
    unless both identities are known), and the store's ``id``, ``camera``
    (the number as in the file name or metadata), ``site`` and ``timestamp``
    (seconds since the epoch), each None when unknown.
    """

    path: str
    pid: int
    matches: list[dict[str, Any]]


def query_index(
    loaded: LoadedModel,
    index_dir: str | Path,
    images: str | Path,
    *,
    top_k: int = 10,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    faiss_gpu: bool = False,
    allow_model_mismatch: bool = False,
    warn: Optional[Callable[[str], None]] = None,
    skipped: Optional[list[SkippedImage]] = None,
    cameras: Optional[Sequence[int]] = None,
    sites: Optional[Sequence[str]] = None,
    time_window: Optional[tuple[Optional[float], Optional[float]]] = None,
    progress: bool = False,
) -> list[QueryResult]:
    """Search the store in ``index_dir`` with every image of ``images`` (a file or a folder).

    The store must have been built with ``loaded``'s model (equal
    fingerprints, :func:`check_index_model`), checked before any image is
    read: otherwise :class:`~fedreid.inference.model_io.ModelMismatchError`, or, with
    ``allow_model_mismatch``, ``warn`` (default :func:`warnings.warn`) gets
    the differences and the search goes on. ``cameras``/``sites``/``time_window``
    (``(since, until)`` in seconds since the epoch, inclusive, either end None)
    restrict the results to the items passing all of them
    (:meth:`GalleryStore.search`); a query may then get fewer than ``top_k``.
    ``skipped``: as in :func:`image_features`. ``faiss_gpu`` searches a bare Flat
    store on a GPU copy of its index (unfiltered searches; same results);
    other stores are searched on the CPU. ``progress``: a bar of the images read, on stderr.
    """
    import warnings

    store = open_gallery_store(index_dir)
    mismatch = check_index_model(store.header, loaded, index_dir, allow_mismatch=allow_model_mismatch)
    if mismatch is not None:
        (warn or (lambda m: warnings.warn(m, UserWarning, stacklevel=3)))(mismatch)
    flat_index = None
    if store.exact:
        flat_index = exact._maybe_to_gpu(store.flat_faiss_index(), bool(faiss_gpu), _faiss_gpu_id(device))
    paths = list_images(images, "query")
    fs = image_features(
        loaded, paths, batch_size=batch_size, device=device, amp=amp, channels_last=channels_last,
        skipped=skipped, where=f"query images {images}", identical_ok=True, progress=progress,
    )
    if fs.features.shape[1] != store.dim:
        raise EvalInputError(
            f"index {index_dir} holds {store.dim}-d features but the model gives {fs.features.shape[1]}-d: "
            "build the index with the same model"
        )
    found = store.search(
        fs.features, top_k, cameras=cameras, sites=sites, time_window=time_window, flat_index=flat_index
    )
    rows = store.rows(found.ids.ravel())
    width = found.ids.shape[1]  # top_k cut to the store's item count
    out = []
    for qi, path in enumerate(fs.paths):
        q_pid = int(fs.pids[qi])
        matches = []
        for rank, (score, row) in enumerate(zip(found.scores[qi], rows[qi * width : (qi + 1) * width]), start=1):
            if row is None:  # -1: fewer items than top_k pass the filters
                break
            identity, camera = row["identity"], row["camera"]
            g_pid = int(identity) if identity is not None else -1
            known = q_pid >= 0 and g_pid >= 0
            matches.append({
                "rank": rank, "score": float(score), "path": str(row["path"]), "pid": g_pid,
                "camid": int(camera) - 1 if camera is not None else -1, "correct": (g_pid == q_pid) if known else None,
                "id": int(row["id"]), "camera": camera, "site": row["site"], "timestamp": row["timestamp"],
            })
        out.append(QueryResult(path=path, pid=q_pid, matches=matches))
    return out


def draw_query_picture(result: QueryResult, out_path: str | Path, size: tuple[int, int] = (128, 64)) -> Path:
    """The query and its matches: green/red frames where both ids are known, grey otherwise."""
    from fedreid.eval.visualize import draw_ranked_list

    m = result.matches
    return draw_ranked_list(
        result.path, [x["path"] for x in m], [x["correct"] for x in m], [x["score"] for x in m],
        out_path, size=size, top_k=max(len(m), 1),
    )


def draw_query_pictures(results: Sequence[QueryResult], out_dir: str | Path) -> list[Path]:
    """One PNG per query in ``out_dir``, named ``<number>_<image stem>.png``."""
    return [
        draw_query_picture(r, Path(out_dir) / f"{i:04d}_{Path(r.path).stem}.png") for i, r in enumerate(results)
    ]


def index_action(*, gallery: Optional[str], add: Optional[str], remove: Optional[Sequence[str]], model: Optional[str],
                 factory: Optional[str], refine: Optional[int], site: Optional[str], metadata: Optional[str],
                 verify: bool, check: bool, target_recall: Optional[float], verify_sample: int,
                 verify_k: int) -> str:
    """What the ``index`` command is asked to do (``build``, ``add``, ``remove``, ``check``); its options checked.

    The arguments are the command's options; an inconsistent combination is
    an :class:`~fedreid.inference.errors.EvalInputError` naming the flags.
    """
    action = "build" if gallery else "add" if add else "remove" if remove else "check"
    if action == "check" and not (verify or check or target_recall is not None):
        raise EvalInputError(
            "index: give --gallery DIR (a new store), --add DIR, --remove ID_OR_PATH..., or --verify / "
            "--target-recall R / --check (an existing store)"
        )
    if action in ("build", "add") and not model:
        raise EvalInputError(f"--{'gallery' if action == 'build' else 'add'} needs --model (the features' model)")
    if action in ("remove", "check") and model:
        what = "--remove" if action == "remove" else "--verify / --target-recall / --check alone"
        raise EvalInputError(f"--model does not apply to {what} (no image is read)")
    if factory is not None and action != "build":
        raise EvalInputError("--factory applies to --gallery: a store keeps the factory it was built with")
    if refine is not None and (action != "build" or refine < 1):
        raise EvalInputError("--refine R (R >= 1) applies to --gallery: a store keeps the search it was built with")
    for flag, value in (("--site", site), ("--metadata", metadata)):
        if value is not None and action not in ("build", "add"):
            raise EvalInputError(f"{flag} applies to the images of --gallery or --add")
    if target_recall is not None and not 0 < target_recall <= 1:
        raise EvalInputError(f"--target-recall must be in (0, 1], got {target_recall}")
    if verify_sample < 1 or verify_k < 1:
        raise EvalInputError(
            f"--verify-sample and --verify-k must be >= 1, got {verify_sample}, {verify_k}"
        )
    return action


def query_filters(cameras: Optional[Sequence[str]], sites: Optional[Sequence[str]], since: Optional[str],
                  until: Optional[str]) -> dict[str, Any]:
    """The filters of the ``query`` command (--cameras, --sites, --since, --until) as :func:`query_index` takes them.

    Checked by the rules the metadata CSV and the service use (:mod:`fedreid.retrieval.fields`).
    """
    filters: dict[str, Any] = {}
    if cameras:
        cams = fields.camera_list(",".join(cameras), "--cameras")
        if not cams:
            raise EvalInputError(f"--cameras expects camera numbers like 1,2, got {','.join(cameras)!r}")
        filters["cameras"] = cams
    if sites:
        names = fields.site_list(",".join(sites), "--sites")
        if not names:
            raise EvalInputError(f"--sites expects site names like north,south, got {','.join(sites)!r}")
        filters["sites"] = names
    window = fields.time_window(since, until, "--")
    if window is not None:
        filters["time_window"] = window
    return filters
