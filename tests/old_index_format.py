"""Writes an index folder of the earlier format (``fedreid-faiss-index`` version 2), which fedreid no longer reads.

Tests use it to check that such a folder is recognised (``index`` may replace
it with a gallery store) and refused everywhere else with a line saying how to
rebuild it. The layout is the one ``save_index`` of the former ``fedreid.eval.retrieval``
wrote: ``index.faiss`` (a flat inner-product index), ``meta.npz`` (ids,
cameras, paths) and ``header.json`` (format, version, metric, ntotal, dim, the
size and SHA-256 of both files, the caller's meta).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import faiss
import numpy as np


def _record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def save_index(folder: str | Path, index: Any, *, ids: Sequence[int], cameras: Sequence[int], paths: Sequence[str],
               meta: dict | None = None) -> Path:
    """``index`` (an ``IndexFlatIP``) and its gallery's ids, cameras and paths as an earlier-format folder."""
    folder = Path(folder)
    ids, cameras = np.asarray(ids, dtype=np.int64), np.asarray(cameras, dtype=np.int64)
    paths = np.asarray([str(p) for p in paths], dtype=str)
    lengths = {index.ntotal, ids.size, cameras.size, paths.size}
    if len(lengths) > 1:
        raise ValueError(f"mismatched lengths {sorted(lengths)}")
    folder.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(folder / "index.faiss"))
    with open(folder / "meta.npz", "wb") as f:
        np.savez(f, ids=ids, cameras=cameras, paths=paths)
    header = {
        "format": "fedreid-faiss-index", "version": 2, "metric": "inner_product",
        "ntotal": int(index.ntotal), "dim": int(index.d),
        "files": {name: _record(folder / name) for name in ("index.faiss", "meta.npz")}, "meta": meta or {},
    }
    (folder / "header.json").write_text(json.dumps(header))
    return folder
