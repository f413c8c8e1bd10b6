"""Client objectives (fedreid.fl.local.*): every loss against numbers worked out by hand.

The arithmetic is written next to each expected value; tensors are tiny so
the whole file runs in a few seconds on CPU.
"""

from __future__ import annotations

import io
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from tolerances import F32_TOL
from torch import nn

from fedreid.fl.local.base import (
    FedAvg,
    ObjectiveError,
    heavy_ball_steps,
    kl_teacher_student,
    masked_log_softmax,
    masked_softmax,
    normalised_steps,
    representation,
)
from fedreid.fl.local.feddyn import (
    FedDyn,
    feddyn_official_client_weight,
    feddyn_server_update,
)
from fedreid.fl.local.fedlmd import (
    FedLMD,
    FedLMDTf,
    lmd_loss,
    lmd_tf_loss,
    lmd_uses_teacher,
    majority_labels,
    teacher_support,
    tf_target,
)
from fedreid.fl.local.fedntd import FedNTD, ntd_loss
from fedreid.fl.local.fedprox import FedProx
from fedreid.fl.local.moon import Moon, moon_contrastive_loss
from fedreid.fl.local.objectives import OBJECTIVES, build_objective
from fedreid.fl.local.scaffold import (
    DELTA_C_KEY,
    Scaffold,
    scaffold_server_control_update,
    scaffold_server_model_update,
)
from fedreid.fl.server_hooks.fednova import local_norm

LN = math.log


class Tiny(nn.Module):
    """``features = body(x)`` (2 -> 2), ``logits = classifier(features)`` (2 -> 3), no biases."""

    def __init__(self, body=((1.0, 2.0), (3.0, 4.0)), head=((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(body))
            self.classifier.weight.copy_(torch.tensor(head))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Scalars(nn.Module):
    """Two scalar parameters ``a`` and ``b`` (SCAFFOLD / FedDyn server arithmetic)."""

    def __init__(self, a: float = 1.0, b: float = 2.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([a]))
        self.b = nn.Parameter(torch.tensor([b]))


def const_logits(rows) -> torch.Tensor:
    """Logits that are a leaf (not produced by the model): the CE then sends no gradient to the model."""
    return torch.tensor(rows, dtype=torch.float32, requires_grad=True)


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------


def test_kl_direction_is_teacher_to_student_like_kl_div():
    p = torch.tensor([[0.5, 0.5]])  # teacher
    q = torch.tensor([[0.9, 0.1]])  # student
    # KL(p||q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5(-0.587787) + 0.5(1.609438) = 0.510826
    kl_pq = 0.5 * LN(0.5 / 0.9) + 0.5 * LN(0.5 / 0.1)
    # KL(q||p) = 0.9 ln(1.8) + 0.1 ln(0.2) = 0.529008 - 0.160944 = 0.368064 (the other direction differs)
    kl_qp = 0.9 * LN(1.8) + 0.1 * LN(0.2)
    ours = kl_teacher_student(p, q.log())
    assert ours.item() == pytest.approx(kl_pq, abs=F32_TOL)
    assert ours.item() != pytest.approx(kl_qp, abs=1e-3)
    # F.kl_div(input=log student, target=teacher) is KL(teacher || student)
    assert F.kl_div(q.log(), p, reduction="batchmean").item() == pytest.approx(kl_pq, abs=F32_TOL)
    g = torch.Generator().manual_seed(0)
    pt = torch.softmax(torch.randn(5, 7, generator=g), 1)
    lq = torch.log_softmax(torch.randn(5, 7, generator=g), 1)
    torch.testing.assert_close(kl_teacher_student(pt, lq), F.kl_div(lq, pt, reduction="none").sum(1))


def test_masked_softmax_removes_entries_from_the_normaliser():
    x = torch.tensor([[0.0, LN(2.0), LN(3.0)], [1.0, 2.0, 3.0]])
    keep = torch.tensor([[False, True, True], [False, False, False]])
    p = masked_softmax(x, keep)
    # row 0: exp = [_, 2, 3] over {1, 2} -> [0, 2/5, 3/5]; row 1: nothing kept -> zeros (not NaN)
    torch.testing.assert_close(p, torch.tensor([[0.0, 0.4, 0.6], [0.0, 0.0, 0.0]]))
    lp = masked_log_softmax(x, keep)
    assert lp[0, 0].item() == float("-inf")
    assert lp[0, 1].item() == pytest.approx(LN(0.4), abs=F32_TOL)


def test_representation_uses_features_then_embed():
    m = Tiny()
    x = torch.tensor([[1.0, 0.0]])
    torch.testing.assert_close(representation(m, x), torch.tensor([[1.0, 3.0]]))  # first column of body

    class Embedder(nn.Module):
        def embed(self, x):
            return x * 2

    torch.testing.assert_close(representation(Embedder(), x), torch.tensor([[2.0, 0.0]]))
    with pytest.raises(ObjectiveError, match="features"):
        representation(nn.Linear(2, 2), x)


# ---------------------------------------------------------------------------
# FedAvg / FedProx
# ---------------------------------------------------------------------------


def test_fedavg_is_mean_cross_entropy():
    obj = FedAvg()
    m = Tiny()
    obj.begin_round(m, dict(m.state_dict()))
    # sample 0: softmax(log [1, 2, 3]) = [1/6, 2/6, 3/6], label 2 -> -ln(1/2) = ln 2
    # sample 1: softmax(0, 0, 0) = 1/3 each, label 0 -> ln 3; mean = (ln 2 + ln 3) / 2 = ln(6)/2
    logits = const_logits([[0.0, LN(2.0), LN(3.0)], [0.0, 0.0, 0.0]])
    loss = obj.loss(m, torch.zeros(2, 2), torch.tensor([2, 0]), logits)
    assert loss.item() == pytest.approx(LN(6.0) / 2, abs=F32_TOL)
    assert obj.end_round(m) == {}


def test_objective_hooks_need_begin_round():
    obj = FedAvg()
    with pytest.raises(ObjectiveError, match="begin_round"):
        obj.loss(Tiny(), torch.zeros(1, 2), torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]))


