"""Feature extraction speed: PyTorch eager vs the exported ONNX (ONNX Runtime) and TorchScript files, on CPU.

One ReID model (``--backbone``, random ImageNet-free weights, ``--bottleneck``
dims) at ``--height`` x ``--width``; each backend computes the same index
feature (embed of image + flipped image, L2-normalised) of one batch of
``--batch`` random normalised images. PyTorch eager is
:func:`fedreid.inference.model_io.model_features` (what ``index``/``query`` run);
the others are :func:`fedreid.inference.export.load_extractor` of files written by
:func:`fedreid.inference.export.export_model`. Torch and ONNX Runtime both get
``--threads`` threads. Figures: images/s, median over ``--repeats`` timed
calls after one warm-up, and the max abs difference to the eager features.

    python bench/export_speed.py [--backbone resnet50] [--batch 32] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedreid.inference.export import EXPORT_FORMATS, OnnxExtractor, export_model, load_extractor
from fedreid.inference.model_io import LoadedModel, model_features, model_fingerprint
from fedreid.models.reid import create_reid_model


def timed(fn, repeats: int) -> tuple[float, np.ndarray]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--bottleneck", type=int, default=512)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = create_reid_model(args.backbone, 0, bottleneck_dim=args.bottleneck, seed=0).eval()
    cfg = {"backbone": args.backbone, "bottleneck_dim": args.bottleneck, "height": args.height, "width": args.width}
    loaded = LoadedModel(model=model, config=cfg, source=Path("bench"), fingerprint=model_fingerprint(model, cfg))
    images = torch.randn(args.batch, 3, args.height, args.width, generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")

    print(f"{args.backbone} {args.height}x{args.width}, batch {args.batch}, {args.threads} threads, "
          f"median of {args.repeats}")
    eager_s, reference = timed(lambda: model_features(loaded, [(images,)], cpu).features, args.repeats)
    print(f"  {'pytorch eager':<14} {args.batch / eager_s:8.1f} images/s")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in EXPORT_FORMATS:
            try:
                path = export_model(loaded, Path(tmp) / f"model.{fmt}", fmt, (args.height, args.width))
                extractor = (OnnxExtractor(path, threads=args.threads) if fmt == "onnx" else load_extractor(path))
            except Exception as exc:  # noqa: BLE001 - e.g. onnxruntime missing: report and go on
                print(f"  {fmt:<14} skipped: {exc}")
                continue
            seconds, feats = timed(lambda: extractor(images), args.repeats)
            diff = float(np.abs(feats - reference).max())
            print(f"  {fmt:<14} {args.batch / seconds:8.1f} images/s  ({eager_s / seconds:.2f}x eager, "
                  f"max abs diff {diff:.1e})")


if __name__ == "__main__":
    main()
