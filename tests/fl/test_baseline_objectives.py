"""FedRS and FedCurv (fedreid.fl.local.fedrs / .fedcurv, fedreid.fl.server_hooks.fedcurv).

Every value is checked against arithmetic written out here (restricted
cross-entropy, the quadratic penalty summed over the other clients, the
squared cross-entropy gradients of a linear softmax model), then both methods
run on scikit-learn's digits, FedCurv with a bit-exact resume.
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

from fedreid.config import ConfigError, load_config
from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, ObjectiveError
from fedreid.fl.local.fedcurv import (
    CONTRIBUTION_KEYS,
    FISHER_KEY,
    FISHER_THETA_KEY,
    FISHER_THETA_SQ_KEY,
    U_KEY,
    V_KEY,
    W_KEY,
    FedCurv,
    batches_past,
    contribution_sums,
    diagonal_fisher,
    fedcurv_penalty,
)
from fedreid.fl.local.fedrs import FedRS, restricted_cross_entropy, restricted_scale
from fedreid.fl.local.objectives import OBJECTIVES, build_objective
from fedreid.fl.server_hooks import SERVER_HOOKS
from fedreid.fl.server_hooks.fedcurv import FedCurvHook
from fedreid.fl.simulation import resume, run_simulation
from fedreid.fl.update import Update
from fedreid.utils.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E = math.exp
LN = math.log


class Linear(nn.Module):
    """``features(x) = x`` (2-d), ``logits = classifier(x)`` (2 -> 3, with bias): a linear softmax model."""

    def __init__(self, weight=((1.0, -1.0), (0.5, 2.0), (-1.0, 0.0)), bias=(0.1, -0.2, 0.3)) -> None:
        super().__init__()
        self.classifier = nn.Linear(2, 3)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.tensor(weight))
            self.classifier.bias.copy_(torch.tensor(bias))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Params(nn.Module):
    """Two parameters, ``a`` (3 entries) and ``b`` (2 x 1), for the penalty arithmetic."""

    def __init__(self, a=(1.0, -2.0, 0.5), b=((3.0,), (0.0,))) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def shared(model):
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------
# FedRS
# ---------------------------------------------------------------------------


def test_fedrs_loss_is_the_restricted_cross_entropy_by_hand():
    # 4 classes, the client holds classes 0 and 2: s = (1, alpha, 1, alpha) with alpha = 0.5
    obj = FedRS([5, 0, 3, 0], alpha=0.5)
    assert obj.scale.tolist() == [1.0, 0.5, 1.0, 0.5]
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.5, 1.0, 2.0, 3.0]], requires_grad=True)
    labels = torch.tensor([0, 2])
    obj.begin_round(Linear(), {})
    loss = obj.loss(Linear(), torch.zeros(2, 2), labels, logits)
    # scaled logits: (1, 1, 0, -0.5) and (0.5, 0.5, 2, 1.5)
    ce1 = -1.0 + LN(E(1.0) + E(1.0) + E(0.0) + E(-0.5))
    ce2 = -2.0 + LN(E(0.5) + E(0.5) + E(2.0) + E(1.5))
    assert loss.item() == pytest.approx((ce1 + ce2) / 2, abs=F32_TOL)
    assert obj.last_terms["ce"].item() == pytest.approx((ce1 + ce2) / 2, abs=F32_TOL)
    # d loss / d z_c = s_c (p_c - 1[y = c]) / B, p = softmax of the scaled logits
    loss.backward()
    rows = [(1.0, 1.0, 0.0, -0.5), (0.5, 0.5, 2.0, 1.5)]
    for i, (row, y) in enumerate(zip(rows, (0, 2))):
        z = sum(E(v) for v in row)
        expected = [s * (E(v) / z - (c == y)) / 2 for c, (s, v) in enumerate(zip((1, 0.5, 1, 0.5), row))]
        assert logits.grad[i].tolist() == pytest.approx(expected, abs=F32_TOL)


def test_fedrs_alpha_one_or_all_classes_present_is_plain_cross_entropy():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, generator=gen)
    labels = torch.tensor([0, 2, 2, 0, 0])
    plain = F.cross_entropy(logits, labels)
    assert torch.equal(restricted_cross_entropy(logits, labels, restricted_scale([5, 0, 3, 0], 1.0)), plain)
    assert torch.equal(restricted_cross_entropy(logits, labels, restricted_scale([1, 1, 1, 1], 0.1)), plain)


def test_fedrs_gradient_reaching_missing_class_weights_is_alpha_times_as_large():
    # o = s * (W h + b): dL/dW_c = s_c * (1/B) sum_i (p_ic - y_ic) h_i, dL/db_c = s_c * (1/B) sum_i (p_ic - y_ic)
    model = Linear()
    obj = FedRS([4, 0, 2], alpha=0.25)  # class 1 missing
    h = torch.tensor([[1.0, 2.0], [-1.0, 0.5]])
    labels = torch.tensor([0, 2])
    obj.begin_round(model, shared(model))
    loss = obj.loss(model, h, labels, model(h))
    loss.backward()
    s = torch.tensor([1.0, 0.25, 1.0])
    with torch.no_grad():
        z = h @ model.classifier.weight.T + model.classifier.bias
        p = torch.softmax(z * s, dim=1)
        err = (p - F.one_hot(labels, 3)) * s / 2  # [B, C]
        grad_w = err.T @ h
        grad_b = err.sum(0)
    torch.testing.assert_close(model.classifier.weight.grad, grad_w)
    torch.testing.assert_close(model.classifier.bias.grad, grad_b)
    # the missing class's row is alpha times the unscaled (p - y) h of the same softmax
    unscaled = ((p - F.one_hot(labels, 3)) / 2).T @ h
    torch.testing.assert_close(model.classifier.weight.grad[1], 0.25 * unscaled[1])
    torch.testing.assert_close(model.classifier.weight.grad[0], unscaled[0])


def test_fedrs_official_scale_and_errors():
    # alpha + (1 - alpha) n_c / max n, counts (4, 0, 2, 1), alpha 0.5: 0.5 + 0.5 * (1, 0, 0.5, 0.25)
    assert restricted_scale([4, 0, 2, 1], 0.5, scale="official").tolist() == [1.0, 0.5, 0.75, 0.625]
    assert restricted_scale([4, 0, 2, 1], 0.5).tolist() == [1.0, 0.5, 1.0, 1.0]
    assert isinstance(build_objective("fedrs", class_counts=[3, 0, 1], alpha=0.1), FedRS)
    with pytest.raises(ObjectiveError, match="needs the client's class counts"):
        build_objective("fedrs")
    with pytest.raises(ObjectiveError, match=r"alpha must be in \[0, 1\]"):
        FedRS([1, 0], alpha=1.5)
    with pytest.raises(ObjectiveError, match="all class counts are 0"):
        FedRS([0, 0])
    with pytest.raises(ObjectiveError, match="unknown fedrs scale"):
        FedRS([1, 0], scale="soft")
    obj = FedRS([1, 0, 2])
    obj.begin_round(Linear(), {})
    with pytest.raises(ObjectiveError, match="for 3 class counts"):
        obj.loss(Linear(), torch.zeros(1, 2), torch.tensor([0]), torch.zeros(1, 4))
    assert obj.state_dict() == {} and OBJECTIVES["fedrs"].needs_class_counts


def test_fedrs_runs_the_documented_training_loop():
    gen = torch.Generator().manual_seed(7)
    model = Linear()
    obj = build_objective("fedrs", class_counts=[6, 0, 1], alpha=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bias_before = model.classifier.bias.detach().clone()
    for r in range(2):
        obj.begin_round(model, shared(model), round_index=r)
        for _ in range(3):
            x = torch.randn(4, 2, generator=gen)
            y = torch.tensor([0, 2, 0, 0])
            loss = obj.loss(model, x, y, model(x))
            opt.zero_grad()
            loss.backward()
            obj.before_step(model, opt)
            opt.step()
            obj.after_step(model, opt)
        assert obj.end_round(model) == {} and obj.steps == 3
    assert model.classifier.bias[1] < bias_before[1]  # the missing class is still pushed down, only less
    assert roundtrip(obj.state_dict()) == {}


# ---------------------------------------------------------------------------
# FedCurv: the penalty
# ---------------------------------------------------------------------------

#: Contributions (F_j, theta_j) of the client itself ("own") and two others, for Params.
FISHERS = {
    "own": ({"a": [0.5, 0.5, 0.5], "b": [[1.0], [1.0]]}, {"a": [9.0, 9.0, 9.0], "b": [[9.0], [9.0]]}),
    "j1": ({"a": [1.0, 0.0, 2.0], "b": [[0.5], [3.0]]}, {"a": [0.0, -1.0, 1.0], "b": [[2.0], [1.0]]}),
    "j2": ({"a": [0.25, 4.0, 0.0], "b": [[0.0], [2.0]]}, {"a": [2.0, -2.0, 0.0], "b": [[1.0], [-1.0]]}),
}


def contribution(fisher, theta):
    f = OrderedDict((n, torch.tensor(v)) for n, v in fisher.items())
    t = OrderedDict((n, torch.tensor(v)) for n, v in theta.items())
    return {FISHER_KEY: f, FISHER_THETA_KEY: OrderedDict((n, f[n] * t[n]) for n in f),
            FISHER_THETA_SQ_KEY: OrderedDict((n, (f[n] * t[n] * t[n]).sum()) for n in f)}


def direct_penalty(theta, others, lam):
    """``lam * sum_j sum_p F_{j,p} (theta_p - theta_{j,p})^2``, element by element in Python floats."""
    total = 0.0
    for fisher, theta_j in others:
        for name in ("a", "b"):
            for f, t, tj in zip(torch.tensor(fisher[name]).flatten().tolist(), theta[name].flatten().tolist(),
                                torch.tensor(theta_j[name]).flatten().tolist()):
                total += f * (t - tj) ** 2
    return lam * total


def own_state():
    c = contribution(*FISHERS["own"])
    return {"fisher": c[FISHER_KEY], "fisher_theta": c[FISHER_THETA_KEY], "fisher_theta_sq": c[FISHER_THETA_SQ_KEY]}


def test_fedcurv_penalty_is_the_sum_over_the_other_clients_and_its_gradient():
    lam = 0.3
    model = Params()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    sums = contribution_sums([contribution(*FISHERS[k]) for k in ("j1", "own", "j2")])
    obj = FedCurv(lam=lam)
    obj.load_state_dict(roundtrip(own_state()))  # what the client sent last time: the server sums include it
    obj.begin_round(model, shared(model), round_index=1, payload=sums)
    logits = torch.tensor([[0.0, 1.0]], requires_grad=True)
    loss = obj.loss(model, torch.zeros(1, 1), torch.tensor([1]), logits)
    ce = LN(1 + E(1.0)) - 1.0
    others = [FISHERS["j1"], FISHERS["j2"]]
    # e.g. a[0]: 1.0 * (1 - 0)^2 + 0.25 * (1 - 2)^2 = 1.25; the own (F, theta) is left out
    assert obj.last_terms["fedcurv"].item() == pytest.approx(direct_penalty(theta, others, lam), rel=F32_TOL)
    assert loss.item() == pytest.approx(ce + direct_penalty(theta, others, lam), rel=F32_TOL)
    loss.backward()
    # d/d theta: 2 lam sum_j F_j (theta - theta_j)
    for name, p in model.named_parameters():
        expected = sum(2 * lam * torch.tensor(f[name]) * (theta[name] - torch.tensor(t[name])) for f, t in others)
        torch.testing.assert_close(p.grad, expected)
    # and the same as autograd through the direct form
    twin = Params()
    direct = lam * sum((torch.tensor(f[n]) * (dict(twin.named_parameters())[n] - torch.tensor(t[n])) ** 2).sum()
                       for f, t in others for n in ("a", "b"))
    direct.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_fedcurv_penalty_function_and_a_client_without_own_contribution():
    model = Params()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    c = contribution_sums([contribution(*FISHERS["j1"])])
    value = fedcurv_penalty(dict(model.named_parameters()), c[U_KEY], c[V_KEY], c[W_KEY], 2.0)
    assert value.item() == pytest.approx(direct_penalty(theta, [FISHERS["j1"]], 2.0), rel=F32_TOL)
    # a first-time client subtracts nothing: it is penalised towards every contributor
    obj = FedCurv(lam=1.0)
    obj.begin_round(model, shared(model), payload=c)
    obj.loss(model, torch.zeros(1, 1), torch.tensor([0]), torch.zeros(1, 2, requires_grad=True))
    assert obj.last_terms["fedcurv"].item() == pytest.approx(direct_penalty(theta, [FISHERS["j1"]], 1.0), rel=F32_TOL)


def test_fedcurv_first_round_is_cross_entropy_and_only_shared_parameters_are_penalised():
    model = Params()
    obj = FedCurv(lam=5.0)
    obj.begin_round(model, shared(model), payload=None)  # round 0: the server has no sums yet
    logits = torch.tensor([[0.2, -0.3]], requires_grad=True)
    loss = obj.loss(model, torch.zeros(1, 1), torch.tensor([0]), logits)
    assert torch.equal(loss, F.cross_entropy(logits, torch.tensor([0])))
    assert "fedcurv" not in obj.last_terms
    # only "a" is in the global state: "b" gets no penalty even though the sums name it
    sums = contribution_sums([contribution(*FISHERS["j1"])])
    obj = FedCurv(lam=1.0)
    obj.begin_round(model, {"a": model.a.detach().clone()}, payload=sums)
    loss = obj.loss(model, torch.zeros(1, 1), torch.tensor([0]), logits)
    loss.backward()
    assert model.b.grad is None
    fisher, theta_j = FISHERS["j1"]
    # a = (1, -2, 0.5), F = (1, 0, 2), theta_j = (0, -1, 1): 1 * 1 + 0 + 2 * 0.25 = 1.5
    assert obj.last_terms["fedcurv"].item() == pytest.approx(1.5, rel=F32_TOL)


# ---------------------------------------------------------------------------
# FedCurv: the Fisher
# ---------------------------------------------------------------------------


def test_fedcurv_fisher_is_the_mean_squared_gradient_on_the_last_batches_at_the_final_model():
    # linear softmax: d CE_b / d W = (1/B) sum_i (p_i - y_i) x_i^T, d CE_b / d bias = (1/B) sum_i (p_i - y_i)
    gen = torch.Generator().manual_seed(0)
    model = Linear()
    obj = FedCurv(lam=0.0, fisher_estimate="last_batches", fisher_batches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    obj.begin_round(model, shared(model))
    batches = []
    for _ in range(3):
        x = torch.randn(4, 2, generator=gen)
        y = torch.randint(0, 3, (4,), generator=gen)
        batches.append((x, y))
        loss = obj.loss(model, x, y, model(x))
        opt.zero_grad()
        loss.backward()
        obj.before_step(model, opt)
        opt.step()
        obj.after_step(model, opt)
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    meta = obj.end_round(model)
    assert model.training  # the eval-mode pass restored the mode
    for n, p in model.named_parameters():  # and left .grad alone
        assert torch.equal(p.grad, grads_before[n])
    w, b = model.classifier.weight.detach(), model.classifier.bias.detach()
    fw, fb = torch.zeros_like(w), torch.zeros_like(b)
    for x, y in batches[1:]:  # the last fisher_batches = 2 batches, at the final parameters
        err = torch.softmax(x @ w.T + b, dim=1) - F.one_hot(y, 3)
        fw += (err.T @ x / 4) ** 2
        fb += (err.sum(0) / 4) ** 2
    torch.testing.assert_close(meta[FISHER_KEY]["classifier.weight"], fw / 2)
    torch.testing.assert_close(meta[FISHER_KEY]["classifier.bias"], fb / 2)
    torch.testing.assert_close(meta[FISHER_THETA_KEY]["classifier.weight"], fw / 2 * w)
    torch.testing.assert_close(meta[FISHER_THETA_SQ_KEY]["classifier.bias"], (fb / 2 * b * b).sum())
    assert all(t.device.type == "cpu" for key in CONTRIBUTION_KEYS for t in meta[key].values())
    # the client keeps what it sent, to subtract it next round
    state = roundtrip(obj.state_dict())
    assert torch.equal(state["fisher"]["classifier.weight"], meta[FISHER_KEY]["classifier.weight"])
    twin = FedCurv(fisher_estimate="last_batches")
    twin.load_state_dict(state)
    assert all(torch.equal(twin.state_dict()[k][n], state[k][n]) for k in state for n in state[k])
    with pytest.raises(ObjectiveError, match="unknown state keys"):
        FedCurv().load_state_dict({"c_i": {}})


def test_diagonal_fisher_matches_autograd_per_batch():
    gen = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    batches = [(torch.randn(5, 3, generator=gen), torch.randint(0, 2, (5,), generator=gen)) for _ in range(3)]
    params = OrderedDict(model.named_parameters())
    got = diagonal_fisher(model, params, batches)
    for name, p in params.items():
        squares = []
        for x, y in batches:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            squares.append(p.grad.detach() ** 2)
        torch.testing.assert_close(got[name], sum(squares) / 3)
    with pytest.raises(ObjectiveError, match="at least one batch"):
        diagonal_fisher(model, params, [])


class Normed(nn.Module):
    """``features = BatchNorm1d(Linear(x))``, ``logits = classifier(features)``: train and eval mode differ."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.body = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.classifier = nn.Linear(4, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
            self.norm.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0, 0.0]))
            self.norm.running_var.copy_(torch.tensor([2.0, 0.5, 1.0, 3.0]))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def test_batches_past_stops_once_more_than_the_samples_were_seen():
    batches = [(torch.zeros(4, 1), torch.zeros(4)) for _ in range(5)]
    assert len(list(batches_past(batches, 8))) == 3  # 4, 8 (not more than 8), 12: FedNTD's `> size`
    assert len(list(batches_past(batches, 7))) == 2
    assert len(list(batches_past(batches, 500))) == 5  # fewer images than asked: the whole pass


