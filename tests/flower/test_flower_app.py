"""The Flower ServerApp/ClientApp over an in-process grid: same numbers as the simulator, lost and bad clients.

Messages are real Flower ``Message``s encoded by :mod:`fedreid.flower.codec`
and dispatched by ``client_app`` itself; only the sockets are missing (see
``flower_fakes.py``). Every ClientApp call starts from an empty process
cache, as a SuperNode may start a fresh process per message, so the private
heads must come back from the node's disk.
"""

import math

import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_prepared, write_world
from flower_fakes import FakeGrid
from flwr.app import Context, Message, RecordDict

from fedreid.config import ConfigError, dump_config
from fedreid.fl.server import RoundFailedError
from fedreid.fl.simulation import run_simulation
from fedreid.fl.state import states_equal
from fedreid.fl.update import private_prefixes
from fedreid.flower import app as flower_app
from fedreid.flower.codec import pack, unpack, update_from_plain, update_to_plain
from fedreid.flower.node import NodeClient, NodeStateError
from fedreid.utils.checkpoint import load_checkpoint

NAMES = ("dsa", "dsb", "dsc")
METHOD = ["fl.cdw=true", "fl.kd=true", "fl.kd_every=2", "fl.rounds=2", "eval.every=1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = write_world(tmp_path_factory.mktemp("prepared"))
    write_prepared(root, "dsc", num_ids=3, seed=5)
    return root


@pytest.fixture(scope="module")
def simulated(world, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sim") / "run"
    history = run_simulation(tiny_config(world, METHOD, names=NAMES), run_dir, progress=False)
    return run_dir, history


def write_config(tmp_path, cfg):
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    return path


def fresh_process(tamper=None):
    """A tamper hook that also empties the ClientApp's process cache after every message."""

    def hook(node, msg, reply):
        flower_app._NODES.clear()
        return tamper(node, msg, reply) if tamper else reply

    return hook


def serve(grid, run_config):
    flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                         run_config=run_config))


def nodes_for(tmp_path, names=NAMES):
    return {100 + i: {"client": name, "state-dir": str(tmp_path / "state" / name)} for i, name in enumerate(names)}


def test_flower_run_equals_the_simulation(world, simulated, tmp_path):
    sim_dir, sim_history = simulated
    cfg_path = write_config(tmp_path, tiny_config(world, METHOD, names=NAMES))
    out = tmp_path / "flower_run"
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 5})
    flower_ckpt = load_checkpoint(out / "checkpoint.pt")
    sim_ckpt = load_checkpoint(sim_dir / "checkpoint.pt")
    assert states_equal(flower_ckpt["server"]["global_state"], sim_ckpt["server"]["global_state"])
    assert strip_time(flower_ckpt["history"]) == strip_time(sim_history)
    assert flower_ckpt["clients"] == {}  # client state stays on the nodes
    # Each node kept its private head on its own disk, equal to the simulated client's.
    for i, name in enumerate(NAMES):
        saved = sorted((tmp_path / "state" / name).rglob("after_round_*.pt"))
        assert [p.name for p in saved] == ["after_round_00000.pt", "after_round_00001.pt"]
        head = torch.load(saved[-1], weights_only=False)["state"]["head"]
        assert states_equal(head, sim_ckpt["clients"][name]["head"])
    assert (out / "report.md").is_file()
    trains = [msg for msg in grid.sent if msg.metadata.message_type == "train"]
    assert len(trains) == 2 * len(NAMES)
    sent_keys = {k for msg in trains for k in unpack(msg.content, "payload")}
    assert sent_keys and not any(k.startswith(private_prefixes()) for k in sent_keys)  # no head goes out either


