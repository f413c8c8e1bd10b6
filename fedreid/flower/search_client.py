"""The operator's side of federated search: check a query, run it (one Flower run or a session).

:mod:`fedreid.flower.search` is what runs inside Flower (the ServerApp's
search, each site's answer); this module is what the ``flower search`` and
``flower session`` commands do on the SuperLink's host. Every input is
checked here, in words, before a process starts; texts that came from a
site or from Flower's log reach the caller's ``report`` only through
:func:`~fedreid.utils.text.printable` (no terminal control, one line each).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from fedreid.options import ConfigError

Report = Callable[[str], None]


@dataclass(frozen=True)
class SearchRequest:
    """One checked query: the feature, its model's fingerprint, k, the filters and the site-side settings.

    Contract: a request exists only if the ServerApp (or a session) would
    send it: its query passes :func:`fedreid.flower.search.make_query`, the
    check ``mode=search`` applies before sending (L2-normalised finite
    feature, k, filters, fingerprint), and ``timeout`` passes
    :func:`~fedreid.flower.search.check_seconds`; else a one-line ConfigError.
    """

    feature: np.ndarray
    fingerprint: dict[str, Any]
    k: int
    filters: dict[str, Any]
    timeout: float
    thumbnails: bool = False
    expect: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from fedreid.flower.search import check_seconds, make_query
        from fedreid.flower.search_codec import SearchCodecError

        check_seconds(self.timeout, "search: --timeout")
        try:
            make_query(self.feature, self.k, self.filters, fingerprint=self.fingerprint, thumbnails=self.thumbnails)
        except SearchCodecError as exc:
            raise ConfigError(f"search: the query would be refused: {exc}") from None


def check_search_options(*, k: int, timeout: float, cameras: Optional[Sequence[int]],
                         sites: Optional[Sequence[str]], since: Optional[float], until: Optional[float],
                         out: Optional[str], join_timeout: Optional[float] = None
                         ) -> tuple[dict[str, Any], Optional[Path]]:
    """The search filters and the result path, checked; a one-line ConfigError naming the option otherwise.

    ``k``, ``timeout``, ``join_timeout`` (None: not given) and the filters
    are checked by the functions the ServerApp's ``mode=search`` checks its
    run config with (:func:`~fedreid.flower.search.check_k`,
    :func:`~fedreid.flower.search.check_seconds`,
    :class:`~fedreid.flower.search_codec.SearchFilters`), so nothing it would
    refuse starts a run. An existing ``out`` is only replaced when it holds an
    earlier search result.
    """
    from fedreid.flower.search import RESULT_FORMAT, check_k, check_seconds
    from fedreid.flower.search_codec import SearchCodecError, SearchFilters

    check_k(k, "search: --k")
    check_seconds(timeout, "search: --timeout")
    if join_timeout is not None:
        check_seconds(join_timeout, "search: --join-timeout", zero=True)
    filters = {"cameras": cameras, "sites": sites,
               "time_window": None if since is None and until is None else [since, until]}
    for key, option in (("cameras", "--camera"), ("sites", "--site"), ("time_window", "--since/--until")):
        try:
            SearchFilters.from_plain({key: filters[key]})
        except SearchCodecError as exc:
            raise ConfigError(f"search: {option}: {exc}") from None
    out_path = Path(out).resolve() if out else None
    if out_path is not None and (out_path.is_dir() or out_path.is_symlink()):
        raise ConfigError(f"--out {out_path}: expected a JSON file path, it is a folder or a link")
    if out_path is not None and out_path.exists():
        try:
            earlier = json.loads(out_path.read_text()).get("format")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            earlier = None
        if earlier != RESULT_FORMAT:
            raise ConfigError(f"--out {out_path} exists and is not a federated search result; choose another file")
    return filters, out_path


def query_feature(*, image: Optional[str], feature: Optional[str], model: Optional[str],
                  fingerprint: Optional[str], device: str = "cpu") -> tuple[np.ndarray, dict[str, Any]]:
    """The query feature and its model fingerprint: computed from ``image`` by ``model``, or read from ``feature``."""
    from fedreid.flower.search import image_query, read_feature_file, read_fingerprint_file

    if image:
        if not model:
            raise ConfigError("search: --image needs --model (the sites' model: a run folder or model file)")
        if fingerprint:
            raise ConfigError("search: with --image the fingerprint is the model's; leave out --fingerprint")
        return image_query(image, model, device)
    if model:
        raise ConfigError("search: --model goes with --image; with --feature give --fingerprint")
    if not fingerprint:
        raise ConfigError("search: --feature needs --fingerprint (a JSON model fingerprint, or the header.json / "
                          "sidecar of the store or model that made the feature): the sites check it")
    try:
        vector = read_feature_file(feature)
    except ConfigError as exc:
        raise ConfigError(f"search: --feature {exc}") from None
    return vector, read_fingerprint_file(fingerprint)


def _report_log(log: Path, report: Report, limit: int) -> None:
    from fedreid.utils.text import printable

    # The log may quote what a site sent (a ClientApp's error): one escaped line per line, no terminal control.
    for line in log.read_text(errors="replace")[-limit:].splitlines() if log.exists() else []:
        report(printable(line, 2000))


def search_in_session(socket: str | Path, request: SearchRequest) -> dict[str, Any]:
    """The result document of ``request`` from the search session listening at ``socket``."""
    from fedreid.flower.search_session import SessionClient

    return SessionClient(socket).search(request.feature, request.k, fingerprint=request.fingerprint,
                                        filters=request.filters, thumbnails=request.thumbnails,
                                        timeout=request.timeout, expect=list(request.expect) or None)


def search_in_one_run(request: SearchRequest, *, superlink: str, ca: Optional[Path], node_auth: bool,
                      join_timeout: float, report: Report) -> Optional[dict[str, Any]]:
    """The result document of ``request`` from one Flower run; None (Flower's log sent to ``report``) without one.

    The ServerApp writes the result into a fresh temporary folder when it runs
    on this host (the SuperLink's), so an older file never passes for this
    search's result; on another host it writes nothing.
    """
    from fedreid.flower.launch import FlowerCli, search_run_config_string
    from fedreid.flower.search import encode_vector

    with tempfile.TemporaryDirectory(prefix="fedreid-search-") as tmp:
        result_path = Path(tmp) / "result.json"
        text = search_run_config_string(encode_vector(request.feature), k=request.k, fingerprint=request.fingerprint,
                                        filters=request.filters, timeout=request.timeout,
                                        thumbnails=request.thumbnails, expect=request.expect, out=result_path,
                                        join_timeout=join_timeout, node_auth=node_auth)
        log = Path(tmp) / "flwr_run.log"
        rc = FlowerCli(superlink, root_cert=ca, home=Path(tmp) / "flwr_home").run(
            text, log=log, timeout=join_timeout + request.timeout + 600)
        if result_path.is_file():
            return json.loads(result_path.read_text())
        _report_log(log, report, 8000)
        why = ("the search failed" if rc != 0 else
               "the SuperLink runs on another host: its ServerApp logged the result above; run `search` on "
               "the SuperLink's host for the JSON")
        report(f"search: no result file (flwr exit code {rc}): {why}")
        return None


def check_session(*, ca: Optional[Path], node_auth: bool, timeout: float, socket: str | Path,
                  idle_timeout: float = 0.0) -> Path:
    """A session's settings checked before anything starts; returns its socket path (new, on this host).

    ``timeout`` and ``idle_timeout`` pass the check the session's ServerApp
    applies to its run config (:func:`~fedreid.flower.search.check_seconds`).
    """
    from fedreid.flower.search import check_seconds
    from fedreid.flower.search_session import SessionClient

    if node_auth and ca is None:
        raise ConfigError("session: --node-auth needs --ca: Flower authenticates SuperNodes over TLS only")
    check_seconds(timeout, "session: --timeout")
    check_seconds(idle_timeout, "session: --idle-timeout", zero=True)
    sock = Path(socket).resolve()
    SessionClient(sock)  # refuses a path too long for a socket
    if not sock.parent.is_dir():
        raise ConfigError(f"session: --socket {sock}: its folder does not exist (the session runs on this host, "
                          "the SuperLink's)")
    if sock.exists() or sock.is_symlink():
        raise ConfigError(f"session: --socket {sock} exists; is another session running? (remove a stale socket "
                          "or choose another path)")
    return sock


def run_session(*, superlink: str, ca: Optional[Path], socket: Path, node_auth: bool, timeout: float,
                expect: Sequence[str], idle_timeout: float, join_timeout: float, log: Optional[str],
                on_open: Callable[[dict[str, Any]], None], report: Report) -> int:
    """Open a search session on the SuperLink and serve until it ends; the run's flwr exit code.

    The settings are those :func:`check_session` accepted.

    ``on_open(status)`` is called once the session answers. The session ends
    when closed (Ctrl-C, SIGTERM), idle for ``idle_timeout`` seconds, or
    stopped with ``flwr stop``; leaving this function in any way closes it.
    A session that never opens raises a ConfigError after its log went to
    ``report``.
    """
    from fedreid.flower.launch import FlowerCli, session_run_config_string, stop_group
    from fedreid.flower.search_session import SessionClient, SessionError

    client = SessionClient(socket)
    text = session_run_config_string(socket, timeout=timeout, expect=expect, node_auth=node_auth,
                                     idle_timeout=idle_timeout)
    with tempfile.TemporaryDirectory(prefix="fedreid-session-") as tmp:
        log_path = Path(log).resolve() if log else Path(tmp) / "flwr_run.log"
        proc = FlowerCli(superlink, root_cert=ca, home=Path(tmp) / "flwr_home").start(text, log=log_path)
        opened = False
        try:
            status = client.wait_ready(join_timeout, alive=lambda: proc.poll() is None)
            opened = True
            on_open(status)
            while proc.poll() is None:  # the session serves until closed, idle, or stopped
                time.sleep(0.5)
            return int(proc.returncode)
        except SessionError as exc:
            _report_log(log_path, report, 6000)
            raise ConfigError(f"session: {exc}") from None
        finally:
            if proc.poll() is None:
                if opened or socket.exists():
                    try:  # the run ends with its ServerApp; stopping flwr alone would leave it on the SuperLink
                        report(f"search session closed after {client.close_session()} queries")
                    except SessionError:
                        pass
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    stop_group(proc, wait=10.0)


__all__ = [
    "SearchRequest",
    "check_search_options",
    "check_session",
    "query_feature",
    "run_session",
    "search_in_one_run",
    "search_in_session",
]