def test_fedcurv_official_fisher_is_a_train_mode_pass_that_leaves_the_model_as_trained():
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 3, generator=gen), torch.randint(0, 2, (4,), generator=gen)) for _ in range(5)]
    model = Normed()
    obj = FedCurv(lam=0.0, fisher_samples=8)
    obj.begin_round(model, shared(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches[0]
    loss = obj.loss(model, x, y, model(x))
    opt.zero_grad()
    loss.backward()
    opt.step()
    trained = shared(model)
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    served = []

    def training_batches():
        for b in batches:
            served.append(b)
            yield b

    meta = obj.end_round(model, training_batches=training_batches)
    assert len(served) == 3  # 12 > 8 images after the third batch: the pass stops there
    assert model.training and all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads_before[n]) for n, p in model.named_parameters())
    # the oracle: each batch's squared CE gradient in train mode (batch statistics), on a copy
    oracle, eval_mode = Normed(), Normed()
    oracle.load_state_dict(trained)
    eval_mode.load_state_dict(trained)
    oracle.train()
    eval_mode.eval()
    for name in ("body.weight", "norm.weight", "classifier.bias"):
        squares, eval_squares = [], []
        for net, out in ((oracle, squares), (eval_mode, eval_squares)):
            for x, y in batches[:3]:
                net.zero_grad()
                F.cross_entropy(net(x), y).backward()
                out.append(dict(net.named_parameters())[name].grad.detach() ** 2)
        torch.testing.assert_close(meta[FISHER_KEY][name], sum(squares) / 3)
        assert not torch.allclose(meta[FISHER_KEY][name], sum(eval_squares) / 3)  # not the eval-mode estimate


