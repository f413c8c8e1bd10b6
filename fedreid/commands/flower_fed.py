"""Federated training across machines on Flower: the same server and client code as train_fed.py.

One SuperLink (the server host), one SuperNode per client (each on the
machine holding that client's data), and a run submitted to the SuperLink.
The ServerApp samples, aggregates, runs CDW / KD / FedFTG, evaluates and
checkpoints as the in-process simulator does, and writes the same run folder;
each client keeps its private identity head and objective state on its own
disk. Telemetry and runtime dependency installation are off.

Across machines (replace HOST; TLS files from `certs`, node keys from `node-key`):
  # on the server host
  python tools/flower_fed.py certs --out tls --host HOST
  python tools/flower_fed.py superlink --tls tls --node-auth
  python tools/flower_fed.py register keys/market1501.pub --site market1501 --superlink HOST:8000 --ca tls/ca.crt
  # on each client host (its own data, its own key; copy tls/ca.crt there)
  python tools/flower_fed.py node-key --out keys market1501
  python tools/flower_fed.py node --client market1501 --superlink HOST:8000 --ca ca.crt \\
      --key keys/market1501 --prepared-root datasets/prepared --state-dir fedreid_state
  # from anywhere that reaches HOST:8000
  python tools/flower_fed.py run --config configs/fedreid/fedpav.yaml --out runs/fedpav_flower \\
      --superlink HOST:8000 --ca tls/ca.crt --node-auth

On one host (SuperLink and a SuperNode per client on 127.0.0.1, stopped at the end):
  python tools/flower_fed.py local --config configs/fedreid/synthetic_fedpav.yaml --out runs/flower_local
On Flower's simulation engine (Ray, the [flower-sim] extra); --client-gpus 0.25 trains four
clients at once per GPU, on every GPU of the machine or of a Ray cluster (docs/flower.md):
  python tools/flower_fed.py simulate --config configs/fedreid/synthetic_fedpav.yaml --out runs/flower_sim \\
      --client-gpus 0.25 --client-cpus 2

Federated search (each site's SuperNode gets --gallery-store, its own gallery store
folder; --search-thumbnails lets its answers carry small thumbnails):
  python tools/flower_fed.py node --client site1 ... --gallery-store /srv/gallery_store
  python tools/flower_fed.py search --superlink HOST:8000 --ca tls/ca.crt --node-auth \\
      --image query.jpg --model runs/fedpav --k 20 --expect site1 --expect site2 --out result.json
Sites receive only the query's feature vector (computed here), k, the filters and the
model fingerprint; they answer with ids, scores, cameras, times and file names. With
--node-auth each answer counts under the site name its node's key was registered with
(`register --site`), whatever the answer says.

`local` and `simulate` stop every process they started when they end, on
Ctrl-C, SIGTERM or SIGHUP, and (Linux) when the tool itself is killed. Before
starting anything they check --out (a new or empty folder or a run folder;
with --resume, one holding a checkpoint) and the work folder (new, empty or
one of theirs): a folder of other files is refused untouched. A node's
--state-dir is checked the same way by the node before it reads anything.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from fedreid.config import ConfigError, load_config
from fedreid.utils.cli import add_override_arguments, run_main

#: What `local` and `simulate` (and earlier versions of them) write in their work folder.
WORK_ENTRIES = ("flwr_home", "flwr_state", "logs", "state", "fedreid_state", "tls", "keys", "flwr_run.log",
                "superlink.db")
WORK_KIND = "flower-work"


def _security(args: argparse.Namespace, what: str) -> Optional[Path]:
    """The CA file, or None with --insecure; refuses to guess."""
    ca = getattr(args, "ca", None)
    if ca and args.insecure:
        raise ConfigError(f"{what}: give either --ca or --insecure, not both")
    if not ca and not args.insecure:
        raise ConfigError(f"{what}: pass --ca CA_FILE for TLS (see `certs`), or --insecure for plain "
                          "HTTP on a trusted network")
    return Path(ca) if ca else None


def cmd_certs(args: argparse.Namespace) -> int:
    from fedreid.flower.security import make_tls_files

    paths = make_tls_files(args.out, args.host or ["127.0.0.1", "localhost"], days=args.days)
    print(f"CA certificate:     {paths['ca']}  (give it to every SuperNode and to `run`)")
    print(f"server certificate: {paths['cert']}  (SuperLink only)")
    print(f"server key:         {paths['key']}  (SuperLink only; keep it private)")
    return 0


def cmd_node_key(args: argparse.Namespace) -> int:
    from fedreid.flower.security import make_node_key

    paths = make_node_key(args.out, args.name)
    print(f"private key: {paths['private']}  (stays on this SuperNode: --key)")
    print(f"public key:  {paths['public']}  (register it on the SuperLink: `register`)")
    return 0


def _exec(cmd: list[str], print_only: bool) -> int:
    from fedreid.flower.launch import flower_env

    print(" ".join(cmd), flush=True)
    if print_only:
        return 0
    os.execvpe(cmd[0], cmd, flower_env())
    return 1  # not reached


def cmd_superlink(args: argparse.Namespace) -> int:
    from fedreid.flower.launch import TLSFiles, superlink_command

    if not args.tls and not args.insecure:
        raise ConfigError("superlink: pass --tls DIR (from `certs`) or --insecure for plain HTTP on a trusted network")
    tls = TLSFiles.from_dir(args.tls) if args.tls else None
    cmd = superlink_command(port=args.port, host=args.host, tls=tls, node_auth=args.node_auth,
                            database=Path(args.database) if args.database else None)
    return _exec(cmd, args.print_only)


def cmd_node(args: argparse.Namespace) -> int:
    from fedreid.flower.launch import supernode_command

    ca = _security(args, "node")
    # Absolute paths: the node's ClientApp processes do not run in this folder.
    local = {"prepared_root": args.prepared_root and str(Path(args.prepared_root).resolve()),
             "classification_root": args.classification_root and str(Path(args.classification_root).resolve()),
             "device": args.device,
             "gallery_store": args.gallery_store and str(Path(args.gallery_store).resolve()),
             "gallery_root": args.gallery_root and str(Path(args.gallery_root).resolve()),
             "search_thumbnails": "true" if args.search_thumbnails else None}
    key = Path(args.key).resolve() if args.key else None
    if key is not None and not key.is_file():
        raise FileNotFoundError(f"node key {key} not found (make it with `node-key`)")
    if not args.print_only:  # refused here, before the SuperNode starts, rather than in its ClientApp's log
        from fedreid.flower.node import claim_state_dir

        claim_state_dir(args.state_dir)
        if args.gallery_store:
            from fedreid.retrieval.store import GalleryStore

            GalleryStore.open(args.gallery_store)  # every file checked, as each search will
    cmd = supernode_command(args.superlink, args.client, Path(args.state_dir).resolve(), port=args.port,
                            root_cert=ca.resolve() if ca else None, private_key=key,
                            **{k: v for k, v in local.items() if v})
    return _exec(cmd, args.print_only)


def cmd_register(args: argparse.Namespace) -> int:
    from fedreid.flower.launch import FlowerCli

    ca = _security(args, "register")
    if not Path(args.public_key).is_file():
        raise FileNotFoundError(f"public key {args.public_key} not found (make it with `node-key`)")
    FlowerCli(args.superlink, root_cert=ca).register(Path(args.public_key), name=args.site)
    print(f"registered {args.public_key} on {args.superlink}" + (f" as site {args.site}" if args.site else ""))
    return 0


def _search_query(args: argparse.Namespace) -> tuple[object, dict]:
    """The query feature and its model fingerprint: computed here from --image, or read from --feature."""
    from fedreid.flower.search import image_query, read_feature_file, read_fingerprint_file

    if args.image:
        if not args.model:
            raise ConfigError("search: --image needs --model (the sites' model: a run folder or model file)")
        if args.fingerprint:
            raise ConfigError("search: with --image the fingerprint is the model's; leave out --fingerprint")
        return image_query(args.image, args.model, args.device)
    if args.model:
        raise ConfigError("search: --model goes with --image; with --feature give --fingerprint")
    if not args.fingerprint:
        raise ConfigError("search: --feature needs --fingerprint (a JSON model fingerprint, or the header.json / "
                          "sidecar of the store or model that made the feature): the sites check it")
    return read_feature_file(args.feature), read_fingerprint_file(args.fingerprint)


def cmd_search(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from fedreid.flower.launch import FlowerCli, search_run_config_string
    from fedreid.flower.search import RESULT_FORMAT, encode_vector
    from fedreid.flower.search_codec import SearchFilters

    if args.session:
        if args.superlink or args.ca or args.insecure or args.node_auth or args.join_timeout is not None:
            raise ConfigError("search: with --session the session's own SuperLink, TLS and node authentication "
                              "apply; leave out --superlink, --ca, --insecure, --node-auth and --join-timeout")
        ca = None
    else:
        if not args.superlink:
            raise ConfigError("search: give --superlink HOST:PORT (a single search run), or --session SOCKET "
                              "(a search session started with `session`)")
        ca = _security(args, "search")
        if args.node_auth and ca is None:
            raise ConfigError("search: --node-auth needs --ca: Flower authenticates SuperNodes over TLS only")
    join_timeout = 30.0 if args.join_timeout is None else args.join_timeout
    if not 1 <= args.k <= 1000:
        raise ConfigError(f"search: --k must be in 1..1000, got {args.k}")
    if args.timeout <= 0:
        raise ConfigError(f"search: --timeout must be > 0 seconds, got {args.timeout}")
    filters = {"cameras": args.camera, "sites": args.site,
               "time_window": None if args.since is None and args.until is None else [args.since, args.until]}
    SearchFilters.from_plain(filters)  # refused here, in words, before anything runs
    out = Path(args.out).resolve() if args.out else None
    if out is not None and (out.is_dir() or out.is_symlink()):
        raise ConfigError(f"--out {out}: expected a JSON file path, it is a folder or a link")
    if out is not None and out.exists():  # refused before anything runs
        try:
            earlier = json.loads(out.read_text()).get("format")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            earlier = None
        if earlier != RESULT_FORMAT:
            raise ConfigError(f"--out {out} exists and is not a federated search result; choose another file")
    feature, fingerprint = _search_query(args)
    if args.session:
        from fedreid.flower.search_session import SessionClient

        plain = SessionClient(args.session).search(feature, args.k, fingerprint=fingerprint, filters=filters,
                                                   thumbnails=args.thumbnails, timeout=args.timeout,
                                                   expect=args.expect)
        return _show_result(plain, out)
    with tempfile.TemporaryDirectory(prefix="fedreid-search-") as tmp:
        # The ServerApp writes the result into this fresh folder when it runs on this host (the SuperLink's),
        # so an older file can never pass for this search's result; on another host it writes nothing.
        result_path = Path(tmp) / "result.json"
        text = search_run_config_string(encode_vector(feature), k=args.k, fingerprint=fingerprint, filters=filters,
                                        timeout=args.timeout, thumbnails=args.thumbnails, expect=args.expect or (),
                                        out=result_path, join_timeout=join_timeout,
                                        node_auth=args.node_auth)
        log = Path(tmp) / "flwr_run.log"
        rc = FlowerCli(args.superlink, root_cert=ca, home=Path(tmp) / "flwr_home").run(
            text, log=log, timeout=join_timeout + args.timeout + 600)
        if not result_path.is_file():  # the run failed, or its ServerApp runs on another host than this one
            from fedreid.utils.text import printable

            # The log may quote what a site sent (a ClientApp's error): one escaped line per line, no terminal control.
            for line in log.read_text(errors="replace")[-8000:].splitlines():
                print(printable(line, 2000), file=sys.stderr)
            why = ("the search failed" if rc != 0 else
                   "the SuperLink runs on another host: its ServerApp logged the result above; run `search` on "
                   "the SuperLink's host for the JSON")
            print(f"search: no result file (flwr exit code {rc}): {why}", file=sys.stderr)
            return 1
        plain = json.loads(result_path.read_text())
    return _show_result(plain, out)


def _show_result(plain: dict, out: Optional[Path]) -> int:
    """Print a search result (site texts escaped, see format_result), write it to ``out``; 0 if any site answered."""
    from fedreid.flower.search import format_result
    from fedreid.utils.io import write_json_atomic

    for line in format_result(plain):
        print(line)
    if out is not None:
        write_json_atomic(out, plain)
        print(f"result: {out}")
    return 0 if plain["answered"] else 1


def cmd_session(args: argparse.Namespace) -> int:
    """Open a search session (a long-lived run) on the SuperLink, serve until Ctrl-C / SIGTERM, then close it."""
    import tempfile

    from fedreid.flower.launch import FlowerCli, session_run_config_string, stop_group
    from fedreid.flower.search_session import SessionClient, SessionError

    ca = _security(args, "session")
    if args.node_auth and ca is None:
        raise ConfigError("session: --node-auth needs --ca: Flower authenticates SuperNodes over TLS only")
    if not args.timeout > 0:
        raise ConfigError(f"session: --timeout must be > 0 seconds, got {args.timeout}")
    sock = Path(args.socket).resolve()
    client = SessionClient(sock)  # refuses a path too long for a socket, before anything runs
    if not sock.parent.is_dir():
        raise ConfigError(f"session: --socket {sock}: its folder does not exist (the session runs on this host, "
                          "the SuperLink's)")
    if sock.exists() or sock.is_symlink():
        raise ConfigError(f"session: --socket {sock} exists; is another session running? (remove a stale socket "
                          "or choose another path)")
    text = session_run_config_string(sock, timeout=args.timeout, expect=args.expect or (), node_auth=args.node_auth,
                                     idle_timeout=args.idle_timeout)
    with tempfile.TemporaryDirectory(prefix="fedreid-session-") as tmp:
        log = Path(args.log).resolve() if args.log else Path(tmp) / "flwr_run.log"
        proc = FlowerCli(args.superlink, root_cert=ca, home=Path(tmp) / "flwr_home").start(text, log=log)
        opened = False
        try:
            status = client.wait_ready(args.join_timeout, alive=lambda: proc.poll() is None)
            opened = True
            print(f"search session open at {sock}: {len(status['nodes'])} nodes connected; site names "
                  f"{'authenticated' if status['node_auth'] else 'as the nodes declare them'}", flush=True)
            print(f"  query it on this host: python tools/flower_fed.py search --session {sock} --feature Q.npy "
                  "--fingerprint FP.json   (Ctrl-C here closes the session)", flush=True)
            while proc.poll() is None:  # the session serves until closed, idle, or stopped
                time.sleep(0.5)
            print(f"search session ended (flwr exit code {proc.returncode})", file=sys.stderr)
            return 0 if proc.returncode == 0 else 1
        except SessionError as exc:
            from fedreid.utils.text import printable

            for line in log.read_text(errors="replace")[-6000:].splitlines() if log.exists() else []:
                print(printable(line, 2000), file=sys.stderr)
            raise ConfigError(f"session: {exc}") from None
        finally:
            if proc.poll() is None:
                if opened or sock.exists():
                    try:  # the run ends with its ServerApp; stopping flwr alone would leave it on the SuperLink
                        queries = client.close_session()
                        print(f"search session closed after {queries} queries", file=sys.stderr)
                    except SessionError:
                        pass
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    stop_group(proc, wait=10.0)


def _finish(out: Path, rounds: int, rc: int, log: Optional[Path]) -> int:
    from fedreid.utils.checkpoint import latest_checkpoint, load_checkpoint

    ckpt_path = latest_checkpoint(out)
    done = len(load_checkpoint(ckpt_path)["history"]) if ckpt_path is not None else 0
    where = f" (flwr's output: {log})" if log else ""
    if rc == 0 and done >= rounds:
        print(f"run finished: {done} rounds, report: {out / 'report.md'}")
        return 0
    print(f"run stopped after {done} of {rounds} rounds, flwr exit code {rc}{where}; "
          f"continue it with --resume", file=sys.stderr)
    return 1


def _run_config(args: argparse.Namespace) -> tuple[Path, str, int]:
    from fedreid.flower.launch import run_config_string

    out = Path(args.out)
    if args.resume:
        if args.config:
            raise ConfigError("--resume uses the run's own config.yaml; pass overrides only")
        config = out / "config.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"{config} not found: nothing to resume in {out}")
    else:
        if not args.config:
            raise ConfigError("--config is required (or --resume)")
        config = Path(args.config)
    cfg = load_config(config, args.overrides)  # fails here, clearly, before any process starts
    text = run_config_string(config, out, args.overrides, resume=args.resume, round_timeout=args.round_timeout,
                             join_timeout=args.join_timeout, node_auth=bool(getattr(args, "node_auth", False)))
    return out, text, cfg.fl.rounds


def cmd_run(args: argparse.Namespace) -> int:
    from fedreid.flower.launch import FlowerCli

    ca = _security(args, "run")
    out, text, rounds = _run_config(args)
    rc = FlowerCli(args.superlink, root_cert=ca).run(text)
    return _finish(out, rounds, rc, None)


def _claim_local_folders(args: argparse.Namespace, out: Path) -> Path:
    """Check and claim the run folder and the work folder of `local` / `simulate`; returns the work folder.

    Nothing is started and nothing in a refused folder changes: the run
    folder as :func:`fedreid.fl.simulation.claim_run_dir`, the work folder
    new, empty, marked, or holding only what these commands write there
    (:data:`WORK_ENTRIES`).
    """
    from fedreid.fl.simulation import claim_run_dir
    from fedreid.utils.io import claim_output_dir

    work = Path(args.workdir) if args.workdir else out.parent / f"{out.name}_flower"
    if work.resolve() == out.resolve():
        raise ConfigError(f"--workdir {work} is the run folder --out; give them different folders")
    adopt = work.is_dir() and not work.is_symlink() and all(
        p.name.startswith(WORK_ENTRIES) or (p.name.startswith(".") and p.name.endswith(".tmp"))
        for p in work.iterdir())
    if work.exists() or work.is_symlink():  # a refusal here comes before --out is made
        claim_output_dir(work, WORK_KIND, tool="flower_fed", adopt=adopt)
    claim_run_dir(out, resume=args.resume, tool="flower_fed")
    claim_output_dir(work, WORK_KIND, tool="flower_fed", adopt=adopt)
    return work


def cmd_local(args: argparse.Namespace) -> int:
    from fedreid.fl.federation import build_federation
    from fedreid.flower.launch import LocalDeployment, TLSFiles
    from fedreid.flower.security import make_node_key, make_tls_files

    if args.node_auth and not args.tls:
        raise ConfigError("--node-auth needs --tls: Flower authenticates SuperNodes over TLS only")
    out, text, rounds = _run_config(args)
    work = _claim_local_folders(args, out)
    cfg = load_config(out / "config.yaml" if args.resume else args.config, args.overrides)
    clients = build_federation(cfg).server.client_names
    tls = None
    if args.tls:
        if not (work / "tls" / "ca.crt").exists():
            make_tls_files(work / "tls")
        tls = TLSFiles.from_dir(work / "tls")
    keys = {}
    if args.node_auth:
        for i, name in enumerate(clients):
            key = work / "keys" / f"node{i}"
            keys[name] = key if key.exists() else make_node_key(work / "keys", f"node{i}")["private"]
    print(f"one host: SuperLink + {len(clients)} SuperNodes ({', '.join(clients)}); logs in {work / 'logs'}",
          flush=True)
    with LocalDeployment(work, clients, tls=tls, node_keys=keys) as dep:
        log = work / "flwr_run.log"
        rc = dep.cli.run(text, log=log)
    return _finish(out, rounds, rc, log)


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedreid.fl.federation import build_federation
    from fedreid.flower.launch import LocalDeployment, simulation_federation_config

    simulation_federation_config(1, client_cpus=args.client_cpus, client_gpus=args.client_gpus)  # refused here
    out, text, rounds = _run_config(args)
    work = _claim_local_folders(args, out)
    cfg = load_config(out / "config.yaml" if args.resume else args.config, args.overrides)
    clients = build_federation(cfg).server.client_names
    print(f"Flower simulation engine: {len(clients)} virtual SuperNodes ({', '.join(clients)}); "
          f"node state in {work / 'fedreid_state'}", flush=True)
    with LocalDeployment(work, clients, simulation=True, client_cpus=args.client_cpus,
                         client_gpus=args.client_gpus) as dep:
        log = work / "flwr_run.log"
        rc = dep.cli.run(text, log=log)
    return _finish(out, rounds, rc, log)


def _time_arg(text: str) -> float:
    from fedreid.retrieval.gallery_rows import GalleryMetadataError, parse_time

    try:
        return parse_time(text, "--since/--until")
    except GalleryMetadataError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SEARCH_HELP = """Federated search: the query's feature goes to every site's SuperNode as a Flower
