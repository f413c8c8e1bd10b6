"""Flower ``ServerApp`` and ``ClientApp`` around the project's own server and client code.

No algorithm lives here. The ServerApp runs
:func:`fedreid.fl.simulation.run_simulation` with a ``remote_round`` that
sends each sampled client its payload and instructions through the Flower
grid and hands the replies to :meth:`fedreid.fl.server.Server.finish_round`
(sampling, aggregation, CDW, KD, FedFTG, SCAFFOLD/FedDyn halves, evaluation,
checkpoints and resume are the in-process code). The ClientApp is
:class:`fedreid.flower.node.NodeClient`: it builds its client from the
config the server sends, trains with :meth:`fedreid.fl.client.Client.fit`
and keeps its private state on its own disk.

Run config (``flwr run ... --run-config``; see :class:`ServerSettings`):
``config`` (the project's YAML, a path on the server machine), ``overrides``
(``key.sub=value`` separated by spaces), ``out`` (the run folder),
``resume``, ``round-timeout``, ``join-timeout``, ``secure-aggregation``,
``node-auth`` (the SuperLink authenticates SuperNodes: a client name held by
a connected node is never handed to another node, see :class:`GridRound`).
``mode=search`` runs a federated search instead of training
(:func:`fedreid.flower.search.serve_search`; its keys ``search-*`` are in
:class:`fedreid.flower.search.SearchSettings`); ``mode=search-session`` a
long-lived run answering search after search from a socket
(:func:`fedreid.flower.search_session.serve_session`, keys ``session-*`` in
:class:`fedreid.flower.search_session.SessionSettings`).

Node config (``flower-supernode --node-config``; see :class:`NodeSettings`):
``client`` (the client this machine is: a dataset name such as
``market1501``, or ``client003`` of a partition), ``state-dir`` (its private
state), and machine-local paths: ``prepared-root``, ``classification-root``,
``device``. For federated search (:mod:`fedreid.flower.search`): this
site's ``gallery-store`` folder, ``gallery-root`` (where its relative image
paths lie), ``search-thumbnails`` (whether answers may carry small JPEG
thumbnails; off by default) and ``thumbnail-size`` (pixels, default 64).

The ClientApp's ``query`` handler answers both the training "which client
are you?" and search queries, told apart by the message content
(:func:`fedreid.flower.search_codec.is_search_query`).
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedreid.config import Config, ConfigError, dump_config, load_config, load_config_text
from fedreid.errors import FedReIDError
from fedreid.flower.codec import CodecError, pack, unpack, update_from_plain, update_to_plain
from fedreid.flower.search import SEARCH_KEYS, SitePolicy, run_config_flag, run_config_seconds, site_reply
from fedreid.flower.search_codec import is_search_query
from fedreid.flower.search_session import SESSION_KEYS

if TYPE_CHECKING:  # the training modules (timm, torchvision...) load when a round or a train message needs them:
    from fedreid.fl.server import Server  # a search query's ClientApp process starts seconds sooner
    from fedreid.flower.node import NodeClient

log = logging.getLogger("fedreid.flower")

#: Node-config keys and the config key each one sets on that machine only.
NODE_PATHS = {
    "prepared-root": "data.prepared_root",
    "classification-root": "classification.root",
    "device": "run.device",
}
#: Every key a node config may hold; ``partition-id`` and ``num-partitions`` are what Flower's simulation sets.
NODE_KEYS = frozenset({"client", "state-dir", "gallery-store", "gallery-root", "thumbnail-size", "search-thumbnails",
                       "partition-id", "num-partitions", *NODE_PATHS})


@dataclass(frozen=True)
class ServerSettings:
    """The run config of the ServerApp."""

    config: Optional[str]
    overrides: list[str]
    out: Path
    resume: bool = False
    round_timeout: float = 3600.0
    join_timeout: float = 300.0
    secure_aggregation: bool = False
    node_auth: bool = False

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "ServerSettings":
        known = {"config", "overrides", "out", "resume", "round-timeout", "join-timeout", "secure-aggregation",
                 "node-auth", "mode", *SEARCH_KEYS, *SESSION_KEYS}  # mode, search-*, session-*: search modes only
        unknown = sorted(set(run_config) - known)
        if unknown:
            raise ConfigError(f"flower run config: unknown key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(sorted(known))}")
        if not str(run_config.get("out", "")).strip():
            raise ConfigError("flower run config: 'out' (the run folder on the server machine) is required")
        config = str(run_config.get("config", "")).strip() or None
        return cls(
            config=config,
            overrides=shlex.split(str(run_config.get("overrides", ""))),
            out=Path(str(run_config["out"])),
            resume=run_config_flag(run_config, "resume"),
            round_timeout=run_config_seconds(run_config, "round-timeout", 3600.0),
            join_timeout=run_config_seconds(run_config, "join-timeout", 300.0, zero=True),
            secure_aggregation=run_config_flag(run_config, "secure-aggregation"),
            node_auth=run_config_flag(run_config, "node-auth"),
        )


@dataclass(frozen=True)
class NodeSettings:
    """The node config of a SuperNode: who it is, where its state and data are."""

    client: Optional[str]
    state_dir: Path
    local_overrides: tuple[str, ...] = ()
    #: Flower's simulation engine names nodes by ``partition-id`` instead: the k-th client of the federation.
    partition: Optional[int] = None
    #: This site's gallery store for federated search (``gallery-store``); None: it answers searches with an error.
    gallery_store: Optional[Path] = None
    #: What a search may take from this site (``search-thumbnails``, ``thumbnail-size``, ``gallery-root``).
    search_policy: SitePolicy = SitePolicy()

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> "NodeSettings":
        unknown = sorted(set(node_config) - NODE_KEYS)
        if unknown:
            raise ConfigError(f"flower node config: unknown key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(sorted(NODE_KEYS))}")
        client = str(node_config.get("client", "")).strip() or None
        partition = node_config.get("partition-id")
        if client is None and partition is None:
            raise ConfigError("flower node config: 'client' (which client this machine is) is required, "
                              "e.g. --node-config \"client='market1501' state-dir='/var/lib/fedreid'\"")
        overrides = tuple(f"{key}={node_config[name]}" for name, key in NODE_PATHS.items() if name in node_config)
        state_dir = Path(str(node_config.get("state-dir", "fedreid_state")))
        store = str(node_config.get("gallery-store", "")).strip()
        root = str(node_config.get("gallery-root", "")).strip()
        try:
            size = int(node_config.get("thumbnail-size", 64))
        except (TypeError, ValueError):
            raise ConfigError(f"flower node config: thumbnail-size: expected pixels (an integer), got "
                              f"{node_config.get('thumbnail-size')!r}") from None
        policy = SitePolicy(thumbnails=run_config_flag(node_config, "search-thumbnails"),
                            thumbnail_size=size,
                            image_root=Path(root) if root else None)
        if client is None:
            try:
                partition = int(partition)
            except (TypeError, ValueError):
                raise ConfigError(f"flower node config: partition-id: expected a client number, "
                                  f"got {partition!r}") from None
        return cls(client, state_dir, overrides, None if client is not None else partition,
                   gallery_store=Path(store) if store else None, search_policy=policy)

    @property
    def site(self) -> str:
        """The name this node answers searches as: its client name (``partition-<k>`` in a simulation)."""
        return self.client if self.client is not None else f"partition-{self.partition}"

    def hello(self) -> dict[str, Any]:
        """The answer to "which client are you?"."""
        return {"client": self.client} if self.client is not None else {"partition": self.partition}


def check_secure_aggregation(cfg: Config, requested: bool) -> None:
    """Refuse secure aggregation: the server-side methods need every client's own model or features."""
    if not requested:
        return
    needs = [f"fl.{name} (server hook)" for name, _ in cfg.hook_specs()]  # every hook reads individual updates
    needs = (["fl.cdw"] if cfg.fl.cdw else []) + needs
    if needs:
        raise ConfigError(
            f"secure aggregation hides individual client models, which {', '.join(needs)} need; "
            "turn those off or run without secure-aggregation"
        )
    raise ConfigError("secure aggregation is not supported by fedreid's Flower app yet; "
                      "run without secure-aggregation (use TLS for transport security)")


