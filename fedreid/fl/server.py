"""The server: sample clients, send the global state, collect updates, aggregate, hooks, evaluate.

The server never sees a client object: a round calls ``fit(k, payload,
instructions) -> Update`` for each sampled client index ``k`` (in simulation
that calls :meth:`fedreid.fl.client.Client.fit` in the same process; a
networked deployment sends ``payload`` and ``instructions`` over the wire and
gets the same :class:`~fedreid.fl.update.Update` back).

Modes (``fl.mode``):

* ``federated`` (FedPav, Algorithm 1): every round, ``K`` of ``N`` clients are
  drawn with the server's seeded generator (a permutation prefix; ``K = N`` in
  the benchmark, the order is still drawn as the reference's
  ``random.sample``), each trains from the global shared state, the server
  averages (:func:`fedreid.fl.aggregate.aggregate`) and runs its hooks (KD).
* ``local``: the baseline where each client trains alone with the same
  schedule. The same loop runs; the payload of client ``k`` is its own last
  shared state and nothing is aggregated or communicated.

Communication is counted from the bytes of every tensor that crosses the wire
(scalars and names travel as small JSON and are not counted), per direction
and per kind, in the round record's ``comm``:

* ``sent_bytes``: to each sampled client, the model payload plus the tensors
  in the instructions (a hook's payload, e.g. SCAFFOLD's control variate
  ``c``); ``sent``: the same split by kind (``model``, then the instruction
  keys);
* ``received_bytes``: every update that came back (rejected ones too: they
  crossed the wire), its shared state plus the tensors in its metadata (KD
  features, SCAFFOLD's ``Delta c``, FedFTG's class counts); ``received``: by
  kind (``model``, then the metadata keys); ``metadata_bytes`` is the
  metadata part;
* ``total_bytes`` = sent + received, ``cumulative_bytes`` its running sum;
* ``paper_bytes`` = ``2 x shared-model bytes x K`` (K = clients whose update
  was accepted): the paper's ``rounds x 2 x model size`` per client, which
  counts the model only; ``cumulative_paper_bytes`` its running sum. For
  plain FedPav the two measures agree.

Each run has a ``run_id`` (:func:`new_run_id`), made when the server is built
and kept in its checkpoint, so a resumed run keeps it: remote clients key the
state they keep between rounds by it (:mod:`fedreid.flower.node`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
from torch import Tensor, nn

from fedreid.config import Config
from fedreid.errors import ConfigError, FedReIDError
from fedreid.fl.aggregate import Aggregate, aggregate, server_step
from fedreid.fl.server_hooks.base import AggregationInput, ServerHook, hook_problem
from fedreid.fl.state import clone_state, state_nbytes
from fedreid.fl.update import Update, check_update, tensor_nbytes, to_plain
from fedreid.utils.checkpoint import CheckpointError
from fedreid.utils.seeding import derive_seed

FitFn = Callable[[int, Mapping[str, Tensor], dict], Update]
log = logging.getLogger(__name__)


class RoundFailedError(FedReIDError, RuntimeError):
    """Too few clients returned a usable update for the round to count."""


@dataclass(frozen=True)
class RoundPlan:
    """A round in flight: its index, the sampled client indices and what they are asked to do."""

    round_index: int
    ids: list[int]
    instructions: dict[str, Any]
    started: float
    #: Keys that replace ``instructions`` for some clients, by client index (``ServerHook.client_instructions``).
    per_client: dict[int, dict[str, Any]] = field(default_factory=dict)

    def instructions_for(self, k: int) -> dict[str, Any]:
        """What client ``k`` is asked to do: the round's instructions with its own keys over them (a new dict)."""
        return {**self.instructions, **self.per_client.get(k, {})}

EvalFn = Callable[[nn.Module], Mapping[str, Any]]


def new_run_id() -> str:
    """A fresh identifier of a run (32 hex digits).

    Deliberately not drawn from the run's seeded generators: two runs of the
    same config and seed must still get different ids (otherwise a node would
    mistake one run's private client state for the other's), and the id
    never changes any number of the run.
    """
    return uuid.uuid4().hex


def is_eval_round(round_index: int, every: int, rounds: int) -> bool:
    """Evaluate after rounds ``every``, ``2 every``, ... and after the last one."""
    return (round_index + 1) % every == 0 or round_index + 1 == rounds


def model_state(model: nn.Module, *, with_head: bool = False) -> "OrderedDict[str, Tensor]":
    """The global model's state as sent to clients (shared only, unless FedAvg)."""
    if with_head:
        return clone_state(model.state_dict())
    from fedreid.models.reid import shared_state

    return clone_state(shared_state(model))


