"""Image classifiers for the federated classification track (FedAvg, MOON, FedNTD, FedLMD, FedFTG).

The contract
------------
Every model made by :func:`create_classifier` is a :class:`ClassificationModel`:

* ``model.features(x) -> Tensor [B, feat_dim]`` is the penultimate
  representation: the input of the last Linear layer, after its
  non-linearity (and pooling, for ResNets). MOON's projection head and
  contrastive loss, FedFTG's generator/distillation and any "feature"
  regulariser use it.
* ``model.classifier`` is that last ``nn.Linear(feat_dim, num_classes)``,
  the "head" (FedNTD/FedLMD compare its logits; head-personalising methods
  keep it private).
* ``model(x) == model.classifier(model.features(x))`` exactly: ``forward``
  does nothing else.
* State-dict keys are ``body.*`` (everything before the head) and
  ``classifier.*`` (the head), see :data:`BODY_PREFIX` / :data:`HEAD_PREFIX`,
  so code can split body and head by prefix whatever the architecture.
* ``feat_dim``, ``num_classes``, ``in_channels``, ``image_size`` and ``arch``
  are plain attributes.

Architectures (``list_classifiers()``)
--------------------------------------
``cnn_lmd``
    The CNN of FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient
    Learning of Deep Networks from Decentralized Data", §3: "two 5x5
    convolution layers (the first with 32 channels, the second with 64, each
    followed with 2x2 max pooling), a fully connected layer with 512 units and
    ReLU activation, and a final softmax output layer"). It is the model of
    FedLMD's official code: ``src/config/fedlmd.json`` of
    github.com/wnma3mz/FedLMD selects ``"fedavg_cifar"``, which is
    ``FedAvgNetCIFAR`` of FedNTD (Lee et al., NeurIPS 2022;
    github.com/Lee-Gihun/FedNTD ``train_tools/models/fedavgnet.py``):
    ``conv(C,32,5,pad 2) ReLU pool2 -> conv(32,64,5,pad 2) ReLU pool2 ->
    Linear(64*8*8, 512) ReLU -> Linear(512, classes)``; its features are the
    ReLU'd 512-d output (FedNTD's ``get_features`` returns the same ``z``).
    The flatten size is computed from ``image_size`` instead of being
    hard-coded: with padding 2 every conv keeps the size, so it is
    ``64 * (H // 4) * (W // 4)``: 4096 at 32x32 (FedNTD's CIFAR net), 3136 at
    28x28 (FedNTD's ``FedAvgNetMNIST``; with one channel the whole net has
    1,663,370 parameters, the figure of the FedAvg paper), 256 at 8x8
    (scikit-learn digits). Options: ``channels=(32, 64)``, ``hidden=(512,)``,
    ``kernel_size=5``, ``padding=2``; e.g. ``padding=0`` gives the unpadded
    variant (flatten ``64*5*5`` at 32x32, as in PFLlib's ``FedAvgCNN``),
    ``hidden=(512, 128)`` a two-hidden-layer one, and ``channels=(64, 64),
    hidden=(384, 192), padding=0`` the LeNet-style CIFAR CNN of FedDyn
    (Acar et al., ICLR 2021; github.com/alpemreacar/FedDyn ``utils_models.py``).
``resnet18_cifar``
    ResNet-18 (He et al., CVPR 2016) with the CIFAR stem: a 3x3 stride-1
    conv and no max-pool (as FedNTD's ``train_tools/models/resnet.py`` and the
    widely used kuangliu/pytorch-cifar ResNet), global average pooling,
    512-d features; 11,173,962 parameters for 10 classes. Built from timm's
    ``resnet18`` (torchvision key names) with the stem replaced. Standard
    BatchNorm (FedNTD's copy uses ``track_running_stats=False``; ours keeps
    running statistics, as torchvision and FedFTG do).
``resnet18``
    Plain ImageNet ResNet-18 (7x7 stride-2 conv + 3x3 max-pool), i.e. timm's
    ``resnet18``. This is what FedFTG's official code trains on CIFAR
    (github.com/ZhangLin-PKU/FedFTG ``models/resnet.py``: torchvision's
    ``ResNet(BasicBlock, [2, 2, 2, 2])``, unchanged stem; the paper, Zhang et
    al. CVPR 2022, only says "ResNet-18"). At 32x32 its last stage is 1x1.
    11,181,642 parameters for 10 classes. Loads torchvision/timm ImageNet
    files through ``pretrained``.
``vgg11`` / ``vgg11_bn``
    VGG-11 (Simonyan & Zisserman, ICLR 2015, configuration "A") sized for
    small inputs as in FedNTD's ``train_tools/models/vgg.py``: 3x3 convs,
    five 2x2 max-pools (a pool that would shrink a 1-pixel map is left out,
    so 28x28 and 8x8 inputs work; FedNTD drops the last pool at 28x28 the same
    way), flatten ``512 * h * w`` (512 at 32x32), then
    ``Linear(., 512) ReLU Linear(512, 512) ReLU`` (the 512-d features) and the
    head. ``vgg11`` has no BatchNorm (FedNTD's ``vgg11``, the one its
    experiments use: BatchNorm statistics are a known trouble under non-IID
    averaging); ``vgg11_bn`` puts BatchNorm after every conv. Conv weights
    ~ N(0, sqrt(2 / (k*k*out_channels))), bias 0, as there. ``dropout=0.0``
    by default (FedNTD's ``use_dropout=False``); ``dropout=p`` puts Dropout
    before each hidden Linear, as FedNTD's ``use_dropout=True``. 9,750,922
    parameters for 10 classes at 32x32.

Any other name is built by timm (``timm.create_model(name, num_classes=0,
in_chans=in_channels, pretrained=False, **kw)``, whose output is its
pre-logits feature) with our Linear head on top, so every timm CNN works;
``"timm:<name>"`` forces timm for a name we also define (``"timm:vgg11"``
is timm's ImageNet VGG-11 with its 4096-wide MLP).

Initialisation and seeds
------------------------
Layers keep their architecture's initialisation (PyTorch defaults for the
CNN and the heads, timm's for ResNets, FedNTD's for VGG convs). With
``seed`` every draw happens inside :func:`fedreid.models.reid._seeded_cpu_rng`
(the CPU generator forked, seeded, then restored), exactly as
:func:`fedreid.models.reid.create_reid_model`: the same seed gives
bit-identical weights whatever the global RNG state, and the caller's global
RNG is left as it was. Models are built on the CPU, so the CPU generator is
the only one drawn from. Without ``seed`` the global RNG is used.

Pretrained files
----------------
``pretrained`` is a local file (or ``pkg://`` path) read by
:func:`fedreid.models.backbones.read_state_dict`; nothing is downloaded.
A file whose keys start with ``body.`` is a whole :class:`ClassificationModel`
state dict (``torch.save(model.state_dict(), f)``): it must match exactly,
except that a file without ``classifier.*`` keys leaves the head as
initialised. Any other file is a backbone file in timm or torchvision format
(e.g. ImageNet ResNet-18 or MobileNetV2) loaded into ``body`` by
:func:`fedreid.models.backbones.load_pretrained` (classifier keys dropped,
torchvision MobileNetV2 names mapped). Mismatches raise
:class:`~fedreid.models.backbones.PretrainedWeightsError` listing the keys.
"""

