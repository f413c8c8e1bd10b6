"""Run folders with an untrained tiny model, for tests of the tools that read ``model_final.pt``."""

from __future__ import annotations

from pathlib import Path

import torch

from fedreid.config import ModelConfig, dump_config, load_config, to_dict
from fedreid.models.reid import create_reid_model, shared_state


def save_tiny_run(run: Path, height: int, width: int, *, seed: int = 0, round: int = 1) -> Path:
    """``run``/model_final.pt: a seeded resnet18 (bottleneck 32) for ``height`` x ``width`` images; returns ``run``."""
    run.mkdir(parents=True, exist_ok=True)
    model = create_reid_model("resnet18", 0, bottleneck_dim=32, seed=seed)
    cfg = ModelConfig(backbone="resnet18", bottleneck_dim=32, height=height, width=width)
    torch.save({"format": "fedreid.model", "model": to_dict(cfg), "mode": "fedpav", "round": round,
                "state": shared_state(model)}, run / "model_final.pt")
    return run


def write_eval_world(root: Path) -> dict[str, Path]:
    """Prepared datasets ``tiny`` (6 query ids, 2 cameras) and ``tiny2`` under ``root``/prepared, and
    ``root``/run: a tiny model (32x16 images, round 2) with the ``config.yaml`` of a run on ``tiny``."""
    from fl_helpers import write_prepared

    prepared = root / "prepared"
    write_prepared(prepared, "tiny", num_ids=1, test_ids=6, seed=3)
    write_prepared(prepared, "tiny2", num_ids=1, test_ids=4, seed=5)
    run = save_tiny_run(root / "run", 32, 16, round=2)
    cfg = load_config(None, [f"data.prepared_root={prepared}", "data.datasets=[tiny]", "data.public_dataset=null",
                             "model.backbone=resnet18", "model.bottleneck_dim=32", "model.height=32", "model.width=16",
                             "eval.batch_size=8"])
    (run / "config.yaml").write_text(dump_config(cfg))
    return {"root": root, "prepared": prepared, "run": run}
