"""Atomic, full-state checkpoints of a federated run.

One file, ``<run_dir>/checkpoint.pt``, rewritten after every round: the
payload is written with ``torch.save`` to a temporary file in the same folder
and moved over the old one with ``os.replace``, so a run killed at any moment
leaves either the previous complete checkpoint or the new one.

Format (a dict; tensors on CPU; loadable with ``weights_only=True``)::

    format      "fedreid.fl.checkpoint"
    version     1
    round       rounds completed (the run resumes with round index ``round``)
    config      the run's config as plain dicts (fedreid.config.to_dict)
    server      Server.state_dict(): round, global_state (shared tensors),
                local_states (mode=local: each client's shared tensors),
                sampler (numpy bit-generator state), total_bytes, client_names
    clients     {name: Client.state_dict()}: head, bn_state (bn=local), rounds_trained
    history     the per-round records so far (metrics.jsonl is rebuilt from it)
    rng         {"torch": torch CPU RNG state} (informational: every random
                draw of a round is seeded from (seed, round, client), see
                fedreid.utils.seeding, so no other generator state is needed)
    data        fingerprints of the data the run trains and evaluates on
                (fedreid.fl.simulation.data_fingerprints); absent in
                checkpoints of older versions
    environment what the numbers depend on besides the config
                (fedreid.fl.simulation.run_environment): torch_threads,
                torch version, Python, machine, the training device and
                precision; absent (or without the last two) in older checkpoints

Every file is read with ``torch.load(weights_only=True)`` (:func:`load_torch_file`):
tensors and plain values only, so a file planted in a run folder cannot run
code when it is loaded.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from fedreid.errors import FedReIDError
from fedreid.utils.io import atomic_path

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = "fedreid.fl.checkpoint"
CHECKPOINT_VERSION = 1
#: Entries every checkpoint has (the others were added later or are informational).
REQUIRED_KEYS = ("round", "config", "server", "clients", "history")


class CheckpointError(FedReIDError, ValueError):
    """A checkpoint is missing, unreadable or of another format."""


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_NAME


def save_checkpoint(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (plus format/version) atomically to ``path``."""
    path = Path(path)
    data = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **payload}
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            torch.save(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
    return path


#: torch's words for a pickled global that weights_only refuses (two wordings across torch versions).
_UNSAFE_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unreadable_reason(path: Path, exc: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed with ``exc``, in one short line."""
    try:
        if path.stat().st_size == 0:
            return "the file is empty (0 bytes)"
    except OSError:
        pass
    text = _ANSI.sub("", str(exc))
    unsafe = _UNSAFE_GLOBAL.search(text)
    if unsafe:
        return (f"it holds a pickled object ({unsafe.group(1).rstrip('.')}) besides tensors and plain values: "
                "refused, since loading it could run code (replace it with a trusted file)")
    if isinstance(exc, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile)) or "zip archive" in text:
        return "not a complete file written by torch.save (truncated, or not a PyTorch file)"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load_torch_file(path: str | os.PathLike, *, what: str, error: type[Exception]) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU; any failure is ``error`` in one line.

    Only tensors and plain values (dicts, lists, numbers, strings) are
    rebuilt: a pickle that would create other objects or call functions is
    refused before anything of it runs. The error names ``what`` and the
    file and says why (empty, truncated or foreign, holding code objects),
    without torch's multi-line advice to load the file unsafely.
    """
    path = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickle protocols on stderr
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as exc:  # noqa: BLE001 - every reader failure is the file's fault
        raise error(f"cannot read {what} {path}: {unreadable_reason(path, exc)}") from exc


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint` (see :func:`load_torch_file`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    data = load_torch_file(path, what="checkpoint", error=CheckpointError)
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a fedreid federated-training checkpoint")
    if data.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {data.get('version')} is not supported "
            f"(this fedreid reads version {CHECKPOINT_VERSION})"
        )
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, it lacks {', '.join(missing)}")
    return data


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[Path]:
    """The run's checkpoint if one exists (the last complete round), else None."""
    path = checkpoint_path(run_dir)
    return path if path.is_file() else None
