"""run.concurrent_clients: clients trained in worker processes equal the sequential run bit for bit (CPU).

Each N=2 run spawns two workers (a few seconds of torch import each), so the
runs here are few and tiny: 2 rounds of the two-client ReID world, one of
partitioned digits with SCAFFOLD (client state that crosses the pipes), a
resume, and the failure paths on one worker with stand-in clients.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fl_helpers import strip_time, tiny_config, write_world

from fedreid.config import load_config
from fedreid.fl.client import ClientError
from fedreid.fl.concurrent import ClientPool, ConcurrentClientError, WorkerDiedError
from fedreid.fl.local.base import OBJECTIVE_PAYLOAD
from fedreid.fl.simulation import resume, run_simulation
from fedreid.fl.update import Update
from fedreid.utils.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: CDW, KD in round 2 and the local-model evaluation: every metadata and record path.
REID = ["fl.rounds=2", "fl.cdw=true", "fl.kd=true", "fl.kd_every=2", "eval.local_models=true"]
DIGITS = [
    "task=classification", "fl.aggregation=fedavg", "model.backbone=cnn_lmd", "classification.num_clients=3",
    "classification.alpha=0.5", "classification.train_subset=300", "train.batch_size=32", "train.drop_last=false",
    "train.local_epochs=1", "fl.rounds=2", "eval.every=1", "run.device=cpu", "run.tensorboard=false",
]


class Kill(RuntimeError):
    pass


def workers_left() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("fedreid-client-worker")]


def assert_same(dir_a, hist_a, dir_b, hist_b):
    """Every tensor of the final global state and client state equal, records equal but for ``time``."""
    assert strip_time(hist_a) == strip_time(hist_b)
    a, b = load_checkpoint(dir_a / "checkpoint.pt"), load_checkpoint(dir_b / "checkpoint.pt")
    ga, gb = a["server"]["global_state"], b["server"]["global_state"]
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert a["clients"].keys() == b["clients"].keys()
    for name, sa in a["clients"].items():
        sb = b["clients"][name]
        assert sa["rounds_trained"] == sb["rounds_trained"]
        for part in ("head", "bn_state"):
            assert (sa[part] is None) == (sb[part] is None)
            if sa[part] is not None:
                assert all(torch.equal(sa[part][k], sb[part][k]) for k in sa[part])
        oa, ob = sa["objective"], sb["objective"]
        assert oa.keys() == ob.keys()
        for key in oa:
            if oa[key] is None:  # state a client that never trained does not have yet (MOON's prev)
                assert ob[key] is None
                continue
            assert oa[key].keys() == ob[key].keys() and all(torch.equal(oa[key][n], ob[key][n]) for n in oa[key])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return write_world(tmp_path_factory.mktemp("prepared"))


def test_reid_clients_trained_concurrently_killed_and_resumed_equal_the_sequential_run(world, tmp_path):
    """Round 1 with two workers, a kill while round 2 trains, round 2 resumed with two workers: as N=1."""
    one = run_simulation(tiny_config(world, REID), tmp_path / "n1", progress=False)
    seen = []
    run_dir = tmp_path / "n2"
    # Three asked for, two clients a round: two workers.
    cfg = tiny_config(world, REID + ["run.concurrent_clients=3"])

    def killer(event, info):
        seen.append((event, info))
        if event == "client_end" and info["round"] == 1:  # the other client may still be training
            raise Kill()

    with pytest.raises(Kill):
        run_simulation(cfg, run_dir, progress=False, callbacks=[killer])
    assert workers_left() == []
    assert load_checkpoint(run_dir / "checkpoint.pt")["round"] == 1
    hist = resume(run_dir, cfg=cfg, progress=False, callbacks=[lambda event, info: seen.append((event, info))])
    assert_same(tmp_path / "n1", one, run_dir, hist)
    assert workers_left() == []
    assert set(hist[1]["local_eval"]) == {"dsa", "dsb"} and "kd" in hist[1]
    assert "gpu_peak_bytes" not in hist[0]["client_metrics"]["dsa"]  # CUDA only
    ends = [(info["round"], info["client"]) for event, info in seen if event == "client_end"]
    assert sorted(ends[:2]) == [(0, "dsa"), (0, "dsb")] and sorted(ends[-2:]) == [(1, "dsa"), (1, "dsb")]


def test_classification_with_client_state_is_bit_identical(tmp_path):
    cfg = load_config(None, DIGITS + ["train.objective=scaffold"])
    one = run_simulation(cfg, tmp_path / "n1", progress=False)
    two = run_simulation(load_config(None, DIGITS + ["train.objective=scaffold", "run.concurrent_clients=2"]),
                         tmp_path / "n2", progress=False)
    assert_same(tmp_path / "n1", one, tmp_path / "n2", two)
    c_i = load_checkpoint(tmp_path / "n2" / "checkpoint.pt")["clients"]["client000"]["objective"]["c_i"]
    assert c_i and any(bool(v.abs().sum()) for v in c_i.values())  # the control variate crossed back


class FakeSplit:
    dataset = "none"


def _only_in(pid: int) -> "OnlyIn":
    if os.getpid() != pid:
        raise ValueError(f"this object cannot be rebuilt outside process {pid}")
    return OnlyIn(pid)


class OnlyIn:
    """An object that unpickles only in the process it names: a class one side of a pipe lacks."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self):
        return _only_in, (self.pid,)


