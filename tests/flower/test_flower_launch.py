"""Nothing outlives the launcher: SIGTERM stops every process group it started, SIGKILL leaves no child (Linux).

No Flower here: the children are long sleepers started exactly as
:class:`fedreid.flower.launch.LocalDeployment` starts SuperLink and
SuperNodes, inside :func:`fedreid.flower.launch.stop_on_signals` as
``tools/flower_fed.py`` runs its commands. Every process is looked at, and
cleaned up if a test fails, by its own PID.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LAUNCHER = r'''
import sys, time
from pathlib import Path
from fedreid.flower.launch import LocalDeployment, Terminated, stop_on_signals

work, grandchildren = Path(sys.argv[1]), sys.argv[2] == "yes"
# Each child starts a grandchild (as a SuperNode starts ClientApps) and prints its PID to its log.
child = [sys.executable, "-c", "import subprocess, time; "
         "p = subprocess.Popen(['sleep', '1000']); print(p.pid, flush=True); time.sleep(1000)"]
if not grandchildren:
    child = ["sleep", "1000"]
try:
    with stop_on_signals():
        dep = LocalDeployment(work, ["a", "b"])  # starts nothing until used
        try:  # what `with LocalDeployment(...)` does, with sleepers for processes
            pids = [dep.start_process(name, child).pid for name in ("superlink", "node-a", "node-b")]
            print("ready", *pids, flush=True)
            time.sleep(1000)
        finally:
            dep.stop()
except Terminated as exc:
    print("terminated", exc.signum, flush=True)
    sys.exit(exc.code)
'''


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def start_launcher(tmp_path, grandchildren: bool):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "work"), "yes" if grandchildren else "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("ready"), line + proc.stdout.read()
    children = [int(p) for p in line.split()[1:]]
    spawned = []
    if grandchildren:
        deadline = time.monotonic() + 30
        logs = [tmp_path / "work" / "logs" / f"{n}.log" for n in ("superlink", "node-a", "node-b")]
        while time.monotonic() < deadline and not all(p.is_file() and p.read_text().strip() for p in logs):
            time.sleep(0.1)
        spawned = [int(p.read_text().split()[0]) for p in logs]
    return proc, children, spawned


def clean_up(proc, pids):
    for pid in pids:  # only if a test failed: by PID, never by name
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_stops_every_process_group(tmp_path, sig):
    proc, children, grandchildren = start_launcher(tmp_path, grandchildren=True)
    try:
        assert all(alive(p) for p in children + grandchildren)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig and f"terminated {int(sig)}" in out, out
        assert wait_gone(children + grandchildren) == []
    finally:
        clean_up(proc, children + grandchildren)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_launcher_leaves_no_child(tmp_path):
    proc, children, _ = start_launcher(tmp_path, grandchildren=False)
    try:
        assert all(alive(p) for p in children)
        proc.kill()  # no handler runs: only the kernel's parent-death signal can stop the children
        proc.wait(timeout=10)
        assert wait_gone(children) == []
    finally:
        clean_up(proc, children)


def test_a_child_started_without_it_survives_a_sigkill(tmp_path):
    # The control experiment: the same launcher with die_with_parent off leaks its children on SIGKILL.
    script = LAUNCHER.replace('LocalDeployment(work, ["a", "b"])', 'LocalDeployment(work, ["a", "b"], die_with_parent=False)')
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "work"), "no"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    children = []
    try:
        line = proc.stdout.readline()
        children = [int(p) for p in line.split()[1:]]
        assert line.startswith("ready") and len(children) == 3, line
        proc.kill()
        proc.wait(timeout=10)
        time.sleep(1.0)
        assert all(alive(p) for p in children)
    finally:
        clean_up(proc, children)
