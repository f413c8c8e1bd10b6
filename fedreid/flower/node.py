"""A client machine's side of a run, without Flower: build its client, train, keep its state on disk.

Flower may start a fresh ClientApp process for every message, so nothing
survives in memory between rounds. What must survive -- the private identity
head, BatchNorm statistics under ``fl.bn=local``, the objective's state
(SCAFFOLD's control variate, FedDyn's ``h_k``, MOON's previous model,
FedLMD's counts) -- is :meth:`fedreid.fl.client.Client.state_dict`, written
after every round to ``<state_dir>/<run>/<client>/after_round_<r>.pt``
(atomically) and never sent.

Before training round ``r`` the node loads the newest state saved after a
round *before* ``r``: if the server crashed and resumes a round the node had
already trained, the node trains it again from the same state, so the run
stays what it would have been without the crash. The two newest states are
kept.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from fedreid.config import Config
from fedreid.fl.update import Update
from fedreid.utils.io import atomic_path

STATE_PATTERN = re.compile(r"after_round_(\d+)\.pt$")
KEEP_STATES = 2
#: Update metadata key of the client's own evaluation of its model before aggregation.
LOCAL_EVAL = "local_eval"


def safe_name(name: str) -> str:
    """A client or run name as one path component (``market1501/cam1`` -> ``market1501_cam1``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "client"


class NodeClient:
    """The client ``name`` of the run ``run`` on this machine, state under ``state_dir``."""

    def __init__(self, cfg: Config, name: str, state_dir: str | Path, run: str) -> None:
        from fedreid.fl.simulation import build_client

        self.cfg = cfg
        self.client, self.work_model = build_client(cfg, name)
        self.folder = Path(state_dir) / safe_name(run) / safe_name(name)
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
        self.client.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        return earlier[-1]

    def save(self, round_index: int) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.state_path(round_index)
        with atomic_path(path) as tmp:
            torch.save(self.client.state_dict(), tmp)
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
        """The evaluator of this client's own dataset (ReID, ``eval.local_models``), else None."""
        cfg = self.cfg
        dataset = self.client.split.dataset
        wanted = cfg.eval.datasets is None or dataset in cfg.eval.datasets
        if cfg.task != "reid" or not cfg.eval.local_models or not wanted:
            return None
        if self._evaluator is None:
            from fedreid.data.prepared import load_prepared
            from fedreid.fl.evaluation import Evaluator

            self._evaluator = Evaluator.from_config(
                cfg, {dataset: load_prepared(cfg.data.prepared_root, dataset)}, self.client.device
            )
        return self._evaluator


__all__ = ["NodeClient", "safe_name"]
