"""FedGen's server (Zhu, Hong, Zhou, ICML 2021, Algorithm 1): a feature-level generator for the clients.

After each round the server holds the participating clients' models and their
label counts ``n_k^y``. It trains the conditional generator ``G(z, y; w)``
(:class:`~fedreid.models.feature_generator.FeatureGenerator`, FedFTG's Table
7(b)) so that the clients' *heads* ``h_k`` (``model.classifier``, the last
Linear) classify its features as ``y`` -- Eq. 4, as a per-client weighted
cross-entropy (the form FedFTG describes for FedGen)::

    min_w  E_{y ~ p^(y), z ~ N(0, I)}  sum_k alpha_k^y CE(h_k(G(z, y)), y)  +  lambda_dis L_dis(z, G(z, y))

The official code (github.com/zhuangdizhu/FedGen,
``FLAlgorithms/servers/serverpFedGen.py`` ``train_generator``) means to
compute this, but multiplies the ``[B]`` losses by ``[B, 1]`` weights, which
broadcasts to ``[B, B]``: its mean is ``sum_k mean_b(CE_kb) * mean_b(alpha_k^{y_b})``,
each client weighted by its weights' batch mean. That is the option
``teacher_loss: official``; ``weighted`` (default) is the formula above.

``alpha_k^y = n_k^y / sum_i n_i^y`` (FedFTG's class-level ensemble weights,
:func:`~fedreid.fl.server_hooks.fedftg.ensemble_weights`, the form of official
``serverpFedGen.py:get_label_weights``; the sum is FedFTG's ``L_cls``,
:func:`~fedreid.fl.server_hooks.fedftg.cls_loss`)
and ``L_dis`` is FedGen's diversity loss
(:func:`~fedreid.fl.server_hooks.fedftg.diversity_loss`, official
``DiversityLoss('l1')`` with the l2 noise distance, weight ``ensemble_eta = 1``).
The paper's Eq. 4 writes the ensemble as the CE of the *averaged* logits; the
per-client weighted CE is used here (the official code's intent, and the form
FedFTG describes for FedGen). The official adversarial
"student" term is off in every official config (``ensemble_beta = 0``) and
is left out.

Then the server broadcasts ``G`` and ``p^(y)`` with the global model
(Algorithm 1, first line of the loop) through the round's objective payload;
the client half is :mod:`fedreid.fl.local.fedgen`. Nothing of the global model
changes here: FedGen aggregates by the plain average.

Schedule and optimiser. Each round ``generator_steps`` Adam steps (official:
``ensemble_epochs // n_teacher_iters = 10`` epochs of 5 steps) on
``generator_batch_size`` labels ``y ~ p^(y)`` (official: the clients' batch
size). Learning rate and decay from FedFTG's appendix 7.3, which sets FedGen's
and FedDF's generator like FedFTG's: ``0.01 * 0.998 ** round`` (official
FedGen: 3e-4 or 1e-4 x0.98, weight decay 1e-2). The generator is in training
mode (batch statistics) while it learns; the clients run it in eval mode with
the running statistics it accumulated (official).

Label counts. ``n_k^y`` are, with ``label_counts: training`` (default), the
clients' training images per label (the update metadata ``class_counts``),
and ``p^(y) = sum_k n_k^y / sum n`` (Algorithm 1: "server updates p^(y) based
on {c_k}"; ``label_sampling: uniform``: uniform over the labels some
participant holds). With ``label_counts: drawn_plus_one`` they are the
official ones (:func:`drawn_label_weights`): each client reports the labels
of the batches it trained on this round
(:data:`~fedreid.fl.local.fedgen.DRAWN_COUNTS_KEY`; the server asks for no
training counts), the teacher weights take those counts plus one
(``userpFedGen.py:UserpFedGen.clean_up_counts`` starts every label at 1,
``serverpFedGen.py:get_label_weights`` divides by the participants' sum), and
the labels drawn come from the labels some participant drew: official
``qualified_labels``, the labels whose largest count exceeds
``MIN_SAMPLES_PER_LABEL = 1``, drawn uniformly (``train_generator``:
``np.random.choice(self.qualified_labels, batch_size)``; here
``label_sampling: uniform``; ``counts`` draws them in proportion to the
drawn counts).

Stability (observed, not in either paper). Nothing bounds the generator's
output: the weighted CE keeps falling as the features grow along the heads'
class directions, and so does the diversity loss. On scikit-learn's digits
(cnn_lmd, 512-d ReLU features of norm ~2) the generated features reached a
norm of ~120 after the first round at FedFTG's lr 0.01 and ~600 by round 9,
when the clients' heads (trained on them with alpha = 10) blew up. Official
FedGen's lr 3e-4 kept the run stable (``configs/classification/digits_fedgen.yaml``
uses it, with alpha = beta = 1 for that config's lr 0.05 and momentum 0.9).

State handling is FedFTG's (:class:`~fedreid.fl.server_hooks.fedftg.FedFTGHook`,
which this hook extends): the generator's weights and BatchNorm statistics,
its Adam state and the round counter persist, plus the feature size and the
last ``p^(y)``; a resumed run continues bit-exactly. Every random draw comes
from the round's ``torch.Generator`` seeded from ``(seed, "fedgen")``, the
initial weights from the hook's seed.

The hook's options are the objective's (``train.objective_options``,
:class:`~fedreid.fl.local.fedgen.FedGenOptions`): ``train.objective: fedgen``
adds this hook, as ``scaffold`` adds SCAFFOLD's server.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fedreid.fl.local.base import OBJECTIVE_PAYLOAD, cpu_clone
from fedreid.fl.local.fedgen import (
    DRAWN_COUNTS_KEY,
    GENERATOR_KEY,
    LABEL_PROBS_KEY,
    SPEC_KEY,
    FedGenOptions,
    head_of,
)
from fedreid.fl.server_hooks.base import HookContext, context_precision, register_hook
from fedreid.fl.server_hooks.fedftg import (
    CLASS_COUNTS,
    FedFTGHook,
    FedFTGInputError,
    TeacherEnsemble,
    cls_loss,
    diversity_loss,
    ensemble_weights,
    label_distribution,
    sample_labels,
)
from fedreid.fl.update import Update
from fedreid.models.classifiers import HEAD_PREFIX
from fedreid.models.feature_generator import FeatureGenerator
from fedreid.models.generator import sample_noise
from fedreid.options import NoOptions
from fedreid.utils.precision import FP32, Precision
from fedreid.utils.seeding import derive_seed, torch_generator

#: Official ``serverpFedGen.py``: a label is qualified (drawn by the generator's training) when
#: some participant's count, which starts at 1, exceeds this.
MIN_SAMPLES_PER_LABEL = 1


def generator_label_probs(class_counts: Any, mode: str = "counts") -> Tensor:
    """``p^(y)`` (float64 ``[C]``) from the participants' counts ``[K, C]``.

    "counts": ``sum_k n_k^y / sum n`` (FedGen Alg. 1; FedFTG's customised
    sampling, :func:`~fedreid.fl.server_hooks.fedftg.label_distribution`);
    "uniform": uniform over the labels some participant holds (``class_counts``
    > 0 for some row; on drawn label counts, official FedGen's
    ``qualified_labels``, see :func:`drawn_label_weights`).
    """
    probs = label_distribution(class_counts, "customized")
    if mode == "counts":
        return probs
    if mode != "uniform":
        raise FedFTGInputError(f"label sampling must be counts or uniform, got {mode!r}")
    held = (probs > 0).to(torch.float64)
    return held / held.sum()


def teacher_draw_weights(class_counts: Any, num_teachers: int, label_sampling: str, ensemble: str, *,
                         method: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(counts, label probabilities, teacher weights)`` of a round's generator training.

    ``class_counts`` ``[K, C]`` of the participants, one row per teacher;
    the labels are drawn from :func:`generator_label_probs` (``label_sampling``)
    and the teachers weighted by :func:`~fedreid.fl.server_hooks.fedftg.ensemble_weights`
    (``ensemble``). ``method`` names the caller in the error raised when the
    number of teachers and of count rows differ.
    """
    counts = torch.as_tensor(class_counts, dtype=torch.float64)
    if num_teachers != counts.shape[0]:
        raise FedFTGInputError(f"{method}: {num_teachers} teachers but class counts for {counts.shape[0]} clients")
    return counts, generator_label_probs(counts, label_sampling), ensemble_weights(counts, ensemble)


