"""Evaluation glue for ``tools/eval_reid.py``: model files -> features -> metrics, indexes, queries.

Everything here wires existing pieces together: models come from
:func:`fedreid.models.reid.create_reid_model` + :func:`load_shared_state`,
features from :func:`fedreid.eval.features.extract_features` through
:class:`fedreid.fl.evaluation.EmbedModule` (flip-averaged, L2-normalised),
metrics from :func:`fedreid.eval.metrics.evaluate` / ``evaluate_scores``
(after :func:`fedreid.eval.rerank.k_reciprocal_rerank` when asked), search
from :mod:`fedreid.eval.retrieval` and pictures from
:mod:`fedreid.eval.visualize`.

Model sources (:func:`load_model`): a run folder (its ``model_final.pt``,
else its ``checkpoint.pt``), a ``model_final.pt`` (``format:
fedreid.model``) or a ``checkpoint.pt`` (``config`` + ``server.global_state``).

Feature caches (:func:`save_dataset_features`): one ``.npz`` per dataset in
the :func:`fedreid.eval.features.save_features` format, query rows first,
then gallery rows; ``meta`` holds ``dataset`` and ``num_query``.

Errors for bad inputs are :class:`FileNotFoundError` (a missing path) or
:class:`EvalInputError` (a :class:`~fedreid.config.ConfigError`, so
``run_main`` prints them as one line); both name the offending path or value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from fedreid.config import ConfigError
from fedreid.eval.features import FeatureSet, extract_features, load_features, save_features
from fedreid.fl.evaluation import EmbedModule

__all__ = [
    "EvalInputError",
    "LoadedModel",
    "DatasetFeatures",
    "QueryResult",
    "resolve_device",
    "find_model_file",
    "load_model",
    "run_config_path",
    "resolve_datasets",
    "dataset_features",
    "save_dataset_features",
    "load_dataset_features",
    "evaluate_dataset",
    "draw_dataset_pictures",
    "plot_cmc_curves",
    "list_images",
    "parse_market_name",
    "image_features",
    "build_gallery_index",
    "query_index",
    "draw_query_picture",
    "draw_query_pictures",
    "evaluate_and_report",
    "picked_queries",
    "summary_row",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
MODEL_FORMAT = "fedreid.model"
MODEL_FILE, CHECKPOINT_FILE = "model_final.pt", "checkpoint.pt"
#: Ranks evaluated (rank 1..CMC_RANKS for the CMC plot; the table shows 1/5/10).
CMC_RANKS = 20
_MARKET_NAME = re.compile(r"^(-?\d+)_c(\d+)")


class EvalInputError(ConfigError):
    """A bad input of the evaluation tool (unreadable model, unknown dataset, empty folder...)."""


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A model ready for feature extraction, and where it came from."""

    model: nn.Module
    config: dict[str, Any]  # the model config (backbone, height, width, ...)
    source: Path
    round: Optional[int] = None


def find_model_file(path: str | Path) -> Path:
    """The model file for ``path``: the file itself, or a run folder's model_final.pt / checkpoint.pt."""
    path = Path(path)
    if path.is_dir():
        for name in (MODEL_FILE, CHECKPOINT_FILE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"no {MODEL_FILE} or {CHECKPOINT_FILE} in run folder {path}")
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    return path


def run_config_path(model_path: str | Path) -> Optional[Path]:
    """The ``config.yaml`` of the run that ``model_path`` (a run folder or a file in one) belongs to."""
    model_path = Path(model_path)
    folder = model_path if model_path.is_dir() else model_path.parent
    config = folder / "config.yaml"
    return config if config.is_file() else None


def _model_payload(
    path: Path, client: Optional[str] = None
) -> tuple[dict[str, Any], Mapping[str, torch.Tensor], Optional[int]]:
    from fedreid.utils.checkpoint import CHECKPOINT_FORMAT

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable is unreadable
        raise EvalInputError(f"cannot read model file {path}: {exc}") from None
    fmt = data.get("format") if isinstance(data, dict) else None
    try:
        if fmt == MODEL_FORMAT:
            return dict(data["model"]), _pick_state(path, data, client), data.get("round")
        if fmt == CHECKPOINT_FORMAT:
            return dict(data["config"]["model"]), data["server"]["global_state"], data.get("round")
    except (KeyError, TypeError) as exc:
        raise EvalInputError(f"model file {path} ({fmt}) lacks entry {exc}") from None
    raise EvalInputError(
        f"{path} is not a fedreid model ({MODEL_FILE}, format {MODEL_FORMAT!r}) "
        f"or training checkpoint ({CHECKPOINT_FILE}); its format is {fmt!r}"
    )


