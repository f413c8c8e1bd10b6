"""Server and clients in one process: :func:`run_simulation` and :func:`resume`.

The federation is built by :mod:`fedreid.fl.federation`; this module runs it,
checkpoints it and resumes it.

::

    history = run_simulation(cfg, "runs/demo")            # fresh run
    history = run_simulation(cfg, "runs/demo", resume=True)  # continue after a kill
    history = resume("runs/demo")                         # same, config from the checkpoint

A run folder holds ``config.yaml`` (its header comment names the torch
version and thread count the run used), ``checkpoint.pt`` (full state after
the last complete round, see :mod:`fedreid.utils.checkpoint`),
``metrics.jsonl`` / ``metrics.csv`` (one record per round),
``model_final.pt`` at the end, ``tensorboard/`` when TensorBoard is
installed, and the marker ``.fedreid-run.json``. A run writes only into a new
or empty folder, one it marked, or one holding a valid checkpoint of an
earlier version (:func:`claim_run_dir`); a folder of the user's files is
refused before anything in it changes.

A checkpoint records fingerprints of the data (:func:`data_fingerprints`:
each client's training rows, the public set, the evaluation sets) and the
torch thread count (:func:`run_environment`). A resume refuses data whose
manifest rows changed since the checkpoint (image bytes are not read) (:class:`DataChangedError`, naming the client
and the change) and warns when the thread count or torch version differs,
since the numbers then differ from an uninterrupted run's.

A round record (also the items of the returned history)::

    round            1-based index of the completed round
    mode             federated | local
    clients          participating clients, in the round's (sampled) order
    train_loss       mean of the clients' local training losses
    client_metrics   {client: {train_loss, train_acc, steps, lr, num_samples, cdw_distance?}}
    weighting        size | cdw;   weights  {client: normalised aggregation weight}
    comm             sent_bytes, received_bytes, total_bytes, metadata_bytes, cumulative_bytes (every
                     tensor on the wire, both ways), sent / received {kind: bytes} (model, SCAFFOLD's
                     control variates, KD features, class counts...), paper_bytes and
                     cumulative_paper_bytes (the paper's 2 x model bytes x K); see fedreid.fl.server
    kd               {kd_loss, kd_steps, kd_teachers}         (KD rounds)
    eval             {dataset: {rank1, rank5, rank10, mAP, num_valid_queries, ...}}  (global model;
                     in `local` mode {client: {...}}, each client's model on its own data)
    local_eval       {client: {dataset: {...}}}   (federated mode: each client's model before aggregation)
    time             seconds: per client, aggregate, kd, eval, round (differs between reruns)

Everything but ``time`` is bit-identical between an uninterrupted run and a
run killed at any point and resumed (CPU, ``run.deterministic``, the same
torch thread count, torch version and machine).

``run.concurrent_clients: N`` > 1 trains N of a round's clients at once in
worker processes (:class:`fedreid.fl.concurrent.ClientPool`, started once per
run); the client objects here keep every client's state, and the records
and checkpoints equal the sequential run's (bit for bit on the CPU; issue
22). ``N = 1`` trains them one after another in this process.

``callbacks``: callables ``cb(event, info)`` with events ``round_start``
(``{"round"}``, 0-based), ``client_end`` (``{"round", "client", "update"}``;
in completion order with concurrent clients) and ``round_end``
(``{"round", "record"}``, after the checkpoint is written).
An exception raised by a callback stops the run (the checkpoint of the last
complete round stays).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from tqdm import tqdm

from fedreid.config import Config, ConfigError, dump_config, from_dict, to_dict
from fedreid.data.prepared import PreparedDataset
from fedreid.errors import FedReIDError
from fedreid.fl.client import Client, ClientError, records_fingerprint
from fedreid.fl.concurrent import ClientPool, ClientResult
from fedreid.fl.evaluation import Evaluator
from fedreid.fl.federation import (
    Federation,
    build_federation,
    check_model_name,
    public_dataset_name,
    resolve_device,
)
from fedreid.fl.inputs import check_inputs
from fedreid.fl.server import Server
from fedreid.fl.update import to_plain
from fedreid.utils.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fedreid.utils.io import atomic_path, atomic_write_leftovers, check_output_dir, claim_output_dir, write_text_atomic
from fedreid.utils.logging import METRICS_JSONL, MetricsLogger, flatten
from fedreid.utils.precision import resolve_precision
from fedreid.utils.seeding import deterministic_mode

log = logging.getLogger(__name__)

Callback = Callable[[str, dict], None]
#: The marker kind of run folders (``.fedreid-run.json``, :func:`fedreid.utils.io.claim_output_dir`).
RUN_KIND = "run"
#: The partition heat-map of a classification run (clients x classes).
PARTITION_PICTURE = "partition.png"

#: Config keys that may differ when a run is resumed. Not ``train.workers``: each loader
#: worker reseeds its own copy of the training transform, so the count sets the augmentations.
RESUMABLE_CHANGES = ("fl.rounds", "run.", "eval.batch_size", "eval.workers", "eval.before_hooks",
                     "train.persistent_workers")

#: Config keys that name files or folders. A relative one is read in the folder of the process
#: that reads it, so a resume may give it made absolute (:func:`made_absolute`).
PATH_KEYS = ("data.prepared_root", "data.raw_root", "synthetic.root", "classification.root", "model.pretrained")


#: Runs one round on clients in other processes: ``record = remote_round(server)``.
RemoteRound = Callable[[Server], dict[str, Any]]


class DataChangedError(FedReIDError, ValueError):
    """The data of a run changed since its checkpoint; the message names what changed."""


def config_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ between two configs."""
    a, b = flatten(to_dict(old)), flatten(to_dict(new))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def made_absolute(saved: Any, new: Any) -> bool:
    """Whether ``new`` is the relative path ``saved`` made absolute in some folder: ``new`` ends with
    ``saved``'s parts (its ``..`` steps not compared); ``scheme://`` values never are.

    The folder a run started in is not recorded, so any folder is accepted;
    the data fingerprints (:func:`check_resume`) still refuse other data there.
    """
    if not isinstance(saved, str) or not isinstance(new, str) or "://" in saved or "://" in new:
        return False
    rel, full = Path(os.path.normpath(saved)), Path(os.path.normpath(new))
    if rel.is_absolute() or not full.is_absolute():
        return False
    parts = [p for p in rel.parts if p != ".."]
    return not parts or list(full.parts[-len(parts):]) == parts


