"""What moving a FedPav round's payload and updates between processes costs.

With ``run.concurrent_clients`` the main process sends every worker the
round's payload (ResNet-50's shared state, about 94 MB) and gets an update
of the same size back from every client, one after another.
:class:`fedreid.fl.concurrent.ClientPool` sends the tensors in memory files
(``shared_memory=True``, :mod:`fedreid.fl.shared_tensors`); with
``shared_memory=False`` they cross the pipes as :func:`torch.save` bytes.
This runs rounds of stand-in clients whose fit only copies the payload into
its update (no training, so the round is all transport) and prints, both
ways, the median round time after the first round and the ratio; then one
message's costs on its own: packing it, and sending and receiving it through
a worker and back:

    python bench/client_pool_transport.py [--backbone resnet50] [--clients 9] [--processes 2] [--rounds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.config import load_config  # noqa: E402
from fedreid.fl.concurrent import ClientPool  # noqa: E402
from fedreid.fl.shared_tensors import pack, receive, send, shared_memory_available  # noqa: E402
from fedreid.fl.update import Update  # noqa: E402
from fedreid.models.factory import create_model  # noqa: E402
from fedreid.models.reid import shared_state  # noqa: E402


class _Split:
    dataset = "none"


class CopyingClient:
    """A stand-in client: its update is a fresh copy of the payload (as a trained model's state would be)."""

    def __init__(self, name: str) -> None:
        self.name, self.split = name, _Split()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def fit(self, model: Any, payload: Mapping[str, torch.Tensor], instructions: Mapping[str, Any]) -> Update:
        return Update(self.name, {k: v.clone() for k, v in payload.items()}, 1, {"pid": os.getpid()})


def pool_rounds(payload: dict, clients: int, processes: int, rounds: int, shared_memory: bool) -> list[float]:
    members = [CopyingClient(f"client{i:03d}") for i in range(clients)]
    seconds = []
    with ClientPool(load_config(None, ["run.device=cpu"]), members, torch.nn.Linear(1, 1), processes=processes,
                    shared_memory=shared_memory) as pool:
        for r in range(rounds):
            t0 = time.perf_counter()
            updates = pool.fit_round(list(range(clients)), lambda k: payload, {"round": r})
            seconds.append(time.perf_counter() - t0)
            assert all(torch.equal(u.state[k], payload[k]) for u in updates[:1] for k in payload)
    return seconds


def _echo(conn, shared: bool) -> None:
    while True:
        message = receive(conn)
        if message is None:
            return
        send(conn, {k: v.clone() for k, v in message.items()}, shared=shared)


def message_costs(payload: dict, shared: bool, repeats: int = 5) -> tuple[float, float]:
    """(median seconds to pack the payload, median seconds to send it to a worker and receive its copy)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_echo, args=(child, shared))
    proc.start()
    child.close()
    packs, trips = [], []
    try:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            message = pack(payload, shared=shared)
            t1 = time.perf_counter()
            with message:
                message.send(parent)
            receive(parent)
            t2 = time.perf_counter()
            packs.append(t1 - t0)
            trips.append(t2 - t1)
        send(parent, None, shared=False)
    finally:
        proc.join(30)
    return statistics.median(packs[1:]), statistics.median(trips[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="resnet50", help="timm backbone whose shared state is sent")
    parser.add_argument("--clients", type=int, default=9, help="clients a round (default 9, the benchmark's)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the first not counted (default 4)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = create_model(f"reid:{args.backbone}", num_classes=0)  # random weights: only their bytes matter
    payload = shared_state(model)
    megabytes = sum(v.numel() * v.element_size() for v in payload.values()) / 1e6
    print(f"payload: {args.backbone}'s shared state, {len(payload)} tensors, {megabytes:.1f} MB; "
          f"{args.clients} clients on {args.processes} worker processes, {os.cpu_count()} CPUs")
    if not shared_memory_available():
        print("memory files are not available here (Linux only): nothing to compare")
        return 0
    ways = {"pipes (torch.save bytes)": False, "memory files": True}
    medians = {}
    print(f"\n{'transport':<26} {'round, median':>14} {'rounds':>30}")
    for label, shared in ways.items():
        seconds = pool_rounds(payload, args.clients, args.processes, args.rounds, shared)
        medians[label] = statistics.median(seconds[1:])
        print(f"{label:<26} {medians[label]:>12.3f} s   {', '.join(f'{s:.2f}' for s in seconds)}")
    before, after = medians.values()
    print(f"ratio: {before / after:.2f}x")
    print(f"\none message, median of 5\n{'transport':<26} {'pack':>9} {'to a worker and back':>22}")
    for label, shared in ways.items():
        packed, trip = message_costs(payload, shared)
        print(f"{label:<26} {packed * 1e3:>7.0f} ms {trip * 1e3:>19.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
