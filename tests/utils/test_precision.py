"""train.precision: resolution per device, fp32 untouched, the bf16 path on the CPU."""

import copy

import pytest
import torch
from torch import nn

from fedreid.config import TrainConfig
from fedreid.fl.aggregate import cdw_distance
from fedreid.fl.local.sgd import train_local
from fedreid.utils.precision import (
    FP32,
    PrecisionError,
    adopt_fp32_settings,
    fp32_settings,
    full_fp32_matmul,
    resolve_precision,
    set_tf32,
)


def test_resolution_per_device():
    assert resolve_precision("auto", "cpu") == FP32
    assert resolve_precision("fp32", "cpu").dtype is None
    bf16 = resolve_precision("bf16", "cpu")
    assert bf16.dtype == torch.bfloat16 and not bf16.channels_last  # layout changes only on CUDA
    with pytest.raises(PrecisionError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", "cpu")
    with pytest.raises(PrecisionError, match="expected one of auto, fp32, bf16, fp16"):
        resolve_precision("half", "cpu")


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(4, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def _loader(seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(16, 3, 8, 8, generator=g)
    labels = torch.randint(0, 3, (16,), generator=g)
    return [(images[i:i + 4], labels[i:i + 4]) for i in range(0, 16, 4)]


def readings() -> tuple:
    """Every reading of the fp32 settings torch offers; torch raises on one once they disagree."""
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())


def test_tf32_settings_round_trip_through_full_fp32_matmul_and_another_process():
    saved = fp32_settings()
    try:
        set_tf32(True)
        assert readings() == (True, True, "high")
        training = fp32_settings()
        with full_fp32_matmul():
            assert readings() == (False, True, "highest")
        assert fp32_settings() == training and readings() == (True, True, "high")
        set_tf32(False)  # a later run in the same process without TF32
        assert readings() == (False, False, "highest")
        adopt_fp32_settings(training)  # what a client pool's worker does with its parent's settings
        assert fp32_settings() == training and readings() == (True, True, "high")
    finally:
        adopt_fp32_settings(saved)
    assert fp32_settings() == saved


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch < 2.9 has no generic fp32 field")
@pytest.mark.parametrize("generic", ["tf32", "ieee"])
def test_settings_survive_a_user_setting_torchs_generic_fp32_field(generic):
    # torch then refuses the legacy allow_tf32 readings; a client pool's start and
    # the ranking's full_fp32_matmul read the settings all the same
    saved = fp32_settings()
    try:
        set_tf32(generic != "tf32")  # torch's legacy switches say the opposite of what follows
        for backend in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn,
                        torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv, torch.backends.mkldnn.rnn):
            backend.fp32_precision = "none"  # each follows the generic field, as in a fresh process
        torch.backends.fp32_precision = generic
        with pytest.raises(RuntimeError):
            torch.backends.cudnn.allow_tf32  # noqa: B018 - torch's refusal this test is about
        user = fp32_settings()
        with full_fp32_matmul():
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert fp32_settings() == user
        adopt_fp32_settings(saved)
        adopt_fp32_settings(user)  # a worker adopting its parent's settings
        assert fp32_settings() == user
    finally:
        torch.backends.fp32_precision = "none"
        adopt_fp32_settings(saved)


def test_bf16_autocast_trains_fp32_parameters_close_to_fp32():
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.05)
    plain, mixed = TinyConvNet(), TinyConvNet()
    a = train_local(plain, _loader, cfg)
    b = train_local(mixed, _loader, cfg, precision=resolve_precision("bf16", "cpu"))
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    moved = [not torch.equal(p, q) for p, q in zip(plain.parameters(), TinyConvNet().parameters())]
    assert all(moved)
    # bf16 keeps 8 bits of mantissa: the two runs agree to bf16's resolution, not bit for bit
    for p, q in zip(plain.parameters(), mixed.parameters()):
        assert not torch.equal(p, q)
        torch.testing.assert_close(p, q, rtol=0.05, atol=0.02)
    assert b.loss == pytest.approx(a.loss, rel=0.05)
    assert b.steps == a.steps == 8


def test_fp32_precision_is_the_plain_loop_bit_for_bit():
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=0.05)
    default, explicit = TinyConvNet(), TinyConvNet()
    a = train_local(default, _loader, cfg)
    b = train_local(explicit, _loader, cfg, precision=resolve_precision("fp32", "cpu"))
    assert a.loss == b.loss and a.accuracy == b.accuracy
    assert all(torch.equal(p, q) for p, q in zip(default.parameters(), explicit.parameters()))


def test_cdw_distance_under_bf16_is_fp32_and_close():
    start = TinyConvNet()
    trained = copy.deepcopy(start)
    with torch.no_grad():
        trained.classifier.weight.add_(0.3)
    images = _loader(1)[0][0]
    plain = cdw_distance(start, trained, images)
    mixed = cdw_distance(start, trained, images, precision=resolve_precision("bf16", "cpu"))
    assert isinstance(mixed, float) and mixed == pytest.approx(plain, abs=0.02) and plain > 0.01


def test_divergence_is_caught_and_named():
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=1e30, lr_backbone_ratio=1.0, momentum=0.0, nesterov=False)
    with pytest.raises(FloatingPointError, match="local training diverged .* at epoch 0, step"):
        train_local(TinyConvNet(), _loader, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_on_cuda_trains_fp32_channels_last_parameters(name):
    cuda = torch.device("cuda")
    precision = resolve_precision(name, cuda)
    assert precision.channels_last and resolve_precision("auto", cuda).name in ("bf16", "fp32")
    cfg = TrainConfig(local_epochs=2, batch_size=4, lr=0.05)
    reference, model = TinyConvNet(), TinyConvNet()
    plain = train_local(reference, _loader, cfg)
    mixed = train_local(model, _loader, cfg, device=cuda, precision=precision)
    conv = model.backbone[0].weight
    assert conv.dtype == torch.float32 and conv.is_contiguous(memory_format=torch.channels_last)
    assert mixed.steps == plain.steps and mixed.loss == pytest.approx(plain.loss, rel=0.05)
    # fp16's GradScaler starts at scale 2^16 and skips the first steps whose scaled gradients
    # overflow while it calibrates, so its weights trail fp32's by those steps (up to 0.044 seen
    # on an H200); bf16 needs no scaler and tracks fp32 to its own resolution
    atol = 0.1 if name == "fp16" else 0.02
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(p, q.cpu(), rtol=0.05, atol=atol)


@pytest.mark.gpu
def test_divergence_on_cuda_is_caught_at_the_end_of_its_epoch():
    cfg = TrainConfig(local_epochs=1, batch_size=4, lr=1e30, lr_backbone_ratio=1.0, momentum=0.0, nesterov=False)
    with pytest.raises(FloatingPointError, match="diverged .* at epoch 0, a step of that epoch"):
        train_local(TinyConvNet(), _loader, cfg, device="cuda", precision=FP32)


def test_clip_grad_norm_bounds_every_step_and_none_leaves_the_loop_alone():
    def one_batch(seed):
        return _loader(seed)[:1]

    def step(clip):
        cfg = TrainConfig(local_epochs=1, batch_size=4, lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0,
                          lr_backbone_ratio=1.0, clip_grad_norm=clip)
        model = TinyConvNet()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        train_local(model, one_batch, cfg)
        return torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)

    free = step(None)  # plain SGD at lr 1: the step is the gradient
    assert free > 0.05
    assert step(0.05) == pytest.approx(0.05, rel=1e-4)  # clipped to the norm
    assert step(float(free) * 2) == pytest.approx(float(free), rel=1e-6)  # a larger bound changes nothing
