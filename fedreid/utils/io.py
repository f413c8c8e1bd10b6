"""Atomic writes: a reader sees the old file or the new one, never half of one.

Files go through :func:`atomic_path`; whole folders through
:func:`replace_dir_atomically` (staged in a hidden sibling named by
:func:`swap_sibling`, renamed in; :func:`swap_leftovers` finds what a kill left).
Output folders are claimed with :func:`claim_output_dir`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from fedreid.errors import FedReIDError


def shown_path(path: str | Path) -> str:
    """``path`` as the user wrote it, with its absolute form when it is relative to the working directory."""
    p = Path(path)
    if p.is_absolute():
        return str(p)
    return f"{p} (relative to the working directory {os.getcwd()}: {p.resolve()})"


def file_in_the_way(folder: str | Path) -> Optional[Path]:
    """The existing file that ``folder`` is, or lies under, so that it cannot be a folder; None when it can."""
    folder = Path(folder)
    for parent in (folder, *folder.parents):
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


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


#: The name :func:`atomic_path` gives its temporary file: ``.<name>.<mkstemp's 8 characters>.tmp``.
_ATOMIC_TEMP = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def atomic_write_leftovers(folder: str | Path) -> list[Path]:
    """The temporary files :func:`atomic_path` writes in ``folder`` (not its subfolders) that a kill left, sorted.

    Only for a folder no other process writes into at the same time: a
    live writer's temporary file looks the same. Subfolders are left alone
    (another tool may be writing there, e.g. an evaluation of a run folder).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if _ATOMIC_TEMP.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def swap_sibling(folder: str | Path, kind: str) -> Path:
    """A new hidden sibling of ``folder``: ``.<name>.<kind>-<8 hex digits>`` (``kind``: ``tmp`` or ``old``).

    ``tmp``: where the new folder is staged; ``old``: where
    :func:`replace_dir_atomically` moves the previous folder aside. The path
    is ``folder``'s as given (``with_name``); pass an absolute path when
    ``folder`` may be ``.`` or end in ``..``.
    """
    folder = Path(folder)
    return folder.with_name(f".{folder.name}.{kind}-{uuid.uuid4().hex[:8]}")


def swap_leftovers(parent: str | Path, name: str) -> list[Path]:
    """The entries of ``parent`` named like :func:`swap_sibling`'s siblings of ``name``, sorted.

    Exactly ``.<name>.tmp-<8 hex>`` and ``.<name>.old-<8 hex>``; what kind of
    entry each is (a folder, a link, a file) is for the caller to check.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-[0-9a-f]{{8}}")
    return [p for p in sorted(parent.iterdir()) if pattern.fullmatch(p.name)]


def replace_dir_atomically(staging: str | Path, target: str | Path, *, aside: Optional[str | Path] = None) -> None:
    """Put the complete folder ``staging`` in place of ``target``; the previous ``target`` is deleted only after.

    ``staging`` is a fully written sibling of ``target`` (same file system,
    normally ``swap_sibling(target, "tmp")``). ``target`` is absent, an empty
    folder (removed, then ``staging`` renamed in), or a folder (not a link)
    that the caller has just checked it may replace: it is renamed to
    ``aside`` (default ``swap_sibling(target, "old")``), ``staging`` renamed to
    ``target``, then ``aside`` deleted. Every step is one ``os.replace`` or a
    deletion; nothing is copied.

    Crash guarantees, for a kill of the process at any instant (file-system
    durability after a power loss, i.e. fsync, is not addressed):

    * ``target`` never holds a mix: it is the previous folder, the new one,
      or absent (only between the two renames, or between removing an empty
      ``target`` and renaming ``staging`` in);
    * killed before the first rename: ``target`` is untouched (or, if it was
      an empty folder, may be gone) and ``staging`` is left whole as a hidden
      sibling;
    * killed between the two renames: the previous folder is whole at
      ``aside``, the new one whole at ``staging``;
    * killed after the second rename: ``target`` is the new folder and
      ``aside`` may remain, partly deleted.

    The siblings a kill leaves are named as :func:`swap_leftovers` finds
    them; the caller's next run decides what to do with them (move a whole
    ``.old-*`` back when ``target`` is absent, delete the rest, or delete
    all). An exception (not a kill) leaves the same states and propagates;
    ``staging`` is the caller's to delete.
    """
    staging, target = Path(staging), Path(target)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if target.exists():
        old = Path(aside) if aside is not None else swap_sibling(target, "old")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)


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
    check_output_dir(folder, kind, tool=tool, adopt=adopt)
    if folder.is_dir():
        for leftover in [p for p in folder.iterdir() if is_marker_leftover(p, kind) and p.is_file()]:
            leftover.unlink()  # our own marker's temporary file, left by a kill while claiming
    folder.mkdir(parents=True, exist_ok=True)
    if not owns_folder(folder, kind):
        write_json_atomic(marker_path(folder, kind), {"kind": kind, "tool": tool})
    return folder


def check_output_dir(folder: str | Path, kind: str, *, tool: str, adopt: bool = False) -> None:
    """Raise :class:`OutputDirError` where :func:`claim_output_dir` would refuse ``folder``; change nothing.

    Lets a tool refuse a folder before long work whose result it will claim it for.
    """
    folder = Path(folder)
    if folder.is_symlink():
        raise OutputDirError(f"{folder} is a symbolic link, not a folder {tool} made; choose another folder")
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"{folder} exists and is not a folder; choose another folder for {tool}'s output")
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise OutputDirError(f"{folder} cannot be made: {blocking} is a file, not a folder; choose another folder "
                             f"for {tool}'s output")
    if folder.is_dir() and not owns_folder(folder, kind) and not adopt:
        entries = sorted(p.name for p in folder.iterdir() if not (is_marker_leftover(p, kind) and p.is_file()))
        if entries:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise OutputDirError(
                f"{folder} holds files {tool} did not write ({shown}); it writes only into a new or empty "
                f"folder or one it made (marked by {marker_path(folder, kind).name}): choose another folder "
                "(nothing was changed)"
            )
