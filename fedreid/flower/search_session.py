"""A federated search session: one long-lived Flower run that takes query after query.

A search by ``mode=search`` (:func:`fedreid.flower.search.serve_search`) is a
Flower run of its own: ``flwr run`` builds and submits the app, the SuperLink
starts a ServerApp process, the ServerApp waits for the nodes, sends one
query and ends. A session (``mode=search-session``, :func:`serve_session`)
pays that once: its ServerApp stays up and listens on a Unix socket on the
SuperLink's host; each request on the socket is one
:func:`~fedreid.flower.search.federated_search` over the same run, so a query
after the first costs what the sites' answers cost (each site's SuperNode
picks up the message, its ClientApp searches its store) -- not a new run.

What a request sees:

* the nodes connected *now*: the node list is read from the SuperLink for
  every query, so a site whose SuperNode left is reported missing and is
  searched again once it is back, without restarting the session;
* the same checks as a single search: node authentication binds each answer
  to the site its key is registered as (``node-auth``), scores must be
  cosines, site texts are printed escaped (see :mod:`fedreid.flower.search`).

The socket (``session-socket``, a path on the SuperLink's host) is created
with mode 0600 in an existing folder: only the SuperLink's user (and root)
can send queries, as only they can read the run's result files. It is not a
network service and carries no authentication of its own. A path that exists
and is not a dead socket of an earlier session is refused, never replaced.
The session ends on a ``close`` request, after ``session-idle-timeout``
seconds without a request (0: never), or when its run is stopped
(``flwr stop``); the socket file is removed then.

Protocol: one JSON object per connection, one line (``\\n``-terminated, at
most :data:`MAX_REQUEST_BYTES`), answered by one JSON line:

* ``{"op": "search", "vector": <base64 float32>, "k": 10, "fingerprint": {...},
  "filters": {...}, "thumbnails": false, "timeout": 30, "expect": ["site", ...]}``
  -> ``{"ok": true, "result": <FederatedResult.to_plain()>}``;
* ``{"op": "status"}`` -> ``{"ok": true, "nodes": [...], "queries": n, "node_auth": b}``;
* ``{"op": "close"}`` -> ``{"ok": true}``, and the session ends;
* a refused request -> ``{"ok": false, "error": "<one line>"}``.

:class:`SessionClient` is the other end (``tools/flower_fed.py search --session``).

The socket and the protocol do not depend on how queries reach the sites:
:func:`serve_requests` serves any :class:`SearchBackend`, a Flower run's grid
(:class:`GridBackend`, :func:`serve_session`) or direct site links
(:class:`~fedreid.flower.site_link.LinkTransport`, ``session --links``), whose
queries cost milliseconds rather than a ClientApp process per site.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import shlex
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from flwr.serverapp import Grid

from fedreid.config import ConfigError
from fedreid.errors import FedReIDError
from fedreid.flower.search import (
    FederatedResult,
    decode_vector,
    encode_vector,
    federated_search,
    format_result,
    registered_sites,
    run_config_flag,
    run_config_seconds,
)
from fedreid.flower.search_codec import MAX_K, SearchCodecError, SearchFilters

log = logging.getLogger("fedreid.flower.search")

__all__ = [
    "SESSION_KEYS",
    "MAX_REQUEST_BYTES",
    "SessionError",
    "SessionSettings",
    "SearchBackend",
    "GridBackend",
    "serve_session",
    "serve_requests",
    "SessionClient",
]

#: Run-config keys of ``mode=search-session`` (besides ``mode``, ``search-timeout``, ``search-expect``, ``node-auth``).
SESSION_KEYS = ("session-socket", "session-idle-timeout")
#: The largest request line (a 65536-d feature is 350 kB of base64).
MAX_REQUEST_BYTES = 1 << 20
#: The longest wait a query may ask for, in seconds.
MAX_QUERY_TIMEOUT = 3600.0
#: Longest socket path (Linux's sun_path holds 108 bytes with the terminating NUL).
MAX_SOCKET_PATH_BYTES = 107
#: How often the session looks for replies while a query runs: a reply waits at most this long here.
POLL_SECONDS = 0.2


class SessionError(FedReIDError, RuntimeError):
    """A session request was refused, or the session could not be reached; the message says which."""


@dataclass(frozen=True)
class SessionSettings:
    """The run config of ``mode=search-session``.

    ``session-socket`` (required: the socket's path on the SuperLink's host,
    in an existing folder), ``session-idle-timeout`` (seconds without a
    request before the session ends; 0: never), ``search-timeout`` (seconds
    the sites have per query unless a request says otherwise),
    ``search-expect`` (site names, space separated: each query reports those
    no node answered as), ``node-auth`` (bind answers to registered sites).
    """

    socket: Path
    timeout: float = 30.0
    expect: tuple[str, ...] = ()
    node_auth: bool = False
    idle_timeout: float = 0.0

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "SessionSettings":
        path = str(run_config.get("session-socket", "")).strip()
        if not path:
            raise ConfigError("flower run config: mode=search-session needs 'session-socket' (a socket path on the "
                              "SuperLink's host; tools/flower_fed.py session fills it)")

        return cls(socket=Path(path), timeout=run_config_seconds(run_config, "search-timeout", 30.0),
                   expect=tuple(shlex.split(str(run_config.get("search-expect", "")))),
                   node_auth=run_config_flag(run_config, "node-auth"),
                   idle_timeout=run_config_seconds(run_config, "session-idle-timeout", 0.0, zero=True))


# =========================================================================== the socket


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(f"session socket {path}: a Unix socket path holds at most {MAX_SOCKET_PATH_BYTES} bytes; "
                          "choose a shorter one (e.g. under /tmp or /run/user/<uid>)")


def _listen(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` (mode 0600), or :class:`ConfigError` without touching another file."""
    _check_socket_path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"session socket {path}: its folder does not exist on the SuperLink's host")
    if path.is_symlink() or path.exists():
        if path.is_symlink() or not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"session socket {path} exists and is not a socket; choose another path "
                              "(nothing was changed)")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex(str(path)) == 0:
                raise ConfigError(f"session socket {path}: another session is listening there")
        path.unlink()  # a dead session's socket: nothing answers on it
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the file is born 0600: no moment where another user could connect
    try:
        server.bind(str(path))
    except OSError:
        server.close()
        raise
    finally:
        os.umask(old_umask)
    server.listen(8)
    return server


