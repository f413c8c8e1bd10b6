"""Direct site links: search-session queries that reach the sites without a Flower message.

Why: in a Flower deployment every message to a site is served by a new
ClientApp process, and an idle SuperNode looks for messages every 3 s, so a
federated search costs seconds per site however small the sites' searches
are (``docs/flower.md``). A site link is a long-lived process on the site
(``tools/flower_fed.py site-link``) that keeps its gallery store open and
answers queries over HTTPS; a search session with ``--links FILE`` sends each
query to every link at once over kept-alive connections
(:class:`LinkTransport`), so a query costs what the sites' searches cost.

The same as over Flower:

* the query and the answer are the records of
  :mod:`fedreid.flower.search_codec`, serialised as Flower serialises them
  (protobuf, :func:`encode_record`; nothing is unpickled);
* a site answers with :func:`~fedreid.flower.search.site_reply`: the model
  fingerprint is checked, error texts hold no local path, thumbnails are sent
  only where the site allows them (``--search-thumbnails``);
* the server judges the answers with
  :func:`~fedreid.flower.search.judge_replies`: every field checked, scores
  must be cosines, one answer per site, texts printed escaped.

Who answered: the server's links file (:func:`read_links`) names each site
with its address, the CA that signed its TLS certificate and a token file.
The server verifies the site's certificate against that CA and the
address's host name and sends the token; the site refuses any request
without it (HTTP 401). An answer counts only under the site name the links
file gives that address: an answer naming another site is ``wrong-site``.
The name is thus bound to the TLS identity of the address, as node
authentication binds it to a registered key. Tokens are secrets: their
files must be readable by their owner only (``link-token`` writes them so).

Sites that leave and come back: a link that cannot be reached is listed as
``unavailable`` for that query; the next query connects again, so a site
whose link process restarted is searched again without restarting the
session.

Protocol: ``POST /v1/search`` with ``Authorization: Bearer <token>`` and
``Content-Type: application/x-protobuf``, the body a serialised query record
of at most :data:`MAX_QUERY_BYTES`; ``200`` carries the answer record. A
refusal is a status (400, 401, 404, 405, 411, 413, 415) with one line of
``text/plain``.
"""

from __future__ import annotations

import concurrent.futures as futures
import hmac
import http.client
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import stat
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from fedreid.config import ConfigError
from fedreid.flower.search import (
    FederatedResult,
    NodeReply,
    SitePolicy,
    checked_timeout,
    judge_replies,
    make_query,
    site_reply,
)
from fedreid.flower.search_codec import MAX_K, MAX_THUMBNAIL_BYTES, SearchCodecError, SearchFilters, encode_query

log = logging.getLogger("fedreid.flower.site_link")

__all__ = [
    "LINK_PATH",
    "SiteLink",
    "read_links",
    "parse_address",
    "make_link_token",
    "read_token",
    "encode_record",
    "decode_record",
    "LinkStore",
    "SiteLinkServer",
    "LinkTransport",
]

LINK_PATH = "/v1/search"
CONTENT_TYPE = "application/x-protobuf"
#: The largest query a site reads: a 65,536-d float32 feature with its filters and fingerprint fits.
MAX_QUERY_BYTES = 1 << 20
#: A query too large is still read (and dropped) up to this size, so that its client gets the 413.
DRAIN_BYTES = 8 * MAX_QUERY_BYTES
#: The largest answer the server reads: k hits with a thumbnail each, and their rows.
MAX_REPLY_BYTES = MAX_K * (MAX_THUMBNAIL_BYTES + 2048) + (1 << 20)
#: Tokens: URL-safe text, long enough to be unguessable, short enough for a header.
TOKEN_MIN_CHARS, TOKEN_MAX_CHARS = 32, 512
#: Seconds a site keeps an idle connection open, waiting for the next query.
IDLE_SECONDS = 300.0
#: Seconds the server waits for a TCP and TLS connection to a site before calling it unavailable.
CONNECT_SECONDS = 5.0
#: How often a site reads its store again when another process replaced it mid-read.
READ_ATTEMPTS = 4


# =========================================================================== records on the wire


