"""Evaluation during training: features of query/gallery sets -> CMC/mAP.

Wiring only: features come from :func:`fedreid.inference.features.extract_features`
(flip-averaged, L2-normalised ``embed`` output in eval mode) and metrics from
:func:`fedreid.eval.metrics.evaluate`. Every query and gallery set is read
through one :class:`~fedreid.data.datasets.SegmentLoader`, built on first use:
its workers persist across evaluations, and one evaluation reads all its sets
in one stream, each batched as a loader of its own would be (so the features
do not depend on which sets are read together, nor on the worker count).

Besides the AP form ``ap`` (key ``mAP``), every form in ``extra_ap`` is
computed from the same features and kept as ``mAP_<form>``: with the default
``eval.extra_ap: [official]`` each record carries ``mAP_official``, the
Market-1501 trapezoid AP averaged over all queries (a query without a true
match scores 0), as the reference's evaluation (``evaluate.py``, its loop over ``evaluate``/``compute_mAP``) reports
it, next to the standard AP, and ``rank<k>_official``, its CMC, also over all
queries (ours, ``rank<k>``, leaves out the queries without a match). Every
record also carries ``mINP`` (Ye et al., TPAMI 2021), averaged like ``mAP``.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fedreid.data.prepared import PreparedDataset
from fedreid.inference.embed import EmbedModule, FeatureBatches
from fedreid.utils.precision import resolve_precision

#: The metric keys kept in round records (``num_queries_without_match``: queries
#: the standard protocol skips and the official one scores 0).
KEEP_KEYS = ("mAP", "num_valid_queries", "num_queries", "num_queries_without_match")


def eval_workers(cfg) -> int:
    """Loader workers of the run's evaluation: ``eval.workers``, or when null the run's training workers in all.

    The training loaders (``train.workers`` per client, ``run.concurrent_clients``
    clients at once) are idle while the server evaluates, so evaluation takes
    their cores: ``train.workers * run.concurrent_clients``, at most the CPU
    count. The worker count changes speed, not features.
    """
    if cfg.eval.workers is not None:
        return int(cfg.eval.workers)
    return min(cfg.train.workers * cfg.run.concurrent_clients, os.cpu_count() or 1)


class Evaluator:
    """Evaluates a model on the query/gallery splits of several datasets.

    ``datasets``: prepared datasets by name (each needs query and gallery
    images). Calling the evaluator returns ``{name: {"rank1", ..., "mAP",
    "num_valid_queries"}}`` and leaves the model in the mode it was in.
    ``precision``: the arithmetic of feature extraction (``eval.precision``,
    resolved on ``device`` by :func:`~fedreid.utils.precision.resolve_precision`):
    fp32 runs no autocast; bf16 and fp16 run under autocast, channels-last on
    CUDA. The features are float32 either way.
    """

    def __init__(
        self,
        datasets: Mapping[str, PreparedDataset],
        *,
        height: int,
        width: int,
        batch_size: int = 128,
        flip: bool = True,
        ap: str = "standard",
        ranks: Sequence[int] = (1, 5, 10),
        device: torch.device | str = "cpu",
        workers: int = 0,
        persistent_workers: bool = True,
        extra_ap: Sequence[str] = ("official",),
        normalize_on: str = "auto",
        precision: str = "fp32",
    ) -> None:
        self.datasets = dict(datasets)
        self.height, self.width = height, width
        self.batch_size = batch_size
        self.flip = flip
        self.ap = ap
        self.extra_ap = tuple(dict.fromkeys(a for a in extra_ap if a != ap))
        self.ranks = tuple(ranks)
        self.device = torch.device(device)
        self.workers = workers
        self.persistent_workers = persistent_workers
        self.normalize_on = normalize_on
        self.precision = resolve_precision(precision, self.device, field="eval.precision").for_extraction()
        self._images: Any = None  # the SegmentLoader over every query and gallery set, built on first use
        self._transform: Any = None
        self._id_arrays: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        for name, ds in self.datasets.items():
            for split in ("query", "gallery"):
                if not ds.split(split):
                    raise ValueError(f"evaluation dataset {name!r} has no {split} images")

    @classmethod
    def from_config(cls, cfg, datasets: Mapping[str, PreparedDataset], device,
                    workers: Optional[int] = None) -> "Evaluator":
        """The run's evaluator; ``workers`` defaults to :func:`eval_workers` (``eval.workers``)."""
        return cls(
            datasets, height=cfg.model.height, width=cfg.model.width, batch_size=cfg.eval.batch_size,
            flip=cfg.eval.flip, ap=cfg.eval.ap, ranks=cfg.eval.ranks, device=device,
            workers=eval_workers(cfg) if workers is None else workers,
            persistent_workers=cfg.train.persistent_workers, extra_ap=cfg.eval.extra_ap,
            normalize_on=cfg.train.normalize_on, precision=cfg.eval.precision,
        )

    def with_workers(self, workers: int) -> "Evaluator":
        """This evaluator reading its images with ``workers`` loader workers (its own, not yet started)."""
        other = copy.copy(self)
        other.workers, other._images = workers, None
        return other

    def _loader(self, splits: Sequence[tuple[str, str]]) -> Iterable:
        """The batches of ``splits`` (``(dataset, "query"|"gallery")``), in order, through one persistent loader."""
        from fedreid.data.datasets import ReIDImageDataset, SegmentLoader, on_device

        if self._images is None:
            from fedreid.data.transforms import build_test_transform, defers_normalize

            self._transform = build_test_transform(
                self.height, self.width, defer_normalize=defers_normalize(self.normalize_on, self.device)
            )
            segments = {(name, split): ReIDImageDataset(ds.split(split), None, transform=self._transform)
                        for name, ds in self.datasets.items() for split in ("query", "gallery")}
            self._images = SegmentLoader(segments, self.batch_size, num_workers=self.workers,
                                         pin_memory=self.device.type == "cuda", persistent=self.persistent_workers)
        return on_device(self._images.read(splits), self._transform, self.device)

    def features(self, model: nn.Module, loader) -> Tensor:
        """Flip-averaged, L2-normalised features of ``loader``'s images, float32 [N, D].

        On the evaluator's CUDA device the tensor stays there, so
        :func:`~fedreid.eval.metrics.evaluate` ranks on the GPU and copies no
        scores back; elsewhere it is a CPU tensor (the numpy ranking path).
        """
        return self._on_device(self._host_features(model, loader))

    def _host_features(self, model: nn.Module, loader) -> Tensor:
        from fedreid.inference.features import extract_features

        with self.precision.autocast():
            out = extract_features(EmbedModule(model), FeatureBatches(loader), flip=self.flip, normalize=True,
                                   device=self.device, channels_last=self.precision.channels_last)
        return torch.from_numpy(np.ascontiguousarray(out.features))

    def _on_device(self, features: Tensor) -> Tensor:
        return features.to(self.device) if self.device.type == "cuda" else features

    def split_features(self, model: nn.Module, names: Sequence[str]) -> dict[tuple[str, str], Tensor]:
        """The features of the query and gallery sets of ``names``, by ``(name, split)``, from one pass.

        The sets are read in one stream, each batched from its own start, so
        every image meets the batch it would in a loader of its set alone.
        The tensors are on the host; :meth:`evaluate_dataset` moves one
        dataset's at a time to the device.
        """
        splits = [(name, split) for name in names for split in ("query", "gallery")]
        features = self._host_features(model, self._loader(splits))
        sizes = [self._images.size(key) for key in splits]
        return dict(zip(splits, torch.split(features, sizes)))

    def _ids(self, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The pids and camids of a set, read from its records once."""
        if (name, split) not in self._id_arrays:
            records = self.datasets[name].split(split)
            self._id_arrays[(name, split)] = (np.array([r.pid for r in records], dtype=np.int64),
                                              np.array([r.camid for r in records], dtype=np.int64))
        return self._id_arrays[(name, split)]

    def evaluate_dataset(self, model: nn.Module, name: str,
                         features: Optional[Mapping[tuple[str, str], Tensor]] = None) -> dict[str, Any]:
        """The record of ``name``: CMC, mAP, mINP and ``extra_ap``, from ``features`` (else extracted here)."""
        from fedreid.eval.metrics import evaluate

        if features is None:
            features = self.split_features(model, [name])
        qf, gf = self._on_device(features[(name, "query")]), self._on_device(features[(name, "gallery")])
        (q_pids, q_camids), (g_pids, g_camids) = self._ids(name, "query"), self._ids(name, "gallery")
        result = evaluate(qf, gf, q_pids, g_pids, q_camids, g_camids, ap=self.ap, ranks=self.ranks, minp=True)
        keep = {f"rank{k}": float(result[f"rank{k}"]) for k in self.ranks}
        keep["mINP"] = float(result["mINP"])
        keep.update({k: (float(result[k]) if k == "mAP" else int(result[k])) for k in KEEP_KEYS if k in result})
        for form in self.extra_ap:
            other = evaluate(qf, gf, q_pids, g_pids, q_camids, g_camids, ap=form, ranks=self.ranks)
            keep[f"mAP_{form}"] = float(other["mAP"])
            if form == "official":  # the reference divides its CMC by all queries too (evaluate.py's loop over compute_mAP)
                keep.update({f"rank{k}_official": float(other[f"rank{k}"]) for k in self.ranks})
        return keep

    def __call__(self, model: nn.Module, names: Optional[Iterable[str]] = None) -> dict[str, dict[str, Any]]:
        names = list(self.datasets) if names is None else list(names)
        was_training = model.training
        try:
            features = self.split_features(model, names)
            return {name: self.evaluate_dataset(model, name, features) for name in names}
        finally:
            model.train(was_training)

