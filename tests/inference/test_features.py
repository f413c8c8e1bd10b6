"""Feature extraction (flip-sum, normalisation, modes, loader contract) and the .npz cache."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fedreid.errors import FedReIDError
from fedreid.inference.features import (
    DegenerateFeaturesError,
    FeatureSet,
    channels_last_model,
    check_features,
    collect_features,
    extract_features,
    load_features,
    save_features,
)


class TinyNet(nn.Module):
    """conv -> BN -> dropout -> global pool: not flip-invariant, and train/eval matter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(0.5)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(self.drop(torch.relu(self.bn(self.conv(x)))))  # [B, 6, 1, 1]


def batches(n=10, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 8, 6, generator=g)
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        yield (
            images[start:stop],
            torch.arange(start, stop),
            torch.arange(start, stop) % 3,
            [f"p{i}.jpg" for i in range(start, stop)],
        )


def all_images(n=10):
    return torch.cat([b[0] for b in batches(n)])


def reference(model, images, flip=True, normalize=True):
    model.eval()
    with torch.no_grad():
        f = model(images).flatten(1)
        if flip:
            f = f + model(torch.flip(images, dims=[3])).flatten(1)
        if normalize:
            f = f / f.norm(dim=1, keepdim=True)
    return f.numpy()


def test_flip_sum_then_normalise():
    model = TinyNet()
    out = extract_features(model, batches())
    expected = reference(TinyNet(), all_images())
    np.testing.assert_allclose(out.features, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out.features, axis=1), 1.0, rtol=1e-5)
    assert out.features.dtype == np.float32 and out.features.shape == (10, 6)
    np.testing.assert_array_equal(out.pids, np.arange(10))
    np.testing.assert_array_equal(out.camids, np.arange(10) % 3)
    assert out.paths[3] == "p3.jpg"


@pytest.mark.parametrize("chunk_bytes", [1, 72, 1 << 20])
def test_tensor_results_are_gathered_in_chunks_in_order_as_arrays_would_be(chunk_bytes):
    # a batch of batches() gives 4 rows of 3 float32 features (48 bytes): chunks of every batch, of a
    # batch and a half (closing across batches) and of everything
    def as_tensor(images):
        return images.mean(dim=(2, 3)) * 3.0

    def as_array(images):
        return as_tensor(images).numpy()

    want = collect_features(batches(), as_array)
    gathered = collect_features(batches(), as_tensor, chunk_bytes=chunk_bytes)
    assert gathered.features.dtype == np.float32 and gathered.features.shape == (10, 3)
    np.testing.assert_array_equal(gathered.features, want.features)
    np.testing.assert_array_equal(gathered.pids, np.arange(10))
    # an array result (an exported file's extractor) between tensor results keeps its place
    calls = iter(range(3))
    mixed = collect_features(batches(), lambda x: as_array(x) if next(calls) == 1 else as_tensor(x),
                             chunk_bytes=chunk_bytes)
    np.testing.assert_array_equal(mixed.features, want.features)


def test_flip_and_normalisation_can_be_disabled():
    images = all_images()
    raw = extract_features(TinyNet(), batches(), flip=False, normalize=False).features
    expected = reference(TinyNet(), images, flip=False, normalize=False)
    np.testing.assert_allclose(raw, expected, rtol=1e-5, atol=1e-6)
    summed = extract_features(TinyNet(), batches(), normalize=False).features
    np.testing.assert_allclose(summed, reference(TinyNet(), images, normalize=False), rtol=1e-5, atol=1e-6)
    # The model is not flip-invariant, so the flipped half really contributes.
    assert not np.allclose(summed, 2 * raw, atol=1e-4)


def test_eval_mode_is_used_and_every_module_mode_restored():
    model = TinyNet()
    model.train()
    model.bn.eval()  # a frozen BatchNorm inside a training model: mixed modes
    running_mean = model.bn.running_mean.clone()
    a = extract_features(model, batches()).features
    b = extract_features(model, batches()).features
    np.testing.assert_array_equal(a, b)  # dropout off, BN uses running stats
    assert model.training and model.conv.training and model.drop.training
    assert not model.bn.training
    assert torch.equal(model.bn.running_mean, running_mean)
    assert all(p.grad is None for p in model.parameters())


