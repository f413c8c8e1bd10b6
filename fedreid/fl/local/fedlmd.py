"""FedLMD, label-masking distillation (Lu, Li, Bao, Wang, Qian, Ge, ACM MM 2023,
"Federated Learning with Label-Masking Distillation"), and its teacher-free variant FedLMD-Tf.

Sources: the paper (Sec. 4.2, Eq. 2-6; Sec. 4.3, Eq. 7-8; Algorithm 1) and
the official code ``wnma3mz/FedLMD`` (commit ``6a06d45``:
``src/algorithms/fedlmd/criterion.py``, ``src/algorithms/fedlmd_tf/criterion.py``,
``.../Server.py``, ``.../ClientTrainer.py``, ``src/config/fedlmd*.json``).

Majority labels of client ``k``. Sec. 4.2 prints the condition as
``n_{k,y} >= n_k / n_{k,y}``, a typo for a comparison with the mean class
count ``n_k / C``; the official ``Server.__init__`` uses
``np.where(data_map[k] > mean(data_map[k]))``, the mean over all ``C``
classes, strictly. The paper's ``>=`` is the default, the official ``>`` the
option ``majority="above_mean"``::

    M_k = { c : n_k^c >= n_k / C }           (paper; "above_mean": n_k^c > n_k / C)

The two differ only for a class holding exactly the mean count: never under
the paper's shards (a client's classes hold far more than the mean, the
others none), and for balanced clients everything (``>=``: every label is a
majority label, so the KD term is 0 and FedLMD trains as FedAvg; ``>``: none
is, and it trains as FedNTD).

Loss of one sample ``(x, y)`` with student logits ``z`` (local model) and
teacher logits ``z^g`` (received global model, frozen), temperature ``tau``
(Eq. 5, with ``L_LMD`` the KL of Eq. 6)::

    L = CE(z, y) + beta * KL( p^g || q )
    p^g(c) = exp(z^g_c/tau) / sum_{c' in A} exp(z^g_c'/tau)   for c in A = C \\ (M_k U {y}),  0 otherwise
    q(c)   = exp(z_c/tau)   / sum_{c' != y} exp(z_c'/tau)     for c != y,                  0 for c = y

Eq. 3 writes the teacher's support as the non-majority labels and Eq. 4 the
student's as the not-true labels; Sec. 4.2 assumes the true label is a
majority label. When it is not, the KL of Eq. 6 would be infinite (teacher
mass where the student has none), so the true label leaves the teacher's
support too, as in the official code.

Mask semantics: the *teacher* masks the client's majority labels **and** the
sample's true label (official: ``logits_t/T - 1000*label_mask - 1000*gt_mask``);
the *student* masks only the true label (``logits_s/T - 1000*gt_mask``). So the
student's not-true distribution, which still includes the majority labels, is
pulled towards the teacher's distribution over the minority (non-majority,
non-true) labels: the global model's knowledge of the labels this client
lacks is preserved, while majority labels are learnt from local data. KL is
summed over classes and averaged over the batch (``reduction="batchmean"``).
A sample with an empty ``A`` (every not-true label is a majority label) has
no teacher distribution: its KD term is 0 (it still counts in the batch mean).

FedLMD-Tf (teacher-free, Eq. 7-8) replaces ``p^g`` by the uniform
distribution over ``A``: ``p^u(c) = 1/|A|`` for ``c in A`` (Eq. 8's
``1/(C - C_k)`` over the minority labels, with the true label removed for the
reason above; a proper distribution for every sample and batch size; 0
everywhere, hence KD term 0, when ``A`` is empty). No teacher forward is run.

Switch (Sec. 5.4, Fig. 8): FedLMD-Tf for the first ``switch_round`` rounds,
FedLMD from then on (:func:`lmd_uses_teacher`; 0-based round index).

Defaults ``tau = 1``, ``beta = 1``: the official configs (``{"tau": 1, "beta": 1}``).

Differences of the official code, each behind an option here:

* ``tf_target="official"``: the official Tf target is
  ``ones(B, C) * 1. / (num_classes - len(label_mask) - 1)`` with the majority
  and true entries zeroed. ``label_mask`` is the ``[B, C]`` mask, so
  ``len(label_mask)`` is the **batch size** ``B``, not ``|M_k|``: every
  admissible entry is ``1/(C - B - 1)`` -- negative when ``B >= C`` (the
  official CIFAR-10 config has ``B = 50, C = 10``: ``-1/41``), infinite when
  ``B = C - 1``, and a row sums to ``|A|/(C - B - 1) != 1`` otherwise (even
  the presumably intended ``1/(C - |M_k| - 1)`` is a distribution only when
  ``y`` is not a majority label). With the PyTorch of the code's time,
  ``kl_div`` replaced entries with a target ``<= 0`` by 0
  (pytorch/pytorch#69230), so under ``B >= C`` the official Tf KD term is
  identically 0 and FedLMD-Tf trains as FedAvg; current PyTorch returns NaN
  instead (``xlogy`` of a negative number). The option reproduces the target
  formula and the old ``kl_div`` semantics (a non-positive target entry
  contributes 0). The paper target is the default. Also, as stored,
  ``LMD_Tf_Loss.forward(logits, targets)`` calls ``lmd_tf_criterion`` without
  ``major_labels`` while its ``ClientTrainer`` passes three arguments, so the
  official Tf path does not run as committed.
* ``mask="official"``: masking by subtracting 1000 from the tempered logits
  instead of removing the entries. Equal to exact masking (the default) to
  float precision unless tempered logits differ by ~1000, or ``A`` is empty:
  the official teacher is then a softmax over masked labels (the true one
  pushed down twice when it is a majority label) instead of "no teacher".
* ``tau_sq=True``: the official code multiplies the KL by ``T ** 2`` (Hinton
  et al.'s gradient scaling); Eq. 5-6 have no such factor, so the default
  is the unscaled KL. At the default ``tau = 1`` there is no difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.local.base import (
    LocalObjective,
    ObjectiveError,
    check_choice,
    check_positive,
    frozen_copy,
    kl_teacher_student,
    masked_log_softmax,
    masked_softmax,
    one_hot_mask,
    register_objective,
)

TF_TARGETS: tuple[str, ...] = ("paper", "official")
MAJORITY_RULES: tuple[str, ...] = ("at_least_mean", "above_mean")
MASKS: tuple[str, ...] = ("exact", "official")
#: The official code's additive mask (``- 1000 * mask`` on the tempered logits).
OFFICIAL_MASK_OFFSET = 1000.0


def majority_labels(class_counts: Sequence[float] | Tensor, rule: str = "at_least_mean") -> Tensor:
    """Boolean ``[C]``: ``n_k^c >= n_k / C`` (``rule="above_mean"``: ``>``), ``C = len(class_counts)``, ``n_k = sum``."""
    check_choice("fedlmd majority", rule, MAJORITY_RULES)
    counts = torch.as_tensor(class_counts, dtype=torch.float64).reshape(-1)
    if counts.numel() < 2:
        raise ObjectiveError(f"fedlmd: class_counts needs one count per class (>= 2 classes), got {counts.numel()}")
    if bool((counts < 0).any()) or not bool(torch.isfinite(counts).all()):
        raise ObjectiveError("fedlmd: class counts must be finite and >= 0")
    # n_c >= n / C  <=>  n_c * C >= n: no rounding of n / C
    scaled, total = counts * counts.numel(), counts.sum()
    return scaled > total if rule == "above_mean" else scaled >= total


def teacher_support(labels: Tensor, majority: Tensor) -> Tensor:
    """``[B, C]`` True on ``A_i = C \\ (M_k U {y_i})``: the labels the teacher keeps."""
    gt = one_hot_mask(labels, majority.numel())
    return ~gt & ~majority.to(gt.device).reshape(1, -1)


def lmd_uses_teacher(round_index: int, *, teacher_free: bool, switch_round: Optional[int]) -> bool:
    """Whether round ``round_index`` (0-based) distils from the global model.

    FedLMD: always. FedLMD-Tf: never, or from ``switch_round`` on when given
    (Sec. 5.4: Tf for rounds ``0 .. switch_round-1``, then FedLMD).
    """
    if not teacher_free:
        return True
    return switch_round is not None and int(round_index) >= int(switch_round)


def _student_log_probs(logits: Tensor, gt: Tensor, tau: float, mask: str) -> Tensor:
    if mask == "official":
        return F.log_softmax(logits / tau - OFFICIAL_MASK_OFFSET * gt.to(logits.dtype), dim=1)
    return masked_log_softmax(logits / tau, ~gt)


def lmd_loss(
    logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    majority: Tensor,
    tau: float = 1.0,
    *,
    tau_sq: bool = False,
    mask: str = "exact",
) -> Tensor:
    """The label-masking distillation term: batch-mean ``KL(p^g || q)`` (times ``tau^2`` if ``tau_sq``)."""
    check_choice("fedlmd mask", mask, MASKS)
    if logits.shape != teacher_logits.shape:
        raise ObjectiveError(f"fedlmd: student logits {tuple(logits.shape)} vs teacher {tuple(teacher_logits.shape)}")
    if logits.shape[1] != majority.numel():
        raise ObjectiveError(f"fedlmd: {logits.shape[1]} logits per sample but {majority.numel()} class counts")
    gt = one_hot_mask(labels, logits.shape[1])
    keep_t = teacher_support(labels, majority)
    t = teacher_logits.detach()
    if mask == "official":
        # "- 1000 * label_mask - 1000 * gt_mask" as written: a true label that is also a majority label gets -2000
        major = majority.to(t.device).reshape(1, -1).expand_as(gt)
        offset = OFFICIAL_MASK_OFFSET * (major.to(t.dtype) + gt.to(t.dtype))
        p_teacher = torch.softmax(t / tau - offset, dim=1)
        kl = F.kl_div(_student_log_probs(logits, gt, tau, mask), p_teacher, reduction="batchmean")
    else:
        p_teacher = masked_softmax(t / tau, keep_t)
        kl = kl_teacher_student(p_teacher, _student_log_probs(logits, gt, tau, mask), keep_t).mean()
    return kl * (tau * tau) if tau_sq else kl


def tf_target(labels: Tensor, majority: Tensor, *, variant: str = "paper") -> Tensor:
    """FedLMD-Tf's teacher replacement, ``[B, C]``.

    ``paper``: uniform over ``A_i`` (rows sum to 1; all-zero row when ``A_i`` is
    empty). ``official``: ``1/(C - B - 1)`` on ``A_i``, 0 elsewhere (see the
    module docstring: not a distribution; negative for ``B >= C``).
    """
    check_choice("fedlmd tf_target", variant, TF_TARGETS)
    keep = teacher_support(labels, majority)
    if variant == "paper":
        target = keep.to(torch.float32)
        return target / target.sum(dim=1, keepdim=True).clamp_min(1.0)
    b, c = keep.shape
    # the official expression, tensor arithmetic included (so C - B - 1 = 0 gives inf, as there)
    target = torch.ones((b, c), device=keep.device) * 1.0 / (c - b - 1)
    return target.masked_fill(~keep, 0.0)


def lmd_tf_loss(
    logits: Tensor,
    labels: Tensor,
    majority: Tensor,
    tau: float = 1.0,
    *,
    tau_sq: bool = False,
    target: str = "paper",
    mask: str = "exact",
) -> Tensor:
    """FedLMD-Tf's term: batch-mean ``KL(p^u || q)`` (times ``tau^2`` if ``tau_sq``).

    Entries where the target is ``<= 0`` contribute 0 -- for the paper target
    these are exactly the masked labels; for the official one this is the old
    ``kl_div`` behaviour the official code ran with.
    """
    check_choice("fedlmd mask", mask, MASKS)
    if logits.shape[1] != majority.numel():
        raise ObjectiveError(f"fedlmd: {logits.shape[1]} logits per sample but {majority.numel()} class counts")
    gt = one_hot_mask(labels, logits.shape[1])
    p = tf_target(labels, majority, variant=target).to(logits.dtype)
    kl = kl_teacher_student(p, _student_log_probs(logits, gt, tau, mask), p > 0).mean()
    return kl * (tau * tau) if tau_sq else kl


@dataclass
class FedLMDTfOptions:
    """Options of ``train.objective: fedlmd_tf`` (the class counts come from the client's data)."""

    #: Distillation temperature (Lu et al. 2023, Eq. 6).
    tau: float = 1.0
    #: Weight of the LMD term.
    beta: float = 1.0
    #: Switch from the teacher-free target to the global-model teacher from this round on (0-based).
    switch_round: Optional[int] = None
    #: Teacher-free target: ``paper`` (Eq. 8) or ``official`` (the released code's).
    tf_target: Literal["paper", "official"] = "paper"
    #: How minority labels are masked: ``exact`` (removed from the softmax) or ``official``.
    mask: Literal["exact", "official"] = "exact"
    #: Multiply the KL term by ``tau^2``.
    tau_sq: bool = False
    #: Majority labels: ``at_least_mean`` (Sec. 4.2's ``>=`` the mean class count) or
    #: ``above_mean`` (the official ``Server.__init__``'s strict ``>``).
    majority: Literal["at_least_mean", "above_mean"] = "at_least_mean"


@dataclass
class FedLMDOptions(FedLMDTfOptions):
    """Options of ``train.objective: fedlmd``."""

    #: Use the teacher-free target (FedLMD-Tf); ``fedlmd_tf`` sets it.
    teacher_free: bool = False


@register_objective
class FedLMD(LocalObjective):
    """``CE + beta * LMD`` (teacher: the received global model) or its teacher-free variant.

    ``class_counts``: the client's training images per class (length ``C``);
    the majority set is fixed from them. ``teacher_free=True`` is FedLMD-Tf;
    with ``switch_round`` it becomes FedLMD from that round on.
    """

    name = "fedlmd"
    Options: ClassVar[type] = FedLMDOptions
    needs_class_counts: ClassVar[bool] = True

    def __init__(
        self,
        class_counts: Sequence[float] | Tensor,
        tau: float = 1.0,
        beta: float = 1.0,
        *,
        teacher_free: bool = False,
        switch_round: Optional[int] = None,
        tf_target: str = "paper",
        mask: str = "exact",
        tau_sq: bool = False,
        majority: str = "at_least_mean",
    ) -> None:
        super().__init__()
        self.majority = majority_labels(class_counts, majority)
        self.tau = check_positive("fedlmd tau", tau, allow_zero=False)
        self.beta = check_positive("fedlmd beta", beta)
        self.teacher_free = bool(teacher_free)
        if switch_round is not None:
            if not self.teacher_free:
                raise ObjectiveError("fedlmd: switch_round applies to the teacher-free variant (teacher_free=True)")
            if int(switch_round) < 0:
                raise ObjectiveError(f"fedlmd: switch_round must be >= 0, got {switch_round}")
        self.switch_round = None if switch_round is None else int(switch_round)
        self.tf_target = check_choice("fedlmd tf_target", tf_target, TF_TARGETS)
        self.mask = check_choice("fedlmd mask", mask, MASKS)
        self.tau_sq = bool(tau_sq)
        self._teacher: Optional[nn.Module] = None

    def uses_teacher(self, round_index: int) -> bool:
        return lmd_uses_teacher(round_index, teacher_free=self.teacher_free, switch_round=self.switch_round)

    def begin_round(
        self,
        model: nn.Module,
        global_state: Mapping[str, Tensor],
        *,
        round_index: int = 0,
        payload: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().begin_round(model, global_state, round_index=round_index, payload=payload)
        # the teacher-free rounds build no copy and run no teacher forward (the point of Tf)
        self._teacher = frozen_copy(model) if self.uses_teacher(round_index) else None

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        ce = super().loss(model, images, labels, logits, features)
        majority = self.majority.to(logits.device)
        if self._teacher is not None:
            with torch.no_grad():
                teacher_logits = self._teacher(images)
            kd = lmd_loss(logits, teacher_logits, labels, majority, self.tau, tau_sq=self.tau_sq, mask=self.mask)
        else:
            kd = lmd_tf_loss(
                logits, labels, majority, self.tau, tau_sq=self.tau_sq, target=self.tf_target, mask=self.mask
            )
        self.last_terms["lmd"] = kd.detach()
        return ce + self.beta * kd

    def end_round(self, model: nn.Module) -> dict[str, Any]:
        self._teacher = None
        return super().end_round(model)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(majority={self.majority.nonzero().flatten().tolist()}, tau={self.tau}, "
            f"beta={self.beta}, teacher_free={self.teacher_free}, switch_round={self.switch_round}, "
            f"tf_target={self.tf_target!r}, mask={self.mask!r}, tau_sq={self.tau_sq})"
        )


@register_objective
class FedLMDTf(FedLMD):
    """FedLMD-Tf: :class:`FedLMD` with ``teacher_free=True`` (optionally ``switch_round``)."""

    name = "fedlmd_tf"
    Options: ClassVar[type] = FedLMDTfOptions

    def __init__(
        self,
        class_counts: Sequence[float] | Tensor,
        tau: float = 1.0,
        beta: float = 1.0,
        *,
        switch_round: Optional[int] = None,
        tf_target: str = "paper",
        mask: str = "exact",
        tau_sq: bool = False,
        majority: str = "at_least_mean",
    ) -> None:
        super().__init__(
            class_counts,
            tau,
            beta,
            teacher_free=True,
            switch_round=switch_round,
            tf_target=tf_target,
            mask=mask,
            tau_sq=tau_sq,
            majority=majority,
        )


__all__ = [
    "FedLMD",
    "FedLMDTf",
    "MASKS",
    "TF_TARGETS",
    "lmd_loss",
    "lmd_tf_loss",
    "lmd_uses_teacher",
    "majority_labels",
    "teacher_support",
    "tf_target",
]
