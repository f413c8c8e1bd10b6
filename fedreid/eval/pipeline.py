"""The evaluation run of ``tools/eval_reid.py evaluate``: dataset features -> metrics, ``results.json``, pictures.

:func:`evaluate_and_report` evaluates every dataset's features
(:func:`fedreid.eval.protocols.evaluate_dataset`) and picks their ranked
lists (:func:`fedreid.eval.query_picking.ranked_lists`), and only then
writes ``cmc.png``, ranked-list pictures and ``results.json``, so an
evaluation that fails leaves the folder's previous outputs as they were;
:func:`check_feature_sets` refuses feature sets that do not belong together
(:func:`unrecorded_models` names those that cannot be checked);
:func:`check_queries` checks ``--queries`` against the query sets;
:func:`claim_eval_dir` claims its output folder. The features come from
:mod:`fedreid.inference.dataset_features` (a model over a prepared dataset,
or a feature cache); the tool's other steps (model files, devices, image
folders, gallery stores) live in :mod:`fedreid.inference` and the gallery
modules, and the tool imports them from there.

``results.json`` names its pictures relative to its own folder
(:func:`~fedreid.eval.report.recorded_path` also reads the absolute or
working-directory-relative paths of an earlier fedreid), and records in
``model`` what the features came from, so a run's report shows it as that
run's final model's numbers only when it is (:mod:`fedreid.eval.report`).

Importing this module imports no torch, so ``tools/eval_reid.py`` indexes,
queries and serves with an ONNX file (``--backend onnx``) where PyTorch is
not installed. How the pieces fit: ``docs/evaluation.md``; what the tool
guarantees about the files it reads and writes: ``docs/retrieval-safety.md``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from fedreid.eval.protocols import DEFAULT_RERANK_BYTES, check_protocol, evaluate_dataset, summary_row
from fedreid.eval.query_picking import chosen_queries, draw_ranked_lists, ranked_lists
from fedreid.eval.report import RESULTS_FILE, recorded_path
from fedreid.inference.dataset_features import DatasetFeatures
from fedreid.inference.errors import EvalInputError

__all__ = [
    "RESULTS_FILE",
    "CMC_PLOT",
    "EVAL_KIND",
    "PICTURES_DIR",
    "check_feature_sets",
    "check_queries",
    "claim_eval_dir",
    "evaluate_and_report",
    "plot_cmc_curves",
    "unrecorded_models",
]

#: What :func:`evaluate_and_report` writes in its folder besides ``results.json`` (:data:`RESULTS_FILE`).
CMC_PLOT, PICTURES_DIR = "cmc.png", "ranked_lists"
#: The kind :func:`claim_eval_dir` marks its folder with (:func:`fedreid.utils.io.marker_path`).
EVAL_KIND = "eval"
#: Gallery images shown per ranked list.
TOP_K = 10


def plot_cmc_curves(results: Mapping[str, Mapping[str, Any]], out_path: str | Path, title: str = "CMC") -> Path:
    from fedreid.eval.metrics import cmc_curve
    from fedreid.eval.visualize import plot_cmc

    return plot_cmc({name: cmc_curve(r) for name, r in results.items()}, out_path, title=title)


def _where(feats: DatasetFeatures) -> str:
    return feats.source or f"dataset {feats.name!r} (features given in memory)"


def _model_record(feats: DatasetFeatures) -> Optional[dict[str, Any]]:
    """What ``feats`` came from, by their ``meta``: model file (absolute), round, fingerprint, client; None if unsaid.

    A relative model path (a feature cache of an earlier fedreid) is taken
    relative to the working directory, as that fedreid wrote it.
    """
    model = feats.meta.get("model")
    if not model:
        return None
    rnd = feats.meta.get("round")
    try:
        rnd = None if rnd is None else int(rnd)
    except (TypeError, ValueError):
        raise EvalInputError(f"{_where(feats)}: its meta round {rnd!r} is not a round number") from None
    return {"file": os.path.abspath(str(model)), "round": rnd, "fingerprint": feats.meta.get("model_fingerprint") or None,
            "client": feats.meta.get("client")}


def _same_model(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a["fingerprint"] and b["fingerprint"]:  # the weights themselves, whichever file held them
        return a["fingerprint"] == b["fingerprint"]
    return a["file"] == b["file"] and a["round"] == b["round"]


def _shown_model(record: Mapping[str, Any]) -> str:
    return f"{record['file']}, round {record['round']}"


def check_feature_sets(feature_sets: Sequence[DatasetFeatures]) -> Optional[dict[str, Any]]:
    """Refuse feature sets that do not belong in one evaluation; return the model they all came from.

    Two sets of one dataset name (their results would replace each other)
    and sets whose ``meta`` names different models (fingerprints when both
    have one, else model file and round: a mean over datasets of different
    models is no model's number) raise :class:`EvalInputError` naming both
    sources. Returns :func:`_model_record` of the sets when every one names
    its model, else None (unknown).
    """
    seen: dict[str, DatasetFeatures] = {}
    for feats in feature_sets:
        if feats.name in seen:
            raise EvalInputError(
                f"dataset {feats.name!r} is given twice, by {_where(seen[feats.name])} and by {_where(feats)}: "
                "one would replace the other; evaluate them into separate --out folders"
            )
        seen[feats.name] = feats
    records = [(feats, _model_record(feats)) for feats in feature_sets]
    known = [(feats, record) for feats, record in records if record is not None]
    for feats, record in known[1:]:
        first, first_record = known[0]
        if not _same_model(first_record, record):
            raise EvalInputError(
                f"{_where(first)} and {_where(feats)} come from different models ({_shown_model(first_record)} vs "
                f"{_shown_model(record)}): one evaluation takes one model's features; evaluate them separately"
            )
    return known[0][1] if known and len(known) == len(records) else None


def unrecorded_models(feature_sets: Sequence[DatasetFeatures]) -> list[str]:
    """The dataset names whose features record no model, when several sets are evaluated together (else ``[]``).

    :func:`check_feature_sets` refuses sets that name different models, but
    cannot check a set whose ``meta`` names none (a cache of an earlier
    fedreid): a mean over datasets that holds one may mix models.
    ``tools/eval_reid.py`` prints a WARNING naming their files and
    ``results.json`` lists them (``unrecorded_model``).
    """
    if len(feature_sets) < 2:
        return []
    return [feats.name for feats in feature_sets if _model_record(feats) is None]


def check_queries(feature_sets: Sequence[DatasetFeatures], queries: Sequence[str]) -> dict[str, list[int]]:
    """``queries`` (``--queries`` specs) as query indices per dataset name; a bad spec is an :class:`EvalInputError`.

    An index must exist in every dataset
    (:func:`~fedreid.eval.query_picking.chosen_queries`), a path or file name
    in at least one. Only the query sets' sizes and paths are read, so the
    tool checks the manifests' query sets with it before extracting anything.
    """
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
    return chosen


# --------------------------------------------------------------------------
# The whole evaluation report
# --------------------------------------------------------------------------


def _relative_to(path: str, folder: Path) -> str:
    try:
        return Path(os.path.relpath(path, os.path.abspath(folder))).as_posix()
    except ValueError:  # another drive (Windows): only the absolute path names it
        return path


def _previous_pictures(out_dir: Path) -> list[Path]:
    """The ranked-list pictures the previous ``results.json`` of ``out_dir`` lists (none if unreadable)."""
    try:
        previous = json.loads((out_dir / RESULTS_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    listed = previous.get("pictures") if isinstance(previous, dict) else None
    if not isinstance(listed, list):
        return []
    return [recorded_path(out_dir, p) for p in listed if isinstance(p, str)]


def _remove_stale_pictures(out_dir: Path, previous: Sequence[Path], current: set[str]) -> None:
    """Delete what the previous evaluation drew and this one did not: only listed PNGs of ``out_dir/ranked_lists``."""
    folder = (out_dir / PICTURES_DIR).resolve()
    for path in previous:
        if (path.name not in current and path.suffix == ".png" and path.is_file() and not path.is_symlink()
                and path.parent.resolve() == folder):
            path.unlink()


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
    rerank_max_bytes: int = DEFAULT_RERANK_BYTES,
) -> dict[str, Any]:
    """Evaluate each dataset, then write ``results.json``, ``cmc.png`` and ranked-list PNGs to ``out_dir``.

    ``pictures``: best/worst queries by AP per dataset (:func:`~fedreid.eval.query_picking.picked_queries`);
    ``queries``: specs of :func:`chosen_queries` drawn as well (an index
    applies to every dataset, a path or file name to the datasets holding it;
    one no dataset holds is an error, raised before anything is evaluated).
    ``protocol``/``seed``/``rerank_max_bytes``: see :func:`evaluate_dataset`. Feature sets that do
    not belong together are refused first (:func:`check_feature_sets`).

    Nothing in ``out_dir`` changes until every dataset is evaluated and every
    picture drawn (into a hidden folder there, then moved in); then
    ``results.json`` is replaced, and the ranked-list pictures the previous
    ``results.json`` listed that this evaluation did not draw are deleted
    (no other file is).

    Returns what ``results.json`` holds: ``datasets`` ({name: rank1, rank5,
    rank10, mAP, cmc, counts}), ``mean`` (of rank1/5/10/mAP), ``ap``,
    ``protocol``, ``rerank``, ``source``, ``model`` (what the features came
    from, by their ``meta``: ``file`` relative to ``out_dir``, ``round``,
    ``fingerprint``; None when they do not say), ``unrecorded_model`` (the
    datasets whose features name no model when several are evaluated, so
    that their mean may mix models: :func:`unrecorded_models`; usually
    empty), ``precision`` ({name: the
    arithmetic of its features, from their ``meta``; None when they do not
    say}), ``pictures`` and ``cmc_plot`` (paths relative to ``out_dir``).
    """
    from fedreid.utils.io import swap_leftovers, swap_sibling, write_json_atomic

    feature_sets = list(feature_sets)
    if not feature_sets:
        raise EvalInputError("nothing to evaluate: no datasets given")
    model = check_feature_sets(feature_sets)
    proto = check_protocol(protocol, ap, rerank)
    chosen = check_queries(feature_sets, queries)
    out_dir = Path(out_dir)
    results, rows, lists = {}, {}, {}
    for feats in feature_sets:
        result, reranked = evaluate_dataset(feats, ap=ap, rerank=rerank, protocol=protocol, seed=seed,
                                            rerank_max_bytes=rerank_max_bytes)
        results[feats.name], rows[feats.name] = result, summary_row(result)
        lists[feats.name] = ranked_lists(feats, result, pictures=pictures, queries=chosen[feats.name],
                                         reranked=reranked, top_k=TOP_K)
        del reranked  # a Q x G matrix: do not keep one per dataset
    title = "CMC (re-ranked)" if rerank else proto.title

    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in swap_leftovers(out_dir, PICTURES_DIR):  # a killed evaluation's staging folder
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
    previous = _previous_pictures(out_dir)
    staging = swap_sibling(out_dir / PICTURES_DIR, "tmp")
    staging.mkdir()
    try:
        staged = [p for feats in feature_sets
                  for p in draw_ranked_lists(feats, lists[feats.name], staging, top_k=TOP_K)]
        plot_cmc_curves(results, staging / CMC_PLOT, title=title)
        (out_dir / PICTURES_DIR).mkdir(exist_ok=True)
        for path in staged:
            os.replace(path, out_dir / PICTURES_DIR / path.name)
        os.replace(staging / CMC_PLOT, out_dir / CMC_PLOT)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    drawn = [f"{PICTURES_DIR}/{p.name}" for p in staged]
    report = {
        "source": source,
        "model": None if model is None else {**model, "file": _relative_to(model["file"], out_dir)},
        "unrecorded_model": unrecorded_models(feature_sets),
        "ap": ap,
        "protocol": protocol,
        "rerank": rerank,
        "precision": {f.name: f.meta.get("precision") for f in feature_sets},
        "datasets": rows,
        "mean": {m: float(np.mean([r[m] for r in rows.values()])) for m in ("rank1", "rank5", "rank10", "mAP")},
        "pictures": drawn,
        "cmc_plot": CMC_PLOT,
    }
    report.update(proto.report_fields(seed))
    write_json_atomic(out_dir / RESULTS_FILE, report)
    _remove_stale_pictures(out_dir, previous, {p.name for p in staged})
    return report


# --------------------------------------------------------------------------
# Output folders of evaluate
# --------------------------------------------------------------------------

_EVAL_RESULT_KEYS = ("datasets", "mean", "ap")


def _is_earlier_eval_folder(folder: Path) -> bool:
    """An unmarked folder holding only what :func:`evaluate_and_report` writes (an earlier version's)."""
    try:
        entries = {p.name: p for p in folder.iterdir()}
        results = json.loads((folder / RESULTS_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(results, dict) or not all(key in results for key in _EVAL_RESULT_KEYS):
        return False
    if not set(entries) <= {RESULTS_FILE, CMC_PLOT, PICTURES_DIR}:
        return False
    pictures = entries.get(PICTURES_DIR)
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
    return claim_output_dir(folder, EVAL_KIND, tool="tools/eval_reid.py evaluate --out", adopt=adopt)