def test_fedcurv_end_round_needs_its_batches_and_options_are_checked():
    obj = FedCurv(fisher_estimate="last_batches")
    obj.begin_round(Params(), shared(Params()))
    with pytest.raises(ObjectiveError, match="no training batch"):
        obj.end_round(Params())
    official = FedCurv()
    assert official.wants_training_pass and not obj.wants_training_pass
    official.begin_round(Params(), shared(Params()))
    with pytest.raises(ObjectiveError, match="fisher_estimate=official needs the client's training_batches"):
        official.end_round(Params())
    with pytest.raises(ObjectiveError, match="lam must be >= 0"):
        FedCurv(lam=-1.0)
    with pytest.raises(ObjectiveError, match="fisher_batches must be >= 1"):
        FedCurv(fisher_estimate="last_batches", fisher_batches=0)
    with pytest.raises(ObjectiveError, match="fisher_samples must be >= 1"):
        FedCurv(fisher_samples=0)
    with pytest.raises(ObjectiveError, match="fisher_batches applies to fisher_estimate=last_batches only"):
        FedCurv(fisher_batches=3)
    with pytest.raises(ObjectiveError, match="unknown fedcurv fisher_estimate 'eval'"):
        FedCurv(fisher_estimate="eval")
    bad = contribution_sums([contribution(*FISHERS["j1"])])
    bad[U_KEY]["a"] = torch.zeros(4)
    with pytest.raises(ObjectiveError, match="has shape"):
        FedCurv().begin_round(Params(), shared(Params()), payload=bad)


