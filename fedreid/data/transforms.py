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

Normalising where the batch is (``defer_normalize=True``): the worker stops
at the ``uint8`` pixels, and :class:`BatchNormalize` finishes a collated batch
on the device it is copied to. A worker then skips the float32 work and
ships a quarter of the bytes (``bench/loader_path.py`` measures both). The
result is the worker pipeline's tensor bit for bit: ``Normalize`` of ``uint8`` is a
per-channel table of 256 float32 values (albucore ``normalize_lut``), and
:class:`BatchNormalize` reads the table that ``Normalize`` itself gives for
every pixel value. Random erasing still draws its rectangle in the worker, from
the same generator and in the same order; only the filling moves::

    worker:  [ColorJitter] Resize [Pad + RandomCrop] [HorizontalFlip] [erasing: draw]
             -> {"image": uint8 [H, W, 3] tensor, "erase": int64 [4] (top, bottom, left, right)}
    device:  table lookup (Normalize) [erasing: fill 0] -> float32 [B, 3, H, W]

Randomness: every random draw of a pipeline comes from one numpy and one
Python generator owned by the pipeline (never from global state).
``ImageTransform.reseed(seed)`` (and ``ArrayAugment.reseed``) restarts them,
so the same seed gives the same sequence of augmented images; the trainer
reseeds per (round, client, epoch), and
:func:`fedreid.data.datasets.make_loader` reseeds the per-worker copies.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Optional, Sequence

import albumentations as A
import cv2
import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchNormalize",
    "CLASSIFICATION_AUGMENTS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArrayAugment",
    "ArrayImageTransform",
    "ImageTransform",
    "NORMALIZE_ON",
    "Uint8ImageTransform",
    "build_classification_augment",
    "build_test_array_transform",
    "build_test_transform",
    "build_train_transform",
    "defers_normalize",
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


class ReferenceErasing(A.Erasing):
    """``A.Erasing`` drawing its rectangle as Zhong et al.'s ``RandomErasing`` does (cap-ntu/FedReID ``random_erasing.py``).

    Up to 100 tries of an area ``U(scale) * H * W`` and an aspect ``U(ratio)``,
    ``h = round(sqrt(area * aspect))``, ``w = round(sqrt(area / aspect))``, kept
    when ``h < H`` and ``w < W``; the corner is uniform; no rectangle when no
    try fits. ``A.Erasing`` itself caps the area at what every aspect in
    ``ratio`` fits (at 256x128, 15% of the image instead of 40%).
    """

    def get_params_dependent_on_data(self, params: dict, data: dict) -> dict:
        height, width = params["shape"][:2]
        for _ in range(100):
            area = self.py_random.uniform(*self.scale) * height * width
            aspect = self.py_random.uniform(*self.ratio)
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if w < width and h < height:
                top, left = self.py_random.randint(0, height - h), self.py_random.randint(0, width - w)
                return {"holes": np.array([[left, top, left + w, top + h]], dtype=np.int32),
                        "seed": self.random_generator.integers(0, 2**32 - 1)}
        return {"holes": np.zeros((0, 4), dtype=np.int32)}


class _ErasingBox(ReferenceErasing):
    """:class:`ReferenceErasing` that draws its rectangle and leaves the pixels alone.

    :class:`Uint8ImageTransform` reads the drawn rectangle (``holes``, ``None``
    when the step did not fire) and :class:`BatchNormalize` fills it.
    """

    holes: Optional[np.ndarray] = None

    def apply(self, img: np.ndarray, holes: np.ndarray, seed: int, **params) -> np.ndarray:
        self.holes = holes
        return img


