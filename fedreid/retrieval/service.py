"""A search service over a gallery store: a JSON API (FastAPI) and a web page, served by uvicorn.

:func:`create_app` builds the application over a store folder
(:class:`~fedreid.retrieval.store.GalleryStore`) and a loaded model (a run's
model or an exported file: the service only calls
:func:`fedreid.inference.images.array_features`). Endpoints: ``POST /search``,
``GET /items/{id}``, ``GET /items/{id}/image``, ``POST /items``,
``DELETE /items/{id}``, ``GET /info`` and the page ``GET /``. Every value is
checked by :mod:`fedreid.retrieval.fields` before any work; the token, Host
and Origin checks, request limits and the readers-writer lock are
:mod:`fedreid.retrieval.guard`'s. Searches run concurrently, updates one at a
time; a store replaced by another process is reopened, and a read always sees
one save. :func:`check_serve_options`, :func:`read_token` and
:func:`run_server` are what the ``serve`` command
(:mod:`fedreid.commands.eval_serve`) runs.

Each endpoint's fields and answers, the security rules and the concurrency
design: ``docs/retrieval-internals.md``.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import socket
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

import numpy as np

try:  # the [serve] extra; module level: FastAPI reads the endpoints' annotations from this module's names
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException as StarletteHTTPException

    _MISSING_EXTRA: Optional[str] = None
except ImportError as exc:  # the options and checks still work; serving says what to install
    _MISSING_EXTRA = str(exc)

from fedreid.errors import FedReIDError
from fedreid.retrieval import fields as field_rules
from fedreid.retrieval.access_log import redact_item_ids
from fedreid.retrieval.guard import (
    DEFAULT_MAX_UPLOAD_BYTES,
    FORM_OVERHEAD,
    MIN_TOKEN_LENGTH,
    TOKEN_ENV,
    ServiceError,
    _Guard,
    _ReadWriteLock,
    _RequestError,
    check_serve_security,
)
from fedreid.retrieval.store_files import header_stamp

if TYPE_CHECKING:
    from fedreid.inference.model_io import LoadedModel
    from fedreid.retrieval.store import GalleryStore

__all__ = [
    "DEFAULT_MAX_DECODES",
    "DEFAULT_MAX_K",
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_MAX_UPLOAD_BYTES",
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "ServiceError",
    "background_server",
    "check_serve_options",
    "check_serve_security",
    "create_app",
    "read_token",
    "run_server",
]

#: Largest accepted image, in pixels (width x height), checked from the header before decoding.
DEFAULT_MAX_PIXELS = 24_000_000
DEFAULT_MAX_K = 100
DEFAULT_K = 10
#: Uploads decoded (and their features computed) at once: each may hold a full-size image's pixels.
DEFAULT_MAX_DECODES = 2
UPLOADS_KIND = "uploads"
TOOL = "tools/eval_reid.py serve"
#: Reads of one request: how often a read is repeated when another process replaced the store meanwhile.
READ_ATTEMPTS = 5
#: Writes of one request: how often the service reopens the store and repeats its own update.
WRITE_ATTEMPTS = 3
#: Pause before the first repeated read, doubled each time (a swap is two renames; a reopen reads the new segments).
RETRY_PAUSE_S = 0.05
#: PIL format name -> file suffix of the uploads accepted (what the index tool reads: jpg/png/bmp).
UPLOAD_FORMATS = {"JPEG": ".jpg", "PNG": ".png", "BMP": ".bmp"}
#: The name ``POST /items`` gives an upload in its uploads folder: a uuid4's 32 hex digits and the format's suffix.
_UPLOAD_NAME = re.compile("[0-9a-f]{32}(?:" + "|".join(re.escape(s) for s in UPLOAD_FORMATS.values()) + ")")
#: The temporary file :func:`fedreid.utils.io.atomic_path` writes an upload through: ``.<upload name>.<8 characters>.tmp``.
_UPLOAD_TEMP = re.compile(r"\." + _UPLOAD_NAME.pattern + r"\.[a-z0-9_]{8}\.tmp")
#: More unreferenced uploads than this in the uploads folder are not what killed updates left (see
#: :meth:`_Service.sweep_uploads`): a sweep then deletes none of them.
SWEEP_LIMIT = 8
_MEDIA_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".bmp": "image/bmp"}
_WEB_ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
               "style.css": "text/css; charset=utf-8"}
_SEARCH_FIELDS = ("image", "item", "k", "cameras", "sites", "since", "until")
_ITEM_FIELDS = ("image", "camera", "site", "timestamp", "identity")
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
             "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
_LOG = logging.getLogger("fedreid.retrieval.service")


_T = TypeVar("_T")




def _require_serve_extra() -> None:
    from importlib.util import find_spec

    missing = _MISSING_EXTRA or ", ".join(
        name for name, modules in (("uvicorn", ("uvicorn",)), ("python-multipart", ("python_multipart", "multipart")))
        if not any(find_spec(m) for m in modules)
    )
    if missing:
        raise ServiceError(
            f"the search service needs fastapi, uvicorn and python-multipart (missing: {missing}): "
            "pip install -e '.[serve]'"
        )


# --------------------------------------------------------------------------
# Start-up checks
# --------------------------------------------------------------------------


def _check_uploads_location(uploads: Path, store_folder: Path) -> None:
    up, st = uploads.resolve(), store_folder.resolve()
    if up == st or st in up.parents or up in st.parents:
        raise ServiceError(
            f"uploads folder {uploads} and store folder {store_folder} must not contain one another "
            "(a store update replaces the whole store folder): choose a separate --uploads folder"
        )


# --------------------------------------------------------------------------
# Request errors and field parsing
# --------------------------------------------------------------------------


def _parse_int(value: str, name: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an integer from ``low`` to ``high``: ASCII digits with an optional sign
    (:func:`fields.is_integer_text <fedreid.retrieval.fields.is_integer_text>`), else a 422 naming ``name``."""
    text = value.strip()
    number: Optional[int] = None
    if field_rules.is_integer_text(text):
        try:
            number = int(text)
        except ValueError:  # more digits than Python converts
            number = None
    bounds = (f" from {low} to {high}" if high is not None else f" >= {low}") if low is not None else ""
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        raise _RequestError(422, f"{name} must be an integer{bounds}, got {value[:40]!r}")
    return number


