"""Per-batch cost of the classification track's training augmentation on CPU.

Builds ``--images`` random 32x32 RGB ``uint8`` images (CIFAR's shape), wraps
them in :class:`fedreid.data.classification.ClassificationDataset` with each
``classification.augment`` pipeline (:func:`fedreid.data.transforms.
build_classification_augment`) and times whole epochs of the seeded loader
the clients use (:func:`fedreid.data.datasets.make_loader`, batch ``--batch``,
main-process loading, ``--threads`` torch threads). For scale it also times
one SGD step (forward, backward, update) of the FedLMD CNN (``cnn_lmd``) and
of ResNet-18 on such a batch.

How to read it: ms per batch of loading (decode-free: the images are in
memory), best of ``--repeats`` epochs; "overhead" is the difference to
``none``, and its share of one training step of each model.

    python bench/classification_augment.py [--images 2000] [--batch 50] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedreid.data.classification import ArrayDataset, ClassificationDataset
from fedreid.data.datasets import make_loader
from fedreid.data.transforms import CLASSIFICATION_AUGMENTS, build_classification_augment
from fedreid.models.factory import CLASSIFIER_PREFIX, create_model


def epoch_ms_per_batch(dataset: ClassificationDataset, batch: int, repeats: int) -> float:
    best = float("inf")
    for r in range(repeats):
        loader = make_loader(dataset, batch, shuffle=True, seed=r)
        started = time.perf_counter()
        batches = sum(1 for _ in loader)
        best = min(best, (time.perf_counter() - started) / batches)
    return best * 1e3


def step_ms(backbone: str, batch: int, repeats: int) -> float:
    model = create_model(CLASSIFIER_PREFIX + backbone, num_classes=10, in_channels=3, image_size=(32, 32),
                         seed=0, pretrained=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = torch.randn(batch, 3, 32, 32), torch.arange(batch) % 10
    best = float("inf")
    for _ in range(repeats + 1):  # the first step warms up
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    data = ArrayDataset("cifar10", rng.integers(0, 256, size=(args.images, 32, 32, 3), dtype=np.uint8),
                        rng.integers(0, 10, size=args.images), [str(k) for k in range(10)])
    steps = {name: step_ms(name, args.batch, args.repeats) for name in ("cnn_lmd", "resnet18")}
    print(f"{args.images} images 32x32x3, batch {args.batch}, {args.threads} torch thread(s), best of {args.repeats}")
    print("training step (fwd+bwd+SGD): " + ", ".join(f"{k} {v:.1f} ms" for k, v in steps.items()))
    base = None
    for kind in CLASSIFICATION_AUGMENTS:
        dataset = ClassificationDataset(data, build_classification_augment(kind, 32, 32, seed=0))
        ms = epoch_ms_per_batch(dataset, args.batch, args.repeats)
        base = ms if base is None else base
        extra = ms - base
        shares = ", ".join(f"{100 * extra / v:.0f}% of a {k} step" for k, v in steps.items())
        print(f"{kind:17s} {ms:6.2f} ms/batch  overhead {extra:+6.2f} ms/batch "
              f"({1e3 * extra / args.batch:+.0f} us/image; {shares})")


if __name__ == "__main__":
    main()
