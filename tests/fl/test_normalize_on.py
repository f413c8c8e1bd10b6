"""``train.normalize_on``: images normalised (and erased) on the training device give the run of today, bit for bit."""

import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_world

from fedreid.config import ConfigError, load_config
from fedreid.data.datasets import DeviceBatches
from fedreid.fl.federation import build_federation
from fedreid.fl.simulation import run_simulation
from fedreid.utils.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: CDW, KD with the server's augmented student loader, random erasing: every loader a round reads.
ROUNDS = ["fl.rounds=2", "fl.cdw=true", "fl.kd=true", "fl.kd_every=1", "fl.kd_mode=train",
          "train.random_erasing=0.5", "train.color_jitter=0.1", "eval.local_models=true"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"))


def test_a_run_normalising_on_the_device_equals_the_workers_run(world, tmp_path):
    runs = {}
    for where in ("worker", "device"):
        runs[where] = run_simulation(tiny_config(world, ROUNDS + [f"train.normalize_on={where}"]),
                                     tmp_path / where, progress=False)
    assert strip_time(runs["worker"]) == strip_time(runs["device"])
    assert "kd" in runs["device"][1] and runs["device"][1]["weighting"] == "cdw"
    a, b = (load_checkpoint(tmp_path / where / "checkpoint.pt") for where in ("worker", "device"))
    ga, gb = a["server"]["global_state"], b["server"]["global_state"]
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    for name, state in a["clients"].items():
        assert all(torch.equal(state["head"][k], b["clients"][name]["head"][k]) for k in state["head"])


def test_every_loader_of_a_device_normalising_run_hands_over_finished_batches(world):
    fed = build_federation(tiny_config(world, ROUNDS + ["train.normalize_on=device"]))
    client = fed.clients[0]
    (kd,) = [hook for hook in fed.server.hooks if hook.name == "kd"]
    loaders = {"train": client.train_loader(0), "public": client.public_loader(kd_seed=1),
               "server's student": kd.public_loader_fn(shuffle=True, seed=1),
               "evaluation": fed.evaluator._loader([(next(iter(fed.evaluator.datasets)), "query")])}
    for name, loader in loaders.items():
        assert isinstance(loader, DeviceBatches), name
        batch = next(iter(loader))
        assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, 32, 16), name
        assert "erase" not in batch
    # auto on the CPU: the workers normalise, as before the option existed
    plain = build_federation(tiny_config(world, ROUNDS)).clients[0]
    assert not isinstance(plain.train_loader(0), DeviceBatches)


def test_normalize_on_takes_its_three_values_only():
    with pytest.raises(ConfigError, match="train.normalize_on"):
        load_config(None, ["train.normalize_on=gpu"])
