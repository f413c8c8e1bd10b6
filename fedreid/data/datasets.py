"""A torch ``Dataset`` over prepared records, and a seeded ``DataLoader``.

Items are dicts (the default collate stacks them into a batch dict)::

    {"image": Tensor [3, H, W] float32   (the transform's output; without a
                                          transform the RGB uint8 [H, W, 3] array),
     "label": int   private class from the client's split, -1 without labels,
     "pid":   int   dataset identity (-1 junk, 0 distractor),
     "camid": int   0-based camera,
     "index": int   position in the record list}

A transform that returns a dict (:class:`fedreid.data.transforms.
Uint8ImageTransform`: ``image`` in ``uint8`` and the erasing rectangle
``erase``) gives the item those fields; :class:`DeviceBatches` finishes such
batches on the device they are copied to.

Images are decoded by :func:`fedreid.data.images.read_image` (OpenCV,
``cv2.imdecode`` of the file's bytes, then BGR -> RGB; re-exported here with
:class:`ImageReadError`): a file that is missing or cannot be decoded raises
:class:`ImageReadError` naming it.

Determinism: :func:`make_loader` shuffles with ``torch.Generator().
manual_seed(seed)`` and, unless told not to, reseeds the dataset's transform
with ``seed``, so with ``num_workers=0`` the loader seed fixes both the order
and the augmentations. With workers, each worker holds its own copy of the
transform; ``worker_init_fn`` reseeds it with the worker's torch seed, which
PyTorch derives from the loader's generator (a base seed drawn per epoch, plus
the worker id): runs with the same seed and worker count match, epochs and
workers differ, but the augmentations are not the ones of ``num_workers=0``.

:class:`SegmentLoader` reads several datasets (evaluation's query and gallery
sets) through one loader with persistent workers, each batched as its own
in-order loader would be.

:class:`EpochLoader` keeps one loader's workers alive across epochs (and a
client's rounds) and gives every epoch exactly the batches and augmentations
of a fresh :func:`make_loader` with that epoch's seed: it draws the base seed
and the permutation from ``Generator().manual_seed(seed)`` in the order
``DataLoader`` does, and each worker reseeds itself (``random``, numpy,
torch, the transform) with ``base + worker id`` on the epoch's first item,
as a fresh worker would.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, Mapping, Optional, Sequence

import cv2
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, get_worker_info
from torch.utils.data._utils.worker import _generate_state

from fedreid.data.images import ImageReadError, read_image
from fedreid.data.prepared import Record

if TYPE_CHECKING:  # pragma: no cover
    from fedreid.data.scenarios import ClientSplit

__all__ = [
    "DeviceBatches", "EpochLoader", "ImageReadError", "ReIDImageDataset", "SegmentLoader", "make_loader", "on_device",
    "read_image", "seed_worker",
]


class ReIDImageDataset(Dataset):
    """Images of ``records``, with the client's private ``labels`` when given."""

    def __init__(
        self,
        records: Sequence[Record],
        labels: Optional[Sequence[int] | np.ndarray] = None,
        transform: Optional[Callable[[np.ndarray], Any]] = None,
    ) -> None:
        self.records = list(records)
        if labels is not None:
            labels = np.asarray(labels, dtype=np.int64)
            if labels.shape != (len(self.records),):
                raise ValueError(
                    f"labels must be one per record: {len(self.records)} records, "
                    f"labels of shape {labels.shape}"
                )
        self.labels = labels
        self.transform = transform

    @classmethod
    def from_client(
        cls, client: "ClientSplit", transform: Optional[Callable[[np.ndarray], Any]] = None
    ) -> "ReIDImageDataset":
        """A client's training images in its private label space."""
        return cls(client.records, client.labels, transform)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        rec = self.records[index]
        image = read_image(rec.path)
        if self.transform is not None:
            image = self.transform(image)
        fields = image if isinstance(image, dict) else {"image": image}
        return {
            **fields,
            "label": -1 if self.labels is None else int(self.labels[index]),
            "pid": int(rec.pid),
            "camid": int(rec.camid),
            "index": index,
        }

    def reseed(self, seed: Optional[int]) -> None:
        """Reseed the transform when it supports it (a no-op otherwise)."""
        reseed = getattr(self.transform, "reseed", None)
        if callable(reseed):
            reseed(seed)

    def __repr__(self) -> str:
        labelled = "labelled" if self.labels is not None else "unlabelled"
        return f"ReIDImageDataset({len(self)} images, {labelled}, transform={self.transform!r})"


