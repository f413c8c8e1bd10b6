"""A client machine's side of a run, without Flower: build its client, train, keep its state on disk.

Flower may start a fresh ClientApp process for every message, so nothing
survives in memory between rounds. What must survive -- the private identity
head, BatchNorm statistics under ``fl.bn=local``, the objective's state
(SCAFFOLD's control variate, FedDyn's ``h_k``, MOON's previous model,
FedLMD's counts) -- is :meth:`fedreid.fl.client.Client.state_dict`, written
after every round to ``<state_dir>/<run id>/<client>/after_round_<r>.pt``
(atomically) and never sent. The run id is fedreid's (made once when the run
is created, kept in the server's checkpoint, sent with every train message;
:attr:`fedreid.fl.server.Server.run_id`), not the run folder's name nor
Flower's run id (a new one on every ``flwr run``, resumes included): a new
run that reuses a folder name starts from fresh client state, a resumed run
finds its own. Each file also records its run id and client, checked when
it is loaded.

The state folder is claimed before anything is built or loaded: it must be
new, empty, marked as a node state folder (``.fedreid-node-state.json``), or
hold only ``<run id>/<client>/after_round_<r>.pt`` files of an earlier
version (:func:`claim_state_dir`); a folder of other files is refused
untouched. State files are read with ``weights_only=True``: tensors and
plain values only, so a planted pickle runs nothing.

Before training round ``r`` the node loads the newest state saved after a
round *before* ``r``: if the server crashed and resumes a round the node had
already trained, the node trains it again from the same state, so the run
stays what it would have been without the crash. The two newest states of a
run are kept; other runs' folders are never touched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from fedreid.config import Config
from fedreid.errors import FedReIDError
from fedreid.fl.update import Update
from fedreid.utils.checkpoint import load_torch_file
from fedreid.utils.io import atomic_path, claim_output_dir

STATE_PATTERN = re.compile(r"after_round_(\d+)\.pt$")
KEEP_STATES = 2
#: Update metadata key of the client's own evaluation of its model before aggregation.
LOCAL_EVAL = "local_eval"
#: What a run id may look like: it becomes a folder name on the node, so nothing path-like.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")
STATE_FORMAT = "fedreid.node_state"
#: The marker kind of a node's state folder (``.fedreid-node-state.json``).
STATE_KIND = "node-state"


class NodeStateError(FedReIDError, ValueError):
    """The node's saved client state does not belong to the run and client asking for it."""


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a state folder, else :class:`NodeStateError`."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise NodeStateError(f"run id {run_id!r}: expected 8-64 letters, digits, '-' or '_' "
                             "(the server sends fedreid's run id with every train message)")
    return run_id