def check_resumable(saved: Config, cfg: Config, completed_rounds: Optional[int] = None) -> None:
    """Refuse, as a one-line :class:`ConfigError`, resuming ``saved``'s run with ``cfg`` if it changes any
    key but :data:`RESUMABLE_CHANGES`, or asks for fewer ``fl.rounds`` than the ``completed_rounds``
    its checkpoint holds (the run cannot be shortened: its config.yaml would contradict its checkpoint).

    A relative path of :data:`PATH_KEYS` given made absolute (:func:`made_absolute`) is no change:
    Flower's ServerApp runs in a folder of Flower's and is given a run's relative paths resolved in
    the submitting shell's folder (:func:`fedreid.flower.deployment.prepare_run`)."""
    old, new = flatten(to_dict(saved)), flatten(to_dict(cfg))
    changed = [k for k in config_changes(saved, cfg) if not k.startswith(RESUMABLE_CHANGES)
               and not (k in PATH_KEYS and made_absolute(old.get(k), new.get(k)))]
    if changed:
        raise ConfigError(
            "cannot resume with a different config; changed keys: " + ", ".join(changed)
            + f" (only {', '.join(RESUMABLE_CHANGES)} may change)"
        )
    if completed_rounds is not None and cfg.fl.rounds < completed_rounds:
        raise ConfigError(
            f"fl.rounds={cfg.fl.rounds}: the run has already completed {completed_rounds} rounds; "
            f"a resume can only keep or raise fl.rounds (its model after round {cfg.fl.rounds} was not kept)"
        )


