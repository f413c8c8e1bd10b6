"""Training-image augmentation of the classification track (classification.augment; FedLMD Sec. 5.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedreid.config import ConfigError, load_config
from fedreid.data.classification import ArrayDataset, ClassificationDataset, default_augment
from fedreid.data.scenarios import ClientSplit
from fedreid.data.transforms import ArrayAugment, build_classification_augment
from fedreid.fl import classification as track
from fedreid.fl.federation import build_classification_federation
from fedreid.fl.simulation import resume, run_simulation
from fedreid.utils.checkpoint import load_checkpoint
from fedreid.utils.seeding import derive_seed

BASE = [
    "task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "classification.num_clients=2",
    "classification.partition=iid", "train.batch_size=8", "train.drop_last=false", "train.local_epochs=2",
    "fl.rounds=2", "eval.every=1", "run.device=cpu", "run.tensorboard=false",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cfg_with(*extra):
    return load_config(None, BASE + list(extra))


def rgb_data(name="cifar10", n=40, size=32, seed=0, same_image=False):
    rng = np.random.default_rng(seed)
    if same_image:
        images = np.repeat(rng.integers(1, 256, size=(1, size, size, 3), dtype=np.uint8), n, axis=0)
    else:
        images = rng.integers(1, 256, size=(n, size, size, 3), dtype=np.uint8)
    return ArrayDataset(name, images, np.arange(n) % 10, [str(k) for k in range(10)])


def grey_data(name="mnist", n=40, size=28, seed=0):
    rng = np.random.default_rng(seed)
    return ArrayDataset(name, rng.integers(1, 256, size=(n, size, size), dtype=np.uint8), np.arange(n) % 10,
                        [str(k) for k in range(10)])


def client_for(data, *extra, index=0):
    cfg = cfg_with(*extra)
    split = ClientSplit(f"client{index:03d}", data.name, list(range(len(data))), data.labels.copy(), list(range(10)))
    return track.ClassificationClient(split, index, cfg, data)


def epoch_images(client, round_index, epoch):
    """The images of one epoch's loader, as train_local draws them (Client.fit's seeds)."""
    seed = derive_seed(client.cfg.seed, "client", round_index, client.index)
    return torch.cat([images for images, _ in client.train_loader(derive_seed(seed, "epoch", epoch))])


def find_shift(out, image, pad=4):
    """``(dy, dx, flipped)`` with ``out`` = ``image`` zero-padded by ``pad``, cropped at (pad+dy, pad+dx), maybe flipped."""
    h, w = image.shape[:2]
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    for flipped in (False, True):
        for dy in range(-pad, pad + 1):
            for dx in range(-pad, pad + 1):
                crop = padded[pad + dy : pad + dy + h, pad + dx : pad + dx + w]
                if np.array_equal(crop[:, ::-1] if flipped else crop, out):
                    return dy, dx, flipped
    return None


# --------------------------------------------------------------------------- defaults and config


@pytest.mark.parametrize(
    "data, expected",
    [
        (rgb_data("cifar10"), "crop_flip"),
        (rgb_data("cifar100"), "crop_flip"),
        (rgb_data("my_photos"), "crop_flip"),  # imagefolder, RGB
        (grey_data("mnist"), "none"),
        (grey_data("fashion_mnist"), "none"),
        (grey_data("digits", size=8), "none"),
        (grey_data("my_scans"), "none"),  # imagefolder, grey
    ],
    ids=["cifar10", "cifar100", "imagefolder-rgb", "mnist", "fashion_mnist", "digits", "imagefolder-grey"],
)
def test_auto_is_crop_flip_for_rgb_photo_sets_and_off_for_digit_sets(data, expected):
    assert default_augment(data) == expected
    client = client_for(data)
    assert client.augment == expected
    transform = client._dataset().transform
    assert (transform is None) == (expected == "none")
    if transform is not None:
        assert isinstance(transform, ArrayAugment) and transform.cutout == 0


def test_explicit_setting_overrides_the_dataset_default():
    assert client_for(rgb_data(), "classification.augment=none")._dataset().transform is None
    grey = client_for(grey_data(), "classification.augment=crop_flip")._dataset().transform
    assert isinstance(grey, ArrayAugment)
    assert client_for(rgb_data(), "classification.augment=crop_flip_cutout")._dataset().transform.cutout == 16


def test_unknown_augment_value_names_the_key():
    with pytest.raises(ConfigError, match="classification.augment"):
        cfg_with("classification.augment=autoaugment")


# --------------------------------------------------------------------------- what the pipeline does


def test_crop_flip_is_a_zero_padded_shift_of_at_most_4_pixels_and_a_mirror():
    image = np.random.default_rng(1).integers(1, 256, size=(32, 32, 3), dtype=np.uint8)
    augment = build_classification_augment("crop_flip", 32, 32, seed=0)
    seen = set()
    for _ in range(600):
        out = augment(image)
        assert out.shape == image.shape and out.dtype == np.uint8
        shift = find_shift(out, image)
        assert shift is not None
        seen.add(shift)
    assert {(dy, dx) for dy, dx, _ in seen} == {(dy, dx) for dy in range(-4, 5) for dx in range(-4, 5)}
    assert {f for _, _, f in seen} == {False, True}


def test_grey_images_keep_their_layout():
    image = np.random.default_rng(2).integers(1, 256, size=(28, 28), dtype=np.uint8)
    out = build_classification_augment("crop_flip", 28, 28, seed=0)(image)
    assert out.shape == (28, 28) and out.dtype == np.uint8
    assert find_shift(out[..., None], image[..., None]) is not None


def test_items_have_the_unaugmented_shape_dtype_and_normalisation():
    for data in (rgb_data(), grey_data()):
        plain = ClassificationDataset(data)
        augmented = ClassificationDataset(data, build_classification_augment("crop_flip", *data.images.shape[1:3], seed=0))
        for i in range(5):
            (a, la), (b, lb) = plain[i], augmented[i]
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float32 and la == lb
        # An identity "augmentation" (no pad, flip never drawn) gives the plain item bit for bit.
        identity = build_classification_augment("crop_flip", *data.images.shape[1:3], pad=0, seed=0)
        identity.compose.transforms[-1].p = 0.0
        assert torch.equal(ClassificationDataset(data, identity)[0][0], plain[0][0])


def test_cutout_zeroes_one_clipped_square_of_at_most_16_pixels_after_normalisation():
    data = rgb_data(n=1)
    dataset = ClassificationDataset(data, build_classification_augment("crop_flip_cutout", 32, 32, pad=0, seed=3))
    dataset.transform.compose.transforms[-1].p = 0.0  # no flip: compare with the plain item
    plain = ClassificationDataset(data)[0][0]
    sides = set()
    for _ in range(200):
        item = dataset[0][0]
        zero = (item == 0).all(dim=0)
        rows, cols = torch.nonzero(zero.any(dim=1)).flatten(), torch.nonzero(zero.any(dim=0)).flatten()
        h, w = len(rows), len(cols)
        assert 8 <= h <= 16 and 8 <= w <= 16 and int(zero.sum()) == h * w  # one clipped square
        assert torch.equal(item[:, ~zero], plain[:, ~zero])
        sides.add((h, w))
    assert (16, 16) in sides and len(sides) > 1  # whole squares inside, clipped ones at the border


def test_flip_mean_crop_is_fedftgs_loader_flip_then_half_the_time_a_mean_padded_crop():
    # FedFTG utils/util_dataset.py:Dataset.__getitem__: flip (p=0.5); with p=0.5, pad 4 zeros of the
    # normalised tensor (the channel mean) and crop back at offsets uniform in 0..8.
    data = rgb_data(n=1)
    dataset = ClassificationDataset(data, build_classification_augment("flip_mean_crop", 32, 32, seed=4))
    plain = ClassificationDataset(data)[0][0]
    candidates = {}
    for flipped in (False, True):
        image = plain.flip(-1) if flipped else plain
        candidates[(flipped, None)] = image
        padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
        for dy in range(9):
            for dx in range(9):
                if (dy, dx) != (4, 4):  # the centre window is the image itself
                    candidates[(flipped, (dy, dx))] = padded[:, dy:dy + 32, dx:dx + 32]
    draws = []
    for _ in range(800):
        item = dataset[0][0]
        (match,) = [key for key, image in candidates.items() if torch.equal(image, item)]
        draws.append(match)
    cropped = [offset is not None for _, offset in draws]
    flipped = [f for f, _ in draws]
    assert 0.44 < np.mean(cropped) < 0.56 and 0.44 < np.mean(flipped) < 0.56
    assert {offset for _, offset in draws if offset is not None} == {
        (dy, dx) for dy in range(9) for dx in range(9)} - {(4, 4)}
    again = ClassificationDataset(data, build_classification_augment("flip_mean_crop", 32, 32, seed=4))
    assert all(torch.equal(again[0][0], candidates[key]) for key in draws[:50])


# --------------------------------------------------------------------------- seeding


def test_two_epochs_see_different_crops_and_flips():
    client = client_for(rgb_data(n=24, same_image=True))  # every item is the same image: order cannot matter
    first, second = epoch_images(client, 0, 0), epoch_images(client, 0, 1)
    assert not torch.equal(first, second)
    assert len({bytes(x.numpy().tobytes()) for x in first}) > 4  # the crops vary within an epoch too
    assert not torch.equal(epoch_images(client, 1, 0), first)  # and between rounds


def test_same_seed_gives_identical_batches_and_another_seed_other_ones():
    data = rgb_data(n=24)

    def batches(*extra):
        client = client_for(data, *extra)
        return [epoch_images(client, r, e) for r in (0, 1) for e in (0, 1)]

    a, b = batches(), batches()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    other = batches("seed=1")
    assert not any(torch.equal(x, y) for x, y in zip(a, other))
    # Without augmentation the seed changes the order only: the same images, sorted, are equal.
    plain = [epoch_images(client_for(data, "classification.augment=none", *s), 0, 0) for s in ([], ["seed=1"])]
    key = lambda t: t.flatten(1).sum(1).argsort()  # noqa: E731
    assert torch.equal(plain[0][key(plain[0])], plain[1][key(plain[1])])


def test_the_test_split_is_never_augmented(monkeypatch):
    train, test = rgb_data(n=40, seed=0), rgb_data(n=20, seed=1)
    monkeypatch.setattr(track, "load_train_test", lambda cfg: (train, test))
    for setting in ("auto", "crop_flip_cutout"):
        fed = build_classification_federation(cfg_with(f"classification.augment={setting}"))
        assert fed.clients[0]._dataset().transform is not None
        assert fed.evaluator.dataset.transform is None
        plain = ClassificationDataset(test)
        for i in range(len(test)):
            assert torch.equal(fed.evaluator.dataset[i][0], plain[i][0])


def test_resumed_run_with_augmentation_is_bit_identical(tmp_path, monkeypatch):
    train, test = rgb_data(n=48, seed=0), rgb_data(n=20, seed=1)
    monkeypatch.setattr(track, "load_train_test", lambda cfg: (train, test))
    cfg = cfg_with("fl.rounds=3")

    class Kill(RuntimeError):
        pass

    def killer(event, info):
        if event == "client_end" and info["round"] == 1 and info["client"] == "client001":
            raise Kill()

    full = run_simulation(cfg, tmp_path / "full", progress=False)
    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    strip = lambda hist: [{k: v for k, v in r.items() if k != "time"} for r in hist]  # noqa: E731
    assert strip(again) == strip(full)
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["server"]["global_state"]
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["server"]["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The augmentation was on: the same run without it ends elsewhere.
    plain = run_simulation(cfg_with("fl.rounds=3", "classification.augment=none"), tmp_path / "plain", progress=False)
    assert [r["eval"] for r in plain] != [r["eval"] for r in full]
