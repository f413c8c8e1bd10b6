"""A bounded load test of the search service: POST /search with an uploaded image at 1, 4 and 16 clients.

The server runs in a subprocess (``python -m fedreid.commands.eval_serve``,
the same code as ``tools/eval_reid.py serve``) on 127.0.0.1 only, over a
Flat gallery store of ``--gallery`` synthetic unit vectors built for an
untrained model (default resnet18, 256x128 input, 512-d features: the cost
per request is the model's forward passes of the upload and its flip, plus
the exact search). Each level sends exactly ``--requests`` requests (after
``--warmup`` unmeasured ones) from that many client threads, each with its
own keep-alive connection, and stops early when a level passes
``--level-timeout`` seconds. Prints p50/p99 latency and throughput per level
and the server's thread settings.

  OMP_NUM_THREADS=1 python bench/service_load.py
  python bench/service_load.py --requests 400 --backbone resnet50 --gallery 100000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

TOKEN = "load-test-token-0123456789abcdef"


def build(root: Path, backbone: str, height: int, width: int, gallery: int, seed: int) -> tuple[Path, Path]:
    """An untrained run folder and a Flat store of ``gallery`` random unit vectors carrying its fingerprint."""
    import torch

    from fedreid.config import ModelConfig, to_dict
    from fedreid.inference.model_io import load_model
    from fedreid.models.reid import create_reid_model, shared_state
    from fedreid.retrieval.store import GalleryStore

    run = root / "run"
    run.mkdir()
    model = create_reid_model(backbone, 0, bottleneck_dim=512, seed=seed)
    cfg = ModelConfig(backbone=backbone, bottleneck_dim=512, height=height, width=width)
    torch.save({"format": "fedreid.model", "model": to_dict(cfg), "mode": "fedpav", "round": 0,
                "state": shared_state(model)}, run / "model_final.pt")
    loaded = load_model(run, "cpu")
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((gallery, 512)).astype(np.float32)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    rows = [{"path": f"/synthetic/item_{i:07d}.jpg", "camera": i % 6, "site": ("north", "plaza", "station")[i % 3],
             "timestamp": 1_714_550_400.0 + 7 * i, "identity": i // 8} for i in range(gallery)]
    GalleryStore.create(root / "store", feats, rows, factory="Flat", model_fingerprint=loaded.fingerprint,
                        meta={"model_fingerprint": loaded.fingerprint, "model": str(run)})
    return run, root / "store"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not answer within {timeout:.0f} s")


def query_jpeg(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 110, np.uint8)
    img[height // 8 : height // 2, width // 4 : 3 * width // 4] = rng.integers(0, 255, 3)
    img[height // 2 : 7 * height // 8, width // 4 : 3 * width // 4] = rng.integers(0, 255, 3)
    img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes()


def run_level(url: str, clients: int, requests: int, image: bytes, k: int, timeout: float) -> dict:
    """``requests`` POST /search from ``clients`` threads; latencies of the answered ones."""
    import httpx

    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))
    deadline = time.monotonic() + timeout

    def worker() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            while time.monotonic() < deadline:
                with lock:
                    if next(counter, None) is None:
                        return
                t = time.perf_counter()
                try:
                    r = client.post("/search", files={"image": ("q.jpg", image, "image/jpeg")}, data={"k": str(k)})
                    ok = r.status_code == 200 and len(r.json()["results"]) == k
                    problem = None if ok else f"{r.status_code} {r.text[:120]}"
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                took = time.perf_counter() - t
                with lock:
                    if problem is None:
                        latencies.append(took)
                    else:
                        errors.append(problem)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - start
    lat = np.array(latencies) * 1000
    return {
        "clients": clients, "ok": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else "",
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "rps": len(latencies) / wall if wall > 0 else 0.0, "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,16", help="concurrent clients per level (comma list)")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per level")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--level-timeout", type=float, default=120.0, help="stop a level after this many seconds")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--gallery", type=int, default=10_000, help="items in the store")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    levels = [int(v) for v in args.levels.split(",")]

    with tempfile.TemporaryDirectory(prefix="fedreid-load-") as tmp:
        t = time.perf_counter()
        run, store = build(Path(tmp), args.backbone, args.height, args.width, args.gallery, args.seed)
        print(f"built {args.backbone} {args.height}x{args.width} and a Flat store of {args.gallery} items "
              f"in {time.perf_counter() - t:.1f} s")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, FEDREID_SERVE_TOKEN=TOKEN)
        cmd = [sys.executable, "-m", "fedreid.commands.eval_serve", "--model", str(run), "--index", str(store),
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
        log = open(Path(tmp) / "server.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc)
            image = query_jpeg(args.height // 2, args.width // 2, args.seed)
            run_level(url, 1, args.warmup, image, args.k, args.level_timeout)
            print(f"server: python -m fedreid.commands.eval_serve (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
                  f"{os.cpu_count()} CPUs); upload {len(image)} bytes JPEG {args.height // 2}x{args.width // 2}, "
                  f"k={args.k}, {args.requests} requests per level")
            print("| clients | requests ok | errors | p50 ms | p99 ms | req/s |")
            print("|---:|---:|---:|---:|---:|---:|")
            for clients in levels:
                r = run_level(url, clients, args.requests, image, args.k, args.level_timeout)
                print(f"| {r['clients']} | {r['ok']} | {r['errors']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                      f"| {r['rps']:.1f} |", flush=True)
                if r["errors"]:
                    print(f"  first error: {r['first_error']}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


if __name__ == "__main__":
    main()
