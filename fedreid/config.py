"""Typed experiment configuration: dataclasses, YAML files, command-line overrides.

A config is a tree of dataclasses. It is built from defaults, then a YAML file,
then ``key.sub=value`` overrides, in that order::

    cfg = load_config("configs/fedreid/demo_synthetic.yaml", ["data.datasets=[market1501,viper]", "seed=3"])

Every key is checked: an unknown key, a value of the wrong type, or a value
outside the allowed set is a :class:`ConfigError` naming the full key, what was
given and what is allowed. Override values are parsed as YAML scalars/lists
(``true``, ``3``, ``0.5``, ``[a, b]``, ``null``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import yaml

from fedreid.data.benchmark import BENCHMARK_DATASETS
from fedreid.options import (
    ConfigError,
    check_positive,
    check_range,
    did_you_mean,
    dump_options,
    from_dict,
    to_dict,
)
from fedreid.utils.cli import override_value

#: Kept under their old names for callers of this module.
_check_positive, _check_range, dump_config = check_positive, check_range, dump_options


# ---------------------------------------------------------------------------
# The configuration tree
# ---------------------------------------------------------------------------

@dataclass
class DataConfig:
    """Where datasets live and how they are prepared."""

    #: Folder of the raw releases, one sub-folder per dataset (``tools/prepare_datasets.py`` reads it,
    #: never writes it).
    raw_root: str = "datasets/raw"
    #: Folder of the prepared datasets (``manifest.csv`` + images per dataset), written by ``prepare``.
    prepared_root: str = "datasets/prepared"
    #: Datasets to prepare / train on (registry names); ``all`` means the nine.
    datasets: list[str] = field(default_factory=lambda: list(BENCHMARK_DATASETS))
    #: The unlabeled public set for knowledge distillation (prepared too).
    public_dataset: Optional[str] = "cuhk02"
    #: ``raw``: official releases; ``fedreid``: the benchmark's processed folders.
    layout: Literal["raw", "fedreid"] = "raw"
    #: Resize prepared images to ``[height, width]`` (OpenCV bicubic, as the loaders; JPEG re-encoded at
    #: quality 95 without chroma subsampling, other formats as PNG); null keeps the source bytes, as the reference.
    resize: Optional[list[int]] = None
    #: Seed of the identity splits that the releases do not fix.
    split_seed: int = 0
    #: Per-dataset identity split files (``{name: path}``) overriding the seeded split.
    split_files: dict[str, str] = field(default_factory=dict)
    #: Per-dataset parser options, e.g. ``{cuhk03np: {boxes: labeled}}``.
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Parallel workers that copy and check images.
    workers: int = 2

    def dataset_names(self) -> list[str]:
        """``datasets`` with ``all`` expanded to the nine benchmark datasets."""
        return list(BENCHMARK_DATASETS) if self.datasets == ["all"] else list(self.datasets)

    def validate(self, prefix: str) -> None:
        if self.resize is not None and (
            len(self.resize) != 2 or min(self.resize) <= 0
        ):
            raise ConfigError(
                f"{prefix}.resize: expected [height, width] with positive values or null, "
                f"got {self.resize!r}"
            )
        _check_positive(f"{prefix}.workers", self.workers)
        if not self.datasets:
            raise ConfigError(f"{prefix}.datasets: expected at least one dataset name")
        self._check_per_dataset_keys(prefix)

    def _check_per_dataset_keys(self, prefix: str) -> None:
        """Keys of ``split_files`` / ``options`` must be registered datasets, options real ones.

        A typo here would otherwise be silently ignored (a split file never
        used) or fail late as ``__init__() got an unexpected keyword argument``.
        """
        if not self.split_files and not self.options:
            return  # the common case needs no parser imports
        # Imported here: only a config with per-dataset keys needs the parser registry.
        from fedreid.data.raw import check_parser_options, list_raw_datasets

        known = list_raw_datasets()
        for section, mapping in (("split_files", self.split_files), ("options", self.options)):
            for name in mapping:
                if name not in known:
                    raise ConfigError(
                        f"{prefix}.{section}.{name}: unknown dataset {name!r}; "
                        f"allowed names: {', '.join(known)}"
                    )
        for name, options in self.options.items():
            check_parser_options(name, options, layout=self.layout, where=f"{prefix}.options.{name}")


@dataclass
class SyntheticConfig:
    """The synthetic multi-domain ReID world (:mod:`fedreid.data.synthetic`)."""

    #: Raw root the synthetic releases are written to.
    root: str = "datasets/raw/synthetic"
    #: Fraction of each real dataset's identity count.
    id_scale: float = 0.02
    #: Fewest identities of any dataset, however small ``id_scale``.
    min_ids: int = 12
    #: Most images of one identity in one camera.
    images_per_camera: int = 2
    #: Height of the rendered images in pixels.
    height: int = 64
    #: Width of the rendered images in pixels.
    width: int = 32
    #: Seed of the synthetic world (identities, cameras, images).
    seed: int = 0

    def validate(self, prefix: str) -> None:
        if not 0 < self.id_scale <= 1:
            raise ConfigError(f"{prefix}.id_scale: expected 0 < value <= 1, got {self.id_scale}")
        for name in ("min_ids", "images_per_camera", "height", "width"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))


@dataclass
class ScenarioConfig:
    """How prepared datasets become federated clients (:mod:`fedreid.data.scenarios`)."""

    #: ``by_dataset``: one client per dataset (Sec. 4.2); ``by_camera``: one per
    #: camera of ``dataset``; ``by_identity``: ``dataset`` split into
    #: ``num_clients`` with disjoint identities (Sec. 4.1, Table 2);
    #: ``leave_one_out``: one client per dataset of ``data.datasets`` except
    #: ``target``, evaluated on ``target`` only (FedDG-ReID Protocol-1).
    kind: Literal["by_dataset", "by_camera", "by_identity", "leave_one_out"] = "by_dataset"
    #: The dataset that ``by_camera`` / ``by_identity`` split into clients.
    dataset: Optional[str] = None
    #: ``leave_one_out``: the unseen dataset (one of ``data.datasets``); no client
    #: trains on it and the evaluation uses only it unless ``eval.datasets`` says otherwise.
    target: Optional[str] = None
    #: Clients of ``by_identity``; null: the dataset's camera count in the
    #: training split, as the paper (Sec. 4.1: "equal to the number of camera views").
    num_clients: Optional[int] = None
    #: ``by_identity``: every client gets exactly ``n_ids // num_clients``
    #: identities and the remainder is left out (Sec. 4.1: "each of them has the
    #: same number of identities", Market-1501: 6 x 125 of 751; the reference's
    #: ``split_id_data.py`` does the same); false: near-equal groups, none left out.
    equal_groups: bool = True
    #: The split each client trains on.
    train_split: Literal["train_all", "train"] = "train_all"

    def validate(self, prefix: str) -> None:
        if self.kind == "leave_one_out":
            if not self.target:
                raise ConfigError(f"{prefix}.target: scenario kind 'leave_one_out' needs the unseen target "
                                  "dataset (one of data.datasets)")
        elif self.target:
            raise ConfigError(f"{prefix}.target: only scenario kind 'leave_one_out' has a target, "
                              f"got kind {self.kind!r}")
        if self.kind in ("by_camera", "by_identity") and not self.dataset:
            raise ConfigError(
                f"{prefix}.dataset: scenario kind {self.kind!r} needs the dataset to split"
            )
        if self.num_clients is not None and self.num_clients < 2:
            raise ConfigError(
                f"{prefix}.num_clients: by_identity needs at least 2 clients (or null: the "
                f"dataset's camera count), got {self.num_clients}"
            )


@dataclass
class ModelConfig:
    """The ReID model (:mod:`fedreid.models.reid`): backbone -> bottleneck -> private head."""

    #: A timm model name (``resnet50``, the paper's; ``resnet18``, ``mobilenetv2_100``...);
    #: classification: a model of :mod:`fedreid.models.classifiers` (``cnn_lmd``, ``resnet18``...).
    backbone: str = "resnet50"
    #: Local weights file for the backbone (no download); null starts from random init.
    pretrained: Optional[str] = None
    #: Stride of the last stage; the reference trains with 2 (``--stride`` default).
    last_stride: int = 2
    #: Width of the bottleneck (the embedding used for retrieval; 512 in the paper).
    bottleneck_dim: int = 512
    #: Dropout before the identity head (0.5 in the reference).
    dropout: float = 0.5
    #: Input height in pixels (256 in the paper).
    height: int = 256
    #: Input width in pixels (128 in the paper).
    width: int = 128

    def validate(self, prefix: str) -> None:
        if self.last_stride not in (1, 2):
            raise ConfigError(f"{prefix}.last_stride: expected 1 or 2, got {self.last_stride}")
        for name in ("bottleneck_dim", "height", "width"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{prefix}.dropout: expected 0 <= value < 1, got {self.dropout}")


@dataclass
class TrainConfig:
    """Local training of one client in one round (:mod:`fedreid.fl.local.sgd`)."""

    #: Local epochs per round (E; 1 in FedPav's benchmark, Table 4 varies it).
    local_epochs: int = 1
    #: Local batch size (B; 32 in the benchmark).
    batch_size: int = 32
    #: Learning rate of the bottleneck and the identity head.
    lr: float = 0.05
    #: Backbone learning rate = ``lr * lr_backbone_ratio`` (0.005 in the paper).
    lr_backbone_ratio: float = 0.1
    #: SGD momentum of the client optimizer.
    momentum: float = 0.9
    #: SGD weight decay of the client optimizer.
    weight_decay: float = 5e-4
    #: Nesterov momentum (the reference client uses it).
    nesterov: bool = True
    #: StepLR of the reference client, recreated every round (see ``fl/local/sgd.py``);
    #: ReID only: task=classification refuses a step it would reach.
    lr_step_size: int = 40
    #: StepLR decay factor (every ``lr_step_size`` epochs of a round).
    lr_gamma: float = 0.1
    #: Learning rate of round ``t`` (0-based) = ``lr * lr_round_decay ** t`` (FedLMD: 0.99,
    #: FedDyn/FedFTG code: 0.998); 1 keeps it constant (FedPav).
    lr_round_decay: float = 1.0
    #: Clip the gradient's global L2 norm to this value before each optimizer step
    #: (after an objective's gradient corrections); null: no clipping. The official
    #: FedFTG code clips at 10 in every client trainer (ZhangLin-PKU/FedFTG,
    #: methods/local_fn_gan.py: max_norm); the paper does not mention it.
    clip_grad_norm: Optional[float] = None
    #: DataLoader workers per client.
    workers: int = 0
    #: Keep a client's loader workers alive across its epochs and rounds (with
    #: ``workers > 0``); every epoch is reseeded as a fresh loader would be, so the
    #: order and the augmentations do not depend on it.
    persistent_workers: bool = True
    #: Where images are normalised (and randomly erased): ``worker`` (the loader
    #: workers hand over float32 tensors), ``device`` (they hand over uint8 pixels and
    #: the training device normalises the batch, which takes work off the workers),
    #: ``auto`` (``device`` on CUDA, ``worker`` elsewhere). Both give the same tensors
    #: bit for bit (:class:`fedreid.data.transforms.BatchNormalize`).
    normalize_on: Literal["auto", "worker", "device"] = "auto"
    #: Arithmetic of local training, CDW, KD and the server's generators:
    #: ``auto`` (bf16 autocast on a CUDA card that supports it, fp32 elsewhere),
    #: ``fp32``, ``bf16`` (autocast; also on the CPU), ``fp16`` (autocast + GradScaler,
    #: CUDA only). Parameters, optimizer state, aggregation and checkpoints stay fp32.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    #: Channels-last memory layout for conv nets on CUDA (ignored on the CPU).
    channels_last: bool = True
    #: TF32 tensor cores for fp32 matmuls and convolutions on CUDA (fp32 precision only).
    tf32: bool = False
    #: Replay the backbone's forward and backward of a full local-training batch as a
    #: CUDA graph (one launch instead of about a thousand; the same numbers as eager).
    #: CUDA only, ignored elsewhere; turn it off for a backbone that cannot be captured.
    cuda_graphs: bool = True
    #: Probability of random erasing of a training image (0: off).
    random_erasing: float = 0.0
    #: Strength of colour jitter on training images (0: off).
    color_jitter: float = 0.0
    #: Skip each epoch's last partial batch, as the FedReID reference client does;
    #: the classification configs set false, since their clients are often smaller than a batch.
    drop_last: bool = True
    #: Client objective (:mod:`fedreid.fl.local.objectives`): ``fedavg`` (plain
    #: cross-entropy, FedPav's client) or another registered one (``fedprox``,
    #: ``scaffold``, ``feddyn``, ``moon``, ``fedntd``, ``fedlmd``...: every one under "Client objectives").
    objective: str = "fedavg"
    #: Keyword options of the objective, e.g. ``{mu: 0.01}`` (FedProx), ``{alpha: 0.01}``
    #: (FedDyn), ``{tau: 0.5, mu: 5}`` (MOON); FedLMD's class counts come from the client's data.
    objective_options: dict[str, Any] = field(default_factory=dict)

    def validate(self, prefix: str) -> None:
        _check_objective(prefix, self.objective, self.objective_options)
        for name in ("local_epochs", "batch_size", "lr", "lr_step_size"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))
        for name in ("lr_backbone_ratio", "lr_gamma", "lr_round_decay"):
            _check_range(f"{prefix}.{name}", getattr(self, name), 0, 1, low_open=True)
        for name in ("momentum", "random_erasing", "color_jitter"):
            _check_range(f"{prefix}.{name}", getattr(self, name), 0, 1)
        if not self.weight_decay >= 0:
            raise ConfigError(f"{prefix}.weight_decay: expected a value >= 0, got {self.weight_decay}")
        if self.clip_grad_norm is not None:
            _check_positive(f"{prefix}.clip_grad_norm", self.clip_grad_norm)
        if self.workers < 0:
            raise ConfigError(f"{prefix}.workers: expected a value >= 0, got {self.workers}")


def _check_objective(prefix: str, name: str, options: Mapping[str, Any]) -> None:
    """``options`` must build the objective's typed ``Options`` (:func:`fedreid.fl.local.objectives.objective_options`)."""
    from fedreid.fl.local.objectives import objective_class, objective_options

    objective_class(name, where=f"{prefix}.objective")
    objective_options(name, options, where=f"{prefix}.objective_options")