query message (the training deployment's TLS and node authentication); each site
searches its own gallery store (node --gallery-store) and answers with its top k
(ids, scores, cameras, times, file names; small thumbnails only where the site
runs with --search-thumbnails). The merged list is ranked by score. Gallery
images never leave a site. A site that does not answer within --timeout is
listed as missing; the search still returns the others' results. With
--node-auth (SuperLink started with --node-auth, each site's key registered
with `register KEY --site NAME`) an answer counts only under the site name its
node's key was registered with; without it, names are as the nodes declare them.

Examples:
  # on each site, the SuperNode with its store (beside the usual node flags)
  python tools/flower_fed.py node ... --gallery-store /data/site_a/store --search-thumbnails
  # on the SuperLink's host: a query image, the sites' model, two sites expected
  python tools/flower_fed.py search --superlink 127.0.0.1:9093 --ca certs/ca.crt --node-auth \\
      --image query.jpg --model runs/fedpav --k 20 --expect site_a --expect site_b --out result.json
  # a precomputed feature and the fingerprint of the model that made it
  python tools/flower_fed.py search --superlink 127.0.0.1:9093 --ca certs/ca.crt \\
      --feature q.npy --fingerprint store/header.json --camera 1 --since 2024-05-01
"""


SESSION_HELP = """Search session: one long-lived Flower run on the SuperLink whose ServerApp
takes query after query from a Unix socket on this host. A query then costs what
the sites' answers cost, not a run's start-up (`flwr run`, the ServerApp process,
waiting for nodes). Nodes are read from the SuperLink for every query: a site that
leaves is listed as missing, and searched again once its SuperNode is back, without
restarting the session. The same checks as `search` apply to every query.

Run it on the SuperLink's host (the socket is made there, mode 0600); Ctrl-C or
SIGTERM closes the session and ends its run. A session left without queries for
--idle-timeout seconds ends by itself.

Example:
  python tools/flower_fed.py session --superlink 127.0.0.1:9093 --ca certs/ca.crt --node-auth \\
      --socket /run/user/1000/fedreid-search.sock --expect site_a --expect site_b
  # another terminal, same host
  python tools/flower_fed.py search --session /run/user/1000/fedreid-search.sock \\
      --feature q.npy --fingerprint store/header.json --k 20
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("certs", help="a test CA and the SuperLink's TLS certificate and key")
    p.add_argument("--out", required=True, help="folder for ca.crt, server.pem, server.key")
    p.add_argument("--host", action="append", help="server name or IP the clients use (repeat); "
                   "default 127.0.0.1 and localhost")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("node-key", help="a SuperNode key pair for node authentication")
    p.add_argument("--out", required=True, help="folder for NAME and NAME.pub")
    p.add_argument("name", help="file name, e.g. the client's name")
    p.set_defaults(func=cmd_node_key)

    def security(q: argparse.ArgumentParser, ca: bool = True) -> None:
        if ca:
            q.add_argument("--ca", help="the CA certificate (ca.crt from `certs`): TLS")
        q.add_argument("--insecure", action="store_true", help="plain HTTP, no TLS (trusted networks only)")

    p = sub.add_parser("superlink", help="start the SuperLink on the server host")
    p.add_argument("--tls", metavar="DIR", help="folder from `certs` (ca.crt, server.pem, server.key)")
    security(p, ca=False)
    p.add_argument("--node-auth", action="store_true", help="only SuperNodes registered with `register` join")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (default all)")
    p.add_argument("--port", type=int, default=8000, help="port of the Fleet, Control and Runtime APIs (8000)")
    p.add_argument("--database", help="SQLite file for the SuperLink's state (default in memory)")
    p.add_argument("--print-only", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=cmd_superlink)

    p = sub.add_parser("node", help="start the SuperNode of one client on the host holding its data")
    p.add_argument("--client", required=True, help="which client this machine is (a dataset name, or client<kkk> of a partition, e.g. client003)")
    p.add_argument("--superlink", required=True, metavar="HOST:PORT")
    security(p)
    p.add_argument("--key", help="this node's private key (from `node-key`) when the SuperLink has --node-auth")
    p.add_argument("--state-dir", default="fedreid_state", help="private head and client state (never sent)")
    p.add_argument("--prepared-root", help="this machine's data.prepared_root")
    p.add_argument("--classification-root", help="this machine's classification.root")
    p.add_argument("--device", help="this machine's run.device, e.g. cuda:0")
    p.add_argument("--port", type=int, default=9094, help="local port for the node's ClientApp runtime (9094)")
    p.add_argument("--gallery-store", help="this site's gallery store folder, searched by `search` (never sent)")
    p.add_argument("--gallery-root", help="where the store's relative image paths lie (default: the store folder)")
    p.add_argument("--search-thumbnails", action="store_true",
                   help="let search answers carry small JPEG thumbnails of the hits (off: ids, scores, "
                        "cameras, times and file names only)")
    p.add_argument("--print-only", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("register", help="allow a SuperNode's public key on a SuperLink started with --node-auth")
    p.add_argument("public_key")
    p.add_argument("--site", help="the site (the node's --client name) this key belongs to: federated search with "
                   "--node-auth counts the node's answers only under this name")
    p.add_argument("--superlink", required=True, metavar="HOST:PORT")
    security(p)
    p.set_defaults(func=cmd_register)

    def run_arguments(q: argparse.ArgumentParser) -> None:
        q.add_argument("--config", help="YAML experiment config (read on the server host)")
        q.add_argument("--out", required=True, help="run folder on the server host")
        q.add_argument("--resume", action="store_true", help="continue the run in --out from its last round")
        q.add_argument("--round-timeout", type=float, help="seconds to wait for a round's replies (3600)")
        q.add_argument("--join-timeout", type=float, help="seconds to wait for all clients at the start (300)")
        add_override_arguments(q, help="config overrides (anywhere among the options)")

    p = sub.add_parser("run", help="submit a training run to a SuperLink and follow it to the end")
    p.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    security(p)
    p.add_argument("--node-auth", action="store_true",
                   help="the SuperLink authenticates SuperNodes (superlink --node-auth): a client name held by "
                        "a connected node is refused to any other node")
    run_arguments(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "search", help="federated search: every site searches its own gallery store, one merged list",
        description=SEARCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--superlink", metavar="HOST:PORT", help="the SuperLink's address (one search, one Flower run)")
    p.add_argument("--session", metavar="SOCKET", help="query the search session listening at SOCKET on this host "
                   "(`session`) instead of starting a run: no run start-up per query")
    security(p)
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--image", help="query image; its feature is computed here with --model")
    q.add_argument("--feature", help="query feature, a .npy of float32 [d] (with --fingerprint)")
    p.add_argument("--model", help="with --image: the sites' model (run folder, model_final.pt or checkpoint.pt)")
    p.add_argument("--fingerprint", help="with --feature: JSON model fingerprint, or a store header.json / model "
                   "sidecar holding one")
    p.add_argument("--device", default="cpu", help="device for --image's feature (cpu)")
    p.add_argument("--k", type=int, default=10, help="length of the merged list; each site sends at most k (10)")
    p.add_argument("--camera", type=int, action="append", help="only these cameras (repeat)")
    p.add_argument("--site", action="append", help="only items whose store site column is this (repeat)")
    p.add_argument("--since", type=_time_arg, help="only items with timestamp >= SINCE (seconds or ISO date/time, UTC)")
    p.add_argument("--until", type=_time_arg, help="only items with timestamp <= UNTIL (seconds or ISO date/time, UTC)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds the sites have to answer (30)")
    p.add_argument("--join-timeout", type=float,
                   help="seconds to wait for the --expect sites' nodes (else one node) to be connected (30; not "
                        "with --session)")
    p.add_argument("--expect", action="append", help="a site that should answer (repeat): listed as missing if none "
                   "answers as it")
    p.add_argument("--thumbnails", action="store_true", help="ask for thumbnails (only sites allowing them send)")
    p.add_argument("--node-auth", action="store_true",
                   help="the SuperLink authenticates SuperNodes (superlink --node-auth): each answer counts only "
                        "under the site name its node's key was registered with (register --site); others are "
                        "listed as wrong-site or unbound")
    p.add_argument("--out", help="write the result (ranked list with thumbnails, missing sites) as JSON here; "
                   "needs this tool on the SuperLink's host, where the ServerApp runs")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "session", help="open a search session: one long-lived run answering `search --session` queries",
        description=SESSION_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    security(p)
    p.add_argument("--socket", required=True, help="the session's Unix socket, a new path on this host (the "
                   "SuperLink's, where the ServerApp runs); made with mode 0600")
    p.add_argument("--node-auth", action="store_true",
                   help="the SuperLink authenticates SuperNodes: answers count only under the site name their "
                        "node's key was registered with (register --site)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds the sites have per query (30)")
    p.add_argument("--expect", action="append", help="a site every query should hear from (repeat)")
    p.add_argument("--idle-timeout", type=float, default=3600.0,
                   help="close the session after this many seconds without a query (3600; 0: never)")
    p.add_argument("--join-timeout", type=float, default=120.0,
                   help="seconds to wait for the session's run to start and open its socket (120)")
    p.add_argument("--log", help="file for the run's log (flwr run --stream); default a temporary file")
    p.set_defaults(func=cmd_session)

    p = sub.add_parser("local", help="SuperLink, one SuperNode per client and the run, all on 127.0.0.1")
    run_arguments(p)
    p.add_argument("--tls", action="store_true", help="TLS with a test CA made in the work folder")
    p.add_argument("--node-auth", action="store_true", help="node authentication with keys made in the work folder")
    p.add_argument("--workdir", help="logs, node state, keys (default <out>_flower next to --out)")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser("simulate", help="the same apps on Flower's simulation engine (Ray), one command")
    run_arguments(p)
    p.add_argument("--client-gpus", type=float, metavar="F",
                   help="share of a GPU Ray reserves per client (0.25: four clients train on one GPU at once; "
                        "several GPUs or a Ray cluster take more); default Flower's, 0")
    p.add_argument("--client-cpus", type=int, metavar="C",
                   help="CPUs Ray reserves per client (a whole number >= 1); default Flower's, 2")
    p.add_argument("--workdir", help="Flower's files, node state, the log (default <out>_flower next to --out)")
    p.set_defaults(func=cmd_simulate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from fedreid.flower.launch import Terminated, stop_on_signals

    args = build_parser().parse_args(argv)
    for item in getattr(args, "overrides", []):
        if "=" not in item:
            raise ConfigError(f"unexpected argument {item!r}: overrides look like key.sub=value")
    # SIGTERM/SIGHUP stop the tool like Ctrl-C: `local`/`simulate` then stop their SuperLink and SuperNodes,
    # `flwr run` is stopped with its process group. A SIGKILL is covered by PR_SET_PDEATHSIG (see launch.py).
    try:
        with stop_on_signals():
            return args.func(args)
    except Terminated as exc:
        print(f"stopped by {signal.Signals(exc.signum).name} (the processes this tool started were stopped)",
              file=sys.stderr)
        return int(exc.code)


def cli() -> None:
    """The console entry point: :func:`main` with one-line input errors and exit codes."""
    run_main(main)