@pytest.mark.parametrize("overrides", [[], ["eval.datasets=[dsa,dsc]"]], ids=["target-only", "eval-datasets"])
def test_leave_one_out_records_equal_the_simulation(world, tmp_path, overrides):
    # Protocol-1 evaluates the unseen target only: no node adds a local evaluation the simulation lacks.
    cfg = tiny_config(world, ["scenario.kind=leave_one_out", "scenario.target=dsc", "fl.rounds=1", "eval.every=1",
                              *overrides], names=NAMES)
    sim_history = run_simulation(cfg, tmp_path / "sim", progress=False)
    cfg_path = write_config(tmp_path, cfg)
    out = tmp_path / "flower_run"
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path, NAMES[:2]), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 5})
    ours = load_checkpoint(out / "checkpoint.pt")
    assert states_equal(ours["server"]["global_state"],
                        load_checkpoint(tmp_path / "sim" / "checkpoint.pt")["server"]["global_state"])
    assert strip_time(ours["history"]) == strip_time(sim_history)


def test_simulation_engine_partitions_map_to_clients(world, simulated, tmp_path):
    # Flower's simulation engine gives nodes partition-id/num-partitions, not a client name.
    sim_dir, _ = simulated
    cfg_path = write_config(tmp_path, tiny_config(world, METHOD, names=NAMES))
    nodes = {7 + i: {"partition-id": i, "num-partitions": len(NAMES), "state-dir": str(tmp_path / "state")}
             for i in reversed(range(len(NAMES)))}
    with FakeGrid(flower_app.client_app, nodes) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5})
    ours = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["server"]["global_state"]
    assert states_equal(ours, load_checkpoint(sim_dir / "checkpoint.pt")["server"]["global_state"])


@pytest.mark.parametrize("objective", ["scaffold", "moon"])
def test_classification_objective_state_lives_on_the_nodes(tmp_path, objective):
    # SCAFFOLD's control variate and MOON's previous model persist on each node's disk across fresh processes.
    from fedreid.config import load_config

    overrides = ["task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd",
                 "classification.num_clients=5", "classification.alpha=0.5", "train.batch_size=32",
                 "train.drop_last=false", "train.local_epochs=1", "train.weight_decay=0", "train.nesterov=false",
                 "train.lr=0.01", "fl.rounds=3", "eval.every=3",
                 "run.device=cpu", "run.tensorboard=false", f"train.objective={objective}"]
    cfg = load_config(None, overrides)
    sim_history = run_simulation(cfg, tmp_path / "sim", progress=False)
    cfg_path = write_config(tmp_path, cfg)
    names = [f"client{k:03d}" for k in range(5)]
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path, names), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5})
    ours = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    theirs = load_checkpoint(tmp_path / "sim" / "checkpoint.pt")
    assert states_equal(ours["server"]["global_state"], theirs["server"]["global_state"])
    assert strip_time(ours["history"]) == strip_time(sim_history)
    saved = torch.load(sorted((tmp_path / "state").rglob("client000/after_round_*.pt"))[-1], weights_only=False)
    assert saved["state"]["objective"]
    assert saved["state"]["rounds_trained"] == theirs["clients"]["client000"]["rounds_trained"]


def test_lost_client_round_completes_and_it_rejoins(world, tmp_path):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=2", "eval.every=100"], names=NAMES))
    out = tmp_path / "run"
    lost = {"round": 0}

    def drop_dsb_in_first_round(node, msg, reply):
        if msg.metadata.message_type == "train" and node == 101 and msg.metadata.group_id == "0":
            lost["round"] += 1
            return None  # the node died: no reply
        return reply

    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=drop_dsb_in_first_round) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 5, "round-timeout": 1})
    history = load_checkpoint(out / "checkpoint.pt")["history"]
    assert lost["round"] == 1
    assert history[0]["clients"] == sorted(set(NAMES) - {"dsb"}, key=history[0]["clients"].index)
    assert "dsb" in history[0]["failed"] and "no reply" in history[0]["failed"]["dsb"]
    assert sorted(history[1]["clients"]) == sorted(NAMES) and "failed" not in history[1]
    hellos = [m for m in grid.sent if m.metadata.message_type == "query" and m.metadata.dst_node_id == 101]
    assert len(hellos) == 2  # asked again who it is after it was lost


