"""Flower as separate processes on 127.0.0.1: SuperLink, one SuperNode per client, ``flwr run``.

Each test starts its own processes (free ports, its own folder and
FLWR_HOME) and stops them by their PIDs and process groups, whatever
happens. Time is bounded by ``flwr run``'s timeout and the run's
``join-timeout`` / ``round-timeout``. Results are compared with the
in-process simulator of the same config and seed.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_world

from fedreid.config import dump_config
from fedreid.fl.simulation import run_simulation
from fedreid.fl.state import states_equal
from fedreid.flower.launch import LocalDeployment, TLSFiles, run_config_string
from fedreid.flower.security import make_node_key, make_tls_files

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ["dsa", "dsb"]
RUN_TIMEOUT = 480


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"))


def history_of(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)


def test_tls_and_node_auth_run_equals_the_simulation_and_strangers_are_refused(world, tmp_path):
    cfg = tiny_config(world, ["fl.rounds=2", "eval.every=2"])
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    make_tls_files(tmp_path / "tls")
    keys = {c: make_node_key(tmp_path / "keys", c)["private"] for c in CLIENTS}
    stranger_key = make_node_key(tmp_path / "keys", "stranger")["private"]
    with LocalDeployment(tmp_path / "dep", CLIENTS, tls=TLSFiles.from_dir(tmp_path / "tls"), node_keys=keys) as dep:
        rc = dep.cli.run(run_config_string(tmp_path / "run.yaml", tmp_path / "flower_run", join_timeout=120,
                                           round_timeout=240, node_auth=True),
                         log=tmp_path / "flwr_run.log", timeout=RUN_TIMEOUT)
        stranger = dep.start_node("dsb", private_key=stranger_key, name="stranger")
        stranger.wait(timeout=60)
        superlink_log = dep.log_path("superlink").read_text(errors="replace")
        stranger_log = dep.log_path("stranger").read_text(errors="replace")
    assert rc == 0, (tmp_path / "flwr_run.log").read_text(errors="replace")[-3000:]
    # The registered nodes trained over TLS; the result is the simulator's, bit for bit.
    sim = tmp_path / "sim"
    sim_history = run_simulation(cfg, sim, progress=False)
    flower, simulated = history_of(tmp_path / "flower_run"), history_of(sim)
    assert states_equal(flower["server"]["global_state"], simulated["server"]["global_state"])
    assert strip_time(flower["history"]) == strip_time(sim_history)
    assert (tmp_path / "flower_run" / "report.md").is_file()
    # The unregistered key is refused at activation and the node gives up.
    assert stranger.returncode != 0
    assert "Failed to activate SuperNode" in stranger_log
    assert "No SuperNode found with the given public key" in superlink_log


def test_a_client_killed_mid_round_is_left_out_and_rejoins(world, tmp_path):
    cfg = tiny_config(world, ["fl.rounds=2", "eval.every=100", "fl.min_clients=1"])
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    events = {}
    # The killer thread must not start a node once the run is over (the deployment is being stopped), and must
    # live until then: a process dies with the thread that started it (PR_SET_PDEATHSIG, see launch.py).
    stop, lock = threading.Event(), threading.Lock()
    with LocalDeployment(tmp_path / "dep", CLIENTS) as dep:

        def kill_dsb_while_it_trains():
            log = dep.log_path("node-dsb")
            deadline = time.monotonic() + RUN_TIMEOUT
            while (not stop.is_set() and time.monotonic() < deadline
                   and "Receiving: train message" not in log.read_text(errors="replace")):
                time.sleep(0.2)
            with lock:
                if stop.is_set():
                    return
                dep.stop_process("node-dsb", 9)  # SIGKILL to the node and its ClientApp
                events["killed"] = True
                dep.start_node("dsb", name="node-dsb-restarted")
            stop.wait()

        killer = threading.Thread(target=kill_dsb_while_it_trains, daemon=True)
        killer.start()
        try:
            rc = dep.cli.run(run_config_string(tmp_path / "run.yaml", tmp_path / "run", join_timeout=120,
                                               round_timeout=240), log=tmp_path / "flwr_run.log", timeout=RUN_TIMEOUT)
        finally:
            with lock:
                stop.set()
            killer.join(timeout=10)
    log = (tmp_path / "flwr_run.log").read_text(errors="replace")
    assert rc == 0 and events.get("killed"), log[-3000:]
    first, second = history_of(tmp_path / "run")["history"]
    assert first["clients"] == ["dsa"] and set(first["failed"]) == {"dsb"}
    assert "round 1: client dsb left out" in log
    assert sorted(second["clients"]) == CLIENTS and "failed" not in second  # it came back under a new node id


def test_flower_simulation_engine_run_equals_the_simulation(world, tmp_path):
    cfg = tiny_config(world, ["fl.rounds=2", "eval.every=2"])
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    tool = subprocess.Popen([sys.executable, str(ROOT / "tools" / "flower_fed.py"), "simulate", "--config",
                             str(tmp_path / "run.yaml"), "--out", str(tmp_path / "flower_sim")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        stdout, stderr = tool.communicate(timeout=RUN_TIMEOUT)
    finally:
        if tool.poll() is None:  # timed out (or this test was interrupted): the tool stops what it started on SIGTERM
            tool.terminate()
            try:
                tool.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(tool.pid, signal.SIGKILL)
                tool.wait(timeout=10)
    assert tool.returncode == 0, stdout + stderr
    assert "run finished: 2 rounds" in stdout
    sim_history = run_simulation(cfg, tmp_path / "sim", progress=False)
    flower, simulated = history_of(tmp_path / "flower_sim"), history_of(tmp_path / "sim")
    assert states_equal(flower["server"]["global_state"], simulated["server"]["global_state"])
    assert strip_time(flower["history"]) == strip_time(sim_history)
    # Node state went to the run's work folder, under the run's id, one folder per client.
    run_id = flower["server"]["run_id"]
    assert sorted(p.name for p in (tmp_path / "flower_sim_flower" / "fedreid_state" / run_id).iterdir()) == CLIENTS