def drawn_label_weights(drawn_counts: Any, num_teachers: int, label_sampling: str, ensemble: str, *,
                        method: str = "fedgen") -> tuple[Tensor, Tensor, Tensor]:
    """Official ``serverpFedGen.py:get_label_weights`` on the labels the participants drew this round.

    ``drawn_counts`` ``[K, C]``: the labels of the batches each participant
    trained on (:data:`~fedreid.fl.local.fedgen.DRAWN_COUNTS_KEY`). The
    official counts start at 1 (``userpFedGen.py:UserpFedGen.clean_up_counts``),
    so ``counts = drawn_counts + 1`` and the teacher weights are
    ``ensemble_weights(counts, ensemble)`` (``class``: ``counts[k, y] / sum_i
    counts[i, y]``, the official ``np.array(weights) / np.sum(weights)``). The
    qualified labels are those with ``max_k counts[k, y] > MIN_SAMPLES_PER_LABEL``
    (= 1: some participant drew ``y``); ``label_sampling="uniform"`` draws
    them uniformly (official ``np.random.choice(self.qualified_labels, ...)``),
    ``"counts"`` in proportion to ``sum_k drawn_counts[k, y]`` (0 off the
    qualified labels). Returns ``(drawn_counts, label probabilities, teacher
    weights)`` as :func:`teacher_draw_weights` does.
    """
    drawn = torch.as_tensor(drawn_counts, dtype=torch.float64)
    if drawn.dim() != 2 or num_teachers != drawn.shape[0]:
        raise FedFTGInputError(f"{method}: {num_teachers} teachers but drawn label counts of shape "
                               f"{tuple(drawn.shape)}")
    if not bool(torch.isfinite(drawn).all()) or bool((drawn < 0).any()):
        raise FedFTGInputError(f"{method}: drawn label counts must be finite and >= 0")
    counts = drawn + 1.0
    qualified = counts.amax(dim=0) > MIN_SAMPLES_PER_LABEL
    if not bool(qualified.any()):
        raise FedFTGInputError(f"{method}: no participant trained on a batch this round (no qualified label)")
    if label_sampling == "uniform":
        probs = qualified.to(torch.float64) / qualified.sum()
    else:
        probs = generator_label_probs(drawn, label_sampling)
    return drawn, probs, ensemble_weights(counts, ensemble)