class Server:
    """Round logic over client indices ``0..N-1`` named ``client_names``."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        client_names: Sequence[str],
        *,
        hooks: Sequence[ServerHook] = (),
        evaluator: Optional[EvalFn] = None,
    ) -> None:
        if not client_names:
            raise ValueError("a server needs at least one client")
        self.cfg = cfg
        self.model = model
        self.client_names = list(client_names)
        self.hooks = list(hooks)
        for hook in self.hooks:
            if not isinstance(hook, ServerHook):
                raise TypeError(f"server hook {hook!r} is not a fedreid.fl.server_hooks.ServerHook")
        aggregators = [h.name for h in self.hooks if h.aggregates()]
        if len(aggregators) > 1:
            raise ValueError(f"server hooks {', '.join(aggregators)} each replace the aggregation; "
                             "a run can use one of them")
        self.evaluator = evaluator
        self.with_head = cfg.fl.aggregation == "fedavg"
        self.global_state = model_state(model, with_head=self.with_head)
        self.local_states: dict[int, "OrderedDict[str, Tensor]"] = {}
        self.sampler = np.random.default_rng(derive_seed(cfg.seed, "sample"))
        self.round = 0  # rounds completed
        self.total_bytes = 0
        self.total_paper_bytes = 0
        self.run_id = new_run_id()  # replaced by the checkpoint's on resume
        k = cfg.fl.clients_per_round
        if k > len(self.client_names):
            raise ConfigError(
                f"fl.clients_per_round={k} but the scenario has only {len(self.client_names)} clients"
            )

    @property
    def num_clients(self) -> int:
        return len(self.client_names)

    @property
    def federated(self) -> bool:
        return self.cfg.fl.mode == "federated"

    # ----------------------------------------------------------------- round

    def sample_clients(self) -> list[int]:
        """``K`` client indices, in a seeded random order (consumes the sampler)."""
        k = self.cfg.fl.clients_per_round or self.num_clients
        return [int(i) for i in self.sampler.permutation(self.num_clients)[:k]]

    def instructions(self, round_index: int) -> dict[str, Any]:
        """What every sampled client is asked to do this round."""
        out: dict[str, Any] = {
            "round": round_index,
            "cdw": bool(self.federated and self.cfg.fl.cdw),
            "kd": False,
            "evaluate": is_eval_round(round_index, self.cfg.eval.every, self.cfg.fl.rounds),
        }
        if self.federated:
            for hook in self.hooks:
                for key, value in hook.instructions(round_index).items():
                    out[key] = out.get(key, False) or value
        return out

    def payload_for(self, k: int) -> "OrderedDict[str, Tensor]":
        if self.federated:
            return self.global_state
        return self.local_states.get(k, self.global_state)

    def run_round(self, fit: FitFn) -> dict[str, Any]:
        """One full round, clients one after another; returns its record (see :mod:`fedreid.fl.simulation`).

        A transport that trains clients concurrently calls :meth:`begin_round`,
        dispatches ``plan.ids`` itself and hands what came back to
        :meth:`finish_round`; this method is that sequence in one process.
        """
        plan = self.begin_round()
        updates: list[Update] = []
        for k in plan.ids:
            update = fit(k, self.payload_for(k), plan.instructions_for(k))
            if update.client != self.client_names[k]:
                raise ValueError(f"update from {update.client!r} returned for client {self.client_names[k]!r}")
            updates.append(update)
        return self.finish_round(plan, updates)

    def begin_round(self) -> RoundPlan:
        """Sample this round's clients, let the hooks prepare, and fix the instructions."""
        round_index = self.round
        started = time.perf_counter()
        ids = self.sample_clients()
        if self.federated:
            for hook in self.hooks:
                hook.begin_round(round_index, self.global_state)
        plan = RoundPlan(round_index, ids, self.instructions(round_index), started)
        if self.federated:
            index = {self.client_names[k]: k for k in ids}
            for hook in self.hooks:
                for name, keys in hook.client_instructions(round_index, [self.client_names[k] for k in ids]).items():
                    if name not in index:
                        raise ValueError(f"server hook {hook.name!r} instructs {name!r}, not sampled this round")
                    plan.per_client.setdefault(index[name], {}).update(keys)
        return plan

    def finish_round(
        self, plan: RoundPlan, updates: Sequence[Update], failures: Optional[Mapping[str, str]] = None
    ) -> dict[str, Any]:
        """Validate, aggregate, run the hooks and evaluate; returns the round's record.

        ``updates``: what the sampled clients returned, in any order.
        ``failures``: client name -> why nothing came back (a lost connection).
        Updates that fail :func:`fedreid.fl.update.check_update` against the
        global state (non-finite values, missing, reshaped or retyped tensors)
        or a hook's ``check_update`` (metadata the hook needs: KD features,
        class counts) are rejected and logged with the failures, never
        averaged. Fewer than
        ``fl.min_clients`` accepted updates raise :class:`RoundFailedError`
        and leave the server as it was before the round.
        """
        if plan.round_index != self.round:
            raise ValueError(f"plan for round {plan.round_index + 1} finished in round {self.round + 1}")
        failed: dict[str, str] = dict(failures or {})
        accepted: list[Update] = []
        # Aggregate in the sampled order whatever order replies came in: float sums depend on it.
        order = {self.client_names[k]: i for i, k in enumerate(plan.ids)}
        for u in sorted(updates, key=lambda u: order.get(u.client, len(order))):
            if u.client not in order:
                failed[u.client] = "update from a client that was not sampled this round"
                continue
            problem = check_update(u, self.payload_for(self.client_names.index(u.client)))
            if not problem and self.federated:  # hooks run on federated rounds only
                problem = next(filter(None, (hook_problem(h, plan.round_index, u, self.model) for h in self.hooks)),
                               None)
            if problem:
                failed[u.client] = f"update rejected: {problem}"
                continue
            accepted.append(u)
        need = min(self.cfg.fl.min_clients, len(plan.ids))
        if len(accepted) < need:
            detail = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items())) or "none replied"
            raise RoundFailedError(
                f"round {plan.round_index + 1}: {len(accepted)} of {len(plan.ids)} sampled clients returned a "
                f"usable update, fl.min_clients={self.cfg.fl.min_clients} ({detail})"
            )
        for name, why in sorted(failed.items()):
            log.warning("round %d: client %s left out: %s", plan.round_index + 1, name, why)
        round_index, ins = plan.round_index, plan.instructions
        comm = self._traffic(plan, [u for u in updates if u.client in order], len(accepted))
        record: dict[str, Any] = {
            "round": round_index + 1,
            "mode": self.cfg.fl.mode,
            "clients": [u.client for u in accepted],
            "train_loss": float(np.mean([u.metadata.get("train_loss", np.nan) for u in accepted])),
            "client_metrics": {},
            "comm": comm,
            "time": {"clients": {}},
        }
        if failed:
            record["failed"] = dict(sorted(failed.items()))
        for u in accepted:
            scalars = to_plain(u.scalars())
            record["time"]["clients"][u.client] = {k: v for k, v in scalars.items() if k.startswith("time_")}
            record["client_metrics"][u.client] = dict(
                {k: v for k, v in scalars.items() if not k.startswith("time_")}, num_samples=u.num_samples
            )
        t0 = time.perf_counter()
        if self.federated:
            agg, by = self.aggregate(round_index, accepted, cdw=ins["cdw"])
            if self.cfg.fl.server_lr != 1.0:
                record["server_lr"] = self.cfg.fl.server_lr
            self.set_global_state(agg.state)
            record["weighting"] = agg.weighting
            record["weights"] = dict(zip(agg.clients, agg.weights))
            if agg.note:
                record["note"] = agg.note
            if agg.stats and by is not None:
                record[by] = to_plain(agg.stats)
            record["time"]["aggregate"] = time.perf_counter() - t0
            if ins["evaluate"] and self.evaluator is not None and self.cfg.eval.before_hooks and any(
                    h.trains_model(round_index) for h in self.hooks):
                t0 = time.perf_counter()
                record["eval_before_hooks"] = to_plain(dict(self.evaluator(self.model)))
                record["time"]["eval_before_hooks"] = time.perf_counter() - t0
            for hook in self.hooks:
                t0 = time.perf_counter()
                stats = hook.after_aggregate(round_index, self.model, accepted)
                if stats:
                    self.global_state = model_state(self.model, with_head=self.with_head)
                    stats = dict(stats)
                    record["time"][hook.name] = stats.pop(f"{hook.name}_seconds", time.perf_counter() - t0)
                    record[hook.name] = to_plain(stats)
        else:
            for u in accepted:
                self.local_states[self.client_names.index(u.client)] = u.state
        del accepted
        if ins["evaluate"] and self.federated and self.evaluator is not None:
            t0 = time.perf_counter()
            record["eval"] = to_plain(dict(self.evaluator(self.model)))
            record["time"]["eval"] = time.perf_counter() - t0
        self.round += 1
        timing = record.pop("time")  # keep wall-clock entries last in the record
        timing["round"] = time.perf_counter() - plan.started
        record["time"] = timing
        return record

    def trainable_names(self) -> list[str]:
        """The trainable parameters of the global state (a server step acts on these, buffers take the average)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad and n in self.global_state]

    def average(self, updates: Sequence[Update], *, cdw: bool = False) -> Aggregate:
        """The server's own aggregation: ``fl.weighting`` (or CDW) weights, then the ``fl.server_lr`` step."""
        agg = aggregate(updates, cdw=cdw, bn=self.cfg.fl.bn, weighting=self.cfg.fl.weighting)
        if self.cfg.fl.server_lr != 1.0:
            agg.state = server_step(self.global_state, agg.state, self.cfg.fl.server_lr, self.trainable_names())
        return agg

    def aggregate(self, round_index: int, updates: Sequence[Update], *, cdw: bool = False
                  ) -> tuple[Aggregate, Optional[str]]:
        """The round's new global state and the name of the hook that made it (None: :meth:`average`).

        A hook that implements ``aggregate`` (SCAFFOLD, FedDyn, FedAvgM, ...)
        owns the step; it may start from :meth:`average` through
        ``AggregationInput.average``.
        """
        batch = AggregationInput(round_index, self.global_state, updates, self.trainable_names(),
                                 lambda: self.average(updates, cdw=cdw), num_clients=self.num_clients)
        for hook in self.hooks:
            if hook.aggregates():
                agg = hook.aggregate(batch)
                if agg is not None:
                    return agg, hook.name
        return batch.average(), None

    def _traffic(self, plan: RoundPlan, received: Sequence[Update], participants: int) -> dict[str, Any]:
        """The round's ``comm`` record (see the module docstring); adds to the running totals.

        ``received``: the updates that came back from sampled clients;
        ``participants``: how many were accepted (the paper's K).
        """
        if not self.federated:  # the local baseline communicates nothing
            sent_by: dict[str, int] = {}
            received_by: dict[str, int] = {}
            paper = 0
        else:
            # Every sampled client gets its payload and its instructions (the round's, some keys its own).
            sent_by = {"model": sum(state_nbytes(self.payload_for(k)) for k in plan.ids)}
            for k in plan.ids:
                for key, value in plan.instructions_for(k).items():
                    if tensor_nbytes(value):
                        sent_by[key] = sent_by.get(key, 0) + tensor_nbytes(value)
            received_by = {"model": sum(u.nbytes for u in received)}
            for u in received:
                for key, n in u.metadata_nbytes_by_key().items():
                    received_by[key] = received_by.get(key, 0) + n
            # Before aggregation the global state is still the one the clients received.
            paper = 2 * state_nbytes(self.global_state) * participants
        sent, got = sum(sent_by.values()), sum(received_by.values())
        self.total_bytes += sent + got
        self.total_paper_bytes += paper
        return {
            "sent_bytes": sent,
            "received_bytes": got,
            "total_bytes": sent + got,
            "metadata_bytes": got - received_by.get("model", 0),
            "cumulative_bytes": self.total_bytes,
            "paper_bytes": paper,
            "cumulative_paper_bytes": self.total_paper_bytes,
            "sent": sent_by,
            "received": received_by,
        }

    def set_global_state(self, state: Mapping[str, Tensor]) -> None:
        """Adopt an aggregated state and load it into the server's model."""
        self.global_state = clone_state(state)
        if self.with_head:
            self.model.load_state_dict(self.global_state)
        else:
            from fedreid.models.reid import load_shared_state

            load_shared_state(self.model, self.global_state)

    # ----------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "global_state": clone_state(self.global_state),
            "local_states": {k: clone_state(v) for k, v in self.local_states.items()},
            "sampler": self.sampler.bit_generator.state,
            "total_bytes": self.total_bytes,
            "total_paper_bytes": self.total_paper_bytes,
            "run_id": self.run_id,
            "client_names": list(self.client_names),
            "hooks": {h.name: h.state_dict() for h in self.hooks},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["client_names"]) != self.client_names:
            raise CheckpointError(
                f"checkpoint clients {state['client_names']} differ from this run's {self.client_names}"
            )
        self.round = int(state["round"])
        self.set_global_state(state["global_state"])
        self.local_states = {int(k): clone_state(v) for k, v in state["local_states"].items()}
        self.sampler.bit_generator.state = state["sampler"]
        self.total_bytes = int(state["total_bytes"])
        # Checkpoints from before these fields: model-only traffic was all that was counted.
        self.total_paper_bytes = int(state.get("total_paper_bytes", self.total_bytes))
        if state.get("run_id"):
            self.run_id = str(state["run_id"])
        else:
            log.warning("the checkpoint has no run id (written by an older fedreid); this run continues as %s, "
                        "and remote clients start from fresh client state", self.run_id)
        saved_hooks = state.get("hooks", {})
        for hook in self.hooks:
            if hook.name in saved_hooks:
                hook.load_state_dict(saved_hooks[hook.name])
            elif type(hook).state_dict is not ServerHook.state_dict:  # a stateful hook needs its state
                raise CheckpointError(f"checkpoint has no state for server hook {hook.name!r}")
