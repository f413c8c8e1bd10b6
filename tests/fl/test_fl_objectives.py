"""Client objectives inside the one training loop: exactness, server halves, persistence, resume."""

import pytest
import torch
from fl_helpers import recorded_round, strip_time, tiny_config, write_world

from fedreid.config import ConfigError
from fedreid.fl.federation import build_federation
from fedreid.fl.local.scaffold import DELTA_C_KEY
from fedreid.fl.simulation import resume, run_simulation
from fedreid.fl.state import states_equal
from fedreid.utils.checkpoint import load_checkpoint


class Kill(RuntimeError):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"))


def objective(name, **options):
    opts = ", ".join(f"{k}: {v}" for k, v in options.items())
    return [f"train.objective={name}", f"train.objective_options={{{opts}}}", "fl.rounds=2", "eval.every=2"]


def final(run_dir):
    return load_checkpoint(run_dir / "checkpoint.pt")


def test_fedprox_with_mu_zero_is_exactly_fedavg(world, tmp_path):
    plain = run_simulation(tiny_config(world, ["fl.rounds=2", "eval.every=2"]), tmp_path / "a", progress=False)
    prox0 = run_simulation(tiny_config(world, objective("fedprox", mu=0.0)), tmp_path / "b", progress=False)
    assert strip_time(plain) == strip_time(prox0)
    assert states_equal(final(tmp_path / "a")["server"]["global_state"], final(tmp_path / "b")["server"]["global_state"])
    prox = run_simulation(tiny_config(world, objective("fedprox", mu=1.0)), tmp_path / "c", progress=False)
    assert prox[0]["train_loss"] > plain[0]["train_loss"]  # the proximal term is in the reported loss


@pytest.mark.parametrize("name, options, hook, key", [
    ("scaffold", {}, "scaffold", "control"),
    ("scaffold", {"control_variate": "displacement"}, "scaffold", "control"),
    ("feddyn", {"alpha": 0.1}, "feddyn", "h"),
])
def test_server_halves_keep_state_and_resume_exactly(world, tmp_path, name, options, hook, key):
    cfg = tiny_config(world, objective(name, **options))
    full = run_simulation(cfg, tmp_path / "full", progress=False)
    ckpt = final(tmp_path / "full")
    server_state = ckpt["server"]["hooks"][hook][key]
    assert server_state and any(v.abs().sum() > 0 for v in server_state.values())
    for client in ckpt["clients"].values():
        assert client["objective"] and all(len(v) > 0 for v in client["objective"].values())
    for rec in full:  # tensors in the metadata are counted as traffic, never logged
        assert all(DELTA_C_KEY not in m for m in rec["client_metrics"].values())
        assert (rec["comm"]["metadata_bytes"] > 0) == (name == "scaffold")

    def killer(event, info):
        if event == "client_end" and info["round"] == 1:
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "killed", progress=False, callbacks=[killer])
    again = resume(tmp_path / "killed", progress=False)
    assert strip_time(again) == strip_time(full)
    assert states_equal(final(tmp_path / "killed")["server"]["global_state"], ckpt["server"]["global_state"])
    for a, b in zip(final(tmp_path / "killed")["server"]["hooks"][hook][key].values(), server_state.values()):
        assert torch.equal(a, b)


def test_scaffold_server_model_is_the_unweighted_mean_of_client_models(world, tmp_path):
    cfg = tiny_config(world, objective("scaffold") + ["fl.rounds=1", "eval.every=1"])
    fed = build_federation(cfg)
    sent = dict(fed.server.global_state)
    _, updates = recorded_round(fed)
    states = [u.state for u in updates]
    params = dict(fed.server.model.named_parameters())
    name = next(n for n in sent if n in params and sent[n].is_floating_point())
    expected = sent[name] + sum(s[name] - sent[name] for s in states) / len(states)
    assert torch.allclose(params[name].detach(), expected, atol=1e-6)