def test_fedprox_value_and_gradient_is_mu_times_difference():
    m = Tiny()  # body W = [[1, 2], [3, 4]]
    # global: W_g = [[1, 2], [3, 3.5]]; the classifier is private (absent); a buffer-like key is ignored
    glob = {"body.weight": torch.tensor([[1.0, 2.0], [3.0, 3.5]]), "bn.running_mean": torch.zeros(2)}
    obj = FedProx(mu=0.5)
    obj.begin_round(m, glob)
    logits = const_logits([[0.0, 0.0, 0.0]])
    loss = obj.loss(m, torch.zeros(1, 2), torch.tensor([1]), logits)
    # CE = ln 3; prox = mu/2 * ||W - W_g||^2 = 0.25 * 0.5^2 = 0.0625
    assert loss.item() == pytest.approx(LN(3.0) + 0.0625, abs=F32_TOL)
    assert obj.last_terms["prox"].item() == pytest.approx(0.0625)
    loss.backward()
    # d prox / dW = mu (W - W_g) = 0.5 * [[0, 0], [0, 0.5]]
    torch.testing.assert_close(m.body.weight.grad, torch.tensor([[0.0, 0.0], [0.0, 0.25]]))
    assert m.classifier.weight.grad is None  # no global value for the private head: no term
    obj.end_round(m)
    with pytest.raises(ObjectiveError):
        FedProx(mu=-1)


# ---------------------------------------------------------------------------
# SCAFFOLD
# ---------------------------------------------------------------------------


def test_scaffold_corrects_gradients_and_updates_control_option_ii():
    m = Scalars(a=1.0, b=2.0)
    glob = {"a": torch.tensor([1.0])}  # b is not shared: untouched by SCAFFOLD
    obj = Scaffold()
    obj.load_state_dict({"c_i": {"a": torch.tensor([0.1])}})
    obj.begin_round(m, glob, payload={"control": {"a": torch.tensor([0.3])}})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for g in (0.5, 0.2):
        opt.zero_grad()
        m.a.grad = torch.tensor([g])
        obj.before_step(m, opt)
        # corrected gradient g - c_i + c = g + 0.2
        assert m.a.grad.item() == pytest.approx(g + 0.2)
        assert m.b.grad is None
        opt.step()
        obj.after_step(m, opt)
    # a: 1 - 0.1 * 0.7 = 0.93, then 0.93 - 0.1 * 0.4 = 0.89
    assert m.a.item() == pytest.approx(0.89)
    meta = obj.end_round(m)
    # c_i+ = c_i - c + (x - y)/(K eta) = 0.1 - 0.3 + (1 - 0.89)/(2 * 0.1) = -0.2 + 0.55 = 0.35
    # (= the mean raw gradient (0.5 + 0.2)/2, as option II intends); Delta c = 0.35 - 0.1 = 0.25
    assert obj.c_i["a"].item() == pytest.approx(0.35, abs=F32_TOL)
    assert meta[DELTA_C_KEY]["a"].item() == pytest.approx(0.25, abs=F32_TOL)
    assert set(meta[DELTA_C_KEY]) == {"a"}
    assert obj.steps == 2


@pytest.mark.parametrize("reference, payload_average, expected", [
    ("received", 0.8, 0.35),  # x is the model received: 0.1 - 0.3 + (1 - 0.89) / 0.2
    ("average", 0.8, -0.65),  # x is the server's average: 0.1 - 0.3 + (0.8 - 0.89) / 0.2
    ("average", None, 0.35),  # no average sent yet (round 1): the model received
])
def test_scaffold_displacement_reference_point(reference, payload_average, expected):
    m = Scalars(a=1.0, b=2.0)
    obj = Scaffold(control_variate="displacement", reference=reference)
    obj.load_state_dict({"c_i": {"a": torch.tensor([0.1])}})
    payload = {"control": {"a": torch.tensor([0.3])}}
    if payload_average is not None:
        payload["average"] = {"a": torch.tensor([payload_average])}
    obj.begin_round(m, {"a": torch.tensor([1.0])}, payload=payload)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for g in (0.5, 0.2):
        opt.zero_grad()
        m.a.grad = torch.tensor([g])
        obj.before_step(m, opt)
        opt.step()
        obj.after_step(m, opt)
    obj.end_round(m)
    assert obj.c_i["a"].item() == pytest.approx(expected, abs=1e-5)


def test_scaffold_reference_average_needs_displacement_and_a_whole_average():
    with pytest.raises(ObjectiveError, match="'average' applies to control_variate=displacement"):
        Scaffold(reference="average")
    with pytest.raises(ObjectiveError, match="choose|expected one of received, average"):
        Scaffold(control_variate="displacement", reference="sent")
    obj = Scaffold(control_variate="displacement", reference="average")
    with pytest.raises(ObjectiveError, match="server's average has no a"):
        obj.begin_round(Scalars(a=1.0), {"a": torch.tensor([1.0])}, payload={"average": {"b": torch.tensor([0.0])}})


def test_scaffold_uses_the_learning_rates_actually_used_and_corrects_unused_parameters():
    m = Scalars(a=1.0, b=2.0)
    glob = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}
    obj = Scaffold()  # c_i = 0
    obj.begin_round(m, glob, payload={"control": {"a": torch.tensor([0.0]), "b": torch.tensor([0.2])}})
    opt = torch.optim.SGD([{"params": [m.a], "lr": 0.1}, {"params": [m.b], "lr": 0.01}])
    for lr_a in (0.1, 0.05):
        opt.param_groups[0]["lr"] = lr_a
        opt.zero_grad(set_to_none=True)
        m.a.grad = torch.tensor([1.0])  # b gets no gradient from the "forward"
        obj.before_step(m, opt)
        opt.step()
        obj.after_step(m, opt)
    # a: 1 - 0.1 - 0.05 = 0.85; b moved by the correction only: 2 - 2 * 0.01 * 0.2 = 1.996
    assert m.a.item() == pytest.approx(0.85)
    assert m.b.item() == pytest.approx(1.996)
    meta = obj.end_round(m)
    # c_a+ = 0 - 0 + 0.15 / (0.1 + 0.05) = 1; c_b+ = 0 - 0.2 + 0.004 / (2 * 0.01) = 0
    assert obj.c_i["a"].item() == pytest.approx(1.0, abs=1e-5)
    assert obj.c_i["b"].item() == pytest.approx(0.0, abs=1e-5)
    assert meta[DELTA_C_KEY]["b"].item() == pytest.approx(0.0, abs=1e-5)


