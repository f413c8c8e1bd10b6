"""FedDF as FedFTG's official code runs it (``FedDFConfig.official()``), against a port of that code.

The port below follows ``ZhangLin-PKU/FedFTG``, ``methods/local_fn_gan.py:train_global_model_feddf``
line by line (separate backward passes, the generator run once for ``L_dis``
and once per teacher, a fresh Adam with weight decay, eval-mode generator and
train-mode student in the distillation, ``KLDivLoss(batchmean)`` toward the
averaged probabilities), with the hook's random draws in the hook's order.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from fl_helpers import distillation_teachers
from tolerances import F32_TOL
from torch import nn

from fedreid.fl.classification import CLASS_COUNTS
from fedreid.fl.server_hooks.feddf import FedDFConfig, FedDFConfigError, FedDFHook, feddf_loss
from fedreid.fl.server_hooks.fedftg import diversity_loss, stratified_labels
from fedreid.models.generator import sample_noise
from fedreid.utils.seeding import forked_torch_rng, torch_generator

SMALL = dict(generator_steps=3, distill_steps=4, batch_size=8, image_size=8, image_channels=1,
             generator_channels=8)


def _world():
    # BatchNorm and dropout: the official student trains in train mode
    with forked_torch_rng(0):
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                              nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, 3))
    teachers, updates = distillation_teachers(model)
    counts = torch.stack([u.metadata[CLASS_COUNTS] for u in updates])
    return model, teachers, counts, updates


def _official_round(cfg: FedDFConfig, student, g_model, teachers, counts, gen: torch.Generator, t: int) -> None:
    """One call of the official ``train_global_model_feddf`` (draws from ``gen`` in the hook's order)."""
    t_model = copy.deepcopy(student).eval()
    glb_lr, gen_lr = cfg.distill_lr * cfg.distill_lr_decay ** t, cfg.generator_lr * cfg.lr_decay ** t
    optimizer_d = torch.optim.SGD(student.parameters(), lr=glb_lr, weight_decay=cfg.distill_weight_decay)
    optimizer_g = torch.optim.Adam(g_model.parameters(), lr=gen_lr, betas=(0.9, 0.999), eps=1e-08,
                                   weight_decay=cfg.generator_weight_decay, amsgrad=False)
    num_clients, bs = len(teachers), cfg.batch_size
    dropout_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    labels_all = stratified_labels(counts, cfg.generator_steps * bs, gen)
    student.eval()
    g_model.train()
    for e in range(cfg.generator_steps):
        y = labels_all[e * bs:(e + 1) * bs]
        z = sample_noise(bs, g_model.z_dim, gen)
        optimizer_g.zero_grad()
        fake = g_model(z, y)
        diversity_loss(z, fake).backward()
        for client in range(num_clients):
            t_model.load_state_dict(teachers[client])
            fake = g_model(z, y)
            (F.cross_entropy(t_model(fake), y) / num_clients).backward()
        optimizer_g.step()
    g_model.eval()
    student.train()
    labels_all = stratified_labels(counts, cfg.distill_steps * bs, gen)
    with forked_torch_rng(dropout_seed):
        for e in range(cfg.distill_steps):
            y = labels_all[e * bs:(e + 1) * bs]
            z = sample_noise(bs, g_model.z_dim, gen)
            optimizer_d.zero_grad()
            fake = g_model(z, y).detach()
            s_logit = student(fake)
            merge = 0
            for client in range(num_clients):
                t_model.load_state_dict(teachers[client])
                merge = merge + F.softmax(t_model(fake).detach(), dim=1)
            F.kl_div(F.log_softmax(s_logit, dim=1), merge / num_clients, reduction="batchmean").backward()
            optimizer_d.step()
    student.eval()


def test_official_preset_sets_the_official_code_and_keeps_overrides():
    cfg = FedDFConfig.official(distill_lr=0.05)
    assert (cfg.generator_steps, cfg.distill_steps, cfg.batch_size) == (50, 20, 50)
    assert (cfg.label_sampling, cfg.ensemble, cfg.target) == ("stratified", "uniform", "avg_probs")
    assert (cfg.generator_forwards, cfg.generator_bn, cfg.student_bn) == ("per_teacher", "running", "train")
    assert (cfg.distill_optimizer, cfg.distill_schedule, cfg.distill_lr, cfg.distill_lr_decay) == (
        "sgd", "constant", 0.05, 0.998)
    assert cfg.reset_generator_optimizer and cfg.generator_weight_decay == cfg.distill_weight_decay == 1e-3
    default = FedDFConfig()
    assert (default.label_sampling, default.ensemble, default.target, default.generator_forwards,
            default.generator_bn, default.distill_lr_decay, default.reset_generator_optimizer) == (
        "counts", "class", "avg_logits", "once", "batch", 1.0, False)


@pytest.mark.parametrize("field, value, message", [
    ("distill_lr_decay", 0.0, "distill_lr_decay must be in (0, 1]"),
    ("generator_weight_decay", -1.0, "generator_weight_decay must be a finite number >= 0"),
    ("distill_weight_decay", math.inf, "distill_weight_decay must be a finite number >= 0"),
    ("generator_forwards", "twice", "generator_forwards must be one of once, per_teacher"),
    ("generator_bn", "eval", "generator_bn must be one of batch, running"),
    ("target", "probs", "target must be one of avg_logits, avg_losses, avg_probs"),
])
def test_new_options_are_checked_by_name(field, value, message):
    with pytest.raises(FedDFConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FedDFConfig(**{field: value})


def test_avg_probs_is_the_kl_to_the_averaged_probabilities():
    gen = torch.Generator().manual_seed(0)
    teachers = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    student = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    p = torch.softmax(teachers, dim=2).mean(dim=0)
    hand = (p * (p.log() - F.log_softmax(student, dim=1))).sum(dim=1).mean()
    assert feddf_loss(student, teachers, target="avg_probs").item() == pytest.approx(hand.item(), rel=1e-12)
    # the average of probabilities is not the softmax of averaged logits
    assert feddf_loss(student, teachers, target="avg_logits").item() != pytest.approx(hand.item(), rel=1e-3)
    hot = 4 * F.kl_div(F.log_softmax(student / 2, dim=1), torch.softmax(teachers / 2, dim=2).mean(dim=0),
                       reduction="batchmean")
    assert feddf_loss(student, teachers, temperature=2.0, target="avg_probs").item() == pytest.approx(
        hot.item(), rel=1e-12)


@pytest.fixture
def float64_default():
    """Models and noise in float64: the conv biases in front of BatchNorm have an analytically zero gradient,
    and in float32 Adam turns its rounding noise (which differs between one summed backward and the official
    separate ones) into steps of the size of the learning rate."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_official_preset_equals_a_port_of_the_official_code_over_two_rounds(float64_default):
    cfg = FedDFConfig.official(**SMALL)
    model, teachers, counts, updates = _world()
    hook = FedDFHook(cfg, num_classes=3, seed=1)
    g_model = copy.deepcopy(hook.generator)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    for t in range(2):
        hook.after_aggregate(t, ours, updates)
        gen = torch_generator(1, "fedftg", t)  # the round generator of a hook of seed 1
        _official_round(cfg, theirs, g_model, teachers, counts, gen, t)
        for name, value in hook.generator.state_dict().items():  # BatchNorm statistics: K + 1 updates a step
            torch.testing.assert_close(value, g_model.state_dict()[name], rtol=F32_TOL, atol=F32_TOL, msg=name)
        for name, value in ours.state_dict().items():
            torch.testing.assert_close(value, theirs.state_dict()[name], rtol=F32_TOL, atol=F32_TOL, msg=name)
    # a fresh Adam each round: its step count is one round's
    steps = {int(s["step"]) for s in hook.optimizer.state_dict()["state"].values()}
    assert steps == {cfg.generator_steps}


def test_distill_lr_decays_per_round_only_when_asked():
    model, _, _, updates = _world()
    hook = FedDFHook(FedDFConfig(**SMALL, distill_lr=0.02, distill_lr_decay=0.5), num_classes=3, seed=1)
    assert hook.after_aggregate(3, copy.deepcopy(model), updates)["feddf_distill_lr"] == pytest.approx(0.02 / 8)
    plain = FedDFHook(FedDFConfig(**SMALL, distill_lr=0.02), num_classes=3, seed=1)
    assert plain.after_aggregate(3, copy.deepcopy(model), updates)["feddf_distill_lr"] == 0.02