def test_nan_update_is_rejected_and_the_round_goes_on(world, tmp_path, caplog):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=1", "eval.every=100"], names=NAMES))
    out = tmp_path / "run"

    def poison(node, msg, reply):
        if msg.metadata.message_type != "train" or node != 102:
            return reply
        plain = unpack(reply.content, "update")
        key = next(k for k, v in plain["state"].items() if v.is_floating_point())
        plain["state"][key] = torch.full_like(plain["state"][key], math.nan)
        return Message(pack(update=plain), reply_to=msg)

    with caplog.at_level("WARNING"), FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=poison) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 5})
    record = load_checkpoint(out / "checkpoint.pt")["history"][0]
    assert "dsc" not in record["clients"] and "non-finite" in record["failed"]["dsc"]
    state = load_checkpoint(out / "checkpoint.pt")["server"]["global_state"]
    assert all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point())
    assert "dsc" in caplog.text


def test_too_few_clients_stop_the_run_resumably(world, tmp_path):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=2", "eval.every=100", "fl.min_clients=3"],
                                                  names=NAMES))
    out = tmp_path / "run"
    two_nodes = nodes_for(tmp_path, NAMES[:2])
    with FakeGrid(flower_app.client_app, two_nodes) as grid, pytest.raises(RoundFailedError, match="min_clients=3"):
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 0})
    assert not (out / "checkpoint.pt").exists()
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path)) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "join-timeout": 5, "resume": "true"})
    assert len(load_checkpoint(out / "checkpoint.pt")["history"]) == 2


def test_server_resume_continues_bit_identically(world, simulated, tmp_path):
    # The server stops after round 1 (a crash, or a planned stop) and is resumed; nodes restart too.
    sim_dir, sim_history = simulated
    cfg_path = write_config(tmp_path, tiny_config(world, METHOD, names=NAMES))
    out = tmp_path / "run"
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "overrides": "fl.rounds=1", "join-timeout": 5})
    assert len(load_checkpoint(out / "checkpoint.pt")["history"]) == 1
    first_id = load_checkpoint(out / "checkpoint.pt")["server"]["run_id"]
    # The nodes' answers take a poll to arrive: the resumed server waits for them as a fresh one does.
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=fresh_process(), latency=1) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(out), "resume": True, "join-timeout": 5})
    ours = load_checkpoint(out / "checkpoint.pt")
    assert states_equal(ours["server"]["global_state"], load_checkpoint(sim_dir / "checkpoint.pt")["server"]["global_state"])
    assert strip_time(ours["history"]) == strip_time(sim_history)
    # The resumed run kept its id, so the nodes found (and kept adding to) its own state.
    assert ours["server"]["run_id"] == first_id
    for name in NAMES:
        assert run_ids(tmp_path / "state" / name) == {first_id: ["after_round_00000.pt", "after_round_00001.pt"]}


def test_a_node_retrains_a_round_from_the_state_before_it(world, tmp_path):
    cfg = tiny_config(world, names=NAMES)
    node = NodeClient(cfg, "dsa", tmp_path / "state", "run-0001")
    payload = {k: v.clone() for k, v in node.work_model.state_dict().items() if not k.startswith(private_prefixes())}
    first = node.fit(payload, {"round": 0})
    again = NodeClient(cfg, "dsa", tmp_path / "state", "run-0001")  # a new process, the server retries round 0
    assert again.restore(0) is None
    second = again.fit(payload, {"round": 0})
    assert states_equal(first.state, second.state)
    assert again.restore(1) == 0


def run_ids(state_dir):
    """The run folders under a node's state dir, and the rounds each holds."""
    return {p.name: sorted(q.name for q in p.rglob("after_round_*.pt")) for p in state_dir.iterdir() if p.is_dir()}