def _read_line(conn: socket.socket, limit: int = MAX_REQUEST_BYTES) -> bytes:
    """One ``\\n``-terminated line (or all until EOF), at most ``limit`` bytes; :class:`SessionError` beyond."""
    data = bytearray()
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return bytes(data)
        data += chunk
        end = data.find(b"\n")
        if end >= 0:
            return bytes(data[:end])
        if len(data) > limit:
            raise SessionError(f"request longer than {limit} bytes")


def _send(conn: socket.socket, doc: Mapping[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(doc, allow_nan=False).encode() + b"\n")
    except OSError as exc:  # the client went away: its loss, the session goes on
        log.warning("search session: the reply could not be sent (%s)", exc)


# =========================================================================== the ServerApp side


class SearchBackend(Protocol):
    """Where a session's queries go: the sites reached over a Flower run's grid, or over direct site links."""

    def status(self) -> dict[str, Any]:
        """``nodes`` (ids), ``node_auth`` (site names bound to identities) and, when bound, ``sites`` (id -> name)."""

    def search(self, feature: Any, k: int, filters: SearchFilters, timeout: float, *,
               fingerprint: Optional[Mapping[str, Any]], thumbnails: bool,
               expected_sites: Sequence[str]) -> FederatedResult:
        """One federated search of every site reachable now."""


class GridBackend:
    """A session's sites over a Flower grid: the nodes connected to the SuperLink at each query."""

    def __init__(self, grid: Grid, *, node_auth: bool) -> None:
        self.grid, self.node_auth = grid, node_auth

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"nodes": sorted(int(n) for n in self.grid.get_node_ids()), "node_auth": self.node_auth}
        if self.node_auth:
            doc["sites"] = {str(n): s for n, s in sorted(registered_sites(self.grid).items())}
        return doc

    def search(self, feature: Any, k: int, filters: SearchFilters, timeout: float, *,
               fingerprint: Optional[Mapping[str, Any]], thumbnails: bool,
               expected_sites: Sequence[str]) -> FederatedResult:
        nodes = sorted(int(n) for n in self.grid.get_node_ids())  # now: a site that left and came back is searched
        bound = registered_sites(self.grid) if self.node_auth else None
        return federated_search(self.grid, nodes, feature, k, filters, timeout, fingerprint=fingerprint,
                                thumbnails=thumbnails, expected_sites=expected_sites, poll_seconds=POLL_SECONDS,
                                bound_sites=bound)


