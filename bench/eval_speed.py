"""Speed and peak memory of the exact re-ID evaluation (fedreid.eval.metrics.evaluate).

For each size (Market-1501: 3,368 x 19,732; MSMT17: 11,659 x 82,161) and
feature dim, four methods are timed on the same synthetic features:

* ours       - ``evaluate(..., ap="standard")``: query blocks, counting ranks;
* matmul     - the floor: the same block matmuls into the same buffer, nothing else;
* vectorised - a vectorised full-matrix + argsort evaluation (ours, written
  for this bench): the full score matrix, a full argsort of every row, then
  per query a numpy keep mask and a cumsum AP (no CMC loop);
* torchreid  - the torchreid python path (``eval_market1501`` of
  KaiyangZhou/deep-person-reid, torchreid/metrics/rank.py, re-implemented
  here): a full cosine-distance matrix, a full argsort, a full gathered
  match matrix, then a Python loop over queries with keep masks, a CMC
  cumsum and an AP built by a list comprehension over the whole ranked
  gallery. Junk (pid -1) is dropped from the gallery first, as torchreid's
  Market loader does, since its metric does not remove it.

The two full-matrix methods cost memory and time linear in the queries, so
they run on a query subset when asked to (torchreid: the first
``--torchreid-queries``, 500 by default, unless ``--full-torchreid``;
vectorised: above ``--naive-max-gb`` of estimated memory) and their time is
extrapolated linearly to all queries, printed as such; torchreid's full-size
memory is *computed* (distance matrix, argsort indices, match matrix and its
gather temporary), not measured. Every method's mAP and Rank-1 on the
queries it ran are checked against ours on the same queries (|diff| <= 1e-6).

Every (size, dim, method) runs in a fresh subprocess so that its peak RSS
(VmHWM, reset after the data is generated where the kernel allows it) is its
own; torch/BLAS allocations are invisible to tracemalloc, hence RSS.

Synthetic data: per-identity unit centres plus per-camera offsets and
per-image noise, so rankings are neither trivial nor random (mAP well below 1);
each query identity has gallery images in other cameras and in its own camera
(removed by the protocol); the gallery also holds junk (pid -1, noisy images
of test identities) and distractors (pid 0, unrelated people).

    python bench/eval_speed.py [--sizes market,msmt17] [--dims 512,2048] [--repeats 3]
    python bench/eval_speed.py --sizes market --dims 512 --full-torchreid
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

from fedreid.eval.metrics import evaluate  # noqa: E402
from fedreid.eval.ranking import DEFAULT_BLOCK_BYTES, JUNK_PID, block_rows  # noqa: E402

# name: (queries, gallery, identities, cameras, junk fraction, distractor fraction)
SIZES = {
    "market": (3368, 19732, 751, 6, 0.19, 0.14),
    "msmt17": (11659, 82161, 3060, 15, 0.02, 0.03),
}
METHODS = ("ours", "matmul", "vectorised", "torchreid")
NAIVE_BYTES_PER_SCORE = 28  # scores, distances, int64 argsort, int64 gathered pids, int32 matches
# torchreid's eval_market1501 at full size, per query x gallery score: the float32
# distance matrix and the int64 argsort indices live throughout; the int32 match
# matrix is built from an int64 gather of the pids (and a bool compare) while both are alive.
TORCHREID_DISTMAT_ARGSORT_BYTES = 4 + 8
TORCHREID_PEAK_BYTES = 4 + 8 + 8 + 1 + 4
MAX_RANK = 50  # torchreid's default max_rank
CHECK_TOLERANCE = 1e-6


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
# The methods; each returns (mAP, Rank-1) over the queries it was given
# --------------------------------------------------------------------------


def run_ours(qf, gf, q_pids, g_pids, q_camids, g_camids) -> tuple[float, float]:
    r = evaluate(qf, gf, q_pids, g_pids, q_camids, g_camids)
    return r["mAP"], r["rank1"]


def run_matmul(qf, gf, *_ids) -> None:
    """The same block matmuls evaluate() does, into one reused buffer, results discarded."""
    rows = min(qf.shape[0], block_rows(gf.shape[0], None, DEFAULT_BLOCK_BYTES))
    buffer = np.empty((rows, gf.shape[0]), dtype=np.float32)
    for a in range(0, qf.shape[0], rows):
        b = min(rows, qf.shape[0] - a)
        np.matmul(qf[a : a + b], gf.T, out=buffer[:b])
    return None


def run_vectorised(qf, gf, q_pids, g_pids, q_camids, g_camids) -> tuple[float, float]:
    """Vectorised full-matrix + argsort: the whole score matrix, a full argsort, numpy per query.

    Written for this bench as a strong textbook baseline, *not* torchreid's
    code: per query it needs only a keep mask and a cumsum (AP vectorised, no
    CMC curve, no Python loop over gallery items). numpy's default (unstable,
    SIMD) argsort, as torchreid uses it; these random features have no exact ties.
    """
    distmat = 1.0 - qf @ gf.T  # cosine distance
    order = np.argsort(distmat, axis=1)
    del distmat
    matches = (g_pids[order] == q_pids[:, None]).astype(np.int32)
    aps, first_hits = [], []
    for i in range(qf.shape[0]):
        ranked_pids, ranked_cams = g_pids[order[i]], g_camids[order[i]]
        keep = (ranked_pids != JUNK_PID) & ~((ranked_pids == q_pids[i]) & (ranked_cams == q_camids[i]))
        raw = matches[i][keep]
        if not raw.any():
            continue
        precision = raw.cumsum() / np.arange(1, raw.size + 1)
        aps.append((precision * raw).sum() / raw.sum())
        first_hits.append(raw[0])
    return float(np.mean(aps)), float(np.mean(first_hits))


def run_torchreid(qf, gf, q_pids, g_pids, q_camids, g_camids) -> tuple[float, float]:
    """torchreid's python ``eval_market1501`` path, step for step (re-implemented, not copied).

    Expects the gallery without junk, as torchreid's dataset loader delivers
    it. Steps as there: cosine distance ``1 - q.g`` (float32) for all pairs; a
    full ``np.argsort`` of every row; the gathered 0/1 match matrix for all
    pairs; then for each query in Python: the same-pid-same-camera keep mask
    over the ranked gallery, the CMC as a clipped cumsum cut at max_rank
    (50), and the AP from a list comprehension dividing the running hit count
    by the rank at every gallery position, masked by the matches.
    """
    distmat = 1 - qf @ gf.T
    n_query, n_gallery = distmat.shape
    max_rank = min(MAX_RANK, n_gallery)
    ranked = np.argsort(distmat, axis=1)
    hit_matrix = (g_pids[ranked] == q_pids[:, np.newaxis]).astype(np.int32)
    curves, aps = [], []
    for q in range(n_query):
        positions = ranked[q]
        dropped = (g_pids[positions] == q_pids[q]) & (g_camids[positions] == q_camids[q])
        hits = hit_matrix[q][np.invert(dropped)]
        if not np.any(hits):
            continue  # the identity has no gallery image in another camera
        curve = hits.cumsum()
        curve[curve > 1] = 1
        curves.append(curve[:max_rank])
        running = hits.cumsum()
        precisions = [found / (position + 1.0) for position, found in enumerate(running)]
        aps.append((np.asarray(precisions) * hits).sum() / hits.sum())
    cmc = np.asarray(curves).astype(np.float32).sum(0) / len(curves)
    return float(np.mean(aps)), float(cmc[0])


RUNNERS = {"ours": run_ours, "matmul": run_matmul, "vectorised": run_vectorised, "torchreid": run_torchreid}


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


def _queries_to_run(method: str, n_q: int, n_g: int, opts: dict) -> int:
    """How many queries a method runs (the rest is extrapolated linearly)."""
    if method == "vectorised" and NAIVE_BYTES_PER_SCORE * n_q * n_g > opts["naive_max_gb"] * 2**30:
        return max(1, min(n_q, int(opts["naive_max_gb"] * 2**30 / (NAIVE_BYTES_PER_SCORE * n_g))))
    if method == "torchreid" and not opts["full_torchreid"]:
        return min(n_q, opts["torchreid_queries"])
    return n_q


def worker(size: str, dim: int, method: str, opts: dict) -> dict:
    qf, gf, q_pids, g_pids, q_camids, g_camids = make_data(size, dim)
    n_q = qf.shape[0]
    n_run = _queries_to_run(method, n_q, gf.shape[0], opts)
    subset = (qf[:n_run], gf, q_pids[:n_run], g_pids, q_camids[:n_run], g_camids)
    inputs = subset
    if method == "torchreid":  # its loader drops junk before anything is timed
        kept = g_pids != JUNK_PID
        inputs = (subset[0], np.ascontiguousarray(gf[kept]), subset[2], g_pids[kept], subset[4], g_camids[kept])
    n_gallery_used = inputs[1].shape[0]
    repeats = 1 if method == "torchreid" and n_run == n_q and n_q > 1000 else opts["repeats"]
    fn = RUNNERS[method]
    data_rss = _vm_hwm_bytes()
    reset = _reset_hwm()
    base_rss = _vm_hwm_bytes()
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn(*inputs)
        times.append(time.perf_counter() - t0)
    peak = _vm_hwm_bytes()
    scale = n_q / n_run
    # The check: ours on exactly the queries (and the full gallery, junk included) this method ran.
    reference = run_ours(*subset) if value is not None and method != "ours" else value
    out = {
        "time_s": statistics.median(times) * scale,
        "measured_s": statistics.median(times),
        "repeats": repeats,
        "peak_bytes": peak if reset else max(peak, data_rss),
        "extra_bytes": (peak - base_rss) * scale,
        "extrapolated": scale != 1.0,
        "scale": scale,
        "n_run": n_run,
        "n_query": n_q,
        "value": value,
        "reference": reference,
    }
    if method == "torchreid":
        pairs = n_q * n_gallery_used
        out.update(
            n_gallery=n_gallery_used,
            full_distmat_argsort_bytes=TORCHREID_DISTMAT_ARGSORT_BYTES * pairs,
            full_peak_bytes=TORCHREID_PEAK_BYTES * pairs,
        )
    return out


def measure(size: str, dim: int, method: str, opts: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps({"size": size, "dim": dim, "method": method, **opts})]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _note(method: str, r: dict) -> str:
    notes = []
    if r["extrapolated"]:
        notes.append(
            f"EXTRAPOLATED: ran {r['n_run']} of {r['n_query']} queries ({r['measured_s']:.2f} s; "
            f"mAP/Rank-1 over those), time and extra memory x{r['scale']:.2f}"
        )
    if method == "torchreid":
        how = "COMPUTED (not measured)" if r["extrapolated"] else "computed (the row above is measured)"
        notes.append(
            f"full-size memory {how}: distmat + argsort {_gb(r['full_distmat_argsort_bytes'])} GB, "
            f"peak with the match matrix {_gb(r['full_peak_bytes'])} GB ({r['n_gallery']} gallery without junk)"
        )
    if r["repeats"] == 1:
        notes.append("1 run")
    return "; ".join(notes)


def _check(size: str, dim: int, method: str, r: dict) -> bool:
    """Print whether a method's mAP / Rank-1 equal ours on the same queries; True when they do."""
    if r["value"] is None or method == "ours":
        return True
    (m_map, m_r1), (o_map, o_r1) = r["value"], r["reference"]
    d_map, d_r1 = abs(m_map - o_map), abs(m_r1 - o_r1)
    ok = d_map <= CHECK_TOLERANCE and d_r1 <= CHECK_TOLERANCE
    print(
        f"check {size} d={dim} {method} vs ours on the {r['n_run']} queries it ran: "
        f"mAP {m_map:.7f} vs {o_map:.7f} (|diff| {d_map:.1e}), "
        f"Rank-1 {m_r1:.7f} vs {o_r1:.7f} (|diff| {d_r1:.1e}): {'OK' if ok else 'MISMATCH'}"
    )
    return ok


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
        help="above this estimated memory the vectorised path runs on a query subset",
    )
    parser.add_argument(
        "--torchreid-queries", type=int, default=500, metavar="N",
        help="queries the torchreid path runs; its time is extrapolated to all (default 500)",
    )
    parser.add_argument(
        "--full-torchreid", action="store_true",
        help="run the torchreid path on every query (Market size: ~2 GB, minutes; MSMT17 size: ~24 GB)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job.pop("size"), job.pop("dim"), job.pop("method"), job)))
        return 0

    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    dims = [int(d) for d in args.dims.split(",") if d]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    if args.torchreid_queries < 1:
        parser.error("--torchreid-queries must be >= 1")
    opts = {
        "repeats": args.repeats,
        "naive_max_gb": args.naive_max_gb,
        "torchreid_queries": args.torchreid_queries,
        "full_torchreid": args.full_torchreid,
    }
    block_mib = DEFAULT_BLOCK_BYTES // 2**20
    print(f"cpu threads: {os.cpu_count()}, repeats: {args.repeats}, block bytes: {block_mib} MiB")
    header = (
        f"{'size':8} {'dim':>5} {'method':10} {'time s':>8} {'peak GB':>8} {'extra GB':>9} "
        f"{'mAP':>7} {'Rank-1':>7}  note"
    )
    print(header)
    print("-" * len(header))
    summary, checks = [], []
    for size in sizes:
        for dim in dims:
            row = {}
            for method in methods:
                r = measure(size, dim, method, opts)
                row[method] = r
                m_map, m_r1 = r["value"] if r["value"] is not None else (float("nan"), float("nan"))
                print(
                    f"{size:8} {dim:5d} {method:10} {r['time_s']:8.2f} {_gb(r['peak_bytes']):>8} "
                    f"{_gb(r['extra_bytes']):>9} {m_map:7.4f} {m_r1:7.4f}  {_note(method, r)}",
                    flush=True,
                )
            summary.append((size, dim, row))
            checks.append((size, dim, row))
    print()
    all_ok = all(_check(size, dim, m, r) for size, dim, row in checks for m, r in row.items())
    print()
    print(
        f"{'size':8} {'dim':>5} {'ours/matmul':>12} {'vectorised/ours':>16} {'torchreid/ours':>15} "
        f"{'vectorised/matmul':>18}"
    )
    for size, dim, row in summary:

        def ratio(a: str, b: str, width: int) -> str:
            if a not in row or b not in row:
                return f"{'-':>{width}}"
            mark = "*" if row[a]["extrapolated"] or row[b]["extrapolated"] else " "
            return f"{row[a]['time_s'] / row[b]['time_s']:{width - 1}.2f}{mark}"

        print(
            f"{size:8} {dim:5d} {ratio('ours', 'matmul', 12)} {ratio('vectorised', 'ours', 16)} "
            f"{ratio('torchreid', 'ours', 15)} {ratio('vectorised', 'matmul', 18)}"
        )
    print("* uses an extrapolated time (see the notes above).")
    print("goals: ours/matmul <= 1.5, full-matrix path / ours >= 10; vectorised/matmul bounds vectorised/ours")
    print("from above, since both pay the same matmul.")
    print("peak GB: the process high-water RSS while the method ran (data included);")
    print("extra GB: above the RSS once the data was built.")
    if not all_ok:
        print("MISMATCH: a method's mAP or Rank-1 differs from ours (see the checks above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
