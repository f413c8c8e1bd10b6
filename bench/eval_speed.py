"""Speed and peak memory of the exact re-ID evaluation (fedreid.eval.metrics.evaluate).

For each size (Market-1501: 3,368 x 19,732; MSMT17: 11,659 x 82,161) and
feature dim, three methods are timed on the same synthetic features:

* ours   - ``evaluate(..., ap="standard")``: query blocks, counting ranks;
* matmul - the floor: the same block matmuls into the same buffer, nothing else;
* naive  - the textbook path (torchreid's python ``eval_market1501``): the full
  score matrix, a full argsort of every row, a per-query loop. When its
  estimated memory exceeds ``--naive-max-gb`` it runs on the first queries
  only and time/memory are extrapolated linearly (printed as such).

Every (size, dim, method) runs in a fresh subprocess so that its peak RSS
(VmHWM, reset after the data is generated where the kernel allows it) is its
own; torch/BLAS allocations are invisible to tracemalloc, hence RSS.

Synthetic data: per-identity unit centres plus per-camera offsets and
per-image noise, so rankings are neither trivial nor random (mAP well below 1);
each query identity has gallery images in other cameras and in its own camera
(removed by the protocol); the gallery also holds junk (pid -1, noisy images
of test identities) and distractors (pid 0, unrelated people).

    python bench/eval_speed.py [--sizes market,msmt17] [--dims 512,2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedreid.eval.metrics import DEFAULT_BLOCK_BYTES, _block_rows, evaluate  # noqa: E402

# name: (queries, gallery, identities, cameras, junk fraction, distractor fraction)
SIZES = {
    "market": (3368, 19732, 751, 6, 0.19, 0.14),
    "msmt17": (11659, 82161, 3060, 15, 0.02, 0.03),
}
METHODS = ("ours", "matmul", "naive")
NAIVE_BYTES_PER_SCORE = 28  # scores, distances, int64 argsort, int64 gathered pids, int32 matches


# --------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------


def _normalised(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _features(
    rng: np.random.Generator, centres: np.ndarray, cam_offsets: np.ndarray, pids_idx, cams, noise
) -> np.ndarray:
    """Unit features: centre + camera offset + noise, built in chunks (bounded memory)."""
    n, d = len(pids_idx), centres.shape[1]
    out = np.empty((n, d), dtype=np.float32)
    for a in range(0, n, 8192):
        b = min(n, a + 8192)
        x = rng.standard_normal((b - a, d), dtype=np.float32)
        x *= (noise[a:b, None] / np.sqrt(d)).astype(np.float32)
        x += centres[pids_idx[a:b]]
        x += cam_offsets[cams[a:b]]
        out[a:b] = _normalised(x)
    return out


def make_data(size: str, dim: int, seed: int = 0):
    """(qf, gf, q_pids, g_pids, q_camids, g_camids) with a realistic id/camera structure."""
    n_q, n_g, n_ids, n_cams, junk_frac, distr_frac = SIZES[size]
    rng = np.random.default_rng(seed)
    centres = _normalised(rng.standard_normal((2 * n_ids, dim), dtype=np.float32))
    cam_offsets = 0.3 * _normalised(rng.standard_normal((n_cams, dim), dtype=np.float32))
    # Each identity is seen by a few cameras; images pick one of them.
    id_cams = np.stack([rng.choice(n_cams, size=4, replace=False) for _ in range(n_ids)])

    q_idx = np.sort(np.concatenate([np.arange(n_ids), rng.integers(0, n_ids, n_q - n_ids)]))
    q_cams = id_cams[q_idx, rng.integers(0, 4, n_q)]
    n_junk, n_distr = int(junk_frac * n_g), int(distr_frac * n_g)
    n_true = n_g - n_junk - n_distr
    g_idx = np.concatenate([np.arange(n_ids), rng.integers(0, n_ids, n_true - n_ids)])
    g_cams = id_cams[g_idx, rng.integers(0, 4, n_true)]
    junk_idx = rng.integers(0, n_ids, n_junk)  # badly cropped images of test identities
    distr_idx = rng.integers(n_ids, 2 * n_ids, n_distr)  # people outside the test set

    def noise(n, lo, hi):
        # Same-identity cosine ~ 1/(1+noise^2) while negatives spread ~ 1/sqrt(dim):
        # scaling the noise by dim^(1/4) keeps the difficulty similar across dims
        # (Market-size mAP ~0.75, mINP ~0.25, i.e. a decent but imperfect model).
        return rng.uniform(lo, hi, n) * (dim / 512) ** 0.25

    qf = _features(rng, centres, cam_offsets, q_idx, q_cams, noise(n_q, 1.2, 3.0))
    all_idx = np.concatenate([g_idx, junk_idx, distr_idx])
    all_cams = np.concatenate([g_cams, rng.integers(0, n_cams, n_junk + n_distr)])
    all_noise = np.concatenate([noise(n_true, 1.2, 3.0), noise(n_junk, 3.0, 6.0), noise(n_distr, 1.2, 3.0)])
    perm = rng.permutation(n_g)
    gf = _features(rng, centres, cam_offsets, all_idx[perm], all_cams[perm], all_noise[perm])
    g_pids = np.concatenate([g_idx + 1, np.full(n_junk, -1), np.zeros(n_distr, dtype=np.int64)])[perm]
    return qf, gf, q_idx + 1, g_pids, q_cams, all_cams[perm]


# --------------------------------------------------------------------------
# The three methods
# --------------------------------------------------------------------------


def run_ours(qf, gf, q_pids, g_pids, q_camids, g_camids) -> float:
    return evaluate(qf, gf, q_pids, g_pids, q_camids, g_camids)["mAP"]


def run_matmul(qf, gf, *_ids) -> float:
    """The same block matmuls evaluate() does, into one reused buffer, results discarded."""
    rows = min(qf.shape[0], _block_rows(gf.shape[0], None, DEFAULT_BLOCK_BYTES))
    buffer = np.empty((rows, gf.shape[0]), dtype=np.float32)
    for a in range(0, qf.shape[0], rows):
        b = min(rows, qf.shape[0] - a)
        np.matmul(qf[a : a + b], gf.T, out=buffer[:b])
    return float("nan")


def run_naive(qf, gf, q_pids, g_pids, q_camids, g_camids) -> float:
    """Full distance matrix + full argsort + per-query loop, as torchreid's python path.

    numpy's default (unstable, SIMD) argsort as torchreid uses it: faster than a
    stable sort, and these random features have no exact ties.
    """
    distmat = 1.0 - qf @ gf.T  # cosine distance
    order = np.argsort(distmat, axis=1)
    del distmat
    matches = (g_pids[order] == q_pids[:, None]).astype(np.int32)
    aps = []
    for i in range(qf.shape[0]):
        ranked_pids, ranked_cams = g_pids[order[i]], g_camids[order[i]]
        keep = (ranked_pids != -1) & ~((ranked_pids == q_pids[i]) & (ranked_cams == q_camids[i]))
        raw = matches[i][keep]
        if not raw.any():
            continue
        precision = raw.cumsum() / np.arange(1, raw.size + 1)
        aps.append((precision * raw).sum() / raw.sum())
    return float(np.mean(aps))


# --------------------------------------------------------------------------
# Measurement (one subprocess per size, dim and method)
# --------------------------------------------------------------------------


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    """Reset the peak-RSS counter (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(size: str, dim: int, method: str, repeats: int, naive_max_gb: float) -> dict:
    data = make_data(size, dim)
    n_q, n_g = data[0].shape[0], data[1].shape[0]
    scale = 1.0
    if method == "naive":
        estimate = NAIVE_BYTES_PER_SCORE * n_q * n_g
        if estimate > naive_max_gb * 2**30:
            keep = max(1, int(naive_max_gb * 2**30 / (NAIVE_BYTES_PER_SCORE * n_g)))
            scale = n_q / keep
            data = (data[0][:keep], data[1], data[2][:keep], data[3], data[4][:keep], data[5])
    fn = {"ours": run_ours, "matmul": run_matmul, "naive": run_naive}[method]
    data_rss = _vm_hwm_bytes()
    reset = _reset_hwm()
    base_rss = _vm_hwm_bytes()
    times, value = [], float("nan")
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn(*data)
        times.append(time.perf_counter() - t0)
    peak = _vm_hwm_bytes()
    return {
        "time_s": statistics.median(times) * scale,
        "peak_bytes": peak if reset else max(peak, data_rss),
        "extra_bytes": (peak - base_rss) * scale,
        "extrapolated": scale != 1.0,
        "scale": scale,
        "mAP": value,
    }


def measure(size: str, dim: int, method: str, repeats: int, naive_max_gb: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", size, str(dim), method, str(repeats), str(naive_max_gb)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="market,msmt17", help="comma list of: " + ",".join(SIZES))
    parser.add_argument("--dims", default="512,2048", help="comma list of feature dims")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of: " + ",".join(METHODS))
    parser.add_argument(
        "--naive-max-gb",
        type=float,
        default=4.0,
        help="above this estimated memory the naive path runs on a query subset",
    )
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        size, dim, method, repeats, max_gb = args.worker
        print(json.dumps(worker(size, int(dim), method, int(repeats), float(max_gb))))
        return 0

    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    dims = [int(d) for d in args.dims.split(",") if d]
    methods = [m for m in args.methods.split(",") if m]
    block_mib = DEFAULT_BLOCK_BYTES // 2**20
    print(f"cpu threads: {os.cpu_count()}, repeats: {args.repeats}, block bytes: {block_mib} MiB")
    header = (
        f"{'size':8} {'dim':>5} {'method':7} {'time s':>8} {'peak GB':>8} {'extra GB':>9} {'mAP':>7}  note"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for size in sizes:
        for dim in dims:
            row = {}
            for method in methods:
                r = measure(size, dim, method, args.repeats, args.naive_max_gb)
                row[method] = r
                note = ""
                if r["extrapolated"]:
                    note = (
                        f"ran {1 / r['scale']:.1%} of the queries; "
                        f"time and extra memory extrapolated x{r['scale']:.1f}"
                    )
                print(
                    f"{size:8} {dim:5d} {method:7} {r['time_s']:8.2f} {_gb(r['peak_bytes']):>8} "
                    f"{_gb(r['extra_bytes']):>9} {r['mAP']:7.4f}  {note}",
                    flush=True,
                )
            summary.append((size, dim, row))
    print()
    print(f"{'size':8} {'dim':>5} {'ours/matmul':>12} {'naive/ours':>11} {'naive/matmul':>13}")
    for size, dim, row in summary:
        times = {m: row[m]["time_s"] for m in row}

        def ratio(a: str, b: str, width: int) -> str:
            return f"{times[a] / times[b]:{width}.2f}" if a in times and b in times else f"{'-':>{width}}"

        ratios = f"{ratio('ours', 'matmul', 12)} {ratio('naive', 'ours', 11)} {ratio('naive', 'matmul', 13)}"
        print(f"{size:8} {dim:5d} {ratios}")
    print("goals: ours/matmul <= 1.5, naive/ours >= 10; naive/matmul bounds naive/ours from above,")
    print("since both pay the same matmul.")
    print("peak GB: the process high-water RSS while the method ran (data included);")
    print("extra GB: above the RSS once the data was built.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