@dataclass
class FLConfig:
    """Server, aggregation and server hooks (:mod:`fedreid.fl`)."""

    #: ``federated``: FedPav rounds; ``local``: every client trains alone and is evaluated on its
    #: own dataset (the ReID baseline; refused with ``task=classification``, which has no per-client test data).
    mode: Literal["federated", "local"] = "federated"
    #: Communication rounds (T; 300 in the benchmark).
    rounds: int = 300
    #: Clients sampled per round; 0 means all (the benchmark: all 9 every round).
    clients_per_round: int = 0
    #: The fewest usable updates for a round to count. Across machines a client
    #: may be lost or send a malformed update (rejected, logged); the round then
    #: completes with the others if at least this many remain, else it fails.
    min_clients: int = 1
    #: ``fedpav``: identity heads stay private; ``fedavg``: the whole model is
    #: averaged (needs the same number of classes on every client).
    aggregation: Literal["fedpav", "fedavg"] = "fedpav"
    #: Aggregation weights: ``size`` (``n_k / n``, FedAvg/FedPav) or ``uniform``
    #: (``1 / |S_t|``, FedLMD Alg. 1 line 12, FedFTG Alg. 2 line 1).
    weighting: Literal["size", "uniform"] = "size"
    #: Server step size ``eta_g`` (FedFTG Alg. 2 line 1): ``w <- w + eta_g (avg - w)``
    #: on the trainable parameters; 1 takes the average. SCAFFOLD's server uses it as its ``eta_g``.
    server_lr: float = 1.0
    #: BatchNorm running statistics: ``average`` (weighted like the parameters),
    #: ``first`` (copied from the first sampled client, as the reference code),
    #: ``local`` (averaged for the server's model, each client keeps its own).
    bn: Literal["average", "first", "local"] = "average"
    #: Cosine-distance weights (Algorithm 3) instead of sample counts.
    cdw: bool = False
    #: ``eval``: CDW logits in eval mode; ``train``: both models in train mode, as the reference
    #: mostly; ``official``: the reference's modes exactly (the received model in eval mode in
    #: round 0 and in each round after an evaluation, ``fedreid.fl.aggregate.cdw_start_in_eval``).
    cdw_mode: Literal["eval", "train", "official"] = "eval"
    #: Public-set knowledge distillation on the server (Algorithm 2).
    kd: bool = False
    #: KD after rounds ``kd_every``, ``2 kd_every``, ... (Algorithm 2 line 12 distils in every
    #: round: 1; the official code, ``main.py:train``: 10).
    kd_every: int = 1
    #: Learning rate of the server's distillation pass (the reference: 5e-4).
    kd_lr: float = 5e-4
    #: Batch size of the public-set loaders.
    kd_batch_size: int = 32
    #: Normalise the student's features before the MSE (the reference does not).
    kd_student_normalize: bool = False
    #: Where the paper is silent on how teachers and student see the public set
    #: (:mod:`fedreid.fl.server_hooks.kd`): ``eval``: teacher features in eval
    #: mode on test-transformed images, the student trains on those images;
    #: ``train``: as the reference code, teachers in train mode (dropout,
    #: batch-statistics BatchNorm) on train-augmented images, in the same
    #: shuffled batches the student then trains on.
    kd_mode: Literal["eval", "train"] = "eval"
    #: The unlabeled public set; null means ``data.public_dataset``.
    public_dataset: Optional[str] = None
    #: FedFTG data-free server fine-tuning after every aggregation (classification).
    fedftg: bool = False
    #: FedFTG options (:class:`fedreid.fl.server_hooks.fedftg.FedFTGConfig`), e.g.
    #: ``{iterations: 10, hard_sample_mining: false}``; image size and channels come from the data.
    fedftg_options: dict[str, Any] = field(default_factory=dict)
    #: Server hooks, run in this order after the client objective's own server half:
    #: ``[{name: kd, every: 2}, {name: fedavgm, momentum: 0.9}]``; each entry is the
    #: hook's registry name and its options (``docs/configuration.md`` lists them).
    #: ``kd: true`` and ``fedftg: true`` above are shorthands for a ``kd`` / ``fedftg`` entry.
    hooks: list[dict[str, Any]] = field(default_factory=list)

    def validate(self, prefix: str) -> None:
        _check_positive(f"{prefix}.rounds", self.rounds)
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ConfigError(f"{prefix}.server_lr: expected a finite positive step size, got {self.server_lr}")
        if self.fedftg_options:
            _check_hook("fedftg", self.fedftg_options, f"{prefix}.fedftg_options")
        for i, entry in enumerate(self.hooks):
            if not isinstance(entry.get("name"), str):
                raise ConfigError(f"{prefix}.hooks[{i}]: expected a mapping with the hook's name, got {entry!r}")
            _check_hook(entry["name"], {k: v for k, v in entry.items() if k != "name"}, f"{prefix}.hooks[{i}]")
        if self.clients_per_round < 0:
            raise ConfigError(
                f"{prefix}.clients_per_round: expected 0 (all) or a positive count, "
                f"got {self.clients_per_round}"
            )
        for name in ("kd_every", "kd_lr", "kd_batch_size", "min_clients"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.mode == "local" and (self.cdw or self.kd):
            which = "cdw" if self.cdw else "kd"
            raise ConfigError(
                f"{prefix}.{which}: the local-training baseline (mode=local) has no aggregation; "
                f"set {prefix}.{which}=false or {prefix}.mode=federated"
            )


def _check_hook(name: str, options: Mapping[str, Any], where: str) -> None:
    """``options`` must build hook ``name``'s typed ``Options`` (:func:`fedreid.fl.server_hooks.hook_options`)."""
    from fedreid.fl.server_hooks import hook_options

    try:
        hook_options(name, options, where=where)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # an Options.__post_init__ refusing a value
        raise ConfigError(f"{where}: {exc}") from None


@dataclass
class EvalConfig:
    """Evaluation during training (:mod:`fedreid.fl.evaluation`)."""

    #: Evaluate every this many rounds (and always after the last round).
    every: int = 10
    #: ``standard`` AP (torchreid) or ``official`` (Market-1501 MATLAB trapezoid AP).
    ap: Literal["standard", "official"] = "standard"
    #: AP forms computed besides ``ap`` and recorded as ``mAP_<form>`` (a form
    #: equal to ``ap`` is skipped): by default the official one, averaged over all
    #: queries as the reference evaluation does, shown next to the standard mAP.
    extra_ap: list[Literal["standard", "official"]] = field(default_factory=lambda: ["official"])
    #: CMC ranks reported (``rank1``, ``rank5``, ...).
    ranks: list[int] = field(default_factory=lambda: [1, 5, 10])
    #: Also evaluate each client's model before aggregation on its own dataset.
    local_models: bool = True
    #: In an evaluation round, also evaluate the aggregated model before the server
    #: hooks train it (KD on its rounds, FedFTG, FedDF), recorded as
    #: ``eval_before_hooks``: the official FedReID ``main.py:train`` tests the model
    #: before and after ``knowledge_distillation``. Off: one evaluation, after the hooks.
    before_hooks: bool = False
    #: Batch size of feature extraction during evaluation.
    batch_size: int = 128
    #: Average the features of the image and its horizontal flip.
    flip: bool = True
    #: Datasets to evaluate on; null means every training dataset.
    datasets: Optional[list[str]] = None
    #: Arithmetic of evaluation's feature extraction (ReID): ``fp32`` (the papers'
    #: protocol), ``bf16`` (autocast; also on the CPU, slowly), ``fp16`` (autocast,
    #: CUDA only), ``auto`` (bf16 on a CUDA card that supports it, fp32 elsewhere).
    #: With bf16/fp16 on CUDA the model and images are also channels-last. Mixed
    #: precision moves every feature by its rounding, so a ranking may change; the
    #: features are ranked in fp32.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    #: Loader workers of evaluation (kept across evaluations with
    #: ``train.persistent_workers``); null: ``train.workers`` times
    #: ``run.concurrent_clients``, at most the CPU count (the training loaders idle
    #: while the server evaluates). Speed only: the features do not depend on it.
    workers: Optional[int] = None

    def validate(self, prefix: str) -> None:
        for name in ("every", "batch_size"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))
        if not self.ranks or min(self.ranks) < 1:
            raise ConfigError(f"{prefix}.ranks: expected positive ranks, got {self.ranks!r}")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"{prefix}.workers: expected a value >= 0 or null, got {self.workers}")


