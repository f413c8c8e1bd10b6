"""Every shipped classification config (configs/classification/*.yaml) builds its federation and runs.

The datasets are replaced by fakes written in their real on-disk formats (the
CIFAR python pickles, the MNIST IDX files) with the real datasets' class
structure, so the partition each config asks for is built exactly as on the
real data; scikit-learn's digits are the real ones. Nothing is downloaded.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedreid.config import load_config, read_yaml
from fedreid.data.classification import CIFAR10_CLASSES, ArrayDataset
from fedreid.data.partition import PartitionError
from fedreid.fl import classification as track
from fedreid.fl.federation import build_classification_federation
from fedreid.fl.simulation import run_simulation

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "classification"
CONFIGS = sorted(CONFIG_DIR.rglob("*.yaml"))

#: Training images per class of the real datasets.
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
REAL_TRAIN_COUNTS = {
    "cifar10": [5000] * 10,
    "cifar100": [500] * 100,
    "mnist": MNIST_TRAIN,
    "fashion_mnist": [6000] * 10,
}
#: Image shape of each dataset as its loader returns it (the models are built for it).
IMAGE_SHAPES = {"cifar10": (32, 32, 3), "cifar100": (32, 32, 3), "mnist": (28, 28), "fashion_mnist": (28, 28)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_paper_configs_train_in_fp32_as_the_official_code():
    """FedLMD's and FedFTG's table configs: no autocast in the official code, so not bf16 on a GPU."""
    paper = [p for p in CONFIGS if p.name.startswith("fedlmd_") or p.parent.name == "fedftg"]
    assert len(paper) >= 40
    assert all(load_config(p).train.precision == "fp32" for p in paper), [p.name for p in paper]


# --------------------------------------------------------------------------- fake datasets on disk


def _labels(counts, rng):
    return rng.permutation(np.repeat(np.arange(len(counts)), counts)).astype(np.int64)


def _images(labels, shape, *, zeros):
    if zeros:
        return np.zeros((labels.size, *shape), dtype=np.uint8)
    # Small label-dependent patterns plus noise: something a round can learn from.
    rng = np.random.default_rng(labels.size)
    base = (labels.reshape(-1, *([1] * len(shape))) * 23 % 200).astype(np.int16)
    noise = rng.integers(0, 40, size=(labels.size, *shape), dtype=np.int16)
    return (base + noise).astype(np.uint8)


def _cifar_rows(images):
    # N x 32 x 32 x 3 -> N x 3072, channel-major (1024 R, 1024 G, 1024 B), as the release stores it.
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), -1))


def _dump(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)


def _write_idx(path, array):
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_fake(dataset, root, train_counts, test_counts, *, zeros, seed=0):
    """``dataset``'s train and test splits in its release format under ``root``."""
    rng = np.random.default_rng(seed)
    train_y, test_y = _labels(train_counts, rng), _labels(test_counts, rng)
    shape = IMAGE_SHAPES[dataset]
    train_x, test_x = _images(train_y, shape, zeros=zeros), _images(test_y, shape, zeros=zeros)
    if dataset == "cifar10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        for i, (x, y) in enumerate(zip(np.array_split(train_x, 5), np.array_split(train_y, 5)), start=1):
            _dump(folder / f"data_batch_{i}", {"data": _cifar_rows(x), "labels": y.tolist()})
        _dump(folder / "test_batch", {"data": _cifar_rows(test_x), "labels": test_y.tolist()})
        _dump(folder / "batches.meta", {"label_names": list(CIFAR10_CLASSES)})
    elif dataset == "cifar100":
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        for name, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            _dump(folder / name, {"data": _cifar_rows(x), "fine_labels": y.tolist(), "coarse_labels": (y // 5).tolist()})
    elif dataset in ("mnist", "fashion_mnist"):
        root.mkdir(parents=True, exist_ok=True)
        for prefix, x, y in (("train", train_x, train_y), ("t10k", test_x, test_y)):
            _write_idx(root / f"{prefix}-images-idx3-ubyte", x)
            _write_idx(root / f"{prefix}-labels-idx1-ubyte", y)
    else:
        raise AssertionError(f"no fake for classification.dataset={dataset!r}: add one to {Path(__file__).name}")
    return root


@pytest.fixture(scope="module")
def full_size_root(tmp_path_factory):
    """``dataset -> folder`` of a fake with the real training class counts (written once, removed after)."""
    made = {}

    def make(dataset):
        if dataset not in made:
            counts = REAL_TRAIN_COUNTS.get(dataset)
            if counts is None:
                raise AssertionError(f"no class structure for classification.dataset={dataset!r}: add it to REAL_TRAIN_COUNTS")
            root = tmp_path_factory.mktemp(f"full-{dataset}")
            made[dataset] = write_fake(dataset, root, counts, [2] * len(counts), zeros=True)
        return made[dataset]

    yield make
    for root in made.values():  # CIFAR at full size is 150 MB a dataset
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    """``dataset -> folder`` of a small fake (12 training and 2 test images per class; CIFAR-100: 2 and 1)."""
    made = {}

    def make(dataset):
        if dataset not in made:
            classes = len(REAL_TRAIN_COUNTS[dataset]) if dataset in REAL_TRAIN_COUNTS else 10
            per_train, per_test = (2, 1) if classes == 100 else (12, 2)
            root = tmp_path_factory.mktemp(f"small-{dataset}")
            made[dataset] = write_fake(dataset, root, [per_train] * classes, [per_test] * classes, zeros=False)
        return made[dataset]

    return make


@pytest.fixture(scope="module")
def loaded():
    """The real loaders run once per (dataset, folder); later builds reuse the arrays."""
    return {}


@pytest.fixture(scope="module")
def partitioned():
    """Splits by their inputs: configs that differ only elsewhere (objective, FedFTG) share one."""
    return {}


def _partition_key(c):
    return (c.dataset, c.root, c.split_seed, c.test_fraction, c.train_subset, c.partition, c.num_clients, c.alpha,
            c.min_size, c.max_retries, c.shards_per_client, c.unbalanced_sigma)


@pytest.fixture
def cached_loading(monkeypatch, loaded, partitioned):
    """The real loaders and partitioner, each run once per distinct input (they are deterministic)."""
    real_load, real_partition = track.load_train_test, track.partition_clients

    def load_train_test(cfg):
        key = _partition_key(cfg.classification)[:5]
        if key not in loaded:
            loaded[key] = real_load(cfg)
        return loaded[key]

    def partition_clients(cfg, train):
        key = _partition_key(cfg.classification)
        if key not in partitioned:
            partitioned[key] = real_partition(cfg, train)
        return partitioned[key]

    monkeypatch.setattr(track, "load_train_test", load_train_test)
    monkeypatch.setattr(track, "partition_clients", partition_clients)


def _run_path(path):
    """What decides the code a round runs: the config less its Dirichlet concentration, targets and folders."""
    data = read_yaml(path)
    data.get("classification", {}).pop("alpha", None)
    data.get("classification", {}).pop("target_accuracies", None)
    data.get("classification", {}).pop("root", None)
    data.get("run", {}).pop("out_dir", None)
    return repr(sorted((k, repr(v)) for k, v in data.items()))


def _one_round_params():
    """Every config; one per distinct run path is fast, its repeats (e.g. beta=0.6 of a beta=0.3 row) are slow."""
    seen, params = set(), []
    for path in CONFIGS:
        key = _run_path(path)
        marks = [pytest.mark.slow] if key in seen else []
        seen.add(key)
        params.append(pytest.param(path, marks=marks, id=str(path.relative_to(CONFIG_DIR).with_suffix(""))))
    return params


def _config_id(path):
    return str(path.relative_to(CONFIG_DIR).with_suffix(""))


def _config(path, root_of, *extra):
    dataset = load_config(path).classification.dataset
    overrides = ["run.device=cpu", "run.tensorboard=false"]
    if dataset != "digits":  # digits: scikit-learn's bundled copy, the real data
        overrides.append(f"classification.root={root_of(dataset)}")
    return load_config(path, overrides + list(extra))


# --------------------------------------------------------------------------- tests


def test_the_shipped_configs_are_found():
    names = {p.stem for p in CONFIGS}
    assert {"fedlmd_cifar10_lda", "fedlmd_cifar10_shards", "digits_fedavg"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=_config_id)
def test_config_builds_its_partition_on_the_real_class_structure(path, full_size_root, cached_loading):
    cfg = _config(path, full_size_root)
    c = cfg.classification
    fed = build_classification_federation(cfg)
    train, _ = track.load_train_test(cfg)
    if path.stem == "fedlmd_cifar10_lda":  # the paper's setting that stopped before round 1 (min_size)
        assert c.partition == "dirichlet" and c.alpha == 0.05 and c.num_clients == 100
    if c.dataset in REAL_TRAIN_COUNTS and c.train_subset is None:
        assert train.class_counts().tolist() == REAL_TRAIN_COUNTS[c.dataset]
    elif c.dataset in REAL_TRAIN_COUNTS:  # a stratified subset keeps each class's share
        real = np.asarray(REAL_TRAIN_COUNTS[c.dataset])
        assert len(train) == c.train_subset
        assert np.all(np.abs(train.class_counts() - real * c.train_subset / real.sum()) < 1)
    parts = [np.asarray(s.records) for s in fed.splits]
    sizes = np.array([len(p) for p in parts])
    assert len(fed.clients) == len(parts) == c.num_clients
    assert sizes.min() >= 1, f"{path.name}: an empty client"
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(train)))  # disjoint and complete
    for client, part in zip(fed.clients, parts):
        assert np.array_equal(client.split.labels, train.labels[part])
    assert np.array_equal(fed.class_counts.sum(axis=0), train.class_counts())
    assert np.array_equal(fed.class_counts.sum(axis=1), sizes)
    classes_held = (fed.class_counts > 0).sum(axis=1)
    if c.partition == "dirichlet":
        assert sizes.min() >= c.min_size
    elif c.partition == "dirichlet_prior" and c.unbalanced_sigma == 0:
        assert sizes.max() - sizes.min() <= 1
    elif c.partition == "shards":
        assert sizes.max() - sizes.min() <= c.shards_per_client
        assert classes_held.max() <= 2 * c.shards_per_client
    elif c.partition == "iid":
        assert sizes.max() - sizes.min() <= 1
    # The model is built for the dataset's real image shape and class count.
    height, width = train.images.shape[1:3]
    with torch.no_grad():
        logits = fed.work_model.eval()(torch.zeros(2, train.channels, height, width))
    assert logits.shape == (2, train.num_classes)


def test_unreachable_dirichlet_min_size_names_the_config_keys_and_a_value_that_builds():
    path = CONFIG_DIR / "fedlmd_cifar10_lda.yaml"
    cfg = load_config(path, ["classification.min_size=10", "classification.max_retries=20"])
    train = ArrayDataset("cifar10", np.zeros((50000, 1, 1), np.uint8), np.repeat(np.arange(10), 5000), CIFAR10_CLASSES)
    with pytest.raises(PartitionError) as info:
        track.partition_clients(cfg, train)
    message = str(info.value)
    for key in ("classification.alpha", "classification.min_size", "classification.num_clients",
                "classification.max_retries", "classification.split_seed=0"):
        assert key in message
    assert "after 21 draws" in message and "\n" not in message
    suggested = int(re.search(r"classification\.min_size \(<= (\d+) succeeds", message).group(1))
    assert suggested >= 1
    splits = track.partition_clients(
        load_config(path, [f"classification.min_size={suggested}", "classification.max_retries=20"]), train
    )
    assert min(len(s) for s in splits) >= suggested


def test_empty_client_names_the_min_size_key():
    cfg = load_config(CONFIG_DIR / "fedlmd_cifar10_lda.yaml", ["classification.min_size=0"])
    train = ArrayDataset("cifar10", np.zeros((50000, 1, 1), np.uint8), np.repeat(np.arange(10), 5000), CIFAR10_CLASSES)
    with pytest.raises(Exception, match=r"classification\.min_size.*1 or more"):
        track.partition_clients(cfg, train)


def _small_round_overrides(cfg):
    """One round on a few small clients, keeping the objective, FedFTG and the partition kind."""
    c = cfg.classification
    extra = [
        "classification.num_clients=4", "fl.clients_per_round=2", "fl.rounds=1", "train.local_epochs=1",
        "train.batch_size=8", "eval.every=1", "eval.batch_size=100",
    ]
    if c.partition == "dirichlet":
        extra.append("classification.min_size=1")
    if c.train_subset is not None:  # the small data is smaller than the subset
        extra.append("classification.train_subset=null")
    if cfg.fl.fedftg:  # FedFTG's server fine-tuning, shortened: one iteration on small batches
        extra += ["fl.fedftg_options.iterations=1", "fl.fedftg_options.batch_size=8"]
    if cfg.train.objective == "fedgen":  # FedGen's server generator, shortened: one step on a small batch
        extra += ["train.objective_options.generator_steps=1", "train.objective_options.generator_batch_size=8"]
    hooks = [dict(h) for h in cfg.fl.hooks]
    for hook in hooks:
        if hook["name"] == "feddf":  # FedDF's server distillation, shortened
            hook.update(generator_steps=1, distill_steps=1, batch_size=8)
    if hooks:
        extra.append("fl.hooks=" + json.dumps(hooks))
    return extra


@pytest.mark.parametrize("path", _one_round_params())
def test_config_runs_one_round_on_small_data(path, small_root, tmp_path):
    base = load_config(path)
    cfg = _config(path, small_root, *_small_round_overrides(base), f"run.out_dir={tmp_path / 'run'}")
    assert cfg.train.objective == base.train.objective and cfg.fl.fedftg == base.fl.fedftg
    assert cfg.classification.partition == base.classification.partition
    assert cfg.model.backbone == base.model.backbone
    history = run_simulation(cfg, tmp_path / "run", progress=False)
    assert len(history) == 1
    result = history[0]["eval"]["test"]
    assert 0.0 <= result["accuracy"] <= 1.0 and np.isfinite(result["loss"])
