"""What a loader worker spends per training image, normalising in the worker or on the device.

``train.normalize_on=worker`` hands the step float32 tensors; ``device``
hands it the uint8 pixels and :class:`fedreid.data.transforms.BatchNormalize`
finishes the batch where it is trained (the same tensors, bit for bit). On a
GPU the loader workers are what limits FedPav's step rate (docs/benchmarks.md,
``bench/gpu_round.py`` (b)), so their CPU time per image is the figure that
matters. This prints, for the ReID training pipeline (with and without random
erasing) and the test pipeline at 256x128 on the synthetic Market-1501:

- microseconds of one worker per image (decode + transform + collate, one thread), median of ``--repeats``;
- the bytes per image that cross from the worker to the training process;
- a loader's img/s with ``--workers`` persistent workers, batch 32: what the training process
  receives (its batches are not finished here, the device's share is the next column);
- the device side's cost per batch of 32 (:class:`BatchNormalize`) on this machine; on a CPU
  it means little, on a GPU it is a table lookup over 3 million bytes.

Then a one-epoch client round's reading (FedPav's default pipeline, normalised in the
worker): its epoch, then the CDW batch (the first batch of another epoch), with the
workers given that one batch (``EpochLoader.epoch(batches=1)``, what the client does)
against a whole epoch's prefetch of 2 batches a worker, all but one of them discarded.

    python bench/loader_path.py [--images 400] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.data.datasets import EpochLoader, ReIDImageDataset  # noqa: E402
from fedreid.data.prepared import load_prepared, prepare_dataset  # noqa: E402
from fedreid.data.raw import create_raw_dataset  # noqa: E402
from fedreid.data.scenarios import by_dataset  # noqa: E402
from fedreid.data.synthetic import generate_world  # noqa: E402
from fedreid.data.transforms import build_test_transform, build_train_transform  # noqa: E402

BATCH = 32
PIPELINES = {
    "train, random erasing 0.5": lambda defer: build_train_transform(
        256, 128, random_erasing=0.5, seed=0, defer_normalize=defer),
    "train (FedPav's default)": lambda defer: build_train_transform(256, 128, seed=0, defer_normalize=defer),
    "test": lambda defer: build_test_transform(256, 128, defer_normalize=defer),
}


def worker_us_per_image(dataset: ReIDImageDataset, repeats: int) -> float:
    """One thread's decode + transform + collate per image, as a worker does it (median over passes)."""
    collate = torch.utils.data.default_collate
    times = []
    for _ in range(repeats):
        dataset.reseed(0)
        t0 = time.perf_counter()
        for start in range(0, len(dataset), BATCH):
            collate([dataset[i] for i in range(start, min(start + BATCH, len(dataset)))])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(dataset) * 1e6


def loader_rate(dataset: ReIDImageDataset, workers: int, repeats: int) -> float:
    """img/s of a persistent loader's epochs, median over epochs."""
    loader = EpochLoader(dataset, BATCH, num_workers=workers)
    rates = []
    for epoch in range(repeats + 1):
        batches = loader.epoch(epoch)
        t0 = time.perf_counter()
        n = sum(int(b["image"].shape[0]) for b in batches)
        if epoch:  # the first epoch starts the workers
            rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def client_round_seconds(dataset: ReIDImageDataset, workers: int, repeats: int, cdw_batches) -> float:
    """Median seconds of (one epoch + the CDW batch) through one persistent loader."""
    loader = EpochLoader(dataset, BATCH, num_workers=workers)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in loader.epoch(2 * r):
            pass
        next(iter(loader.epoch(2 * r + 1, batches=cdw_batches)))
        if r:  # the first round starts the workers
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400, help="training images to read (default 400)")
    parser.add_argument("--workers", type=int, default=2, help="loader workers of the img/s column (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="passes per median (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate_world(tmp / "raw", datasets=["market1501"], id_scale=0.1, height=128, width=64)
        prepare_dataset(create_raw_dataset("market1501", tmp / "raw"), tmp / "prep", progress=False)
        records = by_dataset([load_prepared(tmp / "prep", "market1501")], "train_all")[0].records[: args.images]
        print(f"{len(records)} synthetic Market-1501 images (128x64 JPEG) -> 256x128, batch {BATCH}, "
              f"one torch/OpenCV thread per process, {torch.get_num_threads()} thread here")
        print(f"{'pipeline':<28} {'normalised in':<13} {'worker us/img':>13} {'bytes/img':>10} "
              f"{f'img/s ({args.workers} workers)':>20} {'device side us/batch':>21}")
        for name, build in PIPELINES.items():
            per_image = {}
            for defer in (False, True):
                transform = build(defer)
                dataset = ReIDImageDataset(records, None, transform=transform)
                per_image[defer] = worker_us_per_image(dataset, args.repeats)
                item = dataset[0]
                size = sum(v.numel() * v.element_size() for v in item.values() if isinstance(v, torch.Tensor))
                rate = loader_rate(dataset, args.workers, args.repeats)
                device_side = "-"
                if defer:
                    batch = torch.utils.data.default_collate([dataset[i] for i in range(BATCH)])
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        transform.batch_normalize(batch["image"], batch.get("erase"))
                        times.append(time.perf_counter() - t0)
                    device_side = f"{statistics.median(times) * 1e6:,.0f} (CPU)"
                print(f"{name:<28} {'device' if defer else 'worker':<13} {per_image[defer]:>13,.0f} "
                      f"{size:>10,} {rate:>20,.0f} {device_side:>21}")
            print(f"{'':<28} {'ratio':<13} {per_image[True] / per_image[False]:>13.2f}")
        dataset = ReIDImageDataset(records, None, transform=PIPELINES["train (FedPav's default)"](False))
        print(f"\na one-epoch client round ({len(records)} images, {args.workers} workers): its epoch + the CDW batch")
        whole = client_round_seconds(dataset, args.workers, args.repeats, None)
        one = client_round_seconds(dataset, args.workers, args.repeats, 1)
        print(f"  CDW batch from a whole epoch's prefetch: {whole:.3f} s; workers given one batch: {one:.3f} s "
              f"({whole / one:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
