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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from fedreid.errors import FedReIDError
from fedreid.utils.io import atomic_path

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = "fedreid.fl.checkpoint"
CHECKPOINT_VERSION = 1


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


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a checkpoint written by :func:`save_checkpoint`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable is unreadable
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a fedreid federated-training checkpoint")
    if data.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {data.get('version')} is not supported "
            f"(this fedreid reads version {CHECKPOINT_VERSION})"
        )
    return data


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[Path]:
    """The run's checkpoint if one exists (the last complete round), else None."""
    path = checkpoint_path(run_dir)
    return path if path.is_file() else None