def _pick_state(path: Path, data: Mapping[str, Any], client: Optional[str]) -> Mapping[str, torch.Tensor]:
    """The global state, or in a local-training baseline the chosen client's own model."""
    clients = data.get("client_states")
    if clients is None:
        if client is not None:
            raise EvalInputError(f"{path} holds one global model, not per-client models: drop --client")
        return data["state"]
    if client is None or client not in clients:
        what = "has no client" if client is not None else "is a local-training baseline: every client has its own model"
        raise EvalInputError(
            f"{path} {what}{f' {client!r}' if client else ''}; choose one with --client "
            f"({', '.join(sorted(clients))})"
        )
    return clients[client]


def load_model(
    path: str | Path, device: str | torch.device = "cpu", *, client: Optional[str] = None
) -> LoadedModel:
    """Build the model from a run folder / model_final.pt / checkpoint.pt, in eval mode on ``device``.

    The architecture comes from the saved model config, without pretrained
    weights (the saved shared state overwrites them); a saved classifier
    (FedAvg keeps one) is dropped, features come from ``embed``. A
    local-training baseline's ``model_final.pt`` holds one model per client:
    ``client`` names the one to load.
    """
    from fedreid.models.reid import PRIVATE_PREFIXES, StateMismatchError, create_reid_model, load_shared_state

    file = find_model_file(path)
    cfg, state, rnd = _model_payload(file, client)
    try:
        model = create_reid_model(
            cfg.get("backbone", "resnet50"),
            0,
            pretrained=None,
            last_stride=int(cfg.get("last_stride", 2)),
            bottleneck_dim=int(cfg.get("bottleneck_dim", 512)),
            dropout=float(cfg.get("dropout", 0.5)),
        )
        shared = {k: v for k, v in state.items() if not k.startswith(PRIVATE_PREFIXES)}
        load_shared_state(model, shared)
    except StateMismatchError as exc:
        raise EvalInputError(f"model file {file}: saved state does not fit its model config: {exc}") from None
    except (RuntimeError, KeyError) as exc:  # timm: unknown backbone name
        raise EvalInputError(f"model file {file}: cannot build backbone {cfg.get('backbone')!r}: {exc}") from None
    cfg.setdefault("height", 256)
    cfg.setdefault("width", 128)
    model.to(device).eval()
    return LoadedModel(model=model, config=cfg, source=file, round=rnd)


def _features(loaded: LoadedModel, loader: Iterable[Any], device: torch.device) -> np.ndarray:
    out = extract_features(EmbedModule(loaded.model), loader, flip=True, normalize=True, device=device)
    return np.ascontiguousarray(out.features, dtype=np.float32)


# --------------------------------------------------------------------------
# Prepared datasets -> features
# --------------------------------------------------------------------------


@dataclass
class DatasetFeatures:
    """Query and gallery features of one dataset, with ids, cameras and image paths."""

    name: str
    query: FeatureSet
    gallery: FeatureSet
    meta: dict[str, Any] = field(default_factory=dict)


def _prepared_names(root: Path) -> list[str]:
    from fedreid.data.prepared import MANIFEST

    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file())


def resolve_datasets(names: Sequence[str], prepared_root: str | Path) -> list[str]:
    """``names`` checked against ``prepared_root``; ``["all"]`` means every prepared dataset there."""
    from fedreid.data.prepared import PreparedDatasetError

    root = Path(prepared_root)
    available = _prepared_names(root)
    if list(names) == ["all"]:
        if not available:
            raise FileNotFoundError(f"no prepared datasets under {root}")
        return available
    unknown = [n for n in names if n not in available]
    if unknown:
        raise PreparedDatasetError(
            f"unknown dataset {unknown[0]!r}: {root / unknown[0]} is not a prepared dataset "
            f"(available under {root}: {', '.join(available) or 'none'})"
        )
    return list(names)


def _split_loader(records: Sequence[Any], height: int, width: int, batch_size: int):
    from fedreid.data.datasets import ReIDImageDataset, make_loader
    from fedreid.data.transforms import build_test_transform
    from fedreid.fl.evaluation import FeatureBatches

    dataset = ReIDImageDataset(records, None, transform=build_test_transform(height, width))
    return FeatureBatches(make_loader(dataset, batch_size, shuffle=False, seed=0))


