"""Prepared datasets -> query and gallery features (:class:`DatasetFeatures`), and their ``.npz`` cache.

Features from every source (a model over a prepared dataset, a feature file)
pass :func:`fedreid.inference.features.check_features` before any figure is made
from them: NaN/inf, all-zero or all-identical features are an error naming
their source, not plausible-looking numbers from ties.

Feature caches (:func:`save_dataset_features`): one ``.npz`` per dataset in
the :func:`fedreid.inference.features.save_features` format, query rows first,
then gallery rows; ``meta`` holds ``dataset`` and ``num_query``. Their folder
is claimed with :func:`claim_features_dir`.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from fedreid.inference.errors import EvalInputError
from fedreid.inference.features import FeatureSet, check_features, load_features, save_features, with_progress
from fedreid.inference.model_io import LoadedModel, model_features
from fedreid.utils.filecheck import file_kind
from fedreid.utils.io import shown_path

if TYPE_CHECKING:
    import torch

    from fedreid.utils.precision import Precision

__all__ = [
    "DatasetFeatures",
    "resolve_datasets",
    "dataset_features",
    "save_dataset_features",
    "load_dataset_features",
    "claim_features_dir",
]


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
    from fedreid.options import did_you_mean

    root = Path(prepared_root)
    available = _prepared_names(root)
    if list(names) == ["all"]:
        if not available:
            raise FileNotFoundError(f"no prepared datasets under {shown_path(root)}")
        return available
    unknown = [n for n in names if n not in available]
    if unknown:
        raise PreparedDatasetError(
            f"unknown dataset {unknown[0]!r}{did_you_mean(unknown[0], available)}: {root / unknown[0]} is not a "
            f"prepared dataset (available under {shown_path(root)}: {', '.join(available) or 'none'})"
        )
    return list(names)


def _split_loader(records: Sequence[Any], height: int, width: int, batch_size: int):
    from fedreid.data.datasets import ReIDImageDataset, make_loader
    from fedreid.data.transforms import build_test_transform
    from fedreid.inference.embed import FeatureBatches

    dataset = ReIDImageDataset(records, None, transform=build_test_transform(height, width))
    return FeatureBatches(make_loader(dataset, batch_size, shuffle=False, seed=0))


def dataset_features(
    loaded: LoadedModel,
    prepared_root: str | Path,
    name: str,
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    precision: Optional[Precision] = None,
    progress: bool = False,
    flip: bool = True,
) -> DatasetFeatures:
    """Features of the query and gallery splits of prepared dataset ``name``.

    ``precision``: the arithmetic of the extraction (a resolved
    :class:`~fedreid.utils.precision.Precision`; default fp32): the forwards
    run under its autocast, in its layout (``channels_last``), and its name is
    recorded in the features' ``meta``, with the model file (absolute), its
    round, fingerprint and client (a local-training baseline's). ``flip``: average with the horizontal flip
    (``eval.flip``, recorded in ``meta``). Degenerate features (NaN/inf, all
    zero, all identical; :func:`~fedreid.inference.features.check_features`)
    raise an error naming the model and the dataset. ``progress``: a bar per
    split on stderr.
    """
    from fedreid.data.prepared import PreparedDatasetError, load_prepared
    from fedreid.utils.precision import FP32

    precision = precision or FP32
    ds = load_prepared(prepared_root, name)
    sets = {}
    for split in ("query", "gallery"):
        records = ds.split(split)
        if not records:
            raise PreparedDatasetError(f"dataset {name!r} at {ds.root} has no {split} images")
        loader = _split_loader(records, int(loaded.config["height"]), int(loaded.config["width"]), batch_size)
        loader = with_progress(loader, len(records), f"{name} {split}", progress)
        with precision.autocast():
            features = model_features(loaded, loader, device, channels_last=precision.channels_last, flip=flip).features
        sets[split] = FeatureSet(
            features=features,
            pids=np.array([r.pid for r in records], dtype=np.int64),
            camids=np.array([r.camid for r in records], dtype=np.int64),
            paths=[str(r.path) for r in records],
        )
        check_features(
            sets[split].features, f"model {loaded.source} on dataset {name!r}: {split}", paths=sets[split].paths
        )
    # The model file absolute: a cache read from another working directory still names it.
    meta = {"dataset": name, "model": str(Path(loaded.source).resolve()), "round": loaded.round, "flip": flip,
            "precision": precision.name}
    if loaded.fingerprint:
        meta["model_fingerprint"] = loaded.fingerprint
    if loaded.client is not None:  # a local-training baseline's file holds one model per client
        meta["client"] = loaded.client
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

    A ``name`` other than the dataset the file's meta names is an
    :class:`EvalInputError` naming the file and both names: a cache is never
    relabelled as another dataset. Besides :func:`~fedreid.inference.features.load_features`'s checks, each split
    passes :func:`~fedreid.inference.features.check_features`: NaN/inf, all-zero or
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

    recorded = meta.get("dataset")
    if name and recorded and name != recorded:
        raise EvalInputError(
            f"feature file {path} holds the features of dataset {recorded!r}, not {name!r}: "
            f"give it without a name or as {recorded}=FILE"
        )
    name = name or recorded or Path(path).stem
    feats = DatasetFeatures(name, part(slice(0, n)), part(slice(n, None)), meta, source=f"feature file {path}")
    _check_dataset_features(feats, f"feature file {path}")
    return feats


def _check_dataset_features(feats: DatasetFeatures, where: Optional[str] = None) -> None:
    """Refuse a split whose ids, cameras or paths (when given) are not one per feature row, then degenerate features.

    Each error (an :class:`~fedreid.errors.EvalDataError`) names the split
    (after ``where``): a path list of another length would put other images
    in the ranked-list pictures.
    """
    from fedreid.errors import EvalDataError

    for split, fs in (("query", feats.query), ("gallery", feats.gallery)):
        label = f"{where}: {split}" if where else split
        shape = getattr(fs.features, "shape", ())
        if len(shape) >= 1:
            rows = int(shape[0])
            given = {"ids": fs.pids, "cameras": fs.camids, "paths": fs.paths}
            for what, values in given.items():
                if values is not None and len(values) != rows:
                    raise EvalDataError(
                        f"{label}: {rows} feature rows but {len(values)} {what}: each row needs its own"
                    )
        check_features(fs.features, label, paths=fs.paths)


def _is_feature_cache(path: Path) -> bool:
    from fedreid.inference.features import FEATURE_KEYS

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
    :func:`~fedreid.inference.features.save_features`); a folder of anyone else's
    files raises :class:`~fedreid.utils.io.OutputDirError`.
    """
    from fedreid.utils.io import claim_output_dir

    folder = Path(folder)
    adopt = (
        folder.is_dir() and not folder.is_symlink() and any(folder.iterdir())
        and all(_is_feature_cache(p) for p in folder.iterdir())
    )
    return claim_output_dir(folder, "features", tool="tools/eval_reid.py evaluate --save-features", adopt=adopt)
