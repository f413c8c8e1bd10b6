from pathlib import Path

import numpy as np
import pytest

from fedreid.config import load_config
from fedreid.data.prepared import PreparedDataset, Record, dataset_card
from fedreid.data.scenarios import (
    ScenarioError,
    build_clients,
    by_camera,
    by_dataset,
    by_identity,
    leave_one_out,
)


def make_dataset(name: str, num_ids: int, cams: int = 3, per_cam: int = 2) -> PreparedDataset:
    root = Path("/prepared") / name
    records = []
    for pid in range(10, 10 + num_ids):
        for cam in range(cams):
            for k in range(per_cam):
                split = "val" if (cam, k) == (0, 0) else "train"
                records.append(Record(root / f"{pid}_{cam}_{k}.jpg", pid, cam, split))
    records.append(Record(root / "q.jpg", 10, 0, "query"))
    records.append(Record(root / "g.jpg", 10, 1, "gallery"))
    return PreparedDataset(root, records, dataset_card(records))


def check_label_space(client):
    assert client.labels.dtype == np.int64
    assert sorted(set(client.labels.tolist())) == list(range(client.num_classes))
    for rec, label in zip(client.records, client.labels):
        assert client.pids[label] == rec.pid
    assert all(r.split in ("train", "val") for r in client.records)


def test_by_dataset_one_client_each_with_private_labels():
    a, b = make_dataset("a", 5), make_dataset("b", 3)
    clients = by_dataset([a, b])
    assert [c.name for c in clients] == ["a", "b"]
    assert [c.num_classes for c in clients] == [5, 3]
    assert len(clients[0]) == 5 * 3 * 2  # train_all = train + val
    assert len(by_dataset([a], split="train")[0]) == 5 * 5
    for c in clients:
        check_label_space(c)


def test_by_camera():
    ds = make_dataset("msmt", 4, cams=3)
    clients = by_camera(ds)
    assert [c.name for c in clients] == ["msmt/cam0", "msmt/cam1", "msmt/cam2"]
    for cam, client in enumerate(clients):
        assert {r.camid for r in client.records} == {cam}
        assert client.num_classes == 4
        check_label_space(client)
    assert sum(len(c) for c in clients) == len(ds.split("train_all"))


def test_by_identity_near_equal_groups_disjoint_complete_seeded():
    ds = make_dataset("cuhk", 11)
    clients = by_identity(ds, 3, np.random.default_rng(0), equal_groups=False)
    id_sets = [set(c.pids) for c in clients]
    assert sum(len(s) for s in id_sets) == 11
    assert set.union(*id_sets) == {r.pid for r in ds.split("train_all")}
    assert all(not (x & y) for i, x in enumerate(id_sets) for y in id_sets[i + 1:])
    assert sorted(len(s) for s in id_sets) == [3, 4, 4]
    for c in clients:
        check_label_space(c)
        assert {r.pid for r in c.records} == set(c.pids)
    same = by_identity(ds, 3, np.random.default_rng(0), equal_groups=False)
    other = by_identity(ds, 3, np.random.default_rng(1), equal_groups=False)
    assert [c.pids for c in same] == [c.pids for c in clients]
    assert [c.pids for c in other] != [c.pids for c in clients]


def test_by_identity_equal_groups_is_the_default_and_leaves_the_remainder_out():
    ds = make_dataset("cuhk", 11)
    clients = by_identity(ds, 3, np.random.default_rng(0))
    assert [c.num_classes for c in clients] == [3, 3, 3]
    id_sets = [set(c.pids) for c in clients]
    assert all(not (x & y) for i, x in enumerate(id_sets) for y in id_sets[i + 1:])
    left_out = {r.pid for r in ds.split("train_all")} - set.union(*id_sets)
    assert len(left_out) == 11 % 3
    near = by_identity(ds, 3, np.random.default_rng(0), equal_groups=False)
    assert [c.num_classes for c in near] == [4, 4, 3]  # near-equal groups lose no identity


def test_errors():
    ds = make_dataset("tiny", 2)
    with pytest.raises(ScenarioError, match="cannot split 2 identities into 3 clients"):
        by_identity(ds, 3, np.random.default_rng(0))
    empty = PreparedDataset(Path("/p/empty"), [Record(Path("/q"), 1, 0, "query")], {})
    with pytest.raises(ScenarioError, match="client 'empty' has no training images"):
        by_dataset([empty])


