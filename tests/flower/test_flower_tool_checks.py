"""tools/flower_fed.py around Flower, without Flower running: checks at the door, what `run` shows and
leaves behind, printed command lines.

``flwr`` is replaced by a small shell script (it prints a ServerApp-like line,
its FLWR_HOME's ``config.toml``, and exits with ``$FAKE_FLWR_RC``); nothing
connects anywhere. The door checks are compared with what the ServerApp
itself says for the same input.
"""

import math
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
from fl_helpers import tiny_config, write_world
from flower_fakes import FakeGrid
from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args

from fedreid.commands import flower_fed
from fedreid.config import Config, ConfigError, dump_config, from_dict, load_config
from fedreid.fl.simulation import check_resumable, run_simulation
from fedreid.flower import app as flower_app
from fedreid.flower import launch
from fedreid.flower.app import ServerSettings
from fedreid.flower.deployment import prepare_run, supernode_launch
from fedreid.flower.launch import FlowerCli, run_config_string
from fedreid.utils.checkpoint import load_checkpoint

FAKE_FLWR = """#!/bin/sh
echo "fedreid INFO: round 1: 2 clients, loss 1.234 (fake ServerApp)"
cat "$FLWR_HOME/config.toml"
echo "$FLWR_HOME" >> "{homes}"
exit "${{FAKE_FLWR_RC:-0}}"
"""


@pytest.fixture
def fake_flwr(tmp_path, monkeypatch):
    """``flwr`` is the fake; temporary folders go to a folder of this test's own. Returns (homes file, tmp)."""
    homes = tmp_path / "homes.txt"
    script = tmp_path / "flwr"
    script.write_text(FAKE_FLWR.format(homes=homes))
    script.chmod(0o755)
    monkeypatch.setattr(launch, "_exe", lambda name: str(script) if name == "flwr" else name)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return homes, tmp


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(tiny_config(tmp_path / "prepared", ["fl.rounds=1"])))
    return path


# ------------------------------------------------------------------ door checks


@pytest.mark.parametrize("option, value", [
    ("round_timeout", -5.0), ("round_timeout", 0.0), ("round_timeout", math.inf), ("round_timeout", math.nan),
    ("join_timeout", -1.0), ("join_timeout", math.nan), ("join_timeout", math.inf),
])
def test_the_door_refuses_timeouts_as_the_server_app_does(config_file, tmp_path, option, value):
    with pytest.raises(ConfigError) as door:
        prepare_run(out=str(tmp_path / "run"), config=str(config_file), overrides=[], resume=False,
                    **{option: value})
    with pytest.raises(ConfigError) as server:
        ServerSettings.from_run_config({"out": "run", option.replace("_", "-"): value})
    assert str(door.value) == str(server.value) and "\n" not in str(door.value)
    assert not (tmp_path / "run").exists()


def test_the_door_accepts_what_the_server_app_accepts(config_file, tmp_path):
    run = prepare_run(out=str(tmp_path / "run"), config=str(config_file), overrides=[], resume=False,
                      round_timeout=0.5, join_timeout=0.0)
    settings = ServerSettings.from_run_config(parse_config_args([run.run_config]))
    assert (settings.round_timeout, settings.join_timeout) == (0.5, 0.0)


def test_an_override_with_spaces_reaches_the_server_app_as_one(tmp_path):
    overrides = ["fl.rounds=2", "fl.hooks=[{name: fedavgm, momentum: 0.9}]", "run.out_dir=a b"]
    text = run_config_string(tmp_path / "run.yaml", tmp_path / "run", overrides)
    assert ServerSettings.from_run_config(parse_config_args([text])).overrides == overrides
    with pytest.raises(launch.LaunchError, match="quotes"):
        run_config_string(tmp_path / "run.yaml", tmp_path / "run", ['run.out_dir="x"'])


def serve(grid, run_config):
    flower_app.server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                         run_config=run_config))