def test_runs_reusing_a_folder_name_keep_their_own_client_state(world, simulated, tmp_path):
    # An old run of three rounds in .../a/run, then a new run in .../b/run (same folder name) on the same
    # nodes: the new run starts from fresh client state, exactly as the simulator, and the old run's state stays.
    sim_dir, sim_history = simulated
    old_cfg = write_config(tmp_path, tiny_config(world, ["fl.rounds=3", "eval.every=100"], names=NAMES))
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(old_cfg), "out": str(tmp_path / "a" / "run"), "join-timeout": 5})
    new_cfg = write_config(tmp_path, tiny_config(world, METHOD, names=NAMES))
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=fresh_process()) as grid:
        serve(grid, {"config": str(new_cfg), "out": str(tmp_path / "b" / "run"), "join-timeout": 5})
    old, new = (load_checkpoint(tmp_path / d / "run" / "checkpoint.pt") for d in ("a", "b"))
    assert old["server"]["run_id"] != new["server"]["run_id"]
    assert states_equal(new["server"]["global_state"], load_checkpoint(sim_dir / "checkpoint.pt")["server"]["global_state"])
    assert strip_time(new["history"]) == strip_time(sim_history)
    for name in NAMES:  # each run pruned only its own files
        assert run_ids(tmp_path / "state" / name) == {
            old["server"]["run_id"]: ["after_round_00001.pt", "after_round_00002.pt"],
            new["server"]["run_id"]: ["after_round_00000.pt", "after_round_00001.pt"],
        }


def test_a_node_refuses_another_runs_state_and_bad_run_ids(world, tmp_path):
    cfg = tiny_config(world, names=NAMES)
    node = NodeClient(cfg, "dsa", tmp_path / "state", "run-aaaa")
    payload = {k: v.clone() for k, v in node.work_model.state_dict().items() if not k.startswith(private_prefixes())}
    node.fit(payload, {"round": 0})
    # A state file that ended up under another run's folder (copied by hand) is refused, not trained from.
    (tmp_path / "state" / "run-bbbb").mkdir()
    (tmp_path / "state" / "run-aaaa" / "dsa").rename(tmp_path / "state" / "run-bbbb" / "dsa")
    with pytest.raises(NodeStateError, match="run 'run-aaaa'.*this is run 'run-bbbb'"):
        NodeClient(cfg, "dsa", tmp_path / "state", "run-bbbb").restore(1)
    for bad in ("../../etc", "short", "", "a" * 65):
        with pytest.raises(NodeStateError, match="run id"):
            NodeClient(cfg, "dsa", tmp_path / "state", bad)


def test_a_planted_pickle_in_the_state_dir_is_refused_and_runs_nothing(world, tmp_path):
    """Node state is loaded with weights_only=True: a pickle that would run code is an error, not a restore."""
    import pickle

    cfg = tiny_config(world, names=NAMES)
    node = NodeClient(cfg, "dsa", tmp_path / "state", "run-aaaa")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    node.folder.mkdir(parents=True)
    node.state_path(0).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(NodeStateError, match="cannot read node state .*after_round_00000.pt"):
        node.restore(1)
    assert not marker.exists()


def tamper_update(node_id, change):
    """A tamper hook: ``change(plain_update)`` on node ``node_id``'s train replies (then re-encoded)."""

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or node != node_id:
            return reply
        plain = unpack(reply.content, "update")
        change(plain)
        return Message(pack(update=plain), reply_to=msg)

    return hook


def both(*hooks):
    def hook(node, msg, reply):
        for h in hooks:
            reply = h(node, msg, reply)
        return reply

    return hook


def test_bad_kd_features_leave_the_client_out_not_the_run(world, tmp_path, caplog):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.kd=true", "fl.kd_every=1", "fl.rounds=1",
                                                          "eval.every=100", "fl.min_clients=1"], names=NAMES))

    def truncate(plain):
        plain["metadata"]["kd_features"] = plain["metadata"]["kd_features"][:-1]

    def drop(plain):
        del plain["metadata"]["kd_features"]

    tamper = both(tamper_update(101, truncate), tamper_update(102, drop))
    with caplog.at_level("WARNING"), FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=tamper) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5})
    record = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0]
    assert record["clients"] == ["dsa"] and record["kd"]["kd_teachers"] == 1
    assert "kd: kd_features has shape" in record["failed"]["dsb"]
    assert "kd: no kd_features" in record["failed"]["dsc"]
    assert "dsb" in caplog.text and "dsc" in caplog.text


def test_a_node_answering_hello_with_no_mapping_is_left_out_not_the_run(world, tmp_path, caplog):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=1", "eval.every=100"], names=NAMES))

    def odd_hello(node, msg, reply):
        if node == 102 and msg.metadata.group_id == "hello":
            return Message(pack(hello=["x"]), reply_to=msg)
        return reply

    with caplog.at_level("WARNING"), FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=odd_hello) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 1})
    record = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0]
    assert sorted(record["clients"]) == ["dsa", "dsb"] and record["failed"]["dsc"] == "not connected"
    assert "node 102: malformed answer (the answer is a list, not a mapping)" in caplog.text


