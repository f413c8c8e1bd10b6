"""Public-set knowledge distillation on the server (Zhuang et al. 2020, Algorithm 2).

Every ``kd_every`` rounds, after aggregation. Algorithm 2 (line 12; Algorithm 5
line 11) distils in every round, and so does the default here (``every=1``);
the official code distils after every 10th round only (cap-ntu/FedReID
``main.py:train``: ``if (i+1)%10 == 0: ... server.knowledge_distillation``),
which ``every=10`` reproduces.

1. each participating client, right after its local training, computes the
   features of its model without head (``embed``: the 512-d bottleneck
   output, no grad) on the unlabeled public set, L2-normalises them and sends
   them in its :class:`~fedreid.fl.update.Update` metadata (``kd_features``,
   ``[N_public, d]``, rows in public-set order);
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
  train-augmented images (``data_utils.py``: ``kd_loader`` uses the training
  transform, shuffled, batch size 32), in whatever mode the client models were
  left after local training (train: dropout and batch-statistics BatchNorm).

The paper (Algorithm 2, Sec. 5.1) says only "predict soft labels with w,
D_shared", so the teacher/student mode is an option (``fl.kd_mode``):

* ``eval`` (default): teachers in eval mode on the deterministic test
  transform (:func:`public_features` ``mode="eval"``), the public set in its
  own order; the student trains on those same un-augmented images;
* ``train`` (the reference): the server draws one loader seed per KD round
  (:meth:`KDHook.loader_seed`) and sends it as the ``kd_seed`` instruction;
  each client builds the public loader with that seed (same shuffle, same
  augmentations, same batches as the student's) and computes its features in
  train mode (:func:`public_features` ``mode="train"``: dropout active,
  BatchNorm on batch statistics, running statistics left untouched); the
  student then trains on exactly those augmented batches. The targets are
  still computed by the clients, so remote clients work the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.fl.server_hooks.base import HookContext, ServerHook, context_precision, register_hook
from fedreid.fl.update import Update
from fedreid.options import ConfigError, check_positive
from fedreid.utils.precision import FP32, Precision
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


KD_MODES = ("eval", "train")


@torch.no_grad()
def public_features(
    model: nn.Module,
    loader,
    num_images: int,
    *,
    device: torch.device | str = "cpu",
    mode: str = "eval",
    seed: int = 0,
    precision: Precision = FP32,
) -> Tensor:
    """L2-normalised ``embed`` features of the public set, ``[N, d]`` float32 on CPU.

    The forwards run under ``precision``'s autocast; the features are cast to
    fp32 before they are normalised.

    No grad; row ``i`` is the public image with dataset index ``i``.
    ``mode="eval"``: the model in eval mode. ``mode="train"`` (the reference's
    teachers, module docstring): train mode, so dropout (drawn from a torch RNG
    forked and seeded with ``seed``) and batch-statistics BatchNorm shape the
    features; the model's buffers (BatchNorm running statistics) are restored
    afterwards. A batch of one image, where BatchNorm has no batch statistics,
    is computed in eval mode (:func:`distill` skips such a batch, so its
    target is never used). The model is left in the mode it was in.
    """
    if mode not in KD_MODES:
        raise ValueError(f"KD: mode must be one of {', '.join(KD_MODES)} (fl.kd_mode), got {mode!r}")
    was_training = model.training
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if mode == "train" else {}

    def restore() -> None:  # every batch sees the model's own running statistics
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])

    out: Optional[Tensor] = None
    seen = 0
    try:
        with forked_torch_rng(seed, device):
            for batch in loader:
                images = _images(batch).to(device)
                model.train(mode == "train" and images.shape[0] > 1)
                with precision.autocast():
                    raw = embed(model, precision.prepare_input(images))
                feats = F.normalize(raw.float(), p=2, dim=1).cpu()
                restore()
                idx = _indices(batch, seen)
                if out is None:
                    out = torch.zeros(num_images, feats.shape[1], dtype=torch.float32)
                out[idx] = feats
                seen += images.shape[0]
    finally:
        model.train(was_training)
        restore()
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
    precision: Precision = FP32,
) -> dict[str, float]:
    """One pass of the student ``model`` over ``loader`` towards ``target`` rows.

    Batches must carry the public-set ``index`` of each image (dict batches).
    Dropout draws from a torch RNG forked and seeded with ``seed``. The
    student's forward runs under ``precision``'s autocast; the loss is taken
    on its fp32 features, and the parameters stay fp32.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov and momentum > 0
    )
    model.to(device).train()
    precision.prepare_model(model)
    scaler = precision.grad_scaler()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count, steps = 0, 0
    started = time.perf_counter()
    with forked_torch_rng(seed, device):
        for batch in loader:
            images = _images(batch).to(device)
            if images.shape[0] < 2:
                continue  # BatchNorm cannot train on a single image
            idx = _indices(batch, 0)
            goal = target[idx].to(device)
            optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                student = embed(model, precision.prepare_input(images))
            loss = kd_loss(student.float(), goal, normalize_student=normalize_student)
            precision.backward(loss, scaler)
            precision.step(optimizer, scaler)
            total += loss.detach().double() * images.shape[0]  # read once, after the pass
            count += images.shape[0]
            steps += 1
    model.eval()
    return {"kd_loss": float(total) / count if count else float("nan"), "kd_steps": steps,
            "kd_seconds": time.perf_counter() - started}