class BatchNormalize:
    """The device half of a deferred pipeline: ``normalize(images, erase) -> float32 [B, 3, H, W]``.

    ``images`` is a collated ``uint8 [B, H, W, 3]`` batch of
    :class:`Uint8ImageTransform` outputs on any device, ``erase`` its
    ``int64 [B, 4]`` rectangles ``(top, bottom, left, right)`` or ``None``.
    Every pixel value becomes the float32 that ``A.Normalize(mean, std)``
    gives it (the table is read from ``Normalize`` itself, so the values are
    the worker pipeline's bit for bit), then each rectangle is set to 0 in
    every channel, as ``Erasing(fill=0)`` after ``Normalize`` does.
    ``memory_format`` is the layout of the result (``torch.channels_last``
    for a channels-last model on CUDA).
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        every_value = np.repeat(np.arange(256, dtype=np.uint8).reshape(256, 1, 1), 3, axis=2)
        table = A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0, p=1.0)(image=every_value)
        self.table = np.ascontiguousarray(np.asarray(table["image"], dtype=np.float32).reshape(256, 3).T)
        self._tables: dict = {}  # device -> [3 * 256] tensor

    def __call__(self, images: torch.Tensor, erase: Optional[torch.Tensor] = None, *,
                 memory_format: Optional[torch.memory_format] = None) -> torch.Tensor:
        import torch

        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected a uint8 batch of shape [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
        table = self._tables.get(images.device)
        if table is None:
            table = self._tables[images.device] = torch.from_numpy(self.table).reshape(-1).to(images.device)
        channel_offset = torch.arange(0, 3 * 256, 256, device=images.device)
        out = table[images.long() + channel_offset]  # [B, H, W, 3]: table row c, column = pixel value
        if erase is not None:
            top, bottom, left, right = erase.to(images.device).unbind(1)
            rows = torch.arange(images.shape[1], device=images.device)
            cols = torch.arange(images.shape[2], device=images.device)
            in_rows = (rows >= top[:, None]) & (rows < bottom[:, None])
            in_cols = (cols >= left[:, None]) & (cols < right[:, None])
            out = out.masked_fill((in_rows[:, :, None] & in_cols[:, None, :])[..., None], 0.0)
        return out.permute(0, 3, 1, 2).contiguous(memory_format=memory_format or torch.contiguous_format)

    def __repr__(self) -> str:
        return "BatchNormalize()"


class Uint8ImageTransform(ImageTransform):
    """The worker half of a deferred pipeline: ``transform(rgb_uint8_hwc) -> {"image", ["erase"]}``.

    ``image`` is the ``uint8 [H, W, 3]`` tensor the worker pipeline would
    have normalised; ``erase`` (only when the pipeline has random erasing) is
    the rectangle it drew, ``int64 [4]`` as ``(top, bottom, left, right)``,
    all zero when it drew none. :attr:`batch_normalize` finishes a collated
    batch of them (module docstring).
    """

    def __init__(self, compose: A.Compose, batch_normalize: BatchNormalize, seed: Optional[int] = None) -> None:
        super().__init__(compose, seed)
        self.batch_normalize = batch_normalize
        self._erasing = next((t for t in compose.transforms if isinstance(t, _ErasingBox)), None)

    def __call__(self, image: np.ndarray) -> dict:
        if self._erasing is not None:
            self._erasing.holes = None
        return super().__call__(image)

    def _output(self, image: np.ndarray) -> dict:
        import torch

        out = {"image": torch.from_numpy(np.ascontiguousarray(image))}
        if self._erasing is not None:
            box = np.zeros(4, dtype=np.int64)
            holes = self._erasing.holes
            if holes is not None and len(holes):
                left, top, right, bottom = (int(v) for v in holes[0])  # A.Erasing draws one hole
                box[:] = (top, bottom, left, right)
            out["erase"] = torch.from_numpy(box)
        return out


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
    defer_normalize: bool = False,
) -> ImageTransform:
    """The reference training pipeline (module docstring); ``pad=0`` drops pad + crop.

    ``color_jitter`` is the brightness/contrast/saturation strength (the
    reference's ``--color_jitter`` flag means 0.1; hue stays 0);
    ``random_erasing`` is the erasing probability (reference ``--erasing_p``).
    ``defer_normalize``: a :class:`Uint8ImageTransform` whose
    ``batch_normalize`` finishes the batch where it is (module docstring).
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
    if not defer_normalize:
        steps.append(A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0))
    if random_erasing > 0:  # deferred: the rectangle is drawn here and filled by BatchNormalize
        erasing = _ErasingBox if defer_normalize else ReferenceErasing
        steps.append(erasing(scale=(0.02, 0.4), ratio=(0.3, 1 / 0.3), fill=0, p=random_erasing))
    if defer_normalize:
        return Uint8ImageTransform(A.Compose(steps), BatchNormalize(mean, std), seed=seed)
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
    defer_normalize: bool = False,
) -> ImageTransform:
    """Resize + ImageNet normalisation (deterministic): :func:`build_test_array_transform`'s steps, as a tensor.

    ``defer_normalize``: Resize only, a :class:`Uint8ImageTransform` whose
    ``batch_normalize`` normalises the batch where it is (module docstring).
    """
    if defer_normalize:
        steps = _test_steps(height, width, mean, std, interpolation, normalize=False)
        return Uint8ImageTransform(A.Compose(steps), BatchNormalize(mean, std), seed=0)
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
    height: int, width: int, mean: Sequence[float], std: Sequence[float], interpolation: int, *,
    normalize: bool = True,
) -> list:
    """Resize to ``height x width`` (``interpolation``) + normalisation by ``mean``/``std``, HWC float32 out.

    ``normalize=False``: the resize only (uint8 out), for :class:`BatchNormalize` to finish.
    """
    _check_size(height, width)
    steps = [A.Resize(height, width, interpolation=interpolation)]
    if normalize:
        steps.append(A.Normalize(mean=tuple(mean), std=tuple(std), max_pixel_value=255.0))
    return steps


