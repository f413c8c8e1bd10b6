"""Build time, size, recall@10 and query speed of the gallery store's FAISS factories.

Synthetic clustered features (unit vectors around ``--clusters`` random centres,
Gaussian noise of norm ``--noise`` in a random ``--intrinsic``-d subspace, L2-normalised), a gallery of ``--n`` and ``--queries`` held-out
queries from the same distribution. For each factory, a
:class:`fedreid.retrieval.GalleryStore` is created in a temporary folder and:

* build    - seconds of ``GalleryStore.create`` (training, adding, writing the
             whole store: index, vectors, SQLite table, header with checksums);
* index MB - size of the segments' indexes on disk (every ``seg-<n>.faiss``; every
             factory but ``Flat`` re-scores its candidates from the stored vectors, which are not counted) (the
             store also keeps the raw vectors, ``seg-<n>.vectors.npy``, for exact
             verification and HNSW rebuilds);
* recall   - recall@10 against exact search on ``--sample`` stored vectors
             (``GalleryStore.recall``), at the default parameters and after
             ``tune(--target)`` (the parameter it picked is shown); "held-out" is
             recall@10 of the ``--queries`` held-out queries at the tuned parameters;
* q/s 1t   - queries per second, one query per call, one thread;
* q/s batch- queries per second, all queries in one call, all threads;
* x exact  - both throughputs over the first factory's (list Flat first);
* q/s cold - every factory but ``Flat``: single-thread queries per second right after the
             store is reopened and every ``seg-<n>.vectors.npy`` is dropped from the page cache
             (``posix_fadvise(DONTNEED)``), so re-scoring reads its rows from disk;
* remove   - with ``--remove N``: one more line per factory, the seconds of
             ``GalleryStore.remove`` of N seeded items (the whole update: index,
             vectors, table, files) and recall@10 at the tuned parameters after it
             (unchanged when every item keeps its id).

    python bench/gallery_store.py                      # 100,000 x 512
    python bench/gallery_store.py --n 1000000          # the full run
    python bench/gallery_store.py --factories Flat,HNSW32 --n 20000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedreid.retrieval import GalleryStore  # noqa: E402

DEFAULT_FACTORIES = "Flat,IVF1024,Flat,IVF1024,PQ64,OPQ64,IVF1024,PQ64,HNSW32"


def split_factories(text: str) -> list[str]:
    """Split a comma-joined list of factory strings (which contain commas) at each new index type."""
    starts = ("Flat", "IVF", "OPQ", "HNSW", "PCA", "LSH", "PQ")
    parts, current = [], []
    for token in text.split(","):
        if current and token.startswith(starts) and not (current[-1].startswith(("IVF", "OPQ", "PCA"))):
            parts.append(",".join(current))
            current = []
        current.append(token)
    if current:
        parts.append(",".join(current))
    return parts


def clustered(n: int, d: int, clusters: int, noise: float, intrinsic: int, rng: np.random.Generator,
              centres: np.ndarray | None = None, basis: np.ndarray | None = None):
    """Unit features: a random unit centre plus noise of norm about ``noise`` in a random ``intrinsic``-d subspace.

    ``intrinsic=d`` is isotropic noise: every pair in a cluster is then about
    equally far apart, so the top-10 order rests on small differences that
    compressed codes lose (the hard case for PQ without refinement). A smaller
    ``intrinsic`` makes the features vary along few directions, shared by all
    clusters.
    """
    if centres is None:
        centres = rng.standard_normal((clusters, d)).astype(np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        basis = np.linalg.qr(rng.standard_normal((d, intrinsic)))[0].T.astype(np.float32)  # orthonormal rows
    out = np.empty((n, d), np.float32)
    for s in range(0, n, 100_000):
        m = min(100_000, n - s)
        latent = (noise / np.sqrt(intrinsic)) * rng.standard_normal((m, intrinsic)).astype(np.float32)
        x = centres[rng.integers(0, clusters, m)] + latent @ basis
        out[s : s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out, centres, basis


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the cached pages of ``path`` (flushed first; pages mapped by a process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def single_thread_qps(store: GalleryStore, queries: np.ndarray, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        store.search(queries[i : i + 1], 10)
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=2000)
    p.add_argument("--noise", type=float, default=1.0,
                   help="norm of the Gaussian noise around a unit centre (clusters overlap more as it grows)")
    p.add_argument("--intrinsic", type=int, default=512,
                   help="dimension of the subspace the noise lies in (default 512 = --dim: isotropic noise)")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--sample", type=int, default=500, help="verification queries (stored vectors)")
    p.add_argument("--target", type=float, default=0.95, help="recall@10 that tune() aims for")
    p.add_argument("--factories", default=DEFAULT_FACTORIES)
    p.add_argument("--refine", type=int, default=1, metavar="R",
                   help="PQ factories: re-score the top R*10 exactly from the stored vectors (GalleryStore refine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remove", type=int, default=0, metavar="N",
                   help="also time the removal of N seeded items and the recall after it (default 0: not timed)")
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    gallery, centres, basis = clustered(args.n, args.dim, args.clusters, args.noise, args.intrinsic, rng)
    queries, _, _ = clustered(args.queries, args.dim, args.clusters, args.noise, args.intrinsic, rng, centres, basis)
    rows = [{"path": f"g/{i:08d}.jpg", "camera": i % 8, "site": f"s{i % 3}", "timestamp": float(i)}
            for i in range(args.n)]
    threads = faiss.omp_get_max_threads()
    print(f"gallery {args.n} x {args.dim}, {args.clusters} clusters (noise {args.noise} in {args.intrinsic} dims), {args.queries} queries, "
          f"faiss {faiss.__version__}, {os.cpu_count()} CPUs, {threads} faiss threads")
    header = (f"{'factory':<22} {'build s':>8} {'index MB':>9} {'recall@10':>10} {'tuned':>16} "
              f"{'recall@10':>10} {'held-out':>9} {'q/s 1t':>9} {'q/s batch':>10} {'x exact':>12} {'q/s cold':>9}")
    print(header)
    print("-" * len(header))
    reference = None
    for factory in split_factories(args.factories):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "store"
            t0 = time.perf_counter()
            refine = args.refine if "PQ" in factory else 1
            store = GalleryStore.create(folder, gallery, rows, factory=factory, seed=args.seed, refine=refine)
            build = time.perf_counter() - t0
            size_mb = sum((folder / seg.files["index"]).stat().st_size for seg in store.segments) / 2**20
            default = store.recall(args.sample, 10, args.seed)["recall"]
            tuned = store.tune(args.target, args.sample, 10, args.seed)
            chosen = ", ".join(f"{k}={v}" for k, v in store.search_params.items()) or "exact"
            exact = store.exact_search(queries, 10).ids
            found = store.search(queries, 10).ids
            held_out = float(np.mean([len(np.intersect1d(f[f >= 0], e)) for f, e in zip(found, exact)]) / 10)
            faiss.omp_set_num_threads(1)
            n1 = min(200, args.queries)
            qps1 = single_thread_qps(store, queries, n1)
            faiss.omp_set_num_threads(threads)
            t0 = time.perf_counter()
            store.search(queries, 10)
            qpsb = args.queries / (time.perf_counter() - t0)
            cold = "-"
            if factory != "Flat":  # its candidates are re-scored from the stored vectors
                del store
                store = GalleryStore.open(folder)  # maps the segments' vectors; no page of them is mapped in yet
                for seg in store.segments:
                    drop_from_page_cache(folder / seg.files["vectors"])
                faiss.omp_set_num_threads(1)
                cold = f"{single_thread_qps(store, queries, n1):.0f}"
                faiss.omp_set_num_threads(threads)
            reference = reference or (qps1, qpsb)
            speedup = f"{qps1 / reference[0]:.1f}/{qpsb / reference[1]:.1f}"
            print(f"{factory:<22} {build:>8.1f} {size_mb:>9.1f} {default:>10.3f} {chosen:>16} "
                  f"{tuned['recall']:>10.3f} {held_out:>9.3f} {qps1:>9.0f} {qpsb:>10.0f} {speedup:>12} "
                  f"{cold:>9}", flush=True)
            if args.remove > 0:
                gone = np.random.default_rng(args.seed + 1).choice(store.ids, min(args.remove, store.ntotal - 1),
                                                                   replace=False)
                t0 = time.perf_counter()
                store.remove(gone.tolist())
                removal = time.perf_counter() - t0
                after = store.recall(args.sample, 10, args.seed)["recall"]
                print(f"{'':<22} remove {gone.size}: {removal:.2f} s; recall@10 after {after:.3f} "
                      f"(before {tuned['recall']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