# ---------------------------------------------------------------------------
# FedCurv: the server hook
# ---------------------------------------------------------------------------


def update(client, key):
    return Update(client, {}, 1, dict(contribution(*FISHERS[key])), head_shared=True)


def test_fedcurv_hook_sums_broadcasts_replaces_and_round_trips():
    assert SERVER_HOOKS["fedcurv"] is FedCurvHook and OBJECTIVES["fedcurv"].server_hook == "fedcurv"
    model = Params()
    hook = FedCurvHook()
    hook.begin_round(0, shared(model))
    assert hook.instructions(0) == {}  # nothing to send before a contribution
    assert hook.required_metadata(0) == CONTRIBUTION_KEYS
    ups = [update("c1", "j1"), update("c0", "j2")]
    assert all(hook.check_update(0, u, model) is None for u in ups)
    stats = hook.after_aggregate(0, model, ups)
    assert stats["clients_held"] == 2
    hook.begin_round(1, shared(model))
    sent = hook.instructions(1)[OBJECTIVE_PAYLOAD]
    (f1, t1), (f2, t2) = FISHERS["j1"], FISHERS["j2"]
    for n in ("a", "b"):
        torch.testing.assert_close(sent[U_KEY][n], torch.tensor(f1[n]) + torch.tensor(f2[n]))
        torch.testing.assert_close(sent[V_KEY][n], torch.tensor(f1[n]) * torch.tensor(t1[n])
                                   + torch.tensor(f2[n]) * torch.tensor(t2[n]))
        torch.testing.assert_close(sent[W_KEY][n], (torch.tensor(f1[n]) * torch.tensor(t1[n]) ** 2).sum()
                                   + (torch.tensor(f2[n]) * torch.tensor(t2[n]) ** 2).sum())
    # c1 contributes again: its new terms replace the old ones
    hook.after_aggregate(1, model, [update("c1", "own")])
    hook.begin_round(2, shared(model))
    sent = hook.instructions(2)[OBJECTIVE_PAYLOAD]
    torch.testing.assert_close(sent[U_KEY]["a"], torch.tensor(FISHERS["own"][0]["a"]) + torch.tensor(f2["a"]))
    # state round trip: a fresh hook sends the same sums
    twin = FedCurvHook()
    twin.load_state_dict(roundtrip(hook.state_dict()))
    twin.begin_round(2, shared(model))
    again = twin.instructions(2)[OBJECTIVE_PAYLOAD]
    assert all(torch.equal(again[k][n], sent[k][n]) for k in sent for n in sent[k])
    with pytest.raises(ValueError, match="unknown state keys"):
        FedCurvHook().load_state_dict({"control": {}})


