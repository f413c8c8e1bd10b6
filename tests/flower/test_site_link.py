"""Direct site links (fedreid.flower.site_link): search sessions whose queries reach the sites over HTTPS.

Real TLS servers on 127.0.0.1 in threads, real gallery stores: the merged
answer equals the stores' own exact search, answers are bound to the links
file's site names, a site that restarts is searched again in the same
transport, and every refusal is a missing site with the reason.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from search_world import FP, SITES, exact_answer, exact_merge, make_store, triples, unit_rows

from fedreid.config import ConfigError
from fedreid.flower.search_codec import SearchFilters, SearchQuery, encode_query
from fedreid.flower.search_session import SessionClient, SessionSettings, serve_requests
from fedreid.flower.security import make_tls_files
from fedreid.flower.site_link import (
    CONTENT_TYPE,
    LINK_PATH,
    MAX_QUERY_BYTES,
    LinkTransport,
    SiteLink,
    SiteLinkServer,
    encode_record,
    make_link_token,
    read_links,
    read_token,
)
from fedreid.retrieval.store import GalleryStore


def exact(stores: dict, q: np.ndarray, k: int, **filters) -> list[tuple]:
    """(site, id, score) of the best k over the stores' own searches: score desc, then site, then id."""
    return exact_merge([exact_answer(store, site, q, k, **filters) for site, store in stores.items()], k)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three stores, a CA with a certificate for 127.0.0.1, and a token per site."""
    root = tmp_path_factory.mktemp("links")
    stores = {s: make_store(root / s, n, seed, site=s) for s, n, seed in (("sa", 12, 1), ("sb", 7, 2), ("sc", 20, 3))}
    tls = make_tls_files(root / "tls", hosts=("127.0.0.1",))
    tokens = {s: make_link_token(root / "tokens" / s) for s in SITES}
    return {"root": root, "stores": stores, "tls": tls, "tokens": tokens}


class Site:
    """A site link serving in a thread; ``stop()`` ends it, ``start()`` (again) serves on the same port."""

    def __init__(self, world: dict, site: str, *, serve_as: str = "", port: int = 0) -> None:
        self.world, self.site, self.serve_as, self.port = world, site, serve_as or site, port
        self.server = None

    def start(self) -> "Site":
        self.server = SiteLinkServer(site=self.serve_as, store_folder=self.world["stores"][self.site].folder,
                                     token=read_token(self.world["tokens"][self.site]),
                                     cert=self.world["tls"]["cert"], key=self.world["tls"]["key"], port=self.port)
        self.port = self.server.port
        # Opened here, one store at a time, as the command does: CPython 3.11's ast.literal_eval (numpy's .npy
        # header reader) can fail with a SystemError when threads of one process run it at once.
        self.server.check_store()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()

    def link(self, token: str | None = None, name: str | None = None) -> SiteLink:
        return SiteLink(name or self.site, "127.0.0.1", self.port, self.world["tls"]["ca"],
                        token or read_token(self.world["tokens"][self.site]))


@pytest.fixture
def sites(world):
    running = {s: Site(world, s).start() for s in SITES}
    yield running
    for site in running.values():
        if site.server is not None:
            site.stop()


def test_a_query_over_links_is_the_stores_exact_merge_bound_to_the_links_names(world, sites):
    q = unit_rows(1, 99)[0]
    with LinkTransport([sites[s].link() for s in SITES]) as links:
        for k, filters in ((8, {}), (5, {"cameras": [0, 2]}), (30, {"time_window": (1003.0, 1010.0)})):
            result = links.search(q, k, filters, 10.0, fingerprint=FP, expected_sites=SITES)
            assert triples(result.results) == exact(world["stores"], q, k, **filters)
            assert result.missing == [] and result.authenticated
            assert [(a.site, a.node_id, a.verified) for a in result.answered] == [
                ("sa", 1, True), ("sb", 2, True), ("sc", 3, True)]
        # Another model's feature is refused by every site, in words, with no site's path in them.
        other = links.search(q, 5, None, 10.0, fingerprint=dict(FP, weights_sha256="ef" * 32))
        assert other.results == [] and {m.code for m in other.missing} == {"refused"}
        assert all("fingerprint mismatch" in m.reason and str(world["root"]) not in m.reason for m in other.missing)


def test_an_answer_counts_only_under_the_site_its_link_names(world, sites):
    """A site whose process answers as another site (or a links file pointing at the wrong site) is wrong-site."""
    impostor = Site(world, "sc", serve_as="sa").start()  # sc's store, claiming to be sa
    try:
        q = unit_rows(1, 5)[0]
        links = [sites["sa"].link(), sites["sb"].link(), impostor.link(name="sc")]
        with LinkTransport(links) as transport:
            result = transport.search(q, 10, None, 10.0, fingerprint=FP, expected_sites=SITES)
        assert triples(result.results) == exact({s: world["stores"][s] for s in ("sa", "sb")}, q, 10)
        wrong = [m for m in result.missing if m.node_id == 3]
        assert wrong and wrong[0].code == "wrong-site" and wrong[0].site == "sc"
        assert [m.code for m in result.missing if m.node_id is None] == ["not-answered"]
    finally:
        impostor.stop()


def test_a_wrong_token_a_wrong_ca_and_a_stopped_site_are_missing_with_the_reason(world, sites, tmp_path):
    other_ca = make_tls_files(tmp_path / "other_tls", hosts=("127.0.0.1",))["ca"]
    q = unit_rows(1, 7)[0]
    links = [sites["sa"].link(token="x" * 43),
             SiteLink("sb", "127.0.0.1", sites["sb"].port, other_ca, read_token(world["tokens"]["sb"])),
             sites["sc"].link()]
    with LinkTransport(links) as transport:
        result = transport.search(q, 6, None, 10.0, fingerprint=FP)
        assert triples(result.results) == exact({"sc": world["stores"]["sc"]}, q, 6)
        why = {m.site: m for m in result.missing}
        assert why["sa"].code == "node-error" and "HTTP 401" in why["sa"].reason and "token" in why["sa"].reason
        assert why["sb"].code == "unavailable" and "certificate" in why["sb"].reason
        # sc's link stops: the next query lists it, and goes on with what answers.
        sites["sc"].stop()
        gone = transport.search(q, 6, None, 10.0, fingerprint=FP)
        assert gone.results == [] and {m.site: m.code for m in gone.missing}["sc"] == "unavailable"


def test_a_site_that_restarts_is_searched_again_without_a_new_transport(world, sites):
    q = unit_rows(1, 11)[0]
    everyone = exact(world["stores"], q, 9)
    with LinkTransport([sites[s].link() for s in SITES]) as transport:
        assert triples(transport.search(q, 9, None, 10.0, fingerprint=FP).results) == everyone
        sites["sb"].stop()  # its kept-alive connection dies with it
        without = transport.search(q, 9, None, 10.0, fingerprint=FP, expected_sites=SITES)
        assert [(m.site, m.code) for m in without.missing][:1] == [("sb", "unavailable")]
        assert triples(without.results) == exact({s: world["stores"][s] for s in ("sa", "sc")}, q, 9)
        sites["sb"].start()  # the same port, a new process' worth of server
        assert triples(transport.search(q, 9, None, 10.0, fingerprint=FP).results) == everyone


def test_a_site_link_sees_the_store_another_process_saved(world, tmp_path):
    store = make_store(tmp_path / "grow", 5, 21, site="sa")
    site = Site(dict(world, stores={"sa": store}), "sa").start()
    try:
        q = unit_rows(1, 77)[0]
        with LinkTransport([site.link()]) as transport:
            first = transport.search(q, 10, None, 10.0, fingerprint=FP)
            assert len(first.results) == 5
            store.add(q[None], [{"path": str(tmp_path / "new.jpg"), "camera": 7}])  # as `index --add` would
            second = transport.search(q, 10, None, 10.0, fingerprint=FP)
        assert len(second.results) == 6 and second.results[0].camera == 7 and second.results[0].score > 0.999
    finally:
        site.stop()


def raw_post(port: int, ca: Path, body: bytes, headers: dict, path: str = LINK_PATH) -> tuple[int, str]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=str(ca)),
                                       timeout=10)
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


def test_the_site_refuses_what_is_not_a_query_from_its_server_in_one_line(world, sites):
    port, ca = sites["sa"].port, world["tls"]["ca"]
    token = read_token(world["tokens"]["sa"])
    good = {"Authorization": f"Bearer {token}", "Content-Type": CONTENT_TYPE}
    q = SearchQuery(unit_rows(1, 3)[0], 4, SearchFilters(), FP)
    body = encode_record(encode_query(q))
    assert raw_post(port, ca, body, {**good, "Authorization": "Bearer " + "y" * 43})[0] == 401
    assert raw_post(port, ca, body, {"Content-Type": CONTENT_TYPE})[0] == 401
    assert raw_post(port, ca, body, {**good, "Content-Type": "application/json"})[0] == 415
    assert raw_post(port, ca, body, good, path="/v1/other")[0] == 404
    assert raw_post(port, ca, body, {**good, "Content-Length": "\u00b2"})[0] == 411  # a digit to isdigit, not to int
    status, text = raw_post(port, ca, b"\xff" * 64, good)
    assert status == 400 and "not a serialised Flower record" in text
    status, text = raw_post(port, ca, b"0" * (MAX_QUERY_BYTES + 1), good)
    assert status == 413 and text.count("\n") == 1
    status, _ = raw_post(port, ca, body, good)
    assert status == 200


def test_a_session_over_links_answers_query_after_query(world, sites):
    folder = Path(tempfile.mkdtemp(prefix="fr-l-", dir="/tmp"))
    sock = folder / "s.sock"
    transport = LinkTransport([sites[s].link() for s in SITES])
    settings = SessionSettings(socket=sock, timeout=10.0, expect=SITES, node_auth=True)
    thread = threading.Thread(target=serve_requests, args=(transport, settings), daemon=True)
    thread.start()
    try:
        client = SessionClient(sock, timeout=30)
        status = client.wait_ready(30)
        assert status["sites"] == {"1": "sa", "2": "sb", "3": "sc"} and status["node_auth"]
        q = unit_rows(1, 42)[0]
        for k in (3, 10):
            result = client.search(q, k, fingerprint=FP)
            assert triples(result["results"]) == exact(world["stores"], q, k) and result["authenticated"]
        assert client.close_session() == 2
        thread.join(30)
    finally:
        if thread.is_alive():
            SessionClient(sock).close_session()
        transport.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert not thread.is_alive()


def write_links(tmp_path: Path, world: dict, text: str, name: str = "links.yaml") -> Path:
    path = tmp_path / name
    shutil.copy(world["tls"]["ca"], tmp_path / "ca.crt")
    path.write_text(text)
    return path


def test_the_links_file_is_checked_at_the_door(world, tmp_path):
    token = tmp_path / "sa.token"
    shutil.copy(world["tokens"]["sa"], token)
    os.chmod(token, 0o600)
    good = write_links(tmp_path, world, "ca: ca.crt\nlinks:\n  - {site: sa, address: '127.0.0.1:9601', "
                                        "token: sa.token}\n")
    (link,) = read_links(good)
    assert (link.site, link.host, link.port, link.ca) == ("sa", "127.0.0.1", 9601, tmp_path / "ca.crt")
    assert link.token == read_token(world["tokens"]["sa"]) and link.token not in repr(link)
    cases = [
        ("links: []\n", "expected a mapping with 'links'"),
        ("links:\n  - {site: sa, address: '127.0.0.1', token: sa.token, ca: ca.crt}\n", "links[0].address"),
        ("links:\n  - {site: sa, address: '127.0.0.1:70000', token: sa.token, ca: ca.crt}\n", "port in 1..65535"),
        ("links:\n  - {site: sa, address: '127.0.0.1:9601', token: sa.token}\n", "no CA"),
        ("ca: ca.crt\nlinks:\n  - {site: sa, address: '127.0.0.1:9601', token: nothere}\n", "links[0].token: no file"),
        ("ca: ca.crt\nlinks:\n  - {site: \"a\\nb\", address: '127.0.0.1:9601', token: sa.token}\n", "links[0].site"),
        ("ca: ca.crt\nlinks:\n  - {site: sa, address: 'h:1', token: sa.token}\n"
         "  - {site: sa, address: 'h:2', token: sa.token}\n", "listed twice"),
        ("ca: ca.crt\nlinks:\n  - {site: sa, address: 'h:1', token: sa.token, port: 3}\n", "expected site, address"),
        ("ca: [\n", "not YAML"),
    ]
    for text, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            read_links(write_links(tmp_path, world, text, "bad.yaml"))
        assert "\n" not in str(err.value)
    os.chmod(token, 0o644)
    with pytest.raises(ConfigError, match="others have access to it"):
        read_links(good)
    token.write_text("short\n")
    os.chmod(token, 0o600)
    with pytest.raises(ConfigError, match="URL-safe"):
        read_links(good)
    with pytest.raises(FileExistsError):
        make_link_token(token)  # never overwritten
    assert token.read_text() == "short\n"


# ----------------------------------------------------------------------------- the commands

TOOL = Path(__file__).resolve().parents[2] / "tools" / "flower_fed.py"


def tool(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TOOL), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_listening(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    raise AssertionError("the site link did not listen")


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    return out


def test_the_commands_site_link_session_links_and_search_session(world, tmp_path):
    """Two `site-link` processes, `session --links`, `search --session`; one site stops and comes back."""
    tls = world["tls"]["ca"].parent
    folder = Path(tempfile.mkdtemp(prefix="fr-c-", dir="/tmp"))
    ports = {s: free_port() for s in ("sa", "sb")}
    links = tmp_path / "links.yaml"
    links.write_text(f"ca: {tls / 'ca.crt'}\nlinks:\n" + "".join(
        f"  - {{site: {s}, address: '127.0.0.1:{ports[s]}', token: {world['tokens'][s]}}}\n" for s in ports))

    def site(s: str) -> subprocess.Popen:
        proc = start("site-link", "--site", s, "--gallery-store", world["stores"][s].folder, "--tls", tls,
                     "--token", world["tokens"][s], "--listen", f"127.0.0.1:{ports[s]}")
        wait_listening(proc, ports[s])
        return proc

    q = unit_rows(1, 123)[0]
    np.save(tmp_path / "q.npy", q)
    (tmp_path / "fp.json").write_text(json.dumps(FP))
    query = ("search", "--session", folder / "s.sock", "--feature", tmp_path / "q.npy", "--fingerprint",
             tmp_path / "fp.json", "--k", 6, "--timeout", 20)
    sites = {s: site(s) for s in ports}
    session = start("session", "--links", links, "--socket", folder / "s.sock", "--expect", "sa", "--expect", "sb")
    try:
        SessionClient(folder / "s.sock").wait_ready(120, alive=lambda: session.poll() is None)
        done = tool(*query, "--out", tmp_path / "r.json")
        assert done.returncode == 0, done.stderr
        result = json.loads((tmp_path / "r.json").read_text())
        assert triples(result["results"]) == exact({s: world["stores"][s] for s in ports}, q, 6)
        assert result["authenticated"] and result["missing"] == []
        assert "federated search: 6 results (k=6) from 2 sites (sa, sb)" in done.stdout
        stop(sites["sb"])
        done = tool(*query)
        assert done.returncode == 0 and "missing: sb (node 2): unavailable" in done.stdout
        assert "connection refused (is its site-link running?)" in done.stdout
        sites["sb"] = site("sb")
        done = tool(*query)
        assert done.returncode == 0 and "from 2 sites (sa, sb); 0 missing" in done.stdout
    finally:
        out = stop(session)
        for proc in sites.values():
            stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
    assert "search session closed" in out and "stopped by SIGTERM" in out
    assert not (folder / "s.sock").exists()


@pytest.mark.parametrize("args, message", [
    (("session", "--socket", "/tmp/x.sock"), "give --superlink HOST:PORT"),
    (("session", "--socket", "/tmp/x.sock", "--links", "l.yaml", "--superlink", "h:1"), "one of the two"),
    (("session", "--socket", "/tmp/x.sock", "--links", "l.yaml", "--insecure"), "leave out"),
    (("site-link", "--site", "sa", "--gallery-store", "nothere", "--tls", "{tls}", "--token", "{token}"),
     "no such folder"),
    (("site-link", "--site", "sa", "--gallery-store", "{store}", "--tls", "{tls}", "--token", "{token}",
      "--listen", "127.0.0.1"), "--listen: expected HOST:PORT"),
    (("site-link", "--site", "sa", "--gallery-store", "{store}", "--tls", "{tls}", "--token", "{token}",
      "--listen", "127.0.0.1:80\u00b2"), "--listen: expected HOST:PORT with a port"),
    (("site-link", "--site", "sa", "--gallery-store", "{store}", "--tls", "nothere", "--token", "{token}"),
     "missing"),
])
def test_command_refusals_are_one_line(world, args, message):
    fill = {"{tls}": world["tls"]["ca"].parent, "{token}": world["tokens"]["sa"],
            "{store}": world["stores"]["sa"].folder}
    done = tool(*[fill.get(a, a) for a in args])
    assert done.returncode != 0 and message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_read_that_overlaps_another_process_save_is_repeated_on_the_new_save(tmp_path):
    from fedreid.flower.site_link import LinkStore

    store = make_store(tmp_path / "s", 4, 8, site="sa")
    keeper = LinkStore(store.folder)
    seen = []

    def count(opened: GalleryStore) -> int:
        seen.append(opened.ntotal)
        if len(seen) == 1:  # another process saves the store while this read runs
            GalleryStore.open(store.folder).add(unit_rows(2, 9), [{"path": "/x/a.jpg"}, {"path": "/x/b.jpg"}])
        return opened.ntotal

    assert keeper.read(count) == 6 and seen == [4, 6]  # the answer comes from one save: the new one
    assert keeper.read(lambda opened: opened.ntotal) == 6
