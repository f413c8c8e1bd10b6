"""Starting the parts of a Flower deployment and following a training run, with checks before anything starts.

What the ``flower`` command does, as library calls: the SuperLink's and a
SuperNode's command lines (their inputs checked first: TLS or an explicit
``--insecure``, the node key, its state folder, its gallery store), a run's
config turned into Flower's run config, the run and work folders of a
one-host deployment claimed, and a finished run's round count read from its
checkpoint. Every refusal is a one-line :class:`~fedreid.options.ConfigError`
or a missing-file error, raised before a process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from fedreid.config import Config, ConfigError, load_config
from fedreid.flower import launch
from fedreid.flower.launch import (
    FlowerCli,
    TLSFiles,
    run_config_string,
    simulation_federation_config,
    superlink_command,
    supernode_command,
)
from fedreid.utils.cli import override_value
from fedreid.utils.io import shown_path

#: What one-host deployments (`local`, `simulate`) write in their work folder.
WORK_ENTRIES = ("flwr_home", "flwr_state", "logs", "state", "fedreid_state", "tls", "keys", "flwr_run.log",
                "superlink.db")
#: The SQLite files beside the SuperLink's database (Flower opens it in WAL mode).
DATABASE_SIDE_FILES = ("superlink.db-wal", "superlink.db-shm", "superlink.db-journal")
WORK_KIND = "flower-work"
TOOL = "flower_fed"


def checked_ca(ca: Optional[str], insecure: bool, what: str) -> Optional[Path]:
    """The CA file for TLS, or None with ``insecure``; one of the two must be chosen, never guessed.

    A ``ca`` that is not a file is refused here, naming it, rather than by the
    SuperNode or ``flwr`` it would be handed to, in their own log.
    """
    if ca and insecure:
        raise ConfigError(f"{what}: give either --ca or --insecure, not both")
    if not ca and not insecure:
        raise ConfigError(f"{what}: pass --ca CA_FILE for TLS (see `certs`), or --insecure for plain "
                          "HTTP on a trusted network")
    if ca and not Path(ca).is_file():
        raise FileNotFoundError(f"{what}: --ca {shown_path(ca)} is not a file (the CA certificate, ca.crt from "
                                "`certs` or your organisation's CA)")
    return Path(ca) if ca else None


def superlink_launch(*, tls_dir: Optional[str], insecure: bool, port: int, host: str, node_auth: bool,
                     database: Optional[str]) -> list[str]:
    """The SuperLink's command line (TLS files from ``tls_dir``, or plain HTTP with ``insecure``)."""
    if not tls_dir and not insecure:
        raise ConfigError("superlink: pass --tls DIR (from `certs`) or --insecure for plain HTTP on a trusted network")
    tls = TLSFiles.from_dir(tls_dir) if tls_dir else None
    return superlink_command(port=port, host=host, tls=tls, node_auth=node_auth,
                             database=Path(database) if database else None)


def supernode_launch(*, client: str, superlink: str, ca: Optional[Path], key: Optional[str], state_dir: str,
                     port: int, local: Mapping[str, Optional[str]], check: bool = True) -> list[str]:
    """A SuperNode's command line for ``client``.

    ``local``: the node's own settings (``prepared_root``, ``classification_root``,
    ``gallery_store``, ``gallery_root`` as paths, made absolute because the
    node's ClientApp processes run elsewhere; ``device``, ``search_thumbnails``).
    With ``check`` the state folder is claimed and the gallery store opened
    (every file checked, as each search will) here, before the SuperNode
    starts, rather than in its ClientApp's log.
    """
    paths = ("prepared_root", "classification_root", "gallery_store", "gallery_root")
    settings = {name: (str(Path(value).resolve()) if name in paths else value)
                for name, value in local.items() if value}
    key_path = Path(key).resolve() if key else None
    if key_path is not None and not key_path.is_file():
        raise FileNotFoundError(f"node key {key_path} not found (make it with `node-key`)")
    if check:
        from fedreid.flower.node import claim_state_dir

        claim_state_dir(state_dir)
        if settings.get("gallery_store"):
            from fedreid.retrieval.store import GalleryStore

            GalleryStore.open(settings["gallery_store"])
    return supernode_command(superlink, client, Path(state_dir).resolve(), port=port,
                             root_cert=ca.resolve() if ca else None, private_key=key_path, **settings)


def register_node_key(public_key: str, *, superlink: str, ca: Optional[Path], site: Optional[str]) -> None:
    """Allow a SuperNode's public key on a SuperLink started with node authentication, bound to ``site``."""
    if not Path(public_key).is_file():
        raise FileNotFoundError(f"public key {public_key} not found (make it with `node-key`)")
    FlowerCli(superlink, root_cert=ca).register(Path(public_key), name=site)


