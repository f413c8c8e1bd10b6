"""FedGen's client (Zhu, Hong, Zhou, ICML 2021, "Data-Free Knowledge Distillation for
Heterogeneous Federated Learning"), and the options of both halves.

FedGen's server (:mod:`fedreid.fl.server_hooks.fedgen`) learns a lightweight
*feature-level* conditional generator ``G(z, y)``
(:class:`~fedreid.models.feature_generator.FeatureGenerator`) whose outputs the
ensemble of the clients' heads classifies as ``y`` (Eq. 4), and broadcasts it
with the label prior ``p^(y)`` (Algorithm 1, "broadcast w, theta, p^(y)").
Each client then regularises its local training with it (Eq. 5)::

    J(theta_k) = CE(h(f(x)), y)                                   (own data)
               + alpha_t * (B^ / B) * CE(h(G(z^, y^)), y^)          y^ ~ p^(y), z^ ~ N(0, I)
               + beta_t  * KL(sigma(h(G(z, y))) || sigma(h(f(x))))  (y: the batch's own labels)

``h`` is the local classifier head (``model.classifier``, the last Linear;
FedFTG appendix 7.3: "l in FedGen is L - 1"), ``G`` is frozen (eval mode:
BatchNorm with the running statistics of the server's training; no gradient
reaches it), the generated features go through the head only, so the
``alpha`` term trains the head. What each term is and where it comes from:

* ``alpha`` term: Eq. 5 of the paper (the expected loss of the local
  predictor on the generator's features for ``y^ ~ p^(y)``); the official
  code (github.com/zhuangdizhu/FedGen, ``FLAlgorithms/users/userpFedGen.py``)
  averages the cross-entropy over ``B^ = gen_batch_size`` generated features
  and multiplies it by ``gen_ratio = B^ / B`` ("to further balance
  oversampled down-sampled synthetic data"), as here.
* ``beta`` term: not in Eq. 5, but in the official client (``user_latent_loss
  = generative_beta * KLDivLoss(batchmean)(log sigma(h(f(x))), sigma(h(G(y))))``):
  the generator's features for the batch's *own* labels, through the local
  head, give a (detached) target distribution for the prediction on the
  real images. ``beta = 0`` gives the paper's Eq. 5 alone.
* ``alpha_t = max(floor, alpha * decay^t)`` and likewise ``beta_t``: the
  official ``exp_lr_scheduler(glob_iter, decay=0.98)`` with floor ``1e-4``.
  Defaults ``alpha = beta = 10`` are the official MNIST/CelebA values
  (``utils/model_config.py`` ``RUNCONFIGS``: ``generative_alpha``,
  ``generative_beta``); neither paper gives others for CIFAR.
* The regulariser is off in the first round: the server sends no generator
  before it has trained one (the official server passes
  ``regularization = glob_iter > 0``). A round without a generator in the
  payload is plain cross-entropy.
* ``y^``: drawn from the ``p^(y)`` the server sends (Algorithm 1;
  ``client_label_sampling: prior``, with ``label_sampling: uniform`` that is
  uniform over the labels some participating client holds). With
  ``client_label_sampling: available`` they are uniform over every label of
  the label space, as the official clients draw them
  (``userpFedGen.py:UserpFedGen.train``: ``np.random.choice(self.available_labels,
  gen_batch_size)``), ``available_labels`` being every label of every
  client's training data, fixed for the run
  (``utils/model_utils.py:aggregate_user_data``). The two sets agree
  wherever every class has a training image, since every partition
  (:mod:`fedreid.data.partition`) hands every training image to some client.
* The official client runs the regulariser only while ``epoch < early_stop``
  (``userpFedGen.py:UserpFedGen.train``; ``early_stop = 20`` from
  ``serverpFedGen.py:FedGen.__init__``). An official local "epoch" is ``K``
  batches (``userbase.py:User.get_next_train_batch`` in a loop of ``K``;
  ``K = 1`` in every command of its README), not a pass over the data, so its
  rule is "the first ``20 * K`` local steps of a round":
  ``regularizer_steps: 20`` with ``K = 1``. Its README runs have
  ``local_epochs = 20`` steps per round, so the rule never switches the
  regulariser off there. ``regularizer_steps: null`` (default) regularises
  every step.
* Label counts for the server (``label_counts: drawn_plus_one``): the client
  counts the labels of every real batch its local training uses this round
  (every batch :meth:`FedGen.loss` sees, the first round's included; partial
  batches skipped under ``train.drop_last`` are not used, so not counted) and
  reports them in the update's metadata under :data:`DRAWN_COUNTS_KEY`; the
  server adds the one (official ``userpFedGen.py:UserpFedGen.clean_up_counts``
  starts every label at 1 each round, ``update_label_counts`` adds the labels
  of each batch ``get_next_train_batch(count_labels=True)`` drew; the server's
  use is :func:`fedreid.fl.server_hooks.fedgen.drawn_label_weights`). With
  ``label_counts: training`` (default) the server asks for the clients'
  training counts instead (``class_counts``).

Randomness. The objective is not told which client it serves, so its draws
(``y^``, ``z^``, ``z``) come from a ``torch.Generator`` seeded, on the first
loss of a round, from torch's global RNG -- which the client's round runs
inside, forked and seeded per client and round
(:meth:`fedreid.fl.client.Client.fit`: ``forked_torch_rng(derive_seed(seed,
"client", round, index, "dropout"))``). A resumed run therefore redraws
exactly; the draws are made on the CPU and moved, so they do not depend on
the device.

Options: :class:`FedGenOptions` holds the client's and the server's options
(the server hook is added by ``train.objective: fedgen`` and reads them from
``train.objective_options``, as FedDyn's server reads its ``alpha``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.local.base import LocalObjective, ObjectiveError, kl_teacher_student, register_objective
from fedreid.models.feature_generator import DEFAULT_EMBED_DIM, FeatureGenerator
from fedreid.models.generator import sample_noise

#: Keys of the objective payload the FedGen server sends (``OBJECTIVE_PAYLOAD``).
GENERATOR_KEY = "generator"
SPEC_KEY = "generator_spec"
LABEL_PROBS_KEY = "label_probs"
#: Key of the update metadata under which a client reports the labels of the batches it
#: trained on this round (``label_counts: drawn_plus_one``), float32 ``[C]``.
DRAWN_COUNTS_KEY = "fedgen_drawn_counts"

LABEL_SAMPLINGS: tuple[str, ...] = ("counts", "uniform")
LABEL_COUNTS: tuple[str, ...] = ("training", "drawn_plus_one")
CLIENT_LABEL_SAMPLINGS: tuple[str, ...] = ("prior", "available")


@dataclass
class FedGenOptions:
    """Options of ``train.objective: fedgen``: the client's regulariser and the server's generator."""

    #: Weight alpha of the generated-feature cross-entropy ``CE(h(G(z, y^)), y^)`` (Eq. 5; official ``generative_alpha``).
    alpha: float = 10.0
    #: Weight beta of ``KL(sigma(h(G(z, y))) || sigma(logits))`` on the client's own batch (official ``generative_beta``; 0: Eq. 5 alone).
    beta: float = 10.0
    #: alpha and beta are multiplied by ``regularizer_decay ** round`` (official ``exp_lr_scheduler``, 0.98).
    regularizer_decay: float = 0.98
    #: Lower bound of the decayed alpha and beta (official: 1e-4).
    regularizer_floor: float = 1e-4
    #: Generated features per local batch (null: as many as the real batch); the CE term is scaled by this / batch size.
    gen_batch_size: Optional[int] = None
    #: Server: Adam steps on the generator per round (official: 10 epochs x 5 teacher iterations).
    generator_steps: int = 50
    #: Server: labels per generator step (null: ``train.batch_size``, as the official server).
    generator_batch_size: Optional[int] = None
    #: Server: generator Adam learning rate (FedFTG appendix 7.3: 0.01 for FedGen and FedDF).
    generator_lr: float = 0.01
    #: Server: generator Adam betas.
    generator_betas: tuple[float, float] = (0.9, 0.999)
    #: Server: generator Adam weight decay (FedFTG: none; official FedGen: 1e-2).
    generator_weight_decay: float = 0.0
    #: Server: the generator learning rate is ``generator_lr * lr_decay ** round`` (null: ``train.lr_round_decay``; FedFTG: 0.998).
    lr_decay: Optional[float] = None
    #: Server: weight of FedGen's diversity loss (official ``ensemble_eta``; 0 drops it).
    lambda_dis: float = 1.0
    #: Label prior p^(y) of the server's draws and (``client_label_sampling: prior``) the clients': ``counts`` (the participants' label counts, Alg. 1) or ``uniform`` over the labels they hold (with ``label_counts: drawn_plus_one``: the labels they drew, official ``serverpFedGen.py:train_generator``'s ``qualified_labels``).
    label_sampling: Literal["counts", "uniform"] = "counts"
    #: Server: teacher weights per label, ``class`` (n_k^y / sum_i n_i^y, the form of official ``serverpFedGen.py:get_label_weights``) or ``client_size`` (n_k / n); n_k^y as ``label_counts`` says.
    ensemble: Literal["class", "client_size"] = "class"
    #: The counts n_k^y the server weighs the teachers by and draws its labels from: ``training`` (each client's training images per label) or ``drawn_plus_one`` (official ``userpFedGen.py:UserpFedGen.clean_up_counts`` and ``update_label_counts``: the labels of the batches the client trained on this round, plus 1, in ``serverpFedGen.py:get_label_weights``; the server draws only labels some participant drew, its ``qualified_labels``).
    label_counts: Literal["training", "drawn_plus_one"] = "training"
    #: Labels y^ of the clients' generated features: ``prior`` (the server's p^(y), Alg. 1) or ``available`` (uniform over all labels: official ``userpFedGen.py:UserpFedGen.train``, ``np.random.choice(self.available_labels, ...)``).
    client_label_sampling: Literal["prior", "available"] = "prior"
    #: The regulariser runs in the first this many local steps of each round (null: in every step; official ``userpFedGen.py:UserpFedGen.train``, ``epoch < early_stop``, ``early_stop = 20``, an official epoch being ``K = 1`` batch: 20).
    regularizer_steps: Optional[int] = None
    #: Server: the generator's teacher loss, ``weighted`` (each sample's CE weighted by its label's ``alpha_k^y``: FedFTG's ``L_cls``) or ``official`` (``serverpFedGen.py:train_generator`` broadcasts ``[B]`` losses against ``[B, 1]`` weights: each client's mean CE times the batch mean of its weights).
    teacher_loss: Literal["weighted", "official"] = "weighted"
    #: Noise dimension d (null: 100, 256 for 100+ classes; FedFTG appendix 7.4).
    z_dim: Optional[int] = None
    #: Width of each embedding branch, ``FC(z)`` and ``FC(onehot(y))`` (Table 7(b): 4096).
    embed_dim: int = DEFAULT_EMBED_DIM
    #: Widths of the ``FC, BN, LeakyReLU`` blocks (null: one block of 2 * embed_dim, Table 7(b)).
    hidden_dims: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if isinstance(self.generator_betas, list):
            self.generator_betas = tuple(self.generator_betas)  # type: ignore[assignment]
        if isinstance(self.hidden_dims, list):
            self.hidden_dims = tuple(self.hidden_dims)
        for name in ("alpha", "beta", "regularizer_floor", "generator_lr", "generator_weight_decay", "lambda_dis"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ObjectiveError(f"fedgen {name} must be a finite number >= 0, got {value}")
        for name in ("regularizer_decay", "lr_decay"):
            value = getattr(self, name)
            if value is not None and not 0 < float(value) <= 1:
                raise ObjectiveError(f"fedgen {name} must be in (0, 1], got {value}")
        for name in ("gen_batch_size", "generator_batch_size", "z_dim"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ObjectiveError(f"fedgen {name} must be >= 1 or null, got {value}")
        if self.generator_batch_size is not None and self.generator_batch_size < 2:
            raise ObjectiveError("fedgen generator_batch_size must be >= 2 (BatchNorm and the diversity loss)")
        if int(self.generator_steps) < 0 or int(self.embed_dim) < 1:
            raise ObjectiveError(f"fedgen generator_steps must be >= 0 and embed_dim >= 1, got "
                                 f"{self.generator_steps}, {self.embed_dim}")
        if self.hidden_dims is not None and any(int(h) < 1 for h in self.hidden_dims):
            raise ObjectiveError(f"fedgen hidden_dims must be positive, got {self.hidden_dims}")
        if self.label_sampling not in LABEL_SAMPLINGS:
            raise ObjectiveError(f"fedgen label_sampling must be one of {', '.join(LABEL_SAMPLINGS)}")
        if self.ensemble not in ("class", "client_size"):
            raise ObjectiveError("fedgen ensemble must be class or client_size")
        if self.teacher_loss not in ("weighted", "official"):
            raise ObjectiveError("fedgen teacher_loss must be weighted or official")
        if self.label_counts not in LABEL_COUNTS:
            raise ObjectiveError(f"fedgen label_counts must be one of {', '.join(LABEL_COUNTS)}, got {self.label_counts!r}")
        if self.client_label_sampling not in CLIENT_LABEL_SAMPLINGS:
            raise ObjectiveError(f"fedgen client_label_sampling must be one of {', '.join(CLIENT_LABEL_SAMPLINGS)}, "
                                 f"got {self.client_label_sampling!r}")
        if self.regularizer_steps is not None and int(self.regularizer_steps) < 0:
            raise ObjectiveError(f"fedgen regularizer_steps must be an integer >= 0 or null, got {self.regularizer_steps}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def regularizer_weight(initial: float, decay: float, round_index: int, floor: float = 1e-4) -> float:
    """``max(floor, initial * decay ** round_index)`` (official ``exp_lr_scheduler``); 0 stays 0."""
    if initial == 0:
        return 0.0
    return max(float(floor), float(initial) * float(decay) ** int(round_index))


def fedgen_regularizer(
    head: nn.Module,
    logits: Tensor,
    own_features: Tensor,
    gen_features: Tensor,
    gen_labels: Tensor,
    *,
    alpha: float,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """FedGen's client terms on one batch: ``(total, ce_gen, kl_own)``.

    ``total = alpha * (B^ / B) * ce_gen + beta * kl_own`` with
    ``ce_gen = mean_b CE(head(gen_features), gen_labels)`` (``B^`` rows) and
    ``kl_own = mean_b KL(sigma(head(own_features)) || sigma(logits))`` (``B``
    rows; the target is detached). ``logits`` are the local model's on the
    real batch, ``own_features`` the generator's for that batch's labels.
    Gradients reach ``logits`` and the head's weights (through
    ``head(gen_features)``), never the generator's features.
    """
    batch = logits.shape[0]
    ce_gen = F.cross_entropy(head(gen_features.detach()), gen_labels.long())
    with torch.no_grad():
        target = torch.softmax(head(own_features.detach()), dim=1)
    kl_own = kl_teacher_student(target, F.log_softmax(logits, dim=1)).mean()
    total = alpha * (gen_features.shape[0] / batch) * ce_gen + beta * kl_own
    return total, ce_gen, kl_own


def head_of(model: nn.Module) -> nn.Linear:
    """``model.classifier``, the last Linear (the head FedGen's generator feeds)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise ObjectiveError(
            f"fedgen needs a classifier whose last layer is model.classifier (nn.Linear); "
            f"{type(model).__name__} has {type(head).__name__}"
        )
    return head