@dataclass
class KDOptions:
    """Options of the ``kd`` server hook (``fl.hooks: [{name: kd, ...}]``, or the ``fl.kd*`` keys)."""

    #: Distil after rounds ``every``, ``2 every``, ... (Algorithm 2: 1; the official code: 10).
    every: int = 1
    #: Learning rate of the student's SGD pass (the reference: ``0.01 * lr`` = 5e-4).
    lr: float = 5e-4
    #: Batch size of the public-set loaders (teachers' and student's).
    batch_size: int = 32
    #: Normalise the student's features before the MSE (the reference does not).
    student_normalize: bool = False
    #: ``eval``: teachers in eval mode on test-transformed images; ``train``: the
    #: reference's train-mode teachers on the student's augmented batches.
    mode: Literal["eval", "train"] = "eval"
    #: The unlabeled public set; null means ``data.public_dataset``.
    public_dataset: Optional[str] = None

    def validate(self, prefix: str) -> None:
        for name in ("every", "lr", "batch_size"):
            check_positive(f"{prefix}.{name}", getattr(self, name))


@register_hook
class KDHook(ServerHook):
    """Server hook: asks clients for public features on KD rounds, then distils.

    ``public_loader_fn(shuffle, seed)`` builds a loader over the public set
    (dict batches with ``index``; the test transform with ``mode="eval"``, the
    training transform with ``mode="train"``, as the clients' loaders);
    ``num_public`` is its size. ``mode`` is ``fl.kd_mode`` (module docstring):
    with ``train`` the KD instructions carry ``kd_seed``, the seed of the
    student's loader, so that the clients' teachers see the same batches.
    """

    name = "kd"
    tasks: ClassVar[tuple[str, ...]] = ("reid",)
    needs_public_set: ClassVar[bool] = True
    Options: ClassVar[type] = KDOptions

    @classmethod
    def build(cls, options: KDOptions, context: HookContext) -> "KDHook":
        if context.public_loader is None or context.public_size is None:
            raise ConfigError("fl.hooks: the kd hook needs a public dataset (fl.public_dataset or data.public_dataset)")
        return cls(context.public_loader, context.public_size, every=options.every, lr=options.lr,
                   normalize_student=options.student_normalize, seed=context.seed, device=context.device,
                   mode=options.mode, precision=context_precision(context))

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
        mode: str = "eval",
        precision: Precision = FP32,
    ) -> None:
        if mode not in KD_MODES:
            raise ValueError(f"KD: mode must be one of {', '.join(KD_MODES)} (fl.kd_mode), got {mode!r}")
        self.mode = mode
        self.public_loader_fn = public_loader_fn
        self.num_public = num_public
        self.every = every
        self.lr = lr
        self.normalize_student = normalize_student
        self.seed = seed
        self.device = device
        self.precision = precision

    def round_seed(self, round_index: int) -> int:
        return derive_seed(self.seed, "kd", round_index)

    def loader_seed(self, round_index: int) -> int:
        """The seed of KD round ``round_index``'s public loader (shuffle and augmentation)."""
        return derive_seed(self.round_seed(round_index), "shuffle")

    def instructions(self, round_index: int) -> dict[str, Any]:
        if not is_kd_round(round_index, self.every):
            return {}
        if self.mode == "train":
            return {"kd": True, "kd_seed": self.loader_seed(round_index)}
        return {"kd": True}

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

    def trains_model(self, round_index: int) -> bool:
        return is_kd_round(round_index, self.every)

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
        seed = self.round_seed(round_index)
        loader = self.public_loader_fn(shuffle=True, seed=self.loader_seed(round_index))
        stats = distill(
            model, loader, target, lr=self.lr, normalize_student=self.normalize_student,
            seed=derive_seed(seed, "dropout"), device=self.device, precision=self.precision,
        )
        stats["kd_teachers"] = len(updates)
        return stats
