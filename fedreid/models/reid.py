"""The IDE re-identification model of the FedReID benchmark, split shared / private.

::

    images -> backbone (timm CNN, avg pool) -> [B, feat_dim]
           -> bottleneck = Linear(feat_dim, 512) -> BatchNorm1d(512) -> Dropout(0.5)   [shared]
           -> classifier = Linear(512, num_classes)                                   [private]

This is the reference ``ft_net`` + ``ClassBlock`` (FedReID ``model.py``) with
the ClassBlock's ``add_block`` named ``bottleneck``. The server averages the
backbone and the bottleneck; every client keeps its own identity head, and a
model built with ``num_classes=0`` (the server's global model) has none.

Initialisation, as the reference's ``weights_init_kaiming`` /
``weights_init_classifier``: bottleneck Linear ``kaiming_normal_(a=0,
mode="fan_out")`` with bias 0; BatchNorm1d weight ~ N(1, 0.02), bias 0;
classifier weight ~ N(0, 0.001), bias 0. The backbone keeps timm's
initialisation unless a pretrained file is given.

The test feature is :meth:`ReIDModel.embed` in eval mode (Dropout is the
identity and BatchNorm uses running statistics): the 512-d bottleneck output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Optional

import torch
from torch import Tensor, nn

from fedreid.errors import FedReIDError
from fedreid.models.backbones import PathLike, check_state_dict, create_backbone

__all__ = [
    "PRIVATE_PREFIXES",
    "SHARED_PREFIXES",
    "ReIDModel",
    "StateMismatchError",
    "create_reid_model",
    "load_shared_state",
    "private_state",
    "replace_classifier",
    "shared_state",
]

#: State-dict prefixes averaged by the server (BatchNorm buffers included).
SHARED_PREFIXES = ("backbone.", "bottleneck.")
#: State-dict prefixes that never leave a client.
PRIVATE_PREFIXES = ("classifier.",)


class StateMismatchError(FedReIDError, ValueError):
    """A state dict does not fit a model; the message lists the keys."""


class ReIDModel(nn.Module):
    """``backbone -> bottleneck [shared] -> classifier [private]``.

    ``forward(x)`` returns identity logits ``[B, num_classes]`` (a model
    without classifier raises); ``embed(x)`` returns the bottleneck output
    ``[B, bottleneck_dim]``, the retrieval feature when the caller has put the
    model in eval mode (in train mode it is the dropped-out training feature).
    """

    def __init__(
        self,
        backbone: nn.Module,
        feat_dim: int,
        num_classes: int = 0,
        *,
        bottleneck_dim: int = 512,
        dropout: float = 0.5,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.backbone = backbone
        self.feat_dim = int(feat_dim)
        self.bottleneck_dim = int(bottleneck_dim)
        self.bottleneck = nn.Sequential(
            nn.utils.skip_init(nn.Linear, feat_dim, bottleneck_dim),
            nn.BatchNorm1d(bottleneck_dim),
            nn.Dropout(dropout),
        )
        init_bottleneck(self.bottleneck, generator=generator)
        self.classifier: Optional[nn.Linear] = (
            _new_classifier(bottleneck_dim, num_classes, generator=generator) if num_classes else None
        )

    @property
    def num_classes(self) -> int:
        return 0 if self.classifier is None else self.classifier.out_features

    def embed(self, x: Tensor) -> Tensor:
        """Bottleneck feature ``[B, bottleneck_dim]`` (not L2-normalised)."""
        return self.bottleneck(self.backbone(x))

    def forward(self, x: Tensor) -> Tensor:
        if self.classifier is None:
            raise RuntimeError(
                "this ReIDModel has no classifier (num_classes=0); use embed() for features "
                "or replace_classifier() to add an identity head"
            )
        return self.classifier(self.embed(x))

    def extra_repr(self) -> str:
        return f"feat_dim={self.feat_dim}, bottleneck_dim={self.bottleneck_dim}, num_classes={self.num_classes}"


# ---------------------------------------------------------------------------
# Initialisation (reference ClassBlock)
# ---------------------------------------------------------------------------


def init_bottleneck(block: nn.Sequential, *, generator: Optional[torch.Generator] = None) -> None:
    """Reference ``weights_init_kaiming`` on the bottleneck's Linear and BatchNorm1d."""
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, nn.Linear):
                nn.init.kaiming_normal_(mod.weight, a=0, mode="fan_out", generator=generator)
                nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.BatchNorm1d):
                nn.init.normal_(mod.weight, 1.0, 0.02, generator=generator)
                nn.init.zeros_(mod.bias)


def init_classifier(linear: nn.Linear, *, generator: Optional[torch.Generator] = None) -> None:
    """Reference ``weights_init_classifier``: weight ~ N(0, 0.001), bias 0."""
    with torch.no_grad():
        nn.init.normal_(linear.weight, 0.0, 0.001, generator=generator)
        nn.init.zeros_(linear.bias)