def test_fedcurv_official_sums_lack_the_terms_of_the_clients_served_before():
    """FedNTD's ``Pt = Ut; Pt -= u_k``: the running sums a client gets lack its predecessors' stored terms."""
    model = Params()
    hooks = {mode: FedCurvHook(penalty_sums=mode) for mode in ("paper", "official")}
    for hook in hooks.values():
        hook.begin_round(0, shared(model))
        hook.after_aggregate(0, model, [update("c1", "j1"), update("c0", "j2")])
        hook.begin_round(1, shared(model))
    order = ["c1", "new", "c0", "late"]  # "new" and "late" have sent nothing yet
    assert hooks["paper"].client_instructions(1, order) == {}  # the paper: everyone gets the full sums
    per_client = hooks["official"].client_instructions(1, order)
    full = hooks["official"].instructions(1)[OBJECTIVE_PAYLOAD]
    assert "c1" not in per_client  # the first served gets the full sums
    f1, t1 = FISHERS["j1"]
    for n in ("a", "b"):
        for name in ("new", "c0"):  # after c1: the sums less c1's terms
            sums = per_client[name][OBJECTIVE_PAYLOAD]
            torch.testing.assert_close(sums[U_KEY][n], full[U_KEY][n] - torch.tensor(f1[n]))
            torch.testing.assert_close(sums[V_KEY][n], full[V_KEY][n] - torch.tensor(f1[n]) * torch.tensor(t1[n]))
            torch.testing.assert_close(sums[W_KEY][n], full[W_KEY][n] - (torch.tensor(f1[n]) * torch.tensor(t1[n]) ** 2).sum())
        late = per_client["late"][OBJECTIVE_PAYLOAD]  # after c1 and c0: nothing left
        torch.testing.assert_close(late[U_KEY][n], torch.zeros_like(full[U_KEY][n]), atol=1e-6, rtol=0)
    # c0 then subtracts its own, as the reference's Pt -= u_k: its penalty covers nobody
    c0_sent = contribution(*FISHERS["j2"])
    obj = FedCurv(lam=1.0, penalty_sums="official")
    obj.load_state_dict(roundtrip({"fisher": c0_sent[FISHER_KEY], "fisher_theta": c0_sent[FISHER_THETA_KEY],
                                   "fisher_theta_sq": c0_sent[FISHER_THETA_SQ_KEY]}))
    obj.begin_round(model, shared(model), round_index=1, payload=per_client["c0"][OBJECTIVE_PAYLOAD])
    obj.loss(model, torch.zeros(1, 1), torch.tensor([0]), torch.zeros(1, 2, requires_grad=True))
    assert abs(obj.last_terms["fedcurv"].item()) <= 1e-5
    with pytest.raises(ValueError, match="penalty_sums must be one of paper, official"):
        FedCurvHook(penalty_sums="in_place")


