"""Aggregation weights and the aggregation step.

* FedPav / FedAvg (Zhuang et al. 2020, Algorithm 1): ``w_k = n_k / n`` over
  the shared parameters; FedAvg when everything is shared.
* Uniform (``weighting="uniform"``): ``w_k = 1 / |S_t|``, the plain mean of
  FedLMD (Lu et al. 2023, Algorithm 1 line 12) and FedFTG (Zhang et al. 2022,
  Algorithm 2 line 1, ``Delta w = 1/|S_t| sum_k (w_k - w)``).
* Server step size (``server_lr``, FedFTG Algorithm 2 line 1's ``eta_g``):
  ``w <- w + eta_g (avg - w)`` on the trainable parameters; 1 gives the
  average itself. Buffers (BatchNorm statistics) always take the average:
  extrapolating a running variance past the clients' values can make it
  negative.
* Cosine-distance weights (CDW, Algorithm 3): client ``k`` takes one training
  batch and compares the logits of the model it received (global shared part
  plus its old private head) with the logits of the model it trained:
  ``m_k = mean_batch(1 - cos(old, new))``; weights ``m_k / sum_i m_i``.
  Algorithm 3 line 8 (and Algorithm 5 line 8) prints ``m = sum_k 1/m_k``
  before ``w = sum_k (m_k / m) w_k``: read literally those weights add up to
  ``sum m_k / sum 1/m_k`` (about 0.01 for nine clients at ``m_k ~ 0.1``) and
  shrink every parameter. Sec. 5.2's step (6) has ``m_k`` replace FedPav's
  ``n_k`` weight, and the reference (``server.py:train`` passes the
  distances to ``aggregate_models``, which divides by their sum) normalises
  by ``sum_i m_i``, as here.
  The reference (``optimization.py`` ``cdw_feature_distance``, called at the
  end of ``client.py`` ``Client.train``) computes both forwards while the
  models are still in train mode: dropout is active and BatchNorm uses batch
  statistics (the global model is a ``deepcopy`` of a train-mode client model
  after the first aggregation). ``mode="train"`` reproduces that forward;
  ``mode="eval"`` (default) uses inference mode, so ``m_k`` measures how the
  deployed model changed, not dropout noise. ``mode="official"`` follows the
  reference's control flow exactly: its old model (``server.federated_model``)
  is put in eval mode by ``Server.__init__`` and by every ``Server.test``
  (``main.py:train`` tests after rounds 10, 20, ...), and only the next
  aggregation (a ``deepcopy`` of a train-mode client model) brings train mode
  back; so the received model is in eval mode in round 0 and in the round
  after each evaluation (:func:`cdw_start_in_eval`), in train mode otherwise,
  and the trained model is always in train mode. In train mode the reference
  also updates the BN running statistics of both models as a side effect;
  we discard that side effect (buffers are restored).

The averaging itself is :func:`fedreid.fl.state.weighted_average`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.state import BNPolicy, normalize_weights, weighted_average
from fedreid.fl.update import Update
from fedreid.utils.precision import FP32, Precision
from fedreid.utils.seeding import forked_torch_rng

CDWMode = Literal["eval", "train", "official"]
CDW_MODES: tuple[str, ...] = ("eval", "train", "official")


def cdw_start_in_eval(round_index: int, eval_every: int) -> bool:
    """Whether ``mode="official"`` runs the received model in eval mode in 0-based round ``round_index``.

    Round 0 and every round after an evaluation (after rounds ``eval_every``,
    ``2 eval_every``, ...; the reference tests every 10th round): the module docstring.
    """
    return round_index % max(1, int(eval_every)) == 0


@dataclass
class Aggregate:
    """The result of one aggregation."""

    state: "OrderedDict[str, Tensor]"
    #: Normalised weights, in the order of the updates.
    weights: list[float]
    #: ``size``, ``uniform`` or ``cdw`` (``size``/``uniform`` also when CDW fell back, see ``note``).
    weighting: str
    clients: list[str] = field(default_factory=list)
    note: str = ""
    #: Metrics of the method that aggregated (a server hook's), logged under its name.
    stats: dict[str, Any] = field(default_factory=dict)


Weighting = Literal["size", "uniform"]
WEIGHTINGS: tuple[str, ...] = ("size", "uniform")


def size_weights(updates: Sequence[Update]) -> list[float]:
    """FedPav/FedAvg weights ``n_k / n``."""
    return normalize_weights([u.num_samples for u in updates])


def uniform_weights(updates: Sequence[Update]) -> list[float]:
    """The plain mean ``1 / |S_t|`` (FedLMD Alg. 1 line 12, FedFTG Alg. 2 line 1)."""
    return normalize_weights([1.0] * len(updates))


def server_step(
    previous: Mapping[str, Tensor], average: Mapping[str, Tensor], server_lr: float, parameters: Iterable[str]
) -> "OrderedDict[str, Tensor]":
    """``previous + server_lr * (average - previous)`` on ``parameters``; other entries keep ``average``.

    FedFTG Algorithm 2 line 1 (``w <- w + eta_g * Delta w``). The step is
    taken in float64 and cast back, like :func:`weighted_average`.
    """
    names = set(parameters)
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    for key, avg in average.items():
        if key in names and torch.is_floating_point(avg) and server_lr != 1.0:
            prev = previous[key].detach().to(device=avg.device, dtype=torch.float64)
            out[key] = (prev + server_lr * (avg.to(torch.float64) - prev)).to(avg.dtype)
        else:
            out[key] = avg
    return out


def cdw_weights(distances: Sequence[float]) -> list[float]:
    """CDW weights ``m_k / sum_i m_i`` (Sec. 5.2 step 6; Algorithm 3 line 8's ``sum 1/m_k`` is a typo, see the module docstring)."""
    return normalize_weights(distances)


def cdw_logits_distance(old_logits: Tensor, new_logits: Tensor) -> float:
    """``mean over the batch of (1 - cos(old_b, new_b))``."""
    if old_logits.shape != new_logits.shape:
        raise ValueError(f"CDW: logits shapes differ: {tuple(old_logits.shape)} vs {tuple(new_logits.shape)}")
    return float((1.0 - F.cosine_similarity(old_logits.float(), new_logits.float(), dim=1)).mean())


@torch.no_grad()
def cdw_distance(
    start_model: nn.Module,
    trained_model: nn.Module,
    images: Tensor,
    *,
    mode: CDWMode = "eval",
    seed: int = 0,
    precision: Precision = FP32,
    start_in_eval: bool = False,
) -> float:
    """``m_k`` of one client from one batch of its training images.

    ``start_model``: the received global model with the client's old head;
    ``trained_model``: the model after local training. Both return logits.
    ``mode``: both models in eval or train mode, or ``official``: the trained
    model in train mode, the received one in eval mode when ``start_in_eval``
    (:func:`cdw_start_in_eval`), else in train mode. The forwards run under
    ``precision``'s autocast; the logits are cast to fp32 before the
    distance, which is always computed in fp32.
    """
    if mode not in CDW_MODES:
        raise ValueError(f"cdw_mode must be one of {', '.join(CDW_MODES)}, got {mode!r}")
    models = (start_model, trained_model)
    flags = [m.training for m in models]
    saved = [OrderedDict((k, b.clone()) for k, b in m.named_buffers()) for m in models]
    if mode == "official":
        training = (not start_in_eval, True)
    else:
        training = (mode == "train", mode == "train")
    try:
        with forked_torch_rng(seed, images.device):
            for m, train in zip(models, training):
                m.train(train)
            images = precision.prepare_input(images)
            with precision.autocast():
                old = start_model(images)
                new = trained_model(images)
            old, new = old.float(), new.float()
    finally:
        for m, flag, bufs in zip(models, flags, saved):
            m.train(flag)
            named = dict(m.named_buffers())
            for k, b in bufs.items():
                named[k].copy_(b)
    return cdw_logits_distance(old, new)


def aggregate(
    updates: Sequence[Update],
    *,
    cdw: bool = False,
    bn: BNPolicy = "average",
    weighting: Weighting = "size",
) -> Aggregate:
    """Average the updates' shared states with size, uniform or CDW weights.

    With ``cdw`` every update must carry ``metadata["cdw_distance"]``. If all
    distances are zero (no client moved) the weights fall back to
    ``weighting`` and ``note`` says so.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"aggregate: unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    if not updates:
        raise ValueError("aggregate: no updates to aggregate")
    names = [u.client for u in updates]
    fallback = uniform_weights if weighting == "uniform" else size_weights
    note = ""
    if cdw:
        missing = [u.client for u in updates if "cdw_distance" not in u.metadata]
        if missing:
            raise ValueError(f"CDW aggregation: update of client {missing[0]!r} has no cdw_distance")
        distances = [float(u.metadata["cdw_distance"]) for u in updates]
        if sum(distances) > 0:
            weights, weighting = cdw_weights(distances), "cdw"
        else:
            weights, note = fallback(updates), f"all CDW distances are 0; {weighting} weights used"
    else:
        weights = fallback(updates)
    state = weighted_average([u.state for u in updates], weights, bn=bn)
    return Aggregate(state, weights, weighting, names, note)
