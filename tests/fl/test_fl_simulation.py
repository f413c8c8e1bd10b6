"""End-to-end federated simulation on tiny data: resume, determinism, bytes, modes, errors."""

import copy

import numpy as np
import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_prepared, write_world

from fedreid.config import ConfigError, load_config
from fedreid.data.scenarios import ClientSplit
from fedreid.fl.client import ClientError, check_split
from fedreid.fl.federation import build_federation
from fedreid.fl.simulation import resume, run_simulation
from fedreid.fl.state import bn_buffers, clone_state, state_nbytes, states_equal
from fedreid.fl.update import Update
from fedreid.models.reid import private_state
from fedreid.utils.checkpoint import load_checkpoint
from fedreid.utils.logging import read_metrics

FULL = ["fl.cdw=true", "fl.kd=true", "fl.kd_every=2"]


class Kill(RuntimeError):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = write_world(tmp_path_factory.mktemp("prepared"))
    write_prepared(root, "dsc", num_ids=3, seed=5)  # same class count as dsa (FedAvg)
    return root


@pytest.fixture(scope="module")
def baseline(world, tmp_path_factory):
    """An uninterrupted 3-round run with CDW + KD (KD after round 2)."""
    run_dir = tmp_path_factory.mktemp("runs") / "full"
    seen = []
    history = run_simulation(tiny_config(world, FULL), run_dir, progress=False,
                             callbacks=[lambda ev, info: seen.append((ev, info))])
    return run_dir, history, seen


def final_state(run_dir):
    ckpt = load_checkpoint(run_dir / "checkpoint.pt")
    return ckpt["server"]["global_state"], {k: v["head"] for k, v in ckpt["clients"].items()}


def assert_same_run(dir_a, hist_a, dir_b, hist_b):
    assert strip_time(hist_a) == strip_time(hist_b)
    ga, ha = final_state(dir_a)
    gb, hb = final_state(dir_b)
    assert states_equal(ga, gb)
    assert ha.keys() == hb.keys() and all(states_equal(ha[k], hb[k]) for k in ha)
    assert strip_time(read_metrics(dir_b)) == strip_time(hist_b)


def test_history_contents(baseline):
    _, history, _ = baseline
    assert [r["round"] for r in history] == [1, 2, 3]
    for rec in history:
        assert rec["weighting"] == "cdw"
        assert sum(rec["weights"].values()) == pytest.approx(1.0)
        assert set(rec["eval"]) == {"dsa", "dsb"}
        assert set(rec["local_eval"]) == {"dsa", "dsb"}
        assert 0 <= rec["eval"]["dsa"]["rank1"] <= 1 and "mAP" in rec["eval"]["dsa"]
        assert all(m["cdw_distance"] > 0 for m in rec["client_metrics"].values())
    assert "kd" not in history[0] and "kd" in history[1] and "kd" not in history[2]
    assert history[1]["kd"]["kd_teachers"] == 2 and history[1]["comm"]["metadata_bytes"] > 0


def test_heads_never_in_updates_and_persist(baseline):
    _, _, seen = baseline
    updates = [info["update"] for ev, info in seen if ev == "client_end"]
    assert len(updates) == 6
    for u in updates:
        assert not any(k.startswith("classifier") for k in u.state)
        assert any(k.startswith("bottleneck.1.running_mean") for k in u.state)
    kd_updates = [info["update"] for ev, info in seen if ev == "client_end" and info["round"] == 1]
    assert all(u.metadata["kd_features"].shape == (6, 16) for u in kd_updates)
    assert all(torch.allclose(u.metadata["kd_features"].norm(dim=1), torch.ones(6)) for u in kd_updates)