@register_objective
class FedGen(LocalObjective):
    """``CE + alpha_t * (B^/B) * CE(h(G(z^, y^)), y^) + beta_t * KL(sigma(h(G(z, y))) || sigma(logits))``.

    See the module docstring; the generator and ``p^(y)`` arrive in the round's
    objective payload (:mod:`fedreid.fl.server_hooks.fedgen`). With
    ``label_counts: drawn_plus_one`` :meth:`end_round` returns the labels of
    the round's batches under :data:`DRAWN_COUNTS_KEY`.
    """

    name = "fedgen"
    Options: ClassVar[type] = FedGenOptions
    server_hook: ClassVar[Optional[str]] = "fedgen"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = FedGenOptions(**options)
        self._generator: Optional[FeatureGenerator] = None
        self._probs: Optional[Tensor] = None
        self._rng: Optional[torch.Generator] = None
        self._drawn: Optional[Tensor] = None
        self.alpha_t = 0.0
        self.beta_t = 0.0

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        self._generator, self._probs, self._rng, self._drawn = None, None, None, None
        o = self.options
        if o.label_counts == "drawn_plus_one":
            # counted on the head's device, read once in end_round (no host sync per step)
            head = head_of(model)
            self._drawn = torch.zeros(head.out_features, dtype=torch.int64, device=head.weight.device)
        if not payload or GENERATOR_KEY not in payload:
            return  # no trained generator yet (the first round): plain cross-entropy
        head = head_of(model)
        spec = dict(payload[SPEC_KEY])
        if int(spec["feature_dim"]) != head.in_features or int(spec["num_classes"]) != head.out_features:
            raise ObjectiveError(
                f"fedgen: the server's generator makes {spec['feature_dim']}-d features for {spec['num_classes']} "
                f"classes, the local head is Linear({head.in_features}, {head.out_features})"
            )
        with torch.device("meta"):  # no initialisation work: every tensor comes from the payload
            generator = FeatureGenerator(**spec)
        generator = generator.to_empty(device=head.weight.device)
        generator.load_state_dict(dict(payload[GENERATOR_KEY]))
        self._generator = generator.eval().requires_grad_(False)
        probs = torch.as_tensor(payload[LABEL_PROBS_KEY], dtype=torch.float64).cpu()
        if probs.shape != (head.out_features,) or not bool(torch.isfinite(probs).all()) or probs.sum() <= 0:
            raise ObjectiveError(f"fedgen: label_probs must be {head.out_features} finite weights, got {probs}")
        if o.client_label_sampling == "available":
            probs = torch.full((head.out_features,), 1.0 / head.out_features, dtype=torch.float64)
        self._probs = probs
        self.alpha_t = regularizer_weight(o.alpha, o.regularizer_decay, round_index, o.regularizer_floor)
        self.beta_t = regularizer_weight(o.beta, o.regularizer_decay, round_index, o.regularizer_floor)

    def _draws(self) -> torch.Generator:
        """This round's generator, seeded once from the (client-forked, seeded) global CPU RNG."""
        if self._rng is None:
            self._rng = torch.Generator()
            self._rng.manual_seed(int(torch.randint(0, 2**62, (1,))))
        return self._rng

    def regularizes(self) -> bool:
        """Whether this step (the ``steps``-th of the round, 0-based) adds the regulariser."""
        limit = self.options.regularizer_steps
        return self._generator is not None and (limit is None or self.steps < int(limit))

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        ce = super().loss(model, images, labels, logits, features)
        if self._drawn is not None:  # official update_label_counts: every real batch, with or without a generator
            self._drawn += torch.bincount(labels.reshape(-1).long().to(self._drawn.device),
                                          minlength=self._drawn.numel())
        if not self.regularizes():
            return ce
        gen = self._generator
        assert gen is not None and self._probs is not None
        rng = self._draws()
        device = logits.device
        batch = labels.shape[0]
        gen_batch = self.options.gen_batch_size or batch
        gen_labels = torch.multinomial(self._probs, gen_batch, replacement=True, generator=rng).to(device)
        with torch.no_grad():
            own = gen(sample_noise(batch, gen.z_dim, rng, device=device), labels.to(device))
            fake = gen(sample_noise(gen_batch, gen.z_dim, rng, device=device), gen_labels)
        total, ce_gen, kl_own = fedgen_regularizer(head_of(model), logits, own, fake, gen_labels,
                                                   alpha=self.alpha_t, beta=self.beta_t)
        self.last_terms.update({"fedgen_ce": ce_gen.detach(), "fedgen_kl": kl_own.detach()})
        return ce + total

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        out = super().end_round(model)
        if self._drawn is not None:
            out[DRAWN_COUNTS_KEY] = self._drawn.to("cpu", torch.float32)
        self._generator, self._probs, self._rng, self._drawn = None, None, None, None
        return out

    def __repr__(self) -> str:
        o = self.options
        return f"FedGen(alpha={o.alpha}, beta={o.beta}, regularizer_decay={o.regularizer_decay})"


__all__ = [
    "DRAWN_COUNTS_KEY",
    "GENERATOR_KEY",
    "LABEL_PROBS_KEY",
    "SPEC_KEY",
    "FedGen",
    "FedGenOptions",
    "fedgen_regularizer",
    "head_of",
    "regularizer_weight",
]
