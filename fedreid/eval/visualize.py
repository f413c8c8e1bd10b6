"""Pictures of retrieval results: a query's ranked list, and CMC curves.

``draw_ranked_list`` lays tiles out in one row (``size`` is (height, width)
of each image; all lengths in pixels)::

    GAP | query tile | 2*GAP | tile 1 | GAP | tile 2 | GAP | ... | tile k | GAP

A tile is the resized image inside a ``BORDER``-wide frame (grey for the
query, green for a true match, red for a wrong one, light grey where the
identities are unknown) with a ``CAPTION``-high
strip of text under it (the score). :func:`tile_box` gives each frame's
pixel box and :func:`canvas_shape` the picture's shape.

The gallery shown must already be filtered like the metrics filter it:
:func:`filtered_top_k` does that with :func:`fedreid.eval.metrics.gallery_masks`
and the metrics tie rule, so the picture shows exactly the ranking the
numbers were computed on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import cv2
import numpy as np
from matplotlib.ticker import MaxNLocator

from fedreid.eval.ranking import EvalDataError, gallery_masks, ranking_order
from fedreid.utils.io import atomic_path
from fedreid.utils.plotting import agg_figure

__all__ = [
    "BORDER",
    "CAPTION",
    "CORRECT_BGR",
    "GAP",
    "QUERY_BGR",
    "UNKNOWN_BGR",
    "WRONG_BGR",
    "canvas_shape",
    "draw_ranked_list",
    "filtered_top_k",
    "plot_cmc",
    "tile_box",
]

BORDER, GAP, CAPTION = 4, 6, 16
CORRECT_BGR, WRONG_BGR, QUERY_BGR = (0, 255, 0), (0, 0, 255), (128, 128, 128)
UNKNOWN_BGR = (200, 200, 200)
BACKGROUND_BGR, TEXT_BGR = (255, 255, 255), (0, 0, 0)


def filtered_top_k(
    scores: np.ndarray,
    q_pid: int,
    q_camid: int,
    g_pids: np.ndarray,
    g_camids: np.ndarray,
    k: int = 10,
) -> tuple[np.ndarray, np.ndarray]:
    """``(gallery indices, correct flags)`` of a query's top-``k`` after the metrics filter.

    ``scores`` is the query's similarity to every gallery item (higher is
    better). Junk and same-identity-same-camera items are dropped
    (:func:`~fedreid.eval.metrics.gallery_masks`) and ties go to the lower
    gallery index (:func:`~fedreid.eval.metrics.ranking_order`).
    """
    scores, g_pids, g_camids = np.asarray(scores), np.asarray(g_pids), np.asarray(g_camids)
    if not scores.shape == g_pids.shape == g_camids.shape:
        raise EvalDataError(
            f"mismatched lengths (scores: {scores.size}, g_pids: {g_pids.size}, g_camids: {g_camids.size})"
        )
    keep, good = gallery_masks(q_pid, q_camid, g_pids, g_camids)
    kept = np.flatnonzero(keep)  # ascending, so the stable sort keeps the index rule
    top = kept[ranking_order(scores[kept])][:k]
    return top, good[top]


def tile_box(position: int, size: tuple[int, int] = (128, 64)) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)`` (exclusive ends) of the framed tile at ``position`` (0 = query)."""
    height, width = size
    tile_w = width + 2 * BORDER
    x0 = GAP if position == 0 else GAP + tile_w + 2 * GAP + (position - 1) * (tile_w + GAP)
    return x0, GAP, x0 + tile_w, GAP + height + 2 * BORDER


def canvas_shape(n_gallery: int, size: tuple[int, int] = (128, 64)) -> tuple[int, int, int]:
    """``(height, width, 3)`` of a ranked-list picture with ``n_gallery`` gallery tiles."""
    x1, y1 = tile_box(n_gallery, size)[2:]  # the last tile (the query's when there is none)
    return y1 + CAPTION + GAP, x1 + GAP, 3


def _read_image(path: str | Path, size: tuple[int, int]) -> np.ndarray:
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise FileNotFoundError(f"cannot read image {path}")
    height, width = size
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)


