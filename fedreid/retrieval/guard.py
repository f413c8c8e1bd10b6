"""The search service's guard: authentication, Host/Origin checks, request limits, the read/write lock.

What :mod:`fedreid.retrieval.service` puts in front of its routes and around
its store (the Security and Concurrency sections of that module's docstring):

* :func:`check_serve_security`: at start-up, the token to require, or a
  refusal of an unsafe combination (no token off the loopback interface);
* :class:`_Guard`: the ASGI middleware every request passes first: the
  ``Host`` check without a token (DNS rebinding), the ``Origin`` check of
  state-changing requests, the bearer token (constant-time comparison), the
  body size limit (:data:`DEFAULT_MAX_UPLOAD_BYTES` plus :data:`FORM_OVERHEAD`),
  and the security headers of every response;
* :class:`_ReadWriteLock`: searches run concurrently, store updates alone.
"""

from __future__ import annotations

import hmac
import ipaddress
import threading
import urllib.parse
from contextlib import contextmanager
from typing import Any, Iterator, Optional

try:  # the [serve] extra (the start-up checks work without it)
    from fastapi.responses import JSONResponse
except ImportError:
    pass

from fedreid.errors import FedReIDError

__all__ = [
    "DEFAULT_MAX_UPLOAD_BYTES",
    "FORM_OVERHEAD",
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "ServiceError",
    "check_serve_security",
]

#: Largest accepted image upload; the whole request body may be :data:`FORM_OVERHEAD` bytes larger.
DEFAULT_MAX_UPLOAD_BYTES = 8 * 1024 * 1024


#: Room for the form's other fields and multipart boundaries on top of the upload limit.
FORM_OVERHEAD = 64 * 1024


#: Shortest token accepted (a guessable token is no protection).
MIN_TOKEN_LENGTH = 16


#: Environment variable read for the token when --token is not given (keeps it out of `ps`).
TOKEN_ENV = "FEDREID_SERVE_TOKEN"


class ServiceError(FedReIDError, ValueError):
    """The service cannot start as asked (no token, a public host without one, a mismatched model...)."""


