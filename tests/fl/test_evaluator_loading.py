"""The evaluator reads every query and gallery set through one persistent loader; the numbers stay those of a loader per set."""

import os

import numpy as np
import pytest
import torch
from fl_helpers import tiny_config, write_world

from fedreid.config import ConfigError, load_config
from fedreid.data.datasets import ReIDImageDataset, make_loader
from fedreid.data.prepared import PreparedDataset
from fedreid.data.transforms import build_test_transform
from fedreid.fl.evaluation import Evaluator, eval_workers
from fedreid.inference.embed import EmbedModule, FeatureBatches
from fedreid.inference.features import extract_features
from fedreid.models import create_reid_model
from fedreid.utils.precision import PrecisionError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"), names=("dsa", "dsb", "dsc"))


@pytest.fixture(scope="module")
def model():
    return create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=0)


def datasets(world):
    return {name: PreparedDataset.load(world / name) for name in ("dsa", "dsb", "dsc")}


def own_loader_features(model, ds: PreparedDataset, split: str, batch_size: int) -> np.ndarray:
    """A set's features through a fresh in-order loader of its own (how evaluation read each set before)."""
    dataset = ReIDImageDataset(ds.split(split), None, transform=build_test_transform(32, 16))
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0)
    return extract_features(EmbedModule(model), FeatureBatches(loader), flip=True, normalize=True).features


@pytest.mark.parametrize("workers", [0, 2])
def test_one_stream_gives_every_set_the_features_of_its_own_loader(world, model, workers):
    sets = datasets(world)
    # batch 4 does not divide the sets (2 or 3 queries, 4 or 6 gallery images): batches must not span two sets
    ev = Evaluator(sets, height=32, width=16, batch_size=4, workers=workers)
    features = ev.split_features(model, ["dsc", "dsa"])
    assert list(features) == [("dsc", "query"), ("dsc", "gallery"), ("dsa", "query"), ("dsa", "gallery")]
    for (name, split), got in features.items():
        assert torch.equal(got, torch.from_numpy(own_loader_features(model, sets[name], split, 4))), (name, split)


def test_a_subset_evaluates_as_in_the_full_evaluation_and_workers_change_nothing(world, model):
    sets = datasets(world)
    alone = Evaluator(sets, height=32, width=16, batch_size=4, workers=0)
    pooled = Evaluator(sets, height=32, width=16, batch_size=4, workers=2)
    full = pooled(model)
    assert list(full) == ["dsa", "dsb", "dsc"]
    assert pooled(model, ["dsb"]) == {"dsb": full["dsb"]}  # the same workers serve a second, smaller pass
    assert alone(model) == full
    assert pooled._images._loader._iterator is not None  # the workers stayed between the passes


def test_a_copy_with_other_workers_reads_the_same_sets_with_its_own_loader(world, model):
    ev = Evaluator(datasets(world), height=32, width=16, batch_size=4, workers=2)
    first = ev(model, ["dsa"])
    other = ev.with_workers(0)
    assert other.workers == 0 and ev.workers == 2 and other._images is None
    assert other(model, ["dsa"]) == first and other._images is not ev._images


def test_evaluation_takes_the_idle_training_workers_unless_told(world):
    names = ("dsa", "dsb", "dsc")
    cfg = tiny_config(world, ["train.workers=2", "run.concurrent_clients=3"], names=names)
    assert eval_workers(cfg) == min(6, os.cpu_count())
    assert eval_workers(tiny_config(world, names=names)) == 0  # no training workers, none for evaluation
    cfg = tiny_config(world, ["train.workers=2", "eval.workers=1"], names=names)
    assert eval_workers(cfg) == 1
    assert Evaluator.from_config(cfg, datasets(world), "cpu").workers == 1
    assert Evaluator.from_config(cfg, datasets(world), "cpu", workers=3).workers == 3
    with pytest.raises(ConfigError, match="eval.workers"):
        tiny_config(world, ["eval.workers=-1"], names=names)