def _scaffold_round(control_variate, *, momentum, nesterov=False, weight_decay=0.0, steps=12):
    """One SCAFFOLD round on ``Tiny`` with random data, two lr groups and a mid-round lr change."""
    gen = torch.Generator().manual_seed(3)
    m = Tiny()
    glob = {k: v.clone() for k, v in m.state_dict().items()}
    obj = Scaffold(control_variate=control_variate)
    obj.load_state_dict({"c_i": {"body.weight": torch.randn(2, 2, generator=gen),
                                 "classifier.weight": torch.randn(3, 2, generator=gen)}})
    control = {"body.weight": torch.randn(2, 2, generator=gen), "classifier.weight": torch.randn(3, 2, generator=gen)}
    obj.begin_round(m, glob, payload={"control": control})
    opt = torch.optim.SGD([{"params": [m.body.weight], "lr": 0.02}, {"params": [m.classifier.weight], "lr": 0.05}],
                          momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    x = torch.randn(steps, 4, 2, generator=gen)
    y = torch.randint(0, 3, (steps, 4), generator=gen)
    for k in range(steps):
        if k == steps // 2:
            opt.param_groups[1]["lr"] = 0.01  # a schedule: option II's K eta_l is the sum of the rates used
        opt.zero_grad()
        F.cross_entropy(m(x[k]), y[k]).backward()
        obj.before_step(m, opt)
        opt.step()
        obj.after_step(m, opt)
    meta = obj.end_round(m)
    return obj.c_i, meta[DELTA_C_KEY]


def test_scaffold_control_variate_options_agree_under_plain_sgd():
    # (x - y)/(sum eta) = mean_eta(g_k + wd y_k) + c - c_i exactly under plain SGD, weight decay included
    for wd in (0.0, 0.01):
        mean_ci, mean_delta = _scaffold_round("gradient_mean", momentum=0.0, weight_decay=wd)
        disp_ci, disp_delta = _scaffold_round("displacement", momentum=0.0, weight_decay=wd)
        assert mean_ci.keys() == disp_ci.keys() == {"body.weight", "classifier.weight"}
        for name in mean_ci:
            torch.testing.assert_close(mean_ci[name], disp_ci[name], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(mean_delta[name], disp_delta[name], atol=2e-5, rtol=1e-4)
    # with momentum they part (the displacement option over-scales), the default is momentum-free
    mean_m, _ = _scaffold_round("gradient_mean", momentum=0.9, nesterov=True)
    disp_m, _ = _scaffold_round("displacement", momentum=0.9, nesterov=True)
    assert not torch.allclose(mean_m["body.weight"], disp_m["body.weight"], atol=1e-3)


@pytest.mark.parametrize("nesterov", [False, True])
def test_scaffold_gradient_mean_is_the_true_gradient_under_momentum(nesterov):
    """Constant gradient 0.5, 50 steps at lr 0.01: option II's value is 0.5; momentum 0.9 must not change it."""

    def run(control_variate, momentum):
        m = Scalars(a=1.0)
        obj = Scaffold(control_variate=control_variate)  # c = c_i = 0: no correction
        obj.begin_round(m, {"a": torch.tensor([1.0])})
        opt = torch.optim.SGD([m.a], lr=0.01, momentum=momentum, nesterov=nesterov and momentum > 0)
        for _ in range(50):
            opt.zero_grad()
            (0.5 * m.a).sum().backward()  # d/da = 0.5 at every point
            obj.before_step(m, opt)
            opt.step()
            obj.after_step(m, opt)
        obj.end_round(m)
        return obj.c_i["a"].item()

    assert run("gradient_mean", 0.0) == pytest.approx(0.5, abs=F32_TOL)
    assert run("displacement", 0.0) == pytest.approx(0.5, abs=1e-5)
    assert run("gradient_mean", 0.9) == pytest.approx(0.5, abs=F32_TOL)
    # the literal displacement formula: sum of momentum-amplified steps / (K eta); 4.105 (heavy ball), 4.194 (Nesterov)
    assert run("displacement", 0.9) == pytest.approx(4.194 if nesterov else 4.105, abs=2e-3)
    if not nesterov:  # FedNTD's divisor counts heavy-ball steps exactly
        assert run("adaptive_division", 0.9) == pytest.approx(0.5, abs=1e-4)


def test_scaffold_adaptive_division_is_the_official_momentum_weighted_gradient_mean():
    # FedNTD algorithms/scaffold/ClientTrainer.py:__get_divisor with adaptive_divison: true:
    # c_i+ = c_i - c + (x - y) / (new_K lr); under heavy-ball momentum that is sum_j w_j g_j / sum_j w_j
    # with w_j = (1 - mu^(K-j+1)) / (1 - mu), g_j the uncorrected gradients.
    gen = torch.Generator().manual_seed(5)
    m = Tiny()
    glob = {k: v.clone() for k, v in m.state_dict().items()}
    obj = Scaffold(control_variate="adaptive_division")
    c_i = {"body.weight": torch.randn(2, 2, generator=gen), "classifier.weight": torch.randn(3, 2, generator=gen)}
    control = {"body.weight": torch.randn(2, 2, generator=gen), "classifier.weight": torch.randn(3, 2, generator=gen)}
    obj.load_state_dict({"c_i": c_i})
    obj.begin_round(m, glob, payload={"control": control})
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    steps, grads = 20, []
    for k in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 2, generator=gen)
        F.cross_entropy(m(x), torch.randint(0, 3, (4,), generator=gen)).backward()
        grads.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})
        obj.before_step(m, opt)
        opt.step()
        obj.after_step(m, opt)
    obj.end_round(m)
    weights = [(1 - 0.9 ** (steps - j)) / (1 - 0.9) for j in range(steps)]  # j = 0 .. K-1
    assert sum(weights) == pytest.approx(heavy_ball_steps(steps, 0.9), rel=1e-12)
    assert weights[0] / weights[-1] > 8.7  # the first step weighs most
    for name in ("body.weight", "classifier.weight"):
        expected = sum(w * g[name] for w, g in zip(weights, grads)) / sum(weights)
        torch.testing.assert_close(obj.c_i[name], expected, atol=2e-5, rtol=1e-4)
    assert heavy_ball_steps(7, 0.0) == 7.0
    with pytest.raises(ValueError, match="momentum must satisfy 0 <= momentum < 1"):
        heavy_ball_steps(7, 1.0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fednova_ccvr_subtracts_the_clients_last_normalised_update(nesterov):
    # FedNTD algorithms/fednova: d_i = (x - y_i) / (lr a_i) after a round, the next round's
    # gradients g - d_i (weighted_d, never updated there, stays 0). A constant gradient 0.5
    # under momentum 0.9: d_i = 0.5 after round 1, so round 2's gradient is 0 and the model
    # stays put (d_i = 0 after it); round 3 trains as round 1 again. Under Nesterov momentum
    # ||a_i||_1 is the fednova hook's Nesterov norm (with the heavy-ball one, d_i was 0.533).
    m = Scalars(a=1.0)
    obj = build_objective("fednova_ccvr")
    moves, ds = [], []
    for r in range(3):
        start = float(m.a.detach())
        obj.begin_round(m, {"a": m.a.detach().clone()}, round_index=r)
        opt = torch.optim.SGD([m.a], lr=0.01, momentum=0.9, nesterov=nesterov)
        for _ in range(50):
            opt.zero_grad()
            (0.5 * m.a).sum().backward()
            obj.before_step(m, opt)
            opt.step()
            obj.after_step(m, opt)
        obj.end_round(m)
        moves.append(start - float(m.a.detach()))
        ds.append(float(roundtrip(obj.state_dict())["d_i"]["a"]))
    assert normalised_steps(50, 0.9, nesterov) == local_norm(50, 0.9, nesterov)
    assert moves[0] == pytest.approx(0.01 * 0.5 * normalised_steps(50, 0.9, nesterov), rel=1e-5)
    assert ds[0] == pytest.approx(0.5, abs=1e-5)
    assert moves[1] == pytest.approx(0.0, abs=1e-6) and ds[1] == pytest.approx(0.0, abs=1e-4)
    assert moves[2] == pytest.approx(moves[0], rel=1e-4) and ds[2] == pytest.approx(0.5, abs=1e-4)


def test_fednova_ccvr_needs_the_fednova_server_hook():
    from fedreid.config import ConfigError, load_config

    base = ["task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "train.objective=fednova_ccvr"]
    with pytest.raises(ConfigError, match=r"train.objective=fednova_ccvr is the client half of the 'fednova' "
                                          r"server hook; add fl.hooks=\[\{name: fednova\}\]"):
        load_config(None, base)
    assert load_config(None, base + ["fl.hooks=[{name: fednova}]"]).hook_specs()[0][0] == "fednova"


def test_scaffold_rejects_an_unknown_control_variate():
    with pytest.raises(ObjectiveError, match="control_variate"):
        Scaffold(control_variate="option_i")
    assert isinstance(build_objective("scaffold", control_variate="displacement"), Scaffold)


def test_scaffold_end_round_without_steps_raises():
    m = Scalars()
    obj = Scaffold()
    obj.begin_round(m, {"a": torch.tensor([1.0])})
    with pytest.raises(ObjectiveError, match="zero local steps"):
        obj.end_round(m)


def test_scaffold_server_updates():
    c = {"a": torch.tensor([0.3])}
    deltas = [{"a": torch.tensor([0.25])}, {"a": torch.tensor([-0.05])}]
    # c + |S|/N mean(Delta c) = 0.3 + 2/4 * 0.1 = 0.35
    assert scaffold_server_control_update(c, deltas, num_clients=4)["a"].item() == pytest.approx(0.35)
    # first round: c = 0 -> 0.05
    assert scaffold_server_control_update(None, deltas, num_clients=4)["a"].item() == pytest.approx(0.05)
    with pytest.raises(ObjectiveError):
        scaffold_server_control_update(c, deltas, num_clients=1)
    x = {"a": torch.tensor([1.0])}
    dys = [{"a": torch.tensor([-0.2])}, {"a": torch.tensor([-0.4])}]
    # x + eta_g mean(Delta y) = 1 - 0.3 (eta_g = 1), 1 - 0.15 (eta_g = 0.5)
    assert scaffold_server_model_update(x, dys)["a"].item() == pytest.approx(0.7)
    assert scaffold_server_model_update(x, dys, global_lr=0.5)["a"].item() == pytest.approx(0.85)
    # FedNTD's official size-weighted mean, client sizes 30 and 10: 1 + (0.75 * -0.2 + 0.25 * -0.4) = 0.75
    assert scaffold_server_model_update(x, dys, weights=[30, 10])["a"].item() == pytest.approx(0.75)
    with pytest.raises(ObjectiveError, match="scaffold server mean: 1 weights for 2 clients"):
        scaffold_server_model_update(x, dys, weights=[1.0])
    with pytest.raises(ObjectiveError, match="weights must be finite, non-negative and sum to > 0"):
        scaffold_server_model_update(x, dys, weights=[0.0, 0.0])


# ---------------------------------------------------------------------------
# FedDyn
# ---------------------------------------------------------------------------


def test_feddyn_loss_gradient_and_state_update():
    m = Tiny()  # W = [[1, 2], [3, 4]]
    glob = {"body.weight": torch.tensor([[1.0, 2.0], [3.0, 3.0]])}
    obj = FedDyn(alpha=0.1)
    obj.load_state_dict({"grad": {"body.weight": torch.tensor([[0.5, 0.0], [0.0, 0.0]])}})
    obj.begin_round(m, glob)
    loss = obj.loss(m, torch.zeros(1, 2), torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]))
    # linear = -<g, W> = -0.5 * 1 = -0.5; quadratic = alpha/2 ||W - W_g||^2 = 0.05 * 1 = 0.05
    assert obj.last_terms["linear"].item() == pytest.approx(-0.5)
    assert obj.last_terms["quadratic"].item() == pytest.approx(0.05)
    assert loss.item() == pytest.approx(LN(3.0) - 0.45, abs=F32_TOL)
    loss.backward()
    # d/dW = -g + alpha (W - W_g) = [[-0.5, 0], [0, 0.1]]
    torch.testing.assert_close(m.body.weight.grad, torch.tensor([[-0.5, 0.0], [0.0, 0.1]]))
    assert obj.end_round(m) == {}
    # g+ = g - alpha (W - W_g) = [[0.5, 0], [0, -0.1]]
    torch.testing.assert_close(obj.grad["body.weight"], torch.tensor([[0.5, 0.0], [0.0, -0.1]]))


