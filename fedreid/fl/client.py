"""A federated client: its data, its private identity head, local training -> Update.

A :class:`Client` owns no network. Each round it is handed a *work model*
(any :class:`~fedreid.models.reid.ReIDModel`; in simulation one instance is
shared by all clients, in a deployment each process has its own), loads the
received shared state plus its own head into it, trains, and returns an
:class:`~fedreid.fl.update.Update` with the shared part only. After
:meth:`Client.fit` the work model holds the client's trained model (what the
"local model" evaluation measures).

What persists across rounds (and goes into :meth:`state_dict`): the private
head, the client's BatchNorm statistics under ``fl.bn=local``, the state of
its objective (``train.objective``: SCAFFOLD's ``c_i``, FedDyn's gradient
term, MOON's previous model; see :mod:`fedreid.fl.local.objectives`) and the
count of rounds trained. In federated mode no optimizer state persists: the
reference builds a new optimizer and scheduler in every ``Client.train`` call
(``client.py``), see :mod:`fedreid.fl.local.sgd`. The local-training baseline
(``fl.mode=local``) is one continuous run per client, as training a dataset
alone is (appendix A.1: step size 40, gamma 0.1 over the run's epochs): its
optimizer state persists too and the LR schedule counts the client's epochs
across rounds.

Randomness: everything random in a client's round (shuffle, augmentation,
dropout, the CDW batch) is seeded from ``(run seed, round, client index)`` via
:func:`fedreid.utils.seeding.derive_seed`, with torch's global RNG forked,
so rounds are reproducible one by one and a resumed run is exact.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.config import Config
from fedreid.data.prepared import Record
from fedreid.data.scenarios import ClientSplit
from fedreid.errors import FedReIDError
from fedreid.fl.aggregate import cdw_distance, cdw_start_in_eval
from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, LocalObjective
from fedreid.fl.local.objectives import build_objective, objective_class
from fedreid.fl.local.sgd import LocalResult, device_batch, train_local
from fedreid.fl.server_hooks.kd import KD_FEATURES, public_features
from fedreid.fl.state import bn_buffers, clone_state, host_state, split_state
from fedreid.fl.update import Update, private_prefixes
from fedreid.utils.precision import FP32, Precision, resolve_precision
from fedreid.utils.seeding import derive_seed, forked_torch_rng


class ClientError(FedReIDError, ValueError):
    """A client cannot be built or run as configured; the message names it."""


def check_split(split: ClientSplit, batch_size: int, drop_last: bool = True, *, identities: bool = False,
                batch_norm: bool = False) -> None:
    """Refuse a split the client could not train on, in one line naming the client.

    ``identities``: a ReID client, whose private head classifies its own
    identities (one identity gives a loss of 0: nothing to learn, yet a
    weight in the aggregation) and whose bottleneck BatchNorm cannot train
    on a batch of one image. ``batch_norm``: the model trains BatchNorm
    layers, so no batch may hold one image either.
    """
    if len(split) == 0:
        raise ClientError(f"client {split.name!r} has an empty training split (no images to train on)")
    if len(split.labels) != len(split.records):
        raise ClientError(
            f"client {split.name!r}: {len(split.labels)} labels for {len(split.records)} images"
        )
    if split.num_classes == 0:
        raise ClientError(f"client {split.name!r} has no identities")
    if identities and split.num_classes == 1:
        raise ClientError(
            f"client {split.name!r} has one identity: its identity head over one class has nothing to learn "
            "(the loss is 0), yet it would weigh in the aggregation; give it more identities or leave it out"
        )
    if (identities or batch_norm) and (batch_size == 1 or (not drop_last and len(split) % batch_size == 1)):
        remedy = ("use train.drop_last=true (the reference) and a batch size of at least 2" if identities else
                  "use train.drop_last=true, or a train.batch_size of at least 2 that leaves no batch of one")
        raise ClientError(
            f"client {split.name!r}: train.batch_size={batch_size} with train.drop_last={str(drop_last).lower()} "
            f"gives {len(split)} images a batch of one image, which BatchNorm cannot train on; {remedy}"
        )
    if drop_last and len(split) < batch_size:
        raise ClientError(
            f"client {split.name!r} has {len(split)} training images, fewer than "
            f"train.batch_size={batch_size}: local training skips partial batches (as the "
            f"reference), so it would never train; lower train.batch_size"
        )


def records_fingerprint(records: Sequence[Record], root: str | Path) -> dict[str, Any]:
    """``{"images": n, "sha256": hex}`` of ``records``: what identifies a list of prepared images.

    The digest runs over the rows in their order (the order training and
    evaluation read them in): image path (relative to ``root`` when it lies
    under it, so a moved checkout keeps its fingerprints), identity, camera.
    A removed, added, relabelled or reordered row changes it; the image
    bytes are not read.
    """
    base = os.path.abspath(root)
    digest = hashlib.sha256()
    for r in records:
        path = os.path.abspath(r.path)
        rel = os.path.relpath(path, base)
        shown = path if rel.startswith("..") else rel
        digest.update(f"{Path(shown).as_posix()}\t{int(r.pid)}\t{int(r.camid)}\n".encode())
    return {"images": len(records), "sha256": digest.hexdigest()}


def load_partial(model: nn.Module, state: Mapping[str, Tensor], what: str) -> None:
    """Load ``state`` into some of ``model``'s keys; unknown keys are an error."""
    result = model.load_state_dict(dict(state), strict=False)
    if result.unexpected_keys:
        raise ClientError(f"{what}: keys not in the model: {', '.join(result.unexpected_keys[:4])}")


