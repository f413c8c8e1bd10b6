"""Exact re-ID evaluation on a device against its floor (block matmul + full argsort).

Times, on one device and the same random MSMT17-shaped problem:

* eval  - ``fedreid.eval.metrics.evaluate(..., backend="torch")``: scores,
  ranks, CMC and AP on the device, only per-query numbers copied back;
* floor - the same query blocks scored by one matmul each and every row
  argsorted, nothing else (no filtering, no metrics, nothing copied back).

Each is the median of 3 timed runs after one warm-up, with
``torch.cuda.synchronize`` around each run on CUDA. The problem: random
L2-normalised features around per-identity centres (noisy enough that mAP
stays well below 1), about 3,060 gallery
identities at MSMT17 size (scaled down with the gallery), 15 cameras, 2% junk
(pid -1) and 3% distractors (pid 0).

    python bench/gpu_eval.py                      # CPU, small: a few seconds
    python bench/gpu_eval.py --device cuda --msmt17

``run_eval_bench`` is the importable entry point (bench/gpu_round.py uses it).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.eval.metrics import evaluate  # noqa: E402

MSMT17 = (11_659, 82_161, 512)  # queries, gallery, dim
MSMT17_IDENTITIES = 3_060
N_CAMERAS = 15
JUNK_FRACTION, DISTRACTOR_FRACTION = 0.02, 0.03
REPEATS = 3


def make_problem(n_query: int, n_gallery: int, dim: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(qf, gf, q_pids, g_pids, q_camids, g_camids)``: float32 unit features, int64 ids."""
    rng = np.random.default_rng(seed)
    n_ids = max(2, round(MSMT17_IDENTITIES * n_gallery / MSMT17[1]))
    g_pids = rng.integers(1, n_ids + 1, n_gallery)
    special = rng.random(n_gallery)
    g_pids[special < JUNK_FRACTION] = -1
    g_pids[(special >= JUNK_FRACTION) & (special < JUNK_FRACTION + DISTRACTOR_FRACTION)] = 0
    q_pids = rng.integers(1, n_ids + 1, n_query)
    centres = rng.standard_normal((n_ids + 1, dim), dtype=np.float32)

    def features(pids: np.ndarray) -> np.ndarray:
        # Per-image noise 1.5-3x the centre's norm: same-identity cosines ~0.1-0.3 against
        # ~N(0, 1/dim) for others, so rankings are imperfect (mAP well below 1) as with a real model.
        x = centres[np.maximum(pids, 0)]
        noise = rng.uniform(1.5, 3.0, (pids.size, 1)).astype(np.float32)
        x += noise * rng.standard_normal(x.shape, dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x

    q_cams = rng.integers(0, N_CAMERAS, n_query)
    g_cams = rng.integers(0, N_CAMERAS, n_gallery)
    return features(q_pids), features(g_pids), q_pids, g_pids, q_cams, g_cams


def _median_seconds(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Median wall time of ``REPEATS`` calls after one warm-up, and the last call's result."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = fn()
    times = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _floor(qf: torch.Tensor, gf: torch.Tensor, rows: int) -> None:
    """Block matmul + full argsort of every row: what any exact ranking must at least do."""
    buffer = torch.empty((min(rows, qf.shape[0]), gf.shape[0]), dtype=torch.float32, device=qf.device)
    gt = gf.t()
    for start in range(0, qf.shape[0], rows):
        scores = buffer[: min(rows, qf.shape[0] - start)]
        torch.mm(qf[start : start + rows], gt, out=scores)
        torch.argsort(scores, dim=1, descending=True)


def run_eval_bench(
    device: str, n_query: int, n_gallery: int, dim: int, seed: int = 0, *, host: bool = False
) -> dict[str, Any]:
    """Seconds of the device evaluation and of its floor on ``device``, and their ratio.

    Returns ``eval_s`` (``evaluate(..., backend="torch")``, standard AP),
    ``floor_s`` (block matmul + full argsort with the same query blocks),
    ``ratio`` (eval_s / floor_s), and for reference ``block_size``,
    ``num_blocks``, ``mAP`` and ``rank1``. ``host`` adds ``host_s``:
    ``backend="numpy"`` on the same features (score blocks computed on
    ``device``, ranked on the host), and ``host_max_ap_diff``, the largest
    per-query AP difference between the two backends.
    """
    dev = torch.device(device)
    qf_np, gf_np, *ids = make_problem(n_query, n_gallery, dim, seed)
    qf, gf = torch.from_numpy(qf_np).to(dev), torch.from_numpy(gf_np).to(dev)
    del qf_np, gf_np

    with torch.no_grad():
        on_device = functools.partial(evaluate, qf, gf, *ids, return_per_query=True, backend="torch")
        eval_s, result = _median_seconds(on_device, dev)
        rows = int(result["block_size"])
        floor_s, _ = _median_seconds(lambda: _floor(qf, gf, rows), dev)
        out = {
            "eval_s": eval_s,
            "floor_s": floor_s,
            "ratio": eval_s / floor_s,
            "block_size": rows,
            "num_blocks": -(-n_query // rows),
            "mAP": float(result["mAP"]),
            "rank1": float(result["rank1"]),
        }
        if host:
            on_host = functools.partial(evaluate, qf, gf, *ids, return_per_query=True, backend="numpy")
            out["host_s"], host_result = _median_seconds(on_host, dev)
            out["host_max_ap_diff"] = float(
                np.max(np.abs(host_result["per_query"]["ap"] - result["per_query"]["ap"]))
            )
            out["host_same_first_ranks"] = bool(
                np.array_equal(host_result["per_query"]["first_match_rank"], result["per_query"]["first_match_rank"])
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--queries", type=int, default=500, help="query count (default: 500)")
    parser.add_argument("--gallery", type=int, default=5000, help="gallery size (default: 5000)")
    parser.add_argument("--dim", type=int, default=128, help="feature dim (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random problem")
    parser.add_argument(
        "--host", action="store_true", help="also time backend='numpy' (ranking on the host) and compare"
    )
    parser.add_argument(
        "--msmt17", action="store_true", help=f"MSMT17 size: {MSMT17[0]} x {MSMT17[1]} x {MSMT17[2]}"
    )
    args = parser.parse_args(argv)
    n_q, n_g, dim = MSMT17 if args.msmt17 else (args.queries, args.gallery, args.dim)
    out = run_eval_bench(args.device, n_q, n_g, dim, args.seed, host=args.host)

    name = args.device
    if torch.device(args.device).type == "cuda":
        name += f" ({torch.cuda.get_device_name(torch.device(args.device))})"
    print(f"device: {name}, torch {torch.__version__}, median of {REPEATS} after one warm-up")
    print(f"{'queries':>8} {'gallery':>8} {'dim':>5} {'blocks':>6} {'eval s':>8} {'floor s':>8} {'ratio':>6}"
          f" {'mAP':>7} {'Rank-1':>7}")
    print(
        f"{n_q:>8} {n_g:>8} {dim:>5} {out['num_blocks']:>6} {out['eval_s']:>8.3f} {out['floor_s']:>8.3f}"
        f" {out['ratio']:>6.2f} {out['mAP']:>7.4f} {out['rank1']:>7.4f}"
    )
    if args.host:
        print(
            f"host ranking (backend='numpy'): {out['host_s']:.3f} s; per-query AP max |diff| "
            f"{out['host_max_ap_diff']:.2e}, same first-match ranks: {out['host_same_first_ranks']}"
        )
    print("eval: evaluate(..., backend='torch'); floor: block matmul + full argsort, same blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