def _draw_tile(canvas: np.ndarray, position: int, image: np.ndarray, colour, caption: str) -> None:
    x0, y0, x1, y1 = tile_box(position, image.shape[:2])
    canvas[y0:y1, x0:x1] = colour
    canvas[y0 + BORDER : y1 - BORDER, x0 + BORDER : x1 - BORDER] = image
    baseline = (x0, y1 + CAPTION - 4)
    cv2.putText(canvas, caption, baseline, cv2.FONT_HERSHEY_SIMPLEX, 0.35, TEXT_BGR, 1, cv2.LINE_AA)


def _write_png(out_path: str | Path, image: np.ndarray) -> Path:
    ok, encoded = cv2.imencode(".png", image)
    if not ok:
        raise EvalDataError(f"could not encode a PNG for {out_path}")
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        tmp.write_bytes(encoded.tobytes())
    return out_path


def draw_ranked_list(
    query_path: str | Path,
    gallery_paths: Sequence[str | Path],
    correct_flags: Sequence[bool | None],
    scores: Sequence[float],
    out_path: str | Path,
    *,
    size: tuple[int, int] = (128, 64),
    top_k: int = 10,
) -> Path:
    """Save a PNG of the query and its first ``top_k`` gallery images, best first.

    ``gallery_paths``/``correct_flags``/``scores`` are the ranked, already
    filtered list (see :func:`filtered_top_k`); ``size`` is (height, width)
    per image. Green frames mark true matches, red ones wrong results, light
    grey ones results whose correctness is unknown (flag ``None``: an image
    without an identity in its name); the score is printed under each. Written atomically; returns ``out_path``.
    """
    lengths = {"gallery_paths": len(gallery_paths), "correct_flags": len(correct_flags)}
    lengths["scores"] = len(scores)
    if len(set(lengths.values())) > 1:
        raise EvalDataError("mismatched lengths (" + ", ".join(f"{k}: {v}" for k, v in lengths.items()) + ")")
    if top_k < 1:
        raise EvalDataError(f"top_k must be >= 1, got {top_k}")
    n = min(top_k, len(gallery_paths))
    canvas = np.empty(canvas_shape(n, size), dtype=np.uint8)
    canvas[:] = BACKGROUND_BGR
    _draw_tile(canvas, 0, _read_image(query_path, size), QUERY_BGR, "query")
    for i in range(n):
        flag = correct_flags[i]
        colour = UNKNOWN_BGR if flag is None else CORRECT_BGR if flag else WRONG_BGR
        _draw_tile(canvas, i + 1, _read_image(gallery_paths[i], size), colour, f"{float(scores[i]):.3f}")
    return _write_png(out_path, canvas)


def plot_cmc(
    curves: Mapping[str, Sequence[float] | np.ndarray],
    out_path: str | Path,
    *,
    title: str = "CMC",
    figsize: tuple[float, float] = (5.0, 4.0),
    dpi: int = 100,
) -> Path:
    """Save a PNG of CMC curves: ``{label: [rank-1, rank-2, ...]}`` as fractions in [0, 1].

    Uses a bare matplotlib ``Figure`` with the Agg canvas, so no pyplot
    state or backend switch is involved. Written atomically; returns ``out_path``.
    """
    if not curves:
        raise EvalDataError("plot_cmc needs at least one curve")
    figure, axes = agg_figure(figsize=figsize, dpi=dpi)
    for label, values in curves.items():
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size == 0 or np.any((values < 0) | (values > 1)):
            raise EvalDataError(f"curve {label!r} must be non-empty fractions in [0, 1]")
        marker = "." if values.size <= 20 else None
        axes.plot(np.arange(1, values.size + 1), 100 * values, marker=marker, label=label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # ranks are whole numbers
    axes.set_xlabel("rank")
    axes.set_ylabel("matching rate (%)")
    axes.set_ylim(0, 100)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")
    out_path = Path(out_path)
    with atomic_path(out_path) as tmp:
        figure.savefig(tmp, format="png", dpi=dpi)
    return out_path