class FakeClient:
    """A picklable stand-in for a client: ``fit`` fails as ``how`` says, the main process's copy keeps a count."""

    def __init__(self, name: str, how: str, seconds: float = 0.0, pid_file: str = "") -> None:
        self.name, self.how, self.split, self.calls = name, how, FakeSplit(), 0
        self.seconds, self.pid_file = seconds, pid_file

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]

    def fit(self, model, payload, instructions):
        if self.how == "diverge":
            raise FloatingPointError("local training diverged (loss nan) at epoch 0, step 3; lower train.lr")
        if self.how == "client-error":
            raise ClientError(f"client {self.name!r} has no identities")
        if self.how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "die-leaving-a-child":  # as a DataLoader worker would, the child holds the pipe open
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "exit":
            sys.exit("client gave up")
        if self.pid_file:
            Path(self.pid_file).write_text(str(os.getpid()))
        time.sleep(self.seconds)
        self.calls += 1
        update = Update(self.name, {"w": payload["w"] + 1}, 3, {"train_loss": 0.5, "pid": os.getpid()})
        if self.how == "unpicklable":
            update.metadata["hook"] = lambda: None
        if self.how == "worker-only":
            update.metadata["odd"] = OnlyIn(os.getpid())
        if self.how == "settings":
            update.metadata["settings"] = (torch.backends.mkldnn.conv.fp32_precision,
                                           torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
        if self.how == "scribble":  # writes on the payload it was given
            payload["w"].mul_(-7)
        return update


def test_a_client_goes_back_to_the_worker_that_trained_it_last():
    # its loader workers live there; the round's order alone would swap them
    clients = [FakeClient("a", "train"), FakeClient("b", "train")]
    payload = {"w": torch.zeros(2)}
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=2) as pool:
        first = {u.client: u.metadata["pid"] for u in pool.fit_round([0, 1], lambda k: payload, {"round": 0})}
        second = {u.client: u.metadata["pid"] for u in pool.fit_round([1, 0], lambda k: payload, {"round": 1})}
    assert len(set(first.values())) == 2 and second == first
    assert [c.calls for c in clients] == [2, 2]


class SizedClient(FakeClient):
    def __init__(self, name: str, num_samples: int) -> None:
        super().__init__(name, "train")
        self.num_samples = num_samples


def test_the_largest_clients_are_handed_out_first_and_the_updates_keep_the_rounds_order():
    # one worker: the order results come back in is the order clients were handed out
    clients = [SizedClient(name, n) for name, n in (("a", 20), ("b", 985), ("c", 150), ("d", 150), ("e", 400))]
    payload = {"w": torch.zeros(2)}
    started = []
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=1) as pool:
        updates = pool.fit_round([3, 0, 2, 1, 4], lambda k: payload, {"round": 0},
                                 on_result=lambda result: started.append(clients[result.index].name))
    assert started == ["b", "e", "d", "c", "a"]  # equal sizes (d, c) keep the round's order
    assert [u.client for u in updates] == ["d", "a", "c", "b", "e"]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_every_client_gets_the_payload_as_sent_whatever_the_others_wrote_on_theirs(shared_memory):
    # three clients on two workers: one worker receives the round's payload twice
    clients = [FakeClient(name, "scribble") for name in ("a", "b", "c")]
    payload = {"w": torch.arange(6.0), "big": torch.ones(300_000)}
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=2,
                    shared_memory=shared_memory) as pool:
        for r in range(2):
            updates = pool.fit_round([0, 1, 2], lambda k: payload, {"round": r})
            assert [u.client for u in updates] == ["a", "b", "c"]
            assert all(torch.equal(u.state["w"], torch.arange(6.0) + 1) for u in updates)
    assert torch.equal(payload["w"], torch.arange(6.0)) and [c.calls for c in clients] == [2, 2, 2]