def check_training_run(cfg: Config, settings: ServerSettings) -> None:
    """Refuse a training run the ServerApp cannot serve, as a one-line :class:`ConfigError`.

    Secure aggregation (:func:`check_secure_aggregation`) and ``fl.mode``
    other than ``federated`` (the local-training baseline has no server).
    The ServerApp checks this before its first round; ``tools/flower_fed.py``
    checks it before it starts any process
    (:func:`fedreid.flower.deployment.prepare_run`).
    """
    check_secure_aggregation(cfg, settings.secure_aggregation)
    if cfg.fl.mode != "federated":
        raise ConfigError("fl.mode: the local-training baseline has no server; run it with tools/train_fed.py")


# ------------------------------------------------------------------ server


class GridRound:
    """``remote_round`` for :func:`run_simulation`: one round over the Flower grid.

    Replies are matched to requests by message id (an error reply the
    SuperLink writes for a vanished node comes from the SuperLink, not from
    that node). Which client a node is comes from its answer to a ``query``
    message; those answers are collected without blocking a round, so a
    client that restarts mid-run (under a new node id) joins the next round.

    Two nodes claiming one client name: without node authentication (a
    trusted network) the newer claim wins, as a restarted node reappears
    under a new id before its old one is dropped. With ``node-auth`` a
    registered node keeps its node id across restarts, so a second node
    claiming a name held by a connected node is another key holder: it is
    refused and logged, and considered again only once the holder has left.
    """

    poll_seconds = 0.5
    #: A node that has not answered "which client are you?" after this long, or answered it with an error
    #: (its ClientApp failed: a node config it refuses...), is asked again; not at every poll, as each
    #: message starts a ClientApp process on that node.
    hello_retry_seconds = 60.0

    def __init__(self, grid: Grid, cfg: Config, settings: ServerSettings) -> None:
        self.grid = grid
        self.cfg = cfg
        self.settings = settings
        self.config_text = dump_config(cfg)
        #: fedreid's run id (the server's, kept across resumes): nodes key their client state by it.
        self.run_id: Optional[str] = None
        self.nodes: dict[str, int] = {}  # client name -> node id
        self.strangers: set[int] = set()
        self.hellos: dict[str, tuple[int, float]] = {}  # message id -> (node id, sent at)
        self.hello_failed: dict[int, float] = {}  # node whose answer was an error -> when it came
        self.claims: dict[int, tuple[str, int]] = {}  # refused node -> (client it claims, node holding it)
        #: Whether a round of this process has waited for the clients to join (a resumed run's first too).
        self.joined = False

    def _ask_new_nodes(self) -> None:
        present = set(self.grid.get_node_ids())
        self.nodes = {name: node for name, node in self.nodes.items() if node in present}
        for node, (name, holder) in sorted(self.claims.items()):
            if node not in present:
                del self.claims[node]
            elif holder not in present and name not in self.nodes:
                del self.claims[node]
                self.nodes[name] = node
                log.warning("client %r is now node %s (node %s, which held it, has left)", name, node, holder)
        now = time.monotonic()
        self.hellos = {mid: (node, t) for mid, (node, t) in self.hellos.items()
                       if node in present and now - t < self.hello_retry_seconds}
        asked = {node for node, _ in self.hellos.values()}
        self.hello_failed = {node: t for node, t in self.hello_failed.items()
                             if node in present and now - t < self.hello_retry_seconds}
        new = sorted(present - set(self.nodes.values()) - self.strangers - asked - set(self.claims)
                     - set(self.hello_failed))
        if not new:
            return
        hello = [Message(content=pack(hello={"run": self.run_id}), dst_node_id=node,
                         message_type=MessageType.QUERY, group_id="hello") for node in new]
        for mid, node in zip(self.grid.push_messages(hello), new):
            if mid:
                self.hellos[mid] = (node, now)

    def _collect_hellos(self, client_names: list[str]) -> None:
        if not self.hellos:
            return
        for reply in self.grid.pull_messages(list(self.hellos)):
            node, _ = self.hellos.pop(reply.metadata.reply_to_message_id, (None, 0.0))
            if node is None:
                continue
            if reply.has_error():
                log.warning("node %s did not say which client it is: %s", node, reply.error.reason)
                self.hello_failed[node] = time.monotonic()
                continue
            try:
                answer = unpack(reply.content, "hello")
                if not isinstance(answer, dict):
                    raise TypeError(f"the answer is a {type(answer).__name__}, not a mapping")
                name = str(answer.get("client"))
                if "partition" in answer:
                    # a whole number as hello() sends it: int() of a float would crash on Infinity, round 2.7 down
                    partition = answer["partition"]
                    if not isinstance(partition, int) or isinstance(partition, bool):
                        raise TypeError(f"partition: expected a client number, got {partition!r:.60}")
                    if 0 <= partition < len(client_names):
                        name = client_names[partition]
            except (CodecError, TypeError, ValueError) as exc:
                log.warning("node %s: malformed answer (%s); ignored", node, exc)
                self.strangers.add(node)
                continue
            if name not in client_names:
                log.warning("node %s says it is client %r, which this run does not have (%s); ignored",
                            node, name, ", ".join(client_names))
                self.strangers.add(node)
            elif name in self.nodes and self.nodes[name] != node and self.settings.node_auth:
                log.warning("node %s claims to be client %r, which connected node %s is: refused (with node "
                            "authentication a restarted node keeps its id; is a key shared between sites?)",
                            node, name, self.nodes[name])
                self.claims[node] = (name, self.nodes[name])
            elif name in self.nodes and self.nodes[name] != node:
                # A restarted client comes back under a new id before its old one is dropped.
                log.warning("client %r now answers from node %s (was node %s): the newer one is used",
                            name, node, self.nodes[name])
                self.strangers.add(self.nodes[name])
                self.nodes[name] = node
            else:
                self.nodes[name] = node
                log.info("client %s is node %s", name, node)

    def discover(self, client_names: list[str], *, wait: float) -> None:
        """Learn which node is which client, waiting up to ``wait`` seconds for all of them."""
        deadline = time.monotonic() + wait
        while True:
            self._ask_new_nodes()
            self._collect_hellos(client_names)
            if len(self.nodes) == len(client_names) or time.monotonic() >= deadline:
                return
            time.sleep(self.poll_seconds)

    def __call__(self, server: Server) -> dict[str, Any]:
        names = server.client_names
        self.run_id = server.run_id
        self.discover(names, wait=0.0 if self.joined else self.settings.join_timeout)
        self.joined = True
        plan = server.begin_round()
        failures: dict[str, str] = {}
        messages, targets, sent_to = [], [], {}
        for k in plan.ids:
            name = names[k]
            node = self.nodes.get(name)
            if node is None:
                failures[name] = "not connected"
                continue
            content = pack(payload=dict(server.payload_for(k)), instructions=plan.instructions_for(k),
                           run={"id": server.run_id, "config": self.config_text, "client": name})
            messages.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN,
                                    group_id=str(plan.round_index)))
            targets.append(name)
            sent_to[name] = node
        pending: dict[str, str] = {}
        for mid, name in zip(self.grid.push_messages(messages) if messages else [], targets):
            if mid:
                pending[mid] = name
            else:
                failures[name] = "the SuperLink did not accept the message"
        started = time.monotonic()
        updates = []
        while pending and time.monotonic() - started < self.settings.round_timeout:
            for reply in self.grid.pull_messages(list(pending)):
                name = pending.pop(reply.metadata.reply_to_message_id, None)
                if name is None:
                    continue
                if reply.has_error():
                    failures[name] = f"client failed: {reply.error.reason}"
                    continue
                try:
                    update = update_from_plain(unpack(reply.content, "update"))
                except (CodecError, FedReIDError, ValueError, TypeError) as exc:
                    failures[name] = f"update rejected: {exc}"
                    continue
                if update.client != name:
                    failures[name] = f"update rejected: it names client {update.client!r}"
                    continue
                updates.append(update)
            self._ask_new_nodes()  # a restarted client is asked, and answers, while others train
            self._collect_hellos(names)
            if pending:
                time.sleep(self.poll_seconds)
        for name in pending.values():
            failures[name] = f"no reply within round-timeout={self.settings.round_timeout:g} s"
        for name in failures:  # a lost node is asked again who it is (a restart gives a new id)
            if name in sent_to and self.nodes.get(name) == sent_to[name]:
                del self.nodes[name]
        from fedreid.flower.node import LOCAL_EVAL

        local_eval = {u.client: u.metadata.pop(LOCAL_EVAL) for u in updates if LOCAL_EVAL in u.metadata}
        record = server.finish_round(plan, updates, failures)
        if local_eval:  # as the simulation records it: the clients' models before aggregation
            order = {name: i for i, name in enumerate(record["clients"])}
            kept = sorted((n for n in local_eval if n in order), key=order.__getitem__)
            record["local_eval"] = {name: local_eval[name] for name in kept}
        return record