@dataclass
class RunConfig:
    """Where a run writes and what it runs on."""

    #: The run folder (``--out`` of the tools); a new or empty folder, or one this tool made.
    out_dir: str = "runs/fedreid"
    #: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Deterministic algorithms (bit-exact resume on CPU; slower on GPU).
    deterministic: bool = True
    #: Also write TensorBoard scalars when ``tensorboard`` is installed.
    tensorboard: bool = True
    #: Clients of a round trained at once (simulation): each in its own worker
    #: process with its own work model (and CUDA context); every update equals
    #: its sequential one. 1: one client after another in this process.
    concurrent_clients: int = 1

    def validate(self, prefix: str) -> None:
        if not self.out_dir:
            raise ConfigError(f"{prefix}.out_dir: expected a folder path")
        if self.concurrent_clients < 1:
            raise ConfigError(f"{prefix}.concurrent_clients: expected a value >= 1, got {self.concurrent_clients}")


@dataclass
class ClassificationConfig:
    """The classification track (``task: classification``; :mod:`fedreid.fl.classification`).

    A dataset read from local files (:mod:`fedreid.data.classification`) is
    partitioned over ``num_clients`` clients (:mod:`fedreid.data.partition`);
    the global model is evaluated by its accuracy on the test split.
    """

    #: ``digits`` (bundled with scikit-learn), ``fashion_mnist``, ``mnist``,
    #: ``cifar10``, ``cifar100``, ``imagefolder``.
    dataset: str = "digits"
    #: Folder of the dataset files; null: the dataset's default (Fashion-MNIST:
    #: Debian's /usr/share/datasets/fashion-mnist; digits needs none).
    root: Optional[str] = None
    #: How the training split is divided: ``iid``, ``dirichlet`` (per class over clients),
    #: ``dirichlet_prior`` (per client over classes, FedFTG Sec. 4.1), ``shards`` (label-sorted
    #: shards, McMahan et al. as FedLMD Sec. 5.1 cites), ``shards_per_class`` (one-class shards,
    #: the sharding of FedNTD's and FedLMD's official code).
    partition: Literal["iid", "dirichlet", "dirichlet_prior", "shards", "shards_per_class"] = "dirichlet"
    #: Number of clients the training split is divided into.
    num_clients: int = 10
    #: Dirichlet concentration: alpha of ``dirichlet`` (per class over clients),
    #: beta of ``dirichlet_prior`` (per client over classes).
    alpha: float = 0.5
    #: ``dirichlet``: redraw until every client has at least this many samples
    #: (NIID-Bench's and FedNTD's ``min_require_size`` 10; at most
    #: ``1 + max_retries`` draws, then an error names the value that succeeds).
    min_size: int = 10
    #: ``dirichlet``: redraws after the first before giving up.
    max_retries: int = 100
    #: ``shards`` and ``shards_per_class``: shards each client gets (FedLMD's s).
    shards_per_client: int = 2
    #: ``dirichlet_prior``: lognormal sigma of the client sizes (0: equal sizes).
    unbalanced_sigma: float = 0.0
    #: Relative noise on the class counts clients report (FedFTG discusses <= 0.1).
    count_noise: float = 0.0
    #: ``digits``: share of each class held out for testing.
    test_fraction: float = 0.2
    #: Seed of the partition and the digits split.
    split_seed: int = 0
    #: Train on a class-stratified subset of this many training images, drawn with
    #: ``split_seed`` (a CPU budget; the test split stays whole); null: all of it.
    train_subset: Optional[int] = None
    #: Training-image augmentation (:func:`fedreid.data.transforms.build_classification_augment`;
    #: the test split is never augmented). ``auto``: the dataset's default,
    #: ``crop_flip`` for RGB (cifar10, cifar100, RGB imagefolder) and ``none``
    #: for grey (mnist, fashion_mnist, digits); ``crop_flip``: zero-pad 4 px,
    #: random crop back to the image size, horizontal flip with p=0.5 (FedLMD
    #: Sec. 5.1; FedNTD's code ``RandomCrop(size, padding=4)`` +
    #: ``RandomHorizontalFlip()``); ``crop_flip_cutout``: the same plus Cutout(16)
    #: after normalisation, as FedNTD's loaders (which FedLMD's code uses) apply;
    #: ``flip_mean_crop``: FedFTG's official loader, flip with p=0.5, then with
    #: p=0.5 a 4-px padded random crop whose padding is the channel mean;
    #: ``none``. Normalisation is the same with and without augmentation.
    augment: Literal["auto", "none", "crop_flip", "crop_flip_cutout", "flip_mean_crop"] = "auto"
    #: Accuracies whose first round is reported ("rounds to reach", the papers' tables).
    target_accuracies: list[float] = field(default_factory=lambda: [0.5, 0.7, 0.8])

    def validate(self, prefix: str) -> None:
        from fedreid.data.classification import CLASSIFICATION_DATASETS

        if self.dataset not in CLASSIFICATION_DATASETS:
            raise ConfigError(
                f"{prefix}.dataset: unknown {self.dataset!r}; allowed: {', '.join(CLASSIFICATION_DATASETS)}"
            )
        for name in ("num_clients", "alpha", "shards_per_client"):
            _check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.min_size < 0 or self.unbalanced_sigma < 0:
            raise ConfigError(f"{prefix}.min_size and unbalanced_sigma: expected values >= 0")
        if self.max_retries < 0:
            raise ConfigError(f"{prefix}.max_retries: expected a value >= 0, got {self.max_retries}")
        if self.train_subset is not None and self.train_subset < self.num_clients:
            raise ConfigError(
                f"{prefix}.train_subset: expected null or at least num_clients={self.num_clients} images, "
                f"got {self.train_subset}"
            )
        _check_range(f"{prefix}.count_noise", self.count_noise, 0, 1)
        _check_range(f"{prefix}.test_fraction", self.test_fraction, 0, 1, low_open=True)
        if self.dataset != "digits" and self.test_fraction != ClassificationConfig.test_fraction:
            raise ConfigError(f"{prefix}.test_fraction: only digits is split here; {self.dataset} is tested on its "
                              f"own test split, so test_fraction={self.test_fraction} would be ignored")
        for t in self.target_accuracies:
            _check_range(f"{prefix}.target_accuracies", t, 0, 1)


