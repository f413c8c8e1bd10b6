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
Model files are read with ``torch.load(weights_only=True)`` only, and only
once their first bytes show a PyTorch file: a pickle of other objects is
refused without running anything. A loaded model carries a fingerprint
(:func:`model_fingerprint`) that index folders record and queries check.

Index folders (:func:`build_gallery_index`): written only into a new, empty
or fedreid-marked folder (:func:`fedreid.utils.io.claim_output_dir`, kind
``index``; an unmarked index folder of an earlier version is adopted), never
into or under the gallery folder, and replaced as a whole (staged in a hidden
sibling, then renamed in). Unreadable images abort with an error naming the
image unless the caller collects them (``skipped``), in which case they are
left out and listed in ``skipped.csv``. The evaluation's output folders are
claimed the same way (:func:`claim_eval_dir`, :func:`claim_features_dir`).

Features from every source (a model over a dataset or an image folder, a
feature file, features given in memory) pass
:func:`fedreid.eval.features.check_features` before any figure or index is
made from them: NaN/inf, all-zero or all-identical features are an error
naming their source, not plausible-looking numbers from ties.

Feature caches (:func:`save_dataset_features`): one ``.npz`` per dataset in
the :func:`fedreid.eval.features.save_features` format, query rows first,
then gallery rows; ``meta`` holds ``dataset`` and ``num_query``.

Errors for bad inputs are :class:`FileNotFoundError` (a missing path),
:class:`EvalInputError` (a :class:`~fedreid.config.ConfigError`) or
:class:`~fedreid.eval.metrics.EvalDataError` (bad features or ids, re-raised
here with the dataset and the file or model they came from); all are printed
as one line by ``run_main`` and name the offending path or value.