def test_feddyn_first_round_state_is_zero_and_adaptive_alpha():
    m = Tiny()
    glob = {"body.weight": torch.tensor([[1.0, 2.0], [3.0, 3.0]])}
    # official adaptive alpha: weight n_k / mean(n) = 30 / 20 = 1.5 ... here use weight 2 -> alpha_k = 0.05
    assert feddyn_official_client_weight(30, [10, 30, 20]) == pytest.approx(1.5)
    obj = FedDyn(alpha=0.1, client_weight=2.0)
    obj.begin_round(m, glob)
    obj.loss(m, torch.zeros(1, 2), torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]))
    # g = 0: linear 0; quadratic = 0.05/2 * 1 = 0.025
    assert obj.last_terms["linear"].item() == 0.0
    assert obj.last_terms["quadratic"].item() == pytest.approx(0.025)
    obj.end_round(m)
    # g+ = 0 - 0.05 * (W - W_g) -> -0.05 at [1, 1]
    torch.testing.assert_close(obj.grad["body.weight"], torch.tensor([[0.0, 0.0], [0.0, -0.05]]))


def test_feddyn_server_update_matches_paper_and_official_form():
    prev = {"w": torch.tensor([1.0])}
    # round 1: clients 1 and 2 (of m = 4) return 1.2 and 1.6; alpha = 0.1; h^0 = 0
    theta, h = feddyn_server_update(prev, [{"w": torch.tensor([1.2])}, {"w": torch.tensor([1.6])}], None, 0.1, 4)
    # h = 0 - 0.1 * (1/4) * (0.2 + 0.6) = -0.02; theta = mean 1.4 - (-0.02)/0.1 = 1.6
    assert h["w"].item() == pytest.approx(-0.02)
    assert theta["w"].item() == pytest.approx(1.6)
    # official form: theta = mean_sel + mean_all(hist_k), hist = (0.2, 0.6, 0, 0) -> 1.4 + 0.2 = 1.6
    assert theta["w"].item() == pytest.approx(1.4 + (0.2 + 0.6) / 4)
    # round 2: client 1 alone returns 1.5 from theta = 1.6
    theta2, h2 = feddyn_server_update(theta, [{"w": torch.tensor([1.5])}], h, 0.1, 4)
    # h = -0.02 - 0.1 * (1/4) * (-0.1) = -0.0175; theta = 1.5 + 0.175 = 1.675
    assert h2["w"].item() == pytest.approx(-0.0175)
    assert theta2["w"].item() == pytest.approx(1.675)
    # official: hist_1 = 0.2 - 0.1 = 0.1, hist_2 = 0.6 -> 1.5 + 0.7/4 = 1.675
    assert theta2["w"].item() == pytest.approx(1.5 + (0.1 + 0.6) / 4)