@dataclass(frozen=True)
class PreparedRun:
    """A training run ready to submit: its folder, Flower run config, planned rounds and loaded config."""

    out: Path
    run_config: str
    rounds: int
    cfg: Config


def absolute_path_overrides(cfg: Config) -> list[str]:
    """Overrides giving each relative path of ``cfg`` (:data:`fedreid.fl.simulation.PATH_KEYS`) as an absolute
    one, resolved in this process's working folder; ``pkg://`` values and absolute paths are left out."""
    from fedreid.fl.simulation import PATH_KEYS

    out = []
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and "://" not in value and not Path(value).is_absolute():  # pkg://: a package's file
            resolved = str(Path(value).resolve())
            if override_value(resolved) != resolved:  # YAML would read it as something else
                raise ConfigError(f"{key}: the path {resolved} cannot be passed to the ServerApp as an override; "
                                  "give an absolute path without YAML syntax (': ', ' #', leading '[', '{', '&')")
            out.append(f"{key}={resolved}")
    return out


def prepare_run(*, out: str, config: Optional[str], overrides: Sequence[str], resume: bool,
                round_timeout: Optional[float] = None, join_timeout: Optional[float] = None,
                node_auth: bool = False) -> PreparedRun:
    """Load and check the run's config (the run's own ``config.yaml`` with ``resume``), before any process starts.

    Refused here, with the one-line :class:`ConfigError` the ServerApp would
    give once SuperLink and SuperNodes were up: the run config as the
    ServerApp reads it (:meth:`fedreid.flower.app.ServerSettings.from_run_config`
    on Flower's parse of it: ``round_timeout`` finite and > 0,
    ``join_timeout`` finite and >= 0), a run the ServerApp does not serve
    (:func:`fedreid.flower.app.check_training_run`: ``fl.mode=local``), an
    unknown ``model.backbone`` (:func:`fedreid.fl.federation.check_model_name`), and
    with ``resume`` an override of a key the run may not change
    (:func:`fedreid.fl.simulation.check_resumable`, against ``config.yaml``).

    The ServerApp runs in a folder of Flower's, so the run's relative paths
    (:data:`fedreid.fl.simulation.PATH_KEYS`, from ``--config`` or the
    overrides, or with ``resume`` from ``config.yaml``, where a run of
    ``tools/train_fed.py`` keeps them as written) are passed as overrides
    resolved in this process's working folder, the submitting shell's: the
    folder ``tools/train_fed.py`` reads them in, fresh or resumed. An
    override of the user's is what gets resolved, so it keeps its meaning.
    """
    from flwr.common.config import parse_config_args

    from fedreid.fl.federation import check_model_name
    from fedreid.fl.simulation import check_resumable
    from fedreid.flower.app import ServerSettings, check_training_run

    out_path = Path(out)
    if resume:
        if config:
            raise ConfigError("--resume uses the run's own config.yaml; pass overrides only")
        config_path = out_path / "config.yaml"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: nothing to resume in {out_path}")
    else:
        if not config:
            raise ConfigError("--config is required (or --resume)")
        config_path = Path(config)
    # Resumed too: a run started by flower_fed saved absolute paths, but one of train_fed's kept relative ones.
    overrides = [*overrides, *absolute_path_overrides(load_config(config_path, list(overrides)))]
    text = run_config_string(config_path, out_path, overrides, resume=resume, round_timeout=round_timeout,
                             join_timeout=join_timeout, node_auth=node_auth)
    settings = ServerSettings.from_run_config(parse_config_args([text]))  # what the ServerApp will be given
    cfg = load_config(config_path, list(overrides))
    check_training_run(cfg, settings)
    check_model_name(cfg)
    if resume:
        check_resumable(load_config(config_path), cfg)
    return PreparedRun(out_path, text, cfg.fl.rounds, cfg)


def rounds_done(out: Path) -> int:
    """Rounds recorded in the run folder's latest checkpoint (0 without one)."""
    from fedreid.utils.checkpoint import latest_checkpoint, load_checkpoint

    ckpt_path = latest_checkpoint(out)
    return len(load_checkpoint(ckpt_path)["history"]) if ckpt_path is not None else 0


def folder_stamp(folder: Path) -> Optional[tuple[tuple[str, int, int], ...]]:
    """What ``folder`` holds, as (name, size, modification time) of each entry; None when it is no folder.

    Two stamps differ when anything was written there in between (a run's
    checkpoint, config or marker).
    """
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return None
    stamp = []
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:
            continue
        stamp.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(stamp))