def test_wrong_dtype_and_nested_non_finite_metadata_are_rejected(world, tmp_path):
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=1", "eval.every=100"], names=NAMES))

    def to_int(plain):
        key = next(k for k, v in plain["state"].items() if v.is_floating_point())
        plain["state"][key] = plain["state"][key].long()

    def nested_nan(plain):
        plain["metadata"]["extra"] = {"parts": [torch.zeros(2), torch.tensor([1.0, math.inf])]}

    tamper = both(tamper_update(101, to_int), tamper_update(102, nested_nan))
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path), tamper=tamper) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5})
    record = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0]
    assert record["clients"] == ["dsa"]
    assert "dtype torch.int64, expected torch.float32" in record["failed"]["dsb"]
    assert "metadata 'extra' holds non-finite values" in record["failed"]["dsc"]


def test_bad_fedftg_class_counts_leave_the_client_out(tmp_path):
    from fedreid.config import load_config

    overrides = ["task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd",
                 "classification.num_clients=4", "classification.alpha=0.5", "train.batch_size=32",
                 "train.drop_last=false", "fl.rounds=1", "eval.every=1", "run.device=cpu", "run.tensorboard=false",
                 "fl.fedftg=true", "fl.fedftg_options={iterations: 1, global_steps: 1, batch_size: 8}"]
    cfg_path = write_config(tmp_path, load_config(None, overrides))
    names = [f"client{k:03d}" for k in range(4)]

    def short(plain):
        plain["metadata"]["class_counts"] = plain["metadata"]["class_counts"][:-1]

    def negative(plain):
        plain["metadata"]["class_counts"][0] = -1.0

    def missing(plain):
        del plain["metadata"]["class_counts"]

    tamper = both(tamper_update(101, short), tamper_update(102, negative), tamper_update(103, missing))
    with FakeGrid(flower_app.client_app, nodes_for(tmp_path, names), tamper=tamper) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5})
    record = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0]
    assert record["clients"] == ["client000"] and record["fedftg"]["fedftg_teachers"] == 1
    assert "fedftg: class_counts has shape (9,), expected (10,)" in record["failed"]["client001"]
    assert "fedftg: class_counts must be finite and >= 0" in record["failed"]["client002"]
    assert "fedftg: no class_counts" in record["failed"]["client003"]


@pytest.mark.parametrize("node_auth", [True, False])
def test_a_second_node_claiming_a_held_client(world, tmp_path, caplog, node_auth):
    # Node 103 also says it is dsb while node 101 (dsb) is connected. With node authentication it is refused
    # until 101 has left (after round 1 here); without, the newer claim wins (a restarted node, new id).
    cfg_path = write_config(tmp_path, tiny_config(world, ["fl.rounds=2", "eval.every=100"], names=NAMES))
    nodes = nodes_for(tmp_path)
    nodes[103] = {"client": "dsb", "state-dir": str(tmp_path / "state" / "other")}
    grids = []

    def node_101_leaves_after_round_1(node, msg, reply):
        if msg.metadata.message_type == "train" and node == 101:
            del grids[0].nodes[101]
        return reply

    with caplog.at_level("WARNING"), FakeGrid(flower_app.client_app, nodes, tamper=node_101_leaves_after_round_1) as grid:
        grids.append(grid)
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 5,
                     "node-auth": node_auth})
    trained_by = [(int(m.metadata.group_id), m.metadata.dst_node_id) for m in grid.sent
                  if m.metadata.message_type == "train" and unpack(m.content, "run")["client"] == "dsb"]
    history = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"]
    assert all(sorted(rec["clients"]) == sorted(NAMES) for rec in history)
    if node_auth:
        assert trained_by == [(0, 101), (1, 103)]
        assert "node 103 claims to be client 'dsb', which connected node 101 is: refused" in caplog.text
        assert "client 'dsb' is now node 103 (node 101, which held it, has left)" in caplog.text
    else:
        assert trained_by == [(0, 103), (1, 103)]
        assert "client 'dsb' now answers from node 103 (was node 101)" in caplog.text