def single_threaded_opencv() -> None:
    """Make OpenCV run sequentially in this (loader worker) process.

    ``setNumThreads(0)``, not ``1``: in a process forked after its parent ran
    OpenCV's thread pool (a large resize or blur in the main process),
    ``setNumThreads(1)`` waits forever for pool threads the fork did not copy,
    while ``0`` switches the pool off without them. One worker per core does
    the parallel work; OpenCV's own threads would only oversubscribe the cores.
    """
    cv2.setNumThreads(0)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: reseed the worker's copy of the dataset's transform.

    Uses the worker's torch seed (``base_seed + worker_id``, the base drawn
    from the loader's seeded generator), with which PyTorch also seeds the
    worker's ``random``, numpy and torch RNGs. OpenCV runs single-threaded in
    workers to avoid oversubscribing the cores.
    """
    info = get_worker_info()
    if info is None:  # pragma: no cover - only called inside workers
        return
    single_threaded_opencv()
    reseed = getattr(info.dataset, "reseed", None)
    if callable(reseed):
        reseed(info.seed % 2**32)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    drop_last: bool = False,
    reseed_dataset: bool = True,
    pin_memory: bool = False,
    persistent_workers: bool = False,
) -> DataLoader:
    """A ``DataLoader`` whose order (and augmentations) follow ``seed`` (module docstring).

    ``reseed_dataset=False`` leaves the dataset's transform as the caller
    seeded it (main-process loading only; workers are always reseeded).
    ``pin_memory``: page-locked batches, for non-blocking copies to a GPU.
    ``persistent_workers``: keep the workers between passes, for a loader
    read many times in dataset order through a deterministic transform (every
    pass then equals the first); a shuffled loader cannot, its later passes
    would not follow ``seed`` (use :class:`EpochLoader`).
    """
    if persistent_workers and shuffle:
        raise ValueError("a shuffled loader cannot keep its workers (its next pass would not follow the seed); "
                         "use EpochLoader")
    if seed is None:
        raise ValueError("make_loader needs an integer seed (every random choice is seeded)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if reseed_dataset and callable(getattr(dataset, "reseed", None)):
        dataset.reseed(int(seed))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(int(seed)),
        worker_init_fn=seed_worker if num_workers > 0 else None,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory,
        multiprocessing_context=_worker_context(num_workers),
    )


def _worker_context(num_workers: int) -> Optional[str]:
    """Loader workers are forked where the platform can: inside a spawned process (a client
    worker of ``run.concurrent_clients``) the default would be spawn, which re-imports torch
    in every loader worker (seconds and about 1 GB each). The batches do not depend on it."""
    if num_workers > 0 and "fork" in multiprocessing.get_all_start_methods():
        return "fork"
    return None


def _epoch_draws(seed: int, n: int, shuffle: bool) -> tuple[int, list[int]]:
    """The worker base seed and the order a fresh seeded ``DataLoader`` draws, in its order.

    ``_BaseDataLoaderIter`` draws the base seed from the loader's generator
    when the iterator is made; ``RandomSampler`` then draws its permutation
    from the same generator on the first index.
    """
    generator = torch.Generator().manual_seed(int(seed))
    base = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    return base, order


class _EpochBatches(Sampler):
    """Batches of ``(index, epoch token, base seed)`` for the epoch set by :meth:`set_epoch`."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.token, self.base, self.order, self.drop_last = 0, 0, list(range(n)), False
        self.limit: Optional[int] = None

    def set_epoch(self, seed: int, *, shuffle: bool, drop_last: bool, limit: Optional[int] = None) -> None:
        self.token += 1
        self.base, self.order = _epoch_draws(seed, self.n, shuffle)
        self.drop_last, self.limit = drop_last, limit

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        batch: list[tuple[int, int, int]] = []
        given = 0
        for index in self.order:
            if given == self.limit:
                return
            batch.append((index, self.token, self.base))
            if len(batch) == self.batch_size:
                yield batch
                batch, given = [], given + 1
        if batch and not self.drop_last and given != self.limit:
            yield batch

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        total = full + (1 if rest and not self.drop_last else 0)
        return total if self.limit is None else min(total, self.limit)


