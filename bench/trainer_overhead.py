"""Images/s of one client's local epoch: our Client.fit vs a bare PyTorch loop.

Both sides use the same model (``create_reid_model``), the same data
(``ReIDImageDataset`` + the same train transform), the same batch size, SGD
with the same two parameter groups and cross-entropy; the bare side does
forward/backward/step and nothing else. Data: the synthetic Market-1501
(``id_scale=0.1``, 128x64) generated and prepared into a temp folder.

    python bench/trainer_overhead.py [--backbone resnet18] [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.config import load_config  # noqa: E402
from fedreid.data.datasets import ReIDImageDataset  # noqa: E402
from fedreid.data.prepared import load_prepared, prepare_dataset  # noqa: E402
from fedreid.data.raw import create_raw_dataset  # noqa: E402
from fedreid.data.scenarios import by_dataset  # noqa: E402
from fedreid.data.synthetic import generate_world  # noqa: E402
from fedreid.data.transforms import build_train_transform  # noqa: E402
from fedreid.fl.client import Client  # noqa: E402
from fedreid.models.reid import create_reid_model, replace_classifier, shared_state  # noqa: E402


def bare_epoch(model: nn.Module, dataset, batch_size: int, cfg_train, seed: int) -> tuple[int, float]:
    """One epoch of plain SGD + CE; returns (images, seconds)."""
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    backbone = {id(p) for p in model.backbone.parameters()}
    low = [p for p in model.parameters() if id(p) in backbone]
    high = [p for p in model.parameters() if id(p) not in backbone]
    lr = cfg_train.lr
    opt = torch.optim.SGD(
        [{"params": low, "lr": lr * cfg_train.lr_backbone_ratio}, {"params": high, "lr": lr}],
        lr=lr, momentum=cfg_train.momentum, weight_decay=cfg_train.weight_decay, nesterov=True,
    )
    crit = nn.CrossEntropyLoss()
    model.train()
    images = 0
    for batch in loader:
        x, y = batch["image"], batch["label"]
        opt.zero_grad(set_to_none=True)
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        images += x.shape[0]
    return images, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fedreid-bench-") as tmp:
        raw, out = Path(tmp) / "raw", Path(tmp) / "prepared"
        t0 = time.perf_counter()
        generate_world(raw, datasets=["market1501"], id_scale=0.1, height=args.height, width=args.width)
        prepare_dataset(create_raw_dataset("market1501", raw), out, progress=False)
        ds = load_prepared(out, "market1501")
        print(f"data: synthetic market1501 in {time.perf_counter() - t0:.1f}s")

        cfg = load_config(None, [
            f"model.backbone={args.backbone}", f"model.height={args.height}",
            f"model.width={args.width}", f"train.batch_size={args.batch_size}",
            "fl.cdw=false", "fl.kd=false",
        ])
        split = by_dataset([ds], cfg.scenario.train_split)[0]
        client = Client(split, 0, cfg)
        m = cfg.model
        model_kw = dict(pretrained=m.pretrained, last_stride=m.last_stride,
                        bottleneck_dim=m.bottleneck_dim, dropout=m.dropout, seed=0)

        # ours: a work model + the global (shared) state as payload, as in simulation
        ours_model = create_reid_model(m.backbone, 0, **model_kw)
        payload = shared_state(ours_model)

        # bare: its own model with a head, its own dataset + transform
        bare_model = create_reid_model(m.backbone, 0, **model_kw)
        replace_classifier(bare_model, split.num_classes, seed=0)
        transform = build_train_transform(m.height, m.width, random_erasing=cfg.train.random_erasing,
                                          color_jitter=cfg.train.color_jitter, seed=0)
        bare_ds = ReIDImageDataset(split.records, split.labels, transform=transform)

        def run_ours(r: int) -> tuple[int, float]:
            t = time.perf_counter()
            update = client.fit(ours_model, payload, {"round": r})
            return int(update.metadata["steps"]) * args.batch_size, time.perf_counter() - t

        def run_bare(r: int) -> tuple[int, float]:
            return bare_epoch(bare_model, bare_ds, args.batch_size, cfg.train, seed=r)

        print(f"client: {len(split)} images, {split.num_classes} ids; backbone {m.backbone} "
              f"{m.height}x{m.width}, batch {args.batch_size}, torch threads {torch.get_num_threads()}")
        run_ours(0)  # warm-up
        run_bare(0)
        rates: dict[str, list[float]] = {"ours": [], "bare": []}
        for r in range(args.repeats):
            for name, fn in (("ours", run_ours), ("bare", run_bare)):
                n, s = fn(r + 1)
                rates[name].append(n / s)

    med = {k: statistics.median(v) for k, v in rates.items()}
    print()
    print(f"{'side':<6} {'median img/s':>13}   runs (img/s)")
    for k in ("ours", "bare"):
        print(f"{k:<6} {med[k]:>13.1f}   " + ", ".join(f"{x:.1f}" for x in rates[k]))
    print(f"ratio ours/bare: {med['ours'] / med['bare']:.3f}  (goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