def test_fedcurv_hook_rejects_unusable_contributions():
    model = Params()
    hook = FedCurvHook()
    hook.begin_round(0, shared(model))
    u = update("c", "j1")
    u.metadata[FISHER_KEY]["a"] = torch.zeros(2)
    assert "expected (3,)" in hook.check_update(0, u, model)
    u = update("c", "j1")
    u.metadata[FISHER_KEY]["b"] = -torch.ones(2, 1)
    assert "negative" in hook.check_update(0, u, model)
    u = update("c", "j1")
    del u.metadata[FISHER_THETA_KEY]["a"]
    assert "no tensor for a" in hook.check_update(0, u, model)
    u = update("c", "j1")
    u.metadata[FISHER_THETA_SQ_KEY] = [1.0]
    assert "not a dict" in hook.check_update(0, u, model)


# ---------------------------------------------------------------------------
# configs and a few rounds on scikit-learn's digits
# ---------------------------------------------------------------------------

BASE = [
    "task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "classification.num_clients=5",
    "classification.alpha=0.5", "train.batch_size=32", "train.drop_last=false", "train.local_epochs=1",
    "train.weight_decay=0", "train.nesterov=false", "fl.rounds=3", "eval.every=1", "run.device=cpu",
    "run.tensorboard=false",
]


