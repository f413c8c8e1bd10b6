"""The federated-search commands of ``flower_fed.py``: ``search`` (one query) and ``session`` (a long-lived run).

They take the deployment's TLS and node-authentication options; the work is
:mod:`fedreid.flower.search_client`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

from fedreid.config import ConfigError
from fedreid.utils.io import write_json_atomic


def ca_option(args: argparse.Namespace, what: str) -> Optional[Path]:
    """The --ca file, or None with --insecure (one of them is required)."""
    from fedreid.flower.deployment import checked_ca

    return checked_ca(getattr(args, "ca", None), args.insecure, what)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def cmd_search(args: argparse.Namespace) -> int:
    """One federated search (a Flower run, or a query to a running session); 0 when a site answered.

    Every option is checked before a run starts or a session is asked, by
    the checks the ServerApp applies to what it receives (k, timeouts,
    filters, an L2-normalised query feature, the fingerprint): a refusal is a
    one-line ConfigError naming the option.
    """
    from fedreid.flower import search_client as sc
    from fedreid.flower.search import format_result

    if args.session:
        if args.superlink or args.ca or args.insecure or args.node_auth or args.join_timeout is not None:
            raise ConfigError("search: with --session the session's own SuperLink, TLS and node authentication "
                              "apply; leave out --superlink, --ca, --insecure, --node-auth and --join-timeout")
        ca = None
    else:
        if not args.superlink:
            raise ConfigError("search: give --superlink HOST:PORT (a single search run), or --session SOCKET "
                              "(a search session started with `session`)")
        ca = ca_option(args, "search")
        if args.node_auth and ca is None:
            raise ConfigError("search: --node-auth needs --ca: Flower authenticates SuperNodes over TLS only")
    # Every value the ServerApp (or the session) would refuse is refused here, before anything starts.
    filters, out = sc.check_search_options(k=args.k, timeout=args.timeout, cameras=args.camera, sites=args.site,
                                           since=args.since, until=args.until, out=args.out,
                                           join_timeout=args.join_timeout)
    feature, fingerprint = sc.query_feature(image=args.image, feature=args.feature, model=args.model,
                                            fingerprint=args.fingerprint, device=args.device)
    request = sc.SearchRequest(feature, fingerprint, args.k, filters, args.timeout, args.thumbnails,
                               tuple(args.expect or ()))
    if args.session:
        plain = sc.search_in_session(args.session, request)
    else:
        plain = sc.search_in_one_run(request, superlink=args.superlink, ca=ca, node_auth=args.node_auth,
                                     join_timeout=30.0 if args.join_timeout is None else args.join_timeout,
                                     report=_stderr)
        if plain is None:
            return 1
    for line in format_result(plain):
        print(line)
    if out is not None:
        write_json_atomic(out, plain)
        print(f"result: {out}")
    return 0 if plain["answered"] else 1


def cmd_session(args: argparse.Namespace) -> int:
    """Open a search session (a long-lived run, or direct site links), serve until Ctrl-C / SIGTERM, then close it."""
    from fedreid.flower.search_client import check_session, run_session

    if bool(args.superlink) == bool(args.links):
        raise ConfigError("session: give --superlink HOST:PORT (queries as Flower messages) or --links FILE "
                          "(queries straight to each site's site-link), one of the two")
    if args.links:
        if args.ca or args.insecure or args.node_auth:
            raise ConfigError("session: with --links each link's CA and token come from the links file; leave out "
                              "--ca, --insecure and --node-auth")
        return _link_session(args, check_session(ca=None, node_auth=False, timeout=args.timeout, socket=args.socket,
                                                 idle_timeout=args.idle_timeout))
    ca = ca_option(args, "session")
    sock = check_session(ca=ca, node_auth=args.node_auth, timeout=args.timeout, socket=args.socket,
                         idle_timeout=args.idle_timeout)

    def opened(status: dict) -> None:
        print(f"search session open at {sock}: {len(status['nodes'])} nodes connected; site names "
              f"{'authenticated' if status['node_auth'] else 'as the nodes declare them'}", flush=True)
        print(f"  query it on this host: python tools/flower_fed.py search --session {sock} --feature Q.npy "
              "--fingerprint FP.json   (Ctrl-C here closes the session)", flush=True)

    rc = run_session(superlink=args.superlink, ca=ca, socket=sock, node_auth=args.node_auth, timeout=args.timeout,
                     expect=args.expect or (), idle_timeout=args.idle_timeout, join_timeout=args.join_timeout,
                     log=args.log, on_open=opened, report=_stderr)
    print(f"search session ended (flwr exit code {rc})", file=sys.stderr)
    return 0 if rc == 0 else 1


def _link_session(args: argparse.Namespace, sock: Path) -> int:
    from fedreid.flower.search_session import SessionSettings, serve_requests
    from fedreid.flower.site_link import LinkTransport, read_links

    links = read_links(args.links)
    settings = SessionSettings(socket=sock, timeout=args.timeout, expect=tuple(args.expect or ()), node_auth=True,
                               idle_timeout=args.idle_timeout)
    with LinkTransport(links) as transport:
        print(f"search session open at {sock}: {len(links)} site links ("
              + ", ".join(f"{link.site} at {link.address}" for link in links) + "); site names bound to the links",
              flush=True)
        print(f"  query it on this host: python tools/flower_fed.py search --session {sock} --feature Q.npy "
              "--fingerprint FP.json   (Ctrl-C here closes the session)", flush=True)
        queries = None
        try:
            queries = serve_requests(transport, settings)
        except KeyboardInterrupt:
            pass
        finally:  # also when SIGTERM ends it (the tool then says so too)
            print("search session closed" + ("" if queries is None else f" after {queries} queries"),
                  file=sys.stderr)
    return 0


def cmd_link_token(args: argparse.Namespace) -> int:
    from fedreid.flower.site_link import make_link_token

    path = make_link_token(args.out)
    print(f"token written to {path} (mode 0600): give the same file to the site's `site-link --token` and name it "
          "in the server's links file")
    return 0


def cmd_site_link(args: argparse.Namespace) -> int:
    from fedreid.flower.launch import TLSFiles
    from fedreid.flower.search import SitePolicy
    from fedreid.flower.site_link import SiteLinkServer, parse_address, read_token

    host, port = parse_address(args.listen, "site-link: --listen")
    tls = TLSFiles.from_dir(args.tls)
    store = Path(args.gallery_store)
    if not store.is_dir():
        raise ConfigError(f"site-link: --gallery-store {store}: no such folder (build one with "
                          "`tools/eval_reid.py index`)")
    server = SiteLinkServer(site=args.site, store_folder=store, token=read_token(args.token, "site-link: --token"),
                            cert=tls.cert, key=tls.key, host=host, port=port,
                            policy=SitePolicy(thumbnails=args.search_thumbnails, thumbnail_size=args.thumbnail_size,
                                              image_root=Path(args.gallery_root) if args.gallery_root else None))
    items = server.check_store()
    print(f"site link of {server.site} listening on https://{host}:{server.port} ({store}: {items} items; "
          f"thumbnails {'on' if args.search_thumbnails else 'off'}); Ctrl-C stops it", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    print(f"site link of {server.site} stopped", file=sys.stderr)
    return 0


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
  python tools/flower_fed.py search --superlink 127.0.0.1:8000 --ca certs/ca.crt --node-auth \\
      --image query.jpg --model runs/fedpav --k 20 --expect site_a --expect site_b --out result.json
  # a precomputed feature and the fingerprint of the model that made it
  python tools/flower_fed.py search --superlink 127.0.0.1:8000 --ca certs/ca.crt \\
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

With --links FILE instead of --superlink, the session sends each query straight to
every site's `site-link` over HTTPS (kept-alive connections, all sites at once): no
Flower message per query, so a query costs what the sites' searches cost. The links
file names each site, its address, the CA its certificate is checked against and
its token; answers count only under those names (see `site-link --help`).

Example:
  python tools/flower_fed.py session --superlink 127.0.0.1:8000 --ca certs/ca.crt --node-auth \\
      --socket /run/user/1000/fedreid-search.sock --expect site_a --expect site_b
  # another terminal, same host
  python tools/flower_fed.py search --session /run/user/1000/fedreid-search.sock \\
      --feature q.npy --fingerprint store/header.json --k 20
  # the same session over direct site links (no SuperLink)
  python tools/flower_fed.py session --links links.yaml --socket /run/user/1000/fedreid-search.sock
"""


