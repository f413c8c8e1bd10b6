"""What an update of a large gallery store costs: add 1,000 items, remove 100, reopen (issue 23 §4).

A Flat :class:`fedreid.retrieval.GalleryStore` of ``--items`` (default
1,000,000) synthetic L2-normalised ``--dim``-d features (a seeded NumPy
Generator, in blocks) with synthetic paths is built in a temporary folder, then:

* add      - ``GalleryStore.add`` of ``--add`` (1,000) new items;
* remove   - ``GalleryStore.remove`` of ``--remove`` (100) items: once the
             last added ones (they share one segment), once items drawn at
             random over the whole store (they hit most segments: each hit
             segment is rewritten without them);
* reopen   - ``GalleryStore.open`` in this process right after the updates
             (files verified before and unchanged are not hashed again; the
             files written in the last ``RACY_NS`` are), then with
             ``previous=`` (what the search service does: unchanged segments
             taken over), then a fresh process's first open (hashes everything).

Bytes written: the sizes of the store folder's files that are new or changed
(another inode, size or modification time) after the step, compared with the
folder before it; the percentage is of the store's size before the step.
Times are medians of ``--repeat`` runs of each step (each on the store the
previous run left).

    python bench/store_updates.py                 # 1,000,000 x 512 (about 4 GB on disk, 2 GB in RAM)
    python bench/store_updates.py --items 100000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedreid.retrieval import GalleryStore  # noqa: E402


def unit_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def rows(start: int, n: int) -> list[dict]:
    return [{"path": f"/data/gallery/cam{(start + i) % 8}/img_{start + i:08d}.jpg", "camera": (start + i) % 8}
            for i in range(n)]


def states(folder: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for p in folder.iterdir():
        if p.is_file():
            st = p.stat()
            out[p.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def written(before: dict, after: dict) -> int:
    return sum(state[1] for name, state in after.items() if before.get(name) != state)


def measure(folder: Path, step) -> tuple[float, int, int]:
    """(seconds, bytes written, store bytes before) of ``step()``."""
    before = states(folder)
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    return seconds, written(before, states(folder)), sum(s[1] for s in before.values())


def report(name: str, runs: list[tuple[float, int, int]]) -> None:
    secs = statistics.median(r[0] for r in runs)
    byts = statistics.median(r[1] for r in runs)
    size = statistics.median(r[2] for r in runs)
    print(f"{name:<28} {secs:8.3f} s   {byts / 2**20:10.2f} MiB written   {100 * byts / size:7.3f} % of the store")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--add", type=int, default=1_000)
    ap.add_argument("--remove", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="folder for the temporary store (default: the system's)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "store"
        t0 = time.perf_counter()
        feats = np.empty((args.items, args.dim), np.float32)
        for s in range(0, args.items, 65_536):
            feats[s : s + 65_536] = unit_rows(rng, min(65_536, args.items - s), args.dim)
        store = GalleryStore.create(folder, feats, rows(0, args.items), factory="Flat")
        del feats
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"store: Flat, {args.items} x {args.dim}, {len(store.segments)} segments, {size / 2**30:.2f} GiB, "
              f"built in {time.perf_counter() - t0:.1f} s")
        adds, removes_last, removes_random = [], [], []
        for _ in range(args.repeat):
            start = int(store.header["next_id"])
            new = unit_rows(rng, args.add, args.dim)
            adds.append(measure(folder, lambda: store.add(new, rows(start, args.add))))
        report(f"add {args.add}", adds)
        for _ in range(args.repeat):
            last = store.ids[-args.remove:]
            removes_last.append(measure(folder, lambda: store.remove(last.tolist())))
        report(f"remove {args.remove} (one segment)", removes_last)
        for _ in range(args.repeat):
            picked = np.sort(rng.choice(store.ids, args.remove, replace=False))
            removes_random.append(measure(folder, lambda: store.remove(picked.tolist())))
        report(f"remove {args.remove} (random)", removes_random)
        reopen = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            GalleryStore.open(folder)
            reopen.append(time.perf_counter() - t0)
        print(f"{'reopen (this process)':<28} {statistics.median(reopen):8.3f} s   (first {reopen[0]:.3f} s)")
        reuse = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            store = GalleryStore.open(folder, previous=store)
            reuse.append(time.perf_counter() - t0)
        print(f"{'reopen (previous=, serve)':<28} {statistics.median(reuse):8.3f} s")
        code = ("import sys,time; sys.path.insert(0, sys.argv[2]); from fedreid.retrieval import GalleryStore; "
                "t=time.perf_counter(); GalleryStore.open(sys.argv[1]); print(time.perf_counter()-t)")
        out = subprocess.run([sys.executable, "-c", code, str(folder), str(Path(__file__).resolve().parent.parent)],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        print(f"{'open (a new process)':<28} {float(out.stdout.strip().splitlines()[-1]):8.3f} s   (hashes every file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
