"""Clients of a round trained at once, in worker processes (``run.concurrent_clients``).

:class:`ClientPool` keeps ``N`` worker processes for a whole run (spawned
once; each imports torch once). Each worker gets, once, a pickled copy of
the federation's client objects, a work model and, when local models are
evaluated, the evaluator; on CUDA each has its own CUDA context. Per task the
main process sends the client's index, its persistent state
(:meth:`fedreid.fl.client.Client.state_dict`), the round's payload and
instructions; the worker loads the state into its copy of the client, runs
``client.fit(work_model, payload, instructions)`` (and, when asked, the
client's local-model evaluation on the trained work model) and sends back the
:class:`~fedreid.fl.update.Update`, the client's new state and the
evaluation. The main process loads that state into its own client object,
which stays the owner of client state (checkpoints are written from it).

Guarantee (issue 22): every update equals the one the same client computes
when the clients train one after another in one process -- bit for bit on
the CPU -- because a client's round depends only on (run seed, round, client
index), its state and the payload (:mod:`fedreid.fl.client`), and each worker
mirrors the parent's numeric settings: torch thread count, deterministic
mode, float32 precision of matmuls, convolutions and RNNs (TF32 and oneDNN's
fields) and cuBLAS's reduced-precision reductions (where that oversubscribes the
cores, idle OpenMP threads sleep instead of spinning: :func:`worker_environment`). Processes, not threads:
clients fork torch's *global* RNG (dropout draws from it), which threads
would interleave. :meth:`ClientPool.fit_round` returns the updates in the
round's order whatever order they finished in.

Scheduling: a round's clients are handed out largest first (by
``num_samples``, ties in the round's order; a client without it counts as
0), each to the worker that trained it last when that one is idle. The
round's order is a seeded random permutation
(:meth:`fedreid.fl.server.Server.sample_clients`), and the federation's
clients differ in size by 10x or more, so handing them out in that order
often starts the largest client last while the other workers run out of
work. Longest first keeps the round within 4/3 of the shortest possible
when a client's time follows its size (Graham, "Bounds on multiprocessing
timing anomalies", SIAM J. Appl. Math. 17(2), 1969). Which worker trains a
client, and when, changes no number.

Failures: an exception in a client's fit is raised in the main process as the
same type with the same message (prefixed with the client's name when the
message does not name it), with the worker's traceback as its cause; so is
one outside the fit (an update that does not pickle, a task the worker
cannot rebuild). A reply the main process cannot rebuild raises
:class:`ConcurrentClientError`. A worker that dies (killed, segfault) raises
:class:`WorkerDiedError` naming the client, within a second even while its
own loader workers hold its pipe open. A pool whose round failed while other
clients were still training refuses further rounds (their replies would be
read as the next round's): close it. Workers ignore SIGINT (the main process
decides) and are shut down by :meth:`ClientPool.close` on every exit path; a
worker whose parent vanished (killed, say) exits within a second, mid-fit
too.

GPU memory: on CUDA each worker caps its allocator at ``0.95 / N`` of the
card (:func:`torch.cuda.set_per_process_memory_fraction`), reports the peak
memory allocated during each client's fit as ``metadata["gpu_peak_bytes"]``
(so the round record's ``client_metrics`` show it) and empties its cache
after each task, so the main process has the memory for aggregation, server
hooks and evaluation while the workers wait. On the CPU nothing is added.

Messages cross the pipes as :mod:`fedreid.fl.shared_tensors` messages: a
small pickle stream, with the bytes of its CPU tensors in an anonymous
memory file whose descriptor crosses with it. So the ~100 MB payload is
written once a round, and no payload or update is copied through a pipe.
With ``shared_memory=False``, or on a platform without memory files, they
cross the pipes as :func:`torch.save` bytes. A CUDA tensor is pickled as
torch pickles it and arrives on the same device index it left.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.config import Config
from fedreid.errors import FedReIDError
from fedreid.fl.shared_tensors import PackedMessage, pack, receive, send
from fedreid.fl.update import Update, to_plain
from fedreid.utils.precision import adopt_fp32_settings, fp32_settings
from fedreid.utils.seeding import deterministic_mode

#: Metadata key of a client's peak GPU memory during its fit (bytes; CUDA only).
GPU_PEAK_BYTES = "gpu_peak_bytes"
#: Share of the card the workers' allocators may take together.
GPU_MEMORY_SHARE = 0.95
#: Seconds an idle worker gets to exit after being told to stop.
STOP_GRACE_S = 10.0
#: Seconds between a worker's checks that the process that started it is still there,
#: and between the main process's checks that a busy worker is.
PARENT_CHECK_S = DEATH_CHECK_S = 1.0


class WorkerDiedError(FedReIDError, RuntimeError):
    """A worker process ended without answering; the message names the client it was training."""


class ConcurrentClientError(FedReIDError, RuntimeError):
    """A client failed in a worker with an exception that could not be rebuilt in the main process."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the cause of the re-raised exception)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass
