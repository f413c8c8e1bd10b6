"""A run folder's ``log.txt``: everything the run printed, under a header saying what ran it.

:class:`OutputLog` copies what is written to ``sys.stdout`` and ``sys.stderr``
into a file, appended to (a resumed run adds to its log), each start under a
header: the date, fedreid's version and git commit, torch and CUDA versions,
the device and the command line (:func:`log_header`). Progress-bar redraws
(text carrying a carriage return) stay on the terminal only.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Optional, Sequence

#: The log's name inside a run folder.
LOG_FILE = "log.txt"


def git_commit(folder: Optional[Path] = None) -> str:
    """The commit of the checkout fedreid runs from (``+dirty`` with local changes), or 'not a git checkout'."""
    folder = folder or Path(__file__).resolve().parents[2]
    if not (folder / ".git").exists():
        return "not a git checkout"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (git failed)"
    return commit + ("+dirty" if dirty else "")


def log_header(argv: Sequence[str] | None = None, device: str = "") -> str:
    """The lines that open a log: date, versions, commit, device, command line."""
    import torch

    from fedreid import __version__

    cuda = torch.version.cuda or "none"
    lines = [
        f"== {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
        f"fedreid {__version__} (git {git_commit()}), torch {torch.__version__}, CUDA {cuda}, "
        f"python {platform.python_version()}, {platform.system()} {platform.machine()}"
        + (f", device {device}" if device else ""),
        f"command: {shlex.join(list(sys.argv if argv is None else argv))}",
        f"working directory: {os.getcwd()}",
    ]
    return "\n".join(lines) + "\n"


class _Tee:
    """A text stream that writes to ``stream`` and (without progress-bar redraws) to ``copy``."""

    def __init__(self, stream: IO[str], copy: IO[str]) -> None:
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        if "\r" not in text:
            self._copy.write(text)
            self._copy.flush()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the real stream's
        return getattr(self._stream, name)


class OutputLog:
    """Copy stdout and stderr into ``path`` from :meth:`start` to :meth:`stop` (idempotent; also a context)."""

    def __init__(self) -> None:
        self._file: Optional[IO[str]] = None
        self._saved: Optional[tuple[Any, Any]] = None

    def start(self, path: str | Path, header: str) -> None:
        if self._file is not None:
            return
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self._file.write(header)
        self._file.flush()
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)

    def stop(self) -> None:
        if self._file is None:
            return
        assert self._saved is not None
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self._saved
        self._file.close()
        self._file, self._saved = None, None

    def __enter__(self) -> "OutputLog":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        # The error that ends a run is printed by the tool after this block (fedreid.utils.cli.run_main),
        # when the log is closed: it goes into the log here, as the tool will print it.
        if self._file is not None and exc is not None and not isinstance(exc, SystemExit):
            self._file.write(_ending(exc, tb))
        self.stop()


def _ending(exc: BaseException, tb: Any) -> str:
    """How the tool reports ``exc``: one line for an input error or an interrupt, else the traceback."""
    import traceback

    from fedreid.errors import FedReIDError

    if isinstance(exc, KeyboardInterrupt):
        return "interrupted\n"
    if isinstance(exc, (FedReIDError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return f"error: {exc}\n"
    return "".join(traceback.format_exception(type(exc), exc, tb))


__all__ = ["LOG_FILE", "OutputLog", "git_commit", "log_header"]
