"""Atomic writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from fedreid.errors import FedReIDError


def _plain_file_mode() -> int:
    # os.umask can only be read by setting it; done once, at import, before any
    # thread of ours could create a file meanwhile.
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _plain_file_mode()


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``.

    The temporary file lives in the same folder so ``os.replace`` is atomic.
    On an exception the temporary file is removed and ``path`` is untouched.
    The result gets the permissions of a plainly created file (``0o666`` minus
    the umask), not the owner-only mode of ``mkstemp``, so shared run and
    dataset folders stay readable to the group as usual.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, _FILE_MODE)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


class OutputDirError(FedReIDError, ValueError):
    """An output folder is not one this tool may write into."""


def marker_path(folder: str | Path, kind: str) -> Path:
    """The file that marks ``folder`` as a ``kind`` folder made by fedreid (``.fedreid-<kind>.json``)."""
    return Path(folder) / f".fedreid-{kind}.json"


def owns_folder(folder: str | Path, kind: str) -> bool:
    """Whether ``folder`` holds fedreid's marker of ``kind`` (a readable JSON naming that kind)."""
    try:
        record = json.loads(marker_path(folder, kind).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("kind") == kind


def is_marker_leftover(path: str | Path, kind: str) -> bool:
    """Whether ``path`` is the temporary file of a ``kind`` marker whose writer was killed (:func:`atomic_path`)."""
    name = marker_path(".", kind).name
    return re.fullmatch(rf"\.{re.escape(name)}\.[A-Za-z0-9_]+\.tmp", Path(path).name) is not None


def claim_output_dir(folder: str | Path, kind: str, *, tool: str, adopt: bool = False) -> Path:
    """Make ``folder`` a ``kind`` output folder of ``tool``, or refuse without touching it.

    A folder may be written into only if it is new, empty, or already marked
    as a ``kind`` folder (:func:`owns_folder`); ``adopt=True`` lets the caller
    accept a folder it has recognised as its own by other means (a run folder
    of an earlier version holding a valid checkpoint). The folder is created
    and marked; anything else (a file, a link, a folder of the user's files,
    another kind's folder) raises :class:`OutputDirError` naming the folder
    and the files in the way.
    """
    folder = Path(folder)
    if folder.is_symlink():
        raise OutputDirError(f"{folder} is a symbolic link, not a folder {tool} made; choose another folder")
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"{folder} exists and is not a folder; choose another folder for {tool}'s output")
    if folder.is_dir():
        for leftover in [p for p in folder.iterdir() if is_marker_leftover(p, kind) and p.is_file()]:
            leftover.unlink()  # our own marker's temporary file, left by a kill while claiming
    if folder.is_dir() and not owns_folder(folder, kind) and not adopt:
        entries = sorted(p.name for p in folder.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise OutputDirError(
                f"{folder} holds files {tool} did not write ({shown}); it writes only into a new or empty "
                f"folder or one it made (marked by {marker_path(folder, kind).name}): choose another folder "
                "(nothing was changed)"
            )
    folder.mkdir(parents=True, exist_ok=True)
    if not owns_folder(folder, kind):
        write_json_atomic(marker_path(folder, kind), {"kind": kind, "tool": tool})
    return folder
