"""Tiny prepared datasets and configs for the federated-training tests.

Images are small cv2 pictures whose colour depends on the identity (plus
noise), written as a prepared dataset folder (``manifest.csv`` with
path,pid,camid,split,source). Configs use timm's ``test_resnet`` backbone at
32x16 so a round takes well under a second on CPU.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

import cv2
import numpy as np

from fedreid.config import Config, load_config
from fedreid.data.prepared import PreparedDataset


def write_prepared(
    root: Path,
    name: str,
    *,
    num_ids: int = 3,
    cams: int = 2,
    per_cam: int = 2,
    test_ids: int = 2,
    height: int = 32,
    width: int = 16,
    seed: int = 0,
) -> PreparedDataset:
    """``root/name`` with train images of ``num_ids`` identities and a small query/gallery."""
    rng = np.random.default_rng(seed)
    base = root / name
    rows = []

    def put(split: str, pid: int, cam: int, k: int) -> None:
        rel = Path("images") / split / f"{len(rows):06d}_{pid}_c{cam}.png"
        colour = (np.array([37, 91, 153]) * (pid + 1) + 17 * seed) % 256
        img = np.clip(colour[None, None, :] + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
        img[: height // 2, :, (pid + cam) % 3] = 255 - img[: height // 2, :, (pid + cam) % 3]
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(base / rel), img):
            raise OSError(f"cv2 could not write {base / rel}")
        rows.append((rel.as_posix(), pid, cam, split, f"{name}/{pid}_{cam}_{k}.png"))

    for pid in range(1, num_ids + 1):
        for cam in range(cams):
            for k in range(per_cam):
                put("train", pid, cam, k)
    for pid in range(num_ids + 1, num_ids + 1 + test_ids):
        put("query", pid, 0, 0)
        put("gallery", pid, 1, 0)
        put("gallery", pid, 0, 1)
    with (base / "manifest.csv").open("w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(["path", "pid", "camid", "split", "source"])
        writer.writerows(rows)
    return PreparedDataset.load(base)


def write_world(root: Path, names: Sequence[str] = ("dsa", "dsb"), public: str = "pub") -> Path:
    """Two small client datasets and a public set under ``root``."""
    for i, name in enumerate(names):
        write_prepared(root, name, num_ids=3 + i, seed=i)
    write_prepared(root, public, num_ids=3, cams=1, per_cam=2, seed=7)
    return root


def tiny_config(prepared_root: Path, overrides: Sequence[str] = (), names: Sequence[str] = ("dsa", "dsb")) -> Config:
    base = [
        f"data.prepared_root={prepared_root}",
        f"data.datasets=[{','.join(names)}]",
        "data.public_dataset=pub",
        "model.backbone=test_resnet",
        "model.bottleneck_dim=16",
        "model.height=32",
        "model.width=16",
        "train.batch_size=4",
        "fl.rounds=3",
        "fl.kd_batch_size=4",
        "eval.every=1",
        "eval.batch_size=8",
        "run.device=cpu",
        "run.tensorboard=false",
    ]
    return load_config(None, base + list(overrides))


def strip_time(history: list[dict]) -> list[dict]:
    """Round records without their wall-clock entries."""
    return [{k: v for k, v in rec.items() if k != "time"} for rec in history]


def recorded_round(fed) -> tuple[dict, list]:
    """One round of ``fed``'s server with its own clients in this process: ``(round record, the clients' updates)``."""
    updates = []

    def fit(k, payload, instructions):
        update = fed.clients[k].fit(fed.work_model, payload, instructions)
        updates.append(update)
        return update

    return fed.server.run_round(fit), updates


def distillation_teachers(model, num_classes: int = 3) -> tuple[list, list]:
    """Three teachers (``model`` with seeded noise of scale 0.3 on every parameter) and their updates.

    Each teacher holds 9 images of "its" class, 1 of the next and none of the
    third (``class_counts``), so class-level and uniform teacher weights differ.
    """
    import copy

    import torch

    from fedreid.fl.classification import CLASS_COUNTS
    from fedreid.fl.update import Update
    from fedreid.utils.seeding import forked_torch_rng

    teachers = []
    for k in range(3):
        t = copy.deepcopy(model)
        with torch.no_grad(), forked_torch_rng(100 + k):
            for p in t.parameters():
                p.add_(0.3 * torch.randn_like(p))
        teachers.append(t.state_dict())
    counts = torch.tensor([[9.0, 1.0, 0.0], [0.0, 9.0, 1.0], [1.0, 0.0, 9.0]])[:, :num_classes]
    updates = [Update(f"c{k}", s, 10, {CLASS_COUNTS: counts[k]}, head_shared=True) for k, s in enumerate(teachers)]
    return teachers, updates
