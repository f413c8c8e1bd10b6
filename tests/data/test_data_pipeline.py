"""Training/test transforms, the image dataset and the seeded loader."""

import math

import cv2
import numpy as np
import pytest
import torch

from fedreid.data.datasets import (
    DeviceBatches,
    EpochLoader,
    ImageReadError,
    ReIDImageDataset,
    make_loader,
    read_image,
)
from fedreid.data.prepared import Record
from fedreid.data.scenarios import make_client
from fedreid.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_test_transform,
    build_train_transform,
    defers_normalize,
)

H, W = 32, 16  # small outputs keep the tests fast
MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def asymmetric_image(seed: int = 0, h: int = 48, w: int = 24) -> np.ndarray:
    """RGB uint8 with a left/right asymmetric pattern and noise."""
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[:, : w // 3] = (250, 20, 20)
    return img


def samples(transform, image, n):
    return [transform(image) for _ in range(n)]


# ---------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------


def test_output_shape_dtype_and_normalisation():
    img = np.full((50, 20, 3), (0, 128, 255), dtype=np.uint8)
    for t in (build_test_transform(H, W), build_train_transform(H, W, pad=0, seed=0)):
        out = t(img)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        assert out.shape == (3, H, W) and out.is_contiguous()
        expected = (torch.tensor([0, 128, 255]).view(3, 1, 1) / 255.0 - MEAN) / STD
        torch.testing.assert_close(out, expected.expand(3, H, W), rtol=0, atol=1e-5)
    assert build_train_transform()(asymmetric_image()).shape == (3, 256, 128)  # benchmark size


def test_rejects_non_rgb_uint8_input():
    t = build_test_transform(H, W)
    with pytest.raises(ValueError, match="RGB uint8"):
        t(np.zeros((10, 10), dtype=np.uint8))
    with pytest.raises(ValueError, match="RGB uint8"):
        t(np.zeros((10, 10, 3), dtype=np.float32))


def test_same_seed_same_tensors_different_seed_different():
    img = asymmetric_image()
    kw = dict(random_erasing=0.5, color_jitter=0.1)
    a = samples(build_train_transform(H, W, seed=3, **kw), img, 8)
    b = samples(build_train_transform(H, W, seed=3, **kw), img, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = samples(build_train_transform(H, W, seed=4, **kw), img, 8)
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    t = build_train_transform(H, W, seed=4, **kw)
    t.reseed(3)  # reseeding restarts the stream
    assert all(torch.equal(x, y) for x, y in zip(a, samples(t, img, 8)))
    assert t.seed == 3


def test_flip_is_applied_half_the_time():
    img = asymmetric_image()
    base = build_test_transform(H, W)(img)
    outs = samples(build_train_transform(H, W, pad=0, seed=0), img, 40)
    flipped = [torch.equal(o, base.flip(-1)) for o in outs]
    plain = [torch.equal(o, base) for o in outs]
    assert all(f or p for f, p in zip(flipped, plain))
    assert 5 < sum(flipped) < 35
    no_flip = samples(build_train_transform(H, W, pad=0, flip=False, seed=0), img, 10)
    assert all(torch.equal(o, base) for o in no_flip)


def test_pad_and_random_crop():
    img = asymmetric_image()
    pad = 4
    base = build_test_transform(H, W)(img)
    fill = (0 - MEAN) / STD  # the zero padding, normalised
    padded = fill.expand(3, H + 2 * pad, W + 2 * pad).clone()
    padded[:, pad : pad + H, pad : pad + W] = base
    offsets = set()
    for out in samples(build_train_transform(H, W, pad=pad, flip=False, seed=1), img, 30):
        found = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.allclose(out, padded[:, dy : dy + H, dx : dx + W], atol=1e-6)
        ]
        assert found, "output is not a crop of the padded image"
        offsets.update(found)
    assert len(offsets) > 5


def test_random_erasing_fills_zero_after_normalise():
    img = asymmetric_image()
    base = build_test_transform(H, W)(img)
    outs = samples(build_train_transform(H, W, pad=0, flip=False, random_erasing=1.0, seed=0), img, 5)
    for out in outs:
        erased = (out == 0).all(dim=0) & (base != 0).any(dim=0)
        assert erased.any()
        torch.testing.assert_close(out[:, ~erased], base[:, ~erased])


def test_random_erasing_draws_its_rectangle_as_the_reference():
    """Zhong et al.'s RandomErasing (cap-ntu/FedReID random_erasing.py): area U(0.02, 0.4), aspect U(0.3, 3.33)."""
    import random as stdlib_random

    height, width, n = 256, 128, 2000
    transform = build_train_transform(height, width, pad=0, flip=False, random_erasing=1.0, seed=0,
                                      defer_normalize=True)
    image = np.full((height, width, 3), 128, np.uint8)
    ours = []
    for _ in range(n):
        top, bottom, left, right = transform(image)["erase"].tolist()
        ours.append((bottom - top) * (right - left) / (height * width))
    rng, reference = stdlib_random.Random(1), []
    while len(reference) < n:  # the reference's loop, written out
        area, aspect = rng.uniform(0.02, 0.4) * height * width, rng.uniform(0.3, 1 / 0.3)
        h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if w < width and h < height:
            reference.append(h * w / (height * width))
    ours, reference = np.array(ours), np.array(reference)
    assert abs(ours.mean() - reference.mean()) < 0.01 and ours.max() > 0.35  # A.Erasing's own cap was 0.15
    assert abs(np.quantile(ours, 0.9) - np.quantile(reference, 0.9)) < 0.02


def test_color_jitter_changes_values_not_shape():
    img = asymmetric_image()
    base = build_test_transform(H, W)(img)
    out = build_train_transform(H, W, pad=0, flip=False, color_jitter=0.3, seed=0)(img)
    assert out.shape == base.shape and not torch.equal(out, base)


def test_transform_argument_checks():
    with pytest.raises(ValueError, match="probability"):
        build_train_transform(random_erasing=1.5)
    with pytest.raises(ValueError, match="pad"):
        build_train_transform(pad=-1)


# ---------------------------------------------------------------------------
# Dataset and loader
# ---------------------------------------------------------------------------


@pytest.fixture
def records(tmp_path) -> list[Record]:
    recs = []
    for i in range(6):
        path = tmp_path / f"{i:03d}_{10 + i // 2}_c{i % 3}.png"
        img = asymmetric_image(seed=i)
        assert cv2.imwrite(str(path), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        recs.append(Record(path, 10 + i // 2, i % 3, "train"))
    return recs


def test_read_image_is_rgb(tmp_path):
    path = tmp_path / "red.png"
    bgr = np.zeros((8, 4, 3), np.uint8)
    bgr[..., 2] = 255  # red in OpenCV's BGR order
    cv2.imwrite(str(path), bgr)
    img = read_image(path)
    assert img.dtype == np.uint8 and img.shape == (8, 4, 3)
    assert (img[..., 0] == 255).all() and (img[..., 1:] == 0).all()
    grey = tmp_path / "grey.png"
    cv2.imwrite(str(grey), np.full((5, 5), 7, np.uint8))
    assert read_image(grey).shape == (5, 5, 3)
    unicode = tmp_path / "bild_ä.png"
    cv2.imencode(".png", bgr)[1].tofile(str(unicode))
    assert read_image(unicode).shape == (8, 4, 3)


def test_dataset_items(records):
    client = make_client("c", "ds", records)
    ds = ReIDImageDataset.from_client(client, build_test_transform(H, W))
    assert len(ds) == 6
    item = ds[3]
    assert set(item) == {"image", "label", "pid", "camid", "index"}
    assert item["image"].shape == (3, H, W) and item["image"].dtype == torch.float32
    assert (item["label"], item["pid"], item["camid"], item["index"]) == (1, 11, 0, 3)
    assert all(isinstance(item[k], int) for k in ("label", "pid", "camid", "index"))
    torch.testing.assert_close(item["image"], build_test_transform(H, W)(read_image(records[3].path)))

    unlabelled = ReIDImageDataset(records)
    raw = unlabelled[0]
    assert raw["label"] == -1 and raw["image"].dtype == np.uint8 and raw["image"].shape == (48, 24, 3)
    with pytest.raises(ValueError, match="one per record"):
        ReIDImageDataset(records, labels=[0, 1])


def test_unreadable_and_missing_files_name_the_file(records, tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    missing = tmp_path / "gone.jpg"
    ds = ReIDImageDataset(
        records + [Record(p, 1, 0, "train") for p in (bad, empty, missing)],
        transform=build_test_transform(H, W),
    )
    for i, name in zip(range(6, 9), ("broken.jpg", "empty.jpg", "gone.jpg")):
        with pytest.raises(ImageReadError, match=name):
            ds[i]


def _batches(loader):
    return [(b["index"].tolist(), b["image"]) for b in loader]


def test_loader_determinism(records):
    client = make_client("c", "ds", records)

    def run(seed, epochs=2):
        ds = ReIDImageDataset.from_client(client, build_train_transform(H, W, pad=2))
        loader = make_loader(ds, 4, shuffle=True, seed=seed)
        return [_batches(loader) for _ in range(epochs)]

    a, b, c = run(0), run(0), run(1)
    for ea, eb in zip(a, b):
        for (ia, xa), (ib, xb) in zip(ea, eb):
            assert ia == ib and torch.equal(xa, xb)
    order = lambda run_: [i for epoch in run_ for idx, _ in epoch for i in idx]  # noqa: E731
    assert order(a) != order(c)
    assert order(a)[:6] != order(a)[6:]  # a new order each epoch
    # the loader batches carry the metadata
    plain = ReIDImageDataset.from_client(client, build_test_transform(H, W))
    batch = next(iter(make_loader(plain, 6, shuffle=False, seed=0)))
    assert batch["index"].tolist() == list(range(6))
    assert batch["label"].tolist() == client.labels.tolist()
    assert batch["image"].shape == (6, 3, H, W)


def test_loader_drop_last_and_seed_required(records):
    ds = ReIDImageDataset(records, transform=build_test_transform(H, W))
    assert len(make_loader(ds, 4, shuffle=False, seed=0, drop_last=True)) == 1
    with pytest.raises(ValueError, match="seed"):
        make_loader(ds, 4, shuffle=False, seed=None)


def test_workers_get_distinct_reproducible_augmentations(tmp_path):
    # every record is the same image: without per-worker reseeding the two
    # workers' transform copies would produce identical tensors
    path = tmp_path / "same.png"
    cv2.imwrite(str(path), cv2.cvtColor(asymmetric_image(), cv2.COLOR_RGB2BGR))
    recs = [Record(path, 1, 0, "train")] * 4

    def run():
        ds = ReIDImageDataset(recs, transform=build_train_transform(H, W, pad=4, random_erasing=0.5))
        return [b["image"] for b in make_loader(ds, 1, shuffle=False, seed=5, num_workers=2)]

    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # worker 0 and worker 1 differ


_FORK_AFTER_OPENCV_THREADS = """
import sys
import cv2, numpy as np
from fedreid.data.datasets import EpochLoader, make_loader

big = np.random.default_rng(0).integers(0, 255, (3000, 3000, 3), dtype=np.uint8)
for _ in range(3):  # the parent runs OpenCV's thread pool before the workers are forked
    cv2.resize(big, (1500, 1500)); cv2.GaussianBlur(big, (9, 9), 0)

class Images:
    def __len__(self): return 4
    def __getitem__(self, i): return int(cv2.resize(big[:64, :64], (32, 16)).sum())

print(len(list(make_loader(Images(), 2, shuffle=False, seed=0, num_workers=2))),
      len(list(EpochLoader(Images(), 2, num_workers=2).epoch(0, shuffle=False))), flush=True)
"""


def test_loader_workers_start_after_the_parent_used_opencvs_thread_pool(tmp_path):
    """Workers make OpenCV single-threaded without waiting for pool threads the fork did not copy (no hang)."""
    import subprocess
    import sys

    script = tmp_path / "fork_after_opencv.py"
    script.write_text(_FORK_AFTER_OPENCV_THREADS)
    if cv2.getNumThreads() < 2:
        pytest.skip("OpenCV runs single-threaded here: there is no thread pool to inherit")
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the loader's workers hung in their start-up (cv2.setNumThreads after a fork)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2"]


@pytest.mark.parametrize("workers", [0, 2])
def test_persistent_loader_epochs_equal_fresh_loaders(records, workers):
    # Three epochs (one abandoned after its first batch, as the CDW batch is, and one with
    # drop_last off) from one EpochLoader against a fresh make_loader per epoch: same order,
    # same augmentations, bit for bit, and the workers are the same processes throughout.
    client = make_client("c", "ds", records * 3)

    def dataset():
        return ReIDImageDataset.from_client(client, build_train_transform(H, W, pad=4, random_erasing=0.5))

    plan = [(11, True, None), (12, False, 1), (13, True, None), (14, False, None)]
    persistent = EpochLoader(dataset(), 4, num_workers=workers)
    for seed, drop_last, take in plan:
        fresh = make_loader(dataset(), 4, shuffle=True, seed=seed, num_workers=workers, drop_last=drop_last)
        if take:  # abandon the epoch after its first batch
            b = next(iter(persistent.epoch(seed, drop_last=drop_last)))
            got, want = [(b["index"].tolist(), b["image"])], _batches(fresh)[:1]
        else:
            got, want = _batches(persistent.epoch(seed, drop_last=drop_last)), _batches(fresh)
        assert len(got) == len(want) > 0
        for (ia, xa), (ib, xb) in zip(got, want):
            assert ia == ib and torch.equal(xa, xb)
    if workers:
        pids = lambda: {w.pid for w in persistent._loader._iterator._workers}  # noqa: E731
        first = pids()
        _batches(persistent.epoch(15))
        assert pids() == first


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_read_in_part_gives_its_first_batches_and_decodes_no_others(records, workers):
    # the CDW batch: the first batch of an epoch, as the whole epoch would give it
    client = make_client("c", "ds", records * 3)
    dataset = ReIDImageDataset.from_client(client, build_train_transform(H, W, pad=4, random_erasing=0.5))
    loader = EpochLoader(dataset, 4, num_workers=workers)
    whole = _batches(loader.epoch(21))
    for take in (1, 2):
        part = _batches(loader.epoch(21, batches=take))
        assert len(part) == take and all(ia == ib and torch.equal(xa, xb) for (ia, xa), (ib, xb) in zip(part, whole))
    assert len(_batches(loader.epoch(21, batches=99))) == len(whole)
    if workers:  # the workers were handed one batch, not a prefetch of 2 per worker
        next(iter(loader.epoch(22, batches=1)))
        assert loader._loader._iterator._send_idx == 1
        next(iter(loader.epoch(22)))
        assert loader._loader._iterator._send_idx > 2 * workers  # a whole epoch keeps 2 a worker in flight
    with pytest.raises(ValueError, match="batches must be >= 1"):
        loader.epoch(1, batches=0)


def test_persistent_loader_leaves_the_global_torch_rng_alone(records):
    state = torch.get_rng_state()
    loader = EpochLoader(ReIDImageDataset(records, transform=build_test_transform(H, W)), 2, num_workers=1)
    for seed in (1, 2):
        _batches(loader.epoch(seed))
    assert torch.equal(torch.get_rng_state(), state)


def test_importing_the_transforms_never_asks_the_network_for_albumentations_updates():
    # A fresh interpreter without NO_ALBUMENTATIONS_UPDATE whose sockets fail loudly and are
    # recorded: importing the library's transforms must not try to connect or print a warning.
    import os
    import subprocess
    import sys

    probe = (
        "import socket, sys\n"
        "tried = []\n"
        "def refuse(self, *a, **k):\n"
        "    tried.append(a)\n"
        "    raise OSError('network is off in this test')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = lambda *a, **k: refuse(None, *a)\n"
        "import fedreid.data.transforms\n"
        "print('connects', len(tried))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    done = subprocess.run([sys.executable, "-W", "default", "-c", probe], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "connects 0"
    assert "update" not in done.stderr.lower(), done.stderr


# ---------------------------------------------------------------------------
# Normalising where the batch is (train.normalize_on=device)
# ---------------------------------------------------------------------------

DEFERRABLE = {
    "erasing and jitter": lambda defer: build_train_transform(
        H, W, pad=4, random_erasing=0.5, color_jitter=0.1, seed=3, defer_normalize=defer),
    "always erased, no crop or flip": lambda defer: build_train_transform(
        H, W, pad=0, flip=False, random_erasing=1.0, seed=3, defer_normalize=defer),
    "crop and flip": lambda defer: build_train_transform(H, W, pad=4, seed=3, defer_normalize=defer),
    "test": lambda defer: build_test_transform(H, W, defer_normalize=defer),
}


@pytest.mark.parametrize("pipeline, workers", [(p, 0) for p in sorted(DEFERRABLE)] + [("erasing and jitter", 2)])
def test_batches_normalised_on_the_device_equal_the_worker_pipelines_bit_for_bit(records, pipeline, workers):
    client = make_client("c", "ds", records * 4)
    worker_side = ReIDImageDataset.from_client(client, DEFERRABLE[pipeline](False))
    deferred = DEFERRABLE[pipeline](True)
    device_side = ReIDImageDataset.from_client(client, deferred)
    want = _batches(make_loader(worker_side, 5, shuffle=True, seed=7, num_workers=workers))
    raw = next(iter(make_loader(device_side, 5, shuffle=True, seed=7, num_workers=workers)))
    assert raw["image"].dtype == torch.uint8 and raw["image"].shape == (5, H, W, 3)
    assert ("erase" in raw) == ("erasing" in pipeline or "erased" in pipeline)
    got = _batches(DeviceBatches(make_loader(device_side, 5, shuffle=True, seed=7, num_workers=workers),
                                 "cpu", deferred.batch_normalize))
    assert len(got) == len(want) == 5  # 24 images: the last batch holds 4
    for (ia, xa), (ib, xb) in zip(got, want):
        assert ia == ib and xa.dtype == torch.float32 and torch.equal(xa, xb)
    if pipeline == "always erased, no crop or flip":  # every image has a zeroed rectangle
        assert all((x == 0).all(dim=0).any() for _, batch in got for x in batch)


def test_batch_normalize_gives_the_asked_layout_and_rejects_float_batches():
    transform = build_train_transform(H, W, random_erasing=1.0, seed=0, defer_normalize=True)
    items = [transform(asymmetric_image(s)) for s in range(3)]
    images, erase = torch.stack([i["image"] for i in items]), torch.stack([i["erase"] for i in items])
    plain = transform.batch_normalize(images, erase)
    last = transform.batch_normalize(images, erase, memory_format=torch.channels_last)
    assert plain.is_contiguous() and last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(plain, last)
    top, bottom, left, right = erase[0].tolist()
    assert 0 <= top < bottom <= H and 0 <= left < right <= W
    assert (plain[0, :, top:bottom, left:right] == 0).all()
    with pytest.raises(ValueError, match=r"uint8 batch of shape \[B, H, W, 3\]"):
        transform.batch_normalize(plain)


def test_normalize_on_auto_defers_on_cuda_only():
    assert not defers_normalize("auto", torch.device("cpu")) and defers_normalize("auto", "cuda:0")
    assert defers_normalize("device", "cpu") and not defers_normalize("worker", "cuda")
    with pytest.raises(ValueError, match="train.normalize_on: expected one of auto, worker, device, got 'gpu'"):
        defers_normalize("gpu", "cpu")


@pytest.mark.gpu
def test_batches_normalised_on_cuda_equal_the_worker_pipelines_bit_for_bit(records):
    client = make_client("c", "ds", records * 4)
    want = _batches(make_loader(ReIDImageDataset.from_client(client, DEFERRABLE["erasing and jitter"](False)),
                                8, shuffle=True, seed=2, num_workers=2))
    deferred = DEFERRABLE["erasing and jitter"](True)
    loader = make_loader(ReIDImageDataset.from_client(client, deferred), 8, shuffle=True, seed=2, num_workers=2,
                         pin_memory=True)
    got = _batches(DeviceBatches(loader, "cuda", deferred.batch_normalize, torch.channels_last))
    assert len(got) == len(want) == 3
    for (ia, xa), (ib, xb) in zip(got, want):
        assert xa.is_cuda and xa.is_contiguous(memory_format=torch.channels_last)
        assert ia == ib and torch.equal(xa.cpu(), xb)
