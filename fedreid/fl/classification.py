"""The classification track on the same core: partitioned clients, whole-model averaging, accuracy.

``task: classification`` reuses everything of the ReID engine -- the
:class:`~fedreid.fl.client.Client` round (seeded loaders, the client
objective, :func:`~fedreid.fl.local.sgd.train_local`), the
:class:`~fedreid.fl.server.Server` (sampling, averaging, hooks, checkpoints)
and :func:`~fedreid.fl.simulation.run_simulation` -- and changes only what
differs:

* data: a dataset read from local files
  (:func:`fedreid.data.classification.load_classification_dataset`) split over
  ``classification.num_clients`` clients by a seeded partitioner
  (:func:`fedreid.data.partition.partition`); every client keeps the global
  label space, so a client's split is ``ClientSplit(records=<sample indices>,
  labels=<their labels>, pids=range(C))``; its training images are augmented
  as ``classification.augment`` says (crop + flip for RGB sets by default,
  FedLMD Sec. 5.1; :func:`fedreid.data.transforms.build_classification_augment`),
  the test split never;
* model: a classifier of :mod:`fedreid.models.classifiers` named by
  ``model.backbone``, averaged whole (``fl.aggregation=fedavg``: there is no
  private head);
* evaluation: top-1 accuracy and mean cross-entropy of the global model on
  the test split (:class:`AccuracyEvaluator`);
* metadata: on request (``instructions["class_counts"]``, FedFTG) a client
  reports its per-class sample counts, optionally with relative noise
  (``classification.count_noise``);
* server hooks: SCAFFOLD/FedDyn's server halves, then FedFTG's data-free
  fine-tuning (``fl.fedftg``, :mod:`fedreid.fl.server_hooks.fedftg`) on top of
  any client objective.

The federation itself is built by :func:`fedreid.fl.federation.build_classification_federation`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.config import Config, ConfigError
from fedreid.data.classification import (
    ArrayDataset,
    ClassificationDataset,
    default_augment,
    digits_train_test,
    load_classification_dataset,
)
from fedreid.data.partition import PartitionError, noisy_counts, partition
from fedreid.data.scenarios import ClientSplit
from fedreid.data.transforms import build_classification_augment
from fedreid.fl.client import Client
from fedreid.fl.server_hooks.fedftg import CLASS_COUNTS
from fedreid.fl.state import clone_state
from fedreid.fl.update import Update
from fedreid.utils.seeding import derive_seed


def load_train_test(cfg: Config) -> tuple[ArrayDataset, ArrayDataset]:
    """The configured dataset's train and test splits (digits: a seeded stratified split).

    With ``classification.train_subset`` the training split is cut to
    :func:`stratified_subset` of that size. An empty split, splits naming
    different classes, or splits of different image sizes raise
    :class:`~fedreid.config.ConfigError`.
    """
    c = cfg.classification
    if c.dataset == "digits":  # one draw gives both parts, so they are complementary
        rng = np.random.default_rng(derive_seed(c.split_seed, "digits"))
        train, test = digits_train_test(rng, test_fraction=c.test_fraction)
    else:
        train = load_classification_dataset(c.dataset, c.root, "train")
        test = load_classification_dataset(c.dataset, c.root, "test")
    if len(test) == 0:
        hint = f" (classification.test_fraction={c.test_fraction} holds out no image of any class)" \
            if c.dataset == "digits" else ""
        raise ConfigError(f"classification.dataset={c.dataset}: the test split is empty{hint}")
    if len(train) == 0:
        hint = f" (classification.test_fraction={c.test_fraction} holds out every image)" \
            if c.dataset == "digits" else ""
        raise ConfigError(f"classification.dataset={c.dataset}: the training split is empty{hint}")
    if list(train.classes) != list(test.classes):
        # Labels number the classes of each split on its own: different lists would score
        # a test image of one class against another class's label.
        raise ConfigError(
            f"classification.dataset={c.dataset} (root {c.root}): the test split's classes {test.classes[:10]} differ from "
            f"the training split's {train.classes[:10]}; both splits must hold the same classes"
        )
    if train.images.shape[1:] != test.images.shape[1:]:
        # A model with global pooling would score them all the same, at a size it never trained on.
        raise ConfigError(
            f"classification.dataset={c.dataset} (root {c.root}): the test split's images are "
            f"{_shape(test.images)}, the training split's {_shape(train.images)}; both splits must hold images of one size"
        )
    if c.train_subset is not None:
        if c.train_subset > len(train):
            raise ConfigError(
                f"classification.train_subset={c.train_subset}: the {c.dataset} training split has only {len(train)} images"
            )
        rng = np.random.default_rng(derive_seed(c.split_seed, "train-subset"))
        train = train.subset(stratified_subset(train.labels, c.train_subset, rng))
    return train, test


def _shape(images: np.ndarray) -> str:
    """``H x W`` (grey) or ``H x W x C`` of one image of ``images``."""
    return " x ".join(str(n) for n in images.shape[1:])


def stratified_subset(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` sorted indices keeping each class's share of ``labels`` (largest remainder), drawn with ``rng``."""
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * size / labels.size
    take = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - take), kind="stable")
    take[order[: size - int(take.sum())]] += 1
    picked = [rng.choice(np.flatnonzero(labels == c), int(k), replace=False) for c, k in zip(classes, take)]
    return np.sort(np.concatenate(picked))