def test_feddyn_server_update_with_size_weights_changes_the_mean_only():
    """FedNTD's feddyn/Server.py:_aggregation: theta = sum_k (n_k/n) theta_k - h/alpha, h as the paper."""
    prev = {"w": torch.tensor([1.0])}
    clients = [{"w": torch.tensor([1.2])}, {"w": torch.tensor([1.6])}]
    theta, h = feddyn_server_update(prev, clients, None, 0.1, 4, weights=[300, 100])
    # h = -0.02 as with the plain mean; theta = 0.75 * 1.2 + 0.25 * 1.6 + 0.2 = 1.5
    assert h["w"].item() == pytest.approx(-0.02)
    assert theta["w"].item() == pytest.approx(1.5)
    plain, _ = feddyn_server_update(prev, clients, None, 0.1, 4, weights=[1, 1])
    assert plain["w"].item() == pytest.approx(1.6)


# ---------------------------------------------------------------------------
# MOON
# ---------------------------------------------------------------------------


def test_moon_contrastive_loss_by_hand():
    z = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    zg = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    zp = torch.tensor([[0.0, 5.0], [1.0, -1.0]])
    # sample 0: cos(z, zg) = 6/(2*5) = 0.6, cos(z, zp) = 0; tau = 0.5
    #   -log(e^1.2 / (e^1.2 + e^0)) = log(1 + e^-1.2) = 0.263282
    # sample 1: cos = 1 and 0 -> log(1 + e^-2) = 0.126928
    expected = (LN(1 + math.exp(-1.2)) + LN(1 + math.exp(-2.0))) / 2
    assert moon_contrastive_loss(z, zg, [zp], 0.5).item() == pytest.approx(expected, abs=F32_TOL)
    # two negatives (the official model_buffer_size = 2): log(1 + 2 e^-2) for sample 1 with both negatives cos 0
    two = moon_contrastive_loss(z[1:], zg[1:], [zp[1:], zp[1:]], 0.5)
    assert two.item() == pytest.approx(LN(1 + 2 * math.exp(-2.0)), abs=F32_TOL)


