"""A torch ``Dataset`` over prepared records, and a seeded ``DataLoader``.

Items are dicts (the default collate stacks them into a batch dict)::

    {"image": Tensor [3, H, W] float32   (the transform's output; without a
                                          transform the RGB uint8 [H, W, 3] array),
     "label": int   private class from the client's split, -1 without labels,
     "pid":   int   dataset identity (-1 junk, 0 distractor),
     "camid": int   0-based camera,
     "index": int   position in the record list}

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from fedreid.data.images import ImageReadError, read_image
from fedreid.data.prepared import Record

if TYPE_CHECKING:  # pragma: no cover
    from fedreid.data.scenarios import ClientSplit

__all__ = ["ImageReadError", "ReIDImageDataset", "make_loader", "read_image", "seed_worker"]


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
        return {
            "image": image,
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
    cv2.setNumThreads(1)
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
) -> DataLoader:
    """A ``DataLoader`` whose order (and augmentations) follow ``seed`` (module docstring).

    ``reseed_dataset=False`` leaves the dataset's transform as the caller
    seeded it (main-process loading only; workers are always reseeded).
    """
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
        persistent_workers=False,
    )