def test_settings_and_refusals(world):
    with pytest.raises(ConfigError, match="'out'"):
        flower_app.ServerSettings.from_run_config({"config": "x.yaml"})
    with pytest.raises(ConfigError, match="unknown key.*outt"):
        flower_app.ServerSettings.from_run_config({"outt": "runs/x"})
    with pytest.raises(ConfigError, match="'client'"):
        flower_app.NodeSettings.from_node_config({"state-dir": "/tmp/x"})
    node = flower_app.NodeSettings.from_node_config({"client": "dsa", "prepared-root": "/data/prepared",
                                                     "device": "cuda:1"})
    assert node.local_overrides == ("data.prepared_root=/data/prepared", "run.device=cuda:1")
    assert flower_app.ServerSettings.from_run_config({"out": "r", "node-auth": "true"}).node_auth
    assert not flower_app.ServerSettings.from_run_config({"out": "r"}).node_auth
    # A misspelt flag, a bad duration or an unknown node key is one line naming it, never a silent default.
    for run_config, words in [({"resume": "maybe"}, "resume: expected true or false, got 'maybe'"),
                              ({"round-timeout": "abc"}, "round-timeout: expected seconds, got 'abc'"),
                              ({"round-timeout": -5}, "round-timeout: expected seconds > 0, got -5.0"),
                              ({"join-timeout": "nan"}, "join-timeout: expected seconds >= 0, got nan")]:
        with pytest.raises(ConfigError, match=words):
            flower_app.ServerSettings.from_run_config({"out": "r", **run_config})
    assert flower_app.ServerSettings.from_run_config({"out": "r", "join-timeout": 0, "resume": "no"}).join_timeout == 0
    with pytest.raises(ConfigError, match="unknown key\\(s\\) prepard-root"):
        flower_app.NodeSettings.from_node_config({"client": "dsa", "prepard-root": "/data"})
    with pytest.raises(ConfigError, match="partition-id: expected a client number, got 'abc'"):
        flower_app.NodeSettings.from_node_config({"partition-id": "abc", "num-partitions": 3})
    assert flower_app.NodeSettings.from_node_config({"partition-id": 2, "num-partitions": 3}).site == "partition-2"
    with pytest.raises(ConfigError, match="fl.kd.*need"):
        flower_app.check_secure_aggregation(tiny_config(world, ["fl.kd=true"]), True)
    with pytest.raises(ConfigError, match="not supported"):
        flower_app.check_secure_aggregation(tiny_config(world), True)
    flower_app.check_secure_aggregation(tiny_config(world, ["fl.kd=true"]), False)


def test_codec_round_trips_nested_tensors_exactly():
    from fedreid.fl.update import Update

    state = {"w": torch.randn(3, 2), "bn.num_batches_tracked": torch.tensor(7), "h": torch.randn(4).half()}
    meta = {"train_loss": 0.25, "kd_features": torch.randn(5, 4), "counts": [3, 0, 2],
            "control": {"a.b": torch.randn(2), "c": torch.zeros(1, dtype=torch.float64)}, "note": None}
    back = update_from_plain(unpack(pack(update=update_to_plain(Update("dsa", state, 10, meta))), "update"))
    assert back.client == "dsa" and back.num_samples == 10 and list(back.state) == list(state)
    assert all(torch.equal(back.state[k], v) and back.state[k].dtype == v.dtype for k, v in state.items())
    assert torch.equal(back.metadata["kd_features"], meta["kd_features"])
    assert torch.equal(back.metadata["control"]["a.b"], meta["control"]["a.b"])
    assert back.metadata["control"]["c"].dtype == torch.float64
    assert back.metadata["counts"] == [3, 0, 2] and back.metadata["note"] is None
    # "a/b" and "a" -> "b" would name one tensor: a key holding "/" does not travel
    from fedreid.flower.codec import CodecError

    with pytest.raises(CodecError, match="only string keys without '/' can travel, got 'a/b'"):
        pack(update={"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}})