def test_the_door_refuses_local_mode_as_the_server_app_does(tmp_path):
    cfg = tiny_config(tmp_path / "prepared", ["fl.mode=local"])
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    with pytest.raises(ConfigError) as door:
        prepare_run(out=str(tmp_path / "run"), config=str(path), overrides=[], resume=False)
    with FakeGrid(flower_app.client_app, {}) as grid, pytest.raises(ConfigError) as server:
        serve(grid, {"config": str(path), "out": str(tmp_path / "run2"), "join-timeout": 0})
    assert str(door.value) == str(server.value)
    assert str(door.value).startswith("fl.mode:")


def test_the_door_refuses_an_unknown_backbone(tmp_path):
    cfg = tiny_config(tmp_path / "prepared", ["model.backbone=resnet5O"])
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    with pytest.raises(ConfigError, match="resnet5O") as door:
        prepare_run(out=str(tmp_path / "run"), config=str(path), overrides=[], resume=False)
    assert "\n" not in str(door.value) and not (tmp_path / "run").exists()


def test_the_door_refuses_a_resume_changing_a_fixed_key_as_the_server_app_does(tmp_path):
    world = write_world(tmp_path / "prepared")
    cfg = tiny_config(world, ["fl.rounds=1", "eval.every=100"])
    run_simulation(cfg, tmp_path / "run", progress=False)
    # A change the run may take is let through...
    assert prepare_run(out=str(tmp_path / "run"), config=None, overrides=["fl.rounds=2"], resume=True).rounds == 2
    # ...one it may not is refused before anything starts, in the words of the ServerApp's own check.
    with pytest.raises(ConfigError) as door:
        prepare_run(out=str(tmp_path / "run"), config=None, overrides=["fl.rounds=2", "train.lr=0.5"], resume=True)
    changed = tiny_config(world, ["fl.rounds=2", "eval.every=100", "train.lr=0.5"])
    with pytest.raises(ConfigError) as server:
        run_simulation(changed, tmp_path / "run", resume=True, progress=False, remote_round=lambda s: {})
    assert str(door.value) == str(server.value)
    assert "changed keys: train.lr " in str(door.value)


def test_local_refuses_a_bad_round_timeout_before_making_anything(config_file, tmp_path, capsys):
    from tool_loader import cli_error

    err = cli_error(flower_fed, ["local", "--config", str(config_file), "--out", str(tmp_path / "run"),
                                 "--round-timeout", "-5"], capsys)
    assert "round-timeout: expected seconds > 0, got -5.0" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "run_flower").exists()


# ------------------------------------------------------------------ `run`


def run_tool(config_file, tmp_path, superlink):
    return flower_fed.main(["run", "--superlink", superlink, "--insecure", "--config", str(config_file),
                            "--out", str(tmp_path / "run")])


def test_run_shows_flwr_output_and_a_remote_run_is_not_called_stopped(fake_flwr, config_file, tmp_path, capfd):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the ServerApp, and --out, are elsewhere.
    rc = run_tool(config_file, tmp_path, "192.0.2.1:8000")
    out, err = capfd.readouterr()
    assert "round 1: 2 clients, loss 1.234 (fake ServerApp)" in out  # the ServerApp's lines reach the user
    assert 'address = "192.0.2.1:8000"' in out
    assert rc == 0 and "SuperLink's host" in out and "stopped after" not in out + err
    assert not (tmp_path / "run").exists()