def test_a_run_with_loader_workers_everywhere_records_what_a_run_without_does(world, tmp_path):
    from fl_helpers import strip_time

    from fedreid.fl.simulation import run_simulation

    names = ("dsa", "dsb", "dsc")
    # one training loader worker in both runs (the augmentations depend on the training worker count)
    base = ["fl.rounds=2", "eval.local_models=true", "train.workers=1"]
    plain = run_simulation(tiny_config(world, base + ["eval.workers=0"], names=names), tmp_path / "plain",
                           progress=False)
    # the server evaluates with 2 workers (eval.workers null); each client worker process evaluates its client with 1
    pooled = run_simulation(tiny_config(world, base + ["run.concurrent_clients=2"], names=names),
                            tmp_path / "pooled", progress=False)
    assert strip_time(pooled) == strip_time(plain)
    assert set(plain[-1]["local_eval"]) == {"dsa", "dsb", "dsc"} and set(plain[-1]["eval"]) >= set(names)


def assert_mixed_precision_features(mixed, exact):
    """Float32, unit-length rows, the same up to bf16's rounding, and not the fp32 features (autocast ran)."""
    assert mixed.keys() == exact.keys()
    for key, got in mixed.items():
        want = exact[key]
        assert got.dtype == torch.float32 and got.shape == want.shape, key
        assert torch.allclose(got.norm(dim=1), torch.ones(len(got)), atol=1e-5), key
        assert (got * want).sum(dim=1).min() > 0.99, key  # cosine of each image's two features
    assert any(not torch.equal(mixed[key], exact[key]) for key in mixed)


def test_evaluation_runs_in_fp32_unless_eval_precision_says_otherwise(world, model):
    sets = datasets(world)
    exact = Evaluator(sets, height=32, width=16, batch_size=4)
    assert exact.precision.name == "fp32" and not exact.precision.channels_last
    mixed = Evaluator(sets, height=32, width=16, batch_size=4, precision="bf16")
    assert mixed.precision.name == "bf16" and not mixed.precision.channels_last  # the layout changes on CUDA only
    assert_mixed_precision_features(mixed.split_features(model, ["dsa", "dsb"]),
                                    exact.split_features(model, ["dsa", "dsb"]))
    assert set(mixed(model, ["dsa"])["dsa"]) == set(exact(model, ["dsa"])["dsa"])
    assert Evaluator(sets, height=32, width=16, precision="auto").precision.name == "fp32"  # on the CPU
    with pytest.raises(PrecisionError, match=r"^eval.precision: fp16 needs a CUDA device"):
        Evaluator(sets, height=32, width=16, precision="fp16")
    cfg = tiny_config(world, ["eval.precision=bf16"], names=("dsa", "dsb", "dsc"))
    assert Evaluator.from_config(cfg, sets, "cpu").precision.name == "bf16"
    with pytest.raises(ConfigError, match=r"^eval.precision: the classification track"):
        load_config(None, ["task=classification", "fl.aggregation=fedavg", "eval.precision=bf16"])


@pytest.mark.gpu
def test_on_cuda_the_pinned_stream_gives_the_records_of_the_unpooled_read(world):
    model = create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=0).cuda()
    sets = datasets(world)
    pooled = Evaluator(sets, height=32, width=16, batch_size=4, workers=2, device="cuda")
    assert pooled.normalize_on == "auto"  # on CUDA the device normalises the uint8 batches
    alone = Evaluator(sets, height=32, width=16, batch_size=4, workers=0, device="cuda", normalize_on="worker")
    assert pooled(model) == alone(model)
    features = pooled.split_features(model, ["dsb"])
    assert all(f.device.type == "cpu" and f.dtype == torch.float32 for f in features.values())


@pytest.mark.gpu
def test_on_cuda_bf16_evaluation_is_channels_last_and_gives_the_model_back_as_it_was(world):
    model = create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=0).cuda()
    sets = datasets(world)
    mixed = Evaluator(sets, height=32, width=16, batch_size=4, device="cuda", precision="bf16")
    assert mixed.precision.channels_last
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    features = mixed.split_features(model, ["dsa", "dsb"])
    assert all(torch.equal(v, before[k][0]) and v.stride() == before[k][1] for k, v in model.state_dict().items())
    exact = Evaluator(sets, height=32, width=16, batch_size=4, device="cuda").split_features(model, ["dsa", "dsb"])
    assert_mixed_precision_features(features, exact)
