"""Image pipelines (albumentations + OpenCV): RGB uint8 HWC array -> float32 CHW tensor.

The training pipeline is the FedReID reference's (``data_utils.py``)::

    [ColorJitter(b=c=s=color_jitter, hue=0)]   optional, first, as in the reference
    Resize(256, 128, bicubic)
    Pad(10, constant 0) + RandomCrop(256, 128)
    HorizontalFlip(p=0.5)
    Normalize(ImageNet mean/std)
    [RandomErasing(p, area 0.02-0.4, aspect 0.3-3.33, fill 0)]   optional, after Normalize

Random erasing fills with 0 after normalisation, which is the reference's
``RandomErasing(mean=[0, 0, 0])`` applied to the normalised tensor. Resizing
uses OpenCV's bicubic kernel (the reference uses PIL bicubic, which also
antialiases when shrinking; re-ID crops are mostly enlarged, where the two
agree closely).

Randomness: every random draw of a pipeline comes from one numpy and one
Python generator owned by the pipeline (never from global state).
``ImageTransform.reseed(seed)`` restarts them, so the same seed gives the same
sequence of augmented tensors; the trainer reseeds per (round, client), and
:func:`fedreid.data.datasets.make_loader` reseeds the per-worker copies.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageTransform",
    "build_test_transform",
    "build_train_transform",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageTransform:
    """A seeded albumentations pipeline: ``transform(rgb_uint8_hwc) -> float32 [3, H, W]``."""

    def __init__(self, compose: A.Compose, seed: Optional[int] = None) -> None:
        self.compose = compose
        self.seed: Optional[int] = None
        self.reseed(seed)

    def reseed(self, seed: Optional[int]) -> "ImageTransform":
        """Restart the pipeline's random stream from ``seed`` (``None``: fresh entropy).

        All transforms share one numpy and one Python generator, so their
        draws are independent of each other (albumentations' own
        ``set_random_seed`` would give every transform an identically seeded
        copy, correlating e.g. the flip decision with the crop position).
        """
        self.seed = None if seed is None else int(seed)
        self.compose.set_random_seed(self.seed)
        self.compose.set_random_state(np.random.default_rng(self.seed), random.Random(self.seed))
        return self

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            desc = (
                f"{image.dtype} array of shape {image.shape}"
                if isinstance(image, np.ndarray)
                else type(image).__name__
            )
            raise ValueError(f"expected an RGB uint8 image of shape [H, W, 3], got a {desc}")
        return self.compose(image=image)["image"].contiguous()

    def __repr__(self) -> str:
        steps = ", ".join(type(t).__name__ for t in self.compose.transforms)
        return f"ImageTransform([{steps}], seed={self.seed})"


def build_train_transform(
    height: int = 256,
    width: int = 128,
    *,
    pad: int = 10,
    flip: bool = True,
    random_erasing: float = 0.0,
    color_jitter: float = 0.0,
    seed: Optional[int] = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    interpolation: int = cv2.INTER_CUBIC,
) -> ImageTransform:
    """The reference training pipeline (module docstring); ``pad=0`` drops pad + crop.

    ``color_jitter`` is the brightness/contrast/saturation strength (the
    reference's ``--color_jitter`` flag means 0.1; hue stays 0);
    ``random_erasing`` is the erasing probability (reference ``--erasing_p``).
    """
    _check_size(height, width)
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    if not 0.0 <= random_erasing <= 1.0:
        raise ValueError(f"random_erasing is a probability in [0, 1], got {random_erasing}")
    if color_jitter < 0:
        raise ValueError(f"color_jitter must be >= 0, got {color_jitter}")
    steps: list = []
    if color_jitter > 0:
        steps.append(
            A.ColorJitter(
                brightness=color_jitter, contrast=color_jitter, saturation=color_jitter, hue=0.0, p=1.0
            )
        )
    steps.append(A.Resize(height, width, interpolation=interpolation))
    if pad > 0:
        steps.append(A.Pad(padding=pad, fill=0, border_mode=cv2.BORDER_CONSTANT))
        steps.append(A.RandomCrop(height, width))
    if flip:
        steps.append(A.HorizontalFlip(p=0.5))
    steps.append(A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0))
    if random_erasing > 0:
        steps.append(A.Erasing(scale=(0.02, 0.4), ratio=(0.3, 1 / 0.3), fill=0, p=random_erasing))
    steps.append(ToTensorV2())
    return ImageTransform(A.Compose(steps), seed=seed)


def build_test_transform(
    height: int = 256,
    width: int = 128,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    interpolation: int = cv2.INTER_CUBIC,
) -> ImageTransform:
    """Resize + ImageNet normalisation (deterministic)."""
    _check_size(height, width)
    steps = [
        A.Resize(height, width, interpolation=interpolation),
        A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0),
        ToTensorV2(),
    ]
    return ImageTransform(A.Compose(steps), seed=0)


def _check_size(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