SITE_LINK_HELP = """Site link: a long-lived process on a site that keeps its gallery store open and
answers search sessions' queries over HTTPS, without a Flower message per query (a
SuperNode starts a ClientApp process per message and looks for messages every 3 s;
a link answers in what the search itself costs). The queries, answers and checks are
those of `search`: the server sends the query's feature, k, filters and the model
fingerprint; the site answers with ids, scores, cameras, times and file names
(thumbnails only with --search-thumbnails). Every request must carry the token; the
server checks this site's certificate against the CA in its links file, and counts
the answers only under the site name the links file gives this address.

Example (site_a, reached by the server as site-a.example.org):
  # on the site
  python tools/flower_fed.py certs --out tls_site_a --host site-a.example.org
  python tools/flower_fed.py link-token --out site_a.token
  python tools/flower_fed.py site-link --site site_a --gallery-store /srv/gallery_store \\
      --tls tls_site_a --token site_a.token --listen 0.0.0.0:9601
  # on the server: tls_site_a/ca.crt and site_a.token copied over, then a links file
  #   links:
  #     - {site: site_a, address: 'site-a.example.org:9601', token: site_a.token, ca: site_a_ca.crt}
  python tools/flower_fed.py session --links links.yaml --socket /run/user/1000/fedreid-search.sock
  python tools/flower_fed.py search --session /run/user/1000/fedreid-search.sock --feature q.npy \\
      --fingerprint store/header.json --k 20
"""


