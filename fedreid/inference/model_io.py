"""Trained models for evaluation: finding and reading a model file, building the model, its fingerprint.

Model sources (:func:`load_model`): a run folder (its ``model_final.pt``,
else its ``checkpoint.pt``), a ``model_final.pt`` (``format:
fedreid.model``) or a ``checkpoint.pt`` (``config`` + ``server.global_state``).
Models come from :func:`fedreid.models.reid.create_reid_model` +
:func:`~fedreid.models.reid.load_shared_state`. Model files are read with
``torch.load(weights_only=True)`` only, and only once their first bytes show
a PyTorch file (:func:`fedreid.utils.filecheck.file_kind`): a pickle of other
objects is refused without running anything. A loaded model carries a
fingerprint (:func:`model_fingerprint`) that index folders record and
queries check (:func:`check_index_model`).

:func:`model_features` runs a loaded model over a loader: the flip-averaged,
L2-normalised embeddings of :class:`fedreid.inference.embed.EmbedModule`
through :func:`fedreid.inference.features.extract_features`, or for an exported
file (:func:`fedreid.inference.export.load_exported_model`) the file's own
feature. Torch is imported only where a PyTorch model file is read, hashed
or run: :class:`LoadedModel`, :func:`check_index_model` and the features of
an ONNX file need no torch.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

import numpy as np

from fedreid.inference.errors import EvalInputError
from fedreid.inference.features import FeatureSet, collect_features, extract_features
from fedreid.utils.filecheck import describe_kind, file_kind

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "MODEL_FORMAT",
    "MODEL_FILE",
    "CHECKPOINT_FILE",
    "FEATURE_KIND",
    "MODEL_DEFAULTS",
    "ModelMismatchError",
    "LoadedModel",
    "find_model_file",
    "run_config_path",
    "load_model",
    "model_fingerprint",
    "fingerprint_differences",
    "check_index_model",
    "refuse_other_model_settings",
    "model_features",
]

MODEL_FORMAT = "fedreid.model"
MODEL_FILE, CHECKPOINT_FILE = "model_final.pt", "checkpoint.pt"
#: What the features are (part of the model fingerprint): ``embed`` of image + flipped image, L2-normalised.
FEATURE_KIND = "embed+flip, l2-normalised"


class ModelMismatchError(EvalInputError):
    """A query's model is not the one its index was built with (their fingerprints differ)."""


@dataclass
class LoadedModel:
    """A model ready for feature extraction, and where it came from."""

    model: Optional[nn.Module]  # None for an exported file: ``extractor`` computes the features
    config: dict[str, Any]  # the model config (backbone, height, width, ...)
    source: Path
    round: Optional[int] = None
    #: :func:`model_fingerprint` of the loaded weights and config (empty when built by hand).
    fingerprint: dict[str, Any] = field(default_factory=dict)
    #: An exported-file runner (:func:`fedreid.inference.export.load_exported_model`): a function of images
    #: [B, 3, H, W] (numpy or torch) to features [B, d]; :func:`model_features` takes them as they are.
    extractor: Any = None
    #: The client whose own model this is (a local-training baseline's file), else None.
    client: Optional[str] = None


def find_model_file(path: str | Path) -> Path:
    """The model file for ``path``: the file itself, or a run folder's model_final.pt / checkpoint.pt."""
    path = Path(path)
    if path.is_dir():
        for name in (MODEL_FILE, CHECKPOINT_FILE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"no {MODEL_FILE} or {CHECKPOINT_FILE} in run folder {path}")
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    return path


def run_config_path(model_path: str | Path) -> Optional[Path]:
    """The ``config.yaml`` of the run that ``model_path`` (a run folder or a file in one) belongs to."""
    model_path = Path(model_path)
    folder = model_path if model_path.is_dir() else model_path.parent
    config = folder / "config.yaml"
    return config if config.is_file() else None