@pytest.mark.parametrize("name, options", [
    ("scaffold", {"server_weighting": "size"}),
    ("feddyn", {"alpha": 0.1, "server_weighting": "size"}),
    ("feddyn", {"alpha": 0.1}),
])
def test_server_halves_weigh_the_client_models_as_configured(world, tmp_path, name, options):
    """server_weighting=size: the official FedNTD mean sum_k (n_k / n) y_k; uniform: the papers' 1/|S|."""
    cfg = tiny_config(world, objective(name, **options) + ["fl.rounds=1", "eval.every=1"])
    fed = build_federation(cfg)
    sent = dict(fed.server.global_state)
    _, updates = recorded_round(fed)
    params = dict(fed.server.model.named_parameters())
    name_p = next(n for n in sent if n in params and sent[n].is_floating_point())
    sizes = [u.num_samples for u in updates]
    by_size = sum(n / sum(sizes) * u.state[name_p] for n, u in zip(sizes, updates))
    plain = sum(u.state[name_p] for u in updates) / len(updates)
    assert not torch.allclose(by_size, plain, atol=1e-5)  # the clients' sizes differ enough to tell them apart
    mean = by_size if options.get("server_weighting") == "size" else plain
    if name == "scaffold":
        expected = mean
    else:  # h = -alpha (1/m) sum (theta_k - x), theta = mean - h / alpha
        h = -options["alpha"] / len(fed.clients) * sum(u.state[name_p] - sent[name_p] for u in updates)
        expected = mean - h / options["alpha"]
    assert torch.allclose(params[name_p].detach(), expected, atol=1e-5)


def test_scaffold_reference_average_is_the_aggregate_before_kd_changed_it(world, tmp_path):
    """reference=average: round 2's payload carries round 1's aggregate, not the KD-trained model sent."""
    from fedreid.fl.local.base import OBJECTIVE_PAYLOAD
    from fedreid.fl.local.scaffold import AVERAGE_KEY

    cfg = tiny_config(world, objective("scaffold", control_variate="displacement", reference="average")
                      + ["fl.kd=true", "fl.kd_every=1"])
    fed = build_federation(cfg)
    hook = next(h for h in fed.server.hooks if h.name == "scaffold")
    seen = []

    def fit(k, payload, instructions):
        seen.append((dict(payload), instructions.get(OBJECTIVE_PAYLOAD, {})))
        return fed.clients[k].fit(fed.work_model, payload, instructions)

    fed.server.run_round(fit)
    aggregated = dict(hook.average)
    assert aggregated and all(AVERAGE_KEY not in p for _, p in seen)  # nothing aggregated before round 1
    seen.clear()
    fed.server.run_round(fit)
    sent, extra = seen[0]
    assert set(extra[AVERAGE_KEY]) == set(aggregated)
    assert all(torch.equal(extra[AVERAGE_KEY][n], aggregated[n]) for n in aggregated)
    moved = [n for n in aggregated if not torch.equal(sent[n].cpu(), aggregated[n])]
    assert moved  # KD trained the model the clients received after the average was taken
    assert "average" in hook.state_dict()


def test_scaffold_reference_average_needs_the_displacement_form(world):
    with pytest.raises(ConfigError, match="reference: 'average' applies to control_variate=displacement"):
        tiny_config(world, objective("scaffold", reference="average"))


@pytest.mark.parametrize("name, options", [
    ("moon", {"mu": 1.0}), ("fedntd", {}), ("fedlmd", {}), ("fedlmd_tf", {"switch_round": 1}),
])
def test_distillation_objectives_train(world, tmp_path, name, options):
    hist = run_simulation(tiny_config(world, objective(name, **options)), tmp_path / name, progress=False)
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in hist)
    assert set(hist[-1]["eval"]) == {"dsa", "dsb"}


def test_bad_objective_configs():
    with pytest.raises(ConfigError, match="train.objective: unknown 'fedsgd'"):
        tiny_config("x", ["train.objective=fedsgd"])
    with pytest.raises(ConfigError, match="train.objective_options.mu: not an option of 'scaffold'"):
        tiny_config("x", ["train.objective=scaffold", "train.objective_options={mu: 1}"])


def test_the_moon_server_hook_runs_only_for_first_previous_initial():
    from fedreid.config import load_config

    def hooks(*overrides):
        return [name for name, _ in load_config(None, ["task=classification", "fl.aggregation=fedavg",
                                                       *overrides]).hook_specs()]

    assert hooks("train.objective=moon") == []
    assert hooks("train.objective=moon", "train.objective_options={first_previous: initial}") == ["moon"]
    with pytest.raises(ConfigError, match="configures it from train.objective_options; leave it out of fl.hooks"):
        hooks("train.objective=moon", "fl.hooks=[{name: moon}]")
