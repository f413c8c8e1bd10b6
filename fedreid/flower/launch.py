"""Starting Flower's processes for fedreid: SuperLink, SuperNodes, runs, and all of them on one host.

Every process gets Flower's telemetry and update check off
(``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``) and the
SuperLink runs with runtime dependency installation off (SuperNodes have
it off unless asked): the machines install ``fedreid[flower]`` themselves
and nothing is fetched at run time.

* :func:`superlink_command`, :func:`supernode_command`: the command lines
  (printed by ``tools/flower_fed.py`` so they can be run on other hosts);
* :class:`FlowerCli`: ``flwr run`` / ``flwr supernode register`` against one
  SuperLink, with its own ``FLWR_HOME`` (the user's ``~/.flwr`` is untouched);
* :class:`LocalDeployment`: SuperLink and one SuperNode per client on
  127.0.0.1, stopped by their own PIDs; or, with ``simulation``, the
  SuperLink running Flower's simulation engine (Ray), the clients' CPU and
  GPU shares set by :func:`simulation_federation_config`.

Nothing is left running when the tool that started these processes goes
away: each process starts in its own process group, which is what gets
stopped (Flower's own children included); :func:`stop_on_signals` turns
SIGTERM and SIGHUP into the same clean stop as Ctrl-C; and, for a SIGKILL
nothing can catch, every direct child is started with Linux's
``PR_SET_PDEATHSIG`` (:func:`die_with_parent`), so it gets SIGTERM when its
parent dies, and Flower's processes stop their own children on SIGTERM (they
watch their parent's PID too).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

from fedreid.errors import FedReIDError
from fedreid.flower import PROJECT_DIR


class LaunchError(FedReIDError, RuntimeError):
    """A Flower process did not start or a run did not finish."""


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived (:func:`stop_on_signals`); exits with ``128 + signal`` like a killed process.

    A ``SystemExit``, so ``except Exception`` clauses let it through while
    ``with`` blocks and ``finally`` clauses run their cleanup.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


#: Signals that mean "stop" to a tool running in a terminal or under a supervisor.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Inside the block, the first of ``signals`` raises :class:`Terminated` in the main thread.

    Python's default for SIGTERM/SIGHUP is to die on the spot, skipping every
    ``with`` block, so a :class:`LocalDeployment` would leave its SuperLink and
    SuperNodes running (they are in their own sessions, out of reach of the
    signal). Later signals are ignored while the cleanup runs. Outside the
    main thread (where Python cannot set handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:  # already stopping: let the cleanup finish
            return
        received.append(signum)
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` giving the child ``sig`` when its parent dies (Linux); None elsewhere.

    This covers a SIGKILL of the parent, which no handler sees. Linux sends
    the signal when the *thread* that started the child ends, so start
    long-lived children from a thread that outlives them (the main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl ran: no signal would ever come
            os.kill(os.getpid(), sig)

    return preexec


def popen_group(cmd: Sequence[str], *, dies_with_parent: bool = True, **kwargs) -> subprocess.Popen:
    """``Popen`` in a new session (its own process group, stoppable as a whole), dying with its parent."""
    preexec = die_with_parent() if dies_with_parent else None
    return subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=preexec, **kwargs)


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, *, wait: float = 20.0) -> None:
    """Stop ``proc``'s process group (it leads one: :func:`popen_group`): ``sig``, then SIGKILL after ``wait`` s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=wait)


@dataclass(frozen=True)
class TLSFiles:
    """``ca`` for every party; ``cert`` and ``key`` for the SuperLink (see :mod:`fedreid.flower.security`)."""

    ca: Path
    cert: Optional[Path] = None
    key: Optional[Path] = None

    @classmethod
    def from_dir(cls, folder: str | Path) -> "TLSFiles":
        folder = Path(folder)
        files = cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")
        missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"TLS folder {folder}: missing {', '.join(missing)} "
                                    "(make them with `tools/flower_fed.py certs`)")
        return files


