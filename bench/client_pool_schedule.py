"""How long a round of uneven clients takes on the client pool: handed out largest first or in the round's order.

:class:`fedreid.fl.concurrent.ClientPool` hands a round's clients out largest
first (by ``num_samples``). A client without ``num_samples`` counts as 0, so
the same clients without it are handed out in the round's order, which is a
seeded random permutation (:meth:`fedreid.fl.server.Server.sample_clients`).
This runs both on the same round orders with stand-in clients whose fit
sleeps ``--ms-per-sample`` milliseconds per training sample plus
``--fixed-ms`` (the payload still crosses as in a real round), so the round
time is the pool's schedule alone, with no training competing for the cores:
a run with 8 workers means the same on 2 cores as on 16. Prints, per worker
count, the median and worst round over the orders, each way, with the bound
no schedule can beat (the largest client, or the total work over the workers).

The default sizes are the training-set sizes of the synthetic nine-dataset
world that ``bench/gpu_round.py`` (c) trains (id_scale 0.17, min_ids 48).

    python bench/client_pool_schedule.py [--processes 2,4,8] [--orders 7] [--sizes 857,395,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.config import load_config  # noqa: E402
from fedreid.fl.concurrent import ClientPool  # noqa: E402
from fedreid.fl.update import Update  # noqa: E402

#: Training images of msmt17, dukemtmc, market1501, cuhk03np, prid2011, cuhk01, viper, 3dpes, ilids in (c)'s world.
C_WORLD_SIZES = "857,395,696,263,69,168,54,56,51"


class _Split:
    dataset = "none"


class SleepingClient:
    """A stand-in client whose fit takes ``seconds``: no computing, so a round's time is its schedule."""

    def __init__(self, name: str, samples: int, seconds: float) -> None:
        self.name, self.split, self.samples, self.seconds = name, _Split(), samples, seconds

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def fit(self, model: Any, payload: Mapping[str, torch.Tensor], instructions: Mapping[str, Any]) -> Update:
        time.sleep(self.seconds)
        return Update(self.name, dict(payload), self.samples, {})


class SizedClient(SleepingClient):
    """The same client with ``num_samples``, which the pool hands out largest first."""

    @property
    def num_samples(self) -> int:
        return self.samples


def round_times(kind: type, sizes: list[int], seconds: list[float], processes: int,
                orders: list[list[int]]) -> list[float]:
    clients = [kind(f"client{i:03d}", n, s) for i, (n, s) in enumerate(zip(sizes, seconds))]
    payload = {"w": torch.zeros(1000)}
    times = []
    with ClientPool(load_config(None, ["run.device=cpu"]), clients, torch.nn.Linear(1, 1),
                    processes=processes) as pool:
        pool.fit_round(list(range(len(clients))), lambda k: payload, {"round": -1})  # warm-up
        for r, order in enumerate(orders):
            t0 = time.perf_counter()
            pool.fit_round(order, lambda k: payload, {"round": r})
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=C_WORLD_SIZES, help="the clients' training-set sizes, comma-separated")
    ap.add_argument("--processes", default="2,4,8", help="worker counts (run.concurrent_clients) to compare")
    ap.add_argument("--orders", type=int, default=7, help="seeded random round orders, the same for both ways")
    ap.add_argument("--ms-per-sample", type=float, default=2.0, help="a stand-in fit's milliseconds per sample")
    ap.add_argument("--fixed-ms", type=float, default=100.0, help="a stand-in fit's milliseconds besides")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    sizes = [int(x) for x in args.sizes.split(",")]
    seconds = [(args.fixed_ms + args.ms_per_sample * n) / 1000 for n in sizes]
    rng = np.random.default_rng(args.seed)
    orders = [[int(k) for k in rng.permutation(len(sizes))] for _ in range(args.orders)]
    print(f"{len(sizes)} stand-in clients of {min(sizes)} to {max(sizes)} samples, a fit sleeping "
          f"{args.fixed_ms:g} ms + {args.ms_per_sample:g} ms a sample ({min(seconds):.2f} to {max(seconds):.2f} s); "
          f"{args.orders} seeded round orders, each round timed both ways")
    print(f"{'workers':>8} {'bound':>8} {'round order: median':>20} {'worst':>7} "
          f"{'largest first: median':>22} {'worst':>7} {'ratio':>6}")
    for processes in (int(x) for x in args.processes.split(",")):
        bound = max(max(seconds), sum(seconds) / processes)
        as_sampled = round_times(SleepingClient, sizes, seconds, processes, orders)
        largest_first = round_times(SizedClient, sizes, seconds, processes, orders)
        a, b = statistics.median(as_sampled), statistics.median(largest_first)
        print(f"{processes:>8} {bound:>7.2f}s {a:>19.2f}s {max(as_sampled):>6.2f}s {b:>21.2f}s "
              f"{max(largest_first):>6.2f}s {a / b:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