def test_moon_objective_rounds():
    model = Tiny(body=((1.0, 0.0), (0.0, 1.0)))  # round 0 starts at the global body = I
    obj = Moon()  # mu = 5, tau = 0.5
    assert (obj.mu, obj.tau) == (5.0, 0.5)
    x = torch.tensor([[2.0, 0.0]])
    obj.begin_round(model, dict(model.state_dict()), round_index=0)
    feats = representation(model, x)
    loss = obj.loss(model, x, torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]), feats)
    # no previous model yet: the global model stands in -> l_con = -log(e^2/(e^2+e^2)) = log 2, zero gradient
    assert obj.last_terms["contrastive"].item() == pytest.approx(LN(2.0), abs=F32_TOL)
    assert loss.item() == pytest.approx(LN(3.0) + 5 * LN(2.0), abs=1e-5)
    loss.backward()
    assert model.body.weight.grad.abs().max().item() < 1e-6
    # "training" ends with body = swap matrix; that becomes the previous model
    with torch.no_grad():
        model.body.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    obj.end_round(model)
    # round 1: the global body is I again
    with torch.no_grad():
        model.body.weight.copy_(torch.eye(2))
    obj.begin_round(model, dict(model.state_dict()), round_index=1)
    loss = obj.loss(model, x, torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]), representation(model, x))
    # z = zg = [2, 0] (cos 1), z_prev = [0, 2] (cos 0): l_con = log(1 + e^-2) = 0.126928
    assert obj.last_terms["contrastive"].item() == pytest.approx(LN(1 + math.exp(-2.0)), abs=F32_TOL)
    assert loss.item() == pytest.approx(LN(3.0) + 5 * LN(1 + math.exp(-2.0)), abs=1e-5)
    # features computed inside when not passed: same value
    again = obj.loss(model, x, torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]))
    assert again.item() == pytest.approx(loss.item(), abs=F32_TOL)



def test_moon_first_previous_initial_contrasts_a_new_client_with_the_initial_model():
    """FedNTD's _init_prev_locals: a client yet to train takes the run's initial model as its previous one."""
    from fedreid.fl.local.moon import INITIAL_KEY

    model = Tiny(body=((1.0, 0.0), (0.0, 1.0)))  # the round's global body = I
    initial = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("body")}
    initial["body.weight"] = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # the run's initial body: the swap
    x = torch.tensor([[2.0, 0.0]])
    obj = Moon(first_previous="initial")
    with pytest.raises(ObjectiveError, match="sent no initial model"):
        obj.begin_round(model, dict(model.state_dict()), round_index=4)
    obj.begin_round(model, dict(model.state_dict()), round_index=4, payload={INITIAL_KEY: initial})
    obj.loss(model, x, torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]), representation(model, x))
    # z = zg = [2, 0], z_prev = swap @ x = [0, 2]: the term of a trained client, not log 2
    assert obj.last_terms["contrastive"].item() == pytest.approx(LN(1 + math.exp(-2.0)), abs=F32_TOL)
    obj.end_round(model)
    obj.begin_round(model, dict(model.state_dict()), round_index=5, payload={INITIAL_KEY: initial})
    obj.loss(model, x, torch.tensor([0]), const_logits([[0.0, 0.0, 0.0]]), representation(model, x))
    # once trained, its own previous model (here = the global) wins over the payload
    assert obj.last_terms["contrastive"].item() == pytest.approx(LN(2.0), abs=F32_TOL)
    with pytest.raises(ObjectiveError, match="first_previous"):
        Moon(first_previous="zero")

# ---------------------------------------------------------------------------
# FedNTD
# ---------------------------------------------------------------------------


def _official_ntd(logits, teacher, labels, tau):
    """The official refine_as_not_true + KLDivLoss(batchmean), as a cross-check."""
    c = logits.shape[1]
    pos = torch.arange(c).repeat(logits.shape[0], 1)
    pos = pos[pos != labels.view(-1, 1)].view(-1, c - 1)
    s = torch.gather(logits, 1, pos)
    t = torch.gather(teacher, 1, pos)
    return F.kl_div(F.log_softmax(s / tau, 1), F.softmax(t / tau, 1), reduction="batchmean")


def test_ntd_loss_by_hand():
    logits = torch.tensor([[0.0, LN(2.0), LN(3.0)]])
    teacher = torch.tensor([[5.0, 0.0, LN(3.0)]])
    labels = torch.tensor([0])
    # not-true (classes 1, 2): student q = [2, 3]/5, teacher p = [1, 3]/4
    # KL(p||q) = 0.25 ln(0.25/0.4) + 0.75 ln(0.75/0.6) = -0.117501 + 0.167358 = 0.049857
    kl = 0.25 * LN(0.25 / 0.4) + 0.75 * LN(0.75 / 0.6)
    assert ntd_loss(logits, teacher, labels).item() == pytest.approx(kl, abs=F32_TOL)
    # tau = 2: q ∝ [sqrt2, sqrt3], p ∝ [1, sqrt3]
    s2, s3 = math.sqrt(2), math.sqrt(3)
    q = [s2 / (s2 + s3), s3 / (s2 + s3)]
    p = [1 / (1 + s3), s3 / (1 + s3)]
    kl2 = sum(pi * LN(pi / qi) for pi, qi in zip(p, q))
    assert ntd_loss(logits, teacher, labels, 2.0).item() == pytest.approx(kl2, abs=F32_TOL)
    assert ntd_loss(logits, teacher, labels, 2.0, tau_sq=True).item() == pytest.approx(4 * kl2, abs=F32_TOL)
    g = torch.Generator().manual_seed(1)
    zs, zt, y = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)
    torch.testing.assert_close(ntd_loss(zs, zt, y, 1.5), _official_ntd(zs, zt, y, 1.5))


