"""Which queries get a ranked-list picture, their ranked lists, and the pictures.

Queries are picked by AP (:func:`picked_queries`: the best and the worst) or
named by the user (:func:`chosen_queries`: an index, a path or a file name).
Their rows of scores are computed again from their own query blocks
(:func:`query_scores`), never a query x gallery matrix, filtered like the
metrics (:func:`ranked_lists`) and drawn
by :mod:`fedreid.eval.visualize` (:func:`draw_ranked_lists`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from fedreid.eval.ranking import prepare_features, score_rows
from fedreid.inference.dataset_features import DatasetFeatures
from fedreid.inference.errors import EvalInputError

__all__ = [
    "picked_queries",
    "chosen_queries",
    "query_scores",
    "RankedList",
    "ranked_lists",
    "draw_ranked_lists",
]


def picked_queries(result: Mapping[str, Any], n: int) -> list[tuple[int, str]]:
    """``n`` queries to draw: the best half (rounded up) and the worst half by AP, among queries with a match.

    Reads the per-query AP and ``valid`` mask that
    :func:`~fedreid.eval.metrics.evaluate` computed in its block pass.
    Ties go to the lower query index. Returns ``[(query index, "best"|"worst"), ...]``.
    """
    per_query = result["per_query"]
    valid = np.flatnonzero(per_query["valid"])
    if n <= 0 or valid.size == 0:
        return []
    ap = per_query["ap"][valid]
    n_best = min((n + 1) // 2, valid.size)
    best = valid[np.argsort(-ap, kind="stable")[:n_best]]
    # Worst: ascending AP, the lower index first among ties, never a query already drawn as best.
    rest = np.setdiff1d(valid, best, assume_unique=True)  # sorted, so the stable sort keeps the index rule
    worst = rest[np.argsort(per_query["ap"][rest], kind="stable")[: max(0, n - n_best)]]
    return [(int(i), "best") for i in best] + [(int(i), "worst") for i in worst]


def chosen_queries(feats: DatasetFeatures, specs: Sequence[str], *, missing_ok: bool = False) -> list[int]:
    """Query indices of ``feats`` named by ``specs``, in order, without repeats.

    A spec is a query index (``"12"``: the 13th query of the manifest, the
    order of the feature file) or an image of the query set: its path (as
    stored, or the same file through another relative/absolute spelling), its
    path inside the prepared dataset (``images/query/000206_11_c0.jpg``, as
    the manifest lists it: any trailing run of the stored path's folders) or
    its file name. An index beyond the query set, or a file name shared by
    several query images, is an :class:`EvalInputError`; a path or name the
    query set does not hold is one too unless ``missing_ok`` (the tool checks
    every dataset before it complains).
    """
    q = feats.query
    n = q.features.shape[0]
    paths = [str(p) for p in q.paths]
    absolute = names = None
    picked: list[int] = []
    for spec in specs:
        if spec.isascii() and spec.isdigit():
            if int(spec) >= n:
                raise EvalInputError(
                    f"--queries {spec}: dataset {feats.name!r} has {n} queries (indices 0-{n - 1})"
                )
            found = [int(spec)]
        else:
            if absolute is None:  # built once, only when some spec is a path or name
                absolute = {os.path.abspath(p): i for i, p in enumerate(paths)}
                names = {}
                for i, p in enumerate(paths):
                    names.setdefault(Path(p).name, []).append(i)
            hit = absolute.get(os.path.abspath(spec))
            found = [hit] if hit is not None else names.get(spec, [])
            tail = Path(spec).parts
            if hit is None and len(tail) > 1:  # the path inside the dataset (the manifest's), or another tail
                found = [i for i, p in enumerate(paths) if Path(p).parts[-len(tail):] == tail]
            if len(found) > 1:
                listing = ", ".join(paths[i] for i in found[:3])
                raise EvalInputError(
                    f"--queries {spec}: {len(found)} query images of dataset {feats.name!r} have that file name "
                    f"({listing}{', ...' if len(found) > 3 else ''}): give the path"
                )
            if not found and not missing_ok:
                raise EvalInputError(
                    f"--queries {spec}: not a query index or an image of dataset {feats.name!r}'s query set"
                )
        picked += [i for i in found if i not in picked]
    return picked


def query_scores(
    feats: DatasetFeatures,
    queries: Sequence[int],
    reranked: Optional[np.ndarray] = None,
    block_size: Optional[int] = None,
) -> np.ndarray:
    """Similarity rows ``[len(queries), G]`` (float32) of the given queries only.

    The inner products the metrics rank by, or rows of ``reranked``
    (:func:`~fedreid.eval.protocols.evaluate_dataset`'s). ``block_size``: the
    metrics' query rows per block (their result's ``block_size``); each row
    is then taken from its block, computed again by the metrics' own call
    (:func:`~fedreid.eval.ranking.score_rows`), so it holds the very bits
    they ranked: a row computed alone can differ in the last bits and order
    near-ties otherwise. Drawing a few ranked lists thus costs a few blocks,
    not a query x gallery matrix. Without ``block_size`` the rows are
    computed alone.
    """
    idx = np.asarray(queries, dtype=np.int64).reshape(-1)
    if reranked is not None:
        return np.asarray(reranked[idx], dtype=np.float32)
    if block_size is None:
        return feats.query.features[idx] @ feats.gallery.features.T
    qf, gf = prepare_features(feats.query.features, feats.gallery.features)
    rows = np.empty((idx.size, gf.shape[0]), dtype=np.float32)
    for start in np.unique(idx - idx % block_size):
        stop = min(int(start) + block_size, qf.shape[0])
        for _, block in score_rows(qf[start:stop], gf, block_size):  # one block: the metrics' call
            inside = (idx >= start) & (idx < stop)
            rows[inside] = block[idx[inside] - start]
    return rows


@dataclass
class RankedList:
    """One query's top-k after the metrics filter: what a picture shows."""

    query: int
    tag: str  # "best", "worst" (by AP) or "query" (chosen with --queries)
    gallery: np.ndarray  # gallery indices, best first
    correct: np.ndarray  # bool per entry
    scores: np.ndarray  # similarity per entry


def ranked_lists(
    feats: DatasetFeatures,
    result: Mapping[str, Any],
    *,
    pictures: int = 3,
    queries: Sequence[int] = (),
    reranked: Optional[np.ndarray] = None,
    top_k: int = 10,
) -> list[RankedList]:
    """The ranked lists of :func:`picked_queries` (``pictures`` of them) and of the chosen ``queries``.

    Each list is the query's top-``top_k`` after the metrics filter
    (:func:`fedreid.eval.visualize.filtered_top_k`: junk and
    same-identity-same-camera removed, ties to the lower gallery index).
    """
    from fedreid.eval.visualize import filtered_top_k

    picks = picked_queries(result, pictures) + [(int(i), "query") for i in queries]
    if not picks:
        return []
    q, g = feats.query, feats.gallery
    rows = query_scores(feats, [i for i, _ in picks], reranked, result.get("block_size"))
    out = []
    for (i, tag), row in zip(picks, rows):
        top, correct = filtered_top_k(row, int(q.pids[i]), int(q.camids[i]), g.pids, g.camids, k=top_k)
        out.append(RankedList(i, tag, top, correct, row[top]))
    return out


def draw_ranked_lists(
    feats: DatasetFeatures, lists: Sequence[RankedList], out_dir: str | Path, *, top_k: int = 10
) -> list[Path]:
    """PNGs (green: true match, red: wrong) of ``lists`` (:func:`ranked_lists` of ``feats``) in ``out_dir``.

    Named ``<dataset>_{best,worst}_q<index>.png`` and, for chosen queries,
    ``<dataset>_query_q<index>.png``.
    """
    from fedreid.eval.visualize import draw_ranked_list

    q, g = feats.query, feats.gallery
    return [
        draw_ranked_list(q.paths[r.query], [g.paths[j] for j in r.gallery], list(r.correct), r.scores,
                         Path(out_dir) / f"{feats.name}_{r.tag}_q{r.query:05d}.png", top_k=top_k)
        for r in lists
    ]