def fedgen_generator_loss(teacher_logits: Tensor, labels: Tensor, weights: Tensor, z: Tensor, samples: Tensor,
                          lambda_dis: float, *, teacher_loss: str = "weighted") -> tuple[Tensor, Tensor, Tensor]:
    """FedGen's generator objective ``(total, L_cls, L_dis)``.

    ``L_cls = 1/B sum_b sum_k weights[k, b] CE(teacher_logits[k, b], labels[b])``
    (``teacher_logits [K, B, C]``, ``weights[k, b] = alpha_k^{y_b}``) and
    ``total = L_cls + lambda_dis * L_dis(z, samples)``; ``L_dis`` is not
    computed (0) when ``lambda_dis`` is 0. ``teacher_loss="official"`` takes
    each client's weights at their batch mean (the official broadcast, module
    docstring): ``sum_k mean_b(weights[k]) * mean_b(CE_k)``.
    """
    if teacher_loss == "official":
        weights = weights.mean(dim=1, keepdim=True).expand_as(weights)
    elif teacher_loss != "weighted":
        raise FedFTGInputError(f"fedgen teacher_loss must be weighted or official, got {teacher_loss!r}")
    cls = cls_loss(teacher_logits, labels, weights)
    dis = diversity_loss(z, samples) if lambda_dis > 0 else cls.new_zeros(())
    return cls + lambda_dis * dis, cls, dis


