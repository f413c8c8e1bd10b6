"""Exported feature extractors: ONNX and TorchScript files of a model's retrieval feature, and their runners.

What is exported. :func:`fedreid.inference.model_io.model_features` computes an
image's feature as ``embed(x) + embed(flip_lr(x))``, L2-normalised; the flip
and the normalisation happen *outside* the network, in
:func:`fedreid.inference.features.extract_features`. The exported graph
(:func:`feature_graph`) holds all of it, using the same two operations
(``features._flip_lr``, ``nn.functional.normalize``): its output
``features`` [B, d] float32 *is* the index feature, so a consumer without
PyTorch has nothing of the feature to re-implement. The preprocessing is the
caller's: input ``images`` is [B, 3, H, W] float32, the output of
:func:`fedreid.data.transforms.build_test_transform` (RGB, resized to H x W
with OpenCV's bicubic ``INTER_CUBIC`` without antialiasing, scaled by 1/255,
ImageNet mean/std-normalised, CHW); the batch axis is dynamic. The sidecar
records these steps as numbers (``input.preprocessing_spec``,
:func:`fedreid.inference.images.preprocessing_record`, next to the older prose
``input.preprocessing``), and an ONNX file carries the same record in its
``metadata_props`` (key :data:`ONNX_PREPROCESSING_KEY`, JSON). The runners
refuse a batch that is not floating point (raw ``uint8`` pixels) in one line
naming the file and the expected input; floating batches are cast to float32.

Each exported file ``F`` has a sidecar ``F.json`` (:data:`EXPORT_FORMAT`):
backend, input size, feature size, the model fingerprint
(:func:`~fedreid.inference.model_io.model_fingerprint`, with the exported input
size) and the file's size and SHA-256. :func:`load_extractor` reads the
sidecar first and checks the file against it before any reader sees the
file; the sidecar's declared input and output, and an ONNX graph's own, must
be ``images`` [batch, 3, H, W] -> ``features`` [batch, d] with a dynamic
batch axis, and every run's output must have one row per image (else one
:class:`ExportError` line naming the file). Loading a TorchScript file runs the program inside it: only load
files this tool wrote (the sidecar check refuses files without a matching
sidecar, not a determined forger who writes both).

Files are written atomically (:func:`fedreid.utils.io.atomic_path`); an
existing file is replaced only when it is itself an export of this module
(its sidecar matches it); anything else at the path is refused and left
untouched.

Exporting needs torch; running an ONNX file does not. This module imports
neither torch nor onnxruntime at import time, :class:`OnnxExtractor` needs
only numpy and onnxruntime, and :func:`load_exported_model` gives a
:class:`~fedreid.inference.model_io.LoadedModel` whose ``extractor`` computes the
features (no torch module around it). So ``tools/eval_reid.py index``,
``query`` and ``serve`` with ``--backend onnx`` (and
:func:`fedreid.retrieval.service.create_app` with such a model) run where
``import torch`` fails; the ``pytorch`` and ``torchscript`` backends, the
``evaluate`` and ``export`` commands need torch. ``setup.py`` still lists
torch, torchvision and timm as requirements, so such a machine installs
fedreid with ``pip install --no-deps`` and its other requirements (plus
onnxruntime, and the ``serve`` extra to serve) by hand.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np

from fedreid.inference.errors import EvalInputError
from fedreid.utils.filecheck import sha256_file
from fedreid.utils.io import atomic_path, write_json_atomic

if TYPE_CHECKING:
    from fedreid.inference.model_io import LoadedModel

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_FORMATS",
    "INPUT_NAME",
    "OUTPUT_NAME",
    "DEFAULT_OPSET",
    "ONNX_PREPROCESSING_KEY",
    "ExportError",
    "feature_graph",
    "export_model",
    "sidecar_path",
    "read_sidecar",
    "OnnxExtractor",
    "TorchScriptExtractor",
    "load_extractor",
    "load_exported_model",
    "BACKENDS",
    "load_feature_model",
]

EXPORT_FORMAT = "fedreid.export"
EXPORT_VERSION = 1
EXPORT_FORMATS = ("onnx", "torchscript")
#: What computes the features of ``index``, ``query`` and ``serve``: the PyTorch model or an exported file.
BACKENDS = ("pytorch", *EXPORT_FORMATS)
INPUT_NAME, OUTPUT_NAME = "images", "features"
DEFAULT_OPSET = 17
#: The ONNX ``metadata_props`` key holding the preprocessing record (JSON) of an exported file.
ONNX_PREPROCESSING_KEY = "fedreid.preprocessing"


class ExportError(EvalInputError):
    """An export path that may not be written, or an exported file that may not be loaded."""


def sidecar_path(path: str | Path) -> Path:
    """``<path>.json``: the description of the exported file ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _graph_class():
    import torch
    from torch import nn

    from fedreid.inference.features import _flip_lr

    class FeatureGraph(nn.Module):
        """``normalize(embed(x) + embed(flip_lr(x)))``: the feature of ``model_features``, as one module."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            feats = self.model.embed(images) + self.model.embed(_flip_lr(images))
            return nn.functional.normalize(feats.reshape(feats.shape[0], -1).float(), p=2, dim=1)

    return FeatureGraph


def feature_graph(model: Any) -> Any:
    """``FeatureGraph(model)``: ``normalize(embed(x) + embed(flip_lr(x)))`` as one module (what is exported)."""
    return _graph_class()(model)


def read_sidecar(path: str | Path, *, check_file: bool = True) -> dict[str, Any]:
    """The sidecar of exported file ``path``, checked: format, fields, and (``check_file``) the file's size and SHA-256.

    Raises :class:`ExportError` naming the file and what is wrong.
    """
    path, side = Path(path), sidecar_path(path)
    how = "only files written by 'tools/eval_reid.py export' (with their .json sidecar) are loaded"
    if not path.is_file():
        raise ExportError(f"exported model {path} does not exist")
    if not side.is_file():
        raise ExportError(f"exported model {path} has no sidecar {side.name}: {how}")
    try:
        meta = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"sidecar {side} is unreadable ({type(exc).__name__}): {how}") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"sidecar {side} is not a {EXPORT_FORMAT} description: {how}")
    try:
        backend, height, width = meta["backend"], int(meta["input"]["height"]), int(meta["input"]["width"])
        size, digest = int(meta["file_bytes"]), str(meta["file_sha256"])
        dict(meta["model_fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"sidecar {side} lacks or garbles entry {exc}: {how}") from None
    if backend not in EXPORT_FORMATS or height < 1 or width < 1:
        raise ExportError(f"sidecar {side}: backend {backend!r} / input {height}x{width} not understood: {how}")
    if check_file:
        actual = path.stat().st_size
        if actual != size or sha256_file(path) != digest:
            raise ExportError(
                f"exported model {path} is not the file its sidecar {side.name} describes "
                f"({actual} bytes vs {size} recorded, or another SHA-256): changed, damaged or replaced; "
                "export it again"
            )
    return meta


def _is_our_export(path: Path) -> bool:
    """Whether ``path`` has the sidecar this module writes for it, whether or not the pair still agrees.

    The file is replaced before its sidecar is written, so an export stopped
    in between leaves a sidecar describing the previous file: the name is
    still this module's to write again.
    """
    try:
        meta = read_sidecar(path, check_file=False)
    except ExportError:
        return False
    return meta.get("file") == path.name


def _claim_export_path(path: Path) -> None:
    """Refuse ``path`` (or its sidecar) when it exists and is not an export of this module."""
    side = sidecar_path(path)
    if path.is_dir():
        raise ExportError(f"--out {path} is a folder; give a file name")
    if path.exists() and not _is_our_export(path):
        raise ExportError(
            f"refusing to overwrite {path}: it exists and is not a model exported by this tool "
            f"(no matching {side.name}); remove it or choose another --out"
        )
    if side.exists() and not path.exists():
        raise ExportError(f"refusing to overwrite {side}: it exists without the file it describes; remove it")


def export_model(
    model: Any,
    path: str | Path,
    format: str,
    input_size: tuple[int, int],
    *,
    opset: int = DEFAULT_OPSET,
    fingerprint: Optional[Mapping[str, Any]] = None,
    source: Optional[str] = None,
) -> Path:
    """Write ``model``'s retrieval feature (:func:`feature_graph`) to ``path`` as ``onnx`` or ``torchscript``.

    ``model``: a :class:`~fedreid.models.reid.ReIDModel` (anything with
    ``embed``) or a :class:`~fedreid.inference.model_io.LoadedModel` (then
    ``fingerprint`` and ``source`` default to its own, with ``input_size``
    as height and width). ``input_size``: (height, width) of the images
    the file is traced with and will expect. The model is exported on the
    CPU in eval mode; every module's train/eval flag is restored
    afterwards. Writes ``path`` and then ``path.json`` atomically; returns
    ``path``. Raises :class:`ExportError` when ``path`` holds something that
    is not an earlier export.
    """
    import torch

    from fedreid.inference.images import preprocessing_record

    if format not in EXPORT_FORMATS:
        raise ExportError(f"export format {format!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    height, width = (int(v) for v in input_size)
    if height < 1 or width < 1:
        raise ExportError(f"input size {height}x{width}: both must be >= 1")
    path = Path(path)
    if hasattr(model, "fingerprint") and hasattr(model, "model"):  # a LoadedModel
        fingerprint = fingerprint if fingerprint is not None else model.fingerprint
        source = source if source is not None else str(model.source)
        model = model.model
    fp = dict(fingerprint or {})
    if fp:
        fp.update(height=height, width=width)
    _claim_export_path(path)
    preprocessing = preprocessing_record(height, width)

    modes = {module: module.training for module in model.modules()}
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    graph = feature_graph(model).to("cpu").eval()
    example = torch.zeros(2, 3, height, width)
    try:
        with torch.no_grad():
            dim = int(graph(example).shape[1])
        with atomic_path(path) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notes are not the user's concern
            if format == "onnx":
                try:
                    torch.onnx.export(
                        graph, (example,), str(tmp), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                        dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                        opset_version=int(opset), do_constant_folding=True, dynamo=False,
                    )
                except Exception as exc:  # noqa: BLE001 - the exporter's refusal of this opset, in its words
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    hint = f" (the default opset is {DEFAULT_OPSET})" if int(opset) != DEFAULT_OPSET else ""
                    raise ExportError(f"ONNX export at --opset {opset} failed: {first[:200]}{hint}") from None
                _add_onnx_metadata(tmp, {ONNX_PREPROCESSING_KEY: json.dumps(preprocessing, sort_keys=True)})
            else:
                with torch.no_grad():
                    traced = torch.jit.trace(graph, (example,), check_trace=False)
                torch.jit.save(traced, str(tmp))
    finally:
        model.to(device)
        for module, training in modes.items():
            module.training = training
    meta = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "backend": format,
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "file_sha256": sha256_file(path),
        "input": {"name": INPUT_NAME, "shape": ["batch", 3, height, width], "dtype": "float32",
                  "height": height, "width": width,
                  "preprocessing": "RGB, resize to height x width (bicubic), ImageNet mean/std, CHW",
                  "preprocessing_spec": preprocessing},
        "output": {"name": OUTPUT_NAME, "shape": ["batch", dim], "dtype": "float32",
                   "feature": "embed(x) + embed(flip_lr(x)), L2-normalised"},
        "opset": int(opset) if format == "onnx" else None,
        "model_fingerprint": fp,
        "source": source,
    }
    write_json_atomic(sidecar_path(path), meta)
    return path


def _add_onnx_metadata(path: Path, props: Mapping[str, str]) -> None:
    """Set ``props`` in the ``metadata_props`` of the ONNX file ``path`` (rewritten in place); needs ``onnx``.

    Without the ``onnx`` package (the ``[onnx]`` extra installs it) the file
    keeps no metadata and only the sidecar records the preprocessing.
    """
    try:
        import onnx
    except ImportError:
        return
    proto = onnx.load(str(path))
    kept = [entry for entry in proto.metadata_props if entry.key not in props]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def _expected_input(meta: Mapping[str, Any]) -> str:
    """The input an exported file of sidecar ``meta`` expects, in words (from its preprocessing record)."""
    height, width = int(meta["input"]["height"]), int(meta["input"]["width"])
    spec = (meta.get("input") or {}).get("preprocessing_spec")
    shape = f"float32 images [batch, 3, {height}, {width}] (NCHW)"
    try:
        resize = spec["resize"]
        return (
            f"{shape}: {spec['color']} pixels resized to {resize['height']}x{resize['width']} "
            f"({resize['interpolation']}, {'antialiased' if resize.get('antialias') else 'no antialiasing'}), scaled by {spec['scale']:.6g} to [0, 1], then "
            f"(x - mean) / std with mean {spec['mean']} and std {spec['std']} (its sidecar's input.preprocessing_spec)"
        )
    except (KeyError, TypeError):  # a sidecar of an older export: its prose only
        return f"{shape}: RGB, resized, scaled to [0, 1], ImageNet mean/std-normalised (its sidecar's input.preprocessing)"


def _as_array(images: Any, height: int, width: int, where: Path, expected: str = "") -> np.ndarray:
    """``images`` as a C-contiguous float32 [B, 3, H, W] array; floating input only (float64 etc. are cast)."""
    if hasattr(images, "detach"):  # a torch tensor, without importing torch here
        images = images.detach().cpu()
        if str(images.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            images = images.float()
        images = images.numpy()
    x = np.asarray(images)
    if not np.issubdtype(x.dtype, np.floating):
        raise ExportError(
            f"exported model {where} takes {expected or 'float32 images'}; got {x.dtype} values "
            "(raw pixels are not its input: preprocess them first)"
        )
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 4 or x.shape[1] != 3 or x.shape[2:] != (height, width):
        raise ExportError(
            f"exported model {where} takes images [batch, 3, {height}, {width}], got shape {tuple(x.shape)}"
        )
    return x


def _shown_shape(shape: Any) -> str:
    return "[" + ", ".join(str(v) for v in shape) + "]" if isinstance(shape, (list, tuple)) else repr(shape)


#: In a shape :func:`_fits` checks: the axis must be dynamic (a name or unknown, not a number).
_DYNAMIC = "dynamic"


def _fits(shape: Any, wanted: list[Any]) -> bool:
    """Whether an ONNX shape fits ``wanted``: the same rank, :data:`_DYNAMIC` axes not fixed, int axes equal
    where fixed, None axes anything. (An unknown rank fits: the run's output check covers it.)"""
    if not isinstance(shape, (list, tuple)):
        return True
    if len(shape) != len(wanted):
        return False
    for got, want in zip(shape, wanted):
        if isinstance(got, int) and (want == _DYNAMIC or (want is not None and got != want)):
            return False
    return True


def _check_declared_io(meta: Mapping[str, Any], path: Path, height: int, width: int) -> Optional[int]:
    """The feature size the sidecar of ``path`` declares (None: not given); :class:`ExportError` for another contract.

    Every extractor runs one contract: input :data:`INPUT_NAME` [batch, 3, H, W]
    and output :data:`OUTPUT_NAME` [batch, d], the batch axis dynamic. A sidecar
    declaring another name, a fixed batch size or another rank describes a file
    no runner here can feed, so it is refused when the file is loaded rather
    than when the first batch of a run fails.
    """
    side = sidecar_path(path).name
    expected_in = f"input {INPUT_NAME!r} [batch, 3, {height}, {width}]"
    declared_in = meta.get("input") or {}
    name, shape = declared_in.get("name", INPUT_NAME), declared_in.get("shape")
    if name != INPUT_NAME or (shape is not None and (
            not isinstance(shape, list) or len(shape) != 4 or isinstance(shape[0], int) or shape[1:] != [3, height, width])):
        raise ExportError(
            f"exported model {path}: its sidecar {side} declares input {name!r} {_shown_shape(shape)}; expected "
            f"{expected_in} with a dynamic batch axis (as 'tools/eval_reid.py export' writes): export it again"
        )
    declared_out = meta.get("output") or {}
    name, shape = declared_out.get("name", OUTPUT_NAME), declared_out.get("shape")
    if name != OUTPUT_NAME or (shape is not None and (
            not isinstance(shape, list) or len(shape) != 2 or isinstance(shape[0], int)
            or type(shape[1]) is not int or shape[1] < 1)):
        raise ExportError(
            f"exported model {path}: its sidecar {side} declares output {name!r} {_shown_shape(shape)}; expected "
            f"output {OUTPUT_NAME!r} [batch, d] with a dynamic batch axis (as 'tools/eval_reid.py export' writes): "
            "export it again"
        )
    return int(shape[1]) if shape is not None else None


class _Extractor:
    backend = ""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = read_sidecar(self.path)
        if self.meta["backend"] != self.backend:
            raise ExportError(f"exported model {self.path} is a {self.meta['backend']} file, not {self.backend}")
        self.height, self.width = int(self.meta["input"]["height"]), int(self.meta["input"]["width"])
        #: The feature size the sidecar declares (None for a sidecar without an output shape).
        self.dim: Optional[int] = _check_declared_io(self.meta, self.path, self.height, self.width)
        #: The model fingerprint recorded at export (weights SHA-256, backbone, input size, feature kind).
        self.fingerprint: dict[str, Any] = dict(self.meta["model_fingerprint"])
        self.file_sha256: str = self.meta["file_sha256"]
        #: The input this file expects, in words (from the sidecar's preprocessing record).
        self.expected_input: str = _expected_input(self.meta)

    def __call__(self, images: Any) -> np.ndarray:
        """Features [B, d] float32 (L2-normalised, flip-averaged) of ``images`` [B, 3, H, W] (numpy or torch).

        ``images`` must be floating point, preprocessed as the sidecar records
        (``input.preprocessing_spec``); integer pixels raise :class:`ExportError`.
        An output of any other shape (not one row per image, or not the
        declared d) raises :class:`ExportError` naming the file, so no caller
        pairs features with the wrong images.
        """
        x = _as_array(images, self.height, self.width, self.path, self.expected_input)
        out = np.ascontiguousarray(self._run(x), dtype=np.float32)
        if out.ndim != 2 or out.shape[0] != x.shape[0] or (self.dim is not None and out.shape[1] != self.dim):
            raise ExportError(
                f"exported model {self.path} gave output {OUTPUT_NAME!r} of shape {_shown_shape(out.shape)} for "
                f"{x.shape[0]} images: expected [{x.shape[0]}, {self.dim or 'd'}] (one feature row per image)"
            )
        return out

    def _run(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class OnnxExtractor(_Extractor):
    """An exported ONNX file run by ONNX Runtime (CPU), checked against its sidecar first. No torch needed."""

    backend = "onnx"

    def __init__(self, path: str | Path, *, threads: Optional[int] = None) -> None:
        super().__init__(path)
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ExportError(f"the onnx backend needs onnxruntime (pip install 'fedreid[onnx]'): {exc}") from None
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ExportError(f"exported model {self.path} is not a readable ONNX file ({first[:200]})") from None
        self._check_graph_io()

    def _check_graph_io(self) -> None:
        """Refuse a graph whose inputs/outputs are not the contract (see :func:`_check_declared_io`).

        Checked from the graph's own declarations when the file is loaded, so a
        fixed batch size, another name or a 1-D output is one line naming the
        file instead of an onnxruntime error (or misaligned features) at the first batch.
        """
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        wanted_in = f"one input {INPUT_NAME!r} float32 [batch, 3, {self.height}, {self.width}] with a dynamic batch axis"
        got_in = ", ".join(f"{i.name!r} {i.type} {_shown_shape(i.shape)}" for i in inputs) or "none"
        if len(inputs) != 1 or inputs[0].name != INPUT_NAME or inputs[0].type != "tensor(float)" \
                or not _fits(inputs[0].shape, [_DYNAMIC, 3, self.height, self.width]):
            raise ExportError(f"exported model {self.path} takes inputs {got_in}: expected {wanted_in}")
        out = next((o for o in outputs if o.name == OUTPUT_NAME), None)
        wanted_out = f"an output {OUTPUT_NAME!r} float32 [batch, {self.dim or 'd'}] with a dynamic batch axis"
        if out is None or out.type != "tensor(float)" or not _fits(out.shape, [_DYNAMIC, self.dim]):
            got_out = ", ".join(f"{o.name!r} {o.type} {_shown_shape(o.shape)}" for o in outputs) or "none"
            raise ExportError(f"exported model {self.path} gives outputs {got_out}: expected {wanted_out}")

    def _run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]


class TorchScriptExtractor(_Extractor):
    """An exported TorchScript file (``torch.jit.load``: runs its program; load only files this tool wrote)."""

    backend = "torchscript"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        import torch

        try:
            with warnings.catch_warnings():  # torch.jit.load's deprecation note: the file format is ours
                warnings.simplefilter("ignore", FutureWarning)
                self.module = torch.jit.load(str(self.path), map_location="cpu").eval()
        except Exception as exc:  # noqa: BLE001
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ExportError(f"exported model {self.path} is not a readable TorchScript file ({first[:200]})") from None

    def _run(self, x: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.module(torch.from_numpy(x)).numpy()


def load_extractor(path: str | Path, **kwargs: Any) -> OnnxExtractor | TorchScriptExtractor:
    """The extractor for exported file ``path``, by the backend its sidecar records."""
    backend = read_sidecar(path)["backend"]
    return (OnnxExtractor if backend == "onnx" else TorchScriptExtractor)(path, **kwargs)


#: The steps of a preprocessing record (:func:`fedreid.inference.images.preprocessing_record`) that change
#: the numbers a model is fed; its prose (``decode``, ``formula``) may be reworded between versions.
PREPROCESSING_STEPS = ("color", "resize", "scale", "mean", "std", "layout", "dtype")


def check_preprocessing(extractor: "_Extractor") -> None:
    """Refuse an exported file whose recorded preprocessing is not the one this version prepares images with.

    ``index``, ``query`` and ``serve`` feed an exported file images prepared
    by this version's test transform; a file exported by a version that
    prepared them otherwise (its sidecar's ``input.preprocessing_spec``) would
    give features of differently prepared images without a word. A sidecar
    of an older export that records prose only is not checked.
    """
    from fedreid.inference.images import preprocessing_record

    spec = (extractor.meta.get("input") or {}).get("preprocessing_spec")
    if not isinstance(spec, Mapping):
        return
    ours = preprocessing_record(extractor.height, extractor.width)
    differs = [step for step in PREPROCESSING_STEPS if spec.get(step) != ours[step]]
    if differs:
        step = differs[0]
        raise ExportError(
            f"exported model {extractor.path} expects images prepared with {step} {spec.get(step)!r} (its "
            f"sidecar's input.preprocessing_spec) but this version prepares them with {ours[step]!r}: "
            "export it again with this version"
        )


def load_exported_model(path: str | Path, **kwargs: Any) -> LoadedModel:
    """An exported file as a :class:`~fedreid.inference.model_io.LoadedModel` for ``index`` / ``query``.

    Its ``fingerprint`` is the one recorded at export plus ``backend`` (``onnx`` /
    ``torchscript``) and ``export_sha256`` (the file's SHA-256). An index built
    with it is queried by any model of the same weights, input size and feature
    definition (the PyTorch model, another export of it); another model is
    refused as always, unless --allow-model-mismatch (an export that records no
    weights digest: only by the same file). Its ``model`` is None and its ``extractor`` (:func:`load_extractor`)
    computes the features: ``model_features`` runs the file on the CPU, an ONNX
    file without torch. A file whose recorded preprocessing is not this
    version's is refused (:func:`check_preprocessing`).
    """
    from fedreid.inference.model_io import LoadedModel

    extractor = load_extractor(path, **kwargs)
    check_preprocessing(extractor)
    fp = dict(extractor.fingerprint, backend=extractor.backend, export_sha256=extractor.file_sha256)
    config = {"backbone": fp.get("backbone"), "height": extractor.height, "width": extractor.width,
              "backend": extractor.backend}
    return LoadedModel(model=None, config=config, source=Path(path), fingerprint=fp, extractor=extractor)


def load_feature_model(
    path: str | Path, backend: str, device: Any = "cpu", *, client: Optional[str] = None
) -> LoadedModel:
    """The :class:`~fedreid.inference.model_io.LoadedModel` that computes features for ``backend``.

    ``pytorch``: ``path`` is a run folder, ``model_final.pt`` or ``checkpoint.pt``
    (:func:`~fedreid.inference.model_io.load_model`, on ``device``; ``client`` picks a
    local-training baseline's model). ``onnx`` / ``torchscript``: ``path`` is a file
    written by :func:`export_model` in that format (:func:`load_exported_model`, CPU);
    ``client`` does not apply. Raises :class:`ExportError` for a file of the other format.
    """
    if backend not in BACKENDS:
        raise ExportError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "pytorch":
        from fedreid.inference.model_io import load_model

        return load_model(path, device, client=client)
    if client:
        raise ExportError(f"--client does not apply to --backend {backend} (an exported file is one model)")
    recorded = read_sidecar(path)["backend"]
    if recorded != backend:
        raise ExportError(f"--backend {backend}: {path} was exported as {recorded}")
    return load_exported_model(path)
