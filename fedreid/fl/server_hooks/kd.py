"""Public-set knowledge distillation on the server (Zhuang et al. 2020, Algorithm 2).

Every ``kd_every`` rounds, after aggregation:

1. each participating client, right after its local training, computes the
   features of its model without head (``embed``: the 512-d bottleneck
   output, eval mode, no grad) on the unlabeled public set, L2-normalises them
   and sends them in its :class:`~fedreid.fl.update.Update` metadata
   (``kd_features``, ``[N_public, d]``, rows in public-set order);
2. the server's target is their mean (:func:`kd_target`);
3. the aggregated global model (the student) makes one pass over the public
   set, SGD on the MSE between its features and the target (:func:`distill`).

Reference facts (``server.py`` ``Server.knowledge_distillation``,
``optimization.py`` ``kd_generate_soft_label``, ``main.py``, the
``running_*kd*.sh`` scripts):

* KD runs when ``(round + 1) % 10 == 0``, after the aggregation of that round.
* optimizer: ``SGD(lr=0.01 * lr = 5e-4, weight_decay=5e-4, momentum=0.9,
  nesterov=True)`` over all parameters of the global model, created anew for
  each distillation; the student is in **train** mode (dropout and batch-stat
  BatchNorm active); loss ``nn.MSELoss()`` (mean over batch and dimensions).
* teacher features are L2-normalised only with ``--regularization``, which
  every published KD script passes; the student's output is **not**
  normalised (``output = self.federated_model(x)``). ``kd_student_normalize``
  switches student normalisation on; off by default, as the reference.
* in the reference the teachers run in the same batches as the student, on
  train-augmented images, in whatever mode the client models were left
  (train). Here the targets are computed by the clients (so remote clients
  work the same) and therefore on the deterministic test transform, in eval
  mode; the student trains on those same un-augmented images.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.update import Update
from fedreid.utils.seeding import derive_seed, forked_torch_rng

KD_FEATURES = "kd_features"


def is_kd_round(round_index: int, every: int) -> bool:
    """``round_index`` is 0-based; KD after rounds ``every``, ``2 every``, ... (1-based)."""
    return (round_index + 1) % every == 0


def _images(batch: Any) -> Tensor:
    return batch["image"] if isinstance(batch, dict) else batch[0]


def _indices(batch: Any, offset: int) -> Tensor:
    if isinstance(batch, dict) and "index" in batch:
        return torch.as_tensor(batch["index"]).long()
    return torch.arange(offset, offset + _images(batch).shape[0])


def embed(model: nn.Module, images: Tensor) -> Tensor:
    """The model's feature (``embed``) without the identity head."""
    return model.embed(images)


@torch.no_grad()
def public_features(
    model: nn.Module, loader, num_images: int, *, device: torch.device | str = "cpu"
) -> Tensor:
    """L2-normalised ``embed`` features of the public set, ``[N, d]`` float32 on CPU.

    Eval mode, no grad; row ``i`` is the public image with dataset index ``i``.
    """
    was_training = model.training
    model.eval()
    out: Optional[Tensor] = None
    seen = 0
    try:
        for batch in loader:
            images = _images(batch).to(device)
            feats = F.normalize(embed(model, images).float(), p=2, dim=1).cpu()
            idx = _indices(batch, seen)
            if out is None:
                out = torch.zeros(num_images, feats.shape[1], dtype=torch.float32)
            out[idx] = feats
            seen += images.shape[0]
    finally:
        model.train(was_training)
    if out is None or seen != num_images:
        raise ValueError(f"KD: the public loader gave {seen} images, expected {num_images}")
    return out


def kd_target(features: Sequence[Tensor]) -> Tensor:
    """The mean of the clients' (already normalised) feature matrices."""
    if not features:
        raise ValueError("KD: no teacher features")
    shape = features[0].shape
    for i, f in enumerate(features):
        if f.shape != shape:
            raise ValueError(f"KD: teacher {i} sent features of shape {tuple(f.shape)}, expected {tuple(shape)}")
    acc = torch.zeros(shape, dtype=torch.float64)
    for f in features:
        acc += f.double()
    return (acc / len(features)).float()


def kd_loss(student: Tensor, target: Tensor, *, normalize_student: bool = False) -> Tensor:
    """``MSE(student, target)`` averaged over batch and dimensions (``nn.MSELoss``)."""
    if normalize_student:
        student = F.normalize(student, p=2, dim=1)
    return F.mse_loss(student, target)