def test_failing_and_dying_clients_are_reported_naming_the_client():
    clients = [FakeClient("ok", "train"), FakeClient("nan", "diverge"), FakeClient("bad", "client-error"),
               FakeClient("gone", "die")]
    payload = {"w": torch.zeros(2)}
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=1) as pool:
        updates = pool.fit_round([0], lambda k: payload, {"round": 0})
        assert torch.equal(updates[0].state["w"], torch.ones(2)) and clients[0].calls == 1  # state came back
        # The same type and message, prefixed with the client's name; the worker's traceback as the cause.
        with pytest.raises(FloatingPointError, match=r"^client 'nan': local training diverged \(loss nan\)") as info:
            pool.fit_round([1], lambda k: payload, {"round": 0})
        assert any("client worker process 0" in note for note in info.value.__notes__)
        assert "Traceback" in str(info.value.__cause__) and ", in fit\n" in str(info.value.__cause__)
        with pytest.raises(ClientError) as info:
            pool.fit_round([2], lambda k: payload, {"round": 0})
        assert str(info.value) == "client 'bad' has no identities"  # it names the client already
        with pytest.raises(WorkerDiedError, match=r"died while training client 'gone' \(killed by SIGKILL\)"):
            pool.fit_round([3], lambda k: payload, {"round": 0})
    assert workers_left() == []


def test_failures_outside_a_clients_fit_are_reported_naming_the_client():
    clients = [FakeClient("ok", "train"), FakeClient("odd", "unpicklable"), FakeClient("quits", "exit"),
               FakeClient("foreign", "worker-only")]
    payload = {"w": torch.zeros(2)}
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=1) as pool:
        # an update that does not pickle in the worker: its error, and the worker serves on
        with pytest.raises(Exception, match=r"^client 'odd': .*pickle") as info:
            pool.fit_round([1], lambda k: payload, {"round": 0})
        assert "Traceback" in str(info.value.__cause__)
        with pytest.raises(SystemExit, match=r"^client 'quits': client gave up"):  # as sequentially
            pool.fit_round([2], lambda k: payload, {"round": 0})
        assert pool.fit_round([0], lambda k: payload, {"round": 0})[0].client == "ok"
        # a reply this process cannot rebuild
        with pytest.raises(ConcurrentClientError, match=r"its reply while training client 'foreign' could not be "
                                                        r"read \(ValueError: this object cannot be rebuilt"):
            pool.fit_round([3], lambda k: payload, {"round": 0})
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=1) as pool:
        # a task the worker cannot rebuild: reported as that error, then the worker is gone
        with pytest.raises(ValueError, match=r"^client 'ok': this object cannot be rebuilt outside process"):
            pool.fit_round([0], lambda k: payload, {"round": 0}, own_instructions=lambda k: {"x": OnlyIn(os.getpid())})
        with pytest.raises(WorkerDiedError, match=r"died while (receiving|training) client 'ok' \(exit code 1\)"):
            pool.fit_round([0], lambda k: payload, {"round": 0})
    assert workers_left() == []


def test_a_pool_whose_round_failed_with_clients_still_training_refuses_the_next_round():
    clients = [FakeClient("slow", "train", seconds=2.0), FakeClient("nan", "diverge")]
    payload = {"w": torch.zeros(2)}
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=2) as pool:
        with pytest.raises(FloatingPointError):
            pool.fit_round([0, 1], lambda k: payload, {"round": 0})
        with pytest.raises(RuntimeError, match="a failed round left clients training in this client pool"):
            pool.fit_round([1], lambda k: payload, {"round": 1})
    assert workers_left() == []


def test_a_dead_worker_is_reported_at_once_though_its_children_hold_the_pipe_open():
    clients = [FakeClient("gone", "die-leaving-a-child")]
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1), processes=1) as pool:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"died while training client 'gone' \(killed by SIGKILL\)"):
            pool.fit_round([0], lambda k: {"w": torch.zeros(2)}, {"round": 0})
        assert time.monotonic() - start < 20  # not after the child's 30 s


