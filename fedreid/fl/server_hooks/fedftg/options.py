"""FedFTG's options: :class:`FedFTGConfig`, its choices and errors, and the metadata key it asks clients for.

Every field defaults to the paper's method (Algorithm 1, Eq. 3-8); the
official code's behaviour is one call away (:meth:`FedFTGConfig.official`).
Why each official variant exists, and where the paper and the official code
differ: ``docs/methods/fedftg.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Mapping, Optional, Union

from fedreid.errors import FedReIDError
from fedreid.models.generator import LAYER_ORDERS

MDDivergence = Literal["kl", "kl_teacher_first", "l1"]
LabelSampling = Literal["customized", "uniform", "stratified"]
EnsembleWeighting = Literal["class", "uniform", "client_size"]
GeneratorUpdate = Literal["joint", "per_client"]
GlobalBN = Literal["eval", "train"]
GeneratorBN = Literal["batch", "running"]
TeacherForward = Literal["loop", "vmap"]
PairMetric = Literal["l1", "l2", "cosine"]

MD_DIVERGENCES: tuple[str, ...] = ("kl", "kl_teacher_first", "l1")
LABEL_SAMPLINGS: tuple[str, ...] = ("customized", "uniform", "stratified")
ENSEMBLE_WEIGHTINGS: tuple[str, ...] = ("class", "uniform", "client_size")
GENERATOR_UPDATES: tuple[str, ...] = ("joint", "per_client")
GLOBAL_BNS: tuple[str, ...] = ("eval", "train")
GENERATOR_BNS: tuple[str, ...] = ("batch", "running")
TEACHER_FORWARDS: tuple[str, ...] = ("loop", "vmap")
PAIR_METRICS: tuple[str, ...] = ("l1", "l2", "cosine")

#: Update metadata key: the client's per-class training sample counts ``[C]``.
CLASS_COUNTS = "class_counts"

#: Why FedFTG is refused on FedPav's shared backbone (``task=reid``); the config
#: error says it, ``docs/methods/fedftg.md`` explains it.
NOT_FOR_FEDPAV = (
    "FedFTG does not apply to FedPav's shared backbone (task=reid), so it runs with task=classification only. "
    "Every part of it needs one label set shared by all clients and a classifier over it on the server: the "
    "generator G(z, y) is conditioned on a class label y drawn from p(y) ~ sum_k n_k^y, each teacher is weighted "
    "per class by alpha_k^y = n_k^y / sum_i n_i^y, and L_md / L_cls compare the global model's and the clients' "
    "logits over those classes (Eq. 3-8). In FedPav each client's identity head is private (it never leaves the "
    "client) and the identities of different clients are disjoint, so the server has no classifier, no two "
    "clients' logits share a class, and there is no label y to condition the generator on or to weight teachers "
    "by. It would need a label space common to all clients with a head the server holds (e.g. a public identity "
    "set every client trains on), or a label-free variant that distils the shared 512-d features -- which is "
    "FedPav's own public-set knowledge distillation (fl.kd=true), not FedFTG."
)


class FedFTGConfigError(FedReIDError, ValueError):
    """A FedFTG option out of range or not one of its choices."""


class FedFTGInputError(FedReIDError, ValueError):
    """Teachers, class counts or states that do not fit together."""


@dataclass
class FedFTGConfig:
    """FedFTG server fine-tuning; defaults: the paper's method (Algorithm 1, Eq. 3-8).

    Fields: the schedule (Algorithm 1), the objective's weights (Eq. 8), the
    two optimisers (Sec. 4.1; numeric defaults are the official code's), the
    generator (Table 7), the Table 4 ablations, the official-code variants
    (all set by :meth:`official`) and engineering switches; each is described
    by the ``#:`` comment above it. The paper-vs-official-code table and the
    measurements behind the defaults: ``docs/methods/fedftg.md``.
    """

    #: Outer iterations I per round (Algorithm 1; paper: 10); >= 0.
    iterations: int = 10
    #: Generator steps I_g per iteration (Algorithm 1; paper: 1); >= 0.
    generator_steps: int = 1
    #: Global-model SGD steps I_d per iteration, on that iteration's fixed pseudo batch (Algorithm 1; paper: 5); >= 0.
    global_steps: int = 5
    #: Pseudo samples per iteration (Sec. 4.1: 50, the clients' batch size); >= 2 (``L_dis`` compares pairs).
    batch_size: int = 50
    #: Weight ``lambda_cls`` of ``L_cls`` in the generator's objective (Eq. 8; paper: 1); >= 0.
    lambda_cls: float = 1.0
    #: Weight ``lambda_dis`` of ``L_dis`` in the generator's objective (Eq. 8; paper: 1); >= 0.
    lambda_dis: float = 1.0
    #: Generator Adam learning rate (Sec. 4.1: 0.01), multiplied by ``lr_decay ** round``; >= 0.
    generator_lr: float = 0.01
    #: Generator Adam betas.
    generator_betas: tuple[float, float] = (0.9, 0.999)
    #: Global-model SGD learning rate (Sec. 4.1: 0.1; in a run: ``train.lr``), multiplied by ``lr_decay ** round``; >= 0.
    global_lr: float = 0.1
    #: Global-model SGD momentum (official code: none); >= 0.
    global_momentum: float = 0.0
    #: Global-model SGD weight decay (Sec. 4.1: 1e-3; in a run: ``train.weight_decay``); >= 0.
    global_weight_decay: float = 1e-3
    #: Both learning rates are multiplied by ``lr_decay ** round`` (Sec. 4.1: 0.998; in a run:
    #: ``train.lr_round_decay``); in (0, 1].
    lr_decay: float = 0.998
    #: Noise dimension (null: 100, 256 for >= 100 classes; Sec. 4.1, Table 7); >= 1.
    z_dim: Optional[int] = None
    #: Pseudo image size, one int or ``[height, width]`` (in a run: the data's).
    image_size: Union[int, tuple[int, int]] = 32
    #: Pseudo image channels (in a run: the data's).
    image_channels: int = 3
    #: Generator width ngf (Table 7(a): 64).
    generator_channels: int = 64
    #: BatchNorm (no affine) after the generator's Tanh (official code; Table 7(a) has none).
    generator_output_norm: bool = False
    #: ``paper`` (Table 7(a): convolution, then upsampling) or ``official`` (``CGeneratorA``: upsampling,
    #: then convolution).
    generator_layer_order: str = "paper"
    # Table 4 ablations
    #: The generator maximises ``L_md`` (hard-sample mining, Eq. 8); false (Table 4 ablation): it only
    #: minimises ``lambda_cls L_cls + lambda_dis L_dis``.
    hard_sample_mining: bool = True
    #: ``L_cls`` (Eq. 5-6) in the generator's objective; false: the Table 4 ablation.
    use_cls_loss: bool = True
    #: ``L_dis`` (Eq. 7) in the generator's objective; false: the Table 4 ablation.
    use_dis_loss: bool = True
    #: Pseudo labels: ``customized`` (``y ~ p_t(y)``, paper), ``uniform`` over all classes (Table 4 ablation)
    #: or ``stratified`` (official: allotted in proportion to ``p_t``, shuffled).
    label_sampling: LabelSampling = "customized"
    #: Teacher weights: ``class`` (``alpha^{k,y} = n_k^y / sum_i n_i^y``, paper), ``uniform``
    #: (``1 / |S_t|``, Sec. 3.2's "widely used" weights: the Table 4 ablation) or ``client_size`` (``n_k / n``).
    ensemble: EnsembleWeighting = "class"
    # official-code variants
    #: The global model's ``L_md``: ``kl`` (``KL(global || teacher)``, Eq. 3-4), ``kl_teacher_first``
    #: (official; stabler at extreme label skew) or ``l1`` (mean absolute logit difference).
    md_divergence: MDDivergence = "kl"
    #: The generator's ``L_md`` divergence (null: ``md_divergence``; official: ``l1``): ``kl``, ``kl_teacher_first``
    #: or ``l1``.
    generator_md_divergence: Optional[MDDivergence] = None
    #: Divide the KL values of ``L_md`` by the number of classes (official global step).
    md_class_mean: bool = False
    #: The generator's ``L_md`` gradient flows through the teachers too (paper); false: teacher logits detached
    #: (official).
    md_teacher_grad: bool = True
    #: Generator step: ``joint`` (one Adam step on the summed objective per ``I_g``) or ``per_client``
    #: (official: one Adam step per teacher).
    generator_update: GeneratorUpdate = "joint"
    #: The global model's BatchNorm while fine-tuning: ``eval`` (running statistics frozen) or ``train``
    #: (official: batch statistics of the synthetic batch, running statistics overwritten).
    global_bn: GlobalBN = "eval"
    #: The generator's BatchNorm in the global step: ``batch`` (batch statistics, as in its own step) or
    #: ``running`` (official).
    generator_bn: GeneratorBN = "batch"
    #: Re-create the generator's Adam every round (official); false: its state persists across rounds and checkpoints.
    reset_generator_optimizer: bool = False
    #: Image distance of ``L_dis`` (Eq. 7; official ``l1``, a per-dimension mean): ``l1``, ``l2`` or ``cosine``.
    dis_image_metric: PairMetric = "l1"
    #: Noise distance of ``L_dis`` (Eq. 7; official ``l2``, a per-dimension mean): ``l1``, ``l2`` or ``cosine``.
    dis_noise_metric: PairMetric = "l2"
    # engineering
    #: How the teachers run: ``loop`` (one after another, the faster on CPU) or ``vmap`` (batched); same results.
    teacher_forward: TeacherForward = "loop"
    #: Where ``L_md`` before/after is reported (logging only): 0 on the last iteration's pseudo batch,
    #: ``n >= 1`` on ``n`` fresh pseudo batches of the final generator.
    eval_batches: int = 0
    def __post_init__(self) -> None:
        if isinstance(self.image_size, list):
            self.image_size = tuple(self.image_size)  # type: ignore[assignment]
        if isinstance(self.generator_betas, list):
            self.generator_betas = tuple(self.generator_betas)  # type: ignore[assignment]
        for name in ("iterations", "generator_steps", "global_steps", "eval_batches"):
            if int(getattr(self, name)) < 0:
                raise FedFTGConfigError(f"fedftg.{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 2:
            # L_dis compares pairs; BatchNorm needs two samples in train mode.
            raise FedFTGConfigError(f"fedftg.batch_size must be >= 2, got {self.batch_size}")
        for name in ("lambda_cls", "lambda_dis", "generator_lr", "global_lr", "global_weight_decay",
                     "global_momentum"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise FedFTGConfigError(f"fedftg.{name} must be a finite number >= 0, got {value}")
        if not 0 < float(self.lr_decay) <= 1:
            raise FedFTGConfigError(f"fedftg.lr_decay must be in (0, 1], got {self.lr_decay}")
        if self.z_dim is not None and self.z_dim < 1:
            raise FedFTGConfigError(f"fedftg.z_dim must be >= 1 or None, got {self.z_dim}")
        choices = {
            "md_divergence": MD_DIVERGENCES,
            "label_sampling": LABEL_SAMPLINGS,
            "ensemble": ENSEMBLE_WEIGHTINGS,
            "generator_update": GENERATOR_UPDATES,
            "global_bn": GLOBAL_BNS,
            "generator_bn": GENERATOR_BNS,
            "teacher_forward": TEACHER_FORWARDS,
            "dis_image_metric": PAIR_METRICS,
            "dis_noise_metric": PAIR_METRICS,
            "generator_layer_order": LAYER_ORDERS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise FedFTGConfigError(f"fedftg.{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.generator_md_divergence is not None and self.generator_md_divergence not in MD_DIVERGENCES:
            raise FedFTGConfigError(
                f"fedftg.generator_md_divergence must be one of {', '.join(MD_DIVERGENCES)} or None; "
                f"got {self.generator_md_divergence!r}"
            )

    @property
    def generator_divergence(self) -> str:
        """The divergence of the generator's ``L_md`` (defaults to the global model's)."""
        return self.generator_md_divergence or self.md_divergence

    @property
    def trains_generator(self) -> bool:
        """Whether the generator step has any objective (Table 4 ablations can remove all)."""
        return self.generator_steps > 0 and (self.hard_sample_mining or self.use_cls_loss or self.use_dis_loss)

    @classmethod
    def official(cls, **overrides: Any) -> "FedFTGConfig":
        """The official code's behaviour (the table in ``docs/methods/fedftg.md``), plus ``overrides``."""
        values: dict[str, Any] = dict(
            generator_md_divergence="l1",
            md_divergence="kl_teacher_first",
            md_class_mean=True,
            md_teacher_grad=False,
            generator_update="per_client",
            label_sampling="stratified",
            global_bn="train",
            generator_bn="running",
            reset_generator_optimizer=True,
            generator_output_norm=True,
            generator_layer_order="official",
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "FedFTGConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise FedFTGConfigError(f"fedftg: unknown option(s) {', '.join(unknown)}")
        return cls(**dict(values))