def test_loader_contract_dicts_and_image_only_tuples():
    dict_loader = ({"images": b[0], "pids": b[1], "camids": b[2], "paths": b[3]} for b in batches())
    from_dicts = extract_features(TinyNet(), dict_loader)
    from_tuples = extract_features(TinyNet(), batches())
    np.testing.assert_array_equal(from_dicts.features, from_tuples.features)
    assert from_dicts.paths == from_tuples.paths
    only_images = extract_features(TinyNet(), ((b[0],) for b in batches()))
    assert isinstance(only_images, FeatureSet)
    assert only_images.pids is None and only_images.camids is None and only_images.paths is None
    features, pids, camids, paths = from_tuples  # unpacks like a tuple
    assert features.shape[0] == len(paths) == 10


def test_loader_errors_are_clear():
    with pytest.raises(ValueError, match="no batches"):
        extract_features(TinyNet(), [])
    with pytest.raises(ValueError, match="'images' key"):
        extract_features(TinyNet(), [{"x": torch.zeros(1, 3, 4, 4)}])
    mixed = [(torch.zeros(1, 3, 4, 4), [1]), (torch.zeros(1, 3, 4, 4),)]
    with pytest.raises(ValueError, match="batches differ in their fields"):
        extract_features(TinyNet(), mixed)


def test_cuda_only_options_warn_on_cpu():
    with pytest.warns(UserWarning, match="amp and channels_last ignored: only used on CUDA"):
        out = extract_features(TinyNet(), batches(), amp=True, channels_last=True)
    np.testing.assert_array_equal(out.features, extract_features(TinyNet(), batches()).features)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extract_features(TinyNet(), batches())  # no warning when nothing is ignored


def test_channels_last_converts_the_model_for_the_call_and_restores_it():
    model = TinyNet()
    other = nn.Conv2d(6, 6, 1).to(memory_format=torch.channels_last)  # already channels-last: stays so
    model.add_module("extra", other)
    weight, before = model.conv.weight, model.conv.weight.detach().clone()
    assert model.conv.weight.is_contiguous()
    with channels_last_model(model):
        # the weights themselves, not only the input, so convolutions need no per-call conversion
        assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
        assert not model.conv.weight.is_contiguous()
        x = torch.randn(2, 3, 8, 6).contiguous(memory_format=torch.channels_last)
        inside = model.eval()(x)
    assert model.conv.weight is weight  # same Parameter: optimisers holding it are unaffected
    assert model.conv.weight.is_contiguous() and torch.equal(model.conv.weight, before)
    assert other.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(model(x.contiguous()), inside)


def test_channels_last_model_gives_back_every_stride_of_a_resnet():
    # A 1x1 convolution's weight is contiguous in both formats, yet the
    # conversion restrides it (ResNet's downsample and bottleneck 1x1 convs).
    from fedreid.models.reid import create_reid_model

    model = create_reid_model("test_resnet", 0, bottleneck_dim=16, seed=0)
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    with channels_last_model(model):
        assert any(v.stride() != before[k][1] for k, v in model.state_dict().items())
    for key, value in model.state_dict().items():
        assert value.stride() == before[key][1], key
        assert torch.equal(value, before[key][0]), key


def test_channels_last_model_is_restored_after_an_error():
    model = TinyNet()
    with pytest.raises(RuntimeError, match="boom"):
        with channels_last_model(model):
            raise RuntimeError("boom")
    assert model.conv.weight.is_contiguous()


# --------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------


def test_cache_round_trip(tmp_path):
    out = extract_features(TinyNet(), batches())
    path = save_features(tmp_path / "feats.npz", *out, meta={"model": "tiny", "flip": True})
    assert [p.name for p in tmp_path.iterdir()] == ["feats.npz"]  # no temporary leftovers
    loaded, meta = load_features(path)
    np.testing.assert_array_equal(loaded.features, out.features)
    np.testing.assert_array_equal(loaded.pids, out.pids)
    np.testing.assert_array_equal(loaded.camids, out.camids)
    assert loaded.paths == out.paths and meta == {"model": "tiny", "flip": True}


