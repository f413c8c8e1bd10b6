"""The Flower deployment path against what crosses machines: decoding, key files, paths at the door.

A reply, a hello or a message part comes from another machine: whatever it
holds, the ServerApp leaves that client out with a one-line reason and goes
on (``FakeGrid``, see ``flower_fakes.py``). Key material is never readable
by others and never overwrites a file; a path a user passes is refused at
the door, naming it, rather than by a Flower process in its log.
"""

import json
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import tomli
import torch
from fl_helpers import tiny_config, write_prepared, write_world
from flower_fakes import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.config import parse_config_args

from fedreid.config import dump_config
from fedreid.fl.update import Update, private_prefixes
from fedreid.flower import app as flower_app
from fedreid.flower import deployment, launch, security
from fedreid.flower.codec import CodecError, flatten, pack, unpack, update_from_plain, update_to_plain
from fedreid.utils.checkpoint import load_checkpoint
from fedreid.utils.io import OutputDirError

NAMES = ("dsa", "dsb", "dsc")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = write_world(tmp_path_factory.mktemp("prepared"))
    write_prepared(root, "dsc", num_ids=3, seed=5)
    return root


def serve(grid, run_config):
    flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                         run_config=run_config))


def one_round(world, tmp_path, tamper, extra_nodes=None, overrides=()):
    """One round over a fake grid of the three clients (plus ``extra_nodes``); the round's record."""
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(dump_config(tiny_config(world, ["fl.rounds=1", "eval.every=100", *overrides], names=NAMES)))
    nodes = {100 + i: {"client": n, "state-dir": str(tmp_path / "state" / n)} for i, n in enumerate(NAMES)}
    nodes.update(extra_nodes or {})
    with FakeGrid(flower_app.client_app, nodes, tamper=tamper) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 2})
    return load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0], grid


# ------------------------------------------------------------------ codec: what a client sends back


def test_an_update_with_infinite_samples_or_a_bottomless_document_leaves_its_client_out(world, tmp_path):
    # num_samples=Infinity (JSON allows it) made int() raise OverflowError, a document nested past the
    # recursion limit made json.loads raise RecursionError: both crashed the ServerApp, not the one client.
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or node == 100:
            return reply
        plain = unpack(reply.content, "update")
        if node == 101:
            plain["num_samples"] = math.inf
            return Message(pack(update=plain), reply_to=msg)
        content = pack(update=plain)
        content["update.json"] = ConfigRecord({"json": "[" * 100_000 + "]" * 100_000})
        return Message(content, reply_to=msg)

    record, _ = one_round(world, tmp_path, hook)
    assert record["clients"] == ["dsa"]
    assert record["failed"]["dsb"] == ("update rejected: malformed update: num_samples: expected a whole number, "
                                       "got float inf")
    assert record["failed"]["dsc"] == "update rejected: update: not a JSON document (RecursionError)"


def good_plain():
    return update_to_plain(Update("dsa", {"w": torch.zeros(2)}, 5, {"train_loss": 0.1}))


@pytest.mark.parametrize("field, value, words", [
    ("num_samples", 2.7, "num_samples: expected a whole number, got float 2.7"),  # was FedAvg weight 2
    ("num_samples", True, "num_samples: expected a whole number, got bool True"),  # was weight 1
    ("num_samples", "7", "num_samples: expected a whole number, got str '7'"),
    ("head_shared", "false", "head_shared: expected bool, got str 'false'"),  # was head_shared=True
    ("client", None, "client: expected str, got NoneType None"),  # was the client 'None'
    ("metadata", [["a", 1]], "metadata: expected dict, got list"),
    ("state", {"w": 3}, "state 'w': expected a tensor, got int"),
])
def test_an_update_field_of_another_type_is_refused_not_coerced(field, value, words):
    plain = good_plain()
    plain[field] = value
    with pytest.raises(CodecError, match=f"^malformed update: {words}"):
        update_from_plain(plain)


def test_an_update_missing_or_adding_fields_is_refused():
    plain = good_plain()
    del plain["num_samples"]
    plain["extra"] = 1
    with pytest.raises(CodecError, match="^malformed update: no num_samples; unknown extra$"):
        update_from_plain(plain)
    with pytest.raises(CodecError, match="expected a mapping, got a list"):
        update_from_plain(["x"])
    back = update_from_plain(unpack(pack(update=good_plain()), "update"))
    assert back.num_samples == 5 and back.head_shared is False and torch.equal(back.state["w"], torch.zeros(2))


