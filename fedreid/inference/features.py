"""Feature extraction for retrieval, and an .npz cache of the result.

Loader contract: any iterable of batches, each either

* a tuple/list ``(images, pids, camids, paths)``, where only ``images`` is
  required and the trailing items may be left out (``(images,)``,
  ``(images, pids)``, ...), or
* a dict with key ``"images"`` and optional ``"pids"``, ``"camids"``,
  ``"paths"``;

``images`` is a float tensor [B, 3, H, W], already normalised as the model
expects; ``pids``/``camids`` are int tensors, arrays or lists of length B;
``paths`` a list of B strings. Every batch must carry the same fields.

Convention (FedReID, Zhuang et al., ACM MM 2020; layumi's test.py): the
feature of an image is ``model(x) + model(flip_lr(x))``, then L2-normalised,
so retrieval by inner product is retrieval by cosine similarity.

:func:`extract_features` runs a PyTorch model; :func:`collect_features` runs
any function of a batch of images (an exported file's extractor,
:mod:`fedreid.inference.export`) over the same loader contract, and then
``images`` may be numpy arrays. This module imports torch only inside the
functions that run a PyTorch model.
"""

from __future__ import annotations

import json
import sys
import warnings
import zipfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from fedreid.errors import EvalDataError
from fedreid.utils.filecheck import describe_kind, file_kind
from fedreid.utils.io import atomic_path

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "FEATURE_KEYS",
    "DegenerateFeaturesError",
    "FeatureSet",
    "channels_last_model",
    "check_features",
    "collect_features",
    "extract_features",
    "load_features",
    "save_features",
    "with_progress",
]

FIELDS = ("images", "pids", "camids", "paths")
#: Keys every feature cache holds.
FEATURE_KEYS = ("features", "pids", "camids", "paths", "meta")
_CHECK_ELEMENTS = 1 << 22  # elements per chunk of check_features: no full-size masks
#: Bytes of torch features :func:`collect_features` holds before one copy to the host.
FEATURE_CHUNK_BYTES = 64 << 20


class FeatureSet(NamedTuple):
    """Features [N, d] float32 and what the loader gave with them (None when it gave nothing)."""

    features: np.ndarray
    pids: np.ndarray | None
    camids: np.ndarray | None
    paths: list[str] | None


def _batch_fields(batch: Any) -> dict[str, Any]:
    """The loader contract: a tuple/list (images[, pids[, camids[, paths]]]) or a dict."""
    if isinstance(batch, dict):
        if "images" not in batch:
            raise EvalDataError(f"a dict batch needs an 'images' key, got keys {sorted(batch)}")
        return {name: batch[name] for name in FIELDS if name in batch}
    if isinstance(batch, (tuple, list)):
        if not 1 <= len(batch) <= len(FIELDS):
            raise EvalDataError(
                f"a tuple batch is (images, pids, camids, paths) or a prefix of it, got {len(batch)} items"
            )
        return dict(zip(FIELDS, batch))
    raise TypeError(f"a batch must be a tuple, list or dict, got {type(batch).__name__}")