class ClientResult:
    """What one client's task returned: its update and its local-model evaluation (or None)."""

    index: int
    update: Update
    local_eval: Optional[dict[str, Any]]


#: ``on_result(result)``: called in the main process as each client finishes (completion order).
ResultFn = Callable[[ClientResult], None]


def _numeric_settings(cfg: Config) -> dict[str, Any]:
    """The parent's global settings a client's numbers depend on, for the workers to adopt."""
    matmul = torch.backends.cuda.matmul
    return {
        "threads": int(torch.get_num_threads()),
        "deterministic": bool(cfg.run.deterministic),
        "fp32": fp32_settings(),
        "reduced_precision_reduction": {  # cuBLAS's bf16/fp16 matmuls: what train.precision=bf16 runs on
            "bf16": bool(matmul.allow_bf16_reduced_precision_reduction),
            "fp16": bool(matmul.allow_fp16_reduced_precision_reduction),
        },
    }


def worker_environment(processes: int) -> dict[str, str]:
    """Environment variables the workers start with (on top of this process's).

    Each worker keeps this process's torch thread count (the numbers depend on
    it), so ``processes`` workers may run more threads than there are cores;
    then OpenMP's idle threads must sleep rather than spin (``OMP_WAIT_POLICY=
    PASSIVE``), or the spinning takes the cores from the working threads
    (several times slower on 2 cores). How threads wait changes no number.
    A wait policy set by the user is kept.
    """
    threads = int(torch.get_num_threads())
    if "OMP_WAIT_POLICY" in os.environ or processes * threads <= (os.cpu_count() or 1):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block (what spawned processes inherit), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ClientPool:
    """``processes`` persistent workers training the clients of ``clients`` (see the module docstring).

    ``clients``: the main process's client objects (they keep the state);
    ``work_model``: a model of the federation's layout (copied once into each
    worker); ``evaluator``: called as ``evaluator(model, [dataset])`` for the
    local-model evaluation, or None when the run has none. Use as a context
    manager, or call :meth:`start` and, on every exit path, :meth:`close`.
    ``shared_memory``: tensors cross in memory files (see the module
    docstring); False sends them through the pipes, with the same values.
    """

    def __init__(self, cfg: Config, clients: Sequence[Any], work_model: nn.Module, *, processes: int,
                 evaluator: Optional[Callable[..., Mapping[str, Any]]] = None,
                 device: Optional[torch.device] = None, shared_memory: bool = True) -> None:
        if processes < 1:
            raise ValueError(f"a client pool needs at least one process, got {processes}")
        self.cfg = cfg
        self.clients = list(clients)
        self.work_model = work_model
        self.evaluator = evaluator
        self.processes = processes
        self.shared_memory = shared_memory
        self.device = torch.device(device) if device is not None else next(
            (p.device for p in work_model.parameters()), torch.device("cpu"))
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        self._busy: set[int] = set()  # workers holding a task
        self._home: dict[int, int] = {}  # client index -> the worker that trained it last

    # ------------------------------------------------------------- lifecycle

    def __enter__(self) -> "ClientPool":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the workers, hand each its copy of the clients and model, and wait until all are ready."""
        ctx = multiprocessing.get_context("spawn")
        init = self._pack({
            "clients": self.clients,
            "work_model": self.work_model,
            "evaluator": self.evaluator,
            "settings": _numeric_settings(self.cfg),
            "memory_fraction": GPU_MEMORY_SHARE / self.processes if self.device.type == "cuda" else None,
            "device": str(self.device),
            "shared_memory": self.shared_memory,
        })
        try:
            with _environment(worker_environment(self.processes)):
                for i in range(self.processes):
                    parent, child = ctx.Pipe(duplex=True)
                    # daemon=False: a daemonic process may not start DataLoader workers (train.workers > 0).
                    proc = ctx.Process(target=_worker_main, args=(child, i, os.getpid()),
                                       name=f"fedreid-client-worker-{i}", daemon=False)
                    proc.start()
                    child.close()
                    self._workers.append((proc, parent))
            for i, (proc, conn) in enumerate(self._workers):
                self._send(i, [init], what="its start-up copy of the clients")
            for i in range(len(self._workers)):
                kind, body = self._receive(i, what="starting up")
                if kind != "ready":
                    raise self._rebuild(body, None, i)
        except BaseException:
            self.close()
            raise
        finally:
            init.close()

    def close(self) -> None:
        """Stop every worker (idle ones are asked, busy ones terminated); idempotent."""
        workers, busy = self._workers, self._busy
        self._workers, self._busy, self._home = [], set(), {}
        for w, (proc, conn) in enumerate(workers):
            if w in busy:  # mid-task after a failure elsewhere: its result is not wanted
                proc.terminate()
            elif proc.is_alive():
                try:
                    send(conn, None, shared=False)
                except OSError:
                    pass
        for proc, conn in workers:
            proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()

    # ----------------------------------------------------------------- round

    def fit_round(
        self,
        ids: Sequence[int],
        payload_for: Callable[[int], Mapping[str, Tensor]],
        instructions: Mapping[str, Any],
        *,
        own_instructions: Callable[[int], Mapping[str, Any]] = lambda k: {},
        evaluate: Callable[[int], bool] = lambda k: False,
        on_result: Optional[ResultFn] = None,
    ) -> list[Update]:
        """Train the clients ``ids`` (indices into ``clients``), at most ``processes`` at once.

        Each gets ``payload_for(k)`` and a copy of ``instructions`` with
        ``own_instructions(k)``'s keys over it (``RoundPlan.per_client``), as in
        :meth:`fedreid.fl.server.Server.run_round`; ``evaluate(k)``: also
        evaluate client ``k``'s trained model (``evaluator(model,
        [client.split.dataset])``). As each finishes, its new state is loaded
        into ``clients[k]`` and ``on_result`` is called. Returns the updates
        in the order of ``ids``. The first failure is raised (see the module
        docstring); clients still training then are abandoned with the pool
        (close it).
        """
        if len(set(ids)) != len(ids):
            raise ValueError(f"a round trains each client once, got indices {list(ids)}")
        if not self._workers:
            raise RuntimeError("the client pool is not started")
        if self._busy:  # their replies would be read as this round's
            raise RuntimeError("a failed round left clients training in this client pool; close it and start a new one")
        pending = sorted(ids, key=self._work, reverse=True)  # stable: equal sizes keep the round's order
        idle = list(range(len(self._workers)))
        busy: dict[int, int] = {}  # worker -> client index
        done: dict[int, Update] = {}
        shared: dict[int, tuple[Mapping[str, Tensor], PackedMessage]] = {}  # id(payload) -> (payload, message)
        try:
            while pending or busy:
                while pending and idle:
                    w, k = self._next_task(pending, idle)
                    payload = payload_for(k)
                    if id(payload) not in shared:  # a federated round packs the clients' common payload once
                        shared[id(payload)] = (payload, self._pack({"payload": payload, "instructions": dict(instructions)}))
                    busy[w] = k
                    self._busy.add(w)
                    with self._pack({"index": k, "state": self.clients[k].state_dict(),
                                     "instructions": dict(own_instructions(k)),
                                     "evaluate": bool(evaluate(k))}) as task:
                        self._send(w, [shared[id(payload)][1], task], what=f"client {self._name(k)!r}")
                by_handle: dict[Any, int] = {}
                for w in busy:
                    proc, conn = self._workers[w]
                    by_handle[conn] = w
                    by_handle[proc.sentinel] = w
                # A dead worker's forked children (its loader workers with train.workers > 0)
                # hold its pipe and sentinel open for seconds, so its exit is also polled.
                wait(list(by_handle), timeout=DEATH_CHECK_S)
                for w in list(busy):
                    proc, conn = self._workers[w]
                    what = f"training client {self._name(busy[w])!r}"
                    if not conn.poll():
                        if proc.exitcode is not None and not conn.poll():  # all it wrote is there once it exited
                            raise self._died(w, what)
                        continue
                    k = busy.pop(w)
                    kind, body = self._receive(w, what=what)
                    self._busy.discard(w)
                    if kind != "done":
                        raise self._rebuild(body, k, w)
                    update = body["update"]
                    if update.client != self._name(k):
                        raise ValueError(f"update from {update.client!r} returned for client {self._name(k)!r}")
                    self.clients[k].load_state_dict(body["state"])
                    self._home[k] = w
                    done[k] = update
                    idle.append(w)
                    if on_result is not None:
                        on_result(ClientResult(k, update, body["local_eval"]))
        finally:
            for _, message in shared.values():
                message.close()
        return [done[k] for k in ids]

    # ------------------------------------------------------------- internals

    def _next_task(self, pending: list[int], idle: list[int]) -> tuple[int, int]:
        """Take the next (worker, client) pair off ``idle`` and ``pending``.

        The client is the first pending one (``pending`` is largest first).
        It goes back to the worker that trained it last when that one is
        idle, since its loader workers are still running there; otherwise
        to an idle worker that is no waiting client's home.
        """
        k = pending.pop(0)
        w = self._home.get(k)
        if w not in idle:
            homes = {self._home.get(j) for j in pending}
            w = next((v for v in idle if v not in homes), idle[0])
        idle.remove(w)
        return w, k

    def _work(self, k: int) -> int:
        """Client ``k``'s size, what its round's time mostly follows: its ``num_samples``, or 0 without one."""
        return int(getattr(self.clients[k], "num_samples", 0))

    def _name(self, k: int) -> str:
        return str(self.clients[k].name)

    def _died(self, w: int, what: str) -> WorkerDiedError:
        proc, _ = self._workers[w]
        proc.join(1.0)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        return WorkerDiedError(f"client worker process {w} (pid {proc.pid}) died while {what} ({how}); "
                               f"run.concurrent_clients={self.processes}")

    def _pack(self, obj: Any) -> PackedMessage:
        return pack(obj, shared=self.shared_memory)

    def _send(self, w: int, parts: Sequence[PackedMessage], *, what: str) -> None:
        _, conn = self._workers[w]
        try:
            for part in parts:
                part.send(conn)
        except OSError:  # BrokenPipeError, ConnectionResetError: the worker is gone
            raise self._died(w, f"receiving {what}") from None

    def _receive(self, w: int, *, what: str) -> tuple[str, Any]:
        _, conn = self._workers[w]
        try:
            return receive(conn)
        except (EOFError, OSError):
            raise self._died(w, what) from None
        except Exception as exc:  # a reply this process cannot rebuild (a class only the worker has, say)
            raise ConcurrentClientError(f"client worker process {w}: its reply while {what} could not be read "
                                        f"({type(exc).__name__}: {exc})") from exc

    def _rebuild(self, body: Mapping[str, Any], k: Optional[int], w: int) -> BaseException:
        """The worker's exception, as the same type and message, naming the client, caused by its traceback."""
        name = self._name(k) if k is not None else None
        exc: Optional[BaseException] = None
        if body.get("pickled") is not None:
            try:  # bytes our own worker pickled (_error_body) over its private pipe, never a user's file
                exc = pickle.loads(body["pickled"])
            except Exception:  # a type whose arguments do not round-trip; described below instead
                exc = None
        if not isinstance(exc, BaseException):
            who = f"client {name!r}" if name else f"client worker process {w}"
            exc = ConcurrentClientError(f"{who}: {body['type']}: {body['message']}")
        elif name and exc.args and isinstance(exc.args[0], str) and repr(name) not in exc.args[0]:
            # fedreid's own messages name a client as client 'x'; others get that prefix.
            exc.args = (f"client {name!r}: {exc.args[0]}",) + tuple(exc.args[1:])
        where = f"client {name!r}" if name else "start-up"
        exc.add_note(f"raised in client worker process {w} ({where}; run.concurrent_clients={self.processes})")
        exc.__cause__ = RemoteTraceback(body.get("traceback", ""))
        return exc


