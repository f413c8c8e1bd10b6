"""What a user's file is, before any reader parses it; checksums of saved files.

:func:`file_kind` looks at a file's first bytes only, so a tool can say "this
is a text file, not a PyTorch model" instead of relaying a parser's cryptic
error, and can send only files of the right kind to readers that must not see
anything else (a pickle to nobody but ``torch.load(weights_only=True)``, a
non-faiss file never to ``faiss.read_index``). :func:`sha256_file` streams a
file through SHA-256 for the checksums an index header records;
:func:`read_format_header` reads such a header.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["FILE_KINDS", "check_recorded_file", "describe_kind", "file_kind", "read_format_header", "sha256_file"]

#: What :func:`file_kind` can answer.
FILE_KINDS = ("empty", "zip", "npy", "pickle", "text", "binary")
_SNIFF_BYTES = 512
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"


def file_kind(path: str | Path) -> str:
    """One of :data:`FILE_KINDS`, from the first bytes of ``path`` (nothing is parsed or executed).

    ``zip``: a zip archive (NumPy ``.npz``, PyTorch's default ``torch.save``
    format); ``npy``: a single NumPy array; ``pickle``: a Python pickle of
    protocol 2 or later (PyTorch's legacy format is one); ``text``: UTF-8
    text without NUL bytes; ``binary``: anything else. Raises OSError when the
    file cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if not head:
        return "empty"
    if head.startswith(_ZIP_MAGICS):
        return "zip"
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if b"\0" not in head:
        try:
            head.decode("utf-8")
            return "text"
        except UnicodeDecodeError as exc:
            # A multi-byte character cut by the sniff window is still text.
            if exc.start >= len(head) - 3 and exc.reason == "unexpected end of data":
                return "text"
    return "binary"


def describe_kind(kind: str) -> str:
    """``"it is a text file"``-style words for a :func:`file_kind` answer."""
    return {
        "empty": "it is empty (0 bytes)",
        "zip": "it is a zip archive",
        "npy": "it is a single NumPy .npy array",
        "pickle": "it is a Python pickle, which is never loaded (loading one can run code)",
        "text": "it is a text file",
        "binary": "its first bytes match no expected format",
    }[kind]


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of the file's bytes, read ``chunk_bytes`` at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_recorded_file(
    path: Path, record: dict, header_path: Path, error: type[Exception], *, what: str, fix: str
) -> Path:
    """``path`` after its size and SHA-256 matched ``record`` (``{"bytes", "sha256"}`` from ``header_path``).

    Checked before the file is parsed. A missing file raises
    :class:`FileNotFoundError` (``what`` names it, e.g. "saved index file");
    a different size or digest raises ``error`` naming both files, ending with ``fix``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is missing")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise error(
            f"{path} has {size} bytes but {header_path} says {record['bytes']}: "
            "the folder mixes two saves or the file is damaged"
        )
    if sha256_file(path) != record["sha256"]:
        raise error(f"{path} does not match the SHA-256 in {header_path}: the file is damaged or was replaced {fix}")
    return path


def read_format_header(path: Path, fmt: str, error: type[Exception], missing: str) -> dict[str, Any]:
    """The JSON object at ``path`` whose ``format`` is ``fmt`` (its other fields are the caller's to check).

    A missing file raises ``FileNotFoundError(missing)``; unreadable JSON or
    another format raises ``error`` naming ``path``.
    """
    if not path.is_file():
        raise FileNotFoundError(missing)
    try:
        header = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} is not a readable JSON header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != fmt:
        raise error(f"{path} is not a {fmt} header")
    return header