class _EpochSeededItems(Dataset):
    """``dataset[index]`` for ``(index, token, base)`` items; a worker reseeds itself on a new token."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.token: Optional[int] = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int, int]) -> Any:
        index, token, base = item
        if token != self.token:
            info = get_worker_info()
            worker = 0 if info is None else info.id
            seed = base + worker
            # what DataLoader's worker loop and seed_worker do for a fresh worker
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(_generate_state(base, worker))
            reseed = getattr(self.dataset, "reseed", None)
            if callable(reseed):
                reseed(seed % 2**32)
            self.token = token
        return self.dataset[index]


def _single_threaded_opencv(worker_id: int) -> None:
    single_threaded_opencv()


class EpochLoader:
    """One dataset's loader whose workers persist; :meth:`epoch` gives ``make_loader(seed)``'s batches.

    With ``num_workers > 0`` and ``persistent``, one ``DataLoader`` with
    persistent workers serves every epoch; each epoch's order and
    augmentations equal those of a fresh :func:`make_loader` with the same
    seed, worker count and ``drop_last`` (module docstring), so keeping the
    workers changes speed, not numbers. An epoch may be abandoned early (the
    next :meth:`epoch` discards what the workers had prefetched); one known
    to be read only in part (the CDW batch) says so with ``batches``, and
    then the workers decode no batch beyond those. Otherwise :meth:`epoch`
    is :func:`make_loader`.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, num_workers: int = 0, pin_memory: bool = False,
                 persistent: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent = persistent and num_workers > 0
        self._batches: Optional[_EpochBatches] = None
        self._loader: Optional[DataLoader] = None

    def epoch(self, seed: int, *, shuffle: bool = True, drop_last: bool = False,
              batches: Optional[int] = None) -> Iterable:
        """The batches of one epoch seeded by ``seed``; with ``batches``, only its first ``batches``."""
        if seed is None:
            raise ValueError("EpochLoader.epoch needs an integer seed (every random choice is seeded)")
        if batches is not None and batches < 1:
            raise ValueError(f"batches must be >= 1 (or None for the whole epoch), got {batches}")
        if not self.persistent:
            loader = make_loader(self.dataset, self.batch_size, shuffle=shuffle, seed=int(seed),
                                 num_workers=self.num_workers, drop_last=drop_last, pin_memory=self.pin_memory)
            return loader if batches is None else _FirstBatches(loader, batches)
        if self._loader is None:
            self._batches = _EpochBatches(len(self.dataset), self.batch_size)  # type: ignore[arg-type]
            self._loader = _sampled_loader(_EpochSeededItems(self.dataset), self._batches, self.num_workers,
                                           persistent=True, pin_memory=self.pin_memory)
        assert self._batches is not None
        self._batches.set_epoch(int(seed), shuffle=shuffle, drop_last=drop_last, limit=batches)
        return self._loader


def _sampled_loader(dataset: Dataset, batch_sampler: Sampler, num_workers: int, *, persistent: bool,
                    pin_memory: bool) -> DataLoader:
    """A loader of ``batch_sampler``'s batches whose sampler is re-planned between passes (single-threaded OpenCV)."""
    return DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=num_workers,
        worker_init_fn=_single_threaded_opencv if num_workers else None,
        persistent_workers=persistent and num_workers > 0, pin_memory=pin_memory,
        multiprocessing_context=_worker_context(num_workers),
        # its own generator: the iterator's unused base-seed draw must not touch torch's global RNG
        generator=torch.Generator().manual_seed(0),
    )


class _FirstBatches:
    """The first ``count`` batches of ``loader``, each pass."""

    def __init__(self, loader: Iterable, count: int) -> None:
        self.loader, self.count = loader, count

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.count)