def test_unreadable_parts_are_one_line_codec_errors():
    content = pack(update=good_plain())
    content["update.json"] = ConfigRecord({"json": "{not json"})
    with pytest.raises(CodecError, match=r"^update: not a JSON document \(JSONDecodeError\)$"):
        unpack(content, "update")
    content = pack(update=good_plain())
    content["update.arrays"] = ArrayRecord({"update/state/w": Array(np.array(["ab", "c"]))})  # no torch dtype
    with pytest.raises(CodecError, match="^update: tensor 'update/state/w' cannot be read"):
        unpack(content, "update")
    content = pack(update=good_plain())
    content["update.json"] = ConfigRecord({"json": json.dumps({"__tensor__": ["x"]})})
    with pytest.raises(CodecError, match="does not carry it"):
        unpack(content, "update")


# ------------------------------------------------------------------ app: hellos and what leaves a node


def test_a_hello_with_an_infinite_partition_is_ignored_not_fatal(world, tmp_path, caplog):
    # int(Infinity) raised OverflowError in the server's discovery: one node's answer stopped the run.
    def hook(node, msg, reply):
        if node == 103 and msg.metadata.group_id == "hello":
            return Message(pack(hello={"partition": math.inf}), reply_to=msg)
        return reply

    stranger = {103: {"client": "dsa", "state-dir": str(tmp_path / "state" / "x")}}
    with caplog.at_level("WARNING"):
        record, _ = one_round(world, tmp_path, hook, extra_nodes=stranger)
    assert sorted(record["clients"]) == sorted(NAMES)
    assert "node 103: malformed answer (partition: expected a client number, got inf)" in caplog.text


def test_a_node_failing_its_hello_is_not_asked_again_at_every_poll(world, tmp_path, caplog):
    # Each message starts a ClientApp process on the node: a node whose ClientApp fails (here a misspelt
    # node-config key) was sent a new hello at every poll (12 in a 5 s join-timeout), now once a minute.
    def app(msg, context):  # as Flower's ClientApp runtime: an exception becomes an error reply
        try:
            return flower_app.client_app(msg, context)
        except Exception as exc:  # noqa: BLE001
            return Message(Error(code=2, reason=str(exc)), reply_to=msg)

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(dump_config(tiny_config(world, ["fl.rounds=1", "eval.every=100"], names=NAMES)))
    nodes = {100 + i: {"client": n, "state-dir": str(tmp_path / "state" / n)} for i, n in enumerate(NAMES)}
    nodes[102]["prepard-root"] = "/data"
    with caplog.at_level("WARNING"), FakeGrid(app, nodes) as grid:
        serve(grid, {"config": str(cfg_path), "out": str(tmp_path / "run"), "join-timeout": 2})
    record = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["history"][0]
    assert record["failed"] == {"dsc": "not connected"}
    assert [m.metadata.dst_node_id for m in grid.sent].count(102) == 1
    assert caplog.text.count("node 102 did not say which client it is: flower node config: unknown key") == 1


def test_no_identity_head_crosses_the_wire_either_way(world, tmp_path):
    """Every tensor of every message, both ways (payload, instructions, update, metadata, KD features):
    no private key, and no tensor equal to a client's head kept on its node."""
    sent_back = []

    def hook(node, msg, reply):
        sent_back.append(reply)
        return reply

    record, grid = one_round(world, tmp_path, hook, overrides=["fl.cdw=true", "fl.kd=true", "fl.kd_every=1"])
    assert sorted(record["clients"]) == sorted(NAMES)
    tensors = {}
    for msg in [*grid.sent, *sent_back]:
        for part in sorted({k.rsplit(".", 1)[0] for k in msg.content.keys()}):
            tensors.update(flatten(unpack(msg.content, part), part)[1])
    assert any(k.startswith("update/metadata/kd_features") for k in tensors)  # the replies were looked at
    private = [k for k in tensors if k.split("/")[-1].startswith(private_prefixes())]
    assert private == []
    heads = [torch.load(p, weights_only=True)["state"]["head"]
             for p in sorted((tmp_path / "state").rglob("after_round_*.pt"))]
    assert len(heads) == len(NAMES)
    for head in heads:
        for value in head.values():
            assert not any(t.shape == value.shape and torch.equal(t, value) for t in tensors.values())


# ------------------------------------------------------------------ security: key files