_EXPECTED_MODEL = (
    f"expected a fedreid run folder, its {MODEL_FILE} or {CHECKPOINT_FILE} "
    "(a torch.save'd dict of tensors and plain values)"
)


def _read_model_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of a file whose first bytes show a PyTorch file; errors in words.

    Nothing else is ever handed to an unpickler; a pickle holding objects
    other than tensors and plain containers is refused by ``weights_only``
    before any of it runs.
    """
    import pickle
    import warnings

    import torch

    from fedreid.utils.checkpoint import unreadable_reason

    try:
        kind = file_kind(path)
    except OSError as exc:
        raise EvalInputError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if kind not in ("zip", "pickle"):
        raise EvalInputError(f"model file {path} is not a PyTorch file: {describe_kind(kind)}; {_EXPECTED_MODEL}")
    try:
        with warnings.catch_warnings():  # a planted pickle's protocol is no news to the user: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise EvalInputError(
            f"model file {path} holds Python objects other than tensors and plain containers, which are never "
            f"loaded (loading them can run code); {_EXPECTED_MODEL}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault
        raise EvalInputError(
            f"model file {path} is a damaged or truncated PyTorch file: {unreadable_reason(path, exc)}; "
            f"{_EXPECTED_MODEL}"
        ) from None


def _model_payload(
    path: Path, client: Optional[str] = None
) -> tuple[dict[str, Any], Mapping[str, torch.Tensor], Optional[int]]:
    from fedreid.utils.checkpoint import CHECKPOINT_FORMAT

    data = _read_model_file(path)
    fmt = data.get("format") if isinstance(data, dict) else None
    try:
        config = data.get("config") if fmt == CHECKPOINT_FORMAT else None
        if fmt == CHECKPOINT_FORMAT and not isinstance(config, dict):
            raise EvalInputError(f"model file {path} ({fmt}): its config is a {type(config).__name__}, not a mapping")
        task = data.get("task", "reid") if fmt == MODEL_FORMAT else (config or {}).get("task", "reid")
        if task != "reid":
            raise EvalInputError(f"{path} holds a {task} model, not a person re-identification model")
        if fmt == MODEL_FORMAT:
            model, state = data["model"], _pick_state(path, data, client)
        elif fmt == CHECKPOINT_FORMAT:
            model, state = config["model"], _pick_state(path, _checkpoint_models(data), client)
        else:
            model = None
        if fmt in (MODEL_FORMAT, CHECKPOINT_FORMAT):
            return _checked_model_config(path, model), state, _checked_round(path, data.get("round"))
    except KeyError as exc:
        raise EvalInputError(f"model file {path} ({fmt}) lacks entry {exc}") from None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:  # an entry of the wrong kind
        raise EvalInputError(f"model file {path} ({fmt}) is malformed: {type(exc).__name__}: {exc}") from None
    what = f"its format is {fmt!r}" if fmt is not None else (
        "a bare state dict carries no model config" if isinstance(data, dict) else f"it holds a {type(data).__name__}"
    )
    raise EvalInputError(
        f"{path} is a PyTorch file but not a fedreid model ({MODEL_FILE}, format {MODEL_FORMAT!r}) "
        f"or training checkpoint ({CHECKPOINT_FILE}): {what}; {_EXPECTED_MODEL}"
    )


#: The model config entries that decide the architecture and the input, and what a file without one means
#: (an earlier fedreid's files lack some). Fixed here, not read from ModelConfig: a changed config default
#: must change neither what an old file's model is nor its fingerprint.
MODEL_DEFAULTS: dict[str, Any] = {"backbone": "resnet50", "last_stride": 2, "bottleneck_dim": 512, "height": 256,
                                  "width": 128}


def _model_value(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or :data:`MODEL_DEFAULTS`' value when the file's config lacks it."""
    return config.get(key, MODEL_DEFAULTS[key])