def test_comm_bytes_are_two_shared_states_per_client(baseline, world):
    run_dir, history, _ = baseline
    shared = state_nbytes(final_state(run_dir)[0])
    cumulative = 0
    for i, rec in enumerate(history, start=1):
        comm = rec["comm"]
        assert comm["sent"]["model"] == comm["received"]["model"] == shared * 2
        assert comm["paper_bytes"] == 2 * shared * 2
        assert comm["cumulative_paper_bytes"] == i * 2 * shared * 2
        # Everything that crossed the wire: the models, and KD's features in its round.
        kd_bytes = 2 * 6 * 16 * 4 if "kd" in rec else 0  # 2 clients x 6 public images x 16-d float32
        assert comm["received"].get("kd_features", 0) == kd_bytes
        assert comm["total_bytes"] == comm["paper_bytes"] + kd_bytes
        cumulative += comm["total_bytes"]
        assert comm["cumulative_bytes"] == cumulative


@pytest.mark.parametrize("kill_event, kill_round", [("round_end", 1), ("client_end", 1), ("client_end", 2)])
def test_resume_is_bit_identical(baseline, world, tmp_path, kill_event, kill_round):
    dir_a, hist_a, _ = baseline
    run_dir = tmp_path / "killed"

    def killer(event, info):
        if event == kill_event and info["round"] == kill_round:
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(tiny_config(world, FULL), run_dir, progress=False, callbacks=[killer])
    # The checkpoint holds the rounds finished before the kill: a kill at a round's
    # end comes after that round's checkpoint, one mid-round leaves the round before.
    finished = kill_round + 1 if kill_event == "round_end" else kill_round
    assert load_checkpoint(run_dir / "checkpoint.pt")["round"] == finished
    with pytest.raises(FileExistsError, match="resume"):
        run_simulation(tiny_config(world, FULL), run_dir, progress=False)
    with pytest.raises(ConfigError, match="fl.kd_every"):
        run_simulation(tiny_config(world, FULL + ["fl.kd_every=3"]), run_dir, resume=True, progress=False)
    with pytest.raises(ConfigError, match="changed keys: train.workers"):  # the workers' seeds set the augmentations
        run_simulation(tiny_config(world, FULL + ["train.workers=2"]), run_dir, resume=True, progress=False)
    hist_b = resume(run_dir, progress=False)
    assert_same_run(dir_a, hist_a, run_dir, hist_b)


def test_seeded_determinism(baseline, world, tmp_path):
    dir_a, hist_a, _ = baseline
    again = run_simulation(tiny_config(world, FULL), tmp_path / "again", progress=False)
    assert_same_run(dir_a, hist_a, tmp_path / "again", again)
    other = run_simulation(tiny_config(world, FULL + ["seed=1", "fl.rounds=1"]), tmp_path / "other", progress=False)
    assert other[0]["train_loss"] != hist_a[0]["train_loss"]


@pytest.mark.parametrize("bn, extra", [("first", ["fl.cdw=true", "fl.cdw_mode=train"]), ("local", [])])
def test_bn_policies_run(world, tmp_path, bn, extra):
    overrides = [f"fl.bn={bn}", "fl.rounds=2", "eval.every=2", "eval.local_models=false"] + extra
    hist = run_simulation(tiny_config(world, overrides), tmp_path / bn, progress=False)
    assert len(hist) == 2 and "eval" in hist[1] and "eval" not in hist[0] and "local_eval" not in hist[1]
    ckpt = load_checkpoint(tmp_path / bn / "checkpoint.pt")
    bn_state = ckpt["clients"]["dsa"]["bn_state"]
    assert (bn_state is not None) == (bn == "local")