def test_fedntd_teacher_is_the_frozen_received_model():
    model = Tiny()
    obj = FedNTD()  # tau = 1, beta = 1
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 2])
    obj.begin_round(model, dict(model.state_dict()))
    teacher_logits = model(x).detach()
    with torch.no_grad():  # local training changes the model; the teacher must not follow
        model.body.weight.mul_(2.0)
    logits = model(x)
    loss = obj.loss(model, x, y, logits)
    expected = F.cross_entropy(logits, y) + ntd_loss(logits, teacher_logits, y)
    assert loss.item() == pytest.approx(expected.item(), abs=F32_TOL)
    obj.end_round(model)


# ---------------------------------------------------------------------------
# FedLMD / FedLMD-Tf
# ---------------------------------------------------------------------------


def test_majority_labels_are_counts_at_least_n_over_c():
    # n = 16, C = 4, n/C = 4: 10 >= 4, 5 >= 4 -> {0, 1}
    assert majority_labels([10, 5, 1, 0]).tolist() == [True, True, False, False]
    # Sec. 4.2's ">=" (default) and the official strict ">" differ only at exactly the mean
    assert majority_labels([4, 4, 4, 4]).tolist() == [True] * 4
    assert majority_labels([4, 4, 4, 4], "above_mean").tolist() == [False] * 4
    assert majority_labels([5, 3, 4, 4]).tolist() == [True, False, True, True]
    assert majority_labels([5, 3, 4, 4], "above_mean").tolist() == [True, False, False, False]
    # n = 4, C = 3, n/C = 1.33: only 2 >= 1.33, by either rule
    for rule in ("at_least_mean", "above_mean"):
        assert majority_labels([2, 1, 1], rule).tolist() == [True, False, False]
    with pytest.raises(ObjectiveError):
        majority_labels([3])
    with pytest.raises(ObjectiveError, match="majority"):
        majority_labels([2, 1, 1], "median")


def test_lmd_masks_teacher_majority_and_true_student_true_only():
    majority = majority_labels([10, 5, 1, 0])  # {0, 1}
    labels = torch.tensor([2, 0])
    # teacher keeps C \ (M U {y}): label 2 -> {3}; label 0 -> {2, 3}
    assert teacher_support(labels, majority).tolist() == [[False, False, False, True], [False, False, True, True]]
    student = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, LN(2.0), LN(3.0), LN(4.0)]], requires_grad=True)
    teacher = torch.tensor([[7.0, 1.0, -2.0, 0.5], [0.0, 0.0, 0.0, LN(3.0)]])
    # sample 0: p = [0, 0, 0, 1]; q over {0, 1, 3} = 1/3 each -> KL = ln 3
    # sample 1: p = [0, 0, 1/4, 3/4]; q over {1, 2, 3} = [2, 3, 4]/9 -> q2 = 1/3, q3 = 4/9
    #   KL = 0.25 ln(0.25 / (1/3)) + 0.75 ln(0.75 / (4/9)) = -0.071921 + 0.392436 = 0.320515
    k0 = LN(3.0)
    k1 = 0.25 * LN(0.75) + 0.75 * LN(27 / 16)
    loss = lmd_loss(student, teacher, labels, majority)
    assert loss.item() == pytest.approx((k0 + k1) / 2, abs=F32_TOL)
    # the official -1000 masking gives the same number here
    official = lmd_loss(student, teacher, labels, majority, mask="official")
    assert official.item() == pytest.approx((k0 + k1) / 2, abs=1e-5)
    # the student's true-class logit gets no gradient from the KD term
    loss.backward()
    assert student.grad[0, 2].item() == 0.0 and student.grad[1, 0].item() == 0.0
    assert torch.isfinite(student.grad).all()


def test_lmd_sample_without_minority_labels_has_zero_kd():
    majority = majority_labels([5, 5, 0])  # n/C = 3.33: {0, 1}; label 2 leaves the teacher nothing
    student = torch.tensor([[1.0, -1.0, 0.5]], requires_grad=True)
    teacher = torch.tensor([[0.3, 0.2, 0.1]])
    loss = lmd_loss(student, teacher, torch.tensor([2]), majority)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(student.grad, torch.zeros_like(student))
    # the official masking instead distils a distribution over masked labels (documented defect)
    assert lmd_loss(student, teacher, torch.tensor([2]), majority, mask="official").item() > 0


def test_tf_target_paper_is_a_distribution_for_every_batch_size():
    g = torch.Generator().manual_seed(3)
    for counts in ([10, 5, 1, 0], [4, 4, 4, 4], [9, 1, 1, 1, 0, 0]):
        majority = majority_labels(counts)
        c = len(counts)
        for b in range(1, 13):
            labels = torch.randint(0, c, (b,), generator=g)
            t = tf_target(labels, majority)
            keep = teacher_support(labels, majority)
            assert (t >= 0).all()
            sums = t.sum(1)
            nonempty = keep.any(1)
            torch.testing.assert_close(sums[nonempty], torch.ones(int(nonempty.sum())))
            assert (sums[~nonempty] == 0).all()
            # uniform on the admissible labels, 0 on majority and true labels
            assert ((t > 0) == keep).all()
    majority = majority_labels([10, 5, 1, 0])
    # label 2 -> uniform on {3}; label 0 -> on {2, 3}; label 3 -> on {2}
    torch.testing.assert_close(
        tf_target(torch.tensor([2, 0, 3]), majority),
        torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 1.0, 0.0]]),
    )


def test_tf_target_official_formula_and_its_defect():
    majority = majority_labels([10, 5, 1, 0])  # C = 4
    # B = 2: 1/(C - B - 1) = 1 on admissible entries; the label-0 row sums to 2 (not a distribution)
    t2 = tf_target(torch.tensor([2, 0]), majority, variant="official")
    torch.testing.assert_close(t2, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))
    # B = 4 >= C: 1/(4 - 4 - 1) = -1: negative "probabilities"
    t4 = tf_target(torch.tensor([2, 0, 3, 2]), majority, variant="official")
    assert t4.min().item() == -1.0
    # B = 3 = C - 1: division by zero -> inf
    assert torch.isinf(tf_target(torch.tensor([2, 0, 3]), majority, variant="official")).any()