def encode_record(content: RecordDict) -> bytes:
    """A record as bytes, Flower's protobuf form (what a Flower message carries)."""
    return recorddict_to_proto(content).SerializeToString()


def decode_record(data: bytes) -> RecordDict:
    """Inverse of :func:`encode_record`; :class:`SearchCodecError` for bytes that are not a record."""
    proto = ProtoRecordDict()
    try:
        proto.ParseFromString(data)
        return recorddict_from_proto(proto)
    except Exception as exc:  # noqa: BLE001 -- protobuf's DecodeError and whatever the record builders raise
        raise SearchCodecError(f"not a serialised Flower record ({type(exc).__name__})") from None


# =========================================================================== tokens and the links file


def make_link_token(path: str | Path) -> Path:
    """A new random token in a new file ``path`` (mode 0600); an existing file is never overwritten."""
    from fedreid.flower.security import write_new_file

    path = Path(path)
    write_new_file(path, (secrets.token_urlsafe(32) + "\n").encode(), private=True)
    return path


def read_token(path: str | Path, what: str = "token file") -> str:
    """The token in ``path``: one line of URL-safe text, in a file only its owner can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot be read ({exc.__class__.__name__})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path}: others have access to it (mode {stat.S_IMODE(mode):o}); a token is a secret: "
                          f"chmod 600 {path}")
    allowed = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    if not TOKEN_MIN_CHARS <= len(text) <= TOKEN_MAX_CHARS or not set(text) <= allowed:
        raise ConfigError(f"{what} {path}: expected one line of {TOKEN_MIN_CHARS} to {TOKEN_MAX_CHARS} URL-safe "
                          "characters (A-Z a-z 0-9 - _); make one with `tools/flower_fed.py link-token`")
    return text


@dataclass(frozen=True)
class SiteLink:
    """One site as the server reaches it: its name, address, the CA its certificate is checked against, its token."""

    site: str
    host: str
    port: int
    ca: Path
    token: str = field(repr=False)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: Any, where: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port), or a ConfigError starting with ``where``."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{where}: expected HOST:PORT, got {text!r:.80}")
    host, _, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host.startswith("[") or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT with a port in 1..65535, got {text!r:.80}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not all(part and len(part) <= 63 and part.replace("-", "").isalnum() for part in host.split(".")):
            raise ConfigError(f"{where}: {host!r:.80} is neither an IP address nor a host name") from None
    return host, int(port)


def read_links(path: str | Path) -> list[SiteLink]:
    """The site links of a YAML file, every field checked (relative paths are taken from the file's folder).

    Format::

        ca: tls/ca.crt                  # the CA of every link unless a link names its own
        links:
          - site: site_a                # the name this site's answers count under
            address: 10.0.0.5:9601      # where its `site-link` listens (the certificate's host name or IP)
            token: tokens/site_a.token  # the file holding its token (mode 0600)
          - site: site_b
            address: site-b.example.org:9601
            token: tokens/site_b.token
            ca: tls/site_b_ca.crt
    """
    import yaml

    from fedreid.retrieval.fields import GalleryMetadataError
    from fedreid.retrieval.fields import site as site_rule

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"links file {path}: cannot be read ({exc.__class__.__name__})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"links file {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or set(doc) - {"ca", "links"} or not isinstance(doc.get("links"), list) \
            or not doc["links"]:
        raise ConfigError(f"links file {path}: expected a mapping with 'links' (a list of sites) and optionally "
                          "'ca'")
    base = path.parent

    def file_field(value: Any, where: str) -> Path:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"links file {path}: {where}: expected a file path, got {value!r:.80}")
        found = base / Path(value.strip()).expanduser()
        if not found.is_file():
            raise ConfigError(f"links file {path}: {where}: no file {found}")
        return found

    default_ca = file_field(doc["ca"], "ca") if "ca" in doc else None
    links: list[SiteLink] = []
    for i, entry in enumerate(doc["links"]):
        where = f"links[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"site", "address", "token", "ca"} \
                or not {"site", "address", "token"} <= set(entry):
            raise ConfigError(f"links file {path}: {where}: expected site, address, token and optionally ca, got "
                              f"{entry!r:.120}")
        try:
            name = site_rule(entry["site"], f"{where}.site")
        except GalleryMetadataError as exc:
            raise ConfigError(f"links file {path}: {exc}") from None
        host, port = parse_address(entry["address"], f"links file {path}: {where}.address")
        ca = file_field(entry["ca"], f"{where}.ca") if "ca" in entry else default_ca
        if ca is None:
            raise ConfigError(f"links file {path}: {where}: no CA (give 'ca' for the file or for this link): "
                              "a site's certificate is always checked")
        token = read_token(file_field(entry["token"], f"{where}.token"), f"links file {path}: {where}.token")
        links.append(SiteLink(name, host, port, ca, token))
    names = [link.site for link in links]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"links file {path}: site {twice[0]!r} is listed twice; each site has one link")
    return links


# =========================================================================== the site side


class LinkStore:
    """A site link's gallery store, open between queries and opened again when another process saved it.

    :meth:`read` runs one function on the store at a time. A save by another
    process (``index --add``/``--remove``) replaces ``header.json``; the
    store is then reopened (unchanged segments taken over) before the read,
    and a read during which the header changed is repeated, up to
    :data:`READ_ATTEMPTS` times, so every answer comes from one saved version.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(os.path.abspath(folder))
        self._lock = threading.Lock()
        self._store: Any = None
        self._stamp: Any = None

    def read(self, fn: Callable[[Any], Any]) -> Any:
        from fedreid.retrieval.store import GalleryStore, GalleryStoreError
        from fedreid.retrieval.store_files import header_stamp

        with self._lock:
            for attempt in range(READ_ATTEMPTS):
                stamp = header_stamp(self.folder)
                if stamp is not None and (self._store is None or stamp != self._stamp):
                    self._store = GalleryStore.open(self.folder, previous=self._store)
                    self._stamp = stamp
                if stamp is not None and self._store is not None:
                    try:
                        result, failure = fn(self._store), None
                    except Exception as exc:  # noqa: BLE001 -- judged below: raised as is unless the store moved
                        result, failure = None, exc
                    if header_stamp(self.folder) == self._stamp:
                        if failure is not None:
                            raise failure
                        return result
                time.sleep(0.05 * 2 ** attempt)
        raise GalleryStoreError(f"the gallery store was being replaced on disk during {READ_ATTEMPTS} attempts to "
                                "read it (another process is updating it): try again")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections: no TCP and TLS handshake per query
    server: "_HTTPServer"
    timeout = IDLE_SECONDS

    def setup(self) -> None:
        # Headers and body leave in two writes: without TCP_NODELAY, Nagle's algorithm holds the body until
        # the client's delayed ACK (about 40 ms per query).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def _answer(self, status: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, text: str, *, close: bool = False) -> None:
        log.warning("site link: refused a request from %s: %d %s", self.client_address[0], status, text)
        if close:  # the body was not read: the connection cannot carry another request
            self.close_connection = True
        self._answer(status, (text + "\n").encode())

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        link = self.server.link
        if self.path != LINK_PATH:
            return self._refuse(404, f"no such path; a site link answers POST {LINK_PATH}", close=True)
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {link.token}".encode()):
            return self._refuse(401, "this site link needs its token (Authorization: Bearer ...)", close=True)
        if self.headers.get("Content-Type", "").split(";")[0].strip().lower() != CONTENT_TYPE:
            return self._refuse(415, f"expected Content-Type {CONTENT_TYPE}", close=True)
        length = self.headers.get("Content-Length", "")
        if not (length.isascii() and length.isdigit()):  # str.isdigit alone passes "²", which int() refuses
            return self._refuse(411, "expected a Content-Length", close=True)
        if int(length) > MAX_QUERY_BYTES:
            if int(length) <= DRAIN_BYTES:  # read and dropped, so the client hears why rather than a broken pipe
                left = int(length)
                while left > 0 and (chunk := self.rfile.read(min(1 << 16, left))):
                    left -= len(chunk)
            return self._refuse(413, f"a query is at most {MAX_QUERY_BYTES} bytes, got {length}", close=True)
        data = self.rfile.read(int(length))
        try:
            content = decode_record(data)
        except SearchCodecError as exc:
            return self._refuse(400, str(exc))
        started = time.perf_counter()
        reply = site_reply(content, site=link.site, store_folder=link.store.folder, policy=link.policy,
                           read=link.store.read)
        log.info("site link: query from %s answered in %.1f ms", self.client_address[0],
                 (time.perf_counter() - started) * 1000)
        self._answer(200, encode_record(reply), CONTENT_TYPE)

    def _not_allowed(self) -> None:
        self._refuse(405, f"a site link answers POST {LINK_PATH} only", close=True)

    do_GET = do_PUT = do_DELETE = do_HEAD = do_PATCH = _not_allowed  # noqa: N815

    def handle(self) -> None:
        try:
            super().handle()
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:  # a client that is not one, or went away
            log.info("site link: connection from %s ended: %s", self.client_address[0], exc)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- http.server's signature
        log.debug("site link: %s %s", self.client_address[0], format % args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    link: "SiteLinkServer"

    def server_activate(self) -> None:
        self.open_connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every kept-alive connection: a stopped link answers nothing more, not even on a connection it had."""
        with self.connections_lock:
            for conn in list(self.open_connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class SiteLinkServer:
    """A site's link: answers search queries for ``site`` from the store in ``store_folder`` over HTTPS.

    ``cert``/``key``: the site's TLS certificate (for the host name or IP
    address the server's links file uses) and its private key. ``token``:
    the secret every request must carry. ``port`` 0 picks a free port
    (:attr:`port`). :meth:`serve_forever` serves until :meth:`shutdown`.
    """

    def __init__(self, *, site: str, store_folder: str | Path, token: str, cert: str | Path, key: str | Path,
                 host: str = "127.0.0.1", port: int = 0, policy: SitePolicy = SitePolicy()) -> None:
        from fedreid.retrieval.fields import GalleryMetadataError
        from fedreid.retrieval.fields import site as site_rule

        try:
            self.site = site_rule(site, "site")
        except GalleryMetadataError as exc:
            raise ConfigError(f"site-link: {exc}") from None
        if not TOKEN_MIN_CHARS <= len(token) <= TOKEN_MAX_CHARS:
            raise ConfigError(f"site-link: the token must have {TOKEN_MIN_CHARS} to {TOKEN_MAX_CHARS} characters")
        self.token, self.policy = token, policy
        self.store = LinkStore(store_folder)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"site-link: TLS certificate {cert} with key {key} cannot be loaded ({exc})") from None
        self._httpd = _HTTPServer((host, int(port)), _Handler, bind_and_activate=True)
        # The handshake runs in the connection's own thread, not in the accept loop: a slow client holds no one up.
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._httpd.link = self

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def check_store(self) -> int:
        """Open the store now (a site link with an unreadable store fails at start, not at a query); its item count."""
        return int(self.store.read(lambda store: store.ntotal))

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.5)

    def shutdown(self) -> None:
        """Stop serving (from another thread) and close the listening socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.close_connections()


# =========================================================================== the server side


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate was refused ({exc.verify_message})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is its site-link running?)"
    if isinstance(exc, (TimeoutError, OSError)) and "timed out" in str(exc):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


class LinkTransport:
    """Federated searches over direct site links: each query goes to every link at once.

    One kept-alive HTTPS connection per link, opened at its first query and
    again after a failure (a site that came back is reached at the next
    query); one request per link at a time. Node ids are the links' places
    in the list, from 1. Implements the session's ``SearchBackend``
    (:mod:`fedreid.flower.search_session`).
    """

    node_auth = True

    def __init__(self, links: Sequence[SiteLink]) -> None:
        if not links:
            raise ConfigError("site links: expected at least one link")
        self.links = list(links)
        self._contexts: dict[Path, ssl.SSLContext] = {}
        for link in self.links:
            if link.ca not in self._contexts:
                try:
                    self._contexts[link.ca] = ssl.create_default_context(cafile=str(link.ca))
                except (OSError, ssl.SSLError) as exc:
                    raise ConfigError(f"site link {link.site}: CA file {link.ca} cannot be loaded ({exc})") from None
        self._connections: list[Optional[http.client.HTTPSConnection]] = [None] * len(self.links)
        self._locks = [threading.Lock() for _ in self.links]
        # Twice the links: a request still ending after its query's timeout holds no other link's request back.
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * len(self.links), thread_name_prefix="fedreid-link")

    def sites(self) -> dict[int, str]:
        """Node id -> the site name its answers count under."""
        return {i + 1: link.site for i, link in enumerate(self.links)}

    def status(self) -> dict[str, Any]:
        return {"nodes": sorted(self.sites()), "node_auth": True,
                "sites": {str(n): s for n, s in self.sites().items()},
                "links": {link.site: link.address for link in self.links}}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for i, lock in enumerate(self._locks):
            with lock:
                self._drop(i)

    def __enter__(self) -> "LinkTransport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drop(self, i: int) -> None:
        conn, self._connections[i] = self._connections[i], None
        if conn is not None:
            conn.close()

    def _post(self, i: int, body: bytes, deadline: float) -> Optional[NodeReply]:
        link = self.links[i]
        if not self._locks[i].acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return None  # the previous query to this site is still waiting for it
        try:
            for attempt in (0, 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                conn = self._connections[i]
                reused = conn is not None
                if conn is None:
                    conn = http.client.HTTPSConnection(link.host, link.port, context=self._contexts[link.ca],
                                                       timeout=min(remaining, CONNECT_SECONDS))
                    self._connections[i] = conn
                try:
                    if conn.sock is None:
                        conn.connect()
                        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    conn.request("POST", LINK_PATH, body, {"Authorization": f"Bearer {link.token}",
                                                           "Content-Type": CONTENT_TYPE})
                    response = conn.getresponse()
                    data = response.read(MAX_REPLY_BYTES + 1)
                except (OSError, http.client.HTTPException) as exc:
                    self._drop(i)
                    if reused and attempt == 0 and time.monotonic() < deadline:
                        continue  # a kept-alive connection the site closed (e.g. it restarted): once more, afresh
                    if time.monotonic() >= deadline:
                        return None
                    return NodeReply(code="unavailable", reason=f"link {link.address}: {_describe(exc)}")
                if response.will_close or len(data) > MAX_REPLY_BYTES:
                    self._drop(i)
                if len(data) > MAX_REPLY_BYTES:
                    return NodeReply(code="malformed", reason=f"answer rejected: larger than {MAX_REPLY_BYTES} bytes")
                if response.status != 200:
                    text = data[:300].decode("utf-8", "replace").strip().splitlines()
                    return NodeReply(code="node-error", reason=f"link {link.address} answered HTTP {response.status}: "
                                                               f"{text[0] if text else response.reason}")
                try:
                    return NodeReply(decode_record(data))
                except SearchCodecError as exc:
                    return NodeReply(code="malformed", reason=f"answer rejected: {exc}")
            return None
        finally:
            self._locks[i].release()

    def exchange(self, content: RecordDict, timeout: float) -> dict[int, Optional[NodeReply]]:
        """Send ``content`` to every link at once; node id -> its reply, or None when none came within ``timeout``."""
        body = encode_record(content)
        deadline = time.monotonic() + timeout
        sent = {i + 1: self._pool.submit(self._post, i, body, deadline) for i in range(len(self.links))}
        futures.wait(sent.values(), timeout=timeout)
        return {node: (f.result() if f.done() else None) for node, f in sent.items()}

    def search(self, feature: Any, k: int, filters: Optional[SearchFilters | Mapping[str, Any]] = None,
               timeout: float = 30.0, *, fingerprint: Optional[Mapping[str, Any]], thumbnails: bool = False,
               expected_sites: Sequence[str] = ()) -> FederatedResult:
        """One federated search over the links: the same query, checks and result as over Flower.

        Every answer is bound to its link's site name (``authenticated``);
        a link that cannot be reached, refuses or does not answer within
        ``timeout`` is a missing site with the reason.
        """
        query = make_query(feature, k, filters, fingerprint=fingerprint, thumbnails=thumbnails)
        timeout = checked_timeout(timeout)
        started = time.monotonic()
        replies = self.exchange(encode_query(query), timeout)
        return judge_replies(query, replies, timeout=timeout, started=started, expected_sites=expected_sites,
                             bound_sites=self.sites(), transport="site-links")