# ------------------------------------------------------------------ worker side


def _error_body(exc: BaseException) -> dict[str, Any]:
    try:
        pickled: Optional[bytes] = pickle.dumps(exc)
        pickle.loads(pickled)  # a type that pickles but cannot be rebuilt fails here, not in the parent
    except Exception:
        pickled = None
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)), "pickled": pickled}


def _adopt_settings(settings: Mapping[str, Any]) -> None:
    torch.set_num_threads(int(settings["threads"]))
    adopt_fp32_settings(settings["fp32"])
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = settings["reduced_precision_reduction"]["bf16"]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = settings["reduced_precision_reduction"]["fp16"]


def _worker_main(conn: Connection, index: int, parent_pid: int) -> None:
    """A worker's life: start-up copy, then tasks until told to stop or the parent is gone.

    An error outside a client's fit (its reply would not pickle, a message
    would not unpickle) is sent to the parent as the task's error where the
    pipe still works, and ends the worker with exit code 1.
    """
    # Ctrl-C reaches the whole process group; the parent decides and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="fedreid-parent-watch", daemon=True).start()
    code = 0
    try:
        try:
            init = receive(conn)
            if init is None:
                return
            _adopt_settings(init["settings"])
            device = torch.device(init["device"])
            if device.type == "cuda":
                if device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_per_process_memory_fraction(init["memory_fraction"], device)
        except Exception as exc:
            send(conn, ("error", _error_body(exc)), shared=False)
            return
        with deterministic_mode(init["settings"]["deterministic"]):
            send(conn, ("ready", None), shared=False)
            _serve(conn, init["clients"], init["work_model"], init["evaluator"], device, init["shared_memory"])
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone or closed the pipe
    except BaseException as exc:
        code = 1
        try:
            send(conn, ("error", _error_body(exc)), shared=False)
        except Exception:  # the pipe itself failed: the parent reports the death
            pass
    finally:
        conn.close()
        _exit_now(code)


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker once the process that started it is gone (killed, say), even in the middle of a fit."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    _exit_now(1)


