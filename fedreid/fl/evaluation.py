"""Evaluation during training: features of query/gallery sets -> CMC/mAP.

Wiring only: features come from :func:`fedreid.inference.features.extract_features`
(flip-averaged, L2-normalised ``embed`` output in eval mode) and metrics from
:func:`fedreid.eval.metrics.evaluate`. Loaders are built once per dataset and
reused every evaluation.

Besides the AP form ``ap`` (key ``mAP``), every form in ``extra_ap`` is
computed from the same features and kept as ``mAP_<form>``: with the default
``eval.extra_ap: [official]`` each record carries ``mAP_official``, the
Market-1501 trapezoid AP averaged over all queries (a query without a true
match scores 0), as the reference's evaluation (``evaluate.py`` ``testing_model``) reports
it, next to the standard AP, and ``rank<k>_official``, its CMC, also over all
queries (ours, ``rank<k>``, leaves out the queries without a match). Every
record also carries ``mINP`` (Ye et al., TPAMI 2021), averaged like ``mAP``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fedreid.data.prepared import PreparedDataset
from fedreid.inference.embed import EmbedModule, FeatureBatches

#: The metric keys kept in round records (``num_queries_without_match``: queries
#: the standard protocol skips and the official one scores 0).
KEEP_KEYS = ("mAP", "num_valid_queries", "num_queries", "num_queries_without_match")


class Evaluator:
    """Evaluates a model on the query/gallery splits of several datasets.

    ``datasets``: prepared datasets by name (each needs query and gallery
    images). Calling the evaluator returns ``{name: {"rank1", ..., "mAP",
    "num_valid_queries"}}`` and leaves the model in the mode it was in.
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
        extra_ap: Sequence[str] = ("official",),
        normalize_on: str = "auto",
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
        self.normalize_on = normalize_on
        self._sets: dict[str, dict[str, Any]] = {}
        for name, ds in self.datasets.items():
            for split in ("query", "gallery"):
                if not ds.split(split):
                    raise ValueError(f"evaluation dataset {name!r} has no {split} images")

    @classmethod
    def from_config(cls, cfg, datasets: Mapping[str, PreparedDataset], device) -> "Evaluator":
        return cls(
            datasets, height=cfg.model.height, width=cfg.model.width, batch_size=cfg.eval.batch_size,
            flip=cfg.eval.flip, ap=cfg.eval.ap, ranks=cfg.eval.ranks, device=device,
            workers=cfg.train.workers, extra_ap=cfg.eval.extra_ap, normalize_on=cfg.train.normalize_on,
        )

    def _loaders(self, name: str) -> dict[str, Any]:
        if name not in self._sets:
            from fedreid.data.datasets import ReIDImageDataset, make_loader, on_device
            from fedreid.data.transforms import build_test_transform, defers_normalize

            transform = build_test_transform(
                self.height, self.width, defer_normalize=defers_normalize(self.normalize_on, self.device)
            )
            entry: dict[str, Any] = {}
            for split in ("query", "gallery"):
                records = self.datasets[name].split(split)
                dataset = ReIDImageDataset(records, None, transform=transform)
                loader = make_loader(dataset, self.batch_size, shuffle=False, seed=0, num_workers=self.workers,
                                     pin_memory=self.device.type == "cuda")
                entry[split] = {
                    "loader": on_device(loader, transform, self.device),
                    "pids": np.array([r.pid for r in records], dtype=np.int64),
                    "camids": np.array([r.camid for r in records], dtype=np.int64),
                }
            self._sets[name] = entry
        return self._sets[name]

    def features(self, model: nn.Module, loader) -> Tensor:
        """Flip-averaged, L2-normalised features of ``loader``'s images, float32 [N, D].

        On the evaluator's CUDA device the tensor stays there, so
        :func:`~fedreid.eval.metrics.evaluate` ranks on the GPU and copies no
        scores back; elsewhere it is a CPU tensor (the numpy ranking path).
        """
        from fedreid.inference.features import extract_features

        out = extract_features(
            EmbedModule(model), FeatureBatches(loader), flip=self.flip, normalize=True, device=self.device
        )
        features = torch.from_numpy(np.ascontiguousarray(out.features))
        return features.to(self.device) if self.device.type == "cuda" else features

    def evaluate_dataset(self, model: nn.Module, name: str) -> dict[str, Any]:
        from fedreid.eval.metrics import evaluate

        sets = self._loaders(name)
        qf = self.features(model, sets["query"]["loader"])
        gf = self.features(model, sets["gallery"]["loader"])
        result = evaluate(
            qf, gf, sets["query"]["pids"], sets["gallery"]["pids"],
            sets["query"]["camids"], sets["gallery"]["camids"], ap=self.ap, ranks=self.ranks, minp=True,
        )
        keep = {f"rank{k}": float(result[f"rank{k}"]) for k in self.ranks}
        keep["mINP"] = float(result["mINP"])
        keep.update({k: (float(result[k]) if k == "mAP" else int(result[k])) for k in KEEP_KEYS if k in result})
        for form in self.extra_ap:
            other = evaluate(
                qf, gf, sets["query"]["pids"], sets["gallery"]["pids"],
                sets["query"]["camids"], sets["gallery"]["camids"], ap=form, ranks=self.ranks,
            )
            keep[f"mAP_{form}"] = float(other["mAP"])
            if form == "official":  # the reference divides its CMC by all queries too (evaluate.py testing_model)
                keep.update({f"rank{k}_official": float(other[f"rank{k}"]) for k in self.ranks})
        return keep

    def __call__(self, model: nn.Module, names: Optional[Iterable[str]] = None) -> dict[str, dict[str, Any]]:
        names = list(self.datasets) if names is None else list(names)
        was_training = model.training
        try:
            return {name: self.evaluate_dataset(model, name) for name in names}
        finally:
            model.train(was_training)

