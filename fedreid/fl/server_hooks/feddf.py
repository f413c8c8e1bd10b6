"""FedDF: ensemble distillation for model fusion (Lin, Kong, Stich, Jaggi, NeurIPS 2020), data-free.

FedDF (Algorithm 1) averages the clients' models as FedAvg does, then
distils the average -- the student ``x_j``, initialised with it -- toward the
ensemble of the participating client models on unlabeled server inputs ``d``::

    x_j <- x_j - eta * grad KL( sigma(1/|S_t| sum_k f(x_k, d)) || sigma(f(x_j, d)) )

(the "AvgLogits" ensemble: the teachers' logits are averaged, then
softmaxed). FedDF needs an unlabeled data set or a generator on the server;
FedFTG (Zhang et al., CVPR 2022) runs it as a *data-free* baseline: "Since
FedDF does not explain how to obtain the generator, we train it in the same
way as FedGen" (Sec. 4.1 "Baselines"), with FedFTG's input-level generator
(appendix Table 7(a), :class:`~fedreid.models.generator.ConditionalGenerator`)
and FedFTG's generator learning rate (0.01, decayed by 0.998 per round;
appendix 7.3). So each round, after the server's aggregation:

1. the generator, the FedGen way (:func:`~fedreid.fl.server_hooks.fedgen.train_generator`):
   ``generator_steps`` Adam steps on ``sum_k alpha_k^y CE(f(G(z, y); x_k), y)
   + lambda_dis L_dis`` with ``y ~ p^(y)`` from the participants' label
   counts and the class-level weights ``alpha_k^y = n_k^y / sum_i n_i^y``
   (FedGen's Eq. 4, weighted per sample) -- without any of FedFTG's own
   parts: no hard-sample mining (the generator never sees the global model),
   no adversarial game;
2. the distillation, FedDF's way (:func:`feddf_loss`): ``distill_steps``
   steps, each on a fresh generated batch, of
   ``T^2 * KL(sigma(mean_k f(x~; x_k) / T) || sigma(f(x~; x_j) / T))``,
   averaged over the batch, with Adam (lr 1e-3, cosine-annealed over the
   steps; the optimiser and schedule are re-created every round) -- FedDF's
   server optimiser (Sec. 4 and its official code,
   github.com/epfml/federated-learning-public-code ``codes/FedDF-code/
   pcode/aggregation/noise_knowledge_transfer.py``: ``optim.Adam(lr=1e-3)``,
   ``CosineAnnealingLR``, ``KL_temperature = 1``). ``distill_optimizer: sgd``
   is plain SGD instead.

Choices where the papers are silent, and why:

* Budget. FedDF distils up to 10^4 batches per round and stops early on a
  *labelled validation set* (official ``early_stopping_server_batches``);
  a data-free server has none. FedFTG's paper gives no schedule for its
  baselines, so the default is FedFTG's own server budget (``I = 10``
  generator steps, ``I * I_d = 50`` global steps of batch 50), which puts
  FedDF and FedFTG on the same footing; both counts are options.
* FedFTG's official FedDF baseline (``ZhangLin-PKU/FedFTG``,
  ``methods/local_fn_gan.py:train_global_model_feddf``, called by
  ``methods/FedDF.py:train_FedDF``) differs from the above in every part;
  each difference is an option and :meth:`FedDFConfig.official` sets them
  all. Its generator takes 50 steps (``generator_steps``) of an Adam made
  afresh each round (``reset_generator_optimizer``) with weight decay 1e-3
  (``generator_weight_decay``) on ``L_dis + sum_k CE(f(G(z, y); x_k), y) / K``
  (``ensemble: uniform``), with labels allotted in proportion to the
  participants' counts and shuffled (``label_sampling: stratified``, its
  ``generate_labels``), and runs the generator once for ``L_dis`` and once
  per teacher (``generator_forwards: per_teacher``: its BatchNorm running
  statistics take ``K + 1`` updates a step). Then the student takes 20 SGD
  steps (``distill_steps``) at the clients' learning rate ``0.1 * 0.998^t``
  with weight decay 1e-3 (``distill_lr``, ``distill_lr_decay``,
  ``distill_weight_decay``; constant within the round), in train mode
  (``student_bn: train``), on batches the generator makes with its running
  statistics (``generator_bn: running``), toward the average of the
  teachers' *probabilities* (``target: avg_probs``, ``KLDivLoss(batchmean)``).
* Ensemble. ``target: avg_logits`` (default) is Algorithm 1's average of the
  logits (uniform over the participants, as FedDF); ``avg_losses`` is the
  official code's default ``update_student_scheme``, the mean of the
  per-teacher ``KL(sigma(f_k) || sigma(f_j))``; ``avg_probs`` is FedFTG's
  official baseline, ``KL(mean_k sigma(f_k) || sigma(f_j))``. Class-level
  weights are used only to train the generator (FedGen's way); FedDF's
  ensemble is unweighted.
* BatchNorm. The student runs in eval mode by default (running statistics
  from the clients' real data stay; the affine parameters are trained), for
  the reason FedFTG's fine-tuning does (:mod:`fedreid.fl.server_hooks.fedftg`,
  "BatchNorm of the global model"); ``student_bn: train`` normalises with
  the synthetic batch and overwrites the running statistics (the official
  FedDF student trains in train mode on *real* unlabeled data). The
  generator produces the distillation batches with batch statistics (as it
  was trained; no gradient reaches it then).
* Temperature: ``T = 1`` (official default); the ``T^2`` factor (Hinton et
  al.), which the official code does not apply, is 1 there. The official
  student's gradient norm is clipped at 5; not here.

State: this hook extends :class:`~fedreid.fl.server_hooks.fedftg.FedFTGHook`
and keeps its state handling -- the generator (weights, BatchNorm
statistics), its Adam state and the round counter persist and resume
bit-exactly; the student's optimiser is per round (as the official solver).
Every random draw comes from the round's ``torch.Generator`` (seeded from
``(seed, "feddf")``; dropout, if the student trains in train mode, from a
fork of the global RNG seeded from it).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.errors import FedReIDError
from fedreid.fl.local.base import kl_teacher_student
from fedreid.fl.server_hooks.base import HookContext, context_precision, register_hook
from fedreid.fl.server_hooks.fedftg import (
    FedFTGHook,
    FedFTGInputError,
    TeacherEnsemble,
    md_loss,
    sample_labels,
    stratified_labels,
)
from fedreid.fl.server_hooks.fedgen import teacher_draw_weights, train_generator
from fedreid.models.generator import LAYER_ORDERS, sample_noise
from fedreid.utils.precision import FP32, Precision
from fedreid.utils.seeding import derive_seed, forked_torch_rng

TARGETS: tuple[str, ...] = ("avg_logits", "avg_losses", "avg_probs")


class FedDFConfigError(FedReIDError, ValueError):
    """A FedDF option out of range or not one of its choices."""


@dataclass
class FedDFConfig:
    """FedDF on generated inputs (see the module docstring); ``fl.hooks: [{name: feddf, ...}]``."""

    #: Adam steps of the generator per round, FedGen's objective (default: FedFTG's I = 10).
    generator_steps: int = 10
    #: Distillation steps per round, each on a fresh generated batch (default: FedFTG's I * I_d = 50).
    distill_steps: int = 50
    #: Generated samples per generator step and per distillation step (FedFTG Sec. 4.1: 50).
    batch_size: int = 50
    #: Weight of FedGen's diversity loss in the generator's objective (official FedGen ``ensemble_eta``).
    lambda_dis: float = 1.0
    #: Generator Adam learning rate (FedFTG appendix 7.3: 0.01).
    generator_lr: float = 0.01
    #: Generator Adam betas.
    generator_betas: tuple[float, float] = (0.9, 0.999)
    #: The generator's learning rate is ``generator_lr * lr_decay ** round`` (a run's default: ``train.lr_round_decay``).
    lr_decay: float = 0.998
    #: Labels of the generated batches: ``counts`` (drawn from the participants' label counts), ``uniform`` over
    #: the labels they hold, or ``stratified`` (FedFTG's official ``generate_labels``: each phase's labels allotted
    #: in proportion to the counts, shuffled).
    label_sampling: Literal["counts", "uniform", "stratified"] = "counts"
    #: Teacher weights of the generator's objective: ``class`` (n_k^y / sum_i n_i^y, FedGen), ``client_size``
    #: (n_k / n) or ``uniform`` (1 / K, FedFTG's official baseline).
    ensemble: Literal["class", "client_size", "uniform"] = "class"
    #: The generator's Adam weight decay (FedFTG's official baseline: the clients' 1e-3).
    generator_weight_decay: float = 0.0
    #: Re-create the generator's Adam every round (FedFTG's official baseline); false: its state persists.
    reset_generator_optimizer: bool = False
    #: Generator forwards per step: ``once``, or ``per_teacher`` (FedFTG's official baseline: once for L_dis and
    #: once per teacher; same samples, K + 1 BatchNorm running-statistics updates).
    generator_forwards: Literal["once", "per_teacher"] = "once"
    #: The generator's BatchNorm while it makes the distillation batches: ``batch`` (batch statistics, as it was
    #: trained) or ``running`` (FedFTG's official baseline: eval mode).
    generator_bn: Literal["batch", "running"] = "batch"
    #: The distillation target: ``avg_logits`` (FedDF Alg. 1), ``avg_losses`` (FedDF's official code's default) or
    #: ``avg_probs`` (FedFTG's official baseline: the teachers' averaged probabilities).
    target: Literal["avg_logits", "avg_losses", "avg_probs"] = "avg_logits"
    #: Distillation temperature T (the loss is multiplied by T^2; official: 1).
    temperature: float = 1.0
    #: The student's optimiser: ``adam`` (FedDF) or ``sgd``.
    distill_optimizer: Literal["adam", "sgd"] = "adam"
    #: The student's learning rate (FedDF: Adam 1e-3), multiplied by ``distill_lr_decay ** round``.
    distill_lr: float = 1e-3
    #: Per-round decay of the student's learning rate (FedFTG's official baseline: the clients' 0.998); in (0, 1].
    distill_lr_decay: float = 1.0
    #: The student optimiser's weight decay (FedFTG's official baseline: the clients' 1e-3).
    distill_weight_decay: float = 0.0
    #: SGD momentum (``distill_optimizer: sgd`` only).
    distill_momentum: float = 0.0
    #: The student's learning rate over one round's steps: ``cosine`` annealing to 0 (FedDF) or ``constant``.
    distill_schedule: Literal["cosine", "constant"] = "cosine"
    #: The student's BatchNorm: ``eval`` (running statistics kept) or ``train`` (synthetic-batch statistics).
    student_bn: Literal["eval", "train"] = "eval"
    #: Noise dimension (null: 100, 256 for 100+ classes; FedFTG appendix 7.4).
    z_dim: Optional[int] = None
    #: Generated image size (a run's default: the data's).
    image_size: Union[int, tuple[int, int]] = 32
    #: Generated image channels (a run's default: the data's).
    image_channels: int = 3
    #: Generator width ngf (Table 7(a): 64).
    generator_channels: int = 64
    #: BatchNorm after the generator's Tanh (FedFTG's official generator; Table 7(a) has none).
    generator_output_norm: bool = False
    #: ``paper`` (Table 7(a): convolution, then upsampling) or ``official`` (FedFTG's ``CGeneratorA``).
    generator_layer_order: str = "paper"
    #: How the teachers run: ``loop`` or ``vmap`` (same results; see FedFTG's module docstring).
    teacher_forward: Literal["loop", "vmap"] = "loop"

    def __post_init__(self) -> None:
        if isinstance(self.image_size, list):
            self.image_size = tuple(self.image_size)  # type: ignore[assignment]
        if isinstance(self.generator_betas, list):
            self.generator_betas = tuple(self.generator_betas)  # type: ignore[assignment]
        if int(self.generator_steps) < 0 or int(self.distill_steps) < 0:
            raise FedDFConfigError("feddf: generator_steps and distill_steps must be >= 0")
        if int(self.batch_size) < 2:
            raise FedDFConfigError(f"feddf: batch_size must be >= 2 (BatchNorm, diversity loss), got {self.batch_size}")
        for name in ("lambda_dis", "generator_lr", "generator_weight_decay", "distill_lr", "distill_weight_decay",
                     "distill_momentum"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise FedDFConfigError(f"feddf: {name} must be a finite number >= 0, got {value}")
        for name in ("lr_decay", "distill_lr_decay"):
            if not 0 < float(getattr(self, name)) <= 1:
                raise FedDFConfigError(f"feddf: {name} must be in (0, 1], got {getattr(self, name)}")
        if not float(self.temperature) > 0:
            raise FedDFConfigError(f"feddf: temperature must be > 0, got {self.temperature}")
        if self.z_dim is not None and int(self.z_dim) < 1:
            raise FedDFConfigError(f"feddf: z_dim must be >= 1 or null, got {self.z_dim}")
        choices = {"label_sampling": ("counts", "uniform", "stratified"),
                   "ensemble": ("class", "client_size", "uniform"), "target": TARGETS,
                   "generator_forwards": ("once", "per_teacher"), "generator_bn": ("batch", "running"),
                   "distill_optimizer": ("adam", "sgd"), "distill_schedule": ("cosine", "constant"),
                   "student_bn": ("eval", "train"), "teacher_forward": ("loop", "vmap"),
                   "generator_layer_order": LAYER_ORDERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise FedDFConfigError(f"feddf: {name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")

    @classmethod
    def official(cls, **overrides: Any) -> "FedDFConfig":
        """FedFTG's official FedDF baseline (module docstring), plus ``overrides``.

        The numbers are the official CIFAR scripts' (``scripts/CIFAR10_FedDF.sh``:
        ``--lr 0.1 --weight_decay 1e-3 --lr_decay 0.998 --bs 50``; the
        generator's 0.01 and the step counts from ``methods/FedDF.py`` and
        ``train_global_model_feddf``); in a run, set ``distill_lr``,
        ``distill_lr_decay`` and the weight decays to the clients' values.
        """
        values: dict[str, Any] = dict(
            generator_steps=50, distill_steps=20, batch_size=50, lambda_dis=1.0, generator_lr=0.01,
            lr_decay=0.998, label_sampling="stratified", ensemble="uniform", generator_weight_decay=1e-3,
            reset_generator_optimizer=True, generator_forwards="per_teacher", generator_bn="running",
            target="avg_probs", temperature=1.0, distill_optimizer="sgd", distill_lr=0.1, distill_lr_decay=0.998,
            distill_weight_decay=1e-3, distill_momentum=0.0, distill_schedule="constant", student_bn="train",
            generator_output_norm=True, generator_layer_order="official",
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feddf_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0,
               target: str = "avg_logits") -> Tensor:
    """FedDF's distillation loss of one batch (student ``[B, C]``, teachers ``[K, B, C]``).

    ``avg_logits``: ``T^2 * mean_b KL(sigma(mean_k t_k / T) || sigma(s / T))``;
    ``avg_losses``: ``T^2 * mean_b mean_k KL(sigma(t_k / T) || sigma(s / T))``;
    ``avg_probs``: ``T^2 * mean_b KL(mean_k sigma(t_k / T) || sigma(s / T))``.
    The teachers are constants (detached).
    """
    if teacher_logits.dim() == 2:
        teacher_logits = teacher_logits.unsqueeze(0)
    t = teacher_logits.detach() / temperature
    s = student_logits / temperature
    if target == "avg_logits":
        kl = kl_teacher_student(torch.softmax(t.mean(dim=0), dim=1), F.log_softmax(s, dim=1)).mean()
    elif target == "avg_losses":
        uniform = t.new_full(t.shape[:2], 1.0 / t.shape[0])
        kl = md_loss(s, t, uniform, "kl_teacher_first")
    elif target == "avg_probs":
        kl = kl_teacher_student(torch.softmax(t, dim=2).mean(dim=0), F.log_softmax(s, dim=1)).mean()
    else:
        raise FedDFConfigError(f"feddf: target must be one of {', '.join(TARGETS)}; got {target!r}")
    return kl * (temperature * temperature)


@register_hook
class FedDFHook(FedFTGHook):
    """FedDF on the server: the FedGen-trained input generator, then ensemble distillation, in place.

    ``finetune(global_model, teachers, class_counts, generator)`` (FedFTG's
    entry point, also ``__call__`` and :meth:`after_aggregate` with the
    updates as teachers) trains the generator, then distils ``global_model``
    toward the teachers' averaged logits; returns metrics.
    """

    name = "feddf"
    Options: ClassVar[type] = FedDFConfig
    tasks: ClassVar[tuple[str, ...]] = ("classification",)

    @classmethod
    def context_defaults(cls, context: HookContext) -> dict[str, Any]:
        """The data's image size and channels, and the clients' per-round decay for the generator (as FedFTG)."""
        values = {"image_size": context.image_size, "image_channels": context.image_channels,
                  "lr_decay": context.cfg.train.lr_round_decay}
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def build(cls, options: FedDFConfig, context: HookContext) -> "FedDFHook":
        if not context.num_classes:
            raise FedDFConfigError("feddf needs one label set shared by the clients and a classifier "
                                   "(task=classification)")
        return cls(options, num_classes=context.num_classes, seed=derive_seed(context.seed, "feddf"),
                   device=context.device, precision=context_precision(context))

    def __init__(self, config: Optional[FedDFConfig] = None, *, num_classes: Optional[int] = None, seed: int = 0,
                 device: Optional[torch.device | str] = None, precision: Precision = FP32) -> None:
        super().__init__(config if config is not None else FedDFConfig(),  # type: ignore[arg-type]
                         num_classes=num_classes, seed=seed, device=device, precision=precision)

    def finetune(self, global_model: nn.Module, teachers: Sequence[Any], class_counts: Any,
                 generator: torch.Generator, *, round_index: Optional[int] = None) -> dict[str, Any]:
        """One round of FedDF's server: the generator (FedGen's way), then the distillation of ``global_model``.

        ``teachers``: the participants' models or state dicts in the order of
        the rows of ``class_counts`` ``[K, C]``; ``generator`` supplies every
        random draw; ``round_index`` (default: rounds done) sets the
        generator's learning-rate decay.
        """
        started = time.perf_counter()
        cfg: FedDFConfig = self.config  # type: ignore[assignment]
        stratified = cfg.label_sampling == "stratified"
        counts, probs, weights = teacher_draw_weights(class_counts, len(teachers),
                                                      "counts" if stratified else cfg.label_sampling,
                                                      cfg.ensemble, method="feddf")
        params = [p for p in global_model.parameters() if p.requires_grad]
        if not params:
            raise FedFTGInputError("feddf: the global model has no trainable parameters")
        device = self.device or params[0].device
        gen_model = self._ready(counts.shape[1], device)
        round_index = self.rounds_done if round_index is None else int(round_index)
        lr = cfg.generator_lr * cfg.lr_decay ** round_index
        if cfg.reset_generator_optimizer:
            self.optimizer = self._new_optimizer()
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        dropout_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        schedule = (stratified_labels(counts, cfg.generator_steps * cfg.batch_size, generator)
                    .view(cfg.generator_steps, cfg.batch_size) if stratified else None)
        was_training = global_model.training
        try:
            with TeacherEnsemble(global_model, teachers, cfg.teacher_forward, device) as ens:
                means = train_generator(gen_model, self.optimizer, ens, probs, weights.to(device, torch.float32),
                                        steps=cfg.generator_steps, batch_size=cfg.batch_size,
                                        lambda_dis=cfg.lambda_dis, generator=generator, device=device,
                                        precision=self.precision, labels=schedule,
                                        forwards=cfg.generator_forwards)
                with forked_torch_rng(dropout_seed, device), self.precision.autocast():
                    means.update(self._distill(global_model, params, gen_model, ens, counts, probs, generator, device,
                                               round_index))
        finally:
            global_model.train(was_training)
            gen_model.eval()
        self.rounds_done = round_index + 1
        metrics: dict[str, Any] = {f"feddf_{k}": v for k, v in means.items()}
        metrics.update({"feddf_round": round_index, "feddf_teachers": len(teachers), "feddf_generator_lr": lr,
                        "feddf_distill_lr": cfg.distill_lr * cfg.distill_lr_decay ** round_index,
                        "feddf_seconds": time.perf_counter() - started})
        return metrics

    def _new_optimizer(self) -> torch.optim.Adam:
        assert self.generator is not None
        cfg: FedDFConfig = self.config  # type: ignore[assignment]
        return torch.optim.Adam(self.generator.parameters(), lr=cfg.generator_lr,
                                betas=tuple(cfg.generator_betas),  # type: ignore[arg-type]
                                weight_decay=cfg.generator_weight_decay)

    def _distill(self, student: nn.Module, params: list[nn.Parameter], gen_model: nn.Module, ens: TeacherEnsemble,
                 counts: Tensor, probs: Tensor, generator: torch.Generator, device: torch.device,
                 round_index: int) -> dict[str, float]:
        """``distill_steps`` steps of :func:`feddf_loss` on fresh generated batches; the loss's first/last/mean."""
        cfg: FedDFConfig = self.config  # type: ignore[assignment]
        lr = cfg.distill_lr * cfg.distill_lr_decay ** round_index
        if cfg.distill_optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, weight_decay=cfg.distill_weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=cfg.distill_momentum,
                                  weight_decay=cfg.distill_weight_decay)
        schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.distill_steps)
                    if cfg.distill_schedule == "cosine" and cfg.distill_steps > 0 else None)
        labels = (stratified_labels(counts, cfg.distill_steps * cfg.batch_size, generator)
                  .view(cfg.distill_steps, cfg.batch_size) if cfg.label_sampling == "stratified" else None)
        losses = []
        scaler = self.precision.grad_scaler()
        for step in range(cfg.distill_steps):
            y = (sample_labels(probs, cfg.batch_size, generator) if labels is None else labels[step]).to(device)
            z = sample_noise(cfg.batch_size, gen_model.z_dim, generator, device=device)
            with torch.no_grad():
                # "batch": batch statistics, as in the generator's own training
                gen_model.train(cfg.generator_bn == "batch")
                x = gen_model(z, y)
                teacher_logits = ens(x)
            student.train(cfg.student_bn == "train")
            loss = feddf_loss(student(x).float(), teacher_logits.float(), cfg.temperature, cfg.target)
            opt.zero_grad(set_to_none=True)
            self.precision.backward(loss, scaler)
            self.precision.step(opt, scaler)
            if schedule is not None:
                schedule.step()
            losses.append(loss.detach())
        if not losses:
            return {}
        values = torch.stack(losses).to(torch.float64).cpu()
        return {"kl_first": float(values[0]), "kl_last": float(values[-1]), "kl_mean": float(values.mean())}


__all__ = ["FedDFConfig", "FedDFConfigError", "FedDFHook", "feddf_loss"]