def _is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_serve_security(host: str, token: Optional[str], insecure_local: bool) -> Optional[str]:
    """The token to require (None: no authentication), or :class:`ServiceError` when the combination is unsafe.

    A token is required unless ``insecure_local``; ``insecure_local`` is
    only accepted with a loopback ``host`` (127.0.0.0/8, ::1, localhost) and
    without a token. A token must have at least :data:`MIN_TOKEN_LENGTH`
    characters, no surrounding blanks and no control characters.
    """
    if insecure_local:
        if token:
            raise ServiceError("--insecure-local turns authentication off: drop it, or drop --token")
        if not _is_loopback(host):
            raise ServiceError(
                f"--insecure-local serves without authentication and is only allowed on a loopback host "
                f"(127.0.0.1, ::1 or localhost), not {host!r}; give a --token to serve on {host}"
            )
        return None
    if not token:
        raise ServiceError(
            f"no token: give --token (or set {TOKEN_ENV}, or --token-file) so that clients must send "
            "'Authorization: Bearer <token>' (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
            "or --insecure-local to serve 127.0.0.1 without authentication"
        )
    if token != token.strip() or any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise ServiceError("the token has surrounding blanks or control characters: expected printable characters")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ServiceError(
            f"the token has {len(token)} characters: expected at least {MIN_TOKEN_LENGTH} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


class _ReadWriteLock:
    """Many readers or one writer; a waiting writer holds back new readers (no writer starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _RequestError(Exception):
    """A client error answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def _is_public(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path == "/" or path.startswith("/web/"))


#: Methods that change the store: refused cross-origin whatever the authentication.
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _shown_header(value: Optional[bytes]) -> str:
    """A request header's value for an error message: one line, at most 80 characters, quoted."""
    if value is None:
        return "none"
    text = value.decode("latin-1")[:80]
    return repr("".join(c if c.isprintable() else "?" for c in text))


def _split_host(value: bytes) -> Optional[tuple[str, Optional[int]]]:
    """``Host`` header -> (lower-case host name without brackets, port or None); None when it is not ``host[:port]``."""
    try:
        text = value.decode("ascii")
        parts = urllib.parse.urlsplit("//" + text)
        if not text or parts.netloc != text or parts.username is not None or parts.password is not None \
                or parts.path or parts.query or parts.fragment or not parts.hostname:
            return None
        return parts.hostname, parts.port
    except (UnicodeDecodeError, ValueError):
        return None


def _is_loopback_host_header(value: Optional[bytes]) -> bool:
    """Whether a ``Host`` header names this machine's loopback interface (127.0.0.0/8, [::1], localhost, any port)."""
    split = _split_host(value) if value is not None else None
    if split is None:
        return False
    name = split[0]
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name == "localhost"  # a name other than localhost is what DNS rebinding points at us
    return _is_loopback(name)


def _is_same_origin(origin: bytes, host: Optional[bytes]) -> bool:
    """Whether ``Origin`` is the origin the request was sent to (its scheme's host and port = the ``Host`` header).

    Browsers omit the scheme's default port from both headers; a port given
    explicitly is compared after dropping it when it is the Origin scheme's default.
    """
    if host is None:
        return False
    try:
        parts = urllib.parse.urlsplit(origin.decode("ascii"))
        port = parts.port
    except (UnicodeDecodeError, ValueError):
        return False
    target = _split_host(host)
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or target is None or parts.path not in ("", "/"):
        return False
    default = _DEFAULT_PORTS[parts.scheme]
    return parts.hostname == target[0] and (port or default) == (target[1] or default)


class _Guard:
    """Pure ASGI middleware: host and origin checks, bearer-token check, body size limit, security headers.

    Without a token (``--insecure-local``) only requests whose ``Host`` is a
    loopback name are answered (421 otherwise): a page the operator opens
    cannot reach the service through a DNS name rebound to 127.0.0.1.
    State-changing requests (:data:`_STATE_CHANGING`) carrying an ``Origin``
    other than the service's own are refused (403), with or without a token:
    no other site's page can add or erase items through the operator's
    browser. Clients that send no ``Origin`` (curl, scripts) are not affected.
    """

    def __init__(self, app: Any, *, token: Optional[str], max_body: int) -> None:
        self.app, self.token, self.max_body = app, token, max_body
        self._token_bytes = token.encode() if token else b""

    async def _reply(self, scope: dict, receive: Any, send: Any, status: int, message: str,
                     headers: Optional[dict[str, str]] = None) -> None:
        await JSONResponse({"error": message}, status_code=status, headers=headers)(scope, receive, send)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        if self.token is None:
            return True
        value = headers.get(b"authorization", b"")
        scheme, _, given = value.partition(b" ")
        # compare_digest on bytes: the time taken does not depend on where the two differ
        ok = hmac.compare_digest(given.strip(), self._token_bytes)
        return scheme.lower() == b"bearer" and ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        public = _is_public(scope["method"], scope["path"])

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                for name, value in ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                                    (b"x-frame-options", b"DENY"),
                                    (b"cache-control", b"no-cache" if public else b"no-store, private")):
                    if name not in names:
                        headers.append((name, value))
                message = dict(message, headers=headers)
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.token is None and not _is_loopback_host_header(headers.get(b"host")):
            await self._reply(scope, receive, send_with_headers, 421,
                              f"Host {_shown_header(headers.get(b'host'))} is not a loopback name: without a token "
                              "(--insecure-local) the service answers only requests for 127.0.0.1, localhost or [::1]")
            return
        origin = headers.get(b"origin")
        if scope["method"] in _STATE_CHANGING and origin is not None and not _is_same_origin(origin, headers.get(b"host")):
            await self._reply(scope, receive, send_with_headers, 403,
                              f"cross-origin {scope['method']} refused: Origin {_shown_header(origin)} is not this "
                              f"service's origin (Host {_shown_header(headers.get(b'host'))}); changes are taken only "
                              "from the service's own page or from clients that send no Origin")
            return
        if not public and not self._authorised(headers):
            await self._reply(scope, receive, send_with_headers, 401,
                              "missing or wrong token: send the header 'Authorization: Bearer <token>'",
                              {"WWW-Authenticate": "Bearer"})
            return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await self._reply(scope, receive, send_with_headers, 400, "Content-Length is not a number")
                return
            if declared > self.max_body:
                await self._reply(scope, receive, send_with_headers, 413,
                                  f"the request body has {declared} bytes: at most {self.max_body} accepted "
                                  f"(an image of up to {self.max_body - FORM_OVERHEAD} bytes)")
                return
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _RequestError(413, f"the request body passed {self.max_body} bytes: at most "
                                             f"{self.max_body} accepted (an image of up to "
                                             f"{self.max_body - FORM_OVERHEAD} bytes)")
            return message

        await self.app(scope, counted_receive, send_with_headers)