def add_search_commands(sub: argparse._SubParsersAction,
                        security: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``search`` and ``session`` to the ``flower_fed`` command's subcommands (``security`` adds --ca/--insecure)."""
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
    p.add_argument("--superlink", metavar="HOST:PORT", help="the SuperLink's address: queries go as Flower messages")
    p.add_argument("--links", metavar="FILE", help="a links file (YAML: each site's name, address, CA and token): "
                   "queries go straight to each site's `site-link`, no Flower run (see `site-link --help`)")
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

    p = sub.add_parser(
        "site-link", help="on a site: answer search sessions' queries over HTTPS from a store kept open",
        description=SITE_LINK_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--site", required=True, help="this site's name (the links file must list it under this name)")
    p.add_argument("--gallery-store", required=True, help="this site's gallery store folder (never sent)")
    p.add_argument("--tls", required=True, metavar="DIR",
                   help="folder from `certs --host THIS_HOST` (server.pem, server.key); its ca.crt goes to the server")
    p.add_argument("--token", required=True, help="the token file from `link-token` (mode 0600), also named in the "
                   "server's links file")
    p.add_argument("--listen", default="0.0.0.0:9601", metavar="HOST:PORT",
                   help="interface and port to listen on (0.0.0.0:9601)")
    p.add_argument("--gallery-root", help="where the store's relative image paths lie (default: the store folder)")
    p.add_argument("--search-thumbnails", action="store_true",
                   help="let answers carry small JPEG thumbnails of the hits (off: ids, scores, cameras, times and "
                        "file names only)")
    p.add_argument("--thumbnail-size", type=int, default=64, help="longest thumbnail side in pixels, 16..256 (64)")
    p.set_defaults(func=cmd_site_link)

    p = sub.add_parser("link-token", help="a new random token for one site link (a file, mode 0600)")
    p.add_argument("--out", required=True, help="the token file to write (never overwritten)")
    p.set_defaults(func=cmd_link_token)