class Kill(RuntimeError):
    pass


def cfg_with(*extra):
    return load_config(None, BASE + list(extra))


def without_time(history):
    return [{k: v for k, v in r.items() if k != "time"} for r in history]


def test_config_errors_name_the_option():
    with pytest.raises(ConfigError, match="train.objective_options.mu: not an option of 'fedrs'; allowed: alpha, scale"):
        cfg_with("train.objective=fedrs", "train.objective_options={mu: 1}")
    with pytest.raises(ConfigError, match="train.objective_options.alpha: not an option of 'fedcurv'"):
        cfg_with("train.objective=fedcurv", "train.objective_options={alpha: 1}")
    with pytest.raises(ConfigError, match=r"train.objective_options.alpha: must be in \[0, 1\]"):
        cfg_with("train.objective=fedrs", "train.objective_options={alpha: 2}")
    with pytest.raises(ConfigError, match="train.objective_options.fisher_batches: must be >= 1"):
        cfg_with("train.objective=fedcurv", "train.objective_options={fisher_estimate: last_batches, fisher_batches: 0}")
    with pytest.raises(ConfigError, match="train.objective_options.fisher_batches: applies to "
                                          "fisher_estimate=last_batches only, not official"):
        cfg_with("train.objective=fedcurv", "train.objective_options={fisher_batches: 5}")
    with pytest.raises(ConfigError, match="server half of train.objective=fedcurv"):
        cfg_with("fl.hooks=[{name: fedcurv}]")
    cfg = cfg_with("train.objective=fedcurv", "train.objective_options={lam: 0.5}")
    assert cfg.hook_specs() == [("fedcurv", {})]


