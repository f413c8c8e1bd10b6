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
  127.0.0.1, stopped by their own PIDs.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from fedreid.errors import FedReIDError
from fedreid.flower import PROJECT_DIR


class LaunchError(FedReIDError, RuntimeError):
    """A Flower process did not start or a run did not finish."""


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
    """The environment for Flower processes: telemetry off, this interpreter's scripts first on PATH."""
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


def node_config_string(client: str, state_dir: str | Path, **local: str) -> str:
    """``--node-config`` text: ``client``, ``state-dir`` and machine-local paths (see ``NodeSettings``)."""
    items = {"client": client, "state-dir": str(state_dir), **{k.replace("_", "-"): v for k, v in local.items() if v}}
    for key, value in items.items():
        if "'" in str(value) or "\"" in str(value):
            raise LaunchError(f"node config {key}={value!r}: quotes are not allowed")
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


def run_config_string(config: Path, out: Path, overrides: Sequence[str] = (), *, resume: bool = False,
                      round_timeout: Optional[float] = None, join_timeout: Optional[float] = None) -> str:
    """``--run-config`` text for :class:`fedreid.flower.app.ServerSettings` (paths made absolute)."""
    for item in overrides:
        if "'" in item:
            raise LaunchError(f"override {item!r}: single quotes cannot be passed to flwr run")
    parts = {"config": str(Path(config).resolve()), "out": str(Path(out).resolve()),
             "overrides": " ".join(shlex.quote(o) for o in overrides)}
    text = " ".join(f"{k}='{v}'" for k, v in parts.items())
    text += f" resume={'true' if resume else 'false'}"
    if round_timeout is not None:
        text += f" round-timeout={float(round_timeout)}"
    if join_timeout is not None:
        text += f" join-timeout={float(join_timeout)}"
    return text


class FlowerCli:
    """The ``flwr`` command against one SuperLink, with a private FLWR_HOME holding its connection."""

    def __init__(self, superlink: str, *, root_cert: Optional[Path] = None, home: Optional[Path] = None,
                 options: Optional[Mapping[str, int]] = None) -> None:
        self.superlink = superlink
        self.home = Path(home) if home is not None else Path(tempfile.mkdtemp(prefix="fedreid-flwr-"))
        self.home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", 'default = "fedreid"', "", "[superlink.fedreid]", f'address = "{superlink}"']
        lines.append("insecure = true" if root_cert is None else f'root-certificates = "{Path(root_cert).resolve()}"')
        if options:  # e.g. num-supernodes for a SuperLink in simulation mode
            lines += ["", "[superlink.fedreid.options]", *(f"{k} = {int(v)}" for k, v in options.items())]
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def _run(self, args: Sequence[str], *, timeout: Optional[float], log: Optional[Path] = None,
             cwd: Optional[Path] = None):
        cmd = [_exe("flwr"), *args]
        env = flower_env({"FLWR_HOME": str(self.home)})
        out = open(log, "ab") if log is not None else subprocess.PIPE
        try:
            return subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False, cwd=cwd)
        finally:
            if log is not None:
                out.close()

    def register(self, public_key: Path, *, timeout: float = 60) -> None:
        """Allow the SuperNode holding the private half of ``public_key`` (``--enable-supernode-auth``)."""
        done = self._run(["supernode", "register", str(public_key), "fedreid"], timeout=timeout)
        if done.returncode != 0:
            raise LaunchError(f"flwr supernode register {public_key} failed: {done.stdout.decode(errors='replace')}")

    def run(self, run_config: str, *, log: Optional[Path] = None, timeout: Optional[float] = None,
            cwd: Optional[Path] = None) -> int:
        """``flwr run`` the fedreid app and stream its logs until it ends; returns flwr's exit code."""
        done = self._run(["run", str(PROJECT_DIR), "fedreid", "--run-config", run_config, "--stream"],
                         timeout=timeout, log=log, cwd=cwd)
        return done.returncode


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
    start_timeout: float = 120.0
    #: Flower's simulation engine (Ray) instead of SuperNode processes: one virtual node per client.
    simulation: bool = False

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        if self.simulation and (self.tls or self.node_keys):
            raise LaunchError("Flower's simulation engine runs in one process: no TLS or node keys")
        if self.simulation:
            try:
                import ray  # noqa: F401
            except ImportError:
                raise LaunchError("Flower's simulation engine needs Ray: pip install -e .[flower-sim]") from None
        self.cli = FlowerCli(f"127.0.0.1:{self.port}", root_cert=self.tls.ca if self.tls else None,
                             home=self.workdir / "flwr_home",
                             options={"num-supernodes": len(self.clients)} if self.simulation else None)

    @property
    def superlink(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name.replace('/', '_')}.log"

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise LaunchError(f"{name} is already running (PID {running.pid}); give the new process another name")
        log = self.log_path(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        # Each deployment keeps Flower's own files (installed app bundles) in its folder, not ~/.flwr.
        env = flower_env({"FLWR_HOME": str(self.workdir / "flwr_state" / name.replace("/", "_"))})
        with open(log, "ab") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=self.workdir, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_superlink(self) -> None:
        cmd = superlink_command(port=self.port, host="127.0.0.1", tls=self.tls, node_auth=bool(self.node_keys),
                                database=self.workdir / "superlink.db")
        if self.simulation:
            cmd.append("--simulation")
        proc = self._start("superlink", cmd)
        wait_for_port(self.port, timeout=self.start_timeout, proc=proc, what="flower-superlink",
                      log=self.log_path("superlink"))
        for client, key in self.node_keys.items():
            self.cli.register(Path(f"{key}.pub"))

    def start_node(self, client: str, *, private_key: Optional[Path] = None,
                   name: Optional[str] = None) -> subprocess.Popen:
        """A SuperNode for ``client``; ``name`` labels its process and log (default ``node-<client>``)."""
        key = private_key if private_key is not None else self.node_keys.get(client)
        cmd = supernode_command(self.superlink, client, self.workdir / "state", port=free_port(),
                                root_cert=self.tls.ca if self.tls else None, private_key=key, **self.local)
        return self._start(name or f"node-{client}", cmd)

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
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=wait)

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "superlink"] + ["superlink"]:
            self.stop_process(name)

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["LaunchError", "TLSFiles", "FlowerCli", "LocalDeployment", "flower_env", "superlink_command",
           "supernode_command", "node_config_string", "run_config_string", "free_port"]
