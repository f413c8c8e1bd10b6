"""CDW distance on hand-checkable models; KD target, loss and distillation pass."""

import math

import pytest
import torch
from tolerances import F32_TOL
from torch import nn

from fedreid.config import TrainConfig
from fedreid.fl.aggregate import cdw_distance, cdw_logits_distance, cdw_start_in_eval
from fedreid.fl.local.sgd import build_optimizer, epoch_lr_scale
from fedreid.fl.server_hooks.kd import distill, is_kd_round, kd_loss, kd_target, public_features


class Lin(nn.Module):
    """logits = x @ W.T (no bias), optionally with BatchNorm/Dropout in front."""

    def __init__(self, weight, bn=False, dropout=0.0):
        super().__init__()
        self.bn = nn.BatchNorm1d(2) if bn else nn.Identity()
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.fc = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor(weight, dtype=torch.float32))

    def forward(self, x):
        return self.fc(self.drop(self.bn(x)))

    def embed(self, x):
        return self.forward(x)


def test_cdw_hand_example():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    start = Lin([[1, 0], [0, 1]])  # old logits = x
    trained = Lin([[1, 0], [1, 1]])  # new logits = (x1, x1 + x2)
    # x=(1,0): cos((1,0),(1,1)) = 1/sqrt2 ; x=(0,1): cos((0,1),(0,1)) = 1
    expected = ((1 - 1 / math.sqrt(2)) + 0.0) / 2
    assert cdw_distance(start, trained, images) == pytest.approx(expected, abs=F32_TOL)
    assert cdw_distance(start, start, images) == pytest.approx(0.0, abs=F32_TOL)
    assert cdw_logits_distance(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])) == pytest.approx(1.0)


def test_cdw_train_mode_seeded_and_side_effect_free():
    torch.manual_seed(0)
    images = torch.randn(6, 2)
    start = Lin([[1, 0], [0, 1]], bn=True, dropout=0.5).eval()
    trained = Lin([[1, 0.5], [0.2, 1]], bn=True, dropout=0.5).train()
    before = [start.bn.running_mean.clone(), trained.bn.running_mean.clone()]
    rng_before = torch.get_rng_state()
    a = cdw_distance(start, trained, images, mode="train", seed=3)
    b = cdw_distance(start, trained, images, mode="train", seed=3)
    c = cdw_distance(start, trained, images, mode="train", seed=4)
    e = cdw_distance(start, trained, images, mode="eval")
    assert a == b and a != c and a != e
    assert torch.equal(torch.get_rng_state(), rng_before)  # no global RNG consumed
    assert torch.equal(start.bn.running_mean, before[0]) and torch.equal(trained.bn.running_mean, before[1])
    assert not start.training and trained.training  # modes restored
    with pytest.raises(ValueError, match="cdw_mode"):
        cdw_distance(start, trained, images, mode="test")


def test_cdw_official_mode_is_the_reference_control_flow():
    """The reference's old model is in eval mode in round 0 and after each test (every 10th round)."""
    assert [r for r in range(31) if cdw_start_in_eval(r, 10)] == [0, 10, 20, 30]
    assert all(cdw_start_in_eval(r, 1) for r in range(5))
    torch.manual_seed(0)
    images = torch.randn(6, 2) * 3 + 1  # far from BatchNorm's initial running statistics (0, 1)
    start = Lin([[1, 0], [0, 1]], bn=True)
    trained = Lin([[1, 0.5], [0.2, 1]], bn=True)
    # by hand: the received model on running statistics, the trained one on batch statistics
    with torch.no_grad():
        old = start.eval()(images)
        new = trained.train()(images)
    start.train(), trained.eval()
    before = trained.bn.running_mean.clone()
    expected = cdw_logits_distance(old, new)
    got = cdw_distance(start, trained, images, mode="official", start_in_eval=True)
    assert got == pytest.approx(expected, abs=F32_TOL)
    assert got != pytest.approx(cdw_distance(start, trained, images, mode="train"), abs=1e-3)
    # every other round: both in train mode, as mode="train"
    assert cdw_distance(start, trained, images, mode="official", seed=2) == cdw_distance(
        start, trained, images, mode="train", seed=2)
    assert start.training and not trained.training and torch.equal(trained.bn.running_mean, before)


def test_kd_target_and_loss():
    f1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    f2 = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    target = kd_target([f1, f2])
    assert torch.allclose(target, torch.tensor([[0.5, 0.5], [0.0, 1.0]]))
    student = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    # MSE over all 4 entries: ((1.5)^2 + 0.5^2 + 0 + 0) / 4
    assert kd_loss(student, target).item() == pytest.approx((2.25 + 0.25) / 4)
    # normalised student: (1, 0) -> ((0.5)^2 + 0.5^2) / 4
    assert kd_loss(student, target, normalize_student=True).item() == pytest.approx(0.5 / 4)
    with pytest.raises(ValueError, match="shape"):
        kd_target([f1, torch.zeros(3, 2)])


def _dict_loader(x, batch, order):
    return [{"image": x[order[i:i + batch]], "index": order[i:i + batch]} for i in range(0, len(order), batch)]


def test_public_features_normalised_in_index_order():
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0], [1.0, 0.0]])
    model = Lin([[1, 0], [0, 1]], dropout=0.5).train()
    loader = _dict_loader(x, 2, torch.tensor([2, 0, 1]))
    feats = public_features(model, loader, 3)
    assert torch.allclose(feats, torch.tensor([[0.6, 0.8], [0.0, 1.0], [1.0, 0.0]]))
    assert model.training  # mode restored; dropout was off (eval) or features would not be exact
    with pytest.raises(ValueError, match="expected 4"):
        public_features(model, loader, 4)


def test_distill_one_pass_moves_towards_target():
    torch.manual_seed(0)
    x = torch.randn(8, 2)
    model = Lin([[1, 0], [0, 1]])
    target = torch.tensor([[0.0, 1.0]]).repeat(8, 1)
    loss0 = kd_loss(model.embed(x), target).item()
    stats = distill(model, _dict_loader(x, 4, torch.arange(8)), target, lr=0.2, momentum=0.0, weight_decay=0.0)
    assert stats["kd_steps"] == 2
    assert kd_loss(model.embed(x), target).item() < loss0
    assert not model.training


def test_kd_rounds_and_lr_schedule():
    assert [r for r in range(30) if is_kd_round(r, 10)] == [9, 19, 29]
    # reference: StepLR(40, 0.1) recreated each round, stepped at the start of each epoch
    assert epoch_lr_scale(0) == 1.0 and epoch_lr_scale(38) == 1.0
    assert epoch_lr_scale(39) == pytest.approx(0.1) and epoch_lr_scale(79) == pytest.approx(0.01)


def test_optimizer_groups():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Linear(2, 2)
            self.bottleneck = nn.Linear(2, 2)
            self.classifier = nn.Linear(2, 3)

    opt = build_optimizer(M(), TrainConfig())
    low, high = opt.param_groups
    assert low["lr"] == pytest.approx(0.005) and high["lr"] == pytest.approx(0.05)
    assert len(low["params"]) == 2 and len(high["params"]) == 4
    assert high["nesterov"] and high["momentum"] == 0.9 and high["weight_decay"] == 5e-4