def safe_name(name: str) -> str:
    """A client or run name as one path component (``market1501/cam1`` -> ``market1501_cam1``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "client"


def _earlier_state_layout(folder: Path) -> bool:
    """Whether ``folder`` holds only what a node of an earlier version wrote (``<run id>/<client>/after_round_*.pt``).

    Leftover temporary files of an atomic write (``.<name>.*.tmp``) count as
    the node's own, including those of a marker being written by a node
    starting at the same moment.
    """
    def ours(path: Path) -> bool:
        return path.name.startswith(".") and path.name.endswith(".tmp") and path.is_file()

    try:
        for run in folder.iterdir():
            if ours(run):
                continue
            if run.is_symlink() or not run.is_dir() or not RUN_ID_PATTERN.fullmatch(run.name):
                return False
            for client in run.iterdir():
                if client.is_symlink() or not client.is_dir():
                    return False
                for f in client.iterdir():
                    if not (ours(f) or (STATE_PATTERN.fullmatch(f.name) and f.is_file() and not f.is_symlink())):
                        return False
    except OSError:
        return False
    return True


def claim_state_dir(state_dir: str | Path) -> Path:
    """Make ``state_dir`` this node's state folder, or refuse without changing anything.

    Allowed: a new or empty folder, one marked ``.fedreid-node-state.json``,
    or one holding only an earlier version's state files
    (:func:`_earlier_state_layout`). Anything else raises
    :class:`~fedreid.utils.io.OutputDirError` naming the folder and the files
    in the way.
    """
    folder = Path(state_dir)
    adopt = folder.is_dir() and not folder.is_symlink() and _earlier_state_layout(folder)
    return claim_output_dir(folder, STATE_KIND, tool="the fedreid node (--state-dir)", adopt=adopt)


class NodeClient:
    """The client ``name`` of the run with id ``run_id`` on this machine, state under ``state_dir``.

    The run id and the state folder (:func:`claim_state_dir`) are checked
    before the client's data or model is built or any state is read.
    """

    def __init__(self, cfg: Config, name: str, state_dir: str | Path, run_id: str) -> None:
        from fedreid.fl.federation import build_client

        self.run_id = check_run_id(run_id)
        self.state_dir = claim_state_dir(state_dir)
        self.cfg = cfg
        self.client, self.work_model = build_client(cfg, name)
        self.folder = self.state_dir / self.run_id / safe_name(name)
        self._evaluator = None

    @property
    def name(self) -> str:
        return self.client.name

    def saved_rounds(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = (STATE_PATTERN.search(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def state_path(self, round_index: int) -> Path:
        return self.folder / f"after_round_{round_index:05d}.pt"

    def restore(self, round_index: int) -> Optional[int]:
        """Load the newest state saved before ``round_index``; returns its round (None: fresh client)."""
        earlier = [r for r in self.saved_rounds() if r < round_index]
        if not earlier:
            return None
        path = self.state_path(earlier[-1])
        # tensors and primitives only: a file planted in the state dir cannot run code
        saved = load_torch_file(path, what="node state", error=NodeStateError)
        owner = (saved.get("run_id"), saved.get("client")) if isinstance(saved, dict) else (None, None)
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT or owner != (self.run_id, self.name):
            # Never train from another run's (or client's) private head: that run's state would leak into this one.
            raise NodeStateError(f"{path} holds the state of run {owner[0]!r}, client {owner[1]!r}; this is run "
                                 f"{self.run_id!r}, client {self.name!r} (move the file away)")
        self.client.load_state_dict(saved["state"])
        return earlier[-1]

    def save(self, round_index: int) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.state_path(round_index)
        payload = {"format": STATE_FORMAT, "run_id": self.run_id, "client": self.name, "round": round_index,
                   "state": self.client.state_dict()}
        with atomic_path(path) as tmp:
            torch.save(payload, tmp)
        for old in self.saved_rounds()[:-KEEP_STATES]:
            self.state_path(old).unlink(missing_ok=True)
        return path

    def fit(self, payload: Mapping[str, Tensor], instructions: Mapping[str, Any]) -> Update:
        """Restore, train one round exactly as :meth:`Client.fit` does in a simulation, save.

        In an evaluation round (``eval.local_models``) the trained model,
        before aggregation, is also evaluated on this machine's own query and
        gallery; the result travels as ``metadata["local_eval"]``.
        """
        round_index = int(instructions["round"])
        self.restore(round_index)
        update = self.client.fit(self.work_model, payload, dict(instructions))
        evaluator = self.local_evaluator() if instructions.get("evaluate") else None
        if evaluator is not None:
            from fedreid.fl.update import to_plain

            update.metadata[LOCAL_EVAL] = to_plain(evaluator(self.work_model, [self.client.split.dataset]))
        self.save(round_index)
        return update

    def local_evaluator(self):
        """The evaluator of this client's own dataset, else None.

        Only a ReID run with ``eval.local_models`` whose evaluated datasets
        (:func:`fedreid.fl.federation.evaluated_datasets`, the simulation's
        rule) include this client's dataset evaluates here.
        """
        from fedreid.fl.federation import evaluated_datasets

        cfg = self.cfg
        dataset = self.client.split.dataset
        # With eval.datasets unset, the clients' own datasets are evaluated (this one among them) unless
        # leave_one_out keeps the evaluation to its target; the rule does not need the other clients' names.
        wanted = dataset in evaluated_datasets(cfg, [dataset])
        if cfg.task != "reid" or not cfg.eval.local_models or not wanted:
            return None
        if self._evaluator is None:
            from fedreid.data.prepared import load_prepared
            from fedreid.fl.evaluation import Evaluator

            self._evaluator = Evaluator.from_config(
                cfg, {dataset: load_prepared(cfg.data.prepared_root, dataset)}, self.client.device,
                workers=cfg.train.workers,
            )
        return self._evaluator


__all__ = ["NodeClient", "NodeStateError", "check_run_id", "claim_state_dir", "safe_name"]
