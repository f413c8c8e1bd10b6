"""An in-process stand-in for Flower's Grid: messages go straight to ``client_app`` (no sockets).

Flower's own classes carry the messages (``Message``, ``Context``, records), so
the app's encoding, routing and reply handling run exactly as over the
network; tests of real processes on 127.0.0.1 live in ``tests/flower/test_flower_deploy.py``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from flwr.app import Context, Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo
from flwr.supercore.task_identity import TaskIdentity


class FakeGrid:
    """Nodes ``{node_id: node_config}``; ``tamper(node_id, reply) -> reply | None`` (None: the node is lost).

    ``registered``: ``{node_id: name}``, the name each node's key was registered
    under on the SuperLink (``flwr supernode register --name``), which
    :meth:`get_nodes` reports as Flower's ``NodeInfo.name`` does.
    ``latency``: a reply is missing from the first ``latency`` pulls that ask
    for it, as a real node's answer is not there the instant its query is sent.
    """

    def __init__(self, client_app, nodes: dict[int, dict], *, tamper: Optional[Callable] = None,
                 registered: Optional[dict[int, str]] = None, latency: int = 0) -> None:
        self.client_app = client_app
        self.nodes = dict(nodes)
        self.tamper = tamper
        self.registered = dict(registered or {})
        self.sent: list[Message] = []
        self.replies: dict[str, Message] = {}
        self.latency = int(latency)
        self._waits: dict[str, int] = {}
        self._count = 0
        # What a ServerApp process has set when its main() runs (Message() reads it).
        self._saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0

    def close(self) -> None:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = self._saved

    def __enter__(self) -> "FakeGrid":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=node, name=self.registered.get(node, "")) for node in self.nodes]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver each message now; its reply (unless tampered away) waits to be pulled."""
        ids = []
        for msg in messages:
            self._count += 1
            mid = f"m{self._count}"
            msg.metadata.__dict__["_message_id"] = mid  # what the real grid sets when pushing
            self.sent.append(msg)
            ids.append(mid)
            node = msg.metadata.dst_node_id
            if node not in self.nodes:
                continue
            context = Context(run_id=1, node_id=node, node_config=dict(self.nodes[node]),
                              state=RecordDict(), run_config={})
            reply = self.client_app(msg, context)
            if self.tamper is not None:
                reply = self.tamper(node, msg, reply)
            if reply is not None:
                self.replies[mid] = reply
                self._waits[mid] = self.latency
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        out = []
        for mid in list(message_ids):
            if mid not in self.replies:
                continue
            if self._waits.get(mid, 0) > 0:
                self._waits[mid] -= 1
                continue
            out.append(self.replies.pop(mid))
        return out