def with_progress(loader: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    """``loader``'s batches unchanged, counted in images on a progress bar (stderr) of ``total`` when ``enabled``."""
    if not enabled:
        return loader
    from tqdm import tqdm

    def counted() -> Iterator[Any]:
        with tqdm(total=total, desc=desc, unit="img", leave=False, dynamic_ncols=True) as bar:
            for batch in loader:
                yield batch
                bar.update(len(_batch_fields(batch)["images"]))

    return counted()


def _flip_lr(images: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.flip(images, dims=[3])


def _as_row_features(output: Any) -> torch.Tensor:
    import torch

    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model must return a tensor of features, got {type(output).__name__}")
    return output.reshape(output.shape[0], -1).float()  # [B, d, 1, 1] pooled maps become [B, d]


def _model_device(model: nn.Module) -> torch.device:
    import torch

    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


@contextmanager
def channels_last_model(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its 4-D parameters and buffers in channels-last memory format, for the block.

    Converting only the input would make every convolution convert its
    weights (or the activations back) on each call, losing the speedup; so
    the weights are converted too (``model.to(memory_format=channels_last)``).
    Afterwards every tensor whose strides the conversion changed gets its
    previous strides back, so callers that keep training the model (the
    training loop's evaluation) see it unchanged; values are never touched,
    only strides. A 1x1 convolution's weight counts as contiguous in both
    formats, yet the conversion restrides it: so the strides themselves are
    compared, not the formats.
    """
    import torch

    def four_d() -> dict[str, torch.Tensor]:
        # By name: Module.to() keeps Parameter objects but replaces buffer tensors.
        named = (*model.named_parameters(), *model.named_buffers())
        return {name: t for name, t in named if t.dim() == 4}

    strides = {name: t.stride() for name, t in four_d().items()}
    model.to(memory_format=torch.channels_last)
    try:
        yield model
    finally:
        for name, tensor in four_d().items():
            if tensor.stride() != strides[name]:
                before = torch.empty_strided(tensor.shape, strides[name], dtype=tensor.dtype, device=tensor.device)
                tensor.data = before.copy_(tensor.data)


def _is_tensor(value: Any) -> bool:
    """A torch tensor, found without importing torch (exported files' extractors run without it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _ids(values: Any) -> np.ndarray:
    if _is_tensor(values):
        values = values.detach().cpu().numpy()
    return np.asarray(values).astype(np.int64).reshape(-1)


def collect_features(loader: Iterable[Any], run: Callable[[Any], Any], *,
                     chunk_bytes: int = FEATURE_CHUNK_BYTES) -> FeatureSet:
    """Features of ``loader``'s batches (see the module docstring) by ``run``, with the ids and paths they carry.

    ``run`` maps one batch's ``images`` to its features ``[B, d]`` (or
    ``[B, d, 1, 1]``; an array or anything ``np.asarray`` reads), e.g. an
    exported file's extractor; rows are kept as float32 ``[B, d]``. A torch
    tensor may stay where it was computed: such results are joined and
    copied to the host once per ``chunk_bytes`` of features, so a GPU is
    waited for once per chunk rather than after every batch. No torch is
    needed unless the loader or ``run`` use it. Raises
    :class:`~fedreid.errors.EvalDataError` when the loader yields no
    batches, when batches differ in their fields, or when a field's length is
    not the number of images.
    """
    collected: dict[str, list] = {}
    present: tuple[str, ...] | None = None
    on_device: list[Any] = []  # torch results not yet copied to the host, in order
    held = 0

    def to_host() -> None:
        nonlocal held
        if on_device:
            import torch

            block = torch.cat(on_device).cpu()  # the one wait for the device of this chunk
            collected.setdefault("features", []).append(block.numpy())  # float32: each result was made so
            on_device.clear()
            held = 0

    for batch in loader:
        fields = _batch_fields(batch)
        if present is None:
            present = tuple(fields)
        elif tuple(fields) != present:
            raise EvalDataError(f"batches differ in their fields: first had {present}, a later one {tuple(fields)}")
        out = run(fields["images"])
        if _is_tensor(out):
            rows = out.detach().reshape(out.shape[0], -1).float()
            on_device.append(rows)
            held += rows.numel() * rows.element_size()
            if held >= chunk_bytes:
                to_host()
        else:
            to_host()
            feats = np.asarray(out, dtype=np.float32)
            collected.setdefault("features", []).append(feats.reshape(feats.shape[0], -1))
        for name in ("pids", "camids"):
            if name in fields:
                collected.setdefault(name, []).append(_ids(fields[name]))
        if "paths" in fields:
            collected.setdefault("paths", []).extend(str(p) for p in fields["paths"])
    to_host()

    if "features" not in collected:
        raise EvalDataError("the loader yielded no batches")
    features = np.concatenate(collected["features"])
    out = FeatureSet(
        features=features,
        pids=np.concatenate(collected["pids"]) if "pids" in collected else None,
        camids=np.concatenate(collected["camids"]) if "camids" in collected else None,
        paths=collected.get("paths"),
    )
    for name in ("pids", "camids", "paths"):
        value = getattr(out, name)
        if value is not None and len(value) != features.shape[0]:
            raise EvalDataError(f"the loader gave {len(value)} {name} for {features.shape[0]} images")
    return out


def extract_features(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    flip: bool = True,
    normalize: bool = True,
    device: str | torch.device | None = None,
    amp: bool = False,
    channels_last: bool = False,
) -> FeatureSet:
    """Run ``model`` over ``loader`` (see the module docstring) and collect features.

    The model runs in eval mode under ``torch.no_grad``; every submodule's
    train/eval flag is restored afterwards, so a model with e.g. frozen
    BatchNorm layers comes back exactly as it was. ``flip`` adds the
    features of the horizontally flipped images; ``normalize`` L2-normalises
    the (summed) features (all-zero features stay zero).

    ``device``: where to run; default the model's (first parameter's)
    device. The model is not moved: put it on ``device`` yourself.
    ``amp`` (float16 autocast) and ``channels_last`` are CUDA-only speedups:
    on another device they are not applied and a ``UserWarning`` says so,
    once per call. Without ``amp`` the model runs under the caller's
    autocast, if any (:class:`fedreid.fl.evaluation.Evaluator`'s
    ``eval.precision``); features are float32 either way.
    ``channels_last`` converts the inputs and, for the duration of the call,
    the model's weights (:func:`channels_last_model`).

    Returns a :class:`FeatureSet` (a named tuple ``features, pids, camids,
    paths``); fields the loader did not provide are None. Errors of the
    loader contract: as :func:`collect_features`.
    """
    import torch
    from torch import nn

    device = torch.device(device) if device is not None else _model_device(model)
    on_cuda = device.type == "cuda"
    if (amp or channels_last) and not on_cuda:
        requested = " and ".join(name for name, on in (("amp", amp), ("channels_last", channels_last)) if on)
        warnings.warn(
            f"{requested} ignored: only used on CUDA, extracting on {device}", UserWarning, stacklevel=2
        )
    use_amp, use_channels_last = amp and on_cuda, channels_last and on_cuda

    def run(images: torch.Tensor) -> np.ndarray:
        images = images.to(device, non_blocking=True)
        if use_channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        feats = _as_row_features(model(images))
        if flip:
            feats = feats + _as_row_features(model(_flip_lr(images)))
        if normalize:
            feats = nn.functional.normalize(feats, p=2, dim=1)
        return feats  # on the device: collect_features copies chunks, not every batch

    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if use_amp:  # a disabled autocast would switch off the caller's (the evaluator's eval.precision)
                stack.enter_context(torch.autocast("cuda", dtype=torch.float16))
            if use_channels_last:
                stack.enter_context(channels_last_model(model))
            return collect_features(loader, run)
    finally:
        # Per module, not model.train(flag): that would overwrite mixed modes.
        for module, training in modes.items():
            module.training = training


class DegenerateFeaturesError(EvalDataError):
    """Features that cannot rank anything: NaN/inf values, all rows zero, or all rows identical."""


def check_features(
    features: np.ndarray, where: str, *, paths: Sequence[str] | None = None, identical_ok: bool = False
) -> None:
    """Refuse features whose retrieval figures would be meaningless; ``where`` names their source.

    Raises :class:`DegenerateFeaturesError` (an :class:`EvalDataError`, a
    ValueError) when a row holds NaN or inf (naming the first such row and,
    given ``paths``, its image), when every row is zero, or when there are at
    least two rows and all are identical: every gallery item would then tie
    with every other, and CMC/mAP would come from the tie rule, not from the
    model (``identical_ok`` allows that last case, for query images that may
    be copies of one another). ``where`` starts the message (e.g. ``"feature file X: query"``,
    ``"model M on folder F"``). Arrays that are not 2-D floating point, and
    empty ones, pass here: the metrics name those problems. Works in chunks,
    so a large gallery needs no full-size mask.
    """
    x = np.asarray(features)
    if x.ndim != 2 or x.dtype.kind != "f" or x.shape[0] == 0:
        return
    n = x.shape[0]
    first = x[0].copy()
    all_zero = all_same = True
    rows_per_chunk = max(1, _CHECK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, n, rows_per_chunk):
        chunk = x[start : start + rows_per_chunk]
        finite = np.isfinite(chunk).all(axis=1)
        if not finite.all():
            row = start + int(np.flatnonzero(~finite)[0])
            image = f" ({paths[row]})" if paths is not None and row < len(paths) else ""
            raise DegenerateFeaturesError(
                f"{where} row {row}{image} has NaN or inf features: "
                "the model that produced them diverged or the file is damaged"
            )
        all_zero = all_zero and not chunk.any()
        all_same = all_same and bool((chunk == first).all())
    if all_zero:
        raise DegenerateFeaturesError(
            f"{where}: all {n} feature rows are zero, so every image would tie with every other: "
            "the model gives no signal (collapsed or broken weights) or the file is damaged"
        )
    if all_same and n > 1 and not identical_ok:
        raise DegenerateFeaturesError(
            f"{where}: all {n} feature rows are identical, so every image would tie with every other: "
            "the model maps every image to one point (collapsed weights), or the images are copies of one image"
        )


# --------------------------------------------------------------------------
# The .npz cache
# --------------------------------------------------------------------------


def save_features(
    path: str | Path,
    feats: np.ndarray,
    pids: Sequence[int] | np.ndarray,
    camids: Sequence[int] | np.ndarray,
    paths: Sequence[str],
    meta: dict | None = None,
) -> Path:
    """Write features and their ids to ``path`` (.npz, no pickles), atomically.

    ``meta`` (JSON-serialisable: model, checkpoint, dataset, flip, ...) is
    stored as a JSON string. Returns the path.
    """
    path = Path(path)
    feats = np.asarray(feats, dtype=np.float32)
    pids, camids = np.asarray(pids, dtype=np.int64), np.asarray(camids, dtype=np.int64)
    paths_arr = np.asarray([str(p) for p in paths], dtype=str)
    if feats.ndim != 2:
        raise EvalDataError(f"feats must be 2-D [N, d], got shape {feats.shape}")
    lengths = {"feats": feats.shape[0], "pids": pids.size, "camids": camids.size, "paths": paths_arr.size}
    if len(set(lengths.values())) > 1:
        raise EvalDataError("mismatched lengths (" + ", ".join(f"{k}: {v}" for k, v in lengths.items()) + ")")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        # A file object, not a name: np.savez would append ".npz" to the temporary name.
        meta_json = np.array(json.dumps(meta or {}))
        np.savez(f, features=feats, pids=pids, camids=camids, paths=paths_arr, meta=meta_json)
    return path


_NOT_FEATURES = "is not a NumPy .npz of fedreid features (arrays features, pids, camids, paths, meta; written by save_features / --save-features)"


def _npz_problem(exc: BaseException) -> str:
    """A reader error in words that never suggest loading the file with pickles enabled."""
    text = str(exc)
    if "pickle" in text.lower():
        return "it holds pickled Python objects, which are never loaded (loading them can run code)"
    return f"it is a damaged archive ({text.strip().splitlines()[0] if text.strip() else type(exc).__name__})"


def load_features(path: str | Path) -> tuple[FeatureSet, dict]:
    """Read a cache written by :func:`save_features`: ``(FeatureSet, meta)``.

    The file is read with ``allow_pickle=False``: a pickle, or an archive
    holding object arrays, is refused and nothing in it runs. Raises
    FileNotFoundError for a missing file and
    :class:`~fedreid.errors.EvalDataError` (a ValueError) naming the
    file and what was expected for anything else: not an .npz, missing keys,
    arrays of the wrong kind or length, unreadable meta.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feature cache {path} does not exist")
    kind = file_kind(path)
    if kind != "zip":  # np.load would try anything else as a pickle
        raise EvalDataError(f"feature cache {path} {_NOT_FEATURES}: {describe_kind(kind)}")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise EvalDataError(f"feature cache {path} {_NOT_FEATURES}: {_npz_problem(exc)}") from None
    try:
        with data:
            present = sorted(data.files)
            arrays = {key: data[key] for key in FEATURE_KEYS if key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise EvalDataError(f"feature cache {path} {_NOT_FEATURES}: {_npz_problem(exc)}") from None
    missing = [key for key in FEATURE_KEYS if key not in arrays]
    if missing:
        raise EvalDataError(f"feature cache {path} is missing keys {missing} (has {present}); it {_NOT_FEATURES}")
    expected = {
        "features": (2, "f", "a 2-D float array"),
        "pids": (1, "iu", "a 1-D integer array"),
        "camids": (1, "iu", "a 1-D integer array"),
        "paths": (1, "U", "a 1-D string array"),
        "meta": (0, "U", "a JSON string"),
    }
    for key, (ndim, kinds, what) in expected.items():
        a = arrays[key]
        if a.ndim != ndim or (a.dtype.kind not in kinds and not (a.size == 0 and ndim == 1)):
            raise EvalDataError(
                f"feature cache {path}: {key!r} should be {what}, got shape {a.shape} of dtype {a.dtype}; "
                f"the file {_NOT_FEATURES}"
            )
    lengths = {key: len(arrays[key]) for key in ("features", "pids", "camids", "paths")}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise EvalDataError(f"feature cache {path} has mismatched lengths ({listing})")
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError as exc:
        raise EvalDataError(f"feature cache {path} has unreadable meta: {exc}") from None
    if not isinstance(meta, dict):
        raise EvalDataError(f"feature cache {path}: meta should be a JSON object, got {type(meta).__name__}")
    features = FeatureSet(
        features=arrays["features"],
        pids=arrays["pids"].astype(np.int64, copy=False),
        camids=arrays["camids"].astype(np.int64, copy=False),
        paths=[str(p) for p in arrays["paths"]],
    )
    return features, meta