def _exit_now(code: int = 0) -> None:
    """End the worker without the interpreter's teardown (seconds with torch loaded; nothing to save)."""
    for child in multiprocessing.active_children():  # loader workers: what multiprocessing's exit hook does
        if child.daemon:
            child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(conn: Connection, clients: Sequence[Any], model: nn.Module, evaluator: Any,
           device: torch.device, shared_memory: bool) -> None:
    while True:
        first = receive(conn)  # our own parent's messages over a private pipe: full unpickling is intended
        if first is None:
            return
        task = receive(conn)
        try:
            reply: tuple[str, Any] = ("done", _fit(clients[task["index"]], model, evaluator, device, first, task))
        except (Exception, SystemExit) as exc:  # a client calling sys.exit() is a failing client, not a stop
            reply = ("error", _error_body(exc))
        try:
            message = pack(reply, shared=shared_memory)
        except Exception as exc:  # an update that does not pickle: nothing was written yet
            message = pack(("error", _error_body(exc)), shared=False)
        with message:
            message.send(conn)


def _fit(client: Any, model: nn.Module, evaluator: Any, device: torch.device, shared: Mapping[str, Any],
         task: Mapping[str, Any]) -> dict[str, Any]:
    client.load_state_dict(task["state"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        update = client.fit(model, shared["payload"], {**shared["instructions"], **task["instructions"]})
        if cuda:
            update.metadata[GPU_PEAK_BYTES] = int(torch.cuda.max_memory_allocated(device))
        local = to_plain(evaluator(model, [client.split.dataset])) if task["evaluate"] else None
        return {"update": update, "state": client.state_dict(), "local_eval": local}
    finally:
        if cuda:  # the main process aggregates and evaluates while this worker waits
            torch.cuda.empty_cache()


__all__ = ["GPU_PEAK_BYTES", "ClientPool", "ClientResult", "ConcurrentClientError", "RemoteTraceback",
           "WorkerDiedError", "worker_environment"]