def _seed_compose(compose: A.Compose, seed: Optional[int]) -> np.random.Generator:
    """Give every transform of ``compose`` one shared numpy and one Python generator seeded by ``seed``.

    Returns the numpy generator (steps outside albumentations may draw from it too).
    """
    compose.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    compose.set_random_state(rng, random.Random(seed))
    return rng


#: Values of ``classification.augment`` besides ``auto`` (see :func:`build_classification_augment`).
CLASSIFICATION_AUGMENTS: tuple[str, ...] = ("none", "crop_flip", "crop_flip_cutout", "flip_mean_crop")


class ArrayAugment:
    """A seeded augmentation of ``uint8`` images: ``augment(image) -> image`` of the same shape and dtype.

    ``image`` is ``H x W`` (grey) or ``H x W x C``. The albumentations steps
    run on the ``uint8`` pixels; :meth:`after_normalize` applies what must see
    the normalised ``C x H x W`` tensor (a crop padded with ``mean_pad_crop``
    zeros, then Cutout when ``cutout > 0``), which
    :class:`fedreid.data.classification.ClassificationDataset` calls after its
    normalisation. All draws (crop offset, flip, Cutout centre) come from the
    one numpy and one Python generator that :meth:`reseed` restarts.
    """

    def __init__(self, compose: A.Compose, *, cutout: int = 0, mean_pad_crop: int = 0,
                 seed: Optional[int] = None) -> None:
        if cutout < 0:
            raise ValueError(f"cutout must be >= 0, got {cutout}")
        if mean_pad_crop < 0:
            raise ValueError(f"mean_pad_crop must be >= 0, got {mean_pad_crop}")
        self.compose = compose
        self.cutout = int(cutout)
        self.mean_pad_crop = int(mean_pad_crop)
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
        """The steps on the normalised ``C x H x W`` tensor: FedFTG's crop, then Cutout.

        ``mean_pad_crop = P > 0`` (FedFTG's ``utils/util_dataset.py:Dataset.__getitem__``):
        with probability 0.5 (``rng.random() > 0.5``), pad ``P`` zeros on
        every side (the channel mean, after normalisation) and keep the
        ``H x W`` window at offsets ``(dy, dx)`` uniform in ``0..2P``
        (``rng.integers(2P + 1, size=2)``).

        Cutout (DeVries and Taylor 2017) as FedNTD's loaders apply it after
        ``Normalize``: a centre ``(y, x)`` uniform over the pixels; the square
        ``[y - L//2, y + L//2) x [x - L//2, x + L//2)`` clipped to the image is
        set to 0 in every channel. The tensor comes back unchanged when
        neither step is configured.
        """
        if self.mean_pad_crop and self._rng.random() > 0.5:
            pad = self.mean_pad_crop
            h, w = tensor.shape[-2:]
            dy, dx = (int(v) for v in self._rng.integers(2 * pad + 1, size=2))
            padded = tensor.new_zeros((*tensor.shape[:-2], h + 2 * pad, w + 2 * pad))
            padded[..., pad : pad + h, pad : pad + w] = tensor
            tensor = padded[..., dy : dy + h, dx : dx + w].contiguous()
        if self.cutout == 0:
            return tensor
        h, w = tensor.shape[-2:]
        y, x = int(self._rng.integers(h)), int(self._rng.integers(w))
        half = self.cutout // 2
        tensor = tensor.clone()
        tensor[..., max(y - half, 0) : min(y + half, h), max(x - half, 0) : min(x + half, w)] = 0
        return tensor

    def __repr__(self) -> str:
        steps = [type(t).__name__ for t in self.compose.transforms]
        steps += [f"MeanPadCrop({self.mean_pad_crop})"] if self.mean_pad_crop else []
        steps += [f"Cutout({self.cutout})"] if self.cutout else []
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
    ``Cutout(16)``; the FedLMD paper does not mention it).
    ``flip_mean_crop`` (FedFTG's official loader, ``utils/util_dataset.py:
    Dataset.__getitem__``; the paper names no augmentation): flip left-right
    with probability 0.5, then with probability 0.5 a ``pad``-padded random
    crop whose padding is the channel mean (zeros of the normalised tensor,
    :meth:`ArrayAugment.after_normalize`). ``height`` and ``width`` are the
    stored images' size: the output keeps it.
    """
    if kind not in CLASSIFICATION_AUGMENTS:
        raise ValueError(f"unknown augmentation {kind!r}; known: {', '.join(CLASSIFICATION_AUGMENTS)}")
    _check_size(height, width)
    if pad < 0:
        raise ValueError(f"pad must be >= 0, got {pad}")
    if kind == "none":
        return None
    if kind == "flip_mean_crop":
        return ArrayAugment(A.Compose([A.HorizontalFlip(p=0.5)]), mean_pad_crop=pad, seed=seed)
    steps: list = []
    if pad > 0:
        steps.append(A.Pad(padding=pad, fill=0, border_mode=cv2.BORDER_CONSTANT))
        steps.append(A.RandomCrop(height, width))
    steps.append(A.HorizontalFlip(p=0.5))
    return ArrayAugment(A.Compose(steps), cutout=cutout if kind == "crop_flip_cutout" else 0, seed=seed)


#: Values of ``train.normalize_on``.
NORMALIZE_ON: tuple[str, ...] = ("auto", "worker", "device")


def defers_normalize(normalize_on: str, device: object) -> bool:
    """Whether ``train.normalize_on=normalize_on`` normalises on ``device`` (a torch device or its name).

    ``auto`` defers on CUDA only: there the loader workers are what limits
    the step rate, while on the CPU the same work would only move from the
    workers to the training process.
    """
    if normalize_on not in NORMALIZE_ON:
        raise ValueError(f"train.normalize_on: expected one of {', '.join(NORMALIZE_ON)}, got {normalize_on!r}")
    device_type = getattr(device, "type", str(device).split(":")[0])
    return normalize_on == "device" or (normalize_on == "auto" and device_type == "cuda")


def _check_size(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