def dataset_features(
    loaded: LoadedModel,
    prepared_root: str | Path,
    name: str,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
) -> DatasetFeatures:
    """Features of the query and gallery splits of prepared dataset ``name``."""
    from fedreid.data.prepared import PreparedDatasetError, load_prepared

    ds = load_prepared(prepared_root, name)
    sets = {}
    for split in ("query", "gallery"):
        records = ds.split(split)
        if not records:
            raise PreparedDatasetError(f"dataset {name!r} at {ds.root} has no {split} images")
        loader = _split_loader(records, int(loaded.config["height"]), int(loaded.config["width"]), batch_size)
        sets[split] = FeatureSet(
            features=_features(loaded, loader, torch.device(device)),
            pids=np.array([r.pid for r in records], dtype=np.int64),
            camids=np.array([r.camid for r in records], dtype=np.int64),
            paths=[str(r.path) for r in records],
        )
    meta = {"dataset": name, "model": str(loaded.source), "round": loaded.round, "flip": True}
    return DatasetFeatures(name, sets["query"], sets["gallery"], meta)


def save_dataset_features(folder: str | Path, feats: DatasetFeatures) -> Path:
    """``folder/<name>.npz``: query rows then gallery rows; ``meta.num_query`` splits them."""
    q, g = feats.query, feats.gallery
    meta = {**feats.meta, "dataset": feats.name, "num_query": int(q.features.shape[0])}
    return save_features(
        Path(folder) / f"{feats.name}.npz",
        np.concatenate([q.features, g.features]),
        np.concatenate([q.pids, g.pids]),
        np.concatenate([q.camids, g.camids]),
        list(q.paths) + list(g.paths),
        meta=meta,
    )


def load_dataset_features(path: str | Path, name: Optional[str] = None) -> DatasetFeatures:
    """Read a cache written by :func:`save_dataset_features` (``name`` defaults to its meta)."""
    fs, meta = load_features(path)
    if "num_query" not in meta:
        raise EvalInputError(f"feature cache {path} was not written by eval_reid (no num_query in its meta)")
    n = int(meta["num_query"])

    def part(sl: slice) -> FeatureSet:
        return FeatureSet(fs.features[sl], fs.pids[sl], fs.camids[sl], fs.paths[sl])

    return DatasetFeatures(name or meta.get("dataset") or Path(path).stem, part(slice(0, n)), part(slice(n, None)), meta)


# --------------------------------------------------------------------------
# Metrics and pictures
# --------------------------------------------------------------------------


def _similarity(feats: DatasetFeatures, rerank: bool) -> np.ndarray:
    """Query x gallery similarity (higher is better): inner product, or minus re-ranked distance."""
    if rerank:
        from fedreid.eval.rerank import k_reciprocal_rerank

        return -k_reciprocal_rerank(feats.query.features, feats.gallery.features)
    return feats.query.features @ feats.gallery.features.T


def evaluate_dataset(
    feats: DatasetFeatures, *, ap: str = "standard", rerank: bool = False
) -> tuple[dict[str, Any], np.ndarray]:
    """``(result, similarity)``: the metrics dict (rank1..rank20, mAP, counts, per_query) and the scores used."""
    from fedreid.eval.metrics import evaluate, evaluate_scores

    q, g = feats.query, feats.gallery
    ranks = tuple(range(1, CMC_RANKS + 1))
    sim = _similarity(feats, rerank)
    if rerank:
        result = evaluate_scores(sim, q.pids, g.pids, q.camids, g.camids, ap=ap, ranks=ranks, return_per_query=True)
    else:
        result = evaluate(
            q.features, g.features, q.pids, g.pids, q.camids, g.camids, ap=ap, ranks=ranks, return_per_query=True
        )
    result["num_gallery"] = int(g.features.shape[0])
    return result, sim


