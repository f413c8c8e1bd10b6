"""Image pipelines (albumentations + OpenCV): RGB uint8 HWC array -> float32 CHW tensor.

The test pipeline (:func:`build_test_transform`) is ``Resize(H, W, bicubic)``
+ ``Normalize(ImageNet mean/std)`` + CHW; :func:`build_test_array_transform`
runs the same steps and gives a float32 numpy array instead of a tensor,
without torch (exported models run on numpy). Torch is imported (through
``albumentations.pytorch``) only when a tensor pipeline is built.

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

The classification track's training augmentation
(:func:`build_classification_augment`, FedLMD Sec. 5.1: "random cropping,
random horizontal flipping, and normalization") works on the stored ``uint8``
images and returns ``uint8`` images of the same shape; the dataset
(:class:`fedreid.data.classification.ClassificationDataset`) normalises them
exactly as it normalises test images::

    Pad(4, constant 0) + RandomCrop(H, W)       torchvision RandomCrop(H, padding=4)
    HorizontalFlip(p=0.5)                       RandomHorizontalFlip()
    [Cutout(16) on the normalised tensor]       crop_flip_cutout only

Randomness: every random draw of a pipeline comes from one numpy and one
Python generator owned by the pipeline (never from global state).
``ImageTransform.reseed(seed)`` (and ``ArrayAugment.reseed``) restarts them,
so the same seed gives the same sequence of augmented images; the trainer
reseeds per (round, client, epoch), and
:func:`fedreid.data.datasets.make_loader` reseeds the per-worker copies.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Optional, Sequence

import albumentations as A
import cv2
import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "CLASSIFICATION_AUGMENTS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArrayAugment",
    "ArrayImageTransform",
    "ImageTransform",
    "build_classification_augment",
    "build_test_array_transform",
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
        _seed_compose(self.compose, self.seed)
        return self

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            desc = (
                f"{image.dtype} array of shape {image.shape}"
                if isinstance(image, np.ndarray)
                else type(image).__name__
            )
            raise ValueError(f"expected an RGB uint8 image of shape [H, W, 3], got a {desc}")
        return self._output(self.compose(image=image)["image"])

    def _output(self, image: torch.Tensor) -> torch.Tensor:
        return image.contiguous()

    def __repr__(self) -> str:
        steps = ", ".join(type(t).__name__ for t in self.compose.transforms)
        return f"{type(self).__name__}([{steps}], seed={self.seed})"


class ArrayImageTransform(ImageTransform):
    """An :class:`ImageTransform` giving a float32 numpy ``[3, H, W]`` instead of a tensor (no torch needed).

    Its steps end with an HWC float32 array, whose channels are moved first
    as ``ToTensorV2`` does: the values equal those of the tensor pipeline.
    """

    def __call__(self, image: np.ndarray) -> np.ndarray:
        return super().__call__(image)

    def _output(self, image: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(image.transpose(2, 0, 1))


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
    from albumentations.pytorch import ToTensorV2

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
    """Resize + ImageNet normalisation (deterministic): :func:`build_test_array_transform`'s steps, as a tensor."""
    from albumentations.pytorch import ToTensorV2

    steps = [*_test_steps(height, width, mean, std, interpolation), ToTensorV2()]
    return ImageTransform(A.Compose(steps), seed=0)


def build_test_array_transform(
    height: int = 256,
    width: int = 128,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    interpolation: int = cv2.INTER_CUBIC,
) -> ArrayImageTransform:
    """The test pipeline without torch: float32 numpy ``[3, H, W]`` equal to :func:`build_test_transform`'s tensor."""
    return ArrayImageTransform(A.Compose(_test_steps(height, width, mean, std, interpolation)), seed=0)


def _test_steps(
    height: int, width: int, mean: Sequence[float], std: Sequence[float], interpolation: int
) -> list:
    """Resize to ``height x width`` (``interpolation``) + normalisation by ``mean``/``std``, HWC float32 out."""
    _check_size(height, width)
    return [
        A.Resize(height, width, interpolation=interpolation),
        A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0),
    ]


def _seed_compose(compose: A.Compose, seed: Optional[int]) -> np.random.Generator:
    """Give every transform of ``compose`` one shared numpy and one Python generator seeded by ``seed``.

    Returns the numpy generator (steps outside albumentations may draw from it too).
    """
    compose.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    compose.set_random_state(rng, random.Random(seed))
    return rng