server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    _log_to_stderr()
    mode = str(context.run_config.get("mode", "train")).strip() or "train"
    if mode == "search":  # before the training modules load: a search starts seconds sooner
        from fedreid.flower.search import serve_search

        serve_search(grid, context.run_config)
        return
    if mode == "search-session":  # a long-lived run answering queries from its socket
        from fedreid.flower.search_session import serve_session

        serve_session(grid, context.run_config)
        return
    if mode != "train":
        raise ConfigError(f"flower run config: mode={mode!r}; expected 'train', 'search' or 'search-session'")
    from fedreid.eval.report import write_report
    from fedreid.fl.server import RoundFailedError
    from fedreid.fl.simulation import run_simulation

    settings = ServerSettings.from_run_config(context.run_config)
    cfg = load_config(settings.config, settings.overrides) if settings.config else None
    if cfg is None and not settings.resume:
        raise ConfigError("flower run config: 'config' (the YAML on the server machine) is required unless resuming")
    # Without a config, a resumed run is its saved one.
    effective = cfg if cfg is not None else load_config(settings.out / "config.yaml", settings.overrides)
    check_training_run(effective, settings)
    holder: dict[str, GridRound] = {}

    def remote_round(server: Server) -> dict[str, Any]:
        if "round" not in holder:
            holder["round"] = GridRound(grid, server.cfg, settings)
        return holder["round"](server)

    try:
        history = run_simulation(effective, settings.out, resume=settings.resume, progress=False,
                                 callbacks=[_log_round], remote_round=remote_round)
    except RoundFailedError as exc:
        log.error("%s; the run stops here and can be resumed (resume=true) from its last round", exc)
        raise
    saved = load_config(settings.out / "config.yaml")
    write_report(settings.out, history, targets=saved.classification.target_accuracies)
    log.info("finished: %d rounds, report in %s", len(history), settings.out / "report.md")