def test_a_remote_run_exits_with_flwr_exit_code(fake_flwr, config_file, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("FAKE_FLWR_RC", "3")
    assert run_tool(config_file, tmp_path, "192.0.2.1:8000") == 3
    assert "exit code 3" in capfd.readouterr().err


def test_a_run_on_this_host_is_judged_by_its_folder(fake_flwr, config_file, tmp_path, capfd):
    # The SuperLink is on this machine, so --out is too: nothing was written there, the run did not happen.
    assert run_tool(config_file, tmp_path, "127.0.0.1:1") == 1
    out, err = capfd.readouterr()
    assert "(fake ServerApp)" in out and "run stopped after 0 of 1 rounds" in err


def test_flwr_calls_leave_no_temporary_home(fake_flwr, config_file, tmp_path, capfd):
    homes, tmp = fake_flwr
    cli = FlowerCli("server.example.org:8000")
    assert list(tmp.iterdir()) == []  # nothing made before a call
    assert cli.run("config='x'") == 0
    key = tmp_path / "node.pub"
    key.write_text("ecdsa-sha2-nistp384 AAAA")
    cli.register(key, name="site1")
    run_tool(config_file, tmp_path, "192.0.2.1:8000")  # the `run` command
    used = homes.read_text().split()
    assert len(used) == 3 and all(h.startswith(str(tmp / "fedreid-flwr-")) for h in used)
    assert list(tmp.iterdir()) == []  # every call's FLWR_HOME is gone
    with pytest.raises(launch.LaunchError, match="home"):
        cli.start("config='x'", log=tmp_path / "log")


# ------------------------------------------------------------------ --print-only


def test_a_printed_node_command_pastes_back_into_the_same_argv(tmp_path, capsys):
    args = ["node", "--client", "market1501", "--superlink", "server.example.org:8000", "--insecure",
            "--state-dir", str(tmp_path / "node state"), "--prepared-root", str(tmp_path / "prepared"),
            "--device", "cuda:0", "--print-only"]
    assert flower_fed.main(args) == 0
    line = capsys.readouterr().out.strip()
    local = {"prepared_root": str(tmp_path / "prepared"), "device": "cuda:0"}
    argv = supernode_launch(client="market1501", superlink="server.example.org:8000", ca=None, key=None,
                            state_dir=str(tmp_path / "node state"), port=9094, local=local, check=False)
    assert shlex.split(line) == argv
    # What bash itself passes when the line is pasted (printf is its builtin; one NUL after each argument).
    shell = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], capture_output=True, check=True)
    assert shell.stdout.decode().split("\0")[:-1] == argv
    assert "--node-config \"client='market1501'" in line  # readable, not '\''-escaped


def test_command_line_round_trips_awkward_arguments():
    for cmd in (["a", "it's $HOME"], ["a", 'say "hi"'], ["a", ""], ["a", "x'!y"], ["a", "b\\'c"], ["a b", "c"]):
        assert shlex.split(launch.command_line(cmd)) == cmd



def test_a_fresh_runs_relative_paths_reach_the_server_app_resolved_in_the_submitting_folder(tmp_path, monkeypatch):
    """The ServerApp runs in a folder of Flower's: relative data paths must not be read there."""
    from fedreid.flower.deployment import absolute_path_overrides, claim_local_folders

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(tiny_config(tmp_path / "prepared", ["fl.rounds=1"])))
    run = prepare_run(out="run", config=str(path), resume=False,
                      overrides=["data.prepared_root=data/prepared", "model.pretrained=weights/w.pth"])
    settings = ServerSettings.from_run_config(parse_config_args([run.run_config]))
    passed = dict(o.split("=", 1) for o in settings.overrides)
    assert passed["data.prepared_root"] == f"{tmp_path}/data/prepared"
    assert passed["model.pretrained"] == f"{tmp_path}/weights/w.pth"
    assert passed["synthetic.root"] == f"{tmp_path}/datasets/raw/synthetic"  # the defaults' relative paths too
    assert run.cfg.data.prepared_root == f"{tmp_path}/data/prepared"
    cfg = tiny_config(tmp_path / "prepared", ["model.pretrained=pkg://some_package/w.pth",
                                              f"data.raw_root={tmp_path}", f"synthetic.root={tmp_path}"])
    assert absolute_path_overrides(cfg) == []  # absolute already, or inside a package
    with pytest.raises(ConfigError, match="data.prepared_root: the path .*cannot be passed"):
        absolute_path_overrides(tiny_config(tmp_path, ["data.prepared_root='a: b'"]))
    # the one-host work folder is absolute too: SuperLink and SuperNodes run inside it
    assert claim_local_folders(tmp_path / "out", None, False) == tmp_path / "out_flower"
    assert claim_local_folders(tmp_path.relative_to(tmp_path) / "rel", None, False) == tmp_path / "rel_flower"


