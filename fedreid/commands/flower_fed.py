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

`run` prints flwr's output as it comes: the ServerApp's round lines and errors. It checks
--config (with --resume, <out>/config.yaml) here before submitting, and the ServerApp reads
the same absolute path on the server host, so both must hold that file. When --out is on
this machine (the SuperLink runs here, or the run wrote there) the exit code is 0 only if
every planned round is in its checkpoint. Otherwise the run folder is on the SuperLink's
host and the exit code is flwr's: 0 says the run was submitted and followed to its end, not
that it succeeded; the ServerApp's lines and report.md on that host say how it ended.
`local` and `simulate` write flwr's output to flwr_run.log in their work folder.

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
import sys
from pathlib import Path
from typing import Optional

from fedreid.commands.flower_search import add_search_commands, ca_option
from fedreid.config import ConfigError
from fedreid.utils.cli import add_override_arguments, run_main


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
    from fedreid.flower.launch import command_line, flower_env

    print(command_line(cmd), flush=True)  # pasted into a shell, the same argv
    if print_only:
        return 0
    os.execvpe(cmd[0], cmd, flower_env())
    return 1  # not reached


def cmd_superlink(args: argparse.Namespace) -> int:
    from fedreid.flower.deployment import superlink_launch

    return _exec(superlink_launch(tls_dir=args.tls, insecure=args.insecure, port=args.port, host=args.host,
                                  node_auth=args.node_auth, database=args.database), args.print_only)


def cmd_node(args: argparse.Namespace) -> int:
    from fedreid.flower.deployment import supernode_launch

    local = {"prepared_root": args.prepared_root, "classification_root": args.classification_root,
             "device": args.device, "gallery_store": args.gallery_store, "gallery_root": args.gallery_root,
             "search_thumbnails": "true" if args.search_thumbnails else None}
    cmd = supernode_launch(client=args.client, superlink=args.superlink, ca=ca_option(args, "node"), key=args.key,
                           state_dir=args.state_dir, port=args.port, local=local, check=not args.print_only)
    return _exec(cmd, args.print_only)


def cmd_register(args: argparse.Namespace) -> int:
    from fedreid.flower.deployment import register_node_key

    register_node_key(args.public_key, superlink=args.superlink, ca=ca_option(args, "register"), site=args.site)
    print(f"registered {args.public_key} on {args.superlink}" + (f" as site {args.site}" if args.site else ""))
    return 0


def _prepare(args: argparse.Namespace):  # -> PreparedRun
    from fedreid.flower.deployment import prepare_run

    return prepare_run(out=args.out, config=args.config, overrides=args.overrides, resume=args.resume,
                       round_timeout=args.round_timeout, join_timeout=args.join_timeout,
                       node_auth=bool(getattr(args, "node_auth", False)))


def _finish(out: Path, rounds: int, rc: int, log: Optional[Path]) -> int:
    """The end of a run whose folder ``out`` is on this machine: exit code 0 only if flwr ended well and every
    planned round is in the folder's checkpoint."""
    from fedreid.flower.deployment import rounds_done

    done = rounds_done(out)
    if rc == 0 and done >= rounds:
        print(f"run finished: {done} rounds, report: {out / 'report.md'}")
        return 0
    where = f" (flwr's output: {log})" if log else " (flwr's output above)"
    print(f"run stopped after {done} of {rounds} rounds, flwr exit code {rc}{where}; "
          f"continue it with --resume", file=sys.stderr)
    return 1


def _finish_elsewhere(out: Path, superlink: str, rc: int) -> int:
    """The end of a run whose folder is on the SuperLink's host, not here: flwr's exit code, said as such."""
    if rc != 0:
        print(f"flwr run failed with exit code {rc} (its output above)", file=sys.stderr)
        return rc if rc > 0 else 1
    print(f"flwr run ended (exit code 0). The run's folder {out} is on the SuperLink's host ({superlink}), "
          "not on this machine: the ServerApp's lines above say how the run ended, and its report.md and "
          "checkpoint are there.")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from fedreid.flower.deployment import folder_stamp
    from fedreid.flower.launch import FlowerCli, on_this_host

    ca = ca_option(args, "run")
    run = _prepare(args)
    before = folder_stamp(run.out)
    rc = FlowerCli(args.superlink, root_cert=ca).run(run.run_config)  # flwr's output: on the console
    if on_this_host(args.superlink) or folder_stamp(run.out) != before:  # the ServerApp ran here
        return _finish(run.out, run.rounds, rc, None)
    return _finish_elsewhere(run.out.resolve(), args.superlink, rc)


def cmd_local(args: argparse.Namespace) -> int:
    from fedreid.flower.deployment import check_one_host_security, claim_local_folders, run_on_one_host

    check_one_host_security(args.tls, args.node_auth)
    run = _prepare(args)
    work = claim_local_folders(run.out, args.workdir, args.resume)
    rc, log = run_on_one_host(run, work, tls=args.tls, node_auth=args.node_auth, announce=lambda clients: print(
        f"one host: SuperLink + {len(clients)} SuperNodes ({', '.join(clients)}); logs in {work / 'logs'}",
        flush=True))
    return _finish(run.out, run.rounds, rc, log)


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedreid.flower import deployment

    deployment.check_simulation_resources(args.client_cpus, args.client_gpus)
    run = _prepare(args)
    work = deployment.claim_local_folders(run.out, args.workdir, args.resume)
    rc, log = deployment.run_on_simulation_engine(
        run, work, client_cpus=args.client_cpus, client_gpus=args.client_gpus, announce=lambda clients: print(
            f"Flower simulation engine: {len(clients)} virtual SuperNodes ({', '.join(clients)}); "
            f"node state in {work / 'fedreid_state'}", flush=True))
    return _finish(run.out, run.rounds, rc, log)


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

    p = sub.add_parser("run", help="submit a training run to a SuperLink and follow it to the end, printing "
                       "the ServerApp's output")
    p.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    security(p)
    p.add_argument("--node-auth", action="store_true",
                   help="the SuperLink authenticates SuperNodes (superlink --node-auth): a client name held by "
                        "a connected node is refused to any other node")
    run_arguments(p)
    p.set_defaults(func=cmd_run)

    add_search_commands(sub, security)

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