def _log_to_stderr() -> None:
    """Round lines and warnings reach ``flwr run --stream`` and the SuperLink's log."""
    root = logging.getLogger("fedreid")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fedreid %(levelname)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _log_round(event: str, info: dict) -> None:
    if event != "round_end":
        return
    record = info["record"]
    lost = record.get("failed", {})
    log.info("round %d: %d clients, loss %.3f%s", record["round"], len(record["clients"]),
             record["train_loss"], f", left out: {', '.join(lost)}" if lost else "")


# ------------------------------------------------------------------ client

client_app = ClientApp()
_NODES: dict[tuple[str, str, str], NodeClient] = {}


def _node_client(run: Mapping[str, Any], settings: NodeSettings) -> NodeClient:
    """This machine's client for the run (rebuilt when the process is new or the config changed)."""
    if not run.get("id"):
        raise ConfigError("the train message carries no fedreid run id (a server from an older fedreid?); "
                          "run the same fedreid version on the server and the nodes")
    key = (str(run["id"]), settings.client, str(run["config"]))
    if key not in _NODES:
        from fedreid.flower.node import NodeClient

        _NODES.clear()
        cfg = load_config_text(str(run["config"]), list(settings.local_overrides))
        _NODES[key] = NodeClient(cfg, settings.client, settings.state_dir, str(run["id"]))
    return _NODES[key]


@client_app.query()
def client_query(msg: Message, context: Context) -> Message:
    """A search query (its content says so): this site's answer; otherwise "which client are you?"."""
    settings = NodeSettings.from_node_config(context.node_config)
    if is_search_query(msg.content):
        return Message(site_reply(msg.content, site=settings.site, store_folder=settings.gallery_store,
                                  policy=settings.search_policy), reply_to=msg)
    return Message(pack(hello=settings.hello()), reply_to=msg)


@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    settings = NodeSettings.from_node_config(context.node_config)
    run = unpack(msg.content, "run")
    if settings.client is None:  # a simulation partition: the server mapped it to its client
        settings = NodeSettings(str(run.get("client")), settings.state_dir, settings.local_overrides)
    elif run.get("client") != settings.client:
        raise ConfigError(f"this node is client {settings.client!r}, the server asked for {run.get('client')!r}")
    node = _node_client(run, settings)
    update = node.fit(unpack(msg.content, "payload"), unpack(msg.content, "instructions"))
    return Message(pack(update=update_to_plain(update)), reply_to=msg)


__all__ = ["server_app", "client_app", "ServerSettings", "NodeSettings", "GridRound", "check_secure_aggregation",
           "check_training_run"]