def passed_overrides(run) -> dict:
    """The overrides the ServerApp will apply, each key's last one (the one that takes effect)."""
    settings = ServerSettings.from_run_config(parse_config_args([run.run_config]))
    return dict(o.split("=", 1) for o in settings.overrides)


@pytest.fixture
def train_fed_run(tmp_path, monkeypatch):
    """A run folder as tools/train_fed.py leaves it, started in ``tmp_path``: its config.yaml and checkpoint
    keep the relative ``data.prepared_root=prepared`` it was given."""
    monkeypatch.chdir(tmp_path)
    write_world(tmp_path / "prepared")
    run_simulation(tiny_config(Path("prepared"), ["fl.rounds=1", "eval.every=100"]), "run", progress=False)
    assert load_config(tmp_path / "run" / "config.yaml").data.prepared_root == "prepared"
    return tmp_path / "run"


def test_a_resumed_runs_relative_paths_reach_the_server_app_resolved_in_the_submitting_folder(train_fed_run,
                                                                                              tmp_path):
    """The ServerApp runs in a folder of Flower's: a resumed train_fed run's relative paths must not be read there."""
    run = prepare_run(out="run", config=None, overrides=["fl.rounds=2"], resume=True)
    passed = passed_overrides(run)
    assert passed["data.prepared_root"] == f"{tmp_path}/prepared"
    assert passed["synthetic.root"] == f"{tmp_path}/datasets/raw/synthetic"  # the defaults' relative paths too
    assert run.cfg.data.prepared_root == f"{tmp_path}/prepared" and run.cfg.fl.rounds == 2
    # The ServerApp's own check, against the checkpoint's config, takes the resolved paths as the same run.
    ckpt = load_checkpoint(train_fed_run / "checkpoint.pt")
    check_resumable(from_dict(Config, ckpt["config"]), run.cfg, completed_rounds=1)


def test_a_users_path_override_on_resume_wins_over_the_resolved_one(train_fed_run, tmp_path):
    copy = tmp_path / "copy" / "prepared"  # the same data, moved
    write_world(copy)
    for given, expected in ((f"{copy}", f"{copy}"), ("./prepared", f"{tmp_path}/prepared")):
        run = prepare_run(out="run", config=None, overrides=[f"data.prepared_root={given}"], resume=True)
        assert passed_overrides(run)["data.prepared_root"] == expected
        assert run.cfg.data.prepared_root == expected
    # Another folder is a change the run may not take, refused in the ServerApp's words.
    with pytest.raises(ConfigError) as door:
        prepare_run(out="run", config=None, overrides=["data.prepared_root=other"], resume=True)
    changed = tiny_config(tmp_path / "other", ["fl.rounds=1", "eval.every=100"])
    with pytest.raises(ConfigError) as server:
        run_simulation(changed, train_fed_run, resume=True, progress=False, remote_round=lambda s: {})
    assert str(door.value) == str(server.value)
    assert "changed keys: data.prepared_root " in str(door.value)


def test_a_resumed_runs_absolute_and_package_paths_are_passed_as_they_are(tmp_path, monkeypatch):
    prepared = tmp_path / "data" / "prepared"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(
        dump_config(tiny_config(prepared, ["fl.rounds=1", "model.pretrained=pkg://some_package/w.pth"])))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = prepare_run(out=str(tmp_path / "run"), config=None, overrides=[], resume=True)
    passed = passed_overrides(run)
    assert "data.prepared_root" not in passed and "model.pretrained" not in passed
    assert (run.cfg.data.prepared_root, run.cfg.model.pretrained) == (str(prepared), "pkg://some_package/w.pth")
    assert passed["synthetic.root"] == f"{elsewhere}/datasets/raw/synthetic"  # a relative one beside them is resolved