def train_generator(gen_model: nn.Module, optimizer: torch.optim.Optimizer, ensemble: TeacherEnsemble,
                    probs: Tensor, weights: Tensor, *, steps: int, batch_size: int, lambda_dis: float,
                    generator: torch.Generator, device: torch.device,
                    precision: Precision = FP32, teacher_loss: str = "weighted",
                    labels: Optional[Tensor] = None, forwards: str = "once") -> dict[str, float]:
    """``steps`` optimiser steps of :func:`fedgen_generator_loss` (the generator in training mode).

    Per step: ``y ~ probs`` (or row ``i`` of ``labels`` ``[steps, batch_size]``,
    a schedule drawn in advance) and ``z ~ N(0, I)`` from ``generator``, samples
    ``G(z, y)``, the teachers' logits ``ensemble(G(z, y))`` (gradients reach
    the generator through them, never the teachers' weights), ``weights[:, y]``
    (``[K, C]`` -> ``[K, B]``). ``forwards="per_teacher"`` runs the generator
    once for ``L_dis`` and once more for each teacher, as FedFTG's official
    FedDF baseline does (``methods/local_fn_gan.py:train_global_model_feddf``):
    the samples are the same, but its BatchNorm running statistics take
    ``K + 1`` updates per step. Returns the means over the steps of ``cls``,
    ``dis``, ``loss`` and ``acc`` (how often the weighted ensemble's
    probabilities put ``y`` first). Used by FedGen (feature-level) and FedDF
    (input-level, FedFTG Sec. 4.1). The forwards run under ``precision``'s
    autocast; the loss is taken on fp32 logits and samples.
    """
    if forwards not in ("once", "per_teacher"):
        raise FedFTGInputError(f"generator forwards must be once or per_teacher, got {forwards!r}")
    if labels is not None and tuple(labels.shape) != (steps, batch_size):
        raise FedFTGInputError(f"label schedule has shape {tuple(labels.shape)}, expected ({steps}, {batch_size})")
    gen_model.train()
    scaler = precision.grad_scaler()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for step in range(steps):
        y = (sample_labels(probs, batch_size, generator) if labels is None else labels[step]).to(device)
        z = sample_noise(batch_size, gen_model.z_dim, generator, device=device)
        with precision.autocast():
            samples = gen_model(z, y)
            if forwards == "once":
                logits = ensemble(samples)
            else:
                logits = torch.stack([ensemble.one(k, gen_model(z, y)) for k in range(ensemble.num)])
        samples, logits = samples.float(), logits.float()
        w = weights[:, y]
        loss, cls, dis = fedgen_generator_loss(logits, y, w, z, samples, lambda_dis, teacher_loss=teacher_loss)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss, scaler)
        precision.step(optimizer, scaler)
        with torch.no_grad():
            votes = (torch.softmax(logits, dim=-1) * w.unsqueeze(-1)).sum(dim=0)
            acc = (votes.argmax(dim=1) == y).float().mean()
            sums += torch.stack([cls, dis, loss, acc]).detach().to(torch.float64)
    means = (sums / max(steps, 1)).tolist()
    return dict(zip(("gen_cls", "gen_dis", "gen_loss", "gen_acc"), means))


def head_teachers(teachers: Sequence[Any]) -> list[Any]:
    """The heads of whole client models (``model.classifier``) or of their state dicts (``classifier.*``)."""
    out: list[Any] = []
    for k, t in enumerate(teachers):
        if isinstance(t, nn.Module):
            out.append(head_of(t))
            continue
        head = {name[len(HEAD_PREFIX):]: v for name, v in t.items() if name.startswith(HEAD_PREFIX)}
        if not head:
            raise FedFTGInputError(f"fedgen: teacher {k}'s state has no {HEAD_PREFIX}* entries (the head)")
        out.append(head)
    return out