def summary_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of an :func:`evaluate_dataset` result."""
    row: dict[str, Any] = {k: float(result[k]) for k in ("rank1", "rank5", "rank10", "mAP")}
    row["cmc"] = [float(result[f"rank{k}"]) for k in result["ranks"]]
    for key in ("num_queries", "num_valid_queries", "num_queries_without_match", "num_gallery"):
        row[key] = int(result[key])
    return row


def picked_queries(result: Mapping[str, Any], n: int) -> list[tuple[int, str]]:
    """``n`` queries to draw: the best half (rounded up) and the worst half by AP, among queries with a match.

    Ties go to the lower query index. Returns ``[(query index, "best"|"worst"), ...]``.
    """
    per_query = result["per_query"]
    valid = np.flatnonzero(per_query["num_matches"] > 0)
    if n <= 0 or valid.size == 0:
        return []
    order = valid[np.argsort(-per_query["ap"][valid], kind="stable")]
    n_best = min((n + 1) // 2, order.size)
    best = [int(i) for i in order[:n_best]]
    worst_order = valid[np.argsort(per_query["ap"][valid], kind="stable")]
    worst = [int(i) for i in worst_order if int(i) not in best][: min(n - n_best, order.size - n_best)]
    return [(i, "best") for i in best] + [(i, "worst") for i in worst]


def draw_dataset_pictures(
    feats: DatasetFeatures, result: Mapping[str, Any], sim: np.ndarray, out_dir: str | Path, n: int, top_k: int = 10
) -> list[Path]:
    """Ranked lists (green: true match, red: wrong) of :func:`picked_queries` as PNGs in ``out_dir``."""
    from fedreid.eval.visualize import draw_ranked_list, filtered_top_k

    q, g = feats.query, feats.gallery
    written = []
    for i, tag in picked_queries(result, n):
        top, correct = filtered_top_k(sim[i], int(q.pids[i]), int(q.camids[i]), g.pids, g.camids, k=top_k)
        out = Path(out_dir) / f"{feats.name}_{tag}_q{i:05d}.png"
        written.append(
            draw_ranked_list(q.paths[i], [g.paths[j] for j in top], correct, sim[i, top], out, top_k=top_k)
        )
    return written


def plot_cmc_curves(results: Mapping[str, Mapping[str, Any]], out_path: str | Path, title: str = "CMC") -> Path:
    from fedreid.eval.metrics import cmc_curve
    from fedreid.eval.visualize import plot_cmc

    return plot_cmc({name: cmc_curve(r) for name, r in results.items()}, out_path, title=title)


# --------------------------------------------------------------------------
# Image folders: index and query
# --------------------------------------------------------------------------


def list_images(path: str | Path, what: str = "gallery") -> list[Path]:
    """An image file, or every jpg/png/bmp under a folder (recursive, sorted)."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise EvalInputError(f"{what} file {path} is not a jpg/png/bmp image")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{what} path {path} does not exist")
    images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise EvalInputError(f"{what} folder {path} holds no jpg/png/bmp images")
    return images


def parse_market_name(path: str | Path) -> tuple[int, int]:
    """``(pid, camid)`` from a Market-style name ``0002_c1s1_...`` (camera 0-based), else ``(-1, -1)``."""
    match = _MARKET_NAME.match(Path(path).name)
    if match is None:
        return -1, -1
    return int(match.group(1)), int(match.group(2)) - 1


class _ImageFiles(torch.utils.data.Dataset):
    def __init__(self, paths: Sequence[Path], height: int, width: int) -> None:
        from fedreid.data.transforms import build_test_transform

        self.paths = list(paths)
        self.transform = build_test_transform(height, width)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from fedreid.data.datasets import read_image

        pid, camid = parse_market_name(self.paths[i])
        image = self.transform(read_image(self.paths[i]))
        return {"images": image, "pids": pid, "camids": camid, "paths": str(self.paths[i])}