def check_history_kept(run_dir: Path) -> None:
    """Refuse a resume of a folder without checkpoint whose ``metrics.jsonl`` records round 2 or later.

    A round's metrics line is written just before its checkpoint, so a kill
    between the two leaves round 1 recorded and no checkpoint: that run starts
    over. Round 2 trains only once round 1's checkpoint exists, so a record of
    it means the checkpoint was removed, and starting over would overwrite
    the recorded history.
    """
    metrics = run_dir / METRICS_JSONL
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return
    rounds = []
    for line in lines:
        try:
            rounds.append(int(json.loads(line)["round"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a kill, or not a round's
    if rounds and max(rounds) >= 2:
        raise FileNotFoundError(
            f"{run_dir} has no {checkpoint_path(run_dir).name} to resume from, but {metrics.name} records "
            f"{max(rounds)} rounds, so the checkpoint was removed: starting over would overwrite them; "
            "restore the checkpoint or train into another folder"
        )


def claim_run_dir(run_dir: str | Path, *, resume: bool, tool: str = "fedreid") -> Optional[dict[str, Any]]:
    """Make ``run_dir`` this run's folder, or refuse without changing anything; returns its checkpoint.

    A fresh run (``resume=False``) needs a new or empty folder, or one marked
    as a run folder (``.fedreid-run.json``) that holds no checkpoint; a folder
    with a checkpoint raises :class:`FileExistsError` (resume it instead).
    With ``resume`` the checkpoint, if any, is read first
    (:func:`~fedreid.utils.checkpoint.load_checkpoint`: tensors and plain
    values only) and returned; a valid one makes an unmarked folder of an
    earlier version ours. Any other folder holding files (a user's
    ``report.md``...) raises :class:`~fedreid.utils.io.OutputDirError`
    naming the folder and the files in the way. ``tool`` names the writer in
    that message. The folder is created and marked on success, and the
    temporary files of writes a kill interrupted there (a partial checkpoint)
    are deleted.
    """
    run_dir = Path(run_dir)
    if not resume:
        check_run_dir(run_dir, tool=tool)
    path = latest_checkpoint(run_dir)
    ckpt = load_checkpoint(path) if path is not None else None
    claim_output_dir(run_dir, RUN_KIND, tool=tool, adopt=ckpt is not None)
    for leftover in atomic_write_leftovers(run_dir):
        leftover.unlink()
    return ckpt


def hooks_that_never_run(cfg: Config) -> list[tuple[str, int]]:
    """``(name, every)`` of the server hooks (``cfg.hook_specs()``) whose ``every`` exceeds ``fl.rounds``.

    Such a hook (KD every 10 rounds in a 5-round run) runs after rounds
    ``every``, ``2 every``, ...: never in this run. A warning, not an error:
    a short run of a paper's config is a common check.
    """
    return [(name, int(values["every"])) for name, values in cfg.hook_specs()
            if isinstance(values.get("every"), int) and not isinstance(values["every"], bool)
            and values["every"] > cfg.fl.rounds]


def check_run_dir(run_dir: str | Path, *, tool: str = "fedreid") -> None:
    """Raise where :func:`claim_run_dir` would refuse ``run_dir`` for a fresh run; change nothing.

    A run folder whose checkpoint was removed but whose results remain (its
    ``model_final.pt``, or a ``metrics.jsonl`` of round 2 or later:
    :func:`check_history_kept`) is refused too: a fresh run would overwrite them.
    """
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds a run ({checkpoint_path(run_dir).name}); "
            "resume it (resume=True / --resume) or choose another folder"
        )
    check_output_dir(run_dir, RUN_KIND, tool=tool)
    if (run_dir / "model_final.pt").is_file():
        raise FileExistsError(
            f"{run_dir} holds a finished run's model_final.pt (its checkpoint was removed): a fresh run would "
            "overwrite it and the run's records; train into another folder"
        )
    check_history_kept(run_dir)


def run_simulation(
    cfg: Optional[Config],
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    datasets: Optional[Mapping[str, PreparedDataset]] = None,
    remote_round: Optional[RemoteRound] = None,
    tool: str = "fedreid",
) -> list[dict[str, Any]]:
    """Run (or, with ``resume``, continue) a federated or local-baseline training.

    Returns the history: one record per completed round (see the module
    docstring). ``cfg=None`` is allowed with ``resume`` (the checkpoint's
    config is used). ``datasets`` overrides loading from ``data.prepared_root``.
    ``remote_round(server) -> record``: the clients live elsewhere (Flower,
    :mod:`fedreid.flower`) and keep their own state; the round is run through
    it instead of in this process, and checkpoints hold the server's side only.
    ``run_dir`` must be a folder the run may write into (:func:`claim_run_dir`;
    ``tool`` names the writer in a refusal); a fresh run claims it once the
    federation is built, so a config that building refuses (a batch larger
    than a client's data) leaves no folder. A resume refuses data changed
    since the checkpoint (:class:`DataChangedError`) and warns when the torch
    thread count or version differs from the checkpoint's. With
    ``run.concurrent_clients`` > 1 (and no ``remote_round``) the clients
    train in worker processes, stopped on every exit path; the caller's main
    script then needs the ``if __name__ == "__main__":`` guard (spawn).
    """
    run_dir = Path(run_dir)
    if cfg is None and (not resume or latest_checkpoint(run_dir) is None):
        raise ValueError(f"no checkpoint in {run_dir} to resume and no config given")
    local_inputs = datasets is None and remote_round is None  # else the data are given or remote
    if cfg is not None:
        check_model_name(cfg)
        resolve_device(cfg.run.device)  # run.device=cuda without CUDA: refused before the folder is claimed
        for name, every in hooks_that_never_run(cfg):
            log.warning("server hook %s runs every %d rounds and this run has %d (fl.rounds): it never runs",
                        name, every, cfg.fl.rounds)
        if local_inputs and not resume:
            check_inputs(cfg)  # every missing input named, before a new run folder is claimed
    ckpt = None
    if resume:
        if latest_checkpoint(run_dir) is None:
            check_history_kept(run_dir)
        ckpt = claim_run_dir(run_dir, resume=True, tool=tool)  # first, is the folder a run's?
    else:
        check_run_dir(run_dir, tool=tool)
    if ckpt is not None:
        saved = from_dict(Config, ckpt["config"])
        if cfg is None:
            cfg = saved
        else:
            check_resumable(saved, cfg, completed_rounds=int(ckpt["round"]))
    assert cfg is not None
    if local_inputs and resume:
        check_inputs(cfg)
    with deterministic_mode(cfg.run.deterministic):
        fed = build_federation(cfg, datasets=datasets)
        if not resume:  # claimed once built: what building refuses (a batch larger than a client's data) leaves no folder
            claim_run_dir(run_dir, resume=False, tool=tool)
        return _run(cfg, run_dir, ckpt, fed, progress=progress, callbacks=callbacks, remote_round=remote_round)


def run_environment(cfg: Optional[Config] = None, device: Optional[torch.device] = None) -> dict[str, Any]:
    """What a run's numbers depend on besides config and seed, as recorded with the run.

    ``torch_threads`` (:func:`torch.get_num_threads`: float sums are split
    differently over another thread count), ``torch`` and ``python``
    versions, ``machine`` (OS and architecture). With the run's ``cfg`` and
    training ``device`` also ``device`` (``cpu``, or ``cuda`` with the card's
    name) and ``precision``, the training arithmetic ``train.precision``
    resolved there (``auto`` is bf16 on a bf16 card), with ``+tf32`` when
    ``train.tf32`` lets fp32 matmuls use TF32 on CUDA.
    """
    environment: dict[str, Any] = {
        "torch_threads": int(torch.get_num_threads()),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
    }
    if cfg is not None and device is not None:
        cuda = device.type == "cuda"
        environment["device"] = f"cuda ({torch.cuda.get_device_name(device)})" if cuda else device.type
        precision = resolve_precision(cfg.train.precision, device).name
        environment["precision"] = precision + ("+tf32" if cuda and cfg.train.tf32 else "")
    return environment


def data_fingerprints(fed: Federation) -> dict[str, dict[str, dict[str, Any]]]:
    """Fingerprints of everything the run reads as data, recorded in each checkpoint.

    ``{"clients": {client: fingerprint}, "public": {name: ...}, "eval":
    {name: ...}}``; every fingerprint has ``images`` (a count) and ``sha256``
    (:meth:`fedreid.fl.client.Client.data_fingerprint`: the training rows;
    the KD public set and the ReID query + gallery rows as
    :func:`fedreid.fl.client.records_fingerprint`; a classification test
    split over its images and labels).
    """
    cfg = fed.cfg
    out: dict[str, dict[str, dict[str, Any]]] = {"clients": {c.name: c.data_fingerprint() for c in fed.clients}}
    public = next((c.public_records for c in fed.clients if c.public_records is not None), None)
    if public is not None:
        name = public_dataset_name(cfg) or "public"
        out["public"] = {name: records_fingerprint(public, cfg.data.prepared_root)}
    evaluator = fed.evaluator
    if evaluator is not None and hasattr(evaluator, "data_fingerprint"):
        out["eval"] = evaluator.data_fingerprint()
    elif evaluator is not None:
        out["eval"] = {name: records_fingerprint(ds.split("query") + ds.split("gallery"), cfg.data.prepared_root)
                       for name, ds in getattr(evaluator, "datasets", {}).items()}
    return out


#: (checkpoint section, how a message names one of its entries, what its images are)
_DATA_SECTIONS = (("clients", "client", "training images"), ("public", "public set", "images"),
                  ("eval", "evaluation set", "images"))


def data_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between two :func:`data_fingerprints`, one phrase per entry.

    E.g. ``client market1501: 12936 training images at checkpoint, 12926 now``.
    """
    problems = []
    for section, label, unit in _DATA_SECTIONS:
        old, new = saved.get(section) or {}, now.get(section) or {}
        for name in list(old) + [n for n in new if n not in old]:
            a, b = old.get(name), new.get(name)
            if a is None:
                problems.append(f"{label} {name}: not in the checkpoint, in the data now")
            elif b is None:
                problems.append(f"{label} {name}: in the checkpoint, not in the data now")
            elif a.get("images") != b.get("images"):
                problems.append(f"{label} {name}: {a.get('images')} {unit} at checkpoint, {b.get('images')} now")
            elif a.get("sha256") != b.get("sha256"):
                problems.append(f"{label} {name}: {b.get('images')} {unit} at checkpoint and now, but not the same "
                                "ones (files, identities, labels or their order differ)")
    return problems


def check_resume(ckpt: Mapping[str, Any], fingerprints: Mapping[str, Any], environment: Mapping[str, Any],
                 run_dir: Path) -> None:
    """Refuse to resume on changed data; warn when the numbers cannot stay bit-identical.

    Raises :class:`DataChangedError` listing every change
    (:func:`data_changes`). Logs a warning when the checkpoint's torch thread
    count or torch version differs from this process's, and when the
    checkpoint (of an older fedreid) records neither data fingerprints nor
    environment, so they cannot be checked.
    """
    where = checkpoint_path(run_dir)
    saved_data = ckpt.get("data")
    if saved_data is not None:
        problems = data_changes(saved_data, fingerprints)
        if problems:
            raise DataChangedError(
                f"cannot resume {run_dir}: the data changed since {where.name} was written: " + "; ".join(problems)
                + " (resume with the data the run started with, or start a new run in another folder)"
            )
    saved_env = ckpt.get("environment")
    unknown = [what for what, value in (("data fingerprints", saved_data), ("torch thread count", saved_env))
               if value is None]
    if unknown:
        log.warning("%s (written by an older fedreid) records no %s: resuming without checking %s",
                    where, " and no ".join(unknown), "them" if len(unknown) > 1 else "it")
    if saved_env is None:
        return
    then, now = saved_env.get("torch_threads"), environment["torch_threads"]
    if then != now:
        log.warning("%s was written with %s torch threads, this process has %s: the resumed run's numbers will "
                    "not be bit-identical to an uninterrupted run's (set the same count, e.g. OMP_NUM_THREADS=%s)",
                    where, then, now, then)
    if saved_env.get("torch") != environment["torch"]:
        log.warning("%s was written under torch %s, this is torch %s: the resumed run's numbers may differ from "
                    "an uninterrupted run's", where, saved_env.get("torch"), environment["torch"])
    for key in ("device", "precision"):
        if key in saved_env and key in environment and saved_env[key] != environment[key]:
            log.warning("%s was trained with %s %s, this process trains with %s: the resumed run's numbers will "
                        "differ from an uninterrupted run's", where, key, saved_env[key], environment[key])


def torch_threads_phrase(threads: int) -> str:
    """``"1 torch thread"`` / ``"4 torch threads"``: how the run records speak of a thread count."""
    return f"{threads} torch thread{'' if threads == 1 else 's'}"


def config_header(environment: Mapping[str, Any]) -> str:
    """The comment lines atop a run's ``config.yaml``: the environment the numbers came from."""
    on = f" on {environment['device']} in {environment['precision']}" if "device" in environment else ""
    return (f"# fedreid run config, trained{on} under torch {environment['torch']} with "
            f"{torch_threads_phrase(environment['torch_threads'])} (Python {environment['python']}, "
            f"{environment['machine']}).\n"
            "# The same config, seed, thread count, torch version and machine give the same numbers.\n")


def _run(cfg: Config, run_dir: Path, ckpt, fed: Federation, *, progress: bool, callbacks,
         remote_round: Optional[RemoteRound] = None) -> list[dict[str, Any]]:
    fingerprints = data_fingerprints(fed)
    environment = run_environment(cfg, fed.device)
    if ckpt is not None:
        check_resume(ckpt, fingerprints, environment, run_dir)
    if fed.class_counts is not None and (ckpt is None or not (run_dir / PARTITION_PICTURE).is_file()):
        # a fresh run draws its own partition; a folder it reuses may hold another run's picture
        from fedreid.data.partition import save_partition_heatmap

        c = cfg.classification
        save_partition_heatmap(fed.class_counts, run_dir / PARTITION_PICTURE,
                               title=f"{c.dataset}: {c.partition} partition, {c.num_clients} clients")
    server = fed.server
    clients = fed.clients if remote_round is None else []
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        server.load_state_dict(ckpt["server"])
        for client in clients:
            if client.name not in ckpt["clients"]:
                raise ClientError(f"checkpoint has no state for client {client.name!r}")
            client.load_state_dict(ckpt["clients"][client.name])
        history = list(ckpt["history"])
    write_text_atomic(run_dir / "config.yaml", config_header(environment) + dump_config(cfg))
    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard)
    logger.reset(history)

    def emit(event: str, info: dict) -> None:
        for cb in callbacks:
            cb(event, info)

    # the folder is the run's now (claimed): a tool may start its log.txt there
    emit("run_start", {"run_dir": run_dir, "round": server.round, "device": str(fed.device)})

    round_bar = tqdm(total=cfg.fl.rounds, initial=server.round, desc="rounds", unit="round",
                     disable=not progress, dynamic_ncols=True)
    pool: Optional[ClientPool] = None
    try:
        processes = min(cfg.run.concurrent_clients, cfg.fl.clients_per_round or len(clients))
        if remote_round is None and processes > 1 and server.round < cfg.fl.rounds:
            pool = _client_pool(fed, processes)
        while server.round < cfg.fl.rounds:
            round_index = server.round
            emit("round_start", {"round": round_index})
            local_eval: dict[str, Any] = {}
            k_round = cfg.fl.clients_per_round or len(clients)
            client_bar = tqdm(total=k_round, desc=f"round {round_index + 1}", unit="client",
                              leave=False, disable=not progress, dynamic_ncols=True)

            def fit(k: int, payload, instructions: dict):
                client = clients[k]
                client_bar.set_postfix_str(client.name)
                update = client.fit(fed.work_model, payload, instructions)
                if _evaluates_locally(fed, client, instructions):
                    local_eval[client.name] = to_plain(fed.evaluator(fed.work_model, [client.split.dataset]))
                client_bar.update(1)
                emit("client_end", {"round": round_index, "client": client.name, "update": update})
                return update

            if remote_round is not None:
                record = remote_round(server)
            elif pool is None:
                record = server.run_round(fit)
            else:
                record = _concurrent_round(fed, server, pool, round_index, local_eval, client_bar, emit)
            client_bar.close()
            if local_eval and cfg.fl.mode == "local":
                # The baseline's own result: every client's model on its own data,
                # reported like a global evaluation so tables and curves show it.
                record["eval"] = {client: next(iter(ev.values())) for client, ev in local_eval.items()}
            elif local_eval:
                record["local_eval"] = local_eval
            history.append(record)
            logger.log(record)
            save_checkpoint(checkpoint_path(run_dir), _checkpoint_payload(
                cfg, server, clients, history, data=fingerprints, environment=environment))
            round_bar.update(1)
            round_bar.set_postfix(_postfix(record))
            emit("round_end", {"round": round_index, "record": record})
        _save_final_model(run_dir, cfg, server)
        logger.log_hparams(to_dict(cfg), _final_metrics(history))
    finally:
        if pool is not None:
            pool.close()
        round_bar.close()
        logger.close()
    return history


def _final_metrics(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The last evaluation's mean metrics over its datasets (what the HParams tab compares runs by)."""
    evaluated = [r for r in history if r.get("eval")]
    if not evaluated:
        return {"train_loss": float(history[-1].get("train_loss", float("nan")))} if history else {}
    rows = [v for v in evaluated[-1]["eval"].values() if isinstance(v, Mapping)]
    keys = [k for k in ("rank1", "mAP", "accuracy") if rows and all(isinstance(r.get(k), (int, float)) for r in rows)]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def _evaluates_locally(fed: Federation, client: Client, instructions: Mapping[str, Any]) -> bool:
    """Whether ``client``'s trained model is evaluated on its own data this round (local mode, eval.local_models)."""
    cfg = fed.cfg
    wants_local = cfg.fl.mode == "local" or cfg.eval.local_models
    return bool(instructions.get("evaluate") and wants_local and fed.evaluator is not None
                and client.split.dataset in fed.evaluator.datasets)


def _client_pool(fed: Federation, processes: int) -> ClientPool:
    """The started worker pool of ``run.concurrent_clients`` (:mod:`fedreid.fl.concurrent`)."""
    cfg = fed.cfg
    wants_local = (cfg.fl.mode == "local" or cfg.eval.local_models) and fed.evaluator is not None
    evaluator = fed.evaluator if wants_local else None
    if isinstance(evaluator, Evaluator):  # a worker evaluates its client with that client's loader workers
        evaluator = evaluator.with_workers(cfg.train.workers)
    pool = ClientPool(cfg, fed.clients, fed.work_model, processes=processes, device=fed.device,
                      evaluator=evaluator)
    pool.start()
    # The workers train on their own copies; this one would only hold device memory.
    fed.work_model.to("cpu")
    return pool


def _concurrent_round(fed: Federation, server: Server, pool: ClientPool, round_index: int,
                      local_eval: dict[str, Any], client_bar: tqdm, emit: Callback) -> dict[str, Any]:
    """:meth:`Server.run_round` with the clients trained in ``pool``; the same record (issue 22).

    Progress and ``client_end`` follow completion order; the updates reach
    :meth:`Server.finish_round` and the local evaluations the record in the
    round's order, so the record does not depend on which client finished first.
    """
    clients = fed.clients
    plan = server.begin_round()
    evaluated: dict[int, Any] = {}

    def finished(result: ClientResult) -> None:
        name = clients[result.index].name
        if result.local_eval is not None:
            evaluated[result.index] = result.local_eval
        client_bar.set_postfix_str(name)
        client_bar.update(1)
        emit("client_end", {"round": round_index, "client": name, "update": result.update})

    updates = pool.fit_round(plan.ids, server.payload_for, plan.instructions,
                             own_instructions=lambda k: plan.per_client.get(k, {}),
                             evaluate=lambda k: _evaluates_locally(fed, clients[k], plan.instructions),
                             on_result=finished)
    for k in plan.ids:
        if k in evaluated:
            local_eval[clients[k].name] = evaluated[k]
    return server.finish_round(plan, updates)


def resume(
    run_dir: str | Path,
    *,
    cfg: Optional[Config] = None,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    datasets: Optional[Mapping[str, PreparedDataset]] = None,
) -> list[dict[str, Any]]:
    """Continue the run in ``run_dir`` from its last complete round."""
    if latest_checkpoint(run_dir) is None:
        raise FileNotFoundError(f"no checkpoint to resume in {run_dir}")
    return run_simulation(cfg, run_dir, resume=True, progress=progress, callbacks=callbacks, datasets=datasets)


def _checkpoint_payload(cfg: Config, server: Server, clients: Sequence[Client], history, *,
                        data: Mapping[str, Any], environment: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "round": server.round,
        "config": to_dict(cfg),
        "server": server.state_dict(),
        "clients": {c.name: c.state_dict() for c in clients},
        "history": history,
        "rng": {"torch": torch.get_rng_state()},
        "data": dict(data),
        "environment": dict(environment),
    }


def _save_final_model(run_dir: Path, cfg: Config, server: Server) -> None:
    payload = {
        "format": "fedreid.model",
        "task": cfg.task,
        "model": to_dict(cfg.model),
        "mode": cfg.fl.mode,
        "round": server.round,
        "state": server.global_state,
    }
    if cfg.fl.mode == "local":
        payload["client_states"] = {server.client_names[k]: v for k, v in server.local_states.items()}
    with atomic_path(run_dir / "model_final.pt") as tmp:
        torch.save(payload, tmp)


def _postfix(record: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": f"{record.get('train_loss', float('nan')):.3f}"}
    ev = record.get("eval")
    if ev:
        r1 = [v["rank1"] for v in ev.values() if "rank1" in v]
        if r1:
            out["R1"] = f"{sum(r1) / len(r1):.3f}"
    return out
