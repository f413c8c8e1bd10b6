"""FedFTG's label sampling, class-level ensemble weights and losses (Eq. 3-8).

* customised label sampling ``p_t(y) = sum_k n_k^y / sum_k n_k``
  (:func:`label_distribution`, :func:`sample_labels`; official:
  :func:`stratified_labels`);
* class-level ensemble ``alpha_t^{k,y} = n_k^y / sum_{i in S_t} n_i^y``
  (:func:`ensemble_weights`);
* model discrepancy ``L_md`` (Eq. 3-4, :func:`md_divergence`, :func:`md_loss`),
  fidelity ``L_cls`` (Eq. 5-6, :func:`cls_loss`), diversity ``L_dis`` (Eq. 7,
  :func:`diversity_loss`) and the generator's objective (Eq. 8,
  :func:`generator_objective`).

The KL direction of Eq. 3-4 and why it matters: ``docs/methods/fedftg.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedreid.fl.server_hooks.fedftg.options import (
    ENSEMBLE_WEIGHTINGS,
    LABEL_SAMPLINGS,
    MD_DIVERGENCES,
    PAIR_METRICS,
    FedFTGConfig,
    FedFTGConfigError,
    FedFTGInputError,
)

# --------------------------------------------------------------------------- label sampling, ensemble


def _counts(class_counts: Any) -> Tensor:
    counts = torch.as_tensor(class_counts).detach().to("cpu", torch.float64)
    if counts.dim() != 2:
        raise FedFTGInputError(f"fedftg: class_counts must be [clients, classes], got shape {tuple(counts.shape)}")
    if counts.shape[0] < 1 or counts.shape[1] < 1:
        raise FedFTGInputError(f"fedftg: class_counts is empty, shape {tuple(counts.shape)}")
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise FedFTGInputError("fedftg: class_counts must be finite and >= 0")
    if counts.sum() <= 0:
        raise FedFTGInputError("fedftg: class_counts are all zero")
    return counts


def label_distribution(class_counts: Any, mode: str = "customized") -> Tensor:
    """``p_t(y)``, float64 ``[C]``.

    "customized" (paper): ``p_t(y) = sum_k n_k^y / sum_{k,y'} n_k^{y'}`` --
    labels the participating clients hold more of are drawn more often, a
    class nobody holds never. "uniform" (Table 4 ablation): ``1 / C``.
    "stratified" (official) uses the same ``p_t`` (see :func:`stratified_labels`).
    """
    counts = _counts(class_counts)
    if mode == "uniform":
        return torch.full((counts.shape[1],), 1.0 / counts.shape[1], dtype=torch.float64)
    if mode not in ("customized", "stratified"):
        raise FedFTGConfigError(f"fedftg: label sampling must be one of {', '.join(LABEL_SAMPLINGS)}; got {mode!r}")
    per_class = counts.sum(dim=0)
    return per_class / per_class.sum()


def ensemble_weights(class_counts: Any, mode: str = "class") -> Tensor:
    """``alpha_t^{k,y}``, float64 ``[K, C]``; column ``y`` weighs the teachers for label ``y``.

    "class" (paper, class-level ensemble): ``alpha^{k,y} = n_k^y / sum_i n_i^y``;
    a client that has more of class ``y`` knows it better. For a class no
    participating client holds the ratio is ``0/0``; it is 0 for every client
    (the official ``n / (sum + 1e-6)`` gives the same), so a pseudo sample of
    such a class (drawn only under uniform label sampling) adds nothing to
    ``L_md`` or ``L_cls``. "uniform" (the Table 4 ablation, Sec. 3.2's
    "widely used" ensemble): ``1 / |S_t|`` for every client and class.
    "client_size": ``n_k / n`` for every class, the FedAvg weights (equal to
    "uniform" for clients of equal size, as the paper's).
    """
    counts = _counts(class_counts)
    if mode == "uniform":
        return torch.full(counts.shape, 1.0 / counts.shape[0], dtype=torch.float64)
    if mode == "client_size":
        sizes = counts.sum(dim=1, keepdim=True)
        return (sizes / sizes.sum()).expand_as(counts).clone()
    if mode != "class":
        raise FedFTGConfigError(f"fedftg: ensemble must be one of {', '.join(ENSEMBLE_WEIGHTINGS)}; got {mode!r}")
    per_class = counts.sum(dim=0, keepdim=True)
    safe = torch.where(per_class > 0, per_class, torch.ones_like(per_class))
    return torch.where(per_class > 0, counts / safe, torch.zeros_like(counts))


def sample_labels(probs: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` i.i.d. labels ``y ~ probs`` (int64, CPU) drawn from ``generator``."""
    return torch.multinomial(probs.to(torch.float64), count, replacement=True, generator=generator)


def stratified_labels(class_counts: Any, count: int, generator: torch.Generator) -> Tensor:
    """The official ``generate_labels``: ``count`` labels allotted in proportion to ``p_t``, shuffled.

    Class ``y`` gets the positions ``[floor(count * P(y-1)), floor(count * P(y)))``
    with ``P`` the cumulative ``p_t`` (float64, the last class takes the rest),
    then the whole list is permuted (``torch.randperm`` from ``generator``
    where the official code uses ``np.random.shuffle``).
    """
    probs = label_distribution(class_counts, "customized")
    cuts = torch.floor(torch.cumsum(probs, 0) * count).long()[:-1].clamp(0, count)
    sizes = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([count])]))
    labels = torch.repeat_interleave(torch.arange(probs.numel()), sizes.clamp(min=0))
    return labels[torch.randperm(count, generator=generator)]