def _checked_model_config(path: Path, model: Any) -> dict[str, Any]:
    """A model file's model config, its architecture and input entries checked: names the file and entry."""
    if not isinstance(model, dict):
        raise EvalInputError(f"model file {path}: its model config is a {type(model).__name__}, not a mapping")
    for key, default in MODEL_DEFAULTS.items():
        if key not in model:
            continue  # load_model fills the defaults
        value, kind = model[key], type(default)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EvalInputError(f"model file {path}: model config {key} is {value!r}, expected a whole number >= 1")
        if kind is str and (not isinstance(value, str) or not value):
            raise EvalInputError(f"model file {path}: model config {key} is {value!r}, expected a model name")
    return dict(model)


def _checked_round(path: Path, value: Any) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise EvalInputError(f"model file {path}: its round is {value!r}, expected a whole number >= 0")
    return value


def _checkpoint_models(data: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's models laid out as a model file's: ``state``, and ``client_states`` in a local-training baseline.

    Its global state is the untrained start there: the server never aggregates.
    """
    server = data["server"]
    models: dict[str, Any] = {"state": server["global_state"]}
    if (data["config"].get("fl") or {}).get("mode") == "local":
        names = list(server["client_names"])
        models["client_states"] = {names[int(k)]: state for k, state in server["local_states"].items()}
    return models


def _pick_state(path: Path, data: Mapping[str, Any], client: Optional[str]) -> Mapping[str, torch.Tensor]:
    """The global state, or in a local-training baseline the chosen client's own model."""
    clients = data.get("client_states")
    if clients == {}:
        raise EvalInputError(f"{path} is a local-training baseline whose clients have not trained yet: no model to load")
    if clients is None:
        if client is not None:
            raise EvalInputError(f"{path} holds one global model, not per-client models: drop --client")
        return data["state"]
    if client is None or client not in clients:
        what = "has no client" if client is not None else "is a local-training baseline: every client has its own model"
        raise EvalInputError(
            f"{path} {what}{f' {client!r}' if client else ''}; choose one with --client "
            f"({', '.join(sorted(clients))})"
        )
    return clients[client]


def load_model(
    path: str | Path, device: str | torch.device = "cpu", *, client: Optional[str] = None
) -> LoadedModel:
    """Build the model from a run folder / model_final.pt / checkpoint.pt, in eval mode on ``device``.

    The architecture comes from the saved model config, without pretrained
    weights (the saved shared state overwrites them); a saved classifier
    (FedAvg keeps one) is dropped, features come from ``embed``. A
    local-training baseline's ``model_final.pt`` holds one model per client:
    ``client`` names the one to load.
    """
    from fedreid.models.reid import PRIVATE_PREFIXES, StateMismatchError, create_reid_model, load_shared_state

    file = find_model_file(path)
    cfg, state, rnd = _model_payload(file, client)
    model = None
    try:
        model = create_reid_model(
            _model_value(cfg, "backbone"),
            0,
            pretrained=None,
            last_stride=int(_model_value(cfg, "last_stride")),
            bottleneck_dim=int(_model_value(cfg, "bottleneck_dim")),
            dropout=float(cfg.get("dropout", 0.5)),
            seed=0,  # the saved state overwrites the initial weights; seeded, they leave the caller's RNG alone
        )
        shared = {k: v for k, v in state.items() if not k.startswith(PRIVATE_PREFIXES)}
        load_shared_state(model, shared)
    except StateMismatchError as exc:
        raise EvalInputError(
            f"model file {file}: saved state does not fit the model its config describes (backbone "
            f"{_model_value(cfg, 'backbone')!r}, bottleneck_dim {_model_value(cfg, 'bottleneck_dim')}): "
            f"{_state_mismatch(model, shared, exc)}"
        ) from None
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as exc:  # a config the models refuse
        raise EvalInputError(f"model file {file}: cannot build the model its config describes "
                             f"(backbone {cfg.get('backbone')!r}): {exc}") from None
    for key in ("height", "width"):  # the input size: what the extraction and an export read
        cfg.setdefault(key, MODEL_DEFAULTS[key])
    fingerprint = model_fingerprint(model, cfg)
    model.to(device).eval()
    return LoadedModel(model=model, config=cfg, source=file, round=rnd, fingerprint=fingerprint, client=client)


def refuse_other_model_settings(loaded: LoadedModel, settings: Mapping[str, Any], where: Mapping[str, str]) -> None:
    """An :class:`EvalInputError` when a setting of ``settings`` (``model.*`` values set by a config or an
    override) gives the architecture or input size another value than the model file's.

    The model file decides both, so a differing setting would be dropped
    without a word. ``where``: for each key, what set it (named in the error).
    """
    for key in MODEL_DEFAULTS:
        if key in settings and settings[key] != _model_value(loaded.config, key):
            raise EvalInputError(
                f"model.{key} is {settings[key]!r} ({where.get(key, 'the config')}) but the model file "
                f"{loaded.source} was built with {_model_value(loaded.config, key)!r}: the model file decides "
                "the architecture and the input size; drop or correct the setting"
            )


def _state_mismatch(model: Any, state: Mapping[str, Any], exc: Exception, shown: int = 3) -> str:
    """How ``state`` misses ``model``'s shared keys, in one short line: a count of each kind, ``shown`` keys in all."""
    from fedreid.models.reid import PRIVATE_PREFIXES

    if model is None:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    target = {k: v for k, v in model.state_dict().items() if not k.startswith(PRIVATE_PREFIXES)}

    def shape(value: Any) -> tuple[int, ...]:
        return tuple(getattr(value, "shape", ()))

    kinds = (
        ("missing keys", [k for k in target if k not in state]),
        ("unexpected keys", [k for k in state if k not in target]),
        ("shape mismatches", [f"{k} {shape(state[k])} in the file vs {shape(target[k])}"
                              for k in state if k in target and shape(state[k]) != shape(target[k])]),
    )
    parts = []
    for what, keys in kinds:
        if keys:
            listed = keys[:shown]
            shown -= len(listed)
            more = f", {len(keys) - len(listed)} more" if len(keys) > len(listed) else ""
            parts.append(f"{len(keys)} {what}" + (f" ({', '.join(listed)}{more})" if listed else ""))
    return "; ".join(parts) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def model_fingerprint(model: nn.Module, config: Mapping[str, Any]) -> dict[str, Any]:
    """What defines a model's features: ``weights_sha256``, architecture, input size, feature kind.

    ``weights_sha256`` hashes every entry of ``model.state_dict()`` (name,
    dtype, shape and bytes, in name order), so the same weights give the same
    digest whichever file (``model_final.pt``, ``checkpoint.pt``) or device
    they came from. The other fields come from the model ``config``
    (``backbone``, ``last_stride``, ``bottleneck_dim``, ``height``, ``width``;
    :data:`MODEL_DEFAULTS` where missing) and :data:`FEATURE_KIND`.
    Two models give comparable features only when every field is equal.
    """
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {
        "weights_sha256": digest.hexdigest(),
        "backbone": str(_model_value(config, "backbone")),
        "last_stride": int(_model_value(config, "last_stride")),
        "bottleneck_dim": int(_model_value(config, "bottleneck_dim")),
        "height": int(_model_value(config, "height")),
        "width": int(_model_value(config, "width")),
        "feature": FEATURE_KIND,
    }


#: Fingerprint fields that say how features were computed, not which: an ONNX or TorchScript export
#: of the same weights, input size and feature definition gives the same features as the PyTorch model.
HOW_FIELDS = ("backend", "export_sha256")


def fingerprint_differences(
    first: Mapping[str, Any], second: Mapping[str, Any], names: tuple[str, str] = ("index", "model")
) -> list[str]:
    """The fields in which two model fingerprints differ, as ``"<key> <first's> (<names[0]>) vs <second's> (<names[1]>)"``.

    Empty when they name the same model. :data:`HOW_FIELDS` are not compared
    when both record a weights digest (``weights_sha256``): an export of the
    same weights is the same model. Every check of "same model"
    (:func:`check_index_model`, a federated search site) uses this one rule.
    """

    def shown(value: Any) -> str:
        return value[:16] if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) else repr(value)

    # Without a weights digest on both sides only the export file itself identifies the model.
    weighed = bool(first.get("weights_sha256")) and bool(second.get("weights_sha256"))
    return [
        f"{key} {shown(first.get(key))} ({names[0]}) vs {shown(second.get(key))} ({names[1]})"
        for key in sorted(set(first) | set(second))
        if first.get(key) != second.get(key) and not (weighed and key in HOW_FIELDS)
    ]