@register_hook
class FedGenHook(FedFTGHook):
    """FedGen's server: trains the feature generator on the clients' heads and broadcasts it.

    Built by ``train.objective: fedgen`` (its server half) from the
    objective's options; ``finetune(global_model, teachers, class_counts,
    generator)`` trains the generator (the global model is only read: its
    head is the template of the teachers' heads).
    """

    name = "fedgen"
    Options: ClassVar[type] = NoOptions
    tasks: ClassVar[tuple[str, ...]] = ("classification",)

    @classmethod
    def context_defaults(cls, context: HookContext) -> dict[str, Any]:
        return {}

    @classmethod
    def build(cls, options: Any, context: HookContext) -> "FedGenHook":
        objective = context.objective
        if not isinstance(objective, FedGenOptions):
            raise ValueError("the fedgen server hook runs with the fedgen client objective (train.objective=fedgen)")
        if not context.num_classes:
            raise ValueError("fedgen needs one label set shared by the clients and a classifier (task=classification)")
        train = context.cfg.train
        config = replace(
            objective,
            generator_batch_size=objective.generator_batch_size or int(train.batch_size),
            lr_decay=float(train.lr_round_decay) if objective.lr_decay is None else objective.lr_decay,
        )
        return cls(config, num_classes=context.num_classes, seed=derive_seed(context.seed, "fedgen"),
                   device=context.device, precision=context_precision(context))

    def __init__(self, config: Optional[FedGenOptions] = None, *, num_classes: Optional[int] = None, seed: int = 0,
                 device: Optional[torch.device | str] = None, precision: Precision = FP32) -> None:
        # The generator is built at the first round, when the head's input size is known.
        super().__init__(config if config is not None else FedGenOptions(), seed=seed, device=device,  # type: ignore[arg-type]
                         precision=precision)
        self.num_classes = num_classes
        self.feature_dim: Optional[int] = None
        self.label_probs: Optional[Tensor] = None

    def trains_model(self, round_index: int) -> bool:
        return False  # trains its generator; the global model is only read

    def _build(self, num_classes: int, device: torch.device) -> None:
        cfg: FedGenOptions = self.config  # type: ignore[assignment]
        if self.feature_dim is None:
            raise FedFTGInputError("fedgen: the generator's output size (the head's input) is not known yet")
        self.generator = FeatureGenerator(  # type: ignore[assignment]
            num_classes, self.feature_dim, z_dim=cfg.z_dim, embed_dim=cfg.embed_dim, hidden_dims=cfg.hidden_dims,
            seed=derive_seed(self.seed, "generator_init"),
        ).to(device)
        self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=cfg.generator_lr,
                                          betas=tuple(cfg.generator_betas),  # type: ignore[arg-type]
                                          weight_decay=cfg.generator_weight_decay)

    # ----------------------------------------------------------- server-hook protocol

    def instructions(self, round_index: int) -> dict[str, Any]:
        """Class counts from every client (``label_counts: training``); once trained, the generator and ``p^(y)``.

        With ``label_counts: drawn_plus_one`` no training counts are asked
        for: the clients' objective reports the labels it drew on its own.
        """
        out = super().instructions(round_index)
        if self._drawn_counts:
            out.pop(CLASS_COUNTS, None)
        if self.generator is not None and self.label_probs is not None:
            out[OBJECTIVE_PAYLOAD] = {
                GENERATOR_KEY: cpu_clone(self.generator.state_dict()),
                SPEC_KEY: self.generator.spec(),  # type: ignore[operator]
                LABEL_PROBS_KEY: self.label_probs.clone(),
            }
        return out

    @property
    def _drawn_counts(self) -> bool:
        return self.config.label_counts == "drawn_plus_one"  # type: ignore[attr-defined]

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """FedFTG's check of the counts, on the drawn label counts under ``label_counts: drawn_plus_one``."""
        if not self._drawn_counts:
            return super().check_update(round_index, update, model)
        if DRAWN_COUNTS_KEY not in update.metadata:
            return f"no {DRAWN_COUNTS_KEY} (train.objective_options.label_counts: drawn_plus_one)"
        view = replace(update, metadata={CLASS_COUNTS: update.metadata[DRAWN_COUNTS_KEY]})
        problem = super().check_update(round_index, view, model)
        return None if problem is None else problem.replace(CLASS_COUNTS, DRAWN_COUNTS_KEY)

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        """Trains the generator on the participants' heads, weighted by their counts (``label_counts``)."""
        if not self._drawn_counts:
            return super().after_aggregate(round_index, model, updates)
        missing = [u.client for u in updates if DRAWN_COUNTS_KEY not in u.metadata]
        if missing:
            raise FedFTGInputError(f"fedgen round {round_index}: client {missing[0]!r} sent no {DRAWN_COUNTS_KEY}")
        counts = torch.stack([torch.as_tensor(u.metadata[DRAWN_COUNTS_KEY], dtype=torch.float64) for u in updates])
        gen = torch_generator(self.seed, "fedftg", round_index)  # the stream FedFTGHook.after_aggregate uses
        return self.finetune(model, [u.state for u in updates], counts, gen, round_index=round_index)

    def finetune(self, global_model: nn.Module, teachers: Sequence[Any], class_counts: Any,
                 generator: torch.Generator, *, round_index: Optional[int] = None) -> dict[str, Any]:
        """Eq. 4: ``generator_steps`` Adam steps of the generator against the teachers' heads.

        ``teachers``: the participants' models or state dicts (their heads are
        used), in the order of the rows of ``class_counts`` ``[K, C]``: their
        training counts, or under ``label_counts: drawn_plus_one`` the labels
        they drew this round (:func:`drawn_label_weights` adds the one).
        """
        started = time.perf_counter()
        cfg: FedGenOptions = self.config  # type: ignore[assignment]
        draw_weights = drawn_label_weights if self._drawn_counts else teacher_draw_weights
        counts, probs, weights = draw_weights(class_counts, len(teachers), cfg.label_sampling, cfg.ensemble,
                                              method="fedgen")
        head = head_of(global_model)
        if self.feature_dim is None:
            self.feature_dim = head.in_features
        if (self.feature_dim, counts.shape[1]) != (head.in_features, head.out_features):
            raise FedFTGInputError(f"fedgen: the head is Linear({head.in_features}, {head.out_features}), the "
                                   f"generator makes {self.feature_dim}-d features for {counts.shape[1]} classes")
        device = self.device or head.weight.device
        gen_model = self._ready(counts.shape[1], device)
        round_index = self.rounds_done if round_index is None else int(round_index)
        lr = cfg.generator_lr * (1.0 if cfg.lr_decay is None else cfg.lr_decay) ** round_index
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        try:
            with TeacherEnsemble(head, head_teachers(teachers), "loop", device) as heads:
                means = train_generator(gen_model, self.optimizer, heads, probs, weights.to(device, torch.float32),
                                        steps=cfg.generator_steps, batch_size=cfg.generator_batch_size or 2,
                                        lambda_dis=cfg.lambda_dis, generator=generator, device=device,
                                        precision=self.precision, teacher_loss=cfg.teacher_loss)
        finally:
            gen_model.eval()
        self.label_probs = probs.clone()
        self.rounds_done = round_index + 1
        metrics: dict[str, Any] = {f"fedgen_{k}": v for k, v in means.items()}
        metrics.update({"fedgen_round": round_index, "fedgen_teachers": len(teachers), "fedgen_generator_lr": lr,
                        "fedgen_seconds": time.perf_counter() - started})
        return metrics

    # ----------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """FedFTG's (generator, its Adam state, rounds done), plus the feature size and the last ``p^(y)``."""
        state = super().state_dict()
        state["feature_dim"] = self.feature_dim
        state["label_probs"] = None if self.label_probs is None else self.label_probs.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.feature_dim = None if state.get("feature_dim") is None else int(state["feature_dim"])
        probs = state.get("label_probs")
        self.label_probs = None if probs is None else torch.as_tensor(probs, dtype=torch.float64).clone()
        super().load_state_dict(state)


__all__ = [
    "MIN_SAMPLES_PER_LABEL",
    "FedGenHook",
    "drawn_label_weights",
    "fedgen_generator_loss",
    "generator_label_probs",
    "teacher_draw_weights",
    "head_teachers",
    "train_generator",
]