def test_workers_adopt_the_parents_reduced_precision_settings():
    saved = (torch.backends.mkldnn.conv.fp32_precision, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    try:
        torch.backends.mkldnn.conv.fp32_precision = "bf16"
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not saved[1]
        with ClientPool(load_config(None, ["run.device=cpu"]), [FakeClient("a", "settings")], torch.nn.Linear(1, 1),
                        processes=1) as pool:
            update, = pool.fit_round([0], lambda k: {"w": torch.zeros(2)}, {"round": 0})
    finally:
        torch.backends.mkldnn.conv.fp32_precision, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved
    assert update.metadata["settings"] == ("bf16", not saved[1])


PARENT = """
import sys, torch
from fedreid.config import load_config
from fedreid.fl.concurrent import ClientPool
from test_concurrent_clients import FakeClient
client = FakeClient("slow", "train", seconds=120.0, pid_file=sys.argv[1])
with ClientPool(load_config(None, ["run.device=cpu"]), [client], torch.nn.Linear(1, 1), processes=1) as pool:
    pool.fit_round([0], lambda k: {"w": torch.zeros(2)}, {"round": 0})
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; whoever adopted it reaps it


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_worker_stops_mid_fit_when_its_parent_is_killed(tmp_path):
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the parent never started its worker"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert _running(worker)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20  # the fit had 120 s to go
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker)


@pytest.mark.gpu
def test_on_cuda_each_client_reports_its_peak_memory(world, tmp_path):
    """Two workers with their own CUDA contexts: each client's peak memory in its metrics, under its cap."""
    cfg = tiny_config(world, REID + ["run.device=cuda", "run.concurrent_clients=2"])
    hist = run_simulation(cfg, tmp_path / "n2", progress=False)
    total = torch.cuda.get_device_properties(0).total_memory
    for rec in hist:
        assert sorted(rec["client_metrics"]) == ["dsa", "dsb"]
        for metrics in rec["client_metrics"].values():
            assert 0 < metrics["gpu_peak_bytes"] <= 0.95 / 2 * total
    one = run_simulation(tiny_config(world, REID + ["run.device=cuda"]), tmp_path / "n1", progress=False)
    assert "gpu_peak_bytes" not in one[0]["client_metrics"]["dsa"]  # N=1 is today's path
    assert [r["clients"] for r in one] == [r["clients"] for r in hist]


def test_per_client_instructions_reach_the_pooled_clients_as_the_sequential_ones(tmp_path):
    """FedCurv's official sums differ per client (``RoundPlan.per_client``): pooled clients get theirs too."""
    curv = ["train.objective=fedcurv", "train.objective_options={fisher_samples: 64, penalty_sums: official}",
            "fl.rounds=3"]
    one = run_simulation(load_config(None, DIGITS + curv), tmp_path / "n1", progress=False)
    two = run_simulation(load_config(None, DIGITS + curv + ["run.concurrent_clients=2"]), tmp_path / "n2",
                         progress=False)
    assert_same(tmp_path / "n1", one, tmp_path / "n2", two)
    paper = run_simulation(load_config(None, DIGITS + [curv[0], "train.objective_options={fisher_samples: 64}",
                                                       "fl.rounds=3"]), tmp_path / "paper", progress=False)
    assert strip_time(paper[:1]) == strip_time(one[:1])  # round 1: no sums yet
    # round 2 on: all but the first client served lack their predecessors' terms
    assert strip_time(paper[1:]) != strip_time(one[1:])
    sent = [r["comm"]["sent"][OBJECTIVE_PAYLOAD] for r in one[1:]]
    assert sent == [r["comm"]["sent"][OBJECTIVE_PAYLOAD] for r in paper[1:]]  # the same bytes, other values


def test_moon_initial_previous_model_reaches_new_clients_sequential_and_pooled(tmp_path):
    """MOON ``first_previous: initial`` (FedNTD): the moon hook sends the initial model to clients yet to train."""
    from fedreid.fl.federation import build_federation

    moon = ["train.objective=moon", "fl.clients_per_round=2", "fl.rounds=3", "seed=1"]  # client000 first in round 2
    initial = [*moon, "train.objective_options={first_previous: initial}"]
    one = run_simulation(load_config(None, DIGITS + initial), tmp_path / "n1", progress=False)
    two = run_simulation(load_config(None, DIGITS + initial + ["run.concurrent_clients=2"]), tmp_path / "n2",
                         progress=False)
    assert_same(tmp_path / "n1", one, tmp_path / "n2", two)
    plain = run_simulation(load_config(None, DIGITS + moon), tmp_path / "global", progress=False)
    # round 1: the initial model is the global one; later, a client first sampled then contrasts with it
    def numbers(history):  # what training gave, not what crossed the wire
        return [{k: v for k, v in rec.items() if k not in ("time", "comm")} for rec in history]

    assert numbers(plain[:1]) == numbers(one[:1]) and numbers(plain) != numbers(one)
    seen, copies = set(), []
    for rec in one:
        copies.append(rec["comm"]["sent"].get(OBJECTIVE_PAYLOAD, 0))
        fresh = [c for c in rec["clients"] if c not in seen]
        seen.update(rec["clients"])
        assert (copies[-1] > 0) == bool(fresh)
    assert copies[0] == one[0]["comm"]["sent"]["model"]  # two new clients, each the model's size once
    # the hook's checkpoint: who trained, and the initial model a fresh build of the run starts from
    hook = load_checkpoint(tmp_path / "n1" / "checkpoint.pt")["server"]["hooks"]["moon"]
    start = build_federation(load_config(None, DIGITS + initial)).server.global_state
    assert sorted(hook["trained"]) == sorted(seen)
    assert hook["initial"].keys() == start.keys() and all(torch.equal(hook["initial"][k], start[k]) for k in start)
    assert "moon" not in load_checkpoint(tmp_path / "global" / "checkpoint.pt")["server"]["hooks"]