Memory: metrics come from the block-wise :func:`~fedreid.eval.metrics.evaluate`
(no query x gallery matrix); the ranked-list pictures need the scores of the
few drawn queries only (:func:`query_scores`). The one exception is
re-ranking, whose algorithm needs the full matrices (guarded by
:func:`fedreid.eval.rerank.estimate_rerank_bytes`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from fedreid.config import ConfigError
from fedreid.eval.features import FeatureSet, check_features, extract_features, load_features, save_features
from fedreid.eval.filecheck import describe_kind, file_kind
from fedreid.eval.metrics import DEFAULT_BLOCK_BYTES, EvalDataError
from fedreid.fl.evaluation import EmbedModule

__all__ = [
    "EvalInputError",
    "ModelMismatchError",
    "LoadedModel",
    "SkippedImage",
    "SKIPPED_FILE",
    "DatasetFeatures",
    "QueryResult",
    "PROTOCOLS",
    "CUHK03_REPEATS",
    "FAISS_GPU_MODES",
    "resolve_device",
    "resolve_speedups",
    "resolve_faiss_gpu",
    "query_scores",
    "chosen_queries",
    "find_model_file",
    "load_model",
    "model_fingerprint",
    "check_index_model",
    "write_skipped_csv",
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
    "claim_eval_dir",
    "claim_features_dir",
    "picked_queries",
    "RankedList",
    "ranked_lists",
    "summary_row",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
MODEL_FORMAT = "fedreid.model"
MODEL_FILE, CHECKPOINT_FILE = "model_final.pt", "checkpoint.pt"
#: Ranks evaluated (rank 1..CMC_RANKS for the CMC plot; the table shows 1/5/10).
CMC_RANKS = 20
#: ``standard``: single-query CMC/mAP over the whole filtered gallery;
#: ``cuhk03``: the old CUHK03 single-gallery-shot CMC (standard mAP).
PROTOCOLS = ("standard", "cuhk03")
#: Samplings averaged by the CUHK03 protocol (as torchreid's ``eval_cuhk03``).
CUHK03_REPEATS = 10
FAISS_GPU_MODES = ("auto", "on", "off")
_MARKET_NAME = re.compile(r"^(-?\d+)_c(\d+)")
#: What the features are (part of the model fingerprint): ``embed`` of image + flipped image, L2-normalised.
FEATURE_KIND = "embed+flip, l2-normalised"
#: The list of images left out (``path,reason``), in an index folder or a query's --out folder.
SKIPPED_FILE = "skipped.csv"
_TOOL_INDEX = "tools/eval_reid.py index"


class EvalInputError(ConfigError):
    """A bad input of the evaluation tool (unreadable model, unknown dataset, empty folder...)."""


class ModelMismatchError(EvalInputError):
    """A query's model is not the one its index was built with (their fingerprints differ)."""


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise EvalInputError(f"--device {device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None


def resolve_speedups(
    device: torch.device, amp: Optional[bool] = None, channels_last: Optional[bool] = None
) -> tuple[bool, bool]:
    """``(amp, channels_last)`` for extraction on ``device``; None means on for CUDA, off elsewhere.

    Both only speed up CUDA kernels (:func:`fedreid.eval.features.extract_features`
    ignores them elsewhere), so asking for one explicitly on another device
    is an error rather than a silently slower run.
    """
    on_cuda = device.type == "cuda"
    asked = [flag for flag, value in (("--amp", amp), ("--channels-last", channels_last)) if value]
    if asked and not on_cuda:
        raise EvalInputError(
            f"{' and '.join(asked)} only apply on a CUDA device, but the device is {device}: "
            "drop them or use --device cuda"
        )
    return (on_cuda if amp is None else bool(amp)), (on_cuda if channels_last is None else bool(channels_last))


def resolve_faiss_gpu(mode: str, device: torch.device) -> bool:
    """Whether the FAISS index goes to a GPU: ``auto`` / ``on`` / ``off``.

    ``auto``: when faiss has GPU support, sees a GPU and the tool's device is
    CUDA; ``on``: required (:class:`~fedreid.eval.retrieval.FaissGpuUnavailableError`
    naming what is missing when it cannot be); ``off``: the CPU index.
    """
    from fedreid.eval import retrieval

    if mode not in FAISS_GPU_MODES:
        raise EvalInputError(f"--faiss-gpu {mode!r}: expected one of {', '.join(FAISS_GPU_MODES)}")
    if mode == "off":
        return False
    if mode == "on":
        retrieval.require_faiss_gpu()
        return True
    return device.type == "cuda" and retrieval.faiss_gpu_available()


def _faiss_gpu_id(device: torch.device) -> int:
    return (device.index or 0) if device.type == "cuda" else 0


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
    #: :func:`model_fingerprint` of the loaded weights and config (empty when built by hand).
    fingerprint: dict[str, Any] = field(default_factory=dict)


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


_EXPECTED_MODEL = (
    f"expected a fedreid run folder, its {MODEL_FILE} or {CHECKPOINT_FILE} "
    "(a torch.save'd dict of tensors and plain values)"
)


def _read_model_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a file whose first bytes show a PyTorch file; errors in words.

    Nothing else is ever handed to an unpickler; a pickle holding objects
    other than tensors and plain containers is refused by ``weights_only``
    before any of it runs.
    """
    import pickle
    import warnings

    try:
        kind = file_kind(path)
    except OSError as exc:
        raise EvalInputError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if kind not in ("zip", "pickle"):
        raise EvalInputError(f"model file {path} is not a PyTorch file: {describe_kind(kind)}; {_EXPECTED_MODEL}")
    try:
        with warnings.catch_warnings():  # a planted pickle's protocol is no news to the user: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise EvalInputError(
            f"model file {path} holds Python objects other than tensors and plain containers, which are never "
            f"loaded (loading them can run code); {_EXPECTED_MODEL}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalInputError(
            f"model file {path} is a damaged or truncated PyTorch file ({first[:200]}); {_EXPECTED_MODEL}"
        ) from None


def _model_payload(
    path: Path, client: Optional[str] = None
) -> tuple[dict[str, Any], Mapping[str, torch.Tensor], Optional[int]]:
    from fedreid.utils.checkpoint import CHECKPOINT_FORMAT

    data = _read_model_file(path)
    fmt = data.get("format") if isinstance(data, dict) else None
    try:
        if fmt == MODEL_FORMAT:
            return dict(data["model"]), _pick_state(path, data, client), data.get("round")
        if fmt == CHECKPOINT_FORMAT:
            return dict(data["config"]["model"]), data["server"]["global_state"], data.get("round")
    except (KeyError, TypeError) as exc:
        raise EvalInputError(f"model file {path} ({fmt}) lacks entry {exc}") from None
    what = f"its format is {fmt!r}" if fmt is not None else (
        "a bare state dict carries no model config" if isinstance(data, dict) else f"it holds a {type(data).__name__}"
    )
    raise EvalInputError(
        f"{path} is a PyTorch file but not a fedreid model ({MODEL_FILE}, format {MODEL_FORMAT!r}) "
        f"or training checkpoint ({CHECKPOINT_FILE}): {what}; {_EXPECTED_MODEL}"
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
    fingerprint = model_fingerprint(model, cfg)
    model.to(device).eval()
    return LoadedModel(model=model, config=cfg, source=file, round=rnd, fingerprint=fingerprint)


def model_fingerprint(model: nn.Module, config: Mapping[str, Any]) -> dict[str, Any]:
    """What defines a model's features: ``weights_sha256``, architecture, input size, feature kind.

    ``weights_sha256`` hashes every entry of ``model.state_dict()`` (name,
    dtype, shape and bytes, in name order), so the same weights give the same
    digest whichever file (``model_final.pt``, ``checkpoint.pt``) or device
    they came from. The other fields come from the model ``config``
    (``backbone``, ``last_stride``, ``bottleneck_dim``, ``height``, ``width``;
    the defaults of :func:`load_model` where missing) and :data:`FEATURE_KIND`.
    Two models give comparable features only when every field is equal.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {
        "weights_sha256": digest.hexdigest(),
        "backbone": str(config.get("backbone", "resnet50")),
        "last_stride": int(config.get("last_stride", 2)),
        "bottleneck_dim": int(config.get("bottleneck_dim", 512)),
        "height": int(config.get("height", 256)),
        "width": int(config.get("width", 128)),
        "feature": FEATURE_KIND,
    }


def _fingerprint_differences(index_fp: Mapping[str, Any], model_fp: Mapping[str, Any]) -> list[str]:
    def shown(value: Any) -> str:
        return value[:16] if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) else repr(value)

    return [
        f"{key} {shown(index_fp.get(key))} (index) vs {shown(model_fp.get(key))} (model)"
        for key in sorted(set(index_fp) | set(model_fp))
        if index_fp.get(key) != model_fp.get(key)
    ]


def check_index_model(
    header: Mapping[str, Any], loaded: LoadedModel, index_dir: str | Path, *, allow_mismatch: bool = False
) -> Optional[str]:
    """Whether ``loaded`` is the model the index of ``header`` was built with; None when it is.

    The index header's ``meta.model_fingerprint`` is compared with
    ``loaded.fingerprint`` field by field. A difference (or an index that
    records no fingerprint) raises :class:`ModelMismatchError` naming the
    differing fields with both values; with ``allow_mismatch`` the same words
    are returned instead, for the caller to show as a warning.
    """
    recorded = (header.get("meta") or {}).get("model_fingerprint")
    built_with = (header.get("meta") or {}).get("model", "an unrecorded model")
    if not isinstance(recorded, dict) or not recorded:
        problem = f"index {index_dir} records no model fingerprint, so it cannot be checked against {loaded.source}"
    else:
        diffs = _fingerprint_differences(recorded, loaded.fingerprint)
        if not diffs:
            return None
        problem = (
            f"index {index_dir} was built with another model ({built_with}) than {loaded.source}: "
            + "; ".join(diffs)
        )
    if allow_mismatch:
        return f"{problem}; the scores may be meaningless (--allow-model-mismatch)"
    raise ModelMismatchError(
        f"{problem}; query with the index's model, build the index again with this one, "
        "or pass --allow-model-mismatch to search anyway"
    )


def _features(
    loaded: LoadedModel, loader: Iterable[Any], device: torch.device, *, amp: bool = False, channels_last: bool = False
) -> FeatureSet:
    out = extract_features(
        EmbedModule(loaded.model), loader, flip=True, normalize=True, device=device, amp=amp,
        channels_last=channels_last,
    )
    return out._replace(features=np.ascontiguousarray(out.features, dtype=np.float32))


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
    #: Where the features came from (a feature file, or the model file): named in errors.
    source: str = ""


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
    amp: bool = False,
    channels_last: bool = False,
) -> DatasetFeatures:
    """Features of the query and gallery splits of prepared dataset ``name``.

    ``amp`` / ``channels_last``: CUDA speedups of the extraction (see
    :func:`resolve_speedups`). Degenerate features (NaN/inf, all zero, all
    identical; :func:`~fedreid.eval.features.check_features`) raise an error
    naming the model and the dataset.
    """
    from fedreid.data.prepared import PreparedDatasetError, load_prepared

    ds = load_prepared(prepared_root, name)
    sets = {}
    for split in ("query", "gallery"):
        records = ds.split(split)
        if not records:
            raise PreparedDatasetError(f"dataset {name!r} at {ds.root} has no {split} images")
        loader = _split_loader(records, int(loaded.config["height"]), int(loaded.config["width"]), batch_size)
        sets[split] = FeatureSet(
            features=_features(loaded, loader, torch.device(device), amp=amp, channels_last=channels_last).features,
            pids=np.array([r.pid for r in records], dtype=np.int64),
            camids=np.array([r.camid for r in records], dtype=np.int64),
            paths=[str(r.path) for r in records],
        )
        check_features(
            sets[split].features, f"model {loaded.source} on dataset {name!r}: {split}", paths=sets[split].paths
        )
    meta = {"dataset": name, "model": str(loaded.source), "round": loaded.round, "flip": True}
    if loaded.fingerprint:
        meta["model_fingerprint"] = loaded.fingerprint
    return DatasetFeatures(name, sets["query"], sets["gallery"], meta, source=f"model {loaded.source}")


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
    """Read a cache written by :func:`save_dataset_features` (``name`` defaults to its meta).

    Besides :func:`~fedreid.eval.features.load_features`'s checks, each split
    passes :func:`~fedreid.eval.features.check_features`: NaN/inf, all-zero or
    all-identical features are an error naming the file (and the split, row
    and image of a NaN).
    """
    fs, meta = load_features(path)
    if "num_query" not in meta:
        raise EvalInputError(f"feature cache {path} was not written by eval_reid (no num_query in its meta)")
    try:
        n = int(meta["num_query"])
    except (TypeError, ValueError):
        raise EvalInputError(f"feature cache {path}: num_query={meta['num_query']!r} is not an integer") from None
    if not 0 <= n <= fs.features.shape[0]:
        raise EvalInputError(f"feature cache {path}: num_query={n} but the file holds {fs.features.shape[0]} rows")

    def part(sl: slice) -> FeatureSet:
        return FeatureSet(fs.features[sl], fs.pids[sl], fs.camids[sl], fs.paths[sl])

    name = name or meta.get("dataset") or Path(path).stem
    feats = DatasetFeatures(name, part(slice(0, n)), part(slice(n, None)), meta, source=f"feature file {path}")
    _check_dataset_features(feats, f"feature file {path}")
    return feats


def _check_dataset_features(feats: DatasetFeatures, where: Optional[str] = None) -> None:
    for split, fs in (("query", feats.query), ("gallery", feats.gallery)):
        check_features(fs.features, f"{where}: {split}" if where else split, paths=fs.paths)


# --------------------------------------------------------------------------
# Metrics and pictures
# --------------------------------------------------------------------------


def _check_protocol(protocol: str, ap: str, rerank: bool) -> None:
    if protocol not in PROTOCOLS:
        raise EvalInputError(f"unknown protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "cuhk03" and rerank:
        raise EvalInputError("--rerank is not available with --protocol cuhk03 (it samples the raw feature scores)")
    if protocol == "cuhk03" and ap != "standard":
        raise EvalInputError(f"--protocol cuhk03 reports the standard AP (as torchreid's eval_cuhk03), not --ap {ap}")


def evaluate_dataset(
    feats: DatasetFeatures,
    *,
    ap: str = "standard",
    rerank: bool = False,
    protocol: str = "standard",
    seed: int = 0,
    max_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[dict[str, Any], Optional[np.ndarray]]:
    """``(result, reranked)``: the metrics dict (rank1..rank20, mAP, counts, per_query) and re-ranked scores.

    ``reranked`` is the query x gallery similarity (minus the re-ranked
    distance) when ``rerank``: the re-ranker builds it anyway, and the
    pictures must show that ranking. Otherwise it is None: the metrics run
    block-wise in :func:`~fedreid.eval.metrics.evaluate` (peak memory set by
    ``max_block_bytes``, not by Q x G), and :func:`query_scores` later
    computes the rows of the few queries drawn.

    ``protocol="cuhk03"``: the single-gallery-shot CMC
    (:func:`~fedreid.eval.metrics.evaluate_cuhk03_single_shot`,
    :data:`CUHK03_REPEATS` samplings from ``numpy.random.default_rng(seed)``,
    a fresh generator per dataset so the figures do not depend on which other
    datasets are evaluated); standard AP only, no re-ranking.

    Bad features or ids raise :class:`~fedreid.eval.metrics.EvalDataError`
    naming the dataset and :attr:`DatasetFeatures.source`; degenerate
    features (:func:`~fedreid.eval.features.check_features`) are among them.
    """
    from fedreid.eval.metrics import evaluate, evaluate_cuhk03_single_shot, evaluate_scores

    _check_protocol(protocol, ap, rerank)
    q, g = feats.query, feats.gallery
    ranks = tuple(range(1, CMC_RANKS + 1))
    ids = (q.pids, g.pids, q.camids, g.camids)
    common = {"ranks": ranks, "return_per_query": True, "max_block_bytes": max_block_bytes}
    reranked = None
    try:
        _check_dataset_features(feats)
        if rerank:
            from fedreid.eval.rerank import k_reciprocal_rerank

            reranked = k_reciprocal_rerank(q.features, g.features)
            np.negative(reranked, out=reranked)  # distance -> similarity, in place (no second Q x G array)
            result = evaluate_scores(reranked, *ids, ap=ap, **common)
        elif protocol == "cuhk03":
            rng = np.random.default_rng(seed)
            result = evaluate_cuhk03_single_shot(
                q.features, g.features, *ids, rng=rng, num_repeats=CUHK03_REPEATS, **common
            )
        else:
            result = evaluate(q.features, g.features, *ids, ap=ap, **common)
    except EvalDataError as exc:
        where = feats.source or "features given in memory"
        raise type(exc)(f"dataset {feats.name!r} ({where}): {exc}") from None
    result["num_gallery"] = int(g.features.shape[0])
    result["protocol"] = protocol
    return result, reranked


def summary_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of an :func:`evaluate_dataset` result."""
    row: dict[str, Any] = {k: float(result[k]) for k in ("rank1", "rank5", "rank10", "mAP")}
    row["cmc"] = [float(result[f"rank{k}"]) for k in result["ranks"]]
    for key in ("num_queries", "num_valid_queries", "num_queries_without_match", "num_gallery"):
        row[key] = int(result[key])
    return row


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
    stored, or the same file through another relative/absolute spelling) or
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
    feats: DatasetFeatures, queries: Sequence[int], reranked: Optional[np.ndarray] = None
) -> np.ndarray:
    """Similarity rows ``[len(queries), G]`` (float32) of the given queries only.

    The inner products the metrics rank by, or rows of ``reranked``
    (:func:`evaluate_dataset`'s). Drawing a few ranked lists thus costs a few
    gallery-length rows, not a query x gallery matrix.
    """
    idx = np.asarray(queries, dtype=np.int64).reshape(-1)
    if reranked is not None:
        return np.asarray(reranked[idx], dtype=np.float32)
    return feats.query.features[idx] @ feats.gallery.features.T


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
    rows = query_scores(feats, [i for i, _ in picks], reranked)
    out = []
    for (i, tag), row in zip(picks, rows):
        top, correct = filtered_top_k(row, int(q.pids[i]), int(q.camids[i]), g.pids, g.camids, k=top_k)
        out.append(RankedList(i, tag, top, correct, row[top]))
    return out


def draw_dataset_pictures(
    feats: DatasetFeatures,
    result: Mapping[str, Any],
    out_dir: str | Path,
    n: int,
    *,
    queries: Sequence[int] = (),
    reranked: Optional[np.ndarray] = None,
    top_k: int = 10,
) -> list[Path]:
    """PNGs (green: true match, red: wrong) of :func:`ranked_lists` in ``out_dir``.

    Named ``<dataset>_{best,worst}_q<index>.png`` and, for the chosen
    ``queries``, ``<dataset>_query_q<index>.png``.
    """
    from fedreid.eval.visualize import draw_ranked_list

    q, g = feats.query, feats.gallery
    written = []
    for r in ranked_lists(feats, result, pictures=n, queries=queries, reranked=reranked, top_k=top_k):
        out = Path(out_dir) / f"{feats.name}_{r.tag}_q{r.query:05d}.png"
        paths = [g.paths[j] for j in r.gallery]
        written.append(draw_ranked_list(q.paths[r.query], paths, list(r.correct), r.scores, out, top_k=top_k))
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


@dataclass(frozen=True)
class SkippedImage:
    """An image left out because it could not be read: its path and why (fixed words, no addresses)."""

    path: str
    reason: str


def _skip_reason(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, OSError):
        return f"cannot read the file ({cause.strerror or type(cause).__name__})"
    return "cannot decode the image (empty, corrupt or not an image)"


def _image_batches(
    paths: Sequence[Path], height: int, width: int, batch_size: int, skipped: Optional[list[SkippedImage]]
) -> Iterator[dict[str, Any]]:
    """Batches in the loader contract of :func:`~fedreid.eval.features.extract_features`, in ``paths`` order.

    An unreadable image is appended to ``skipped`` and left out, or, when
    ``skipped`` is None, an :class:`EvalInputError` naming it.
    """
    from fedreid.data.datasets import ImageReadError, read_image
    from fedreid.data.transforms import build_test_transform

    transform = build_test_transform(height, width)
    batch: list[tuple[Any, int, int, str]] = []

    def collate() -> dict[str, Any]:
        images, pids, camids, names = zip(*batch)
        return {
            "images": torch.stack(images),
            "pids": torch.tensor(pids, dtype=torch.int64),
            "camids": torch.tensor(camids, dtype=torch.int64),
            "paths": list(names),
        }

    for path in paths:
        try:
            image = read_image(path)
        except ImageReadError as exc:
            if skipped is None:
                raise EvalInputError(
                    f"{exc}: pass --skip-bad-images to list unreadable images in {SKIPPED_FILE} and go on"
                ) from None
            skipped.append(SkippedImage(str(path), _skip_reason(exc)))
            continue
        pid, camid = parse_market_name(path)
        batch.append((transform(image), pid, camid, str(path)))
        if len(batch) == batch_size:
            yield collate()
            batch = []
    if batch:
        yield collate()


def image_features(
    loaded: LoadedModel,
    paths: Sequence[Path],
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    skipped: Optional[list[SkippedImage]] = None,
    where: str = "images",
    identical_ok: bool = False,
) -> FeatureSet:
    """Features of image files, with Market-style ids/cameras (-1 when the name has none).

    ``skipped``: None aborts at the first unreadable image (an
    :class:`EvalInputError` naming it); a list collects them
    (:class:`SkippedImage`, in ``paths`` order) and the features cover the
    readable images only, in order (none readable is an error). The features
    pass :func:`~fedreid.eval.features.check_features`, whose errors name the
    model and ``where`` (e.g. ``"gallery photos/"``); ``identical_ok``
    allows all-identical rows (query images may be copies of one another).
    """
    if int(batch_size) < 1:
        raise EvalInputError(f"--batch-size must be >= 1, got {batch_size}")
    first_skip = len(skipped) if skipped is not None else 0
    batches = _image_batches(
        paths, int(loaded.config["height"]), int(loaded.config["width"]), int(batch_size), skipped
    )
    try:
        fs = _features(loaded, batches, torch.device(device), amp=amp, channels_last=channels_last)
    except EvalDataError:
        if skipped is not None and len(skipped) - first_skip == len(paths):
            raise EvalInputError(
                f"none of the {len(paths)} images of {where} could be read (e.g. {skipped[first_skip].path}: "
                f"{skipped[first_skip].reason})"
            ) from None
        raise
    check_features(fs.features, f"model {loaded.source} on {where}", paths=fs.paths, identical_ok=identical_ok)
    return fs


def write_skipped_csv(path: str | Path, skipped: Sequence[SkippedImage]) -> Path:
    """``path`` (atomically): a ``path,reason`` header and one row per skipped image, in order."""
    from fedreid.utils.io import write_text_atomic

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "reason"])
    writer.writerows([s.path, s.reason] for s in skipped)
    write_text_atomic(path, buffer.getvalue())
    return Path(path)


def _check_index_location(gallery: Path, index_dir: Path) -> None:
    """Refuse an index folder that is the gallery folder or lies inside it (symlinks resolved)."""
    if not gallery.is_dir():
        return
    g, i = gallery.resolve(), index_dir.resolve()
    if i == g or g in i.parents:
        where = "is the gallery folder" if i == g else f"is inside the gallery folder {gallery}"
        raise EvalInputError(
            f"--index {index_dir} {where}: the index files would be written among the images; "
            "choose a folder outside the gallery (nothing was changed)"
        )


def build_gallery_index(
    loaded: LoadedModel,
    gallery: str | Path,
    index_dir: str | Path,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    faiss_gpu: bool = False,
    skipped: Optional[list[SkippedImage]] = None,
) -> tuple[Path, int]:
    """Index every image under ``gallery`` into ``index_dir``; returns ``(folder, number of images indexed)``.

    ``index_dir`` must be new, empty, marked as a fedreid index folder holding
    nothing but the index's files, or an index folder of an earlier version
    (then adopted); anything else, and a folder that is or lies inside the
    gallery folder, raises before any work
    (:class:`~fedreid.utils.io.OutputDirError` / :class:`EvalInputError`) and
    changes nothing. The folder is replaced as a whole, so an interrupted
    build leaves the previous index or the new one, never a mix (a hidden
    sibling ``.<name>.tmp-*`` / ``.<name>.old-*`` it leaves is removed by the
    next build). The header records the model's fingerprint
    (:func:`model_fingerprint`) for :func:`query_index`. ``skipped``: as in
    :func:`image_features`; when given, the images left out are listed in
    ``index_dir/skipped.csv``. ``faiss_gpu`` builds the index on the GPU (see
    :func:`resolve_faiss_gpu`); the saved file is the same either way (a CPU
    copy is written).
    """
    from fedreid.eval.retrieval import build_index, is_index_folder, save_index
    from fedreid.utils.io import claim_output_dir

    device = torch.device(device)
    gallery, index_dir = Path(gallery), Path(index_dir)
    paths = list_images(gallery, "gallery")
    _check_index_location(gallery, index_dir)
    adopt = index_dir.is_dir() and not index_dir.is_symlink() and is_index_folder(index_dir, extra_files=(SKIPPED_FILE,))
    claim_output_dir(index_dir, "index", tool=_TOOL_INDEX, adopt=adopt)
    _refuse_foreign_files(index_dir)
    _remove_index_temporaries(index_dir)
    first_skip = len(skipped) if skipped is not None else 0
    fs = image_features(
        loaded, paths, batch_size=batch_size, device=device, amp=amp, channels_last=channels_last,
        skipped=skipped, where=f"gallery {gallery}",
    )
    left_out = list(skipped[first_skip:]) if skipped is not None else []
    meta = {
        "model": str(loaded.source), "round": loaded.round, "gallery": str(gallery.resolve()),
        "model_fingerprint": loaded.fingerprint, "skipped": len(left_out),
    }
    index = build_index(fs.features, use_gpu=bool(faiss_gpu), gpu_id=_faiss_gpu_id(device))
    stage = _index_temporary(index_dir, "tmp")
    try:
        claim_output_dir(stage, "index", tool=_TOOL_INDEX)  # new: created and marked
        save_index(
            stage, index, ids=fs.pids, cameras=fs.camids,
            paths=[str(Path(p).resolve()) for p in fs.paths], meta=meta,
        )
        if left_out:
            write_skipped_csv(stage / SKIPPED_FILE, left_out)
        _swap_index_folder(stage, index_dir)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    return index_dir, len(fs.paths)


# An index folder is replaced as a whole: the new one is written into a hidden
# sibling ``.<name>.tmp-<hex>``, the old one moved aside to ``.<name>.old-<hex>``,
# the new one moved in, the old one deleted. A kill leaves the old index, the
# new one, or (between the two renames) none, the old one then moved back by the
# next build; never a mix. The next build removes the hidden siblings a kill
# left (only ones that are empty or marked).
_INDEX_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(tmp|old)-[0-9a-f]{8}$")


def _index_temporary(index_dir: Path, kind: str) -> Path:
    folder = Path(os.path.abspath(index_dir))
    return folder.with_name(f".{folder.name}.{kind}-{uuid.uuid4().hex[:8]}")


def _index_own_names() -> set[str]:
    from fedreid.eval.retrieval import HEADER_FILE, INDEX_FILE, META_FILE
    from fedreid.utils.io import marker_path

    return {HEADER_FILE, INDEX_FILE, META_FILE, SKIPPED_FILE, marker_path(".", "index").name}


def _refuse_foreign_files(index_dir: Path) -> None:
    """An index folder is replaced as a whole: refuse (changing nothing) when it holds anyone else's files."""
    own = _index_own_names()
    foreign = sorted(
        p.name for p in index_dir.iterdir()
        if p.name not in own and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise EvalInputError(
            f"index folder {index_dir} also holds files that are not the index's ({shown}); a new index replaces "
            "the whole folder: move them elsewhere or choose another folder (nothing was changed)"
        )


def _remove_index_temporaries(index_dir: Path) -> None:
    """Clean up the hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings an interrupted build left.

    A marked ``.old-*`` folder is moved back when the kill fell between the two
    renames of :func:`_swap_index_folder` (no index folder in place); other
    siblings are deleted when empty, marked, or holding only a marker's
    temporary file.
    """
    from fedreid.utils.io import is_marker_leftover, owns_folder

    folder = Path(os.path.abspath(index_dir))
    for p in sorted(folder.parent.iterdir()):
        match = _INDEX_TEMPORARY.match(p.name)
        if match is None or match["name"] != folder.name or p.is_symlink() or not p.is_dir():
            continue
        if p.name.startswith(f".{folder.name}.old-") and owns_folder(p, "index") and not folder.exists():
            os.replace(p, folder)
        elif owns_folder(p, "index") or all(is_marker_leftover(q, "index") for q in p.iterdir()):
            shutil.rmtree(p)


def _swap_index_folder(stage: Path, index_dir: Path) -> None:
    _refuse_foreign_files(index_dir)  # checked again right before anything is moved
    old = _index_temporary(index_dir, "old")
    os.replace(index_dir, old)
    os.replace(stage, index_dir)
    shutil.rmtree(old)


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
    amp: bool = False,
    channels_last: bool = False,
    faiss_gpu: bool = False,
    allow_model_mismatch: bool = False,
    warn: Optional[Callable[[str], None]] = None,
    skipped: Optional[list[SkippedImage]] = None,
) -> list[QueryResult]:
    """Search the index in ``index_dir`` with every image of ``images`` (a file or a folder).

    The index must have been built with ``loaded``'s model (equal
    fingerprints, :func:`check_index_model`), checked before any image is
    read: otherwise :class:`ModelMismatchError`, or, with
    ``allow_model_mismatch``, ``warn`` (default :func:`warnings.warn`) gets
    the differences and the search goes on. ``skipped``: as in
    :func:`image_features`. ``faiss_gpu`` loads the index onto the GPU (see
    :func:`resolve_faiss_gpu`).
    """
    import warnings

    from fedreid.eval.retrieval import load_index, search

    device = torch.device(device)
    index = load_index(index_dir, use_gpu=bool(faiss_gpu), gpu_id=_faiss_gpu_id(device))
    mismatch = check_index_model(index.header, loaded, index_dir, allow_mismatch=allow_model_mismatch)
    if mismatch is not None:
        (warn or (lambda m: warnings.warn(m, UserWarning, stacklevel=3)))(mismatch)
    paths = list_images(images, "query")
    fs = image_features(
        loaded, paths, batch_size=batch_size, device=device, amp=amp, channels_last=channels_last,
        skipped=skipped, where=f"query images {images}", identical_ok=True,
    )
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
    queries: Sequence[str] = (),
    protocol: str = "standard",
    seed: int = 0,
    source: Optional[str] = None,
) -> dict[str, Any]:
    """Evaluate each dataset, then write ``results.json``, ``cmc.png`` and ranked-list PNGs to ``out_dir``.

    ``pictures``: best/worst queries by AP per dataset (:func:`picked_queries`);
    ``queries``: specs of :func:`chosen_queries` drawn as well (an index
    applies to every dataset, a path or file name to the datasets holding it;
    one no dataset holds is an error, raised before anything is evaluated).
    ``protocol``/``seed``: see :func:`evaluate_dataset`.

    Returns what ``results.json`` holds: ``datasets`` ({name: rank1, rank5,
    rank10, mAP, cmc, counts}), ``mean`` (of rank1/5/10/mAP), ``ap``,
    ``protocol``, ``rerank``, ``source``, ``pictures`` and ``cmc_plot`` (paths).
    """
    from fedreid.utils.io import write_json_atomic

    feature_sets = list(feature_sets)
    if not feature_sets:
        raise EvalInputError("nothing to evaluate: no datasets given")
    _check_protocol(protocol, ap, rerank)
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
    title = "CMC (re-ranked)" if rerank else "CMC (CUHK03 single-gallery-shot)" if protocol == "cuhk03" else "CMC"
    cmc_path = plot_cmc_curves(results, out_dir / "cmc.png", title=title)
    report = {
        "source": source,
        "ap": ap,
        "protocol": protocol,
        "rerank": rerank,
        "datasets": rows,
        "mean": {m: float(np.mean([r[m] for r in rows.values()])) for m in ("rank1", "rank5", "rank10", "mAP")},
        "pictures": [str(p) for p in drawn],
        "cmc_plot": str(cmc_path),
    }
    if protocol == "cuhk03":
        report.update(seed=int(seed), repeats=CUHK03_REPEATS)
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


def _is_feature_cache(path: Path) -> bool:
    from fedreid.eval.features import FEATURE_KEYS

    if path.suffix != ".npz" or not path.is_file() or path.is_symlink():
        return False
    try:
        if file_kind(path) != "zip":
            return False
        with np.load(path, allow_pickle=False) as data:
            return all(key in data.files for key in FEATURE_KEYS)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False


def claim_features_dir(folder: str | Path) -> Path:
    """Make ``folder`` a ``--save-features`` folder (kind ``features``), or refuse without touching it.

    New, empty and marked folders are taken, and an unmarked one that holds
    only feature caches (``.npz`` files with the arrays of
    :func:`~fedreid.eval.features.save_features`); a folder of anyone else's
    files raises :class:`~fedreid.utils.io.OutputDirError`.
    """
    from fedreid.utils.io import claim_output_dir

    folder = Path(folder)
    adopt = (
        folder.is_dir() and not folder.is_symlink() and any(folder.iterdir())
        and all(_is_feature_cache(p) for p in folder.iterdir())
    )
    return claim_output_dir(folder, "features", tool="tools/eval_reid.py evaluate --save-features", adopt=adopt)