def test_cdw_official_mode_gets_the_round_from_the_client(world, tmp_path, monkeypatch):
    import fedreid.fl.client as client_module

    seen = []
    real = client_module.cdw_distance

    def recorded(*args, **kwargs):
        seen.append((kwargs["mode"], kwargs["start_in_eval"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(client_module, "cdw_distance", recorded)
    overrides = ["fl.cdw=true", "fl.cdw_mode=official", "fl.rounds=3", "eval.every=2", "eval.local_models=false"]
    run_simulation(tiny_config(world, overrides), tmp_path / "official", progress=False)
    # two clients a round; the received model in eval mode in round 1 and after the evaluation of round 2
    assert seen == [("official", True)] * 2 + [("official", False)] * 2 + [("official", True)] * 2


def test_local_baseline_and_sampling(world, tmp_path):
    cfg = tiny_config(world, ["fl.mode=local", "fl.rounds=2", "fl.clients_per_round=1"])
    hist = run_simulation(cfg, tmp_path / "local", progress=False)

    def killer(event, info):
        if event == "round_end" and info["round"] == 0:
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, tmp_path / "local2", progress=False, callbacks=[killer])
    assert strip_time(resume(tmp_path / "local2", progress=False)) == strip_time(hist)
    for rec in hist:
        assert len(rec["clients"]) == 1 and "weights" not in rec and "local_eval" not in rec
        assert rec["comm"]["total_bytes"] == 0
        (name,) = rec["clients"]
        # each client's own model on its own dataset is the baseline's evaluation
        assert list(rec["eval"]) == [name] and set(rec["eval"][name]) >= {"rank1", "mAP"}
    ckpt = load_checkpoint(tmp_path / "local" / "checkpoint.pt")
    assert len(ckpt["server"]["local_states"]) >= 1


def test_fedpav_one_client_per_round_bytes(world, tmp_path):
    hist = run_simulation(tiny_config(world, ["fl.rounds=1", "fl.clients_per_round=1"]), tmp_path / "k1", progress=False)
    shared = state_nbytes(load_checkpoint(tmp_path / "k1" / "checkpoint.pt")["server"]["global_state"])
    assert hist[0]["comm"]["total_bytes"] == 2 * shared * 1
    assert list(hist[0]["weights"].values()) == [1.0]


def test_fedavg_shares_whole_model(world, tmp_path):
    seen = []
    cfg = tiny_config(world, ["fl.aggregation=fedavg", "fl.rounds=1"], names=("dsa", "dsc"))
    hist = run_simulation(cfg, tmp_path / "fedavg", progress=False,
                          callbacks=[lambda ev, info: seen.append(info["update"]) if ev == "client_end" else None])
    assert all(u.head_shared and "classifier.weight" in u.state for u in seen)
    g = load_checkpoint(tmp_path / "fedavg" / "checkpoint.pt")["server"]["global_state"]
    w = hist[0]["weights"]
    assert w == {"dsa": 0.5, "dsc": 0.5}
    expected = sum(w[u.client] * u.state["classifier.weight"].double() for u in seen).float()
    assert torch.allclose(g["classifier.weight"], expected)


def test_clear_errors(world, tmp_path):
    empty = ClientSplit("cam9", "dsa", [], np.zeros(0, dtype=np.int64), [])
    with pytest.raises(ClientError, match="'cam9' has an empty training split"):
        check_split(empty, 4)
    lonely = ClientSplit("cam3", "dsa", list(range(6)), np.zeros(6, dtype=np.int64), [17])
    with pytest.raises(ClientError, match="'cam3' has one identity: its identity head over one class"):
        check_split(lonely, 4, identities=True)
    pair = ClientSplit("cam4", "dsa", list(range(9)), np.array([0, 1] * 4 + [0]), [17, 18])
    check_split(pair, 4, identities=True)  # drop_last: the ninth image is skipped, as the reference
    with pytest.raises(ClientError, match="'cam4': train.batch_size=4 with train.drop_last=false gives 9 images "
                                          "a batch of one image"):
        check_split(pair, 4, drop_last=False, identities=True)
    with pytest.raises(ClientError, match="train.batch_size=1"):
        check_split(pair, 1, identities=True)
    check_split(pair, 4, drop_last=False)  # classification: the classes are the dataset's, BatchNorm may be absent
    with pytest.raises(ClientError, match="fewer than train.batch_size=64"):
        build_federation(tiny_config(world, ["train.batch_size=64"]))
    with pytest.raises(ConfigError, match="clients_per_round=5"):  # one line from the tools, not a traceback
        build_federation(tiny_config(world, ["fl.clients_per_round=5"]))
    with pytest.raises(ConfigError, match="fedavg"):
        build_federation(tiny_config(world, ["fl.aggregation=fedavg"]))
    for override, fragment in [
        ("fl.bn=median", "fl.bn: 'median' is not allowed"),
        ("fl.kd_every=0", "fl.kd_every: expected a positive value"),
        ("train.lr=-1", "train.lr: expected a positive value"),
        ("train.momentum=2", "train.momentum: expected 0 <= value <= 1"),
        ("fl.cdw_mode=test", "fl.cdw_mode"),
        ("eval.ap=market", "eval.ap"),
        ("fl.clients_per_round=-1", "fl.clients_per_round"),
        ("model.dropout=1", "model.dropout"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="fl.kd: the local-training baseline"):
        load_config(None, ["fl.mode=local", "fl.kd=true"])


def test_paper_defaults():
    cfg = load_config()
    assert cfg.model.backbone == "resnet50" and (cfg.model.height, cfg.model.width) == (256, 128)
    assert cfg.train.batch_size == 32 and cfg.train.local_epochs == 1
    assert cfg.train.lr == 0.05 and cfg.train.lr * cfg.train.lr_backbone_ratio == pytest.approx(0.005)
    assert cfg.fl.rounds == 300 and cfg.fl.clients_per_round == 0 and cfg.fl.kd_every == 1
    assert cfg.fl.kd_lr == 5e-4 and cfg.fl.bn == "average" and cfg.fl.aggregation == "fedpav"


def _shifted_bn(state, shift: float):
    """``state`` with every BatchNorm running mean moved by ``shift`` (a recognisable payload)."""
    out = clone_state(state)
    for key in bn_buffers(out):
        if key.endswith("running_mean"):
            out[key] += shift
    return out


def test_private_head_persists_and_starts_the_next_round(world):
    fed = build_federation(tiny_config(world, ["fl.rounds=2"]))
    client = fed.clients[0]
    client.fit(fed.work_model, fed.server.global_state, {"round": 0})
    trained_head = clone_state(client.head)

    untouched = build_federation(tiny_config(world, ["fl.rounds=2"])).clients[0]
    untouched.init_head(copy.deepcopy(fed.work_model))
    assert not states_equal(trained_head, untouched.head), "local training left the head unchanged"

    # Round 2 (and CDW's "old head") start from the head this client trained,
    # whatever head the shared work model carries from the previous client.
    fed.clients[1].fit(fed.work_model, fed.server.global_state, {"round": 0})
    model = fed.clients[0].prepare_model(fed.work_model, fed.server.global_state)
    assert states_equal(dict(private_state(model)), trained_head)


@pytest.mark.parametrize("bn", ["average", "local"])
def test_bn_policy_decides_whose_statistics_a_client_starts_from(world, bn):
    fed = build_federation(tiny_config(world, [f"fl.bn={bn}", "fl.rounds=2"]))
    client = fed.clients[0]
    client.fit(fed.work_model, fed.server.global_state, {"round": 0})
    payload = _shifted_bn(fed.server.global_state, 5.0)
    model_bn = bn_buffers(client.prepare_model(fed.work_model, payload).state_dict())
    if bn == "local":
        assert client.bn_state is not None and states_equal(model_bn, client.bn_state)
    else:
        assert client.bn_state is None and states_equal(model_bn, bn_buffers(payload))


def test_bn_first_takes_the_first_sampled_client_not_client_zero(world):
    base = ["fl.bn=first", "fl.rounds=1", "eval.every=100", "eval.local_models=false"]
    for seed in range(20):  # a seed whose sampled order does not start with client 0
        fed = build_federation(tiny_config(world, [f"seed={seed}", *base]))
        if copy.deepcopy(fed.server.sampler).permutation(2)[0] == 1:
            break
    else:
        pytest.fail("no seed in 0..19 samples client 1 first")
    before = clone_state(fed.server.global_state)

    def fit(k, payload, instructions):
        state = _shifted_bn(payload, 10.0 * (k + 1))
        return Update(fed.clients[k].name, state, fed.clients[k].num_samples, {"train_loss": 0.0})

    record = fed.server.run_round(fit)
    assert record["clients"][0] == fed.clients[1].name
    after = bn_buffers(fed.server.global_state)
    assert states_equal(after, bn_buffers(_shifted_bn(before, 20.0)))


def test_local_baseline_is_one_continuous_run_whose_lr_schedule_fires(world, tmp_path):
    # Appendix A.1's StepLR (here step 2, gamma 0.1) over each client's own epochs: local
    # training decays at epoch 2 (0-based epoch 1, the reference's scheduler.step() at the
    # start of each epoch), FedPav's fresh optimizer per round never does.
    step = ["train.lr_step_size=2", "train.lr=0.05", "fl.rounds=3", "eval.every=3", "eval.local_models=false"]
    local = run_simulation(tiny_config(world, step + ["fl.mode=local"]), tmp_path / "local", progress=False)
    fed = run_simulation(tiny_config(world, step), tmp_path / "fed", progress=False)
    for client in ("dsa", "dsb"):
        lrs = [rec["client_metrics"][client]["lr"] for rec in local]
        assert lrs == pytest.approx([0.05, 0.005, 0.005])
        assert [rec["client_metrics"][client]["lr"] for rec in fed] == pytest.approx([0.05] * 3)
    ckpt = load_checkpoint(tmp_path / "local" / "checkpoint.pt")
    momentum = ckpt["clients"]["dsa"]["optimizer"]["state"]
    assert momentum and all(torch.isfinite(s["momentum_buffer"]).all() for s in momentum.values())
    assert load_checkpoint(tmp_path / "fed" / "checkpoint.pt")["clients"]["dsa"]["optimizer"] is None

    def killer(event, info):
        if event == "round_end" and info["round"] == 0:
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(tiny_config(world, step + ["fl.mode=local"]), tmp_path / "killed", progress=False,
                       callbacks=[killer])
    assert strip_time(resume(tmp_path / "killed", progress=False)) == strip_time(local)
    # a per-round decay still applies on top of the carried-over optimizer
    decayed = run_simulation(tiny_config(world, step + ["fl.mode=local", "train.lr_round_decay=0.5"]),
                             tmp_path / "decayed", progress=False)
    assert [rec["client_metrics"]["dsa"]["lr"] for rec in decayed] == pytest.approx([0.05, 0.0025, 0.00125])
    groups = load_checkpoint(tmp_path / "decayed" / "checkpoint.pt")["clients"]["dsa"]["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([0.000125, 0.00125])  # backbone at 0.1 x, the rest at lr


def test_a_fresh_run_refuses_a_run_folder_whose_checkpoint_was_removed_but_whose_results_remain(tmp_path):
    import json

    from fedreid.fl.simulation import RUN_KIND, check_run_dir
    from fedreid.utils.io import claim_output_dir

    finished = tmp_path / "finished"
    claim_output_dir(finished, RUN_KIND, tool="train_fed.py")
    (finished / "model_final.pt").write_bytes(b"the user's model")
    with pytest.raises(FileExistsError, match="holds a finished run's model_final.pt"):
        check_run_dir(finished)
    history = tmp_path / "history"
    claim_output_dir(history, RUN_KIND, tool="train_fed.py")
    metrics = history / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3)))
    with pytest.raises(FileNotFoundError, match="records 3 rounds, so the checkpoint was removed"):
        check_run_dir(history)
    metrics.write_text(json.dumps({"round": 1}) + "\n")  # a kill between round 1's metrics line and its checkpoint
    check_run_dir(history)  # starts over
    assert (finished / "model_final.pt").read_bytes() == b"the user's model"


def test_a_server_hook_whose_period_exceeds_the_rounds_is_named():
    from fedreid.fl.simulation import hooks_that_never_run

    short = load_config(None, ["fl.rounds=2", "fl.kd=true", "fl.kd_every=5", "fl.hooks=[{name: fedavgm}]"])
    assert hooks_that_never_run(short) == [("kd", 5)]
    assert hooks_that_never_run(load_config(None, ["fl.rounds=10", "fl.kd=true", "fl.kd_every=5"])) == []
