"""FedRS, restricted softmax (Li & Zhan, "FedRS: Federated Learning with Restricted Softmax for
Label Distribution Non-IID Data", KDD 2021).

Client ``k`` holds the classes ``C_k`` (its training images per class are
``n_k^c``; ``c in C_k`` iff ``n_k^c > 0``). FedRS trains with the softmax of
scaled logits (the paper's restricted softmax)::

    o_c = s_c * z_c,      s_c = 1 for c in C_k,   s_c = alpha for c not in C_k   (0 <= alpha <= 1)
    L   = CE(softmax(o), y)     (mean over the batch)

``z_c = w_c^T h`` in the paper. Every gradient that reaches a missing class
``c`` goes through its scaled logit, so ``dL/dw_c = s_c (p_c - 1[y = c]) h``
with ``p = softmax(o)``: the client pushes the weights of the classes it lacks
away ``alpha`` times as hard. ``alpha = 1`` is FedAvg's cross-entropy;
``alpha = 0`` fixes the missing classes' logits at 0. The official code has
no single default: its experiments search ``alpha`` in ``{0.9, 0.5, 0.1}``
(``train_lab.py``); the default here is the middle value, ``alpha = 0.5``.

Conventions and the official code (``lxcnju/FedRepo``, ``algorithms/fedrs.py`` as of
dc2cb6a, 2022-07-24; the file first uploaded in April 2022 rebound ``dist`` to its
own scaled value at every local step, which that commit replaced by ``cdist``):

* Bias: the paper's classifier and the official ``ClassifyNet`` have no bias
  (``nn.Linear(h_size, n_classes, bias=False)``), so ``z_c = w_c^T h``. Here the
  scale multiplies the model's whole logit ``z_c = w_c^T h + b_c``, the
  bias included, so a missing class's bias is restrained like its weights; for
  a bias-free classifier this is the paper's formula.
* ``scale="official"``: the official code does not use the 0/1 presence of a
  class but the soft scale ``s_c = alpha + (1 - alpha) * n_k^c / max_c' n_k^c'``
  (``cdist = dist / dist.max(); cdist = cdist * (1 - alpha) + alpha``): a
  missing class still gets ``alpha``, the client's largest class 1, the others
  in between. The default ``scale="paper"`` is the restricted softmax above.
* The official client also clips the gradient norm (``max_grad_norm``, 100 in
  ``config.py``); here that is the training loop's ``train.clip_grad_norm`` (off
  by default), the same for every method.

The scaling applies to the training loss only; the model itself (and so the
global model, and every evaluation) keeps its plain logits.

On the ReID track a client's label space is its own identities, each of which
it holds, so every class is present and FedRS trains as FedAvg; the method is
meant for a label space shared by all clients (the classification track).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.local.base import LocalObjective, ObjectiveError, check_choice, register_objective
from fedreid.options import ConfigError

#: How the per-class logit scale is made from the class counts (see the module docstring).
SCALES: tuple[str, ...] = ("paper", "official")


def _counts(class_counts: Sequence[float] | Tensor) -> Tensor:
    counts = torch.as_tensor(class_counts, dtype=torch.float64).reshape(-1)
    if counts.numel() < 2:
        raise ObjectiveError(f"fedrs: class_counts needs one count per class (>= 2 classes), got {counts.numel()}")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ObjectiveError("fedrs: class counts must be finite and >= 0")
    if not bool((counts > 0).any()):
        raise ObjectiveError("fedrs: the client holds no class (all class counts are 0)")
    return counts


def _check_alpha(alpha: float) -> float:
    a = float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ObjectiveError(f"fedrs alpha must be in [0, 1], got {alpha!r}")
    return a


def restricted_scale(class_counts: Sequence[float] | Tensor, alpha: float, *, scale: str = "paper") -> Tensor:
    """The per-class logit scale ``s`` (float32, ``[C]``).

    ``paper``: 1 where ``class_counts > 0``, ``alpha`` elsewhere.
    ``official``: ``alpha + (1 - alpha) * n_c / max_c' n_c'``.
    """
    check_choice("fedrs scale", scale, SCALES)
    counts = _counts(class_counts)
    a = _check_alpha(alpha)
    if scale == "paper":
        s = torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, a))
    else:
        s = a + (1.0 - a) * counts / counts.max()
    return s.to(torch.float32)


def restricted_cross_entropy(logits: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    """``CE(softmax(s * z), y)``, mean over the batch; ``scale`` is ``s`` of shape ``[C]``."""
    if logits.dim() != 2 or logits.shape[1] != scale.numel():
        raise ObjectiveError(
            f"fedrs: logits of shape {tuple(logits.shape)} for {scale.numel()} class counts"
        )
    return F.cross_entropy(logits * scale.to(device=logits.device, dtype=logits.dtype).reshape(1, -1),
                           labels.long())


@dataclass
class FedRSOptions:
    """Options of ``train.objective: fedrs`` (the class counts come from the client's data)."""

    #: Scale of the logits of the classes the client has no sample of, in [0, 1]
    #: (Li & Zhan 2021, restricted softmax; 1 is FedAvg; the official runs search 0.9, 0.5, 0.1).
    alpha: float = 0.5
    #: Per-class scale: ``paper`` (1 for the client's classes, ``alpha`` for the others) or
    #: ``official`` (the released code's ``alpha + (1 - alpha) * n_c / max n``).
    scale: Literal["paper", "official"] = "paper"

    def validate(self, prefix: str) -> None:
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise ConfigError(f"{prefix}.alpha: must be in [0, 1], got {self.alpha!r}")


@register_objective
class FedRS(LocalObjective):
    """Cross-entropy of the restricted softmax ``softmax(s * z)`` (see the module docstring).

    ``class_counts``: the client's training images per class (length ``C``);
    the scale ``s`` is fixed from them.
    """

    name = "fedrs"
    Options: ClassVar[type] = FedRSOptions
    needs_class_counts: ClassVar[bool] = True

    def __init__(self, class_counts: Sequence[float] | Tensor, alpha: float = 0.5, *, scale: str = "paper") -> None:
        super().__init__()
        self.alpha = _check_alpha(alpha)
        self.scale_mode = check_choice("fedrs scale", scale, SCALES)
        self.present = _counts(class_counts) > 0
        self.scale = restricted_scale(class_counts, self.alpha, scale=self.scale_mode)

    def loss(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        logits: Tensor,
        features: Optional[Tensor] = None,
    ) -> Tensor:
        """``CE(softmax(s * logits), labels)``; ``last_terms["ce"]`` is this restricted cross-entropy."""
        self._check_in_round("loss")
        ce = restricted_cross_entropy(logits, labels, self.scale)
        self.last_terms = {"ce": ce.detach()}
        return ce

    def __repr__(self) -> str:
        missing = (~self.present).nonzero().flatten().tolist()
        return f"FedRS(alpha={self.alpha}, scale={self.scale_mode!r}, missing={missing})"


__all__ = ["SCALES", "FedRS", "FedRSOptions", "restricted_cross_entropy", "restricted_scale"]