def test_build_clients_from_config():
    datasets = {"a": make_dataset("a", 6), "b": make_dataset("b", 4)}
    rng = np.random.default_rng(0)
    cfg = load_config(None, []).scenario
    assert len(build_clients(cfg, datasets, rng)) == 2
    cfg = load_config(None, ["scenario.kind=by_identity", "scenario.dataset=a", "scenario.num_clients=2"]).scenario
    assert [c.name for c in build_clients(cfg, datasets, rng)] == ["a/part1", "a/part2"]
    # num_clients null (the default): one client per camera of the training split (3 here)
    cfg = load_config(None, ["scenario.kind=by_identity", "scenario.dataset=a"]).scenario
    assert cfg.num_clients is None and cfg.equal_groups
    clients = build_clients(cfg, datasets, rng)
    assert [c.name for c in clients] == ["a/part1", "a/part2", "a/part3"]
    assert [c.num_classes for c in clients] == [2, 2, 2]
    cfg = load_config(None, ["scenario.kind=by_identity", "scenario.dataset=a", "scenario.equal_groups=false",
                             "scenario.num_clients=4"]).scenario
    assert sorted(c.num_classes for c in build_clients(cfg, datasets, rng)) == [1, 1, 2, 2]
    cfg = load_config(None, ["scenario.kind=by_camera", "scenario.dataset=zzz"]).scenario
    with pytest.raises(ScenarioError, match="scenario.dataset='zzz' is not among"):
        build_clients(cfg, datasets, rng)


def test_leave_one_out_trains_every_dataset_but_the_target():
    datasets = [make_dataset("c2", 3), make_dataset("c3", 4), make_dataset("m", 5), make_dataset("ms", 6)]
    clients = leave_one_out(datasets, "m")
    assert [c.name for c in clients] == ["c2", "c3", "ms"]
    assert all(r.path.parent.name != "m" for c in clients for r in c.records)
    for c in clients:
        check_label_space(c)
    cfg = load_config(None, ["data.datasets=[c2,c3,m,ms]", "scenario.kind=leave_one_out",
                             "scenario.target=ms"]).scenario
    names = [c.name for c in build_clients(cfg, {d.name: d for d in datasets}, np.random.default_rng(0))]
    assert names == ["c2", "c3", "m"]
    with pytest.raises(ScenarioError, match="scenario.target='zz' is not among the datasets"):
        leave_one_out(datasets, "zz")
    with pytest.raises(ScenarioError, match="leaves no source dataset"):
        leave_one_out(datasets[:1], "c2")
    train_only = PreparedDataset(Path("/p/t"), [r for r in make_dataset("t", 3).records
                                                if r.split in ("train", "val")], {})
    with pytest.raises(ScenarioError, match="scenario.target='t' has no query/gallery split"):
        leave_one_out([*datasets, train_only], "t")


@pytest.mark.parametrize("overrides, message", [
    (["scenario.kind=leave_one_out"], "scenario.target: scenario kind 'leave_one_out' needs the unseen target"),
    (["scenario.target=market1501"], "scenario.target: only scenario kind 'leave_one_out' has a target"),
    (["data.datasets=[cuhk02,market1501]", "scenario.kind=leave_one_out", "scenario.target=market"],
     r"scenario.target: 'market' is not one of data.datasets \(cuhk02, market1501\) \(did you mean market1501\?\)"),
    (["data.datasets=[market1501]", "scenario.kind=leave_one_out", "scenario.target=market1501"],
     "leave_one_out needs the target and at least one source"),
])
def test_leave_one_out_config_errors(overrides, message):
    from fedreid.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_leave_one_out_run_never_trains_on_the_target_and_evaluates_only_it(tmp_path):
    from fl_helpers import tiny_config, write_world

    from fedreid.config import ConfigError
    from fedreid.fl.federation import build_client, build_federation
    from fedreid.fl.inputs import MissingInputsError, check_inputs
    from fedreid.fl.simulation import run_simulation

    names = ("dsa", "dsb", "dsc")
    world = write_world(tmp_path / "prepared", names=names)
    cfg = tiny_config(world, ["scenario.kind=leave_one_out", "scenario.target=dsb", "fl.rounds=1"], names=names)
    fed = build_federation(cfg)
    assert [c.name for c in fed.clients] == ["dsa", "dsc"]
    history = run_simulation(cfg, tmp_path / "run", progress=False)
    assert list(history[-1]["eval"]) == ["dsb"]
    assert set(history[-1]["clients"]) == {"dsa", "dsc"}
    # a machine holding one source builds the client the simulation has, at the same position
    client, _ = build_client(cfg, "dsc")
    assert client.index == 1 and client.name == "dsc"
    with pytest.raises(ConfigError, match="not one of the client datasets"):
        build_client(cfg, "dsb")
    # KD's public set may not be the unseen target
    kd_on_target = tiny_config(world, ["scenario.kind=leave_one_out", "scenario.target=dsb", "fl.kd=true",
                                       "data.public_dataset=dsb"], names=names)
    with pytest.raises(ConfigError, match="the leave_one_out target, which no client may see"):
        check_inputs(kd_on_target)
    # the target is an input too: missing, it is named before anything is written
    missing = tiny_config(tmp_path / "elsewhere", ["scenario.kind=leave_one_out", "scenario.target=dsb"],
                          names=names)
    with pytest.raises(MissingInputsError, match="dsa, dsb, dsc"):
        check_inputs(missing)