from __future__ import annotations

import inspect
import numbers
from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable, Optional, TypeVar, Union, overload

import timm
from torch import Tensor, nn

from fedreid.errors import FedReIDError
from fedreid.models.backbones import (
    PathLike,
    PretrainedWeightsError,
    check_state_dict,
    close_model_names,
    load_pretrained,
    read_state_dict,
    resolve_weights_path,
)
from fedreid.models.reid import _seeded_cpu_rng
from fedreid.registry import Registry

__all__ = [
    "BODY_PREFIX",
    "HEAD_PREFIX",
    "TIMM_PREFIX",
    "ClassificationModel",
    "ModelConfigError",
    "UnknownModelError",
    "count_parameters",
    "create_classifier",
    "list_classifiers",
    "register_classifier",
]

#: State-dict prefix of everything before the head.
BODY_PREFIX = "body."
#: State-dict prefix of the head (the last Linear).
HEAD_PREFIX = "classifier."
#: Name prefix that sends a name straight to timm (``"timm:vgg11"``).
TIMM_PREFIX = "timm:"

ImageSize = Union[int, Sequence[int]]
_MAX_SIMILAR = 10


class ModelConfigError(FedReIDError, ValueError):
    """An argument of :func:`create_classifier` is invalid (the message names it)."""


