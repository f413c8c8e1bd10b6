"""Plain local SGD with cross-entropy on the private identity head (FedPav's client).

Facts from the reference client (``client.py`` ``Client.train`` and
``utils.py`` ``get_optimizer``), reproduced here:

* SGD, nesterov, momentum 0.9, weight decay 5e-4; two parameter groups:
  the backbone at ``0.1 * lr`` and ``model.classifier`` (the reference's
  ``ClassBlock``: bottleneck + identity head) at ``lr`` (0.005 / 0.05).
* The optimizer **and** a ``StepLR(step_size=40, gamma=0.1)`` are created anew
  inside every call of ``Client.train``, i.e. every round: momentum buffers and
  the schedule never persist across rounds. ``scheduler.step()`` is called at
  the *start* of each local epoch, so (PyTorch >= 1.1 semantics) local epoch
  ``e`` (0-based) runs at ``lr * gamma ** ((e + 1) // step_size)``; with the
  benchmark's E=1 the rate never decays. :func:`epoch_lr_scale` is that rule.
* Batches smaller than the batch size are skipped (``if b < self.batch_size:
  continue``), i.e. ``drop_last`` (``train.drop_last``, on by default); the epoch loss is the sum of ``loss * b``
  over the used images divided by their count.

Nothing here touches global random state: the caller seeds the loader, the
augmentation and dropout (see :class:`fedreid.fl.client.Client`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from fedreid.fl.local.base import LocalObjective, representation
from fedreid.fl.local.cuda_graphs import graphed_backbone
from fedreid.utils.precision import FP32, Precision

if TYPE_CHECKING:
    from fedreid.config import TrainConfig


@dataclass
class LocalResult:
    """What a round of local training reports."""

    loss: float
    accuracy: float
    steps: int
    images: int
    epoch_losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    seconds: float = 0.0
    #: The optimizer after the last step (``continue_from`` of a continuous run's next call).
    optimizer: Optional[torch.optim.Optimizer] = None


def epoch_lr_scale(epoch: int, step_size: int = 40, gamma: float = 0.1) -> float:
    """LR factor of local epoch ``epoch`` (0-based) under the reference's StepLR use."""
    return gamma ** ((epoch + 1) // step_size)


def build_optimizer(model: nn.Module, cfg: TrainConfig, lr_scale: float = 1.0) -> torch.optim.SGD:
    """Backbone at ``lr * lr_backbone_ratio``; bottleneck + head at ``lr``.

    Parameters outside ``model.backbone`` form the high-lr group, as
    everything outside the reference's ``model.classifier`` block forms its
    low-lr group.
    """
    lr = cfg.lr * lr_scale
    if not hasattr(model, "backbone"):  # a classifier: one learning rate for everything
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.SGD(
            [{"params": params, "lr": lr, "base_lr": lr}], lr=lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, nesterov=cfg.nesterov and cfg.momentum > 0,
        )
    backbone = {id(p) for p in model.backbone.parameters()}
    low = [p for p in model.parameters() if id(p) in backbone and p.requires_grad]
    high = [p for p in model.parameters() if id(p) not in backbone and p.requires_grad]
    return torch.optim.SGD(
        [
            {"params": low, "lr": lr * cfg.lr_backbone_ratio, "base_lr": lr * cfg.lr_backbone_ratio},
            {"params": high, "lr": lr, "base_lr": lr},
        ],
        lr=lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.nesterov and cfg.momentum > 0,
    )


def device_batch(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)`` of a ``{"image", "label", ...}`` dict or a tuple batch, on ``device`` (labels long)."""
    if isinstance(batch, dict):
        images, labels = batch["image"], batch["label"]
    else:
        images, labels = batch[0], batch[1]
    return images.to(device, non_blocking=True), torch.as_tensor(labels).long().to(device, non_blocking=True)


def train_local(
    model: nn.Module,
    make_epoch_loader: Callable[[int], Iterable],
    cfg: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    on_step: Optional[Callable[[int, float], None]] = None,
    objective: Optional["LocalObjective"] = None,
    lr_scale: float = 1.0,
    precision: Precision = FP32,
    first_epoch: int = 0,
    continue_from: Optional[Mapping[str, Any]] = None,
) -> LocalResult:
    """``cfg.local_epochs`` epochs of SGD on ``model``'s logits.

    ``make_epoch_loader(e)`` returns the (seeded) loader of epoch ``e``;
    batches are ``{"image", "label", ...}`` dicts or ``(images, labels)``.
    A fresh optimizer is built here, every call (the reference's behaviour).

    The loss is cross-entropy, or ``objective``'s loss when one is given (an
    objective of :mod:`fedreid.fl.local.objectives` whose ``begin_round`` the
    caller has already run; its ``before_step``/``after_step`` wrap every
    optimizer step). ``LocalResult.loss`` is always the full objective.
    ``lr_scale`` multiplies every learning rate (the per-round decay).

    One continuous run over several calls (the local-training baseline,
    appendix A.1: one optimizer and one StepLR schedule across all epochs):
    ``first_epoch`` is the run's epoch count before this call (the schedule
    reads ``first_epoch + e``) and ``continue_from`` the ``state_dict()`` of
    the previous call's ``LocalResult.optimizer`` (momentum buffers). Both
    default to a fresh start, FedPav's client.

    ``cfg.cuda_graphs`` (CUDA only): full batches through ``model.backbone``
    replay a CUDA graph of its forward and backward
    (:mod:`fedreid.fl.local.cuda_graphs`); the rest of the step stays eager.

    ``cfg.clip_grad_norm``: the gradient's global norm is clipped before each
    step, after the objective's ``before_step`` (the official FedFTG trainers
    clip the gradient of the whole loss, SCAFFOLD's linear term included).

    ``precision`` (:mod:`fedreid.utils.precision`): forward and loss run
    under its autocast, gradients are unscaled before the objective's
    ``before_step`` sees them (fp16), parameters stay fp32. The epoch's loss
    sum and correct count accumulate on the device (in float64 and int64, the
    same arithmetic as summing ``loss.item() * b`` in Python) and are read once
    per epoch, so a CUDA step never waits for the host. A non-finite loss
    raises :class:`FloatingPointError`: at its step on the CPU, where reading
    it costs nothing, and at the end of its epoch on other devices.
    """
    device = torch.device(device)
    started = time.perf_counter()
    model.to(device).train()
    precision.prepare_model(model)
    optimizer = build_optimizer(model, cfg, lr_scale)
    if continue_from is not None:
        # the momentum buffers carry over; this round's learning rates (lr_scale) stay
        base_lrs = [group["base_lr"] for group in optimizer.param_groups]
        optimizer.load_state_dict(dict(continue_from))
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["base_lr"] = base_lr
    scaler = precision.grad_scaler()
    criterion = nn.CrossEntropyLoss()
    check_each_step = device.type == "cpu"
    total_loss = 0.0
    total_correct = 0
    total_images = steps = 0
    result = LocalResult(0.0, 0.0, 0, 0)
    with graphed_backbone(model, cfg.batch_size, cfg.cuda_graphs and device.type == "cuda"):
        for epoch in range(cfg.local_epochs):
            scale = epoch_lr_scale(first_epoch + epoch, cfg.lr_step_size, cfg.lr_gamma)
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * scale
            result.lrs.append(cfg.lr * lr_scale * scale)
            model.train()
            ep_loss = torch.zeros((), dtype=torch.float64, device=device)
            ep_correct = torch.zeros((), dtype=torch.int64, device=device)
            ep_images = 0
            for batch in make_epoch_loader(epoch):
                images, labels = device_batch(batch, device)
                b = images.shape[0]
                if cfg.drop_last and b < cfg.batch_size:  # the reference skips partial batches
                    continue
                images = precision.prepare_input(images)
                optimizer.zero_grad(set_to_none=True)
                with precision.autocast():
                    if objective is None:
                        logits = model(images)
                        loss = criterion(logits, labels)
                    elif objective.needs_features:  # one forward gives both (MOON)
                        features = representation(model, images)
                        logits = model.classifier(features)
                        loss = objective.loss(model, images, labels, logits, features)
                    else:
                        logits = model(images)
                        loss = objective.loss(model, images, labels, logits)
                if check_each_step and not math.isfinite(loss.item()):
                    raise _diverged(loss.item(), epoch, f"step {steps}")
                precision.backward(loss, scaler)
                if objective is not None or cfg.clip_grad_norm is not None:
                    precision.unscale(optimizer, scaler)
                if objective is not None:
                    objective.before_step(model, optimizer)
                if cfg.clip_grad_norm is not None:  # the corrected gradient, as the official code clips its loss's
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                precision.step(optimizer, scaler)
                if objective is not None:
                    objective.after_step(model, optimizer)
                steps += 1
                ep_loss += loss.detach().double() * b
                ep_images += b
                ep_correct += (logits.detach().argmax(1) == labels).sum()
                if on_step is not None:
                    on_step(steps, loss.item())
            ep_sum = float(ep_loss)  # the epoch's one read of the device
            if not math.isfinite(ep_sum):
                raise _diverged(ep_sum, epoch, "a step of that epoch (checked at its end on this device)")
            result.epoch_losses.append(ep_sum / ep_images if ep_images else float("nan"))
            total_loss += ep_sum
            total_correct += int(ep_correct)
            total_images += ep_images
    result.steps = steps
    result.images = total_images
    result.loss = total_loss / total_images if total_images else float("nan")
    result.accuracy = float(total_correct) / total_images if total_images else float("nan")
    result.seconds = time.perf_counter() - started
    result.optimizer = optimizer
    return result


def _diverged(loss: float, epoch: int, where: str) -> FloatingPointError:
    return FloatingPointError(f"local training diverged (loss {loss}) at epoch {epoch}, {where}; lower train.lr")