def test_cache_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_features(tmp_path / "nope.npz")
    partial = tmp_path / "partial.npz"
    np.savez(partial, features=np.zeros((2, 3), np.float32), pids=np.zeros(2))
    with pytest.raises(ValueError, match=r"partial.npz is missing keys \['camids', 'paths', 'meta'\]"):
        load_features(partial)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="garbage.npz is not a NumPy .npz of fedreid features.*a text file") as exc:
        load_features(garbage)
    assert isinstance(exc.value, FedReIDError)  # the tools print it as one line
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(ValueError, match="broken.npz is not a NumPy .npz of fedreid features .*: it is a damaged archive"):
        load_features(broken)
    with pytest.raises(ValueError, match=r"mismatched lengths \(feats: 2, pids: 1"):
        save_features(tmp_path / "bad.npz", np.zeros((2, 3)), [1], [1, 2], ["a", "b"])


def test_a_feature_file_of_the_wrong_kind_never_suggests_unsafe_loading(tmp_path):
    """Text, a pickle, object arrays, wrong dtypes: each refused with what was expected, never allow_pickle."""
    import pickle

    text = tmp_path / "notes.npz"
    text.write_text("101\n")
    pickled = tmp_path / "pickled.npz"
    pickled.write_bytes(pickle.dumps({"features": [1.0]}))
    objects = tmp_path / "objects.npz"
    np.savez(objects, features=np.array([[object()]], dtype=object), pids=np.zeros(1, int),
             camids=np.zeros(1, int), paths=np.array(["a"]), meta=np.array("{}"))
    strings = tmp_path / "strings.npz"
    np.savez(strings, features=np.array([["a", "b"]]), pids=np.zeros(1, int), camids=np.zeros(1, int),
             paths=np.array(["a"]), meta=np.array("{}"))
    expectations = {
        text: "is not a NumPy .npz of fedreid features.*: it is a text file",
        pickled: "is not a NumPy .npz of fedreid features.*: it is a Python pickle, which is never loaded",
        objects: "is not a NumPy .npz of fedreid features.*: it holds pickled Python objects, which are never loaded",
        strings: "'features' should be a 2-D float array, got shape \\(1, 2\\) of dtype <U1",
    }
    for path, message in expectations.items():
        with pytest.raises(ValueError, match=message) as exc:
            load_features(path)
        assert str(path) in str(exc.value) and "allow_pickle" not in str(exc.value) and "\n" not in str(exc.value)


# --------------------------------------------------------------------------
# Degenerate features
# --------------------------------------------------------------------------


def test_check_features_refuses_what_would_rank_by_ties_alone():
    rng = np.random.default_rng(0)
    good = rng.standard_normal((5, 4)).astype(np.float32)
    check_features(good, "x")  # passes
    check_features(good[:1], "x")  # one row: nothing to compare
    check_features(np.zeros((0, 4), np.float32), "x")  # empty: the metrics name that
    paths = [f"img{i}.jpg" for i in range(5)]
    nan = good.copy()
    nan[3, 1] = np.inf
    cases = [
        (np.zeros((5, 4), np.float32), "src: all 5 feature rows are zero"),
        (np.zeros((1, 4), np.float32), "src: all 1 feature rows are zero"),
        (np.tile(good[:1], (5, 1)), "src: all 5 feature rows are identical"),
        (nan, r"src row 3 \(img3.jpg\) has NaN or inf features"),
    ]
    for features, message in cases:
        with pytest.raises(DegenerateFeaturesError, match=message) as exc:
            check_features(features, "src", paths=paths)
        assert isinstance(exc.value, FedReIDError) and isinstance(exc.value, ValueError)
    check_features(np.tile(good[:1], (5, 1)), "src", identical_ok=True)  # copies of one query image
    with pytest.raises(DegenerateFeaturesError, match="all 5 feature rows are zero"):
        check_features(np.zeros((5, 4), np.float32), "src", identical_ok=True)


def test_check_features_works_in_chunks(monkeypatch):
    from fedreid.inference import features as features_module

    monkeypatch.setattr(features_module, "_CHECK_ELEMENTS", 8)  # 2 rows of 4 per chunk
    x = np.tile(np.arange(4, dtype=np.float32), (7, 1))
    with pytest.raises(DegenerateFeaturesError, match="all 7 feature rows are identical"):
        check_features(x, "src")
    x[6, 0] = 5.0  # differs only in the last chunk
    check_features(x, "src")
    x[5, 2] = np.nan
    with pytest.raises(DegenerateFeaturesError, match="src row 5 has NaN"):
        check_features(x, "src")