class UnknownModelError(ModelConfigError):
    """The name is neither one of ours (:func:`list_classifiers`) nor a timm model."""


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class ClassificationModel(nn.Module):
    """``body -> features [B, feat_dim] -> classifier (Linear) -> logits [B, num_classes]``.

    See the module docstring for the contract other code relies on.
    """

    def __init__(
        self,
        body: nn.Module,
        feat_dim: int,
        num_classes: int,
        *,
        arch: str = "",
        in_channels: int = 3,
        image_size: tuple[int, int] = (32, 32),
    ) -> None:
        super().__init__()
        self.body = body
        self.classifier = nn.Linear(int(feat_dim), int(num_classes))
        self.feat_dim = int(feat_dim)
        self.arch = arch
        self.in_channels = int(in_channels)
        self.image_size = (int(image_size[0]), int(image_size[1]))

    @property
    def num_classes(self) -> int:
        return self.classifier.out_features

    def features(self, x: Tensor) -> Tensor:
        """Penultimate representation ``[B, feat_dim]`` (the head's input)."""
        return self.body(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def extra_repr(self) -> str:
        return (
            f"arch={self.arch!r}, in_channels={self.in_channels}, image_size={self.image_size}, "
            f"feat_dim={self.feat_dim}, num_classes={self.num_classes}"
        )


class _CheckedFlatten(nn.Flatten):
    """Flatten, failing with a readable message when the input size is not the built one.

    The first Linear after it is sized from ``image_size``; without this check
    a wrong input size surfaces as an anonymous matmul shape error.
    """

    def __init__(self, expected: int, image_size: tuple[int, int]) -> None:
        super().__init__(1)
        self.expected = int(expected)
        self.built_for = image_size

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        if out.shape[1] != self.expected:
            raise ValueError(
                f"this model was built for image_size={self.built_for} ({self.expected} flattened "
                f"features); the input's feature map {tuple(x.shape[1:])} gives {out.shape[1]} "
                f"(input images must have the size given to create_classifier)"
            )
        return out

    def extra_repr(self) -> str:
        return f"expected={self.expected}"


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


_Builder = TypeVar("_Builder", bound=Callable[..., tuple[nn.Module, int]])
#: Our architectures' body builders by name (timm's resolve after these, see :func:`create_classifier`).
_REGISTRY: Registry[Callable[..., tuple[nn.Module, int]]] = Registry("classifier", name_of=lambda fn: fn.__name__)


@overload
def register_classifier(name_or_fn: _Builder) -> _Builder: ...


@overload
def register_classifier(name_or_fn: Optional[str] = None) -> Callable[[_Builder], _Builder]: ...


def register_classifier(name_or_fn=None):  # type: ignore[no-untyped-def]
    """Register a body builder under its function name, or under ``name``.

    Usable as ``@register_classifier`` or ``@register_classifier("name")``. A
    builder takes keyword arguments ``in_channels``, ``image_size`` (an
    ``(H, W)`` pair) and its own options, and returns ``(body, feat_dim)``
    where ``body(x)`` is ``[B, feat_dim]``; :func:`create_classifier` adds the
    head, so every registered architecture keeps the module's contract.
    Registering a taken name raises :class:`ValueError`.
    """

    def add(fn: _Builder, name: str) -> _Builder:
        if name in _REGISTRY:
            raise ValueError(f"classifier {name!r} is already registered")
        if name.startswith(TIMM_PREFIX):
            raise ValueError(f"classifier names may not start with {TIMM_PREFIX!r}: {name!r}")
        return _REGISTRY.register(fn, name=name)

    if callable(name_or_fn):
        return add(name_or_fn, name_or_fn.__name__)
    return lambda fn: add(fn, name_or_fn or fn.__name__)


def list_classifiers() -> list[str]:
    """Our architectures' names, sorted (timm's come on top of these)."""
    return _REGISTRY.names()


# ---------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------


def create_classifier(
    name: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    image_size: ImageSize = 32,
    seed: Optional[int] = None,
    pretrained: Optional[PathLike] = None,
    **kw: object,
) -> ClassificationModel:
    """Build a classifier by name (ours first, then timm), see the module docstring.

    ``image_size`` is an int (square) or ``(H, W)``; it sizes the flatten of
    ``cnn_lmd`` / ``vgg11*`` and is checked for the others (which pool
    globally and accept any size). ``kw`` are the architecture's options
    (``cnn_lmd``: ``channels``, ``hidden``, ``kernel_size``, ``padding``;
    ``vgg11*``: ``hidden``, ``dropout``; timm: anything ``timm.create_model``
    takes, e.g. ``drop_rate``). ``seed`` makes the initialisation
    deterministic without touching the global RNG; ``pretrained`` is a local
    file. Raises :class:`UnknownModelError` for an unknown name and
    :class:`ModelConfigError` for invalid arguments.
    """
    num_classes = _positive_int("num_classes", num_classes)
    in_channels = _positive_int("in_channels", in_channels)
    size = _image_size(image_size)
    builder, arch = _resolve(name)
    with _seeded_cpu_rng(seed):
        body, feat_dim = builder(in_channels=in_channels, image_size=size, **kw)
        model = ClassificationModel(
            body, feat_dim, num_classes, arch=arch, in_channels=in_channels, image_size=size
        )
    if pretrained is not None:
        _load_pretrained(model, pretrained)
    return model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (each shared tensor once); buffers not counted."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _resolve(name: str) -> tuple[Callable[..., tuple[nn.Module, int]], str]:
    if not isinstance(name, str) or not name:
        raise ModelConfigError(f"model name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        return _checked_kwargs(_REGISTRY[name], name), name
    timm_name = name[len(TIMM_PREFIX):] if name.startswith(TIMM_PREFIX) else name
    if timm_name and timm.is_model(timm_name):
        return (lambda **kw: _timm_body(timm_name, **kw)), name
    similar = close_model_names(timm_name, list_classifiers() + timm.list_models(), limit=_MAX_SIMILAR) if timm_name else []
    hint = f"; close names: {', '.join(similar)}" if similar else ""
    raise UnknownModelError(
        f"unknown classifier {name!r}: ours are {', '.join(list_classifiers())}, "
        f"and it is not a timm model either{hint}"
    )


def _checked_kwargs(builder: Callable[..., tuple[nn.Module, int]], name: str) -> Callable[..., tuple[nn.Module, int]]:
    """Wrap ``builder`` so unknown options name the architecture and its options."""
    params = inspect.signature(builder).parameters
    options = [p for p in params if p not in ("in_channels", "image_size")]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def call(**kw: object) -> tuple[nn.Module, int]:
        unknown = sorted(k for k in kw if k not in params)
        if unknown and not open_ended:
            raise ModelConfigError(
                f"classifier {name!r} has no option(s) {', '.join(unknown)}; "
                f"its options are: {', '.join(options) or '(none)'}"
            )
        return builder(**kw)

    return call


def _positive_int(what: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ModelConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _is_int(value: object) -> bool:
    # numpy integers count (sizes often come from arrays); bools do not
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _image_size(value: ImageSize) -> tuple[int, int]:
    if _is_int(value):
        pair: tuple[object, ...] = (value, value)
    elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        pair = tuple(value)
    else:
        raise ModelConfigError(f"image_size must be an int or an (H, W) pair, got {value!r}")
    if not all(_is_int(v) and v >= 1 for v in pair):  # type: ignore[operator]
        raise ModelConfigError(f"image_size must hold positive integers, got {value!r}")
    return int(pair[0]), int(pair[1])  # type: ignore[call-overload]


def _load_pretrained(model: ClassificationModel, path: PathLike) -> None:
    path = resolve_weights_path(path)
    state = read_state_dict(path)
    if not any(k.startswith(BODY_PREFIX) for k in state):
        # A backbone file (timm / torchvision names): into the body only.
        load_pretrained(model.body, path)
        return
    target = model.state_dict()
    if not any(k.startswith(HEAD_PREFIX) for k in state):
        # A body-only save (e.g. for a new label set): the head stays as initialised.
        target = {k: v for k, v in target.items() if not k.startswith(HEAD_PREFIX)}
    check_state_dict(
        state, target, source=f"pretrained weights file {path}", allow_missing_nbt=True, error=PretrainedWeightsError
    )
    model.load_state_dict(state, strict=False)  # missing num_batches_tracked / head stay as built


# ---------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------


@register_classifier
def cnn_lmd(
    *,
    in_channels: int,
    image_size: tuple[int, int],
    channels: Sequence[int] = (32, 64),
    hidden: Sequence[int] = (512,),
    kernel_size: int = 5,
    padding: int = 2,
) -> tuple[nn.Module, int]:
    """FedAvg's CNN as used by FedNTD/FedLMD (module docstring): conv-ReLU-pool blocks, then ReLU'd FCs."""
    if not channels:
        raise ModelConfigError("cnn_lmd: channels must name at least one conv layer")
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    h, w = image_size
    c_in = in_channels
    for i, c_out in enumerate(channels, 1):
        layers[f"conv{i}"] = nn.Conv2d(c_in, int(c_out), kernel_size, padding=padding)
        layers[f"act{i}"] = nn.ReLU(inplace=True)
        layers[f"pool{i}"] = nn.MaxPool2d(2, 2)
        # conv output then floor-halving 2x2 pool; the flatten size follows from it
        h, w = (h + 2 * padding - kernel_size + 1) // 2, (w + 2 * padding - kernel_size + 1) // 2
        if h < 1 or w < 1:
            raise ModelConfigError(
                f"cnn_lmd: image_size {image_size} is too small for {i} conv({kernel_size}, padding "
                f"{padding}) + 2x2 pool stage(s) (the feature map would be empty)"
            )
        c_in = int(c_out)
    flat = c_in * h * w
    layers["flatten"] = _CheckedFlatten(flat, image_size)
    dim = flat
    for j, width in enumerate(hidden, 1):
        layers[f"fc{j}"] = nn.Linear(dim, int(width))
        layers[f"fc_act{j}"] = nn.ReLU(inplace=True)
        dim = int(width)
    return nn.Sequential(layers), dim


def _timm_resnet18(in_channels: int, *, cifar_stem: bool) -> tuple[nn.Module, int]:
    body = timm.create_model("resnet18", pretrained=False, num_classes=0, in_chans=in_channels)
    if cifar_stem:
        # CIFAR stem: 3x3 stride-1 conv, no max-pool, so a 32x32 image reaches
        # layer4 as 4x4 instead of 1x1. Initialised as timm inits its convs.
        body.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(body.conv1.weight, mode="fan_out", nonlinearity="relu")
        body.maxpool = nn.Identity()
    return body, int(body.num_features)


@register_classifier
def resnet18_cifar(*, in_channels: int, image_size: tuple[int, int]) -> tuple[nn.Module, int]:
    """ResNet-18 with the CIFAR stem (3x3/1 conv, no max-pool), 512-d pooled features."""
    return _timm_resnet18(in_channels, cifar_stem=True)


@register_classifier
def resnet18(*, in_channels: int, image_size: tuple[int, int]) -> tuple[nn.Module, int]:
    """ImageNet ResNet-18 (7x7/2 conv + max-pool), FedFTG's code's model; 512-d pooled features."""
    return _timm_resnet18(in_channels, cifar_stem=False)


#: VGG configuration "A" (11 weight layers with the 3 FCs): conv widths, "M" = 2x2 max-pool.
_VGG11_CFG: tuple[Union[int, str], ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _vgg11_body(
    in_channels: int, image_size: tuple[int, int], *, batch_norm: bool, hidden: int, dropout: float
) -> tuple[nn.Module, int]:
    if not 0.0 <= dropout < 1.0:
        raise ModelConfigError(f"vgg11: dropout must be in [0, 1), got {dropout!r}")
    convs: list[nn.Module] = []
    h, w = image_size
    c_in = in_channels
    for v in _VGG11_CFG:
        if v == "M":
            if h >= 2 and w >= 2:  # a pool on a 1-pixel map would empty it: leave it out
                convs.append(nn.MaxPool2d(2, 2))
                h, w = h // 2, w // 2
            continue
        conv = nn.Conv2d(c_in, int(v), kernel_size=3, padding=1)
        # FedNTD's VGG init (from the classic pytorch-vgg-cifar10): N(0, sqrt(2/n)), n = k*k*out
        nn.init.normal_(conv.weight, 0.0, (2.0 / (3 * 3 * int(v))) ** 0.5)
        nn.init.zeros_(conv.bias)
        convs.append(conv)
        if batch_norm:
            convs.append(nn.BatchNorm2d(int(v)))
        convs.append(nn.ReLU(inplace=True))
        c_in = int(v)
    flat = c_in * h * w
    fc: list[nn.Module] = []
    dim = flat
    for _ in range(2):
        if dropout > 0:
            fc.append(nn.Dropout(dropout))
        fc += [nn.Linear(dim, hidden), nn.ReLU(inplace=True)]
        dim = hidden
    body = nn.Sequential(
        OrderedDict(convs=nn.Sequential(*convs), flatten=_CheckedFlatten(flat, image_size), fc=nn.Sequential(*fc))
    )
    return body, dim


@register_classifier
def vgg11(
    *, in_channels: int, image_size: tuple[int, int], hidden: int = 512, dropout: float = 0.0
) -> tuple[nn.Module, int]:
    """VGG-11 ("A") without BatchNorm, small-image classifier (FedNTD's ``vgg11``)."""
    return _vgg11_body(in_channels, image_size, batch_norm=False, hidden=hidden, dropout=dropout)


@register_classifier
def vgg11_bn(
    *, in_channels: int, image_size: tuple[int, int], hidden: int = 512, dropout: float = 0.0
) -> tuple[nn.Module, int]:
    """VGG-11 ("A") with BatchNorm after every conv (FedNTD's ``vgg11_bn``)."""
    return _vgg11_body(in_channels, image_size, batch_norm=True, hidden=hidden, dropout=dropout)


def _timm_body(name: str, *, in_channels: int, image_size: tuple[int, int], **kw: object) -> tuple[nn.Module, int]:
    """Any timm model without its last Linear; its pre-logits output is ``features``."""
    taken = sorted({"num_classes", "in_chans", "pretrained"} & set(kw))
    if taken:
        raise ModelConfigError(
            f"timm model {name!r}: {', '.join(taken)} are set by create_classifier "
            f"(use num_classes=, in_channels=, pretrained=<local file>)"
        )
    try:
        body = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_channels, **kw)
    except TypeError as exc:  # an option the timm model does not take
        raise ModelConfigError(f"timm model {name!r} rejected options {sorted(kw)}: {exc}") from exc
    # head_hidden_size is the pre-logits width (differs from num_features when
    # the head has its own layers, e.g. MobileNetV3's conv_head)
    feat_dim = getattr(body, "head_hidden_size", None) or body.num_features
    return body, int(feat_dim)
