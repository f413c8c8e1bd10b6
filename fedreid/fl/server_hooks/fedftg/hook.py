"""FedFTG's server hook: a persistent conditional generator and the fine-tuning of Algorithm 1.

After aggregation in round ``t``, :meth:`FedFTGHook.finetune` runs ``I``
iterations; in each, ``I_g`` generator steps *maximise*
``L_md - lambda_cls L_cls - lambda_dis L_dis`` over the generator (hard-sample
mining, Eq. 8), then ``I_d`` SGD steps *minimise* ``L_md`` (Eq. 3-4) over the
global model on that batch (Algorithm 1; ``I = 10, I_g = 1, I_d = 5``). The
global model's BatchNorm is frozen by default (the method fine-tunes the
weights, not the normalisation statistics of real data). Every random draw
comes from the ``torch.Generator`` passed to ``finetune``, the generator's
initial weights from the hook's seed. Method notes, the paper-vs-official-code
table and the cost of a round: ``docs/methods/fedftg.md``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedreid.fl.server_hooks.base import HookContext, ServerHook, context_precision, register_hook
from fedreid.fl.server_hooks.fedftg.losses import (
    _counts,
    cls_loss,
    diversity_loss,
    ensemble_weights,
    generator_objective,
    label_distribution,
    md_loss,
    sample_labels,
    stratified_labels,
)
from fedreid.fl.server_hooks.fedftg.options import (
    CLASS_COUNTS,
    NOT_FOR_FEDPAV,
    FedFTGConfig,
    FedFTGConfigError,
    FedFTGInputError,
)
from fedreid.fl.server_hooks.fedftg.teachers import TeacherEnsemble, TeacherInput, _check_classes
from fedreid.fl.update import Update
from fedreid.models.generator import ConditionalGenerator, default_z_dim, sample_noise
from fedreid.utils.precision import FP32, Precision
from fedreid.utils.seeding import derive_seed, forked_torch_rng, torch_generator


@dataclass
class _Running:
    """Sums for the metrics of one fine-tuning.

    Tensor values are summed as float64 tensors on their device and read once
    in :meth:`means`: no device-to-host synchronisation per step on an
    accelerator.
    """

    values: dict[str, Tensor | float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, value: Tensor | float) -> None:
        v = value.detach().to(torch.float64) if isinstance(value, Tensor) else float(value)
        prev = self.values.get(name)
        self.values[name] = v if prev is None else prev + v
        self.counts[name] = self.counts.get(name, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: float(self.values[k]) / self.counts[k] for k in self.values}


def _generator_step(optimizer: torch.optim.Optimizer, run: "_Running", md: Tensor, cls: Tensor, dis: Tensor,
                    config: FedFTGConfig, precision: Precision = FP32,
                    scaler: Optional["torch.amp.GradScaler"] = None) -> None:
    """One Adam step of the generator on Eq. 8's objective from its terms; logs the terms."""
    loss = generator_objective(md, cls, dis, config)
    optimizer.zero_grad(set_to_none=True)
    precision.backward(loss, scaler)
    precision.step(optimizer, scaler)
    for name, value in (("gen_md", md), ("gen_cls", cls), ("gen_dis", dis), ("gen_loss", loss)):
        run.add(name, value)


