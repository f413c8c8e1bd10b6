"""Latency of federated search on one host: a Flower run per query, a search session, and direct site links.

A SuperLink and ``--sites`` SuperNodes on 127.0.0.1 (TLS and node
authentication by default, as in production), each site with its own gallery
store of ``--items`` random unit features of ``--dim`` dimensions (Flat). Queries
are stored items with a little noise, L2-normalised. Printed:

* site search  - what the sites' own searches cost: ``answer_query`` on each
                 store in this process (median over the queries), the floor of a
                 federated query;
* fresh run    - ``--fresh`` searches the old way, one ``flwr run`` (mode=search)
                 each: submit, ServerApp start, nodes, query, end; seconds each;
* session open - seconds from ``flwr run`` of ``mode=search-session`` to its
                 socket answering;
* first query  - the session's first query (the SuperNodes fetch the run and its
                 app bundle for the first message of a run);
* per query    - median, 10th and 90th percentile, min and max over ``--queries``
                 queries after the first; every one must have all sites answered;
* idle CPU     - CPU seconds per second the deployment uses with the session
                 open and no query (pollers: SuperNodes, SuperExecs, the session);
* CPU / query  - CPU seconds all Flower processes of the deployment (SuperLink,
                 SuperNodes, their SuperExecs, the ClientApp process each message
                 starts, the session's ServerApp) used per query, from /proc: on a
                 machine with fewer free cores than that, it is the latency floor;
* rejoin       - one site's SuperNode stopped, a query (the site listed missing),
                 the SuperNode started again: seconds until a query has all
                 sites again, in the same session (no restart).

With ``--transport links`` (or ``both``, the default) the same session runs over
direct site links instead: one ``tools/flower_fed.py site-link`` process per site
(TLS, a token each) and ``session --links``; the same figures are printed under
"links:", the CPU from the site-link and session processes.

Where the time goes inside a query, as far as Flower 1.42 lets it be changed,
is described in docs/flower.md ("Search sessions").

    python bench/federated_search.py                     # 3 sites, 2000 x 512 each, 20 queries
    python bench/federated_search.py --queries 50 --fresh 0 --insecure --transport flower
    python bench/federated_search.py --transport links --queries 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedreid.flower.launch import (  # noqa: E402
    LocalDeployment,
    TLSFiles,
    search_run_config_string,
    session_run_config_string,
    stop_group,
)
from fedreid.flower.search import SitePolicy, answer_query, encode_vector  # noqa: E402
from fedreid.flower.search_codec import SearchQuery  # noqa: E402
from fedreid.flower.search_session import SessionClient  # noqa: E402
from fedreid.flower.security import make_node_key, make_tls_files  # noqa: E402
from fedreid.flower.site_link import make_link_token  # noqa: E402
from fedreid.retrieval import GalleryStore  # noqa: E402

FP = {"weights_sha256": "be" * 32, "backbone": "bench"}
TOOL = Path(__file__).resolve().parent.parent / "tools" / "flower_fed.py"


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def make_stores(root: Path, sites: list[str], items: int, dim: int, seed: int) -> dict[str, GalleryStore]:
    rng = np.random.default_rng(seed)
    stores = {}
    for i, site in enumerate(sites):
        rows = [{"path": f"/{site}/img_{j:06d}.jpg", "camera": j % 6, "site": site, "timestamp": 1.7e9 + j}
                for j in range(items)]
        stores[site] = GalleryStore.create(root / site, unit(rng.standard_normal((items, dim))), rows,
                                           meta={"model_fingerprint": FP})
    return stores


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import flwr

    return (f"{model or platform.processor()}, {os.cpu_count()} CPUs visible, Python {platform.python_version()}, "
            f"flwr {getattr(flwr, '__version__', '?')}")


def figures(values: list[float]) -> str:
    q = np.percentile(values, [10, 50, 90]) if values else [float("nan")] * 3
    return (f"median {q[1]:.3f} s  p10 {q[0]:.3f}  p90 {q[2]:.3f}  min {min(values):.3f}  max {max(values):.3f}"
            f"  (n={len(values)})")


def group_cpu(groups: set[int]) -> float:
    """CPU seconds used so far by the processes of these process groups, reaped children included (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:  # pgrp; then utime, stime, cutime, cstime
            total += sum(int(f) for f in fields[11:15])
    return total / tick


def all_answered(plain: dict, sites: list[str]) -> bool:
    return sorted(a["site"] for a in plain["answered"]) == sorted(sites)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--items", type=int, default=2000, help="gallery items per site (2000)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--queries", type=int, default=20, help="session queries after the first (20)")
    parser.add_argument("--fresh", type=int, default=2, help="searches as one Flower run each, for comparison (2)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the sites have per query (60)")
    parser.add_argument("--insecure", action="store_true", help="no TLS and no node authentication")
    parser.add_argument("--no-rejoin", action="store_true", help="skip the leave-and-rejoin measurement")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds to measure the idle CPU use over (10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument("--transport", choices=("flower", "links", "both"), default="both",
                        help="measure the Flower deployment, direct site links, or both (both)")
    args = parser.parse_args()

    sites = [f"site{i}" for i in range(args.sites)]
    work = Path(tempfile.mkdtemp(prefix="fr-bench-", dir="/tmp"))  # short: the session socket lives here
    print(f"machine: {machine()}")
    print(f"{args.sites} sites x {args.items} items x {args.dim}-d (Flat), k={args.k}, work folder {work}; "
          f"Flower: {'no TLS, no node auth' if args.insecure else 'TLS + node authentication'}, "
          "site links: TLS + a token each")
    stores = make_stores(work / "stores", sites, args.items, args.dim, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    picks = [(sites[i % len(sites)], int(rng.integers(args.items))) for i in range(args.queries + 8)]
    queries = [unit(stores[s].vectors[j] + 0.05 * unit(rng.standard_normal(args.dim))) for s, j in picks]

    site_seconds = []
    for q in queries[: min(len(queries), 20)]:
        per_site = []
        for site, store in stores.items():
            t = time.perf_counter()
            answer_query(store, SearchQuery(q, args.k, fingerprint=FP), site=site, policy=SitePolicy())
            per_site.append(time.perf_counter() - t)
        site_seconds.append(max(per_site))
    print(f"site search (in process, slowest site per query): {figures(site_seconds)}")

    code = 0
    if args.transport in ("links", "both"):
        code = measure_links(args, work, sites, stores, queries)
    if args.transport in ("flower", "both"):
        code = measure_flower(args, work, sites, stores, queries) or code
    if args.keep:
        print(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


def session_figures(args: argparse.Namespace, client: SessionClient, queries: list[np.ndarray], sites: list[str],
                    groups: set[int], prefix: str, processes: str) -> bool:
    """Print an open session's first query, idle CPU, per-query latency and CPU (``groups``: the processes
    serving it); True when every timed query had all sites."""
    t = time.perf_counter()
    first = client.search(queries[0], args.k, fingerprint=FP)
    print(f"{prefix}first query: {time.perf_counter() - t:.3f} s "
          f"({'all sites' if all_answered(first, sites) else 'NOT all sites'})", flush=True)
    cpu, t = group_cpu(groups), time.perf_counter()
    time.sleep(args.idle)
    idle = (group_cpu(groups) - cpu) / (time.perf_counter() - t)
    print(f"{prefix}idle CPU with the session open: {idle:.3f} s per second", flush=True)
    lat, complete = [], 0
    cpu = group_cpu(groups)
    for q in queries[1: 1 + args.queries]:
        t = time.perf_counter()
        plain = client.search(q, args.k, fingerprint=FP)
        lat.append(time.perf_counter() - t)
        complete += all_answered(plain, sites)
    cpu = (group_cpu(groups) - cpu) / max(len(lat), 1)
    print(f"{prefix}per query after the first: {figures(lat)}; all {len(sites)} sites answered in "
          f"{complete}/{len(lat)}", flush=True)
    print(f"{prefix}CPU per query ({processes}): {cpu:.3f} s; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    return complete == len(lat)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_link(work: Path, site: str, store: GalleryStore, port: int) -> subprocess.Popen:
    log = open(work / f"link-{site}.log", "ab")
    proc = subprocess.Popen([sys.executable, str(TOOL), "site-link", "--site", site, "--gallery-store",
                             str(store.folder), "--tls", str(work / "tls_links"), "--token",
                             str(work / "tokens" / site), "--listen", f"127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            raise SystemExit(f"site-link of {site} ended: see {work / f'link-{site}.log'}")
        time.sleep(0.1)
    raise SystemExit(f"site-link of {site} did not listen within 120 s")


def measure_links(args: argparse.Namespace, work: Path, sites: list[str], stores: dict,
                  queries: list[np.ndarray]) -> int:
    """The session over direct site links: open, first query, idle CPU, per-query latency, CPU, rejoin."""
    make_tls_files(work / "tls_links", hosts=("127.0.0.1",))
    ports = {s: free_port() for s in sites}
    for s in sites:
        make_link_token(work / "tokens" / s)
    (work / "links.yaml").write_text("ca: tls_links/ca.crt\nlinks:\n" + "".join(
        f"  - {{site: {s}, address: '127.0.0.1:{ports[s]}', token: tokens/{s}}}\n" for s in sites))
    code = 0
    t = time.perf_counter()
    links = {s: start_link(work, s, stores[s], ports[s]) for s in sites}
    sock = work / "l.sock"
    session = subprocess.Popen([sys.executable, str(TOOL), "session", "--links", str(work / "links.yaml"),
                                "--socket", str(sock), "--timeout", str(args.timeout), "--idle-timeout", "600",
                                *[a for s in sites for a in ("--expect", s)]],
                               stdout=open(work / "link-session.log", "ab"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    client = SessionClient(sock, timeout=args.timeout + 60)
    try:
        client.wait_ready(300, alive=lambda: session.poll() is None)
        print(f"links: {len(sites)} site-links and the session open: {time.perf_counter() - t:.2f} s", flush=True)
        groups = {p.pid for p in links.values()} | {session.pid}
        code = 0 if session_figures(args, client, queries, sites, groups, "links: ",
                                    "the site-links and the session") else 1
        if not args.no_rejoin and len(sites) > 1:
            gone = sites[-1]
            links[gone].send_signal(signal.SIGTERM)
            links[gone].wait(timeout=60)
            t = time.perf_counter()
            plain = client.search(queries[-1], args.k, fingerprint=FP, timeout=10)
            missing = [m["site"] for m in plain["missing"] if m["node_id"] is not None]
            print(f"links: {gone} stopped: query {time.perf_counter() - t:.3f} s, answered by "
                  f"{', '.join(a['site'] for a in plain['answered'])}; missing {missing}", flush=True)
            t = time.perf_counter()
            links[gone] = start_link(work, gone, stores[gone], ports[gone])
            started = time.perf_counter() - t
            t = time.perf_counter()
            back = client.search(queries[-2], args.k, fingerprint=FP)
            print(f"links: {gone} restarted ({started:.2f} s to listen): the next query, {time.perf_counter() - t:.3f}"
                  f" s, {'has all sites' if all_answered(back, sites) else 'does NOT have all sites'} "
                  "(same session)", flush=True)
            code = code or (0 if all_answered(back, sites) else 1)
        print(f"links: session served {client.close_session()} queries")
        session.wait(timeout=60)
    finally:
        for proc in (session, *links.values()):
            if proc.poll() is None:
                stop_group(proc, wait=10.0)
    return code


def measure_flower(args: argparse.Namespace, work: Path, sites: list[str], stores: dict,
                   queries: list[np.ndarray]) -> int:
    """A Flower run per query (``--fresh``), then the Flower search session."""
    tls = keys = None
    if not args.insecure:
        make_tls_files(work / "tls")
        tls = TLSFiles.from_dir(work / "tls")
        keys = {s: make_node_key(work / "keys", s)["private"] for s in sites}
    per_node = {s: {"gallery_store": str(stores[s].folder)} for s in sites}
    code = 0
    with LocalDeployment(work / "dep", sites, tls=tls, node_keys=keys or {}, per_node=per_node) as dep:
        fresh = []
        for i in range(args.fresh):
            out = work / f"fresh{i}.json"
            text = search_run_config_string(encode_vector(queries[i]), k=args.k, fingerprint=FP, timeout=args.timeout,
                                            expect=sites, out=out, join_timeout=120, node_auth=not args.insecure)
            t = time.perf_counter()
            rc = dep.cli.run(text, log=work / "fresh.log", timeout=600)
            fresh.append(time.perf_counter() - t)
            ok = rc == 0 and out.exists() and all_answered(json.loads(out.read_text()), sites)
            print(f"fresh run {i + 1}: {fresh[-1]:.2f} s{'' if ok else '  (NOT all sites answered)'}", flush=True)
        if fresh:
            print(f"fresh run per query: {figures(fresh)}")

        sock = work / "s.sock"
        text = session_run_config_string(sock, timeout=args.timeout, expect=sites, node_auth=not args.insecure,
                                         idle_timeout=600)
        t = time.perf_counter()
        proc = dep.cli.start(text, log=work / "session.log")
        client = SessionClient(sock, timeout=args.timeout + 60)
        try:
            client.wait_ready(300, alive=lambda: proc.poll() is None)
            opened = time.perf_counter() - t
            print(f"session open: {opened:.2f} s", flush=True)
            groups = {p.pid for p in dep.procs.values()} | {proc.pid}
            if not session_figures(args, client, queries, sites, groups, "",
                                   "all Flower processes"):
                code = 1
            if not args.no_rejoin and len(sites) > 1:
                gone = sites[-1]
                dep.stop_process(f"node-{gone}", signal.SIGTERM)
                t = time.perf_counter()
                plain = client.search(queries[-1], args.k, fingerprint=FP, timeout=10)
                missing = [m["site"] for m in plain["missing"]]
                print(f"{gone} stopped: query {time.perf_counter() - t:.2f} s, answered by "
                      f"{', '.join(a['site'] for a in plain['answered'])}; missing {missing}", flush=True)
                dep.start_node(gone)
                t, tries = time.perf_counter(), 0
                while time.perf_counter() - t < 300:
                    tries += 1
                    if all_answered(client.search(queries[-2], args.k, fingerprint=FP, timeout=10), sites):
                        break
                    time.sleep(1.0)
                back = time.perf_counter() - t
                after = []
                for q in queries[1:6]:
                    s = time.perf_counter()
                    ok = all_answered(client.search(q, args.k, fingerprint=FP), sites)
                    after.append(time.perf_counter() - s)
                    code = code or (0 if ok else 1)
                print(f"{gone} restarted: all sites answer again after {back:.1f} s ({tries} queries; SuperNode "
                      f"start included), same session; then {figures(after)}", flush=True)
            print(f"session served {client.close_session()} queries")
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                stop_group(proc, wait=10.0)
    return code


if __name__ == "__main__":
    sys.exit(main())