class Client:
    """One federated client (see the module docstring).

    ``public_records``: the unlabeled public set for KD rounds (None when KD is off).
    ``index``: the client's position in the federation (seeds its randomness).
    """

    def __init__(
        self,
        split: ClientSplit,
        index: int,
        cfg: Config,
        *,
        public_records: Optional[Sequence[Record]] = None,
        device: torch.device | str = "cpu",
    ) -> None:
        check_split(split, cfg.train.batch_size, cfg.train.drop_last, identities=cfg.task == "reid")
        self.split = split
        self.name = split.name
        self.index = index
        self.cfg = cfg
        self.device = torch.device(device)
        self.public_records = list(public_records) if public_records is not None else None
        self.head: Optional["OrderedDict[str, Tensor]"] = None
        self.bn_state: Optional["OrderedDict[str, Tensor]"] = None
        self.rounds_trained = 0
        #: ``fl.mode=local``: the optimizer's state after the client's last round (CPU tensors).
        self.optimizer_state: Optional[dict[str, Any]] = None
        self._objective: Optional[LocalObjective] = None
        self._train_transform = None
        self._train_dataset = None
        self._train_loader = None
        self._public_loaders: Optional[PublicLoaders] = None
        self.precision: Precision = resolve_precision(
            cfg.train.precision, self.device, channels_last=cfg.train.channels_last
        )

    # ------------------------------------------------------------------ data

    @property
    def num_samples(self) -> int:
        return len(self.split)

    @property
    def num_classes(self) -> int:
        return self.split.num_classes

    def _dataset(self):
        if self._train_dataset is None:
            from fedreid.data.datasets import ReIDImageDataset
            from fedreid.data.transforms import build_train_transform, defers_normalize

            m, t = self.cfg.model, self.cfg.train
            self._train_transform = build_train_transform(
                m.height, m.width, random_erasing=t.random_erasing, color_jitter=t.color_jitter,
                seed=derive_seed(self.cfg.seed, "augment", self.index),
                defer_normalize=defers_normalize(t.normalize_on, self.device),
            )
            self._train_dataset = ReIDImageDataset(
                self.split.records, self.split.labels, transform=self._train_transform
            )
        return self._train_dataset

    def train_loader(self, seed: int, *, drop_last: Optional[bool] = None, batches: Optional[int] = None):
        """A loader over the training split; shuffle and augmentation seeded by ``seed``.

        One :class:`~fedreid.data.datasets.EpochLoader` per client: with
        ``train.workers > 0`` its workers persist across epochs and rounds
        (``train.persistent_workers``), and every call gives the batches of a
        fresh loader seeded with ``seed``. Batches are pinned for a CUDA device.
        With ``train.normalize_on`` deferring, the batches are finished on the
        client's device (:class:`~fedreid.data.datasets.DeviceBatches`).
        ``batches``: only the epoch's first ``batches`` are read (persistent
        workers decode no others).
        """
        from fedreid.data.datasets import EpochLoader, on_device

        t = self.cfg.train
        if self._train_loader is None:
            self._train_loader = EpochLoader(
                self._dataset(), t.batch_size, num_workers=t.workers, persistent=t.persistent_workers,
                pin_memory=self.device.type == "cuda",
            )
        # the loader seeds the shuffle order and reseeds the augmentation with the same seed
        loader = self._train_loader.epoch(
            derive_seed(seed, "loader"), shuffle=True, drop_last=t.drop_last if drop_last is None else drop_last,
            batches=batches,
        )
        return on_device(loader, self._train_transform, self.device, channels_last=self.precision.channels_last)

    def training_pass(self, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        """One pass of :meth:`train_loader` (seeded by ``seed``) as ``(images, labels)`` on the client's device."""
        for batch in self.train_loader(seed):
            yield device_batch(batch, self.device)

    def public_loader(self, kd_seed: Optional[int] = None):
        """The public set for KD features (:mod:`fedreid.fl.server_hooks.kd`).

        ``fl.kd_mode=eval``: in dataset order. ``train``: shuffled and
        augmented with the round's ``kd_seed`` (the server's student loader's
        batches). Built once (:class:`PublicLoaders`): its workers persist.
        """
        if self.public_records is None:
            raise ClientError(f"client {self.name!r}: a KD round needs the public set, none was given")
        train_mode = kd_mode(self.cfg) == "train"
        if train_mode and kd_seed is None:
            raise ClientError(
                f"client {self.name!r}: fl.kd_mode=train needs the round's kd_seed in the KD instructions"
            )
        if self._public_loaders is None:
            self._public_loaders = PublicLoaders(self.public_records, self.cfg, device=self.device,
                                                 precision=self.precision)
        if train_mode:
            return self._public_loaders.loader(shuffle=True, seed=int(kd_seed))
        return self._public_loaders.loader(shuffle=False)

    def data_fingerprint(self) -> dict[str, Any]:
        """What identifies this client's training data; a checkpoint records it, a resume compares it.

        ``{"dataset", "images", "identities", "sha256"}``, the digest over the
        training rows as :func:`records_fingerprint` (paths relative to
        ``data.prepared_root``).
        """
        rows = records_fingerprint(self.split.records, self.cfg.data.prepared_root)
        return {"dataset": self.split.dataset, "images": rows["images"], "identities": self.num_classes,
                "sha256": rows["sha256"]}

    def class_counts(self) -> list[int]:
        """Training images per class of this client's label space (FedLMD, FedFTG)."""
        counts = [0] * self.num_classes
        for label in self.split.labels:
            counts[int(label)] += 1
        return counts

    # ----------------------------------------------------------------- model

    @property
    def objective(self) -> Optional[LocalObjective]:
        """The client's objective (built on first use); ``None`` for plain cross-entropy."""
        name = self.cfg.train.objective
        if name == "fedavg":
            return None
        if self._objective is None:
            counts = self.class_counts() if objective_class(name).needs_class_counts else None
            self._objective = build_objective(name, class_counts=counts, **self.cfg.train.objective_options)
        return self._objective

    def init_head(self, model: nn.Module) -> None:
        """Create this client's identity head (seeded) from ``model``'s classifier layout."""
        from fedreid.models.reid import private_state, replace_classifier

        replace_classifier(model, self.num_classes, seed=derive_seed(self.cfg.seed, "head", self.index))
        self.head = clone_state(private_state(model))

    def prepare_model(self, model: nn.Module, payload: Mapping[str, Tensor]) -> nn.Module:
        """Work model := received shared state + own head (+ own BN stats under bn=local)."""
        from fedreid.models.reid import load_shared_state, replace_classifier

        if self.head is None:
            self.init_head(model)
        replace_classifier(model, self.num_classes, seed=0)  # values overwritten just below
        load_partial(model, self.head, f"client {self.name!r} head")
        if self.cfg.fl.aggregation == "fedavg":
            load_partial(model, payload, f"client {self.name!r} global state")
        else:
            load_shared_state(model, payload)
        if self.cfg.fl.bn == "local" and self.bn_state is not None:
            load_partial(model, self.bn_state, f"client {self.name!r} BN statistics")
        return model.to(self.device)

    # ------------------------------------------------------------------- fit

    def fit(
        self,
        model: nn.Module,
        payload: Mapping[str, Tensor],
        instructions: Mapping[str, Any],
    ) -> Update:
        """One round: load ``payload``, train locally, return the shared update.

        ``instructions``: ``round`` (0-based, required), ``cdw`` (compute the
        CDW distance), ``kd`` (send public-set features), ``kd_seed`` (the
        round's public loader seed, ``fl.kd_mode=train``).
        """
        started = time.perf_counter()
        round_index = int(instructions["round"])
        seed = derive_seed(self.cfg.seed, "client", round_index, self.index)
        # the first epoch's loader workers start decoding while the model is loaded and copied
        first_epoch = iter(self.train_loader(derive_seed(seed, "epoch", 0)))
        self.prepare_model(model, payload)
        start = copy.deepcopy(model) if instructions.get("cdw") else None

        def epoch_loader(epoch: int):
            return first_epoch if epoch == 0 else self.train_loader(derive_seed(seed, "epoch", epoch))

        objective = self.objective
        if objective is not None:
            objective.begin_round(
                model, payload, round_index=round_index, payload=instructions.get(OBJECTIVE_PAYLOAD)
            )
        continuous = self.cfg.fl.mode == "local"
        with forked_torch_rng(derive_seed(seed, "dropout"), self.device):
            result: LocalResult = train_local(
                model, epoch_loader, self.cfg.train, device=self.device, objective=objective,
                lr_scale=self.cfg.train.lr_round_decay ** round_index, precision=self.precision,
                first_epoch=self.rounds_trained * self.cfg.train.local_epochs if continuous else 0,
                continue_from=self.optimizer_state if continuous else None,
            )
        if continuous and result.optimizer is not None:
            self.optimizer_state = cpu_state(result.optimizer.state_dict())
        metadata: dict[str, Any] = {
            "train_loss": result.loss,
            "train_acc": result.accuracy,
            "steps": result.steps,
            "lr": result.lrs[-1] if result.lrs else self.cfg.train.lr,
            "time_train": result.seconds,
        }
        if objective is not None:
            if objective.wants_training_pass:
                with forked_torch_rng(derive_seed(seed, "objective-pass-dropout"), self.device):
                    metadata.update(objective.end_round(
                        model, training_batches=lambda: self.training_pass(derive_seed(seed, "objective-pass"))))
            else:
                metadata.update(objective.end_round(model))
        if start is not None:
            t0 = time.perf_counter()
            metadata["cdw_distance"] = self.cdw_distance(start, model, seed, round_index)
            metadata["time_cdw"] = time.perf_counter() - t0
            del start
        if instructions.get("kd"):
            t0 = time.perf_counter()
            metadata[KD_FEATURES] = public_features(
                model, self.public_loader(instructions.get("kd_seed")), len(self.public_records),
                device=self.device, mode=kd_mode(self.cfg), seed=derive_seed(seed, "kd-dropout"),
                precision=self.precision,
            )
            metadata["time_kd_features"] = time.perf_counter() - t0
        update = self._make_update(model, metadata)
        self.rounds_trained += 1
        update.metadata["time_fit"] = time.perf_counter() - started
        return update

    def cdw_distance(self, start: nn.Module, trained: nn.Module, seed: int, round_index: int = 0) -> float:
        """``m_k`` on the first batch of a fresh (seeded, augmented) training loader."""
        batch = next(iter(self.train_loader(derive_seed(seed, "cdw"), drop_last=False, batches=1)))
        images = (batch["image"] if isinstance(batch, dict) else batch[0]).to(self.device, non_blocking=True)
        return cdw_distance(
            start, trained, images, mode=self.cfg.fl.cdw_mode, seed=derive_seed(seed, "cdw-dropout"),
            precision=self.precision, start_in_eval=cdw_start_in_eval(round_index, self.cfg.eval.every),
        )

    def _make_update(self, model: nn.Module, metadata: dict[str, Any]) -> Update:
        full = model.state_dict()
        shared, private = split_state(full, private_prefixes())
        self.head = clone_state(private)
        if self.cfg.fl.bn == "local":
            self.bn_state = clone_state(bn_buffers(shared))
        fedavg = self.cfg.fl.aggregation == "fedavg"
        state = host_state(full if fedavg else shared)  # the update crosses to the host in a few copies
        return Update(self.name, state, self.num_samples, metadata, head_shared=fedavg)

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Everything that persists across rounds (CPU tensors)."""
        return {
            "name": self.name,
            "index": self.index,
            "num_classes": self.num_classes,
            "rounds_trained": self.rounds_trained,
            "head": clone_state(self.head) if self.head is not None else None,
            "bn_state": clone_state(self.bn_state) if self.bn_state is not None else None,
            "objective": self.objective.state_dict() if self.objective is not None else {},
            "optimizer": cpu_state(self.optimizer_state) if self.optimizer_state is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ClientError(f"client state of {state.get('name')!r} cannot be loaded into client {self.name!r}")
        if state.get("num_classes") != self.num_classes:
            raise ClientError(
                f"client {self.name!r}: saved head has {state.get('num_classes')} classes, "
                f"the data has {self.num_classes}"
            )
        self.rounds_trained = int(state["rounds_trained"])
        self.head = clone_state(state["head"]) if state.get("head") is not None else None
        self.bn_state = clone_state(state["bn_state"]) if state.get("bn_state") is not None else None
        self.optimizer_state = cpu_state(state["optimizer"]) if state.get("optimizer") is not None else None
        if self.objective is not None:
            self.objective.load_state_dict(state.get("objective", {}))
        elif state.get("objective"):
            raise ClientError(f"client {self.name!r}: the checkpoint has objective state, train.objective is fedavg")


def cpu_state(value: Any) -> Any:
    """A deep copy of an optimizer ``state_dict`` (nested dicts and lists) with CPU tensors."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_state(v) for v in value)
    return value


def kd_mode(cfg: Config) -> str:
    """The KD hook's ``mode`` in this run (``fl.kd_mode`` when KD is off)."""
    kd = cfg.hook_settings("kd")
    return kd.mode if kd is not None else cfg.fl.kd_mode


class PublicLoaders:
    """The public set's KD loaders, built once and read every KD round; batches carry ``index``.

    The test transform with ``fl.kd_mode=eval``; the training transform (the
    reference's ``kd_loader``) with ``train``. :meth:`loader` gives the
    batches of a fresh :func:`~fedreid.data.datasets.make_loader` seeded by
    ``seed`` (order, and augmentations in ``train`` mode), shuffled or in
    dataset order, so equal seeds give equal batches in every process. One
    :class:`~fedreid.data.datasets.EpochLoader` serves every pass: with
    ``train.workers > 0`` and ``train.persistent_workers`` its workers stay
    between KD rounds instead of being started again each round. ``device``:
    where the batches are used; on CUDA they are pinned, and with
    ``train.normalize_on`` deferring there they are normalised there, in
    ``precision``'s layout.
    """

    def __init__(self, records: Sequence[Record], cfg: Config, *, device: Optional[torch.device] = None,
                 precision: Precision = FP32) -> None:
        from fedreid.data.datasets import EpochLoader, ReIDImageDataset
        from fedreid.data.transforms import build_test_transform, build_train_transform, defers_normalize

        m, t = cfg.model, cfg.train
        kd = cfg.hook_settings("kd")
        mode, batch_size = (kd.mode, kd.batch_size) if kd is not None else (cfg.fl.kd_mode, cfg.fl.kd_batch_size)
        self.device = None if device is None else torch.device(device)
        defer = self.device is not None and defers_normalize(t.normalize_on, self.device)
        if mode == "train":
            # seed=0 only until the first pass: every pass reseeds the augmentation with its own seed
            self.transform = build_train_transform(
                m.height, m.width, random_erasing=t.random_erasing, color_jitter=t.color_jitter, seed=0,
                defer_normalize=defer,
            )
        else:
            self.transform = build_test_transform(m.height, m.width, defer_normalize=defer)
        self.dataset = ReIDImageDataset(list(records), None, transform=self.transform)
        self.channels_last = precision.channels_last
        self._epochs = EpochLoader(
            self.dataset, batch_size, num_workers=t.workers, persistent=t.persistent_workers,
            pin_memory=self.device is not None and self.device.type == "cuda",
        )

    def __len__(self) -> int:
        return len(self.dataset)

    def loader(self, shuffle: bool, seed: int = 0):
        """One pass over the public set, seeded by ``seed``, shuffled or in dataset order."""
        from fedreid.data.datasets import on_device

        batches = self._epochs.epoch(int(seed), shuffle=shuffle)
        if self.device is None:
            return batches
        return on_device(batches, self.transform, self.device, channels_last=self.channels_last)


__all__ = ["Client", "ClientError", "PublicLoaders", "check_split", "records_fingerprint"]