def _parse_item_id(value: str) -> int:
    return _parse_int(value, "the item id", low=0, high=2**63 - 1)


# --------------------------------------------------------------------------
# The service's state
# --------------------------------------------------------------------------


@dataclass
class _Upload:
    data: bytes
    name: str


class _Service:
    """What the app holds: the store, the model, the limits and the lock (see the module docstring)."""

    def __init__(self, store: GalleryStore, loaded: LoadedModel, *, device: Any, uploads: Optional[Path], max_upload_bytes: int,
                 max_pixels: int, max_k: int, allow_model_mismatch: bool = False,
                 warn: Optional[Callable[[str], None]] = None, max_decodes: int = DEFAULT_MAX_DECODES,
                 stamp: Optional[tuple[int, int, int]] = None) -> None:
        self.store, self.loaded, self.device, self.uploads = store, loaded, device, uploads
        self.max_upload_bytes, self.max_pixels, self.max_k = max_upload_bytes, max_pixels, max_k
        self.allow_model_mismatch, self.warn = allow_model_mismatch, warn
        self.lock = _ReadWriteLock()
        self.decodes = threading.BoundedSemaphore(max_decodes)
        # ``stamp``: the header's stamp taken before ``store`` was opened; one taken now could already be that of
        # a later save, which this service would then take for the one it holds and never reopen.
        self.stamp = header_stamp(store.folder) if stamp is None else stamp
        self.sweep_refused = False

    # -- the store on disk --------------------------------------------------

    def refresh(self) -> None:
        """Reopen the store when another process (e.g. ``index --add``) has replaced its folder since.

        The check is one ``stat`` of ``header.json`` (every store update
        writes a new one); None (the folder is between an update's two
        renames) is left to the read that follows, which repeats itself
        (:meth:`consistent`). See :meth:`_reopen`.
        """
        if header_stamp(self.store.folder) in (self.stamp, None):
            return
        with self.lock.write():
            self._reopen()

    def _reopen(self) -> None:
        """(The write lock held.) Adopt the store on disk when its ``header.json`` is not the one served.

        A store replaced again while it is being opened (its header no longer
        the one the open began with, or a file of the next save read against
        the previous header) is opened again, up to :data:`READ_ATTEMPTS`
        times. The reopened store must still belong to the served model and
        give features of its size, or requests get a 503 (without server
        paths) until the service is restarted.
        """
        from fedreid.inference.model_io import check_index_model
        from fedreid.retrieval.store import GalleryStore

        folder = self.store.folder
        for attempt in range(READ_ATTEMPTS):
            stamp = header_stamp(folder)
            if stamp == self.stamp:
                return
            if stamp is not None:
                try:
                    store = GalleryStore.open(folder, previous=self.store)  # unchanged segments taken over
                    problem = check_index_model(store.header, self.loaded, store.folder,
                                                allow_mismatch=self.allow_model_mismatch)
                except (OSError, ValueError, FedReIDError) as exc:
                    if header_stamp(folder) == stamp:  # the same save throughout: it is what is on disk
                        raise _RequestError(503, "the gallery store was changed on disk and cannot be served now: "
                                                 f"{self.public(str(exc))}") from None
                else:
                    if header_stamp(folder) == stamp:
                        if store.dim != self.store.dim:
                            raise _RequestError(
                                503, f"the gallery store was rebuilt with {store.dim}-d features; the served model "
                                f"gives {self.store.dim}-d ones: restart the service with the store's model"
                            )
                        if problem and self.warn is not None:
                            self.warn(problem)
                        self.store, self.stamp = store, stamp
                        return
            time.sleep(RETRY_PAUSE_S * 2**attempt)
        raise _RequestError(503, f"the gallery store was being replaced on disk during {READ_ATTEMPTS} attempts to "
                                 "reopen it (another process is updating it): try again")

    def consistent(self, read: Callable[[GalleryStore], _T]) -> _T:
        """``read(store)`` on one saved version of the store, also while another process replaces it.

        The in-memory index and vectors are one save; the table is read from
        the folder, which another process may replace mid-read. So the read
        counts only when ``header.json`` is, after it, still the served save;
        otherwise (whatever it returned or raised, e.g. SQLite finding no
        database between an update's two renames) the store is reopened and
        the read repeated, up to :data:`READ_ATTEMPTS` times, then a 503.
        """
        for attempt in range(READ_ATTEMPTS):
            self.refresh()
            with self.lock.read():
                store, stamp = self.store, self.stamp
                try:
                    result, failure = read(store), None
                except Exception as exc:  # noqa: BLE001 - judged below: raised as is unless the store moved
                    result, failure = None, exc
            if header_stamp(store.folder) == stamp:
                if failure is not None:
                    raise failure
                return result  # type: ignore[return-value]
            time.sleep(RETRY_PAUSE_S * 2**attempt)
        raise _RequestError(503, f"the gallery store was being replaced on disk during {READ_ATTEMPTS} attempts to "
                                 "read it (another process is updating it): try again")

    def update(self, change: Callable[[GalleryStore], _T]) -> _T:
        """``change(store)`` (an add or a removal) on the newest save, holding the store's update lock throughout.

        Under the service's write lock and the store's update lock
        (:meth:`GalleryStore.update_lock`; another process's update that
        holds it is waited for, up to its timeout), the store is reopened if
        another process saved it since, the uploads folder swept
        (:meth:`sweep_uploads`), then the store changed: no other update can
        come in between, so the client never sees "changed on disk". Should
        a writer that ignores the lock still get in, the change is repeated on
        the reopened store, up to :data:`WRITE_ATTEMPTS` times.
        """
        from fedreid.retrieval.store import GalleryStoreError

        with self.lock.write():
            for attempt in range(WRITE_ATTEMPTS):
                with self.store.update_lock():
                    self._reopen()
                    self.sweep_uploads()
                    served = self.stamp
                    try:
                        result = change(self.store)
                    except GalleryStoreError:
                        if attempt + 1 < WRITE_ATTEMPTS and header_stamp(self.store.folder) != served:
                            continue  # saved by someone else after all: reopen and repeat
                        raise
                    self.stamp = header_stamp(self.store.folder)
                    return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def sweep_at_start(self) -> None:
        """Sweep the uploads folder (:meth:`sweep_uploads`) now, unless another process is updating the store.

        Never waits: when the store's update lock is taken, or the store
        cannot be reopened, nothing is done (the next update sweeps).
        """
        from fedreid.retrieval.store import GalleryStoreError

        if self.uploads is None:
            return
        try:
            with self.lock.write(), self.store.update_lock(timeout=0):
                self._reopen()
                self.sweep_uploads()
        except (GalleryStoreError, _RequestError, OSError):
            pass

    def sweep_uploads(self) -> list[str]:
        """(The write lock and the store's update lock held, ``self.store`` the newest save.) Delete the uploads no
        item holds; the names deleted.

        What a killed ``POST /items`` or ``DELETE /items/{id}`` left: an
        upload written but not added (or its temporary file), or one whose
        item was erased. Only the uploads folder's own entries are looked at
        (one listing; the folder must still be itself, not a link, and
        carry the uploads marker), only regular files named as the service
        names uploads (:data:`_UPLOAD_NAME`) or their temporary files
        (:data:`_UPLOAD_TEMP`), and an upload is kept when the store holds its
        path (one lookup) or, the folder having been moved, another path
        ending with its name (a uuid4). Uploads are written and deleted only
        under the store's update lock, so none caught between its write and
        its commit is ever taken for a leftover. A kill leaves at most one
        leftover and every start and update sweeps, so more than
        :data:`SWEEP_LIMIT` unreferenced uploads are not leftovers (the
        store was replaced by an older copy or rebuilt; a folder of
        another store's is refused at the start, :func:`_check_uploads_store`): then nothing is deleted and a warning says so
        once. A sweep never fails the update it precedes: an error only logs.
        """
        from fedreid.utils.io import owns_folder

        folder = self.uploads
        if folder is None:
            return []
        try:
            if os.path.realpath(folder) != str(folder) or not owns_folder(folder, UPLOADS_KIND):
                return []
            with os.scandir(folder) as entries:
                files = [e.name for e in entries
                         if (_UPLOAD_NAME.fullmatch(e.name) or _UPLOAD_TEMP.fullmatch(e.name))
                         and e.is_file(follow_symlinks=False)]
            uploads = {str(folder / name): name for name in files if _UPLOAD_NAME.fullmatch(name)}
            held = self.store.find_paths(list(uploads))
            loose = [name for name in files if _UPLOAD_TEMP.fullmatch(name)] + \
                    [name for path, name in uploads.items() if path not in held]
            if len(loose) > SWEEP_LIMIT:
                if not self.sweep_refused:
                    self.sweep_refused = True
                    message = (f"uploads folder {folder} holds {len(loose)} uploads that store {self.store.folder} "
                               "does not name by their path there, more than killed updates leave: none was deleted "
                               "(give each store its own uploads folder)")
                    (self.warn or _LOG.warning)(message)
                return []
            deleted = []
            for name in sorted(loose):
                if _UPLOAD_NAME.fullmatch(name) and self.store.find_file_name(name):
                    continue  # held under the folder's earlier path
                if _delete_upload_file(folder / name, _UPLOAD_NAME if _UPLOAD_NAME.fullmatch(name) else _UPLOAD_TEMP):
                    deleted.append(name)
        except Exception:  # noqa: BLE001 - a sweep never fails the update it precedes; the next one sweeps again
            _LOG.exception("sweeping the uploads folder %s failed", folder)
            return []
        if deleted:
            _LOG.info("deleted %d upload(s) no item holds (left by a killed update) from %s", len(deleted), folder)
        return deleted

    def public(self, text: str) -> str:
        """``text`` without server folders, for an HTTP answer: the store folder as ``<store>``, any other absolute
        path by its last name."""
        text = text.replace(str(self.store.folder), "<store>")
        return _ABSOLUTE_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "/", text)

    # -- images and features ------------------------------------------------

    def decode(self, upload: _Upload) -> tuple[np.ndarray, str]:
        """The upload as an RGB array and its file suffix, or a 400 naming what is wrong with it.

        The pixels are OpenCV's (:func:`~fedreid.inference.images.decode_image_bytes`,
        as a gallery file's). Before that, PIL reads the header only (format;
        width x height against ``max_pixels``) and checks the file is whole
        without a second full-size decode: a JPEG (which OpenCV may decode
        half grey when cut) is decoded at 1/8 scale, a PNG's chunks and their
        CRCs are read to the end (OpenCV refuses a PNG or BMP it cannot
        finish). Callers bound how many run at once (:meth:`upload_features`).
        """
        from PIL import Image, UnidentifiedImageError

        from fedreid.inference.errors import EvalInputError
        from fedreid.inference.images import decode_image_bytes

        what = f"the uploaded file {upload.name!r}" if upload.name else "the uploaded file"
        if not upload.data:
            raise _RequestError(400, f"{what} is empty: expected a JPEG, PNG or BMP image")
        if len(upload.data) > self.max_upload_bytes:
            raise _RequestError(413, f"{what} has {len(upload.data)} bytes: at most {self.max_upload_bytes} accepted")
        try:
            with Image.open(io.BytesIO(upload.data)) as probe:  # the header first: format and size
                fmt, (width, height) = probe.format, probe.size
                if fmt not in UPLOAD_FORMATS:
                    raise _RequestError(400, f"{what} is a {fmt} image: expected a JPEG, PNG or BMP file")
                if width * height > self.max_pixels:
                    raise _RequestError(
                        400, f"{what} is {width}x{height} pixels: at most {self.max_pixels} pixels accepted"
                    )
                try:
                    if fmt == "JPEG":  # every coded block is still read, at 1/64 of the pixels
                        probe.draft(None, (max(1, width // 8), max(1, height // 8)))
                        probe.load()
                    elif fmt == "PNG":
                        probe.verify()
                except (OSError, ValueError, SyntaxError, EOFError):
                    raise _RequestError(400, f"{what} is a damaged or truncated {fmt} file") from None
        except Image.DecompressionBombError:
            raise _RequestError(400, f"{what} declares too many pixels: at most {self.max_pixels} accepted") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            raise _RequestError(400, f"{what} is not an image: expected a JPEG, PNG or BMP file") from None
        try:
            image = decode_image_bytes(upload.data, what)
        except EvalInputError:  # its header was read: the rest is damaged
            raise _RequestError(400, f"{what} is a damaged or truncated {fmt} file") from None
        return image, UPLOAD_FORMATS[fmt]

    def features(self, image: np.ndarray) -> np.ndarray:
        from fedreid.inference.images import array_features

        return array_features(self.loaded, [image], device=self.device)

    def upload_features(self, upload: _Upload) -> tuple[np.ndarray, str]:
        """The feature [1, d] of an uploaded image and its file suffix (:meth:`decode`, :meth:`features`).

        At most ``max_decodes`` uploads are decoded at once, each holding its
        decoded pixels until its feature is computed, so many concurrent large
        uploads wait rather than each taking its image's memory.
        """
        with self.decodes:
            image, suffix = self.decode(upload)
            return self.features(image), suffix

    # -- reading ------------------------------------------------------------

    @staticmethod
    def _item_vector(store: GalleryStore, item: int) -> np.ndarray:
        ids = store.ids
        row = int(np.searchsorted(ids, item))
        if row >= ids.size or int(ids[row]) != item:
            raise _RequestError(404, f"no item {item} in the gallery")
        return np.array(store.vectors[row : row + 1], dtype=np.float32)

    def search(self, query: Optional[np.ndarray], item: Optional[int], k: int, filters: dict[str, Any]
               ) -> tuple[np.ndarray, np.ndarray, list[Optional[dict]]]:
        """Scores, ids and rows of the top ``k``, all from one save of the store (:meth:`consistent`)."""
        def read(store: GalleryStore) -> tuple[np.ndarray, np.ndarray, list[Optional[dict]]]:
            vector = self._item_vector(store, int(item)) if query is None else query
            result = store.search(vector, k, **filters)
            return result.scores[0], result.ids[0], store.rows(result.ids[0])

        return self.consistent(read)

    def row(self, item: int) -> dict[str, Any]:
        row = self.consistent(lambda store: store.rows([item])[0])
        if row is None:
            raise _RequestError(404, f"no item {item} in the gallery")
        return row

    def file_roots(self) -> list[Path]:
        """The folders whose files may be served: the store's recorded gallery roots and the uploads folder."""
        from fedreid.retrieval.gallery_rows import recorded_gallery_roots

        roots = recorded_gallery_roots(self.store.header)
        return roots + ([self.uploads] if self.uploads is not None else [])

    def image_file(self, item: int) -> tuple[bytes, str]:
        """The bytes and media type of ``item``'s image, or a 404 naming the file (its name only).

        Only a regular file whose real path (links resolved) lies inside
        :meth:`file_roots` is read: a gallery file replaced by a link to
        anything outside them, a folder on its path replaced by such a link, a
        FIFO or a device are refused, not followed.
        """
        row = self.row(item)
        path = Path(row["path"])
        media = _MEDIA_TYPES.get(path.suffix.lower())
        if media is None:
            raise _RequestError(404, f"item {item}'s file {path.name!r} is not a jpg/png/bmp image file")
        return read_file_inside(path, self.file_roots(), f"the image file of item {item} ({path.name})"), media

    # -- updates ------------------------------------------------------------

    def add(self, upload: _Upload, meta: dict[str, Any]) -> dict[str, Any]:
        """Store ``upload`` in the uploads folder and add it with ``meta``; the new item's row.

        The file is written and added in one :meth:`update`, so a sweep
        (which runs only there) never takes it for a leftover; it is deleted
        again when the add fails. The header's ``meta.precision`` gains the
        service's ``fp32`` (:func:`fedreid.retrieval.folders.added_precision_meta`).
        """
        from fedreid.inference.model_io import check_index_model
        from fedreid.retrieval.folders import added_precision_meta, extraction_precision
        from fedreid.utils.io import atomic_path

        def add_item(store: GalleryStore) -> int:
            # Searching may be allowed with another model (--allow-model-mismatch); storing its features never is.
            if check_index_model(store.header, self.loaded, store.folder, allow_mismatch=True) is not None:
                raise _RequestError(409, "adding items needs the gallery store's own model, and the served model "
                                         "is another one (--allow-model-mismatch allows searching only)")
            with atomic_path(path) as tmp:
                tmp.write_bytes(upload.data)
            try:
                header_meta = added_precision_meta(store.header, extraction_precision(self.loaded, amp=False))
                return int(store.add(feature, [dict(meta, path=str(path))], meta=header_meta)[0])
            except BaseException:
                path.unlink(missing_ok=True)
                raise

        if self.uploads is None:
            raise _RequestError(403, "adding items is off: the server was started without an uploads folder (--uploads DIR)")
        feature, suffix = self.upload_features(upload)  # outside the lock: searches and other uploads go on
        path = self.uploads / f"{uuid.uuid4().hex}{suffix}"
        return self.row(self.update(add_item))

    def remove(self, item: int) -> dict[str, Any]:
        from fedreid.retrieval.gallery_rows import roots_after_removal

        def erase(store: GalleryStore) -> tuple[int, bool]:
            row = store.rows([item])[0]
            if row is None:
                raise _RequestError(404, f"no item {item} in the gallery")
            store.remove([item], meta=roots_after_removal(store, [item]))
            # A kill before this deletion leaves an upload no item holds: the next sweep deletes it.
            return int(store.ntotal), _delete_upload_file(Path(row["path"]))

        items, deleted = self.update(erase)
        return {"removed": item, "file_deleted": deleted, "items": items}

    def info(self) -> dict[str, Any]:
        self.refresh()
        cfg = self.loaded.config
        return {
            "items": int(self.store.ntotal), "dim": int(self.store.dim), "factory": self.store.factory,
            "model": {"backbone": cfg.get("backbone"), "height": int(cfg["height"]), "width": int(cfg["width"]),
                      "backend": cfg.get("backend", "pytorch")},
            "uploads": self.uploads is not None,
            "limits": {"max_k": self.max_k, "max_upload_bytes": self.max_upload_bytes, "max_pixels": self.max_pixels},
        }


def _delete_upload_file(path: Path, name: re.Pattern[str] = _UPLOAD_NAME) -> bool:
    """Delete ``path`` if ``POST /items`` wrote it; whether a file was deleted.

    An upload is recognised wherever its folder is now (the service may have
    been restarted with another ``--uploads`` or none): its name is the
    service's (``name``: :data:`_UPLOAD_NAME`, or :data:`_UPLOAD_TEMP` for a
    sweep's temporary files) and its folder, links resolved, holds the
    uploads marker (:func:`fedreid.utils.io.owns_folder`). Anything else,
    such as a gallery image indexed from the user's own folder, is never
    deleted, nor a link or anything but a regular file.
    """
    from fedreid.utils.io import owns_folder

    if not name.fullmatch(path.name):
        return False
    try:
        folder = Path(os.path.realpath(path.parent, strict=True))
    except (OSError, RuntimeError):  # the folder is gone, or a looping link
        return False
    if not owns_folder(folder, UPLOADS_KIND):
        return False
    target = folder / path.name
    try:
        if not stat.S_ISREG(os.lstat(target).st_mode):
            return False
        target.unlink()
    except OSError:  # already gone, or not ours to delete (permissions): the answer says so
        return False
    return True


#: The uploads marker's entry naming the one store whose items the folder's uploads are (:func:`_bind_uploads`).
UPLOADS_STORE_KEY = "store"


def _uploads_store(uploads: Path) -> Optional[str]:
    """The store an uploads folder is bound to (its marker's :data:`UPLOADS_STORE_KEY`), or None."""
    from fedreid.utils.io import marker_path

    try:
        record = json.loads(marker_path(uploads, UPLOADS_KIND).read_text())
    except (OSError, ValueError):
        return None
    bound = record.get(UPLOADS_STORE_KEY) if isinstance(record, dict) else None
    return bound if isinstance(bound, str) else None


def _check_uploads_store(uploads: Path, store_folder: Path) -> None:
    """Refuse an uploads folder bound to another store: its sweep (:meth:`_Service.sweep_uploads`) would delete
    that store's uploads, which this store does not hold."""
    from fedreid.utils.io import marker_path

    bound, ours = _uploads_store(uploads), os.path.realpath(store_folder)
    if bound is not None and bound != ours:
        raise ServiceError(
            f"uploads folder {uploads} holds the uploads of store {bound}, not of {ours}: give each store its own "
            f"uploads folder (if that store was moved here, delete the {UPLOADS_STORE_KEY!r} entry of "
            f"{marker_path(uploads, UPLOADS_KIND).name} to bind the folder to it; nothing was changed)"
        )


def _bind_uploads(uploads: Path, store_folder: Path) -> None:
    """Record in the uploads marker (atomically) that the folder's uploads are ``store_folder``'s, once."""
    from fedreid.utils.io import marker_path, write_json_atomic

    if _uploads_store(uploads) is None:
        marker = marker_path(uploads, UPLOADS_KIND)
        record = json.loads(marker.read_text())
        record[UPLOADS_STORE_KEY] = os.path.realpath(store_folder)
        write_json_atomic(marker, record)


def _inside(real: str, roots: Sequence[Path]) -> bool:
    return any(real == str(root) or Path(root) in Path(real).parents for root in roots)


def read_file_inside(path: Path, roots: Sequence[Path], what: str) -> bytes:
    """The bytes of the regular file at ``path`` when its real path lies inside one of ``roots``; else a 404.

    ``roots`` are taken as given (absolute, their links resolved when they were
    recorded), so a root replaced by a link widens nothing. The real path is
    checked before opening and, where ``/proc`` names the open file, again
    after: a folder on the path swapped for a link in between is caught too.
    The file is opened without following a final link and without blocking
    (a FIFO would otherwise hang the request), then must be a regular file.
    """
    try:
        real = os.path.realpath(path, strict=True)
    except (OSError, RuntimeError):  # missing, a dangling or looping link, unreadable folder
        raise _RequestError(404, f"{what} is missing on the server") from None
    if not _inside(real, roots):
        raise _RequestError(404, f"{what} lies outside the gallery and uploads folders: it is not served")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _RequestError(404, f"{what} is missing on the server") from None
    except OSError:  # a link put in place since, a folder, no permission
        raise _RequestError(404, f"{what} cannot be read by the server") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _RequestError(404, f"{what} is not a regular file: it is not served")
        try:
            opened = os.readlink(f"/proc/self/fd/{f.fileno()}")
        except OSError:  # no /proc here: the check before opening stands
            opened = real
        if not _inside(opened, roots):
            raise _RequestError(404, f"{what} lies outside the gallery and uploads folders: it is not served")
        try:
            return f.read()
        except OSError:
            raise _RequestError(404, f"{what} cannot be read by the server") from None


#: An absolute path in a message (not the path part of a URL or of a media type such as image/png).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~<>-])/[^\s'\"(),;]*")


def _result_item(row: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A table row as the API shows it: the file name only, and the image's URL."""
    return {
        **extra,
        "id": int(row["id"]), "path": Path(row["path"]).name, "camera": row["camera"], "site": row["site"],
        "timestamp": row["timestamp"], "identity": row["identity"], "image_url": f"/items/{int(row['id'])}/image",
    }


# --------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------


def _web_asset(name: str) -> bytes:
    return (resources.files("fedreid.retrieval") / "web" / name).read_bytes()


def create_app(
    store_folder: str | Path,
    loaded: LoadedModel,
    *,
    token: Optional[str],
    insecure_local: bool = False,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_k: int = DEFAULT_MAX_K,
    uploads: Optional[str | Path] = None,
    device: Any = "cpu",
    allow_model_mismatch: bool = False,
    warn: Optional[Callable[[str], None]] = None,
    max_decodes: int = DEFAULT_MAX_DECODES,
) -> FastAPI:
    """The FastAPI application serving the store at ``store_folder`` with the model ``loaded``.

    ``token``: the bearer token every API request must carry (compared in
    constant time); None is accepted only with ``insecure_local`` (the
    caller binds a loopback host: :func:`check_serve_security`). The store is
    opened (:meth:`GalleryStore.open`) and must have been built by
    ``loaded``'s model (:func:`fedreid.inference.model_io.check_index_model`;
    ``allow_model_mismatch`` turns the refusal into a ``warn``) and give
    features of the store's size. ``uploads``: the folder ``POST /items``
    writes into, claimed with :func:`fedreid.utils.io.claim_output_dir`
    (new, empty, or an uploads folder of this service; neither inside nor
    around the store folder); None turns ``POST /items`` off. Uploads no
    item holds, left there by a killed add or removal, are deleted at the
    start (unless another process is updating the store) and before every
    update (:meth:`_Service.sweep_uploads`); the folder is bound to the first
    store served with it (:func:`_bind_uploads`) and refused for any other.
    ``max_upload_bytes``: largest image upload (bodies may be
    :data:`FORM_OVERHEAD` larger); ``max_pixels``: largest image; ``max_k``:
    largest ``k``; ``max_decodes``: uploads decoded at once (each may hold a
    ``max_pixels`` image; more wait). Raises :class:`ServiceError` (or the store's/model check's
    errors) before serving anything. ``device``: where a PyTorch model runs;
    an exported model (``loaded.extractor``) runs on the CPU, and an ONNX
    file without torch.
    """
    _require_serve_extra()
    from fedreid.inference.errors import EvalInputError
    from fedreid.inference.model_io import check_index_model
    from fedreid.retrieval.store import GalleryStore, GalleryStoreError
    from fedreid.utils.io import claim_output_dir

    if token is None and not insecure_local:
        raise ServiceError("no token: authentication can only be off with insecure_local (a loopback host)")
    if token is not None:
        token = check_serve_security("127.0.0.1", token, False)
    for name, value in (("max_upload_bytes", max_upload_bytes), ("max_pixels", max_pixels), ("max_k", max_k),
                        ("max_decodes", max_decodes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ServiceError(f"{name} must be an integer >= 1, got {value!r}")
    stamp = header_stamp(os.path.abspath(store_folder))
    store = GalleryStore.open(store_folder)
    problem = check_index_model(store.header, loaded, store.folder, allow_mismatch=allow_model_mismatch)
    if problem and warn is not None:
        warn(problem)
    if loaded.extractor is None:
        import torch

        device = torch.device(device)
    probe = np.zeros((int(loaded.config["height"]), int(loaded.config["width"]), 3), dtype=np.uint8)
    from fedreid.inference.images import array_features

    dim = int(array_features(loaded, [probe], device=device).shape[1])  # also warms the model up
    if dim != store.dim:
        raise ServiceError(f"model {loaded.source} gives {dim}-d features but store {store.folder} holds {store.dim}-d ones")
    uploads_dir: Optional[Path] = None
    if uploads is not None:
        uploads_dir = Path(os.path.abspath(uploads))
        _check_uploads_location(uploads_dir, store.folder)
        _check_uploads_store(uploads_dir, store.folder)  # before claiming: a refused folder stays untouched
        claim_output_dir(uploads_dir, UPLOADS_KIND, tool=f"{TOOL} --uploads")
        uploads_dir = uploads_dir.resolve()
        _bind_uploads(uploads_dir, store.folder)
    service = _Service(store, loaded, device=device, uploads=uploads_dir,
                       max_upload_bytes=int(max_upload_bytes), max_pixels=int(max_pixels), max_k=int(max_k),
                       allow_model_mismatch=allow_model_mismatch, warn=warn, max_decodes=int(max_decodes),
                       stamp=stamp)
    service.sweep_at_start()
    page = {name: _web_asset(name) for name in _WEB_ASSETS}

    app = FastAPI(title="fedreid gallery search", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    def error(status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(_RequestError)
    async def _on_request_error(request: Request, exc: _RequestError) -> JSONResponse:
        return error(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = request.url.path[:100]
        message = {404: f"no endpoint {where}", 405: f"{request.method} is not allowed on {where}"}
        return error(exc.status_code, message.get(exc.status_code, str(exc.detail)), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, "; ".join(str(e.get("msg")) for e in exc.errors()) or "invalid request")

    @app.exception_handler(field_rules.GalleryMetadataError)
    async def _on_field_error(request: Request, exc: field_rules.GalleryMetadataError) -> JSONResponse:
        return error(422, str(exc))

    @app.exception_handler(GalleryStoreError)
    async def _on_store_error(request: Request, exc: GalleryStoreError) -> JSONResponse:
        return error(409, service.public(str(exc)))

    @app.exception_handler(EvalInputError)
    async def _on_input_error(request: Request, exc: EvalInputError) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
        # The path as the access log writes it: an item's id must not outlive its erasure in the log.
        _LOG.exception("internal error on %s %s", request.method, redact_item_ids(request.url.path))
        return error(500, f"internal error ({type(exc).__name__}); see the server log")

    async def read_form(request: Request, allowed: Sequence[str]) -> dict[str, Any]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
            raise _RequestError(415, f"expected a multipart/form-data body (or url-encoded fields), got {kind or 'none'!r}")
        try:
            form = await request.form(max_files=1, max_fields=len(allowed) + 4, max_part_size=FORM_OVERHEAD)
        except StarletteHTTPException as exc:
            raise _RequestError(400, f"malformed form body: {exc.detail}") from None
        try:
            fields: dict[str, Any] = {}
            for key, value in form.multi_items():
                if key not in allowed:
                    raise _RequestError(422, f"unknown field {key[:40]!r}: expected {', '.join(allowed)}")
                if key in fields:
                    raise _RequestError(422, f"field {key!r} is given twice: expected it once")
                if isinstance(value, UploadFile):
                    if key != "image":
                        raise _RequestError(422, f"field {key!r} must be a plain value, not a file")
                    fields[key] = _Upload(await value.read(), Path(value.filename or "").name[:120])
                elif key == "image":
                    raise _RequestError(422, "field 'image' must be a file upload (multipart/form-data)")
                else:
                    fields[key] = str(value)
            return fields
        finally:
            await form.close()

    def json_response(body: Any, status: int = 200) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    # -- the page -----------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def index_page() -> Response:
        return Response(page["index.html"], media_type=_WEB_ASSETS["index.html"],
                        headers={"Content-Security-Policy": _PAGE_CSP})

    @app.get("/web/{name}", include_in_schema=False)
    async def web_asset(name: str) -> Response:
        if name not in page or name == "index.html":
            raise _RequestError(404, f"no web asset {name[:60]!r}")
        return Response(page[name], media_type=_WEB_ASSETS[name])

    # -- the API ------------------------------------------------------------

    @app.get("/info")
    async def info() -> JSONResponse:
        return json_response(service.info())

    @app.post("/search")
    async def search(request: Request) -> JSONResponse:
        started = time.perf_counter()
        fields = await read_form(request, _SEARCH_FIELDS)
        k = _parse_int(fields["k"], "k", 1, service.max_k) if fields.get("k", "").strip() else min(DEFAULT_K, service.max_k)
        filters: dict[str, Any] = {}
        if "cameras" in fields and (cams := field_rules.camera_list(fields["cameras"], "cameras")) is not None:
            filters["cameras"] = cams
        if "sites" in fields and (sites := field_rules.site_list(fields["sites"], "sites")) is not None:
            filters["sites"] = sites
        window = field_rules.time_window(fields.get("since", "").strip() or None,
                                         fields.get("until", "").strip() or None)
        if window is not None:
            filters["time_window"] = window
        has_item = bool(fields.get("item", "").strip())
        if ("image" in fields) == has_item:
            raise _RequestError(422, "give either an 'image' file or an 'item' id to search with (exactly one)")
        if has_item:
            item: Optional[int] = _parse_item_id(fields["item"])
            query = None
            described: dict[str, Any] = {"kind": "item", "item": item}
        else:
            upload: _Upload = fields["image"]
            item = None
            query, _ = await run_in_threadpool(service.upload_features, upload)
            described = {"kind": "image", "name": upload.name}
        scores, ids, rows = await run_in_threadpool(service.search, query, item, k, filters)
        results = [
            _result_item(row, rank=rank + 1, score=float(score))
            for rank, (score, i, row) in enumerate(zip(scores, ids, rows))
            if i >= 0 and row is not None
        ]
        took = (time.perf_counter() - started) * 1000
        return json_response({"results": results, "k": k, "query": described, "took_ms": round(took, 2)})

    @app.get("/items/{item_id}")
    async def get_item(item_id: str) -> JSONResponse:
        row = await run_in_threadpool(service.row, _parse_item_id(item_id))
        return json_response(_result_item(row))

    @app.get("/items/{item_id}/image")
    async def get_item_image(item_id: str) -> Response:
        data, media = await run_in_threadpool(service.image_file, _parse_item_id(item_id))
        return Response(data, media_type=media)

    @app.post("/items")
    async def add_item(request: Request) -> JSONResponse:
        if service.uploads is None:
            raise _RequestError(403, "adding items is off: the server was started without an uploads folder (--uploads DIR)")
        fields = await read_form(request, _ITEM_FIELDS)
        if "image" not in fields:
            raise _RequestError(422, "field 'image' (a JPEG, PNG or BMP file) is required")
        given = {key: fields[key] for key in ("camera", "site", "timestamp", "identity") if fields.get(key, "").strip()}
        meta: dict[str, Any] = {"camera": None, "site": None, "timestamp": None, "identity": None}
        meta.update(field_rules.item_values(given, "the new item"))  # empty fields: unknown
        row = await run_in_threadpool(service.add, fields["image"], meta)
        return json_response(_result_item(row), status=201)

    @app.delete("/items/{item_id}")
    async def delete_item(item_id: str) -> JSONResponse:
        return json_response(await run_in_threadpool(service.remove, _parse_item_id(item_id)))

    app.add_middleware(_Guard, token=token, max_body=int(max_upload_bytes) + FORM_OVERHEAD)
    return app


# --------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------


@contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"
                      ) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread for the block; yields its base URL (``http://host:port``).

    ``port`` 0 picks a free port (the socket is bound before the thread
    starts, so there is no race). The server is stopped and the thread
    joined on leaving the block. For tests and benchmarks; :func:`run_server`
    is the command line's.
    """
    _require_serve_extra()
    import uvicorn

    from fedreid.retrieval.access_log import log_config

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, log_config=log_config(), server_header=False,
                                           timeout_keep_alive=5, ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the test server on {host}:{bound} did not start")
            time.sleep(0.02)
        shown = f"[{host}]" if ":" in host else host
        yield f"http://{shown}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def run_server(app: FastAPI, *, host: str, port: int, ssl_certfile: Optional[str] = None,
               ssl_keyfile: Optional[str] = None) -> None:
    """Serve ``app`` until interrupted: no server header, 5 s keep-alive, no websockets, HTTPS with both files.

    The access log leaves item ids out (:mod:`fedreid.retrieval.access_log`).
    """
    import uvicorn

    from fedreid.retrieval.access_log import log_config

    uvicorn.run(app, host=host, port=int(port), log_level="info", log_config=log_config(), server_header=False,
                timeout_keep_alive=5, ws="none", ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


def check_serve_options(*, host: str, token: Optional[str], insecure_local: bool, ssl_certfile: Optional[str],
                        ssl_keyfile: Optional[str], port: int, max_upload_mb: float,
                        max_pixels: int = DEFAULT_MAX_PIXELS, max_k: int = DEFAULT_MAX_K,
                        max_decodes: int = DEFAULT_MAX_DECODES) -> Optional[str]:
    """Refuse unsafe or impossible ``serve`` settings before anything is loaded; the token to require (None: none).

    No token without ``insecure_local``, ``insecure_local`` off the loopback
    interface, half a TLS pair, a bad port, an upload limit that is not a
    finite number of MiB of at least one byte (``int(max_upload_mb * 2**20)``
    is the limit in bytes), ``max_pixels``, ``max_k`` or ``max_decodes`` under 1: each a
    one-line :class:`ServiceError` naming the option. The ``[serve]`` extra
    must be installed.
    """
    token = check_serve_security(host, token, insecure_local)
    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise ServiceError("give both --ssl-certfile and --ssl-keyfile, or neither")
    if not 0 <= int(port) <= 65535:
        raise ServiceError(f"--port must be from 0 to 65535, got {port}")
    if not (math.isfinite(max_upload_mb) and int(max_upload_mb * 2**20) >= 1):
        raise ServiceError(f"--max-upload-mb must be a finite number of MiB of at least one byte "
                           f"(>= {2**-20:.3g}), got {max_upload_mb}")
    for option, value in (("--max-pixels", max_pixels), ("--max-k", max_k), ("--max-decodes", max_decodes)):
        if int(value) < 1:
            raise ServiceError(f"{option} must be an integer >= 1, got {value}")
    _require_serve_extra()
    return token


def read_token(token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    """The bearer token: ``token``, the first line of ``token_file``, or ``$FEDREID_SERVE_TOKEN``; given once."""
    if token and token_file:
        raise ServiceError("give the token once: --token or --token-file, not both")
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ServiceError(f"cannot read --token-file {token_file}: {exc}") from None
        return lines[0].strip() if lines else ""
    return token or os.environ.get(TOKEN_ENV) or None