def _search_request(backend: SearchBackend, request: Mapping[str, Any], settings: SessionSettings) -> dict[str, Any]:
    """One ``search`` request: checked as ``mode=search`` checks its run config, then the backend's search."""
    unknown = sorted(set(request) - {"op", "vector", "k", "fingerprint", "filters", "thumbnails", "timeout",
                                     "expect"})
    if unknown:
        raise SessionError(f"search: unknown key(s) {', '.join(map(str, unknown))}")
    feature = decode_vector(request.get("vector", ""))
    k = request.get("k", 10)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise SessionError(f"search: k: expected an integer in 1..{MAX_K}, got {k!r:.40}")
    timeout = request.get("timeout", settings.timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not (math.isfinite(timeout) and 0 < timeout <= MAX_QUERY_TIMEOUT):
        raise SessionError(f"search: timeout: expected seconds in (0, {MAX_QUERY_TIMEOUT:g}], got {timeout!r:.40}")
    expect = request.get("expect", list(settings.expect))
    if not isinstance(expect, list) or not all(isinstance(s, str) and s for s in expect):
        raise SessionError("search: expect: expected a list of site names")
    thumbnails = request.get("thumbnails", False)
    if not isinstance(thumbnails, bool):
        raise SessionError("search: thumbnails: expected true or false")
    fingerprint = request.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, dict):
        raise SessionError("search: fingerprint: expected a JSON object")
    filters = SearchFilters.from_plain(request.get("filters"))
    result = backend.search(feature, k, filters, float(timeout), fingerprint=fingerprint, thumbnails=thumbnails,
                            expected_sites=expect)
    return result.to_plain()


def serve_session(grid: Grid, run_config: Mapping[str, Any]) -> int:
    """The ServerApp's ``mode=search-session``: :func:`serve_requests` over the run's grid."""
    settings = SessionSettings.from_run_config(run_config)
    return serve_requests(GridBackend(grid, node_auth=settings.node_auth), settings)


def serve_requests(backend: SearchBackend, settings: SessionSettings) -> int:
    """Answer requests on the session socket until closed; returns the queries served.

    Contract: see the module docstring. Requests are served one at a time
    (a SuperNode handles one message at a time anyway); a malformed or
    refused request gets ``{"ok": false, "error": ...}`` and the session goes
    on. The socket file is removed when the session ends, however it ends.
    """
    server = _listen(settings.socket)
    identity = os.stat(settings.socket).st_ino
    queries = 0
    log.info("search session open on %s (site names %s; per-query timeout %g s%s)", settings.socket,
             "bound to identities" if settings.node_auth else "as the sites declare them", settings.timeout,
             f"; ends after {settings.idle_timeout:g} s without a request" if settings.idle_timeout else "")
    last = time.monotonic()
    try:
        while True:
            if settings.idle_timeout and time.monotonic() - last > settings.idle_timeout:
                log.info("search session: no request for %g s, closing", settings.idle_timeout)
                break
            ready, _, _ = select.select([server], [], [], 0.5)
            if not ready:
                continue
            conn, _ = server.accept()
            last = time.monotonic()
            stop = False
            with conn:
                conn.settimeout(30.0)  # a client that connects and says nothing does not hold the session
                try:
                    raw = _read_line(conn)
                    try:
                        request = json.loads(raw)
                    except ValueError as exc:
                        raise SessionError(f"the request is not JSON ({exc})") from None
                    if not isinstance(request, dict):
                        raise SessionError("the request must be a JSON object with 'op'")
                    op = request.get("op")
                    if op == "search":
                        started = time.monotonic()
                        plain = _search_request(backend, request, settings)
                        queries += 1
                        lines = format_result(plain)
                        log.info("session query %d: %s (%.3f s)", queries, lines[0], time.monotonic() - started)
                        for line in lines:
                            if line.startswith("missing: "):
                                log.info("session query %d: %s", queries, line)
                        _send(conn, {"ok": True, "result": plain})
                    elif op == "status":
                        _send(conn, {"ok": True, "queries": queries, **backend.status()})
                    elif op == "close":
                        _send(conn, {"ok": True, "queries": queries})
                        stop = True
                    else:
                        raise SessionError(f"unknown op {op!r:.40}; expected search, status or close")
                except (SessionError, ConfigError, SearchCodecError) as exc:
                    _send(conn, {"ok": False, "error": str(exc)})
                except OSError as exc:  # the client's connection failed (socket.timeout included)
                    log.warning("search session: a request was lost (%s)", exc)
                except Exception as exc:  # noqa: BLE001 -- one failed query (e.g. the SuperLink's API) ends no session
                    log.exception("search session: a request failed")
                    _send(conn, {"ok": False, "error": f"the search failed: {type(exc).__name__}: {exc}"})
            if stop:
                log.info("search session closed after %d queries", queries)
                break
    finally:
        server.close()
        try:  # ours only: a later session may have replaced a file we think is ours
            if os.stat(settings.socket).st_ino == identity:
                settings.socket.unlink()
        except OSError:
            pass
    return queries


