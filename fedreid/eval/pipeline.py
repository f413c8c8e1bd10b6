"""The evaluation run of ``tools/eval_reid.py evaluate``: dataset features -> metrics, ``results.json``, pictures.

:func:`evaluate_and_report` evaluates each dataset's features
(:func:`fedreid.eval.protocols.evaluate_dataset`), then writes
``results.json``, ``cmc.png`` and ranked-list pictures
(:func:`fedreid.eval.query_picking.draw_dataset_pictures`);
:func:`claim_eval_dir` claims its output folder. The features come from
:mod:`fedreid.inference.dataset_features` (a model over a prepared dataset,
or a feature cache); the tool's other steps (model files, devices, image
folders, gallery stores) live in :mod:`fedreid.inference` and the gallery
modules, and the tool imports them from there.

Importing this module imports no torch, so ``tools/eval_reid.py`` indexes,
queries and serves with an ONNX file (``--backend onnx``) where PyTorch is
not installed. How the pieces fit: ``docs/evaluation.md``; what the tool
guarantees about the files it reads and writes: ``docs/retrieval-safety.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from fedreid.eval.protocols import _check_protocol, evaluate_dataset, summary_row
from fedreid.eval.query_picking import chosen_queries, draw_dataset_pictures
from fedreid.inference.dataset_features import DatasetFeatures
from fedreid.inference.errors import EvalInputError

__all__ = ["claim_eval_dir", "evaluate_and_report", "plot_cmc_curves"]


def plot_cmc_curves(results: Mapping[str, Mapping[str, Any]], out_path: str | Path, title: str = "CMC") -> Path:
    from fedreid.eval.metrics import cmc_curve
    from fedreid.eval.visualize import plot_cmc

    return plot_cmc({name: cmc_curve(r) for name, r in results.items()}, out_path, title=title)


# --------------------------------------------------------------------------
# The whole evaluation report
# --------------------------------------------------------------------------


def evaluate_and_report(
    feature_sets: Iterable[DatasetFeatures],
    out_dir: str | Path,
    *,
    ap: str = "standard",
    rerank: bool = False,
    pictures: int = 3,
    queries: Sequence[str] = (),
    protocol: str = "standard",
    seed: int = 0,
    source: Optional[str] = None,
) -> dict[str, Any]:
    """Evaluate each dataset, then write ``results.json``, ``cmc.png`` and ranked-list PNGs to ``out_dir``.

    ``pictures``: best/worst queries by AP per dataset (:func:`~fedreid.eval.query_picking.picked_queries`);
    ``queries``: specs of :func:`chosen_queries` drawn as well (an index
    applies to every dataset, a path or file name to the datasets holding it;
    one no dataset holds is an error, raised before anything is evaluated).
    ``protocol``/``seed``: see :func:`evaluate_dataset`.

    Returns what ``results.json`` holds: ``datasets`` ({name: rank1, rank5,
    rank10, mAP, cmc, counts}), ``mean`` (of rank1/5/10/mAP), ``ap``,
    ``protocol``, ``rerank``, ``source``, ``precision`` ({name: the
    arithmetic of its features, from their ``meta``; None when they do not
    say}), ``pictures`` and ``cmc_plot`` (paths).
    """
    from fedreid.utils.io import write_json_atomic

    feature_sets = list(feature_sets)
    if not feature_sets:
        raise EvalInputError("nothing to evaluate: no datasets given")
    proto = _check_protocol(protocol, ap, rerank)
    chosen = {f.name: chosen_queries(f, queries, missing_ok=True) for f in feature_sets}
    for spec in queries:
        if not (spec.isascii() and spec.isdigit()) and not any(
            chosen_queries(f, [spec], missing_ok=True) for f in feature_sets
        ):
            names = ", ".join(repr(f.name) for f in feature_sets)
            raise EvalInputError(
                f"--queries {spec}: not a query index or an image of the query set of {names} "
                "(give an index, a query image path, or its file name)"
            )
    out_dir = Path(out_dir)
    results, rows, drawn = {}, {}, []
    for feats in feature_sets:
        result, reranked = evaluate_dataset(feats, ap=ap, rerank=rerank, protocol=protocol, seed=seed)
        results[feats.name], rows[feats.name] = result, summary_row(result)
        drawn += draw_dataset_pictures(
            feats, result, out_dir / "ranked_lists", pictures, queries=chosen[feats.name], reranked=reranked
        )
        del reranked  # a Q x G matrix: do not keep one per dataset
    title = "CMC (re-ranked)" if rerank else proto.title
    cmc_path = plot_cmc_curves(results, out_dir / "cmc.png", title=title)
    report = {
        "source": source,
        "ap": ap,
        "protocol": protocol,
        "rerank": rerank,
        "precision": {f.name: f.meta.get("precision") for f in feature_sets},
        "datasets": rows,
        "mean": {m: float(np.mean([r[m] for r in rows.values()])) for m in ("rank1", "rank5", "rank10", "mAP")},
        "pictures": [str(p) for p in drawn],
        "cmc_plot": str(cmc_path),
    }
    report.update(proto.report_fields(seed))
    write_json_atomic(out_dir / "results.json", report)
    return report


# --------------------------------------------------------------------------
# Output folders of evaluate
# --------------------------------------------------------------------------

_EVAL_RESULT_KEYS = ("datasets", "mean", "ap")


def _is_earlier_eval_folder(folder: Path) -> bool:
    """An unmarked folder holding only what :func:`evaluate_and_report` writes (an earlier version's)."""
    try:
        entries = {p.name: p for p in folder.iterdir()}
        results = json.loads((folder / "results.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(results, dict) or not all(key in results for key in _EVAL_RESULT_KEYS):
        return False
    if not set(entries) <= {"results.json", "cmc.png", "ranked_lists"}:
        return False
    pictures = entries.get("ranked_lists")
    if pictures is None:
        return True
    return pictures.is_dir() and not pictures.is_symlink() and all(
        p.is_file() and p.suffix == ".png" for p in pictures.iterdir()
    )


def claim_eval_dir(folder: str | Path) -> Path:
    """Make ``folder`` an evaluation output folder (kind ``eval``), or refuse without touching it.

    New, empty and marked folders are taken, and an unmarked one that holds
    only an earlier evaluation's ``results.json``, ``cmc.png`` and
    ``ranked_lists/*.png``; a folder of anyone else's files raises
    :class:`~fedreid.utils.io.OutputDirError`.
    """
    from fedreid.utils.io import claim_output_dir

    folder = Path(folder)
    adopt = folder.is_dir() and not folder.is_symlink() and _is_earlier_eval_folder(folder)
    return claim_output_dir(folder, "eval", tool="tools/eval_reid.py evaluate --out", adopt=adopt)