@register_hook
class FedFTGHook(ServerHook):
    """FedFTG on the server: a persistent generator, fine-tuning after each aggregation.

    ``finetune(global_model, teachers, class_counts, generator)`` (also
    ``__call__``) trains ``global_model`` in place and returns metrics. As a
    server hook (:mod:`fedreid.fl.server_hooks`), :meth:`instructions` asks
    the clients for their class counts and :meth:`after_aggregate` runs
    ``finetune`` with the updates' states as teachers and a generator seeded
    from ``(seed, "fedftg", round)``.

    ``state_dict()`` holds the generator's weights and BN statistics, its Adam
    state and the round counter; a hook restored with ``load_state_dict``
    continues bit-exactly like one that never stopped.

    The server part of Algorithm 1 (Eq. 3-8); method notes and the
    paper-vs-official-code table: ``docs/methods/fedftg.md``.
    """

    name = "fedftg"
    tasks: ClassVar[tuple[str, ...]] = ("classification",)
    Options: ClassVar[type] = FedFTGConfig

    @classmethod
    def context_defaults(cls, context: HookContext) -> dict[str, Any]:
        """The data's image size and channels; the clients' learning rate, decay and weight decay for the
        global model too (Sec. 4.1 names one classifier learning rate, 0.1). The official code fixes the
        global model's at 0.1 whatever the clients' (``local_fn_gan.py`` ``train_FedGAN_common``:
        ``glb_model_lr = 0.1``, times ``lr_decay_per_round ** i``): set the hook's ``global_lr: 0.1``
        for that; the FedFTG configs' ``train.lr`` is 0.1, so there both agree."""
        train = context.cfg.train
        return {"image_size": context.image_size, "image_channels": context.image_channels,
                "global_lr": train.lr, "lr_decay": train.lr_round_decay, "global_weight_decay": train.weight_decay}

    @classmethod
    def build(cls, options: FedFTGConfig, context: HookContext) -> "FedFTGHook":
        if not context.num_classes:
            raise FedFTGConfigError(NOT_FOR_FEDPAV)
        return cls(options, num_classes=context.num_classes, seed=derive_seed(context.seed, "fedftg"),
                   device=context.device, precision=context_precision(context))

    def __init__(
        self,
        config: Optional[FedFTGConfig] = None,
        *,
        num_classes: Optional[int] = None,
        seed: int = 0,
        device: Optional[torch.device | str] = None,
        precision: Precision = FP32,
    ) -> None:
        self.config = config if config is not None else FedFTGConfig()
        #: Autocast of the generator and global steps (``train.precision``); parameters stay fp32.
        self.precision = precision
        self.seed = int(seed)
        self.device = torch.device(device) if device is not None else None
        self.generator: Optional[ConditionalGenerator] = None
        self.optimizer: Optional[torch.optim.Adam] = None
        self.rounds_done = 0
        if num_classes is not None:
            self._build(int(num_classes), self.device or torch.device("cpu"))

    # ----------------------------------------------------------- generator

    def _build(self, num_classes: int, device: torch.device) -> None:
        cfg = self.config
        init = torch_generator(self.seed, "fedftg", "generator_init")
        self.generator = ConditionalGenerator(
            num_classes,
            z_dim=cfg.z_dim if cfg.z_dim is not None else default_z_dim(num_classes),
            image_size=cfg.image_size,
            channels=cfg.image_channels,
            base_channels=cfg.generator_channels,
            output_norm=cfg.generator_output_norm,
            layer_order=cfg.generator_layer_order,
            generator=init,
        ).to(device)
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.Adam:
        assert self.generator is not None
        return torch.optim.Adam(self.generator.parameters(), lr=self.config.generator_lr,
                                betas=tuple(self.config.generator_betas))  # type: ignore[arg-type]

    def _ready(self, num_classes: int, device: torch.device) -> ConditionalGenerator:
        if self.generator is None:
            self._build(num_classes, device)
        assert self.generator is not None
        if self.generator.num_classes != num_classes:
            raise FedFTGInputError(
                f"fedftg: class counts have {num_classes} classes, the generator was built for "
                f"{self.generator.num_classes}"
            )
        if next(self.generator.parameters()).device != device:
            self.generator.to(device)
            if self.optimizer is not None:
                # Adam moments follow their parameters (load_state_dict casts them).
                self.optimizer.load_state_dict(self.optimizer.state_dict())
        return self.generator

    # ----------------------------------------------------------- server-hook protocol

    def instructions(self, round_index: int) -> dict[str, Any]:
        return {CLASS_COUNTS: True}

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s class counts cannot weigh its teacher, or None (see :mod:`fedreid.fl.server_hooks`).

        ``class_counts`` must be one finite, non-negative number per class
        (the generator's classes once it is built). Checked per update before
        aggregation, so a bad client is left out instead of stopping the run
        in :meth:`after_aggregate`.
        """
        counts = update.metadata.get(CLASS_COUNTS)
        if counts is None:
            return f"no {CLASS_COUNTS}"
        try:
            counts = torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"{CLASS_COUNTS} is not a list of numbers ({exc})"
        if counts.dtype == torch.bool or counts.is_complex():
            return f"{CLASS_COUNTS} must hold real numbers, got {counts.dtype}"
        expected = self.generator.num_classes if self.generator is not None else None
        if counts.dim() != 1 or counts.numel() == 0 or (expected is not None and counts.numel() != expected):
            return (f"{CLASS_COUNTS} has shape {tuple(counts.shape)}, expected "
                    f"({expected if expected is not None else 'classes'},)")
        counts = counts.double()
        if not bool(counts.isfinite().all()) or bool((counts < 0).any()):
            return f"{CLASS_COUNTS} must be finite and >= 0"
        return None

    def trains_model(self, round_index: int) -> bool:
        return True  # fine-tunes the global model every round (FedDF distils it)

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        missing = [u.client for u in updates if CLASS_COUNTS not in u.metadata]
        if missing:
            raise FedFTGInputError(f"fedftg round {round_index}: client {missing[0]!r} sent no {CLASS_COUNTS}")
        counts = torch.stack([torch.as_tensor(u.metadata[CLASS_COUNTS], dtype=torch.float64) for u in updates])
        gen = torch_generator(self.seed, "fedftg", round_index)
        return self.finetune(model, [u.state for u in updates], counts, gen, round_index=round_index)

    # ----------------------------------------------------------- fine-tuning

    def __call__(self, global_model: nn.Module, teachers: TeacherInput, class_counts: Any,
                 generator: torch.Generator, *, round_index: Optional[int] = None) -> dict[str, Any]:
        return self.finetune(global_model, teachers, class_counts, generator, round_index=round_index)

    def finetune(
        self,
        global_model: nn.Module,
        teachers: TeacherInput,
        class_counts: Any,
        generator: torch.Generator,
        *,
        round_index: Optional[int] = None,
    ) -> dict[str, Any]:
        """Algorithm 1's server part: ``I`` x (``I_g`` generator steps, ``I_d`` global steps), in place.

        ``teachers``: the participating clients' models (or state dicts) in
        the order of the rows of ``class_counts`` (``[K, C]``, ``n_k^y``).
        ``generator`` (a CPU ``torch.Generator``) supplies every random draw.
        ``round_index`` (default: rounds done so far) sets the learning-rate
        decay ``lr_decay ** round``.

        Returns ``fedftg_md_before`` / ``fedftg_md_after`` (``L_md`` of the
        global model before and after, on the last iteration's pseudo batch
        with ``eval_batches=0``, else on ``eval_batches`` fresh pseudo batches
        of the final generator; ``fedftg_md_eval`` says which:
        ``"last_batch"`` or ``"fresh"``), ``fedftg_md_first`` /
        ``fedftg_md_last`` (the first and last global-step losses),
        ``fedftg_gen_md`` / ``_cls`` / ``_dis`` / ``_loss`` (means over
        generator steps), the learning rates, the teacher forward used and
        ``fedftg_seconds``.
        """
        started = time.perf_counter()
        cfg = self.config
        counts = _counts(class_counts)
        num_teachers, num_classes = counts.shape
        if len(teachers) != num_teachers:
            raise FedFTGInputError(f"fedftg: {len(teachers)} teachers but class counts for {num_teachers} clients")
        first = next(global_model.parameters(), None)
        if first is None:
            raise FedFTGInputError("fedftg: the global model has no parameters")
        device = self.device or first.device
        gen_model = self._ready(num_classes, device)
        assert self.optimizer is not None
        round_index = self.rounds_done if round_index is None else int(round_index)
        scale = cfg.lr_decay ** round_index
        if cfg.reset_generator_optimizer:
            self.optimizer = self._new_optimizer()
        # Otherwise Adam's moments persist like the generator itself: the
        # generator continues its optimisation across rounds, and a resumed
        # run needs them to continue bit-exactly.
        opt_g = self.optimizer
        for group in opt_g.param_groups:
            group["lr"] = cfg.generator_lr * scale
        params = [p for p in global_model.parameters()]
        flags = [p.requires_grad for p in params]
        opt_d = torch.optim.SGD(params, lr=cfg.global_lr * scale, momentum=cfg.global_momentum,
                                weight_decay=cfg.global_weight_decay)
        probs = label_distribution(counts, cfg.label_sampling)
        alpha = ensemble_weights(counts, cfg.ensemble).to(device, torch.float32)
        total = cfg.iterations * cfg.batch_size
        if cfg.label_sampling == "stratified":
            schedule = stratified_labels(counts, total, generator)
        else:
            schedule = sample_labels(probs, total, generator)
        schedule = schedule.view(cfg.iterations, cfg.batch_size)
        # Dropout (only active with global_bn="train") draws from a forked
        # global RNG seeded from the caller's generator.
        dropout_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        # The weights before fine-tuning, for the md_before/md_after report.
        before = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
        last: Optional[tuple[Tensor, Tensor, Tensor]] = None
        was_training = global_model.training
        mode = cfg.teacher_forward
        run = _Running()
        metrics: dict[str, Any] = {}
        scalers = (self.precision.grad_scaler(), self.precision.grad_scaler())  # generator, global model
        try:
            with TeacherEnsemble(global_model, teachers, mode, device) as ens, forked_torch_rng(dropout_seed, device), \
                    self.precision.autocast():
                for i in range(cfg.iterations):
                    y = schedule[i].to(device)
                    z = sample_noise(cfg.batch_size, gen_model.z_dim, generator, device=device)
                    w = alpha[:, y]  # [K, B]: alpha^{k, y_b}
                    if cfg.trains_generator:
                        self._generator_phase(global_model, params, gen_model, opt_g, ens, z, y, w, run, scalers[0])
                    last = self._global_phase(global_model, params, flags, gen_model, opt_d, ens, z, y, w, run,
                                              first=(i == 0), last=(i == cfg.iterations - 1), scaler=scalers[1])
                if cfg.eval_batches > 0:
                    metrics.update(self._evaluate(global_model, before, gen_model, ens, probs, alpha, generator,
                                                  device))
                elif last is not None:
                    metrics.update(self._evaluate_last(global_model, before, *last))
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
            global_model.train(was_training)
            gen_model.eval()
        self.rounds_done = round_index + 1
        metrics.update({f"fedftg_{k}": v for k, v in run.means().items()})
        metrics.update({
            "fedftg_round": round_index,
            "fedftg_teachers": num_teachers,
            "fedftg_generator_lr": cfg.generator_lr * scale,
            "fedftg_global_lr": cfg.global_lr * scale,
            "fedftg_teacher_forward": mode,
            "fedftg_seconds": time.perf_counter() - started,
        })
        return metrics

    def _generator_phase(self, global_model: nn.Module, params: list[nn.Parameter], gen_model: ConditionalGenerator,
                         opt_g: torch.optim.Optimizer, ens: TeacherEnsemble, z: Tensor, y: Tensor, w: Tensor,
                         run: _Running, scaler: Optional["torch.amp.GradScaler"] = None) -> None:
        """``I_g`` generator steps (Eq. 8, maximising over ``theta``); the global model is fixed, eval mode."""
        cfg = self.config
        global_model.eval()
        for p in params:  # gradients reach x~ through the global model, never its weights
            p.requires_grad_(False)
        gen_model.train()
        div = cfg.generator_divergence
        zero = z.new_zeros(())
        for _ in range(cfg.generator_steps):
            if cfg.generator_update == "joint":
                x = gen_model(z, y)
                t = _check_classes(ens(x), gen_model.num_classes)
                md = zero
                if cfg.hard_sample_mining:
                    s = global_model(x)
                    t_md = t if cfg.md_teacher_grad else t.detach()
                    md = md_loss(s, t_md, w, div, class_mean=cfg.md_class_mean)
                cls = cls_loss(t, y, w) if cfg.use_cls_loss else zero
                dis = (diversity_loss(z, x, image_metric=cfg.dis_image_metric, noise_metric=cfg.dis_noise_metric)
                       if cfg.use_dis_loss else zero)
                _generator_step(opt_g, run, md, cls, dis, cfg, self.precision, scaler)
            else:
                # Official: one Adam step per teacher, each on that teacher's terms
                # (CE averaged over the batch times the mean alpha, L_dis / K).
                for k in range(ens.num):
                    x = gen_model(z, y)
                    t = _check_classes(ens.one(k, x), gen_model.num_classes)
                    wk = w[k:k + 1]
                    md = zero
                    if cfg.hard_sample_mining:
                        s = global_model(x)
                        t_md = t if cfg.md_teacher_grad else t.detach()
                        md = md_loss(s, t_md.unsqueeze(0), wk, div, class_mean=cfg.md_class_mean)
                    cls = F.cross_entropy(t, y) * wk.mean() if cfg.use_cls_loss else zero
                    dis = (diversity_loss(z, x, image_metric=cfg.dis_image_metric,
                                          noise_metric=cfg.dis_noise_metric) / ens.num
                           if cfg.use_dis_loss else zero)
                    _generator_step(opt_g, run, md, cls, dis, cfg, self.precision, scaler)

    def _global_phase(self, global_model: nn.Module, params: list[nn.Parameter], flags: list[bool],
                      gen_model: ConditionalGenerator, opt_d: torch.optim.Optimizer, ens: TeacherEnsemble,
                      z: Tensor, y: Tensor, w: Tensor, run: _Running, *, first: bool,
                      last: bool, scaler: Optional["torch.amp.GradScaler"] = None
                      ) -> Optional[tuple[Tensor, Tensor, Tensor]]:
        """``I_d`` SGD steps of the global model on ``L_md`` over the iteration's fixed batch.

        Returns the batch ``(x~, teacher logits, weights)`` (None when ``I_d = 0``).
        """
        cfg = self.config
        if cfg.global_steps == 0:
            return None
        with torch.no_grad():
            # "batch": normalise with the batch statistics, as in the generator
            # step, so the global model distils on the hard samples that step
            # mined; the running statistics (official "running") lag behind a
            # generator that changes every step and are poor in early rounds.
            # "running" is also fragile: the conv biases in front of BatchNorm
            # have an analytically zero gradient, Adam turns its rounding noise
            # into +-lr steps, and only eval-mode BN lets those biases reach the
            # images -- float-rounding changes (loop vs vmap, CPU vs GPU) then
            # change the result by ~1e-2 instead of ~1e-7 (still deterministic
            # for one setup).
            gen_model.train(cfg.generator_bn == "batch")
            x = gen_model(z, y)
            # The batch and the teachers are fixed for the I_d steps: one teacher pass.
            t = _check_classes(ens(x), gen_model.num_classes)
        global_model.train(cfg.global_bn == "train")
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
        for step in range(cfg.global_steps):
            s = _check_classes(global_model(x), gen_model.num_classes)
            loss = md_loss(s, t, w, cfg.md_divergence, class_mean=cfg.md_class_mean)
            opt_d.zero_grad(set_to_none=True)
            self.precision.backward(loss, scaler)
            self.precision.step(opt_d, scaler)
            if first and step == 0:
                run.add("md_first", loss)
            if last and step == cfg.global_steps - 1:
                run.add("md_last", loss)
            run.add("md_global", loss)
        return x, t, w

    @torch.no_grad()
    def _evaluate_last(self, global_model: nn.Module, before: Mapping[str, Tensor], x: Tensor, t: Tensor,
                       w: Tensor) -> dict[str, Any]:
        """``L_md`` before and after on the last iteration's batch (eval-mode BN): two global forward passes."""
        cfg = self.config
        global_model.eval()
        s_after = global_model(x)
        s_before = functional_call(global_model, dict(before), (x,))
        return {"fedftg_md_before": float(md_loss(s_before, t, w, cfg.md_divergence, class_mean=cfg.md_class_mean)),
                "fedftg_md_after": float(md_loss(s_after, t, w, cfg.md_divergence, class_mean=cfg.md_class_mean)),
                "fedftg_md_eval": "last_batch"}

    @torch.no_grad()
    def _evaluate(self, global_model: nn.Module, before: Mapping[str, Tensor], gen_model: ConditionalGenerator,
                  ens: TeacherEnsemble, probs: Tensor, alpha: Tensor, generator: torch.Generator,
                  device: torch.device) -> dict[str, Any]:
        """``L_md`` of the global model before and after, on fresh pseudo batches (eval-mode BN).

        The generator's BN statistics are restored afterwards, so reporting
        leaves no trace in its state.
        """
        cfg = self.config
        saved = {k: v.clone() for k, v in gen_model.state_dict().items()}
        global_model.eval()
        gen_model.train(cfg.generator_bn == "batch")
        md_before, md_after = 0.0, 0.0
        for _ in range(cfg.eval_batches):
            y = sample_labels(probs, cfg.batch_size, generator).to(device)
            z = sample_noise(cfg.batch_size, gen_model.z_dim, generator, device=device)
            x = gen_model(z, y)
            t = ens(x)
            w = alpha[:, y]
            s_after = global_model(x)
            s_before = functional_call(global_model, dict(before), (x,))
            md_after += float(md_loss(s_after, t, w, cfg.md_divergence, class_mean=cfg.md_class_mean))
            md_before += float(md_loss(s_before, t, w, cfg.md_divergence, class_mean=cfg.md_class_mean))
        gen_model.load_state_dict(saved)
        return {"fedftg_md_before": md_before / cfg.eval_batches, "fedftg_md_after": md_after / cfg.eval_batches,
                "fedftg_md_eval": "fresh"}

    # ----------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """Generator (weights + BN statistics), its Adam state, rounds done, config and classes."""
        return {
            "version": 1,
            "seed": self.seed,
            "rounds_done": self.rounds_done,
            "num_classes": None if self.generator is None else self.generator.num_classes,
            "config": self.config.to_dict(),
            "generator": None if self.generator is None else copy.deepcopy(self.generator.state_dict()),
            "optimizer": None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the hook's own config stays; the generator is rebuilt if needed)."""
        self.rounds_done = int(state["rounds_done"])
        if state.get("generator") is None:
            self.generator, self.optimizer = None, None
            return
        num_classes = int(state["num_classes"])
        device = (self.device or (next(self.generator.parameters()).device if self.generator is not None
                                  else torch.device("cpu")))
        if self.generator is None or self.generator.num_classes != num_classes:
            self._build(num_classes, device)
        assert self.generator is not None and self.optimizer is not None
        self.generator.load_state_dict(state["generator"])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def with_options(config: FedFTGConfig, **changes: Any) -> FedFTGConfig:
    """A copy of ``config`` with ``changes`` (validated), e.g. one Table 4 ablation."""
    return replace(config, **changes)