#: The ``classification.*`` config key that sets each partitioner argument
#: (what :func:`partition_clients` names when a split cannot be made).
PARTITION_CONFIG_KEYS: dict[str, str] = {
    "alpha": "classification.alpha",
    "beta": "classification.alpha",
    "min_size": "classification.min_size",
    "max_retries": "classification.max_retries",
    "num_clients": "classification.num_clients",
    "shards_per_client": "classification.shards_per_client",
    "unbalanced_sigma": "classification.unbalanced_sigma",
}


def partition_clients(cfg: Config, train: ArrayDataset) -> list[ClientSplit]:
    """``classification.num_clients`` splits of ``train`` by the configured (seeded) partitioner.

    The generator is seeded by ``derive_seed(classification.split_seed,
    "partition")``, so the split depends on the config alone. A split that
    cannot be made raises :class:`~fedreid.data.partition.PartitionError`
    whose message names the config keys to change
    (:data:`PARTITION_CONFIG_KEYS`), e.g. ``classification.min_size``; a
    client left without samples (``dirichlet`` with ``min_size: 0``) raises
    :class:`~fedreid.config.ConfigError`.
    """
    c = cfg.classification
    options: dict[str, Any] = {
        "iid": {},
        "dirichlet": {"alpha": c.alpha, "min_size": c.min_size, "max_retries": c.max_retries},
        "dirichlet_prior": {"beta": c.alpha, "unbalanced_sigma": c.unbalanced_sigma},
        "shards": {"shards_per_client": c.shards_per_client},
        "shards_per_class": {"shards_per_client": c.shards_per_client},
    }[c.partition]
    rng = np.random.default_rng(derive_seed(c.split_seed, "partition"))
    try:
        parts = partition(train.labels, c.partition, c.num_clients, rng, **options)
    except PartitionError as exc:
        # The partitioner names its own arguments; name the config keys that set them.
        advice = f"; use {exc.advice(PARTITION_CONFIG_KEYS)}" if exc.remedies else ""
        raise PartitionError(
            f"classification.partition={c.partition} on {train.name} ({len(train)} training images) "
            f"with classification.split_seed={c.split_seed}: {exc.reason}{advice}",
        ) from exc
    classes = list(range(train.num_classes))
    splits = []
    for k, indices in enumerate(parts):
        if len(indices) == 0:
            raise ConfigError(
                f"classification.min_size: client {k} got no samples from the {c.partition} partition; "
                "set classification.min_size to 1 or more (redraws until no client is empty), "
                "or use a larger classification.alpha or a smaller classification.num_clients"
            )
        splits.append(ClientSplit(f"client{k:03d}", train.name, [int(i) for i in indices],
                                  train.labels[indices].astype(np.int64), classes))
    return splits