def claim_local_folders(out: Path, workdir: Optional[str], resume: bool) -> Path:
    """Check and claim the run folder and the work folder of a one-host deployment; returns the work folder.

    Nothing is started and nothing in a refused folder changes: the run
    folder as :func:`fedreid.fl.simulation.claim_run_dir`, the work folder
    new, empty, marked, or holding only what these deployments write there
    (:data:`WORK_ENTRIES`).
    """
    from fedreid.fl.simulation import claim_run_dir
    from fedreid.utils.io import claim_output_dir

    # Absolute: the SuperLink and SuperNodes run in it and read their TLS files by these paths.
    work = (Path(workdir) if workdir else out.parent / f"{out.name}_flower").resolve()
    if work.resolve() == out.resolve():
        raise ConfigError(f"--workdir {work} is the run folder --out; give them different folders")
    # Exact names: a folder holding e.g. `statements.pdf` or `keys_backup` is the user's, not an earlier work folder.
    adopt = work.is_dir() and not work.is_symlink() and all(
        p.name in WORK_ENTRIES or p.name in DATABASE_SIDE_FILES or (p.name.startswith(".") and p.name.endswith(".tmp"))
        for p in work.iterdir())
    if work.exists() or work.is_symlink():  # a refusal here comes before --out is made
        claim_output_dir(work, WORK_KIND, tool=TOOL, adopt=adopt)
    claim_run_dir(out, resume=resume, tool=TOOL)
    claim_output_dir(work, WORK_KIND, tool=TOOL, adopt=adopt)
    return work


def client_names(cfg: Config) -> list[str]:
    """The clients of ``cfg``'s federation, one SuperNode each."""
    from fedreid.fl.federation import build_federation

    return build_federation(cfg).server.client_names


def check_one_host_security(tls: bool, node_auth: bool) -> None:
    """Node authentication on one host needs TLS (Flower authenticates SuperNodes over TLS only)."""
    if node_auth and not tls:
        raise ConfigError("--node-auth needs --tls: Flower authenticates SuperNodes over TLS only")


def run_on_one_host(run: PreparedRun, work: Path, *, tls: bool, node_auth: bool,
                    announce: Callable[[list[str]], None] = lambda clients: None) -> tuple[int, Path]:
    """The run on a SuperLink and one SuperNode per client on 127.0.0.1, stopped at the end; (flwr exit code, log).

    ``tls``/``node_auth``: a test CA and node keys made in the work folder
    (kept there for a resume). ``announce(clients)`` is called before start.
    """
    from fedreid.flower.security import make_node_key, make_tls_files

    check_one_host_security(tls, node_auth)
    clients = client_names(run.cfg)
    files = None
    if tls:
        if not (work / "tls" / "ca.crt").exists():
            make_tls_files(work / "tls")
        files = TLSFiles.from_dir(work / "tls")
    keys = {}
    if node_auth:
        for i, name in enumerate(clients):
            key = work / "keys" / f"node{i}"
            keys[name] = key if key.exists() else make_node_key(work / "keys", f"node{i}")["private"]
    announce(clients)
    with launch.LocalDeployment(work, clients, tls=files, node_keys=keys) as dep:
        log = work / "flwr_run.log"
        return dep.cli.run(run.run_config, log=log), log


def run_on_simulation_engine(run: PreparedRun, work: Path, *, client_cpus: Optional[int],
                             client_gpus: Optional[float],
                             announce: Callable[[list[str]], None] = lambda clients: None) -> tuple[int, Path]:
    """The run on Flower's simulation engine (Ray), one virtual SuperNode per client; (flwr exit code, log)."""
    clients = client_names(run.cfg)
    announce(clients)
    with launch.LocalDeployment(work, clients, simulation=True, client_cpus=client_cpus,
                                client_gpus=client_gpus) as dep:
        log = work / "flwr_run.log"
        return dep.cli.run(run.run_config, log=log), log


def check_simulation_resources(client_cpus: Optional[int], client_gpus: Optional[float]) -> None:
    """Refuse client resources the simulation engine would not take, before anything starts."""
    simulation_federation_config(1, client_cpus=client_cpus, client_gpus=client_gpus)


__all__ = [
    "PreparedRun",
    "WORK_ENTRIES",
    "WORK_KIND",
    "check_one_host_security",
    "check_simulation_resources",
    "checked_ca",
    "claim_local_folders",
    "client_names",
    "folder_stamp",
    "prepare_run",
    "register_node_key",
    "rounds_done",
    "run_on_one_host",
    "run_on_simulation_engine",
    "superlink_launch",
    "supernode_launch",
]