def _new_classifier(
    in_features: int,
    num_classes: int,
    *,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> nn.Linear:
    # skip_init: no draw from the global RNG for the default init we overwrite
    head = nn.utils.skip_init(
        nn.Linear, in_features, num_classes, device=device or "cpu", dtype=dtype
    )
    init_classifier(head, generator=generator)
    return head


@contextlib.contextmanager
def _seeded_cpu_rng(seed: Optional[int]) -> Iterator[None]:
    """Seed the CPU default generator for the block, then restore it (CUDA untouched)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        yield


# ---------------------------------------------------------------------------
# Factory and head replacement
# ---------------------------------------------------------------------------


def create_reid_model(
    backbone: str = "resnet50",
    num_classes: int = 0,
    *,
    pretrained: Optional[PathLike] = None,
    last_stride: int = 2,
    bottleneck_dim: int = 512,
    dropout: float = 0.5,
    seed: Optional[int] = None,
) -> ReIDModel:
    """Build the FedReID model.

    ``num_classes=0`` builds no classifier (the server's global model).
    ``last_stride=2`` is the reference default (``main.py --stride 2``).
    With ``seed`` every random initialisation (timm's and ours) draws from a
    CPU generator seeded with it, inside :func:`torch.random.fork_rng`: the
    same seed gives bit-identical weights and the caller's global RNG state
    is left exactly as it was. Without ``seed`` the global RNG is used.
    """
    with _seeded_cpu_rng(seed):
        net, feat_dim = create_backbone(backbone, pretrained=pretrained, last_stride=last_stride)
        model = ReIDModel(
            net, feat_dim, num_classes, bottleneck_dim=bottleneck_dim, dropout=dropout
        )
    model.backbone_name = backbone
    return model


def replace_classifier(
    model: ReIDModel, num_classes: int, *, seed: Optional[int] = None
) -> ReIDModel:
    """Give ``model`` a fresh private head of ``num_classes`` (0 removes it), in place.

    The head is initialised as the reference's (N(0, 0.001), bias 0) on the
    bottleneck's device and dtype; with ``seed`` from
    ``torch.Generator().manual_seed(seed)`` (global RNG untouched).
    """
    if num_classes < 0:
        raise ValueError(f"num_classes must be >= 0, got {num_classes}")
    if num_classes == 0:
        model.classifier = None
        return model
    ref = model.bottleneck[0].weight
    generator = None if seed is None else torch.Generator().manual_seed(int(seed))
    if generator is not None and ref.device.type != "cpu":
        head = _new_classifier(model.bottleneck_dim, num_classes, generator=generator, dtype=ref.dtype)
        head = head.to(ref.device)
    else:
        head = _new_classifier(
            model.bottleneck_dim, num_classes, generator=generator, device=ref.device, dtype=ref.dtype
        )
    model.classifier = head
    return model


# ---------------------------------------------------------------------------
# Shared / private state
# ---------------------------------------------------------------------------


def _split_keys(model: nn.Module) -> tuple[list[str], list[str]]:
    shared, private, other = [], [], []
    for key in model.state_dict():
        if key.startswith(SHARED_PREFIXES):
            shared.append(key)
        elif key.startswith(PRIVATE_PREFIXES):
            private.append(key)
        else:
            other.append(key)
    if other:
        raise StateMismatchError(
            f"state keys neither shared {SHARED_PREFIXES} nor private {PRIVATE_PREFIXES}: "
            + ", ".join(other[:10])
        )
    return shared, private


def shared_state(model: nn.Module, *, copy: bool = True) -> dict[str, Tensor]:
    """The shared entries of ``model.state_dict()`` (backbone + bottleneck, BN buffers included).

    ``copy=True`` (default) returns detached clones, safe to keep while the
    model goes on training or is overwritten; ``copy=False`` returns the
    state-dict views that share storage with the model.
    """
    state = model.state_dict()
    shared, _ = _split_keys(model)
    return {k: (state[k].detach().clone() if copy else state[k]) for k in shared}


def private_state(model: nn.Module, *, copy: bool = True) -> dict[str, Tensor]:
    """The private entries (the identity head); empty for a model without one."""
    state = model.state_dict()
    _, private = _split_keys(model)
    return {k: (state[k].detach().clone() if copy else state[k]) for k in private}


def load_shared_state(
    model: nn.Module, state: Mapping[str, Tensor], strict: bool = True
) -> nn.Module:
    """Copy shared parameters and buffers into ``model`` (in place), leaving its head alone.

    Raises :class:`StateMismatchError` naming the keys when ``state`` has keys
    that are not shared keys of ``model`` (a classifier key included), when a
    shape differs, or, with ``strict=True``, when a shared key is missing.
    ``strict=False`` allows a partial update (missing keys keep their values);
    unexpected or mis-shaped keys are an error either way.
    """
    shared, _ = _split_keys(model)
    current = model.state_dict()
    target = {k: current[k] for k in shared}
    check_state_dict(
        state, target, source="shared state", strict=strict, error=StateMismatchError
    )
    model.load_state_dict(dict(state), strict=False)
    return model