def array_fingerprint(data: ArrayDataset, indices: Optional[np.ndarray] = None) -> str:
    """SHA-256 over ``data``'s name, size and image shape, then the samples at ``indices`` (all: None).

    Per sample: its index, its label and its image bytes, in ``indices``'
    order; a changed file, partition, subset or label changes it.
    """
    indices = np.arange(len(data), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    digest = hashlib.sha256(f"{data.name}\n{len(data)}\n{data.images.shape[1:]}\n".encode())
    digest.update(indices.tobytes())
    digest.update(np.ascontiguousarray(data.labels[indices], dtype=np.int64).tobytes())
    for start in range(0, indices.size, 4096):  # bounded copies of the image rows
        digest.update(np.ascontiguousarray(data.images[indices[start:start + 4096]]).tobytes())
    return digest.hexdigest()


class ClassificationClient(Client):
    """A client holding a partition of a classification dataset; trains and sends the whole model."""

    def __init__(self, split: ClientSplit, index: int, cfg: Config, data: ArrayDataset, *,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(split, index, cfg, device=device)
        self.data = data

    def _dataset(self) -> ClassificationDataset:
        """This client's training images, augmented as ``classification.augment`` says.

        The augmentation is seeded here and reseeded by every epoch's loader
        (:meth:`Client.train_loader`: ``derive_seed(seed, round, index,
        epoch)``), so the crops and flips depend on the config, the round,
        the client and the epoch only.
        """
        if self._train_dataset is None:
            self._train_transform = build_classification_augment(
                self.augment, *self.data.images.shape[1:3],
                seed=derive_seed(self.cfg.seed, "augment", self.index),
            )
            self._train_dataset = ClassificationDataset(
                self.data.subset(np.asarray(self.split.records)), self._train_transform
            )
        return self._train_dataset

    def data_fingerprint(self) -> dict[str, Any]:
        """What identifies this client's training data; a checkpoint records it, a resume compares it.

        ``{"dataset", "images", "identities", "sha256"}``: the digest covers
        the dataset's name and size, the client's sample indices in order,
        their labels and their image bytes (:func:`array_fingerprint`).
        """
        indices = np.asarray(self.split.records, dtype=np.int64)
        return {"dataset": self.data.name, "images": int(indices.size), "identities": self.num_classes,
                "sha256": array_fingerprint(self.data, indices)}

    @property
    def augment(self) -> str:
        """``classification.augment`` with ``auto`` resolved for this dataset (:func:`default_augment`)."""
        setting = self.cfg.classification.augment
        return default_augment(self.data) if setting == "auto" else setting

    def init_head(self, model: nn.Module) -> None:
        self.head = OrderedDict()  # the classifier is shared like every other layer

    def prepare_model(self, model: nn.Module, payload: Mapping[str, Tensor]) -> nn.Module:
        model.load_state_dict(payload)
        return model.to(self.device)

    def fit(self, model: nn.Module, payload: Mapping[str, Tensor], instructions: Mapping[str, Any]) -> Update:
        update = super().fit(model, payload, instructions)
        if instructions.get(CLASS_COUNTS):
            counts = np.asarray(self.class_counts(), dtype=np.int64)
            noise = self.cfg.classification.count_noise
            if noise > 0:
                rng = np.random.default_rng(derive_seed(self.cfg.seed, "count-noise", instructions["round"], self.index))
                counts = noisy_counts(counts, noise, rng)
            update.metadata[CLASS_COUNTS] = torch.as_tensor(counts, dtype=torch.float32)
        return update

    def _make_update(self, model: nn.Module, metadata: dict[str, Any]) -> Update:
        return Update(self.name, clone_state(model.state_dict()), self.num_samples, metadata, head_shared=True)


class AccuracyEvaluator:
    """Top-1 accuracy and mean cross-entropy of a model on a test split."""

    def __init__(self, test: ArrayDataset, *, batch_size: int = 256, device: torch.device | str = "cpu") -> None:
        self.test = test
        self.dataset = ClassificationDataset(test)
        self.batch_size = batch_size
        self.device = torch.device(device)
        #: No client trains on the test split, so there is no local-model evaluation.
        self.datasets: list[str] = []

    def data_fingerprint(self) -> dict[str, dict[str, Any]]:
        """``{"test": {"images", "sha256"}}``: what identifies the test split (:func:`array_fingerprint`)."""
        return {"test": {"images": len(self.test), "sha256": array_fingerprint(self.test)}}

    @torch.no_grad()
    def __call__(self, model: nn.Module, names: Optional[list[str]] = None) -> dict[str, dict[str, float]]:
        was_training = model.training
        model.eval()
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)
        correct, loss, n = 0, 0.0, 0
        for images, labels in loader:
            images, labels = images.to(self.device), labels.to(self.device)
            logits = model(images)
            loss += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
            n += labels.numel()
        model.train(was_training)
        return {"test": {"accuracy": correct / n, "loss": loss / n, "num_samples": n}}


__all__ = [
    "AccuracyEvaluator",
    "CLASS_COUNTS",
    "ClassificationClient",
    "load_train_test",
    "partition_clients",
]