# --------------------------------------------------------------------------- losses


def md_divergence(global_logits: Tensor, teacher_logits: Tensor, kind: str = "kl", *,
                  class_mean: bool = False) -> Tensor:
    """Per teacher and sample divergence ``[K, B]`` between ``global_logits [B, C]`` and ``teacher_logits [K, B, C]``.

    * "kl" (Eq. 3-4): ``KL(sigma(g) || sigma(t_k)) = sum_c sigma(g)_c (log sigma(g)_c - log sigma(t_k)_c)``;
    * "kl_teacher_first": ``KL(sigma(t_k) || sigma(g))``;
    * "l1" (official generator step): ``mean_c |g_c - t_{k,c}|`` on logits.

    ``class_mean`` divides the KL values by ``C`` (the official global step
    averages its soft cross-entropy over classes too).
    """
    if teacher_logits.dim() == 2:
        teacher_logits = teacher_logits.unsqueeze(0)
    g = global_logits.unsqueeze(0)
    if kind == "l1":
        return (g - teacher_logits).abs().mean(dim=-1)
    log_g = F.log_softmax(g, dim=-1)
    log_t = F.log_softmax(teacher_logits, dim=-1)
    if kind == "kl":
        div = (log_g.exp() * (log_g - log_t)).sum(dim=-1)
    elif kind == "kl_teacher_first":
        div = (log_t.exp() * (log_t - log_g)).sum(dim=-1)
    else:
        raise FedFTGConfigError(f"fedftg: md divergence must be one of {', '.join(MD_DIVERGENCES)}; got {kind!r}")
    return div / global_logits.shape[-1] if class_mean else div


def md_loss(global_logits: Tensor, teacher_logits: Tensor, weights: Tensor, kind: str = "kl", *,
            class_mean: bool = False) -> Tensor:
    """``L_md`` (Eq. 3-4): ``1/B sum_b sum_k weights[k, b] * div_k(b)``.

    ``weights[k, b] = alpha^{k, y_b}`` (class-level ensemble) or ``n_k / n``.
    """
    div = md_divergence(global_logits, teacher_logits, kind, class_mean=class_mean)
    return (div * weights).sum() / global_logits.shape[0]


def cls_loss(teacher_logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """``L_cls`` (Eq. 5-6): ``1/B sum_b sum_k weights[k, b] CE(D(x~_b; omega_k), y_b)``."""
    if teacher_logits.dim() == 2:
        teacher_logits = teacher_logits.unsqueeze(0)
    k, b, c = teacher_logits.shape
    ce = F.cross_entropy(teacher_logits.reshape(k * b, c), labels.repeat(k), reduction="none").view(k, b)
    return (ce * weights).sum() / b


def pairwise_distance(x: Tensor, metric: str) -> Tensor:
    """``[B, B]`` distances between the rows of ``x [B, d]``, averaged over dimensions.

    "l1": ``mean_d |x_i - x_j|``; "l2": ``mean_d (x_i - x_j)^2``; "cosine":
    ``1 - cos(x_i, x_j)`` (the official ``DiversityLoss.compute_distance``).
    """
    if metric == "cosine":
        return 1 - F.cosine_similarity(x.unsqueeze(1), x.unsqueeze(0), dim=-1)
    diff = x.unsqueeze(1) - x.unsqueeze(0)
    if metric == "l1":
        return diff.abs().mean(dim=-1)
    if metric == "l2":
        return diff.pow(2).mean(dim=-1)
    raise FedFTGConfigError(f"fedftg: distance must be one of {', '.join(PAIR_METRICS)}; got {metric!r}")


def diversity_loss(z: Tensor, images: Tensor, *, image_metric: str = "l1", noise_metric: str = "l2") -> Tensor:
    """``L_dis`` (Eq. 7): ``exp(-1/B^2 sum_{i,j} d_x(x~_i, x~_j) * d_z(z_i, z_j))``.

    Small when samples from distant noise vectors are far apart, so
    minimising it spreads the generator's outputs (against mode collapse).
    All ``B^2`` pairs, the diagonal (distance 0) included, as the official
    ``DiversityLoss`` (image distance "l1", noise distance "l2", both
    per-dimension means).

    A deliberate deviation from Eq. 7's literal form (whole Euclidean norms),
    whose exponent underflows ``exp`` to exactly 0 in float32 for image-sized
    inputs, so the term would do nothing; the per-dimension means keep it of
    order 1 (the official code's form; numbers in ``docs/methods/fedftg.md``).
    """
    b = z.shape[0]
    dx = pairwise_distance(images.reshape(b, -1), image_metric)
    dz = pairwise_distance(z.reshape(b, -1), noise_metric)
    return torch.exp(-(dx * dz).mean())


def generator_objective(md: Tensor, cls: Tensor, dis: Tensor, config: FedFTGConfig) -> Tensor:
    """The loss the generator *minimises*: ``-(L_md) + lambda_cls L_cls + lambda_dis L_dis`` (Eq. 8).

    Minimising it maximises ``L_md - lambda_cls L_cls - lambda_dis L_dis``.
    Each term is dropped when its ablation switch is off
    (``hard_sample_mining``, ``use_cls_loss``, ``use_dis_loss``).
    """
    loss = md.new_zeros(())
    if config.hard_sample_mining:
        loss = loss - md
    if config.use_cls_loss:
        loss = loss + config.lambda_cls * cls
    if config.use_dis_loss:
        loss = loss + config.lambda_dis * dis
    return loss