def distill(
    model: nn.Module,
    loader,
    target: Tensor,
    *,
    lr: float = 5e-4,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    nesterov: bool = True,
    normalize_student: bool = False,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """One pass of the student ``model`` over ``loader`` towards ``target`` rows.

    Batches must carry the public-set ``index`` of each image (dict batches).
    Dropout draws from a torch RNG forked and seeded with ``seed``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov and momentum > 0
    )
    model.to(device).train()
    total, count, steps = 0.0, 0, 0
    started = time.perf_counter()
    with forked_torch_rng(seed, device):
        for batch in loader:
            images = _images(batch).to(device)
            if images.shape[0] < 2:
                continue  # BatchNorm cannot train on a single image
            idx = _indices(batch, 0)
            goal = target[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = kd_loss(embed(model, images), goal, normalize_student=normalize_student)
            loss.backward()
            optimizer.step()
            total += loss.item() * images.shape[0]
            count += images.shape[0]
            steps += 1
    model.eval()
    return {"kd_loss": total / count if count else float("nan"), "kd_steps": steps,
            "kd_seconds": time.perf_counter() - started}


class KDHook:
    """Server hook: asks clients for public features on KD rounds, then distils.

    ``public_loader_fn(shuffle, seed)`` builds a loader over the public set
    (test transform, dict batches with ``index``); ``num_public`` is its size.
    """

    name = "kd"

    def __init__(
        self,
        public_loader_fn,
        num_public: int,
        *,
        every: int = 10,
        lr: float = 5e-4,
        normalize_student: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.public_loader_fn = public_loader_fn
        self.num_public = num_public
        self.every = every
        self.lr = lr
        self.normalize_student = normalize_student
        self.seed = seed
        self.device = device

    def instructions(self, round_index: int) -> dict[str, Any]:
        return {"kd": True} if is_kd_round(round_index, self.every) else {}

    def check_update(self, round_index: int, update: Update, model: nn.Module) -> Optional[str]:
        """Why ``update``'s KD features cannot be a teacher this round, or None.

        A KD round needs ``kd_features`` as a floating ``[N_public, d]``
        tensor, ``d`` the global model's ``bottleneck_dim`` (when it has one).
        Checked per update before aggregation, so a client that sent none, or
        truncated ones, is left out of the round instead of stopping the run
        in :func:`kd_target` (finiteness is :func:`fedreid.fl.update.check_update`'s).
        """
        if not is_kd_round(round_index, self.every):
            return None
        feats = update.metadata.get(KD_FEATURES)
        if feats is None:
            return f"no {KD_FEATURES} in a KD round"
        if not isinstance(feats, Tensor) or not feats.is_floating_point():
            kind = f"a {feats.dtype} tensor" if isinstance(feats, Tensor) else f"a {type(feats).__name__}"
            return f"{KD_FEATURES} must be a floating-point tensor, got {kind}"
        dim = getattr(model, "bottleneck_dim", None)
        if feats.dim() != 2 or feats.shape[0] != self.num_public or (dim is not None and feats.shape[1] != dim):
            return (f"{KD_FEATURES} has shape {tuple(feats.shape)}, expected "
                    f"({self.num_public}, {dim if dim is not None else 'd'}) (public images, feature size)")
        return None

    def after_aggregate(
        self, round_index: int, model: nn.Module, updates: Sequence[Update]
    ) -> Optional[Mapping[str, Any]]:
        if not is_kd_round(round_index, self.every):
            return None
        # The server ran check_update on every update; this stays for callers that do not.
        missing = [u.client for u in updates if KD_FEATURES not in u.metadata]
        if missing:
            raise ValueError(f"KD round {round_index}: client {missing[0]!r} sent no {KD_FEATURES}")
        target = kd_target([u.metadata[KD_FEATURES] for u in updates])
        if target.shape[0] != self.num_public:
            raise ValueError(f"KD: targets for {target.shape[0]} images, public set has {self.num_public}")
        seed = derive_seed(self.seed, "kd", round_index)
        loader = self.public_loader_fn(shuffle=True, seed=derive_seed(seed, "shuffle"))
        stats = distill(
            model, loader, target, lr=self.lr, normalize_student=self.normalize_student,
            seed=derive_seed(seed, "dropout"), device=self.device,
        )
        stats["kd_teachers"] = len(updates)
        return stats
