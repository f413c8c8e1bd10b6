"""Building a federation: data -> clients, global model, server hooks, server (nothing trained).

:func:`build_federation` looks the config's ``task`` up in :data:`TASKS`
and returns a :class:`Federation`; :mod:`fedreid.fl.simulation` runs it in
one process and :mod:`fedreid.flower` across machines. A task is one
builder registered with :func:`register_task`: ``reid`` (FedPav on ReID
datasets) and ``classification`` (the clients and evaluator of
:mod:`fedreid.fl.classification`).

The server hooks of every task come from one place, :func:`build_server_hooks`:
``cfg.hook_specs()`` names them (the client objective's server half, the
``fl.kd``/``fl.fedftg`` shorthands, ``fl.hooks``), the registry
(:mod:`fedreid.fl.server_hooks`) builds each from its typed options and a
:class:`~fedreid.fl.server_hooks.base.HookContext`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from fedreid.config import Config, ConfigError
from fedreid.data.partition import class_counts
from fedreid.data.prepared import PreparedDataset, Record, load_prepared
from fedreid.data.scenarios import ClientSplit, build_clients, by_dataset
from fedreid.fl import classification as classification_task
from fedreid.fl.classification import AccuracyEvaluator, ClassificationClient
from fedreid.fl.client import Client, PublicLoaders, check_split
from fedreid.fl.evaluation import Evaluator
from fedreid.fl.local.objectives import objective_options
from fedreid.fl.server import Server
from fedreid.fl.server_hooks import HookContext, ServerHook, hook_class
from fedreid.options import build_options
from fedreid.utils.precision import resolve_precision, set_tf32
from fedreid.utils.seeding import derive_seed, numpy_rng


def resolve_device(name: str) -> torch.device:
    """``run.device`` as a torch device (``auto``: CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def configure_device(cfg: Config, device: torch.device) -> None:
    """Process-wide settings of ``device`` for this run: TF32 on CUDA as ``train.tf32`` says."""
    if device.type == "cuda":
        set_tf32(cfg.train.tf32)


@dataclass
class Federation:
    """Everything a simulated run is made of."""

    cfg: Config
    device: torch.device
    splits: list[ClientSplit]
    clients: list[Client]
    server: Server
    work_model: nn.Module
    evaluator: Optional[Any]
    datasets: dict[str, PreparedDataset] = field(default_factory=dict)
    #: Classification: samples per (client, class) of the partition (drawn as a heat-map).
    class_counts: Optional[np.ndarray] = None


#: ``federation = builder(cfg, datasets=...)`` by ``task`` name.
TaskBuilder = Callable[..., Federation]
TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator: ``builder(cfg, *, datasets=None) -> Federation`` builds federations of ``task: name``."""

    def add(builder: TaskBuilder) -> TaskBuilder:
        TASKS[name] = builder
        return builder

    return add


def build_federation(cfg: Config, *, datasets: Optional[Mapping[str, PreparedDataset]] = None) -> Federation:
    """The federation of ``cfg`` (its task's registered builder); nothing is trained yet."""
    try:
        builder = TASKS[cfg.task]
    except KeyError:
        raise ConfigError(f"task: no federation builder for {cfg.task!r}; registered: {', '.join(TASKS)}") from None
    return builder(cfg, datasets=datasets)


# ----------------------------------------------------------------- server hooks


def needs_public_set(cfg: Config) -> bool:
    """Whether one of the run's server hooks works on the unlabeled public set (KD)."""
    return any(hook_class(name).needs_public_set for name, _ in cfg.hook_specs())


def public_dataset_name(cfg: Config) -> Optional[str]:
    """The public set's dataset: the KD hook's ``public_dataset``, else ``data.public_dataset``."""
    kd = cfg.hook_settings("kd")
    return (kd.public_dataset if kd is not None else None) or cfg.fl.public_dataset or cfg.data.public_dataset


def build_server_hooks(cfg: Config, context: HookContext) -> list[ServerHook]:
    """The run's server hooks (``cfg.hook_specs()``), each built from its typed options and ``context``."""
    hooks = []
    for i, (name, values) in enumerate(cfg.hook_specs()):
        cls = hook_class(name)
        options = build_options(cls.Options, {**cls.context_defaults(context), **values}, f"fl.hooks[{i}]",
                                f"server hook {name!r}")
        hooks.append(cls.build(options, context))
    return hooks


def hook_context(cfg: Config, num_clients: int, device: torch.device, **known: Any) -> HookContext:
    """A :class:`HookContext` of this run; ``known``: what the task adds (classes, image size, public set)."""
    return HookContext(cfg=cfg, num_clients=num_clients, device=device, seed=cfg.seed,
                       objective=objective_options(cfg.train.objective, cfg.train.objective_options),
                       **{"num_classes": 0, **known})


# ----------------------------------------------------------------- the reid task


def load_datasets(cfg: Config) -> dict[str, PreparedDataset]:
    """The prepared datasets the clients train on."""
    return {name: load_prepared(cfg.data.prepared_root, name) for name in scenario_datasets(cfg)}


def scenario_datasets(cfg: Config) -> list[str]:
    """The prepared datasets the scenario reads: ``data.datasets`` (a leave-one-out target included),
    or the one dataset that ``by_camera`` / ``by_identity`` split."""
    if cfg.scenario.kind in ("by_camera", "by_identity") and cfg.scenario.dataset:
        return [cfg.scenario.dataset]
    return cfg.data.dataset_names()


def client_datasets(cfg: Config) -> list[str]:
    """One client per dataset (``by_dataset``, ``leave_one_out``): the datasets that train, in client order."""
    names = cfg.data.dataset_names()
    return [n for n in names if n != cfg.scenario.target] if cfg.scenario.kind == "leave_one_out" else names


def evaluated_datasets(cfg: Config, trained: Sequence[str]) -> list[str]:
    """The datasets a ReID run evaluates on, the global model and each client's own (``eval.local_models``).

    ``eval.datasets`` when set; else under ``leave_one_out`` the target alone
    (Protocol-1: the unseen domain only); else ``trained``, the datasets the
    clients train on, once each in order. A client's model is evaluated on its
    own dataset only when that dataset is in this list, in a simulation and on
    a Flower node alike.
    """
    if cfg.eval.datasets is not None:
        return list(cfg.eval.datasets)
    if cfg.scenario.kind == "leave_one_out":
        return [cfg.scenario.target]
    return list(dict.fromkeys(trained))


def check_public_set(cfg: Config) -> None:
    """Refuse a KD public set that is the leave-one-out target: it would show the model the unseen domain."""
    if cfg.scenario.kind != "leave_one_out" or not needs_public_set(cfg):
        return
    if public_dataset_name(cfg) == cfg.scenario.target:
        raise ConfigError(f"fl.public_dataset: the public set for KD is {cfg.scenario.target!r}, the "
                          "leave_one_out target, which no client may see; choose another public dataset")


def public_records(cfg: Config) -> list[Record]:
    """The unlabeled public set's images (its ``train_all`` split, else all of it)."""
    name = public_dataset_name(cfg)
    if not name:
        raise ConfigError("fl.public_dataset: KD needs a public dataset (set fl.public_dataset or data.public_dataset)")
    ds = load_prepared(cfg.data.prepared_root, name)
    records = ds.split("train_all") or list(ds.records)
    if not records:
        raise ConfigError(f"fl.public_dataset: the public dataset {name!r} has no images")
    return records


@register_task("reid")
def build_reid_federation(
    cfg: Config, *, datasets: Optional[Mapping[str, PreparedDataset]] = None
) -> Federation:
    """Datasets -> client splits -> clients, global ReID model, server (nothing trained yet)."""
    check_public_set(cfg)
    device = resolve_device(cfg.run.device)
    configure_device(cfg, device)
    datasets = dict(datasets) if datasets is not None else load_datasets(cfg)
    splits = build_clients(cfg.scenario, datasets, numpy_rng(cfg.data.split_seed, "scenario"))
    public = public_records(cfg) if needs_public_set(cfg) else None
    clients = [Client(split, k, cfg, public_records=public, device=device) for k, split in enumerate(splits)]

    num_classes = 0
    if cfg.fl.aggregation == "fedavg":
        sizes = {c.num_classes for c in clients}
        if len(sizes) != 1:
            raise ConfigError(
                "fl.aggregation: fedavg averages the identity heads too, which needs the same number "
                f"of classes on every client (got {sorted(sizes)}); use fedpav"
            )
        num_classes = sizes.pop()
    global_model = reid_model(cfg, num_classes, device)
    work_model = copy.deepcopy(global_model)

    eval_names = evaluated_datasets(cfg, [s.dataset for s in splits])
    unknown = [n for n in eval_names if n not in datasets]
    if unknown:
        datasets.update({n: load_prepared(cfg.data.prepared_root, n) for n in unknown})
    evaluator = Evaluator.from_config(cfg, {n: datasets[n] for n in eval_names}, device) if eval_names else None

    known: dict[str, Any] = {"num_classes": num_classes, "image_size": (cfg.model.height, cfg.model.width),
                             "image_channels": 3}
    if public is not None:
        precision = resolve_precision(cfg.train.precision, device, channels_last=cfg.train.channels_last)
        known["public_loader"] = PublicLoaders(public, cfg, device=device, precision=precision).loader
        known["public_size"] = len(public)
    hooks = build_server_hooks(cfg, hook_context(cfg, len(clients), device, **known))
    server = Server(cfg, global_model, [c.name for c in clients], hooks=hooks, evaluator=evaluator)
    return Federation(cfg, device, splits, clients, server, work_model, evaluator, datasets)


def reid_model(cfg: Config, num_classes: int, device: torch.device) -> nn.Module:
    """The global ReID model of ``cfg.model`` (seeded), in eval mode on ``device``."""
    from fedreid.models.backbones import BackboneError
    from fedreid.models.factory import REID_PREFIX, create_model

    m = cfg.model
    try:
        model = create_model(
            REID_PREFIX + m.backbone, num_classes=num_classes, pretrained=m.pretrained, last_stride=m.last_stride,
            bottleneck_dim=m.bottleneck_dim, dropout=m.dropout, seed=derive_seed(cfg.seed, "model"),
        ).to(device)
    except BackboneError as exc:
        raise ConfigError(f"model.backbone={m.backbone}, model.last_stride={m.last_stride}: {exc}") from None
    return model.eval()


def check_model_name(cfg: Config) -> None:
    """Refuse an unknown ``model.backbone`` of a ReID run before any data is read or folder made.

    Raises :class:`~fedreid.config.ConfigError` listing close timm names.
    (Classification names are checked when the model is built.)
    """
    if cfg.task != "reid":
        return
    import timm

    from fedreid.models.backbones import close_model_names

    if not timm.is_model(cfg.model.backbone):
        close = close_model_names(cfg.model.backbone)
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise ConfigError(f"model.backbone: unknown backbone {cfg.model.backbone!r} (not a timm model){hint}")


def build_client(cfg: Config, name: str) -> tuple[Client, nn.Module]:
    """The client ``name`` and a work model, as the machine that holds its data builds them.

    With one client per dataset (the ReID benchmark) only that dataset is read;
    the other scenarios split one dataset, which that machine then holds. The
    client's index, and so its seeds, are its position in the whole federation,
    so it trains exactly as in a simulation of the same config.
    """
    if cfg.task == "reid" and cfg.scenario.kind in ("by_dataset", "leave_one_out"):
        names = client_datasets(cfg)
        if name not in names:
            raise ConfigError(f"client {name!r} is not one of the client datasets ({', '.join(names)})")
        check_public_set(cfg)
        split = by_dataset([load_prepared(cfg.data.prepared_root, name)], cfg.scenario.train_split)[0]
        device = resolve_device(cfg.run.device)
        configure_device(cfg, device)
        public = public_records(cfg) if needs_public_set(cfg) else None
        client = Client(split, names.index(name), cfg, public_records=public, device=device)
        num_classes = client.num_classes if cfg.fl.aggregation == "fedavg" else 0
        return client, reid_model(cfg, num_classes, device)
    fed = build_federation(cfg)
    by_name = {c.name: c for c in fed.clients}
    if name not in by_name:
        raise ConfigError(f"client {name!r} is not in this federation ({', '.join(by_name)})")
    return by_name[name], fed.work_model


# ----------------------------------------------------------------- the classification task


@register_task("classification")
def build_classification_federation(cfg: Config, *, datasets: Any = None) -> Federation:
    """Data -> partition -> clients, global classifier, server, evaluator (nothing trained yet).

    ``datasets`` is unused: the data comes from ``classification.*``
    (:func:`fedreid.fl.classification.load_train_test`).
    """
    from fedreid.models.classifiers import UnknownModelError
    from fedreid.models.factory import CLASSIFIER_PREFIX, create_model

    device = resolve_device(cfg.run.device)
    configure_device(cfg, device)
    # Looked up on the module at call time, so a test or an extension may substitute either.
    train, test = classification_task.load_train_test(cfg)
    splits = classification_task.partition_clients(cfg, train)
    clients = [ClassificationClient(split, k, cfg, train, device=device) for k, split in enumerate(splits)]
    height, width = train.images.shape[1:3]
    try:
        model = create_model(
            CLASSIFIER_PREFIX + cfg.model.backbone, num_classes=train.num_classes, in_channels=train.channels,
            image_size=(height, width), seed=derive_seed(cfg.seed, "model"), pretrained=cfg.model.pretrained,
        ).to(device)
    except UnknownModelError as exc:
        raise ConfigError(f"model.backbone: {exc}") from None
    model.eval()
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        for split in splits:
            check_split(split, cfg.train.batch_size, cfg.train.drop_last, batch_norm=True)
    evaluator = AccuracyEvaluator(test, batch_size=cfg.eval.batch_size, device=device)
    context = hook_context(cfg, len(clients), device, num_classes=train.num_classes,
                           image_size=(int(height), int(width)), image_channels=train.channels)
    hooks = build_server_hooks(cfg, context)
    server = Server(cfg, model, [c.name for c in clients], hooks=hooks, evaluator=evaluator)
    fed = Federation(cfg, device, splits, clients, server, copy.deepcopy(model), evaluator, {})
    fed.class_counts = class_counts(train.labels, [np.asarray(s.records) for s in splits], train.num_classes)
    return fed


__all__ = [
    "TASKS",
    "Federation",
    "build_classification_federation",
    "build_client",
    "build_federation",
    "build_reid_federation",
    "build_server_hooks",
    "check_model_name",
    "check_public_set",
    "client_datasets",
    "evaluated_datasets",
    "hook_context",
    "load_datasets",
    "needs_public_set",
    "public_dataset_name",
    "public_records",
    "scenario_datasets",
    "register_task",
    "reid_model",
    "resolve_device",
]