def image_features(
    loaded: LoadedModel, paths: Sequence[Path], *, batch_size: int = 128, device: str | torch.device = "cpu"
) -> FeatureSet:
    """Features of image files, with Market-style ids/cameras (-1 when the name has none)."""
    dataset = _ImageFiles(paths, int(loaded.config["height"]), int(loaded.config["width"]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    out = extract_features(EmbedModule(loaded.model), loader, flip=True, normalize=True, device=torch.device(device))
    return out._replace(features=np.ascontiguousarray(out.features, dtype=np.float32))


def build_gallery_index(
    loaded: LoadedModel,
    gallery: str | Path,
    index_dir: str | Path,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
) -> tuple[Path, int]:
    """Index every image under ``gallery`` into ``index_dir``; returns ``(folder, number of images)``."""
    from fedreid.eval.retrieval import build_index, save_index

    paths = list_images(gallery, "gallery")
    fs = image_features(loaded, paths, batch_size=batch_size, device=device)
    meta = {"model": str(loaded.source), "round": loaded.round, "gallery": str(Path(gallery).resolve())}
    folder = save_index(
        index_dir, build_index(fs.features, use_gpu=False), ids=fs.pids, cameras=fs.camids,
        paths=[str(Path(p).resolve()) for p in fs.paths], meta=meta,
    )
    return folder, len(paths)


@dataclass
class QueryResult:
    """One query image's top-k: gallery paths, scores, ids; ``correct`` is None when ids are unknown."""

    path: str
    pid: int
    matches: list[dict[str, Any]]


def query_index(
    loaded: LoadedModel,
    index_dir: str | Path,
    images: str | Path,
    *,
    top_k: int = 10,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
) -> list[QueryResult]:
    """Search the index in ``index_dir`` with every image of ``images`` (a file or a folder)."""
    from fedreid.eval.retrieval import load_index, search

    index = load_index(index_dir)
    paths = list_images(images, "query")
    fs = image_features(loaded, paths, batch_size=batch_size, device=device)
    if fs.features.shape[1] != index.index.d:
        raise EvalInputError(
            f"index {index_dir} holds {index.index.d}-d features but the model gives {fs.features.shape[1]}-d: "
            "build the index with the same model"
        )
    scores, indices = search(index.index, fs.features, top_k)
    out = []
    for qi, path in enumerate(fs.paths):
        q_pid = int(fs.pids[qi])
        matches = []
        for rank, (score, gi) in enumerate(zip(scores[qi], indices[qi]), start=1):
            g_pid = int(index.ids[gi])
            known = q_pid >= 0 and g_pid >= 0
            matches.append({
                "rank": rank, "score": float(score), "path": str(index.paths[gi]), "pid": g_pid,
                "camid": int(index.cameras[gi]), "correct": (g_pid == q_pid) if known else None,
            })
        out.append(QueryResult(path=path, pid=q_pid, matches=matches))
    return out


def draw_query_picture(result: QueryResult, out_path: str | Path, size: tuple[int, int] = (128, 64)) -> Path:
    """The query and its matches: green/red frames where both ids are known, grey otherwise."""
    from fedreid.eval.visualize import draw_ranked_list

    m = result.matches
    return draw_ranked_list(
        result.path, [x["path"] for x in m], [x["correct"] for x in m], [x["score"] for x in m],
        out_path, size=size, top_k=max(len(m), 1),
    )


def draw_query_pictures(results: Sequence[QueryResult], out_dir: str | Path) -> list[Path]:
    """One PNG per query in ``out_dir``, named ``<number>_<image stem>.png``."""
    return [
        draw_query_picture(r, Path(out_dir) / f"{i:04d}_{Path(r.path).stem}.png") for i, r in enumerate(results)
    ]


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
    source: Optional[str] = None,
) -> dict[str, Any]:
    """Evaluate each dataset, then write ``results.json``, ``cmc.png`` and ranked-list PNGs to ``out_dir``.

    Returns what ``results.json`` holds: ``datasets`` ({name: rank1, rank5,
    rank10, mAP, cmc, counts}), ``mean`` (of rank1/5/10/mAP), ``ap``,
    ``rerank``, ``source``, ``pictures`` and ``cmc_plot`` (paths).
    """
    from fedreid.utils.io import write_json_atomic

    out_dir = Path(out_dir)
    results, rows, drawn = {}, {}, []
    for feats in feature_sets:
        result, sim = evaluate_dataset(feats, ap=ap, rerank=rerank)
        results[feats.name], rows[feats.name] = result, summary_row(result)
        drawn += draw_dataset_pictures(feats, result, sim, out_dir / "ranked_lists", pictures)
    if not rows:
        raise EvalInputError("nothing to evaluate: no datasets given")
    title = "CMC (re-ranked)" if rerank else "CMC"
    cmc_path = plot_cmc_curves(results, out_dir / "cmc.png", title=title)
    report = {
        "source": source,
        "ap": ap,
        "rerank": rerank,
        "datasets": rows,
        "mean": {m: float(np.mean([r[m] for r in rows.values()])) for m in ("rank1", "rank5", "rank10", "mAP")},
        "pictures": [str(p) for p in drawn],
        "cmc_plot": str(cmc_path),
    }
    write_json_atomic(out_dir / "results.json", report)
    return report
