"""Run folders with an untrained tiny model, for tests of the tools that read ``model_final.pt``."""

from __future__ import annotations

from pathlib import Path

import torch

from fedreid.config import ModelConfig, to_dict
from fedreid.models.reid import create_reid_model, shared_state


def save_tiny_run(run: Path, height: int, width: int, *, seed: int = 0, round: int = 1) -> Path:
    """``run``/model_final.pt: a seeded resnet18 (bottleneck 32) for ``height`` x ``width`` images; returns ``run``."""
    run.mkdir(parents=True, exist_ok=True)
    model = create_reid_model("resnet18", 0, bottleneck_dim=32, seed=seed)
    cfg = ModelConfig(backbone="resnet18", bottleneck_dim=32, height=height, width=width)
    torch.save({"format": "fedreid.model", "model": to_dict(cfg), "mode": "fedpav", "round": round,
                "state": shared_state(model)}, run / "model_final.pt")
    return run