def check_index_model(
    header: Mapping[str, Any], loaded: LoadedModel, index_dir: str | Path, *, allow_mismatch: bool = False
) -> Optional[str]:
    """Whether ``loaded`` is the model the index of ``header`` was built with; None when it is.

    The index header's ``meta.model_fingerprint`` is compared with
    ``loaded.fingerprint`` field by field, except how the features are
    computed (:data:`HOW_FIELDS`) when both record their weights' digest: an
    export of the same weights, input size and feature definition queries an
    index the PyTorch model built, and the reverse. A difference (or an index that
    records no fingerprint) raises :class:`ModelMismatchError` naming the
    differing fields with both values; with ``allow_mismatch`` the same words
    are returned instead, for the caller to show as a warning.
    """
    recorded = (header.get("meta") or {}).get("model_fingerprint")
    built_with = (header.get("meta") or {}).get("model", "an unrecorded model")
    if not isinstance(recorded, dict) or not recorded:
        problem = f"index {index_dir} records no model fingerprint, so it cannot be checked against {loaded.source}"
    else:
        diffs = fingerprint_differences(recorded, loaded.fingerprint)
        if not diffs:
            return None
        problem = (
            f"index {index_dir} was built with another model ({built_with}) than {loaded.source}: "
            + "; ".join(diffs)
        )
    if allow_mismatch:
        return f"{problem}; the scores may be meaningless (--allow-model-mismatch)"
    raise ModelMismatchError(
        f"{problem}; query with the index's model, build the index again with this one, "
        "or pass --allow-model-mismatch to search anyway"
    )