@dataclass
class Config:
    """The root of every experiment config."""

    #: Seed of everything random in the run (model init, sampling, loaders, augmentation).
    seed: int = 0
    #: ``reid`` (FedPav on ReID datasets) or ``classification`` (FedAvg-family
    #: methods, FedFTG, FedLMD on a partitioned classification dataset).
    task: Literal["reid", "classification"] = "reid"
    #: Datasets on disk.
    data: DataConfig = field(default_factory=DataConfig)
    #: The synthetic ReID world.
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    #: How datasets become clients.
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    #: The model.
    model: ModelConfig = field(default_factory=ModelConfig)
    #: Local training.
    train: TrainConfig = field(default_factory=TrainConfig)
    #: Server, aggregation and server hooks.
    fl: FLConfig = field(default_factory=FLConfig)
    #: Evaluation during training.
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: Run folder and device.
    run: RunConfig = field(default_factory=RunConfig)
    #: The classification track (``task: classification``).
    classification: ClassificationConfig = field(default_factory=ClassificationConfig)

    def validate(self, prefix: str) -> None:
        if self.train.objective == "feddyn" and self.fl.server_lr != 1.0:
            raise ConfigError(
                "fl.server_lr: FedDyn's server step replaces the average (theta = mean - h / alpha), "
                "so a server step size does not apply; set fl.server_lr=1"
            )
        if self.task != "classification":
            if self.fl.fedftg:
                from fedreid.fl.server_hooks.fedftg import NOT_FOR_FEDPAV

                raise ConfigError(f"fl.fedftg: {NOT_FOR_FEDPAV}")
        else:
            if self.fl.aggregation != "fedavg":
                raise ConfigError("fl.aggregation: classification averages whole models; set fl.aggregation=fedavg")
            for key in ("cdw", "kd"):
                if getattr(self.fl, key):
                    raise ConfigError(f"fl.{key}: a FedReID method, not available with task=classification")
            if self.eval.precision != "fp32":
                raise ConfigError("eval.precision: the classification track computes its test accuracy in fp32; "
                                  "set eval.precision=fp32 (train.precision sets its training)")
            if self.fl.mode == "local":
                raise ConfigError("fl.mode=local: the local-training baseline evaluates each client's model on that "
                                  "client's own dataset, and the classification track has one shared test split and "
                                  "no test data per client, so nothing would be evaluated; set fl.mode=federated")
            if self.fl.clients_per_round > self.classification.num_clients:
                raise ConfigError(f"fl.clients_per_round={self.fl.clients_per_round} but classification.num_clients="
                                  f"{self.classification.num_clients}: a round cannot sample more clients than exist")
            # FedReID's reference client restarts a StepLR every round; the classification methods'
            # code (FedAvg family, FedFTG, FedLMD, FedNTD) keeps one rate through a round.
            span = self.train.local_epochs
            if span > self.train.lr_step_size:
                raise ConfigError(
                    f"train.lr_step_size={self.train.lr_step_size}: FedReID's StepLR would cut the learning rate "
                    f"by train.lr_gamma after epoch {self.train.lr_step_size} of {span} local epochs a round, "
                    f"which no classification method does; set train.lr_step_size to at least {span} "
                    "(train.lr_round_decay decays the rate across rounds)")
        if self.task == "reid" and self.scenario.kind == "leave_one_out":
            self._check_leave_one_out()
        self._check_hooks()

    def _check_leave_one_out(self) -> None:
        names = self.data.dataset_names()
        target = self.scenario.target
        if target not in names:
            raise ConfigError(f"scenario.target: {target!r} is not one of data.datasets ({', '.join(names)})"
                              f"{did_you_mean(str(target), names)}")
        if len(names) < 2:
            raise ConfigError(f"data.datasets: leave_one_out needs the target and at least one source "
                              f"dataset, got {names}")

    def hook_specs(self) -> list[tuple[str, dict[str, Any]]]:
        """The run's server hooks in the order they run, as ``(name, options mapping)``.

        The client objective's server half (SCAFFOLD, FedDyn), then the
        ``fl.kd`` and ``fl.fedftg`` shorthands, then ``fl.hooks``. None in
        the local-training baseline (``fl.mode=local``): nothing is aggregated.
        """
        if self.fl.mode != "federated":
            return []
        from fedreid.fl.local.objectives import objective_class, objective_options

        specs: list[tuple[str, dict[str, Any]]] = []
        objective = objective_class(self.train.objective)
        own = objective.server_hook
        if own and objective.uses_server_hook(objective_options(self.train.objective, self.train.objective_options)):
            specs.append((own, {}))
        if self.fl.kd:
            f = self.fl
            specs.append(("kd", {"every": f.kd_every, "lr": f.kd_lr, "batch_size": f.kd_batch_size,
                                 "student_normalize": f.kd_student_normalize, "mode": f.kd_mode,
                                 "public_dataset": f.public_dataset}))
        if self.fl.fedftg:
            specs.append(("fedftg", dict(self.fl.fedftg_options)))
        for entry in self.fl.hooks:
            specs.append((entry["name"], {k: v for k, v in entry.items() if k != "name"}))
        return specs

    def hook_settings(self, name: str) -> Any:
        """The typed options of server hook ``name`` in this run, or None when it does not run."""
        from fedreid.fl.server_hooks import hook_options

        for spec_name, values in self.hook_specs():
            if spec_name == name:
                return hook_options(name, values)
        return None

    def _check_hooks(self) -> None:
        from fedreid.fl.local.objectives import OBJECTIVES
        from fedreid.fl.server_hooks import hook_class

        if self.fl.mode != "federated" and self.fl.hooks:
            raise ConfigError("fl.hooks: the local-training baseline (fl.mode=local) has no server; "
                              "remove fl.hooks or set fl.mode=federated")
        specs = self.hook_specs()
        names = [name for name, _ in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"fl.hooks: server hook {twice[0]!r} is configured twice (fl.hooks and a "
                              f"shorthand such as fl.{twice[0]}=true, or the client objective's own server half)")
        classes = [hook_class(name) for name in names]
        aggregating = [c.name for c in classes if c.aggregates()]
        if len(aggregating) > 1:
            raise ConfigError(f"fl.hooks: {' and '.join(aggregating)} each replace the server's aggregation; "
                              "a run can use one of them")
        needed = OBJECTIVES.get(self.train.objective).requires_hook
        if needed and needed not in names:
            raise ConfigError(f"train.objective={self.train.objective} is the client half of the {needed!r} "
                              f"server hook; add fl.hooks=[{{name: {needed}}}]")
        own = {cls.server_hook: name for name, cls in OBJECTIVES.items() if cls.server_hook}
        listed = {entry["name"] for entry in self.fl.hooks}
        for c in classes:
            if self.task not in c.tasks:
                raise ConfigError(f"fl.hooks: server hook {c.name!r} runs with task={' or '.join(c.tasks)}, "
                                  f"this run has task={self.task}")
            if c.name in own and own[c.name] != self.train.objective:
                raise ConfigError(f"fl.hooks: {c.name!r} is the server half of train.objective={own[c.name]}; "
                                  f"set train.objective={own[c.name]} instead of listing the hook")
            if c.name in own and c.name in listed:
                raise ConfigError(f"fl.hooks: {c.name!r} is the server half of train.objective={own[c.name]}, "
                                  "which configures it from train.objective_options; leave it out of fl.hooks")