def test_lmd_tf_loss_by_hand_and_official_collapse():
    majority = majority_labels([10, 5, 1, 0])
    logits = torch.tensor([[0.0, LN(2.0), LN(3.0), LN(4.0)]])
    # label 2: target on {3}; student over {0, 1, 3} = [1, 2, 4]/7 -> KL = -ln(4/7) = ln(7/4) = 0.559616
    assert lmd_tf_loss(logits, torch.tensor([2]), majority).item() == pytest.approx(LN(7 / 4), abs=F32_TOL)
    # official target with B >= C: every admissible entry is negative, which the old kl_div zeroed:
    # the KD term is exactly 0 (FedLMD-Tf trains as FedAvg), and finite
    g = torch.Generator().manual_seed(4)
    z = torch.randn(6, 4, generator=g)
    y = torch.tensor([2, 0, 3, 2, 1, 0])
    off = lmd_tf_loss(z, y, majority, target="official")
    assert off.item() == 0.0
    assert lmd_tf_loss(z, y, majority).item() > 0


def test_lmd_switch_round_and_teacher_construction():
    assert lmd_uses_teacher(5, teacher_free=False, switch_round=None)
    assert not lmd_uses_teacher(100, teacher_free=True, switch_round=None)
    assert [lmd_uses_teacher(r, teacher_free=True, switch_round=2) for r in range(4)] == [False, False, True, True]
    with pytest.raises(ObjectiveError, match="teacher-free"):
        FedLMD([3, 1, 0], switch_round=2)
    model = Tiny()
    obj = FedLMDTf([10, 1, 1], switch_round=2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([1, 2])
    majority = majority_labels([10, 1, 1])  # n/C = 4: {0}
    for r, teacher in ((0, False), (1, False), (2, True)):
        obj.begin_round(model, dict(model.state_dict()), round_index=r)
        assert (obj._teacher is not None) == teacher
        logits = model(x)
        loss = obj.loss(model, x, y, logits)
        if teacher:
            expected = F.cross_entropy(logits, y) + lmd_loss(logits, model(x).detach(), y, majority)
        else:
            expected = F.cross_entropy(logits, y) + lmd_tf_loss(logits, y, majority)
        assert loss.item() == pytest.approx(expected.item(), abs=F32_TOL)
        obj.end_round(model)


# ---------------------------------------------------------------------------
# state, registry, a short loop
# ---------------------------------------------------------------------------


def test_state_dict_roundtrip():
    m = Tiny()
    glob = {"body.weight": torch.tensor([[1.0, 2.0], [3.0, 3.0]])}
    dyn = FedDyn(alpha=0.1)
    dyn.begin_round(m, glob)
    dyn.end_round(m)
    sc = Scaffold()
    sc.load_state_dict({"c_i": {"body.weight": torch.full((2, 2), 0.5)}})
    moon = Moon()
    moon.begin_round(m, dict(m.state_dict()))
    moon.end_round(m)
    for obj, cls in ((dyn, FedDyn), (sc, Scaffold), (moon, Moon), (FedAvg(), FedAvg)):
        saved = roundtrip(obj.state_dict())
        twin = cls()
        twin.load_state_dict(saved)
        again = twin.state_dict()
        assert saved.keys() == again.keys()
        for key in saved:
            if saved[key] is None or isinstance(saved[key], dict) and not saved[key]:
                assert again[key] == saved[key]
                continue
            assert saved[key].keys() == again[key].keys()
            for name in saved[key]:
                assert torch.equal(saved[key][name], again[key][name])
    torch.testing.assert_close(roundtrip(dyn.state_dict())["grad"]["body.weight"], torch.tensor([[0.0, 0.0], [0.0, -0.1]]))
    with pytest.raises(ObjectiveError, match="unknown state keys"):
        Scaffold().load_state_dict({"c": {}})
    with pytest.raises(ObjectiveError):
        FedAvg().load_state_dict({"x": 1})


def test_registry_builds_every_method():
    assert {"fedavg", "fedprox", "scaffold", "feddyn", "moon", "fedntd", "fedlmd", "fedlmd_tf"} <= set(OBJECTIVES)
    assert isinstance(build_objective("fedprox", mu=0.1), FedProx)
    assert isinstance(build_objective("fedlmd_tf", class_counts=[3, 1, 0]), FedLMDTf)
    with pytest.raises(ObjectiveError, match="unknown client objective"):
        build_objective("fedsgd")
    with pytest.raises(ObjectiveError, match="fedprox"):
        build_objective("fedprox", alpha=1.0)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_documented_training_loop_runs_every_objective(name, device):
    gen = torch.Generator().manual_seed(7)
    model = Tiny().to(device)
    options = {"class_counts": [6, 1, 1]} if OBJECTIVES[name].needs_class_counts else {}
    obj = build_objective(name, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for r in range(2):
        glob = OrderedDict((k, v.clone()) for k, v in model.state_dict().items() if k.startswith("body."))
        obj.begin_round(model, glob, round_index=r, payload={"control": {}})
        seen = []
        for _ in range(3):
            images = torch.randn(4, 2, generator=gen).to(device)
            labels = torch.randint(0, 3, (4,), generator=gen).to(device)
            seen.append((images, labels))
            features = representation(model, images) if obj.needs_features else None
            logits = model.classifier(features) if features is not None else model(images)
            loss = obj.loss(model, images, labels, logits, features)
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            obj.before_step(model, opt)
            opt.step()
            obj.after_step(model, opt)
        if obj.wants_training_pass:  # a fresh pass over the training data (FedCurv's official Fisher)
            meta = obj.end_round(model, training_batches=lambda: iter(seen))
        else:
            meta = obj.end_round(model)
        assert obj.steps == 3
        assert isinstance(meta, dict)
        for value in meta.values():  # tensors that travel in an Update are on CPU
            for t in value.values():
                assert t.device.type == "cpu"
        roundtrip(obj.state_dict())