def test_on_digits_fedrs_alpha_one_and_fedcurv_lam_zero_train_as_fedavg_exactly(tmp_path):
    fedavg = run_simulation(cfg_with("fl.rounds=2"), tmp_path / "avg", progress=False)
    rs1 = run_simulation(cfg_with("fl.rounds=2", "train.objective=fedrs", "train.objective_options={alpha: 1.0}"),
                         tmp_path / "rs1", progress=False)
    assert without_time(rs1) == without_time(fedavg)
    rs = run_simulation(cfg_with("fl.rounds=2", "train.objective=fedrs"), tmp_path / "rs", progress=False)
    assert without_time(rs) != without_time(fedavg)
    assert all(0.1 < r["eval"]["test"]["accuracy"] <= 1 for r in rs)
    # lam = 0: the official Fisher pass (its own loader seed and dropout generator, BatchNorm statistics
    # put back) leaves training exactly as FedAvg's
    curv0 = run_simulation(cfg_with("fl.rounds=2", "train.objective=fedcurv", "train.objective_options={lam: 0.0}"),
                           tmp_path / "curv0", progress=False)
    for a, b in zip(curv0, fedavg):
        assert a["client_metrics"] == b["client_metrics"] and a["eval"] == b["eval"]
    a = load_checkpoint(tmp_path / "avg" / "checkpoint.pt")["server"]["global_state"]
    b = load_checkpoint(tmp_path / "curv0" / "checkpoint.pt")["server"]["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fedcurv_on_digits_keeps_client_and_server_state_and_resumes_bit_identically(tmp_path):
    cfg = cfg_with("train.objective=fedcurv", "train.objective_options={lam: 1.0}")  # the official Fisher pass
    full = run_simulation(cfg, tmp_path / "full", progress=False)
    fedavg = run_simulation(cfg_with("fl.rounds=2"), tmp_path / "avg", progress=False)
    assert full[0]["client_metrics"] == fedavg[0]["client_metrics"]  # round 1: no sums yet, no penalty
    assert full[1]["client_metrics"] != fedavg[1]["client_metrics"]  # round 2: the penalty acts
    assert [r["fedcurv"]["clients_held"] for r in full] == [5, 5, 5]
    assert all(r["comm"]["sent"].get(OBJECTIVE_PAYLOAD, 0) > 0 for r in full[1:])  # U, V, W go out from round 2
    assert OBJECTIVE_PAYLOAD not in full[0]["comm"]["sent"]
    assert all(FISHER_KEY in r["comm"]["received"] for r in full)
    ckpt = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    held = ckpt["server"]["hooks"]["fedcurv"]["contributions"]
    assert sorted(held) == sorted(ckpt["clients"])
    for name, client in ckpt["clients"].items():  # each client keeps exactly what the server holds for it
        for key, state_key in zip(CONTRIBUTION_KEYS, ("fisher", "fisher_theta", "fisher_theta_sq")):
            assert all(torch.equal(client["objective"][state_key][n], held[name][key][n]) for n in held[name][key])

    def killer(event, info):
        if event == "client_end" and info["round"] == 1 and info["client"] == "client002":
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    assert without_time(again) == without_time(full)
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")
    a = ckpt["server"]["global_state"]
    assert all(torch.equal(a[k], b["server"]["global_state"][k]) for k in a)
    for name in held:
        for key in CONTRIBUTION_KEYS:
            assert all(torch.equal(held[name][key][n], b["server"]["hooks"]["fedcurv"]["contributions"][name][key][n])
                       for n in held[name][key])