def model_features(
    loaded: LoadedModel,
    loader: Iterable[Any],
    device: str | torch.device,
    *,
    amp: bool = False,
    channels_last: bool = False,
    flip: bool = True,
) -> FeatureSet:
    """Features of ``loaded`` on ``loader``'s images: ``embed`` of image + flipped image, L2-normalised, float32.

    ``flip=False``: ``embed`` of the image alone (``eval.flip: false``).
    For an exported model (``loaded.extractor`` set) the exported file computes
    the flip-averaged, normalised feature itself (:func:`~fedreid.inference.features.collect_features`:
    no torch needed, the batches' images may be numpy arrays), so ``flip=False``
    is refused; it runs on the CPU, ``device``, ``amp`` and ``channels_last`` do not apply.
    """
    if loaded.extractor is not None:
        if not flip:
            raise EvalInputError(f"{loaded.source}: an exported model computes the flip-averaged feature itself; "
                                 "eval.flip=false needs the model file it was exported from")
        out = collect_features(loader, loaded.extractor)
        return out._replace(features=np.ascontiguousarray(out.features, dtype=np.float32))
    from fedreid.inference.embed import EmbedModule

    out = extract_features(
        EmbedModule(loaded.model), loader, flip=flip, normalize=True, device=device, amp=amp,
        channels_last=channels_last,
    )
    return out._replace(features=np.ascontiguousarray(out.features, dtype=np.float32))