class _SegmentBatches(Sampler):
    """Index batches of the chosen segments of a concatenation, each segment batched from its own start."""

    def __init__(self, spans: Mapping[Hashable, tuple[int, int]], batch_size: int) -> None:
        self.spans, self.batch_size = dict(spans), batch_size
        self.keys: list[Hashable] = []

    def __iter__(self) -> Iterator[list[int]]:
        for key in self.keys:
            start, stop = self.spans[key]
            for low in range(start, stop, self.batch_size):
                yield list(range(low, min(low + self.batch_size, stop)))

    def __len__(self) -> int:
        return sum(-(-(stop - start) // self.batch_size) for start, stop in map(self.spans.__getitem__, self.keys))


class SegmentLoader:
    """Several datasets ("segments") read through one loader whose workers persist.

    :meth:`read` gives the batches of the chosen segments, in the order asked,
    each segment batched from its start exactly as a fresh
    ``make_loader(segment, batch_size, shuffle=False)`` would: no batch spans
    two segments, so a model sees the same batches either way. One pass keeps
    every worker busy across the segments' boundaries (a loader per segment
    drains at each end, and a segment of a few batches leaves most workers
    idle), and with ``persistent`` the workers start once, not once per
    segment and pass. Meant for deterministic transforms (evaluation's test
    pipeline): workers are not reseeded between passes. One pass at a time:
    a :meth:`read` re-plans the loader it returns. Pickles without its
    workers (a copy starts its own).
    """

    def __init__(self, segments: Mapping[Hashable, Dataset], batch_size: int, *, num_workers: int = 0,
                 pin_memory: bool = False, persistent: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.segments = dict(segments)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent = persistent and num_workers > 0
        spans, start = {}, 0
        for key, dataset in self.segments.items():
            spans[key] = (start, start + len(dataset))  # type: ignore[arg-type]
            start += len(dataset)  # type: ignore[arg-type]
        self._batches = _SegmentBatches(spans, batch_size)
        self._loader: Optional[DataLoader] = None

    def size(self, key: Hashable) -> int:
        """The number of items of segment ``key``."""
        start, stop = self._batches.spans[key]
        return stop - start

    def read(self, keys: Sequence[Hashable]) -> DataLoader:
        """The batches of the segments ``keys``, in that order (see the class docstring)."""
        unknown = [key for key in keys if key not in self.segments]
        if unknown:
            raise KeyError(f"no segment {unknown[0]!r}; the loader has {list(self.segments)}")
        self._batches.keys = list(keys)
        if self._loader is None or not self.persistent:
            self._loader = _sampled_loader(ConcatDataset(list(self.segments.values())), self._batches,
                                           self.num_workers, persistent=self.persistent, pin_memory=self.pin_memory)
        return self._loader

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loader": None}


class DeviceBatches:
    """A loader of ``uint8`` batches, finished on ``device``: the loader's batches with ``image`` normalised there.

    Each batch's ``image`` (``uint8 [B, H, W, 3]``) and ``erase`` go to
    ``device`` (non-blocking from pinned memory), and ``image`` becomes
    ``normalize(image, erase, memory_format=memory_format)`` (a
    :class:`fedreid.data.transforms.BatchNormalize`), float32 ``[B, 3, H, W]``;
    ``erase`` leaves the batch and the other fields stay as collated. Iterable
    as often as ``loader`` is, with its length.
    """

    def __init__(self, loader: Iterable, device: torch.device | str, normalize: Callable[..., torch.Tensor],
                 memory_format: Optional[torch.memory_format] = None) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.normalize = normalize
        self.memory_format = memory_format

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            batch = dict(batch)
            images = batch["image"].to(self.device, non_blocking=True)
            erase = batch.pop("erase", None)
            if erase is not None:
                erase = erase.to(self.device, non_blocking=True)
            batch["image"] = self.normalize(images, erase, memory_format=self.memory_format)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def on_device(loader: Iterable, transform: Any, device: torch.device | str, *, channels_last: bool = False) -> Iterable:
    """``loader`` itself, or its batches finished on ``device`` when ``transform`` defers normalisation.

    A :class:`fedreid.data.transforms.Uint8ImageTransform` defers it: the
    batches then come through :class:`DeviceBatches`, channels-last when
    ``channels_last`` (the model's input layout, so the step copies nothing again).
    """
    from fedreid.data.transforms import Uint8ImageTransform

    if not isinstance(transform, Uint8ImageTransform):
        return loader
    return DeviceBatches(loader, device, transform.batch_normalize, torch.channels_last if channels_last else None)