# ---------------------------------------------------------------------------
# Loading, overriding, validating
# ---------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    cls: type = Config,
) -> Any:
    """Defaults, then the YAML file at ``path``, then ``key.sub=value`` overrides.

    An error about a key the file sets (not an override) names the file and the key's line.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
    try:
        return from_dict(cls, apply_overrides(data, overrides))
    except ConfigError as exc:
        overridden = {item.partition("=")[0].strip() for item in overrides}
        if path is None or exc.key is None or any(exc.key == k or exc.key.startswith((k + ".", k + "["))
                                                  for k in overridden):
            raise
        line = _key_line(Path(path), exc.key)
        where = f"config file {path}" + (f", line {line}" if line else "")
        raise ConfigError(f"{where}: {exc}") from exc


def _key_line(path: Path, key: str) -> int | None:
    """The 1-based line of ``key`` (dotted; else its nearest parent) in the YAML file, or None."""
    try:
        root = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = f"{prefix}{k.value}"
                lines[name] = k.start_mark.line + 1
                walk(v, name + ".")

    walk(root, "")
    parts = key.split(".")
    while parts:
        if ".".join(parts) in lines:
            return lines[".".join(parts)]
        parts.pop()
    return None


def load_config_text(text: str, overrides: Sequence[str] = (), cls: type = Config) -> Any:
    """Like :func:`load_config`, from YAML text (a config sent to another machine)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the config text is not valid YAML: {_yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"the config text: expected a mapping of keys, got {type(data).__name__}")
    return from_dict(cls, apply_overrides(data, overrides))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # a model file or other binary given as --config
        raise ConfigError(
            f"config file {path} is not UTF-8 YAML text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of keys at the top level, "
            f"got {type(data).__name__}"
        )
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping.

    YAML's loaders keep the last of two equal keys without a word, so a config
    with two ``fl:`` sections would silently lose the first.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"while reading the mapping that begins on line {node.start_mark.line + 1}", node.start_mark,
                    f"key {key!r} is given twice (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parser error in one line: where (line, column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` set (:func:`fedreid.utils.cli.override_value`).

    A string beginning with ``~/`` is refused: no shell expands a ``~`` that
    follows ``=``, so it would name a folder called ``~``.
    """
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        value = override_value(raw)
        if isinstance(value, str) and value.startswith("~/"):
            raise ConfigError(f"override {item!r}: the shell does not expand a '~' after '=': "
                              f"write the full path, e.g. {key.strip()}={os.path.expanduser(value)}")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


__all__ = [
    "BENCHMARK_DATASETS",
    "ClassificationConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FLConfig",
    "ModelConfig",
    "RunConfig",
    "ScenarioConfig",
    "SyntheticConfig",
    "TrainConfig",
    "apply_overrides",
    "dump_config",
    "from_dict",
    "load_config",
    "load_config_text",
    "read_yaml",
    "to_dict",
]
