"""What reading evaluation's images costs: a loader per set against one persistent stream.

Evaluation during training reads the query and gallery sets of every
benchmark dataset (18 sets for the nine). Read with a fresh in-order loader
per set, every set of every evaluation starts its workers again, drains them
at its end, and a set of a few batches leaves most workers idle.
:class:`fedreid.data.datasets.SegmentLoader` (what :class:`fedreid.fl.
evaluation.Evaluator` uses) reads them all in one stream through workers that
persist, each set batched as its own loader would batch it, so the features
are the same bit for bit. This prints, on the synthetic nine-dataset world
at 256x128 with the test pipeline and ``eval.batch_size`` 128, the seconds one
evaluation spends reading its images (no model runs), both ways, for the
first pass and as the median of the later ones, and their ratio:

    python bench/eval_loading.py [--id-scale 0.04] [--workers 2] [--repeats 3]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from round_time import prepare_synthetic  # noqa: E402

from fedreid.config import load_config  # noqa: E402
from fedreid.data.benchmark import BENCHMARK_DATASETS  # noqa: E402
from fedreid.data.datasets import ReIDImageDataset, SegmentLoader, make_loader  # noqa: E402
from fedreid.data.prepared import load_prepared  # noqa: E402
from fedreid.data.transforms import build_test_transform  # noqa: E402

BATCH = 128


def images_read(batches) -> int:
    return sum(int(b["image"].shape[0]) for b in batches)


def timed(read) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = read()
    return time.perf_counter() - t0, n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--id-scale", type=float, default=0.04, help="synthetic world's id_scale (default 0.04)")
    parser.add_argument("--workers", type=int, default=2, help="loader workers (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="evaluations after the first (default 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare_synthetic(load_config(None, [
            f"synthetic.root={tmp / 'raw'}", f"data.prepared_root={tmp / 'prep'}", "data.public_dataset=null",
            f"synthetic.id_scale={args.id_scale}", "synthetic.height=128", "synthetic.width=64",
        ]))
        transform = build_test_transform(256, 128)
        sets = {}
        for name in BENCHMARK_DATASETS:
            ds = load_prepared(tmp / "prep", name)
            for split in ("query", "gallery"):
                sets[(name, split)] = ReIDImageDataset(ds.split(split), None, transform=transform)
        total = sum(len(d) for d in sets.values())
        sizes = sorted(len(d) for d in sets.values())
        print(f"{len(sets)} query/gallery sets of the synthetic nine-dataset world (id_scale {args.id_scale}): "
              f"{total} images, {sizes[0]} to {sizes[-1]} a set, 128x64 JPEG -> 256x128, batch {BATCH}, "
              f"{args.workers} workers")

        def per_set() -> int:
            return sum(images_read(make_loader(d, BATCH, shuffle=False, seed=0, num_workers=args.workers))
                       for d in sets.values())

        stream = SegmentLoader(sets, BATCH, num_workers=args.workers)
        rows = {"a loader per set": per_set, "one persistent stream": lambda: images_read(stream.read(list(sets)))}
        print(f"{'reading':<24} {'first s':>8} {'later s (median)':>17} {'img/s later':>12}")
        later = {}
        for name, read in rows.items():
            first, n = timed(read)
            assert n == total, (name, n, total)
            later[name] = statistics.median(timed(read)[0] for _ in range(args.repeats))
            print(f"{name:<24} {first:>8.2f} {later[name]:>17.2f} {total / later[name]:>12,.0f}")
        a, b = later.values()
        print(f"ratio (per set / stream, later passes): {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