def flower_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment for Flower processes: telemetry off, this interpreter's scripts first on PATH.

    Flower's own settings in the caller's environment pass through, e.g.
    ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (seconds between a SuperExec's
    checks for a task, 1 by default; 0.2 gave no faster search queries on a
    busy 2-CPU machine and twice the idle CPU, so the default is kept).
    """
    env = dict(os.environ)
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env


def _exe(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def superlink_command(*, port: int = 8000, host: str = "0.0.0.0", tls: Optional[TLSFiles] = None,
                      node_auth: bool = False, database: Optional[Path] = None) -> list[str]:
    """``flower-superlink`` serving Fleet, Control and Runtime APIs on ``host:port``."""
    cmd = [_exe("flower-superlink"), "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    if node_auth and tls is None:
        raise LaunchError("SuperNode authentication needs TLS: give the SuperLink its certificate files")
    if tls is None:
        cmd.append("--insecure")
    else:
        if tls.cert is None or tls.key is None:
            raise LaunchError("the SuperLink needs the server certificate and key, not only the CA")
        cmd += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
    if node_auth:
        cmd.append("--enable-supernode-auth")
    if database is not None:
        cmd += ["--database", str(database)]
    return cmd


def control_characters(text: str) -> bool:
    """Whether ``text`` holds a character a TOML string may not (control characters but tab, and DEL)."""
    return any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in text)


def node_config_string(client: str, state_dir: str | Path, **local: str) -> str:
    """``--node-config`` text: ``client``, ``state-dir`` and machine-local paths (see ``NodeSettings``).

    Flower reads each value as a TOML literal string: a quote or a control
    character (a line break in a path) is a :class:`LaunchError` naming the
    key here, not an unspecific format error of the SuperNode at its start.
    """
    items = {"client": client, "state-dir": str(state_dir), **{k.replace("_", "-"): v for k, v in local.items() if v}}
    for key, value in items.items():
        if "'" in str(value) or "\"" in str(value):
            raise LaunchError(f"node config {key}={value!r}: quotes are not allowed")
        if control_characters(str(value)):
            raise LaunchError(f"node config {key}={value!r}: control characters (line breaks...) are not allowed")
    return " ".join(f"{key}='{value}'" for key, value in items.items())


def supernode_command(superlink: str, client: str, state_dir: str | Path, *, port: int = 9094,
                      root_cert: Optional[Path] = None, private_key: Optional[Path] = None,
                      **local: str) -> list[str]:
    """``flower-supernode`` for the client ``client`` (its ClientApp runtime API on 127.0.0.1:``port``)."""
    cmd = [_exe("flower-supernode"), "--superlink", superlink, "--port", str(port),
           "--node-config", node_config_string(client, state_dir, **local)]
    cmd += ["--insecure"] if root_cert is None else ["--root-certificates", str(root_cert)]
    if private_key is not None:
        cmd += ["--auth-supernode-private-key", str(private_key)]
    return cmd


def command_line(cmd: Sequence[str]) -> str:
    """``cmd`` as one line that a POSIX shell (bash, sh, zsh) parses back into exactly ``cmd``.

    An argument with a single quote but nothing a double-quoted string would
    expand (``"``, ``$``, backquote, backslash, ``!``) is double-quoted, so a
    ``--node-config`` value reads as ``"client='market1501' state-dir='...'"``;
    any other argument is quoted as :func:`shlex.quote` does.
    """
    def word(arg: str) -> str:
        quoted = shlex.quote(arg)
        if quoted != arg and "'" in arg and not any(c in arg for c in '"$`\\!'):
            return f'"{arg}"'
        return quoted

    return " ".join(word(str(arg)) for arg in cmd)


def run_config_string(config: Path, out: Path, overrides: Sequence[str] = (), *, resume: bool = False,
                      round_timeout: Optional[float] = None, join_timeout: Optional[float] = None,
                      node_auth: bool = False) -> str:
    """``--run-config`` text for :class:`fedreid.flower.app.ServerSettings` (paths made absolute).

    Flower reads it as TOML values: the paths as literal strings, the
    overrides as one basic string of shell words (an override with spaces,
    such as ``fl.hooks=[{name: fedavgm}]``, stays one word). Raises
    :class:`LaunchError` on what cannot be passed that way: a quote or a
    backslash in an override, a single quote in a path, a line break.
    """
    for item in overrides:
        if any(c in item for c in "'\"\\") or control_characters(item):
            raise LaunchError(f"override {item!r}: quotes, backslashes and line breaks cannot be passed to flwr run")
    paths = {"config": str(Path(config).resolve()), "out": str(Path(out).resolve())}
    for key, value in paths.items():
        if "'" in value or control_characters(value):
            raise LaunchError(f"{key} path {value!r}: single quotes and line breaks cannot be passed to flwr run")
    text = " ".join(f"{k}='{v}'" for k, v in paths.items())
    text += ' overrides="' + " ".join(shlex.quote(o) for o in overrides) + '"'
    text += f" resume={'true' if resume else 'false'}"
    if round_timeout is not None:
        text += f" round-timeout={float(round_timeout)}"
    if join_timeout is not None:
        text += f" join-timeout={float(join_timeout)}"
    if node_auth:
        text += " node-auth=true"
    return text


def _json_literal(value: object) -> str:
    """JSON text that fits a single-quoted run-config value (a quote becomes the JSON escape \\u0027)."""
    import json

    text = json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))
    return text.replace("'", "\\u0027")


def search_run_config_string(vector: str, *, k: int, fingerprint: Optional[Mapping[str, object]] = None,
                             filters: Optional[Mapping[str, object]] = None, timeout: float = 30.0,
                             thumbnails: bool = False, expect: Sequence[str] = (), out: Optional[Path] = None,
                             join_timeout: float = 30.0, node_auth: bool = False) -> str:
    """``--run-config`` text of a federated search (``mode=search``, see :class:`fedreid.flower.search.SearchSettings`).

    ``vector``: :func:`fedreid.flower.search.encode_vector` of the query
    feature; ``out``: the result JSON on the SuperLink's machine (made absolute);
    ``node_auth``: the SuperLink authenticates SuperNodes, so each answer is
    bound to the site name its node's key was registered under.
    """
    for name in expect:
        if not name or any(c.isspace() or c in "'\"" for c in name):
            raise LaunchError(f"expected site {name!r}: a site name without spaces or quotes")
    parts = {"mode": "search", "search-vector": vector,
             "search-fingerprint": _json_literal(dict(fingerprint)) if fingerprint else "",
             "search-filters": _json_literal(dict(filters or {})), "search-expect": " ".join(expect),
             "out": str(Path(out).resolve()) if out is not None else ""}
    for key, value in parts.items():
        if "'" in value:
            raise LaunchError(f"run config {key}={value!r}: single quotes cannot be passed to flwr run")
    text = " ".join(f"{k}='{v}'" for k, v in parts.items())
    return (text + f" search-k={int(k)} search-timeout={float(timeout)} join-timeout={float(join_timeout)}"
            f" search-thumbnails={'true' if thumbnails else 'false'} node-auth={'true' if node_auth else 'false'}")


def session_run_config_string(socket: Path, *, timeout: float = 30.0, expect: Sequence[str] = (),
                              node_auth: bool = False, idle_timeout: float = 0.0) -> str:
    """``--run-config`` text of a search session (``mode=search-session``, see
    :class:`fedreid.flower.search_session.SessionSettings`).

    ``socket``: the session's Unix socket on the SuperLink's machine (made
    absolute); ``timeout``: seconds the sites have per query unless a query
    says otherwise; ``idle_timeout``: seconds without a query before the
    session ends (0: never).
    """
    for name in expect:
        if not name or any(c.isspace() or c in "'\"" for c in name):
            raise LaunchError(f"expected site {name!r}: a site name without spaces or quotes")
    path = str(Path(socket).resolve())
    if "'" in path:
        raise LaunchError(f"session socket {path!r}: single quotes cannot be passed to flwr run")
    return (f"mode='search-session' session-socket='{path}' search-expect='{' '.join(expect)}'"
            f" search-timeout={float(timeout)} session-idle-timeout={float(idle_timeout)}"
            f" node-auth={'true' if node_auth else 'false'}")


def simulation_federation_config(num_supernodes: int, *, client_cpus: Optional[int] = None,
                                 client_gpus: Optional[float] = None) -> dict[str, int | float]:
    """The simulation engine's settings for ``flwr run --federation-config`` (Flower's ``SimulationConfig``).

    ``num_supernodes`` virtual SuperNodes (one per client); ``client_cpus`` /
    ``client_gpus``: the resources Ray reserves for each ClientApp
    (``backend_config["client_resources"]`` ``num_cpus`` / ``num_gpus``;
    a fraction such as 0.25 puts four clients on one GPU at once). Unset,
    Flower's defaults apply (2 CPUs, no GPU). Raises :class:`LaunchError`
    on a value Flower would refuse (CPUs: a whole number >= 1; GPUs >= 0).
    """
    out: dict[str, int | float] = {"num-supernodes": int(num_supernodes)}
    if client_cpus is not None:
        if isinstance(client_cpus, bool) or int(client_cpus) != client_cpus or client_cpus < 1:
            raise LaunchError(f"--client-cpus {client_cpus}: Flower reserves a whole number of CPUs >= 1 per client")
        out["client-resources-num-cpus"] = int(client_cpus)
    if client_gpus is not None:
        if not client_gpus >= 0:  # NaN too
            raise LaunchError(f"--client-gpus {client_gpus}: expected a share of a GPU >= 0 (e.g. 0.25)")
        out["client-resources-num-gpus"] = float(client_gpus)
    return out


def toml_string(value: str) -> str:
    """``value`` as a TOML basic string: a path holding ``"`` or ``\\`` reads back as itself, not as TOML syntax.

    JSON's string escapes are TOML's (``\\"``, ``\\\\``, ``\\uXXXX`` for control
    characters); DEL, which JSON leaves as is, TOML wants escaped too.
    """
    import json

    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


class FlowerCli:
    """The ``flwr`` command against one SuperLink, with a private FLWR_HOME holding its connection.

    ``home``: the FLWR_HOME folder, made and given its ``config.toml`` here
    (a deployment keeps it in its work folder). Without one, every ``flwr``
    call gets a fresh temporary folder, removed when the call ends, so
    nothing is left behind; :meth:`start`, whose ``flwr`` outlives the call,
    then needs ``home``. The user's ``~/.flwr`` is never used.
    ``federation_config``: settings of a SuperLink in simulation mode
    (:func:`simulation_federation_config`), sent with every ``flwr run``.
    """

    def __init__(self, superlink: str, *, root_cert: Optional[Path] = None, home: Optional[Path] = None,
                 federation_config: Optional[Mapping[str, int | float]] = None) -> None:
        self.superlink = superlink
        self.root_cert = Path(root_cert).resolve() if root_cert is not None else None
        self.federation_config = dict(federation_config or {})
        self.home = Path(home) if home is not None else None
        if self.home is not None:
            self._write_home(self.home)

    def _write_home(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", 'default = "fedreid"', "", "[superlink.fedreid]",
                 f"address = {toml_string(self.superlink)}"]
        lines.append("insecure = true" if self.root_cert is None else
                     f"root-certificates = {toml_string(str(self.root_cert))}")
        (home / "config.toml").write_text("\n".join(lines) + "\n")

    @contextmanager
    def _flwr_home(self) -> Iterator[Path]:
        """``home``, or a temporary FLWR_HOME removed when the block ends."""
        if self.home is not None:
            yield self.home
            return
        with tempfile.TemporaryDirectory(prefix="fedreid-flwr-") as tmp:
            self._write_home(Path(tmp))
            yield Path(tmp)

    def _run(self, args: Sequence[str], *, timeout: Optional[float], log: Optional[Path] = None,
             capture: bool = False, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """``flwr ARGS`` in its own process group, stopped with it if this process stops waiting (timeout, signal).

        Its output (stdout and stderr together) is appended to ``log``, or
        returned with ``capture``, or else goes to this process's stdout.
        """
        cmd = [_exe("flwr"), *args]
        with self._flwr_home() as home:
            env = flower_env({"FLWR_HOME": str(home)})
            if capture:
                out = subprocess.PIPE
            elif log is not None:
                out = open(log, "ab")
            else:
                sys.stdout.flush()  # what this process printed comes before flwr's lines
                out = None
            try:
                proc = popen_group(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=cwd)
                try:
                    stdout, _ = proc.communicate(timeout=timeout)
                except BaseException:  # TimeoutExpired, Ctrl-C, Terminated: flwr goes too
                    stop_group(proc, wait=10.0)
                    raise
                return subprocess.CompletedProcess(cmd, proc.returncode, stdout)
            finally:
                if out not in (None, subprocess.PIPE):
                    out.close()

    def register(self, public_key: Path, *, name: Optional[str] = None, timeout: float = 60) -> None:
        """Allow the SuperNode holding the private half of ``public_key`` (``--enable-supernode-auth``).

        ``name``: the site this key belongs to (Flower's node name); a federated
        search under node authentication takes a node's site from it
        (:func:`fedreid.flower.search.registered_sites`).
        """
        args = ["supernode", "register", str(public_key), "fedreid"]
        if name is not None:
            from fedreid.retrieval.fields import GalleryMetadataError, site

            try:
                name = site(name, "site name")
            except GalleryMetadataError as exc:
                raise LaunchError(str(exc)) from None
            args += ["--name", name]
        done = self._run(args, timeout=timeout, capture=True)
        if done.returncode != 0:
            raise LaunchError(f"flwr supernode register {public_key} failed: {done.stdout.decode(errors='replace')}")

    def run_args(self, run_config: str) -> list[str]:
        """The arguments of :meth:`run`'s ``flwr`` command."""
        args = ["run", str(PROJECT_DIR), "fedreid", "--run-config", run_config, "--stream"]
        if self.federation_config:
            args += ["--federation-config", " ".join(f"{k}={v}" for k, v in self.federation_config.items())]
        return args

    def run(self, run_config: str, *, log: Optional[Path] = None, timeout: Optional[float] = None,
            cwd: Optional[Path] = None) -> int:
        """``flwr run`` the fedreid app and stream its logs until it ends; returns flwr's exit code.

        The logs (the ServerApp's round lines and errors, Flower's own) are
        appended to ``log``, or else printed on this process's stdout. flwr's
        exit code says whether the run was submitted and followed, not how
        the ServerApp ended (a failed ServerApp still gives 0).
        """
        return self._run(self.run_args(run_config), timeout=timeout, log=log, cwd=cwd).returncode

    def start(self, run_config: str, *, log: Path) -> subprocess.Popen:
        """:meth:`run` without waiting: ``flwr run --stream`` in its own process group, its output in ``log``.

        Needs ``home`` (the flwr process outlives this call). The caller stops
        it with :func:`stop_group` (stopping ``flwr`` does not stop the run on
        the SuperLink: a search session is ended by its ``close`` request, see
        :mod:`fedreid.flower.search_session`).
        """
        if self.home is None:
            raise LaunchError("FlowerCli.start needs a home folder: its flwr process outlives the call")
        env = flower_env({"FLWR_HOME": str(self.home)})
        with open(log, "ab") as out:
            return popen_group([_exe("flwr"), *self.run_args(run_config)], env=env, stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def on_this_host(address: str) -> bool:
    """Whether ``address`` (``HOST:PORT``, ``[IPv6]:PORT``) names this machine: one of its addresses resolves
    to an interface here (loopback included). An unresolvable host is not this machine."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))  # only an address of this machine can be bound
            return True
        except OSError:
            continue
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, *, timeout: float, proc: Optional[subprocess.Popen] = None,
                  what: str = "process", log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise LaunchError(f"{what} exited with code {proc.returncode} before listening on {port}\n{tail}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise LaunchError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s")


@dataclass
class LocalDeployment:
    """A SuperLink and one SuperNode per client on 127.0.0.1; logs and node state under ``workdir``.

    Use as a context manager: every process started is stopped on exit (by its
    PID and process group), whatever happened.
    """

    workdir: Path
    clients: Sequence[str]
    tls: Optional[TLSFiles] = None
    node_keys: Mapping[str, Path] = field(default_factory=dict)  # client -> private key (enables auth)
    local: Mapping[str, str] = field(default_factory=dict)  # prepared_root=..., device=... for every node
    #: Node config of one client's node only, on top of ``local`` (e.g. its ``gallery_store`` for search).
    per_node: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    start_timeout: float = 120.0
    #: Flower's simulation engine (Ray) instead of SuperNode processes: one virtual node per client.
    simulation: bool = False
    #: Simulation engine only: CPUs and GPU share Ray reserves per ClientApp (:func:`simulation_federation_config`).
    client_cpus: Optional[int] = None
    client_gpus: Optional[float] = None
    #: Each process gets SIGTERM when the thread that started it ends (:func:`die_with_parent`, Linux).
    die_with_parent: bool = True

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        if self.simulation and (self.tls or self.node_keys):
            raise LaunchError("Flower's simulation engine runs in one process: no TLS or node keys")
        if not self.simulation and (self.client_cpus is not None or self.client_gpus is not None):
            raise LaunchError("client CPUs and GPUs are resources of Flower's simulation engine (simulation=True)")
        federation = None
        if self.simulation:
            federation = simulation_federation_config(len(self.clients), client_cpus=self.client_cpus,
                                                      client_gpus=self.client_gpus)
            try:
                import ray  # noqa: F401
            except ImportError:
                raise LaunchError("Flower's simulation engine needs Ray: pip install -e .[flower-sim]") from None
        self.cli = FlowerCli(f"127.0.0.1:{self.port}", root_cert=self.tls.ca if self.tls else None,
                             home=self.workdir / "flwr_home", federation_config=federation)

    @property
    def superlink(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name.replace('/', '_')}.log"

    def start_process(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        """Start ``cmd`` as ``name`` (its log: :meth:`log_path`), in its own process group, stopped with the rest."""
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise LaunchError(f"{name} is already running (PID {running.pid}); give the new process another name")
        log = self.log_path(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        # Each deployment keeps Flower's own files (installed app bundles) in its folder, not ~/.flwr.
        env = flower_env({"FLWR_HOME": str(self.workdir / "flwr_state" / name.replace("/", "_"))})
        with open(log, "ab") as fh:
            proc = popen_group(cmd, dies_with_parent=self.die_with_parent, stdout=fh, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, cwd=self.workdir)
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        cmd = superlink_command(port=self.port, host="127.0.0.1", tls=self.tls, node_auth=bool(self.node_keys),
                                database=self.workdir / "superlink.db")
        if self.simulation:
            cmd.append("--simulation")
        proc = self.start_process("superlink", cmd)
        wait_for_port(self.port, timeout=self.start_timeout, proc=proc, what="flower-superlink",
                      log=self.log_path("superlink"))
        for client, key in self.node_keys.items():
            self.cli.register(Path(f"{key}.pub"), name=client)  # the client's name is its site for search

    def start_node(self, client: str, *, private_key: Optional[Path] = None,
                   name: Optional[str] = None) -> subprocess.Popen:
        """A SuperNode for ``client``; ``name`` labels its process and log (default ``node-<client>``)."""
        key = private_key if private_key is not None else self.node_keys.get(client)
        local = {**self.local, **self.per_node.get(client, {})}
        cmd = supernode_command(self.superlink, client, self.workdir / "state", port=free_port(),
                                root_cert=self.tls.ca if self.tls else None, private_key=key, **local)
        return self.start_process(name or f"node-{client}", cmd)

    def start(self) -> "LocalDeployment":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_superlink()
        if not self.simulation:
            for client in self.clients:
                self.start_node(client)
        return self

    def stop_process(self, name: str, sig: int = signal.SIGTERM, *, wait: float = 20.0) -> None:
        """Stop ``name`` and its children (the ClientApp/ServerApp processes it started)."""
        proc = self.procs.get(name)
        if proc is not None:
            stop_group(proc, sig, wait=wait)

    def stop(self) -> None:
        """Stop every process started, SuperNodes first (also what ``with`` and :func:`stop_on_signals` lead to)."""
        for name in [n for n in list(self.procs) if n != "superlink"] + ["superlink"]:
            self.stop_process(name)

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["LaunchError", "TLSFiles", "FlowerCli", "LocalDeployment", "Terminated", "command_line", "die_with_parent",
           "flower_env", "free_port", "node_config_string", "on_this_host", "popen_group", "run_config_string",
           "search_run_config_string", "session_run_config_string", "simulation_federation_config", "stop_group",
           "stop_on_signals", "superlink_command", "supernode_command"]