#: Values of ``classification.augment`` besides ``auto`` (see :func:`build_classification_augment`).
CLASSIFICATION_AUGMENTS: tuple[str, ...] = ("none", "crop_flip", "crop_flip_cutout")


class ArrayAugment:
    """A seeded augmentation of ``uint8`` images: ``augment(image) -> image`` of the same shape and dtype.

    ``image`` is ``H x W`` (grey) or ``H x W x C``. The albumentations steps
    run on the ``uint8`` pixels; :meth:`after_normalize` applies Cutout
    (``cutout > 0``) to the normalised ``C x H x W`` tensor, which
    :class:`fedreid.data.classification.ClassificationDataset` calls after its
    normalisation. All draws (crop offset, flip, Cutout centre) come from the
    one numpy and one Python generator that :meth:`reseed` restarts.
    """

    def __init__(self, compose: A.Compose, *, cutout: int = 0, seed: Optional[int] = None) -> None:
        if cutout < 0:
            raise ValueError(f"cutout must be >= 0, got {cutout}")
        self.compose = compose
        self.cutout = int(cutout)
        self.seed: Optional[int] = None
        self.reseed(seed)

    def reseed(self, seed: Optional[int]) -> "ArrayAugment":
        """Restart the random stream from ``seed`` (``None``: fresh entropy)."""
        self.seed = None if seed is None else int(seed)
        self._rng = _seed_compose(self.compose, self.seed)
        return self

    def __call__(self, image: np.ndarray) -> np.ndarray:
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim not in (2, 3):
            desc = f"{image.dtype} array of shape {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise ValueError(f"expected a uint8 image of shape [H, W] or [H, W, C], got a {desc}")
        out = self.compose(image=image)["image"]
        # albumentations keeps H x W x C; give back exactly the input's layout.
        return np.ascontiguousarray(out.reshape(image.shape))

    def after_normalize(self, tensor: torch.Tensor) -> torch.Tensor:
        """Cutout (DeVries and Taylor 2017) as FedNTD's loaders apply it after ``Normalize``.

        A centre ``(y, x)`` uniform over the pixels; the square
        ``[y - L//2, y + L//2) x [x - L//2, x + L//2)`` clipped to the image is
        set to 0 in every channel (the channel mean, after normalisation).
        ``tensor`` is ``C x H x W``; returned unchanged when ``cutout == 0``.
        """
        if self.cutout == 0:
            return tensor
        h, w = tensor.shape[-2:]
        y, x = int(self._rng.integers(h)), int(self._rng.integers(w))
        half = self.cutout // 2
        tensor = tensor.clone()
        tensor[..., max(y - half, 0) : min(y + half, h), max(x - half, 0) : min(x + half, w)] = 0
        return tensor

    def __repr__(self) -> str:
        steps = [type(t).__name__ for t in self.compose.transforms] + ([f"Cutout({self.cutout})"] if self.cutout else [])
        return f"ArrayAugment([{', '.join(steps)}], seed={self.seed})"


def build_classification_augment(
    kind: str, height: int, width: int, *, pad: int = 4, cutout: int = 16, seed: Optional[int] = None
) -> Optional[ArrayAugment]:
    """The classification track's training augmentation named ``kind`` (``None`` for ``"none"``).

    ``crop_flip`` (FedLMD Sec. 5.1; FedNTD's code, which FedLMD's runs:
    ``RandomCrop(H, padding=4)`` + ``RandomHorizontalFlip()``): zero-pad
    ``pad`` pixels on every side, crop a random ``height x width`` window
    (offsets uniform in ``0..2*pad``, both axes), flip left-right with
    probability 0.5. ``crop_flip_cutout``: the same, then Cutout of side
    ``cutout`` on the normalised tensor (FedNTD's loaders append
    ``Cutout(16)``; the FedLMD paper does not mention it). ``height`` and
    ``width`` are the stored images' size: the output keeps it.
    """
    if kind not in CLASSIFICATION_AUGMENTS:
        raise ValueError(f"unknown augmentation {kind!r}; known: {', '.join(CLASSIFICATION_AUGMENTS)}")
    _check_size(height, width)
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    if kind == "none":
        return None
    steps: list = []
    if pad > 0:
        steps.append(A.Pad(padding=pad, fill=0, border_mode=cv2.BORDER_CONSTANT))
        steps.append(A.RandomCrop(height, width))
    steps.append(A.HorizontalFlip(p=0.5))
    return ArrayAugment(A.Compose(steps), cutout=cutout if kind == "crop_flip_cutout" else 0, seed=seed)


def _check_size(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