def test_a_private_key_is_never_readable_by_others_while_it_is_written(tmp_path, monkeypatch):
    # The key used to be written into a 0644 temporary file and chmod-ed to 0600 only afterwards.
    modes = []
    real_write_bytes, real_fdopen = Path.write_bytes, os.fdopen

    def spy_write_bytes(self, data):
        done = real_write_bytes(self, data)
        modes.append((b"PRIVATE KEY" in data, stat.S_IMODE(self.stat().st_mode)))
        return done

    class SpyFile:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            done = self.fh.write(data)
            self.fh.flush()
            modes.append((b"PRIVATE KEY" in data, stat.S_IMODE(os.fstat(self.fh.fileno()).st_mode)))
            return done

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(Path, "write_bytes", spy_write_bytes)
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: SpyFile(real_fdopen(*a, **k)))
    old = os.umask(0o022)
    try:
        security.make_node_key(tmp_path / "keys", "node0")
        security.make_tls_files(tmp_path / "tls")
    finally:
        os.umask(old)
    private = [mode for is_key, mode in modes if is_key]
    assert len(private) == 2 and all(mode == 0o600 for mode in private), modes
    assert stat.S_IMODE((tmp_path / "keys" / "node0.pub").stat().st_mode) == 0o644  # public files stay plain
    assert stat.S_IMODE((tmp_path / "tls" / "ca.crt").stat().st_mode) == 0o644
    assert not [p for p in (tmp_path / "keys").iterdir() if p.name.endswith(".tmp")]


def test_a_key_file_that_appears_meanwhile_is_not_overwritten(tmp_path, monkeypatch):
    # Between the "exists?" check and the write another process creates the file: it stays as it is.
    target = tmp_path / "token"
    target.write_text("the user's\n")
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: False if self == target else real_exists(self))
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        security.write_new_file(target, b"new secret\n", private=True)
    assert target.read_text() == "the user's\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]  # no temporary file left


def test_key_files_are_written_where_there_are_no_hard_links(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    security.write_new_file(tmp_path / "k", b"secret\n", private=True)
    assert (tmp_path / "k").read_bytes() == b"secret\n" and stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


# ------------------------------------------------------------------ deployment and launch: paths at the door


def test_a_ca_that_is_not_a_file_is_refused_at_the_door(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"node: --ca {tmp_path / 'nope.crt'} is not a file"):
        deployment.checked_ca(str(tmp_path / "nope.crt"), False, "node")
    (tmp_path / "ca.crt").write_text("x")
    assert deployment.checked_ca(str(tmp_path / "ca.crt"), False, "run") == tmp_path / "ca.crt"
    assert deployment.checked_ca(None, True, "run") is None


def test_a_work_folder_of_the_users_files_is_not_adopted(tmp_path):
    # Names that merely start like ours (statements.pdf ~ "state", keys_backup ~ "keys") are the user's.
    work = tmp_path / "work"
    work.mkdir()
    (work / "statements.pdf").write_text("mine")
    (work / "keys_backup").mkdir()
    with pytest.raises(OutputDirError, match="keys_backup, statements.pdf"):
        deployment.claim_local_folders(tmp_path / "out", str(work), False)
    assert sorted(p.name for p in work.iterdir()) == ["keys_backup", "statements.pdf"]
    assert not (tmp_path / "out").exists()
    # An earlier version's work folder (no marker), the SuperLink's SQLite side files included, is adopted.
    earlier = tmp_path / "earlier"
    for name in ("logs", "state", "tls", "flwr_home"):
        (earlier / name).mkdir(parents=True)
    for name in ("superlink.db", "superlink.db-wal", "superlink.db-shm", "flwr_run.log"):
        (earlier / name).write_text("")
    assert deployment.claim_local_folders(tmp_path / "out2", str(earlier), False) == earlier.resolve()


def test_flwr_home_config_reads_back_paths_with_quotes_and_backslashes(tmp_path):
    ca = tmp_path / 'my "certs"\\x' / "ca.crt"  # TOML syntax inside a basic string, written as is before
    launch.FlowerCli("127.0.0.1:9093", root_cert=ca, home=tmp_path / "home")
    config = tomli.loads((tmp_path / "home" / "config.toml").read_text())
    assert config["superlink"]["fedreid"] == {"address": "127.0.0.1:9093", "root-certificates": str(ca.resolve())}


def test_control_characters_in_config_values_are_refused_naming_the_key(tmp_path):
    # Flower's parser refused these at the SuperNode's start with "invalid format", naming nothing.
    for bad in ("/srv/a\nb", "/srv/a\x07b"):
        with pytest.raises(launch.LaunchError, match="node config state-dir=.*control characters"):
            launch.node_config_string("dsa", bad)
        with pytest.raises(launch.LaunchError, match="out path .*cannot be passed to flwr run"):
            launch.run_config_string(tmp_path / "c.yaml", Path(bad))
        with pytest.raises(launch.LaunchError, match="override .*cannot be passed to flwr run"):
            launch.run_config_string(tmp_path / "c.yaml", tmp_path / "out", [f"data.prepared_root={bad}"])
    text = launch.node_config_string("dsa", "/srv/a\tb c", prepared_root="/data/x=y")
    assert parse_config_args([text]) == {"client": "dsa", "state-dir": "/srv/a\tb c", "prepared-root": "/data/x=y"}