# =========================================================================== the client side


class SessionClient:
    """Queries for a session listening at ``path`` (this host), each request waiting up to ``timeout`` seconds."""

    def __init__(self, path: str | Path, *, timeout: float = 120.0) -> None:
        self.path = Path(path)
        self.timeout = float(timeout)
        _check_socket_path(self.path)

    def request(self, doc: Mapping[str, Any], *, timeout: Optional[float] = None) -> dict[str, Any]:
        """Send one request, return its reply; :class:`SessionError` when refused or unreachable."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.timeout if timeout is None else timeout)
            try:
                conn.connect(str(self.path))
                conn.sendall(json.dumps(doc, allow_nan=False).encode() + b"\n")
                raw = _read_line(conn, limit=1 << 30)
            except FileNotFoundError:
                raise SessionError(f"no search session at {self.path} (start one with `tools/flower_fed.py "
                                   "session`)") from None
            except ConnectionRefusedError:
                raise SessionError(f"no search session listens at {self.path} (it has ended)") from None
            except socket.timeout:
                raise SessionError(f"the search session at {self.path} did not answer within "
                                   f"{conn.gettimeout():g} s") from None
            except OSError as exc:  # e.g. another user's socket: no permission
                raise SessionError(f"the search session at {self.path} cannot be reached: {exc}") from None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise SessionError(f"the search session at {self.path} answered something that is not JSON "
                               "(did it end mid-request?)") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise SessionError(f"the search session refused the request: "
                               f"{reply.get('error') if isinstance(reply, dict) else reply!r:.200}")
        return reply

    def search(self, feature: Any, k: int = 10, *, fingerprint: Optional[Mapping[str, Any]],
               filters: Optional[Mapping[str, Any]] = None, thumbnails: bool = False,
               timeout: Optional[float] = None, expect: Optional[Sequence[str]] = None) -> dict[str, Any]:
        """One federated search in the session: the result document (:meth:`FederatedResult.to_plain`)."""
        doc: dict[str, Any] = {"op": "search", "vector": encode_vector(feature), "k": int(k),
                               "fingerprint": None if fingerprint is None else dict(fingerprint),
                               "filters": dict(filters or {}), "thumbnails": bool(thumbnails)}
        if timeout is not None:
            doc["timeout"] = float(timeout)
        if expect is not None:
            doc["expect"] = list(expect)
        wait = self.timeout + (float(timeout) if timeout is not None else 0.0)
        return self.request(doc, timeout=wait)["result"]

    def status(self) -> dict[str, Any]:
        """The nodes connected now, the queries served, whether names are authenticated."""
        return self.request({"op": "status"})

    def close_session(self) -> int:
        """End the session (its run ends too); returns the queries it served."""
        return int(self.request({"op": "close"}).get("queries", 0))

    def wait_ready(self, wait: float, *, alive: Any = None, poll_seconds: float = 0.2) -> dict[str, Any]:
        """The session's status once it answers, waiting up to ``wait`` seconds.

        ``alive``: a callable returning False once the process starting the
        session has ended (then waiting is pointless: :class:`SessionError`).
        """
        deadline = time.monotonic() + float(wait)
        while True:
            try:
                return self.request({"op": "status"}, timeout=max(min(5.0, deadline - time.monotonic()), 0.5))
            except SessionError as exc:
                if alive is not None and not alive():
                    raise SessionError(f"the search session's run ended before it opened {self.path}") from None
                if time.monotonic() >= deadline:
                    raise SessionError(f"no search session answered at {self.path} within {wait:g} s "
                                       f"({exc})") from None
            time.sleep(poll_seconds)
