"""FedAvgM (server momentum) and FedNova (normalised averaging) as aggregating server hooks.

Hand-computed rounds on two-parameter states, the ``||a_i||_1`` formulas
against PyTorch's own SGD, checkpoint round trips, the server path (a client
without ``steps`` is left out), short digits runs and resume.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from fl_helpers import strip_time

from fedreid.config import ConfigError, load_config
from fedreid.fl.aggregate import aggregate, server_step
from fedreid.fl.federation import build_classification_federation
from fedreid.fl.server_hooks import SERVER_HOOKS, AggregationInput, FedAvgMHook, FedNovaHook, HookContext
from fedreid.fl.server_hooks.fedavgm import FedAvgMOptions
from fedreid.fl.server_hooks.fednova import FedNovaOptions, fednova_step, local_norm
from fedreid.fl.simulation import resume, run_simulation
from fedreid.fl.state import states_equal
from fedreid.fl.update import Update
from fedreid.utils.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = ["w", "b"]  # trainable; "bn.running_mean" and "bn.num_batches_tracked" are buffers


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def state(w, b, mean, count=1):
    return OrderedDict([("w", t(*w)), ("b", t(b)), ("bn.running_mean", t(mean)),
                        ("bn.num_batches_tracked", torch.tensor(count))])


X0 = state([1.0, 2.0], 0.5, 0.0, 0)


def round_one_updates(steps=(2, 4)):
    return [Update("a", state([0.0, 1.0], 1.0, 2.0, 3), 1, {"steps": steps[0]}),
            Update("b", state([2.0, 4.0], 0.0, 4.0, 5), 3, {"steps": steps[1]})]


def batch(global_state, updates, *, round_index=0, server_lr=1.0, weighting="size"):
    """What the server hands an aggregating hook (its ``average`` as :meth:`Server.average`)."""

    def average():
        agg = aggregate(updates, weighting=weighting)
        if server_lr != 1.0:
            agg.state = server_step(global_state, agg.state, server_lr, PARAMS)
        return agg

    return AggregationInput(round_index, global_state, updates, list(PARAMS), average, num_clients=2)


def close(got, *values):
    assert torch.allclose(got, t(*values), rtol=0, atol=1e-6), (got, values)


# ------------------------------------------------------------------------------------------- FedAvgM


def test_both_hooks_are_registered():
    assert SERVER_HOOKS["fedavgm"] is FedAvgMHook and SERVER_HOOKS["fednova"] is FedNovaHook
    assert FedAvgMHook.aggregates() and FedNovaHook.aggregates()


def test_fedavgm_two_rounds_by_hand():
    hook = FedAvgMHook(momentum=0.5, server_lr=1.0)
    # Round 1: size weights 1/4, 3/4; avg w = [1.5, 3.25], b = 0.25; Delta = x - avg = [-0.5, -1.25], 0.25;
    # v = Delta, x1 = x - v = avg (the first round is FedAvg's).
    agg = hook.aggregate(batch(X0, round_one_updates()))
    close(agg.state["w"], 1.5, 3.25)
    close(agg.state["b"], 0.25)
    close(agg.state["bn.running_mean"], 3.5)  # buffers: the average
    assert int(agg.state["bn.num_batches_tracked"]) == 5 and agg.state["w"].dtype == torch.float32
    assert agg.weights == [0.25, 0.75] and agg.weighting == "size" and agg.clients == ["a", "b"]
    close(hook.velocity["w"].float(), -0.5, -1.25)
    assert hook.velocity["w"].dtype == torch.float64
    assert agg.stats["momentum_norm"] == pytest.approx((0.5**2 + 1.25**2 + 0.25**2) ** 0.5)
    x1 = agg.state
    # Round 2: avg w = 0.25 [1, 3] + 0.75 [2, 3] = [1.75, 3.0], b = 0.75 * 0.5 = 0.375;
    # Delta = x1 - avg = [-0.25, 0.25], -0.125; v = 0.5 v + Delta = [-0.5, -0.375], 0.0;
    # x2 = x1 - v = [2.0, 3.625], 0.25 (FedAvg would give [1.75, 3.0], 0.375).
    second = [Update("a", state([1.0, 3.0], 0.0, 1.0), 1, {}), Update("b", state([2.0, 3.0], 0.5, 1.0), 3, {})]
    agg2 = hook.aggregate(batch(x1, second, round_index=1))
    close(agg2.state["w"], 2.0, 3.625)
    close(agg2.state["b"], 0.25)
    close(hook.velocity["w"].float(), -0.5, -0.375)
    close(hook.velocity["b"].float(), 0.0)
    close(agg2.state["bn.running_mean"], 1.0)


def test_fedavgm_momentum_zero_is_fedavg_and_uniform_weighting_is_followed():
    hook = FedAvgMHook(momentum=0.0, server_lr=1.0)
    agg = hook.aggregate(batch(X0, round_one_updates(), weighting="uniform"))
    plain = aggregate(round_one_updates(), weighting="uniform")
    assert agg.weighting == "uniform" and agg.weights == [0.5, 0.5]
    assert states_equal(agg.state, plain.state)  # w = [1.0, 2.5], b = 0.5
    close(agg.state["w"], 1.0, 2.5)


def test_fedavgm_server_lr_is_applied_once():
    # eta = 0.5, beta = 0.5: x1 = x - 0.5 (x - avg) = [1 + 0.25, 2 + 0.625], 0.5 - 0.125.
    expected = ([1.25, 2.625], 0.375)
    own = FedAvgMHook(momentum=0.5, server_lr=0.5).aggregate(batch(X0, round_one_updates()))
    # fl.server_lr = 0.5 taken over (options.server_lr null): the average the server hands over
    # already has the 0.5 step in it; the hook must not take it twice.
    ctx = HookContext(cfg=SimpleNamespace(fl=SimpleNamespace(server_lr=0.5)), num_clients=2, num_classes=0,
                      device=torch.device("cpu"), seed=0)
    taken = FedAvgMHook.build(FedAvgMOptions(momentum=0.5), ctx)
    assert taken.server_lr == 0.5
    via_fl = taken.aggregate(batch(X0, round_one_updates(), server_lr=0.5))
    for agg in (own, via_fl):
        close(agg.state["w"], *expected[0])
        close(agg.state["b"], expected[1])
    with pytest.raises(ConfigError, match="server_lr"):
        FedAvgMHook.build(FedAvgMOptions(momentum=0.5, server_lr=0.3), ctx)


def test_fedavgm_momentum_survives_a_state_dict_round_trip():
    hook = FedAvgMHook(momentum=0.9, server_lr=1.0)
    x1 = hook.aggregate(batch(X0, round_one_updates())).state
    buffer = io.BytesIO()
    torch.save(hook.state_dict(), buffer)
    buffer.seek(0)
    restored = FedAvgMHook(momentum=0.9, server_lr=1.0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(v.device.type == "cpu" for v in hook.state_dict()["velocity"].values())
    second = [Update("a", state([1.0, 3.0], 0.0, 1.0), 1, {}), Update("b", state([2.0, 3.0], 0.5, 1.0), 3, {})]
    a = hook.aggregate(batch(x1, second, round_index=1))
    b = restored.aggregate(batch(x1, second, round_index=1))
    assert states_equal(a.state, b.state)
    assert all(torch.equal(hook.velocity[k], restored.velocity[k]) for k in hook.velocity)
    fresh = FedAvgMHook(momentum=0.9, server_lr=1.0).aggregate(batch(x1, second, round_index=1))
    assert not torch.equal(fresh.state["w"], a.state["w"])  # the momentum did carry over


# ------------------------------------------------------------------------------------------- FedNova


@pytest.mark.parametrize("rho, nesterov", [(0.0, False), (0.5, False), (0.9, False), (0.5, True), (0.9, True)])
@pytest.mark.parametrize("tau", [1, 2, 7])
def test_local_norm_matches_torch_sgd_on_a_constant_gradient(tau, rho, nesterov):
    # With a constant gradient g, tau steps of SGD move x by lr * ||a||_1 * g (a: the paper's Eq. 5-6).
    g = torch.tensor([1.0, -2.0], dtype=torch.float64)
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=rho, nesterov=nesterov)
    for _ in range(tau):
        opt.zero_grad()
        (g * p).sum().backward()
        opt.step()
    moved = (-p.detach() / (0.1 * g))
    assert torch.allclose(moved, torch.full_like(moved, local_norm(tau, rho, nesterov)), rtol=1e-12)


def test_local_norm_by_hand():
    assert local_norm(4) == 4.0
    # rho = 0.5: a = [(1 - 0.5^(tau-k)) / 0.5]_k; tau 2 -> [1.5, 1], tau 4 -> [1.875, 1.75, 1.5, 1].
    assert local_norm(2, 0.5) == pytest.approx(2.5)
    assert local_norm(4, 0.5) == pytest.approx(6.125)
    assert local_norm(2, 0.5, nesterov=True) == pytest.approx(2 + 0.5 * 2.5)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError):
            local_norm(bad)


def test_fednova_unequal_steps_by_hand():
    hook = FedNovaHook(momentum=0.0)
    # ||a|| = tau: 2 and 4; p = 1/4, 3/4; tau_eff = 0.5 + 3 = 3.5.
    # w: d_a = ([1, 2] - [0, 1]) / 2 = [0.5, 0.5], d_b = ([1, 2] - [2, 4]) / 4 = [-0.25, -0.5];
    #    sum p d = [-0.0625, -0.25]; x - 3.5 * that = [1.21875, 2.875].
    # b: d_a = (0.5 - 1) / 2 = -0.25, d_b = 0.5 / 4 = 0.125; sum p d = 0.03125; 0.5 - 0.109375 = 0.390625.
    agg = hook.aggregate(batch(X0, round_one_updates(steps=(2, 4))))
    close(agg.state["w"], 1.21875, 2.875)
    close(agg.state["b"], 0.390625)
    close(agg.state["bn.running_mean"], 3.5)
    assert agg.stats["tau_eff"] == pytest.approx(3.5) and agg.stats["norms"] == {"a": 2.0, "b": 4.0}
    assert agg.weights == [0.25, 0.75] and agg.weighting == "size"
    # Momentum 0.5: ||a|| = 2.5 and 6.125, tau_eff = 0.625 + 4.59375 = 5.21875;
    # w: sum p d = 0.25 [1, 1] / 2.5 + 0.75 [-1, -2] / 6.125.
    mom = FedNovaHook(momentum=0.5).aggregate(batch(X0, round_one_updates(steps=(2, 4))))
    s = [0.25 * 1 / 2.5 + 0.75 * -1 / 6.125, 0.25 * 1 / 2.5 + 0.75 * -2 / 6.125]
    close(mom.state["w"], 1.0 - 5.21875 * s[0], 2.0 - 5.21875 * s[1])
    # Uniform p: tau_eff = 3; sum p d = 0.5 [0.5, 0.5] + 0.5 [-0.25, -0.5] = [0.125, 0]; x - 3 * that.
    uni = FedNovaHook(momentum=0.0, weighting="uniform").aggregate(batch(X0, round_one_updates(steps=(2, 4))))
    close(uni.state["w"], 0.625, 2.0)
    assert uni.weights == [0.5, 0.5] and uni.weighting == "uniform"


@pytest.mark.parametrize("rho", [0.0, 0.9])
def test_fednova_with_equal_steps_is_fedavg(rho):
    gen = torch.Generator().manual_seed(3)
    x = OrderedDict((n, torch.randn(5, 3, generator=gen)) for n in ("w", "b"))
    updates = [Update(f"c{i}", OrderedDict((n, v + 0.1 * torch.randn(v.shape, generator=gen)) for n, v in x.items()),
                      n, {"steps": 6}) for i, n in enumerate((3, 10, 7))]
    agg = FedNovaHook(momentum=rho).aggregate(batch(x, updates))
    plain = aggregate(updates)
    assert agg.stats["tau_eff"] == pytest.approx(local_norm(6, rho))
    for name in x:
        assert torch.allclose(agg.state[name], plain.state[name], rtol=0, atol=1e-6)


def test_fednova_check_update_refuses_unusable_steps():
    hook = FedNovaHook()
    assert hook.required_metadata(0) == ("steps",)
    for bad in (0, -3, 2.5, float("nan"), float("inf"), "4", True, None):
        problem = hook.check_update(0, Update("a", X0, 1, {"steps": bad}), torch.nn.Linear(1, 1))
        assert problem and "steps" in problem, bad
    assert hook.check_update(0, Update("a", X0, 1, {"steps": 4}), torch.nn.Linear(1, 1)) is None


# --------------------------------------------------------------------------------- config and runs

BASE = [
    "task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "classification.num_clients=4",
    "classification.alpha=0.5", "train.batch_size=32", "train.drop_last=false", "train.local_epochs=1",
    "train.weight_decay=0", "train.nesterov=false", "train.momentum=0.9", "fl.rounds=3", "eval.every=1",
    "run.device=cpu", "run.tensorboard=false",
]


def cfg_with(*extra):
    return load_config(None, BASE + list(extra))


@pytest.mark.parametrize("entry, key", [
    ("{name: fedavgm, momentum: 2}", "fl.hooks[0].momentum"),
    ("{name: fedavgm, momentum: -0.1}", "fl.hooks[0].momentum"),
    ("{name: fedavgm, server_lr: 0}", "fl.hooks[0].server_lr"),
    ("{name: fedavgm, beta: 0.9}", "fl.hooks[0].beta"),
    ("{name: fednova, momentum: 1.0}", "fl.hooks[0].momentum"),
    ("{name: fednova, weighting: cdw}", "fl.hooks[0].weighting"),
    ("{name: fednova, nesterov: 3}", "fl.hooks[0].nesterov"),
])
def test_bad_hook_options_name_the_key(entry, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        cfg_with(f"fl.hooks=[{entry}]")


def test_one_aggregating_hook_per_run():
    with pytest.raises(ConfigError, match="fedavgm and fednova"):
        cfg_with("fl.hooks=[{name: fedavgm}, {name: fednova}]")
    with pytest.raises(ConfigError, match="scaffold and fedavgm"):
        cfg_with("train.objective=scaffold", "fl.hooks=[{name: fedavgm}]")


def test_fednova_takes_the_clients_momentum():
    fed = build_classification_federation(cfg_with("train.momentum=0.5", "train.nesterov=true",
                                                   "fl.hooks=[{name: fednova}]"))
    hook = next(h for h in fed.server.hooks if h.name == "fednova")
    assert (hook.momentum, hook.nesterov, hook.weighting) == (0.5, True, "size")
    assert FedNovaOptions().momentum is None


def test_a_client_without_steps_is_left_out_of_the_fednova_round():
    fed = build_classification_federation(cfg_with("classification.num_clients=3", "fl.hooks=[{name: fednova}]",
                                                   "eval.every=100"))
    server = fed.server
    sent = OrderedDict((k, v.clone()) for k, v in server.global_state.items())
    plan = server.begin_round()
    updates = [fed.clients[k].fit(fed.work_model, server.payload_for(k), dict(plan.instructions)) for k in plan.ids]
    assert all(u.metadata["steps"] > 0 for u in updates)
    dropped = updates[1]
    updates[1] = Update(dropped.client, dropped.state, dropped.num_samples,
                        {k: v for k, v in dropped.metadata.items() if k != "steps"}, head_shared=dropped.head_shared)
    record = server.finish_round(plan, updates)
    kept = [updates[0], updates[2]]
    assert record["clients"] == [u.client for u in kept]
    assert record["failed"] == {dropped.client: "update rejected: fednova: no steps"}
    assert record["fednova"]["norms"] == {u.client: local_norm(u.metadata["steps"], 0.9) for u in kept}
    params = server.trainable_names()
    weights = [u.num_samples / sum(v.num_samples for v in kept) for u in kept]
    norms = [local_norm(u.metadata["steps"], 0.9) for u in kept]
    expected, _ = fednova_step(OrderedDict((n, sent[n]) for n in params), [u.state for u in kept], weights, norms)
    for name in params:
        assert torch.equal(server.global_state[name], expected[name].float())


class Kill(RuntimeError):
    pass


def test_fedavgm_digits_run_learns_and_resumes_bit_exactly(tmp_path):
    cfg = cfg_with("fl.hooks=[{name: fedavgm, momentum: 0.5}]")
    full = run_simulation(cfg, tmp_path / "full", progress=False)
    assert [r["weighting"] for r in full] == ["size"] * 3 and all(r["fedavgm"]["momentum_norm"] > 0 for r in full)
    assert full[-1]["eval"]["test"]["accuracy"] > 0.3  # 10 classes: chance is 0.1

    def killer(event, info):
        if event == "client_end" and info["round"] == 1 and info["client"] == "client002":
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    assert strip_time(again) == strip_time(full)
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["server"]
    b = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["server"]
    assert states_equal(a["global_state"], b["global_state"])
    va, vb = a["hooks"]["fedavgm"]["velocity"], b["hooks"]["fedavgm"]["velocity"]
    assert list(va) == list(vb) and all(torch.equal(va[k], vb[k]) for k in va)


def test_fednova_digits_run_learns(tmp_path):
    hist = run_simulation(cfg_with("fl.hooks=[{name: fednova}]"), tmp_path / "run", progress=False)
    assert all(r["fednova"]["steps_min"] >= 1 and r["fednova"]["tau_eff"] > 0 for r in hist)
    assert hist[0]["fednova"]["steps_min"] < hist[0]["fednova"]["steps_max"]  # the skewed clients differ
    assert hist[-1]["eval"]["test"]["accuracy"] > 0.3
