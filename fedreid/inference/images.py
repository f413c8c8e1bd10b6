"""Image files and folders as evaluation input: listing them, Market-style ids, unreadable images, features.

An unreadable image aborts with an error naming it unless the caller collects
them (``skipped``), in which case it is left out and listed
(:class:`SkippedImage`, :func:`write_skipped_csv`).

Images already in memory (an upload's bytes, a PIL image, an RGB array) get
the same preprocessing and features as image files: :func:`decode_image_bytes`
decodes as :func:`fedreid.data.images.read_image` does, and
:func:`array_features` feeds the arrays through the same test transform and
:func:`~fedreid.inference.model_io.model_features` as :func:`image_features`.

A PyTorch model gets tensor batches (:func:`fedreid.data.transforms.build_test_transform`);
an exported model (``loaded.extractor``) gets the same values as numpy
batches (:func:`~fedreid.data.transforms.build_test_array_transform`), so
an ONNX file's features need no torch.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import numpy as np

from fedreid.errors import EvalDataError
from fedreid.inference.errors import EvalInputError
from fedreid.inference.features import FeatureSet, check_features, with_progress
from fedreid.inference.model_io import LoadedModel, model_features

if TYPE_CHECKING:
    import torch

__all__ = [
    "IMAGE_EXTENSIONS",
    "SKIPPED_FILE",
    "SkippedImage",
    "list_images",
    "parse_market_name",
    "image_features",
    "decode_image_bytes",
    "array_features",
    "preprocessing_record",
    "write_skipped_csv",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
_MARKET_NAME = re.compile(r"^(-?\d+)_c(\d+)")
#: The list of images left out (``path,reason``), in an index folder or a query's --out folder.
SKIPPED_FILE = "skipped.csv"


def list_images(path: str | Path, what: str = "gallery") -> list[Path]:
    """An image file, or every jpg/png/bmp under a folder (recursive, sorted)."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise EvalInputError(f"{what} file {path} is not a jpg/png/bmp image")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{what} path {path} does not exist")
    images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not images:
        raise EvalInputError(f"{what} folder {path} holds no jpg/png/bmp images")
    return images


def parse_market_name(path: str | Path) -> tuple[int, int]:
    """``(pid, camid)`` from a Market-style name ``0002_c1s1_...`` (camera 0-based), else ``(-1, -1)``."""
    match = _MARKET_NAME.match(Path(path).name)
    if match is None:
        return -1, -1
    return int(match.group(1)), int(match.group(2)) - 1


@dataclass(frozen=True)
class SkippedImage:
    """An image left out because it could not be read: its path and why (fixed words, no addresses)."""

    path: str
    reason: str


def _skip_reason(exc: BaseException) -> str:
    import cv2

    from fedreid.data.images import opencv_refusal

    cause = exc.__cause__
    if isinstance(cause, OSError):
        return f"cannot read the file ({cause.strerror or type(cause).__name__})"
    if isinstance(cause, cv2.error):
        return f"cannot decode the image: {opencv_refusal(cause)}"
    return "cannot decode the image (empty, corrupt or not an image)"


def _collate(batch: Sequence[tuple[Any, int, int, str]], stack: Callable[[Sequence[Any]], Any]) -> dict[str, Any]:
    """``(image, pid, camid, path)`` items as one batch of the loader contract; ``stack`` joins the images."""
    images, pids, camids, names = zip(*batch)
    return {
        "images": stack(images),
        "pids": np.array(pids, dtype=np.int64),
        "camids": np.array(camids, dtype=np.int64),
        "paths": list(names),
    }


def _preprocessing(loaded: LoadedModel) -> tuple[Callable[[np.ndarray], Any], Callable[[Sequence], dict[str, Any]]]:
    """``(transform, collate)`` of ``loaded``'s input: numpy for an exported file, tensors for a PyTorch model."""
    from fedreid.data import transforms

    height, width = int(loaded.config["height"]), int(loaded.config["width"])
    if loaded.extractor is not None:
        return transforms.build_test_array_transform(height, width), lambda batch: _collate(batch, np.stack)
    import torch

    return transforms.build_test_transform(height, width), lambda batch: _collate(batch, torch.stack)


def preprocessing_record(height: int, width: int) -> dict[str, Any]:
    """What an image goes through before a ``height x width`` model sees it, as plain values.

    Read from the test transform itself (the one :func:`_preprocessing` gives
    an exported model, whose steps the PyTorch path's tensor transform
    shares), not typed again: the decoder, the colour order, the resize
    (OpenCV interpolation, no antialiasing), ``scale`` (1 / the transform's
    ``max_pixel_value``), per-channel ``mean`` and ``std``, and the layout.
    One image's input is ``((resize(rgb) * scale - mean) / std)`` transposed to
    ``[3, H, W]`` float32; a batch stacks them (NCHW). The exported files'
    sidecars record it (:func:`fedreid.inference.export.export_model`).
    """
    import albumentations as A
    import cv2

    from fedreid.data import transforms

    steps = transforms.build_test_array_transform(int(height), int(width)).compose.transforms
    resize = next(t for t in steps if isinstance(t, A.Resize))
    normalize = next(t for t in steps if isinstance(t, A.Normalize))
    names = {getattr(cv2, n): f"cv2.{n}" for n in ("INTER_NEAREST", "INTER_LINEAR", "INTER_CUBIC", "INTER_AREA",
                                                   "INTER_LANCZOS4", "INTER_LINEAR_EXACT", "INTER_NEAREST_EXACT")}
    return {
        "decode": "OpenCV imdecode IMREAD_COLOR (EXIF orientation applied, alpha dropped, 16-bit to high byte)",
        "color": "RGB",
        "resize": {"height": int(resize.height), "width": int(resize.width),
                   "interpolation": names.get(resize.interpolation, str(resize.interpolation)),
                   "antialias": bool(getattr(resize, "area_for_downscale", None))},
        "scale": 1.0 / float(normalize.max_pixel_value),
        "mean": [float(v) for v in normalize.mean],
        "std": [float(v) for v in normalize.std],
        "formula": "(pixel * scale - mean) / std, per channel",
        "layout": "NCHW",
        "dtype": "float32",
    }


def _image_batches(
    loaded: LoadedModel, paths: Sequence[Path], batch_size: int, skipped: Optional[list[SkippedImage]]
) -> Iterator[dict[str, Any]]:
    """Batches of ``loaded``'s input in the loader contract of :mod:`fedreid.inference.features`, in ``paths`` order.

    An unreadable image is appended to ``skipped`` and left out, or, when
    ``skipped`` is None, an :class:`EvalInputError` naming it.
    """
    from fedreid.data.images import ImageReadError, read_image

    transform, collate = _preprocessing(loaded)
    batch: list[tuple[Any, int, int, str]] = []
    for path in paths:
        try:
            image = read_image(path)
        except ImageReadError as exc:
            if skipped is None:
                raise EvalInputError(
                    f"{exc}: pass --skip-bad-images to list unreadable images in {SKIPPED_FILE} and go on"
                ) from None
            skipped.append(SkippedImage(str(path), _skip_reason(exc)))
            continue
        pid, camid = parse_market_name(path)
        batch.append((transform(image), pid, camid, str(path)))
        if len(batch) == batch_size:
            yield collate(batch)
            batch = []
    if batch:
        yield collate(batch)


def image_features(
    loaded: LoadedModel,
    paths: Sequence[Path],
    *,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    amp: bool = False,
    channels_last: bool = False,
    skipped: Optional[list[SkippedImage]] = None,
    where: str = "images",
    identical_ok: bool = False,
    progress: bool = False,
) -> FeatureSet:
    """Features of image files, with Market-style ids/cameras (-1 when the name has none).

    ``skipped``: None aborts at the first unreadable image (an
    :class:`EvalInputError` naming it); a list collects them
    (:class:`SkippedImage`, in ``paths`` order) and the features cover the
    readable images only, in order (none readable is an error). The features
    pass :func:`~fedreid.inference.features.check_features`, whose errors name the
    model and ``where`` (e.g. ``"gallery photos/"``); ``identical_ok``
    allows all-identical rows (query images may be copies of one another).
    ``progress``: a bar of the images read, on stderr.
    """
    if int(batch_size) < 1:
        raise EvalInputError(f"--batch-size must be >= 1, got {batch_size}")
    first_skip = len(skipped) if skipped is not None else 0
    batches = with_progress(_image_batches(loaded, paths, int(batch_size), skipped), len(paths), where, progress)
    try:
        fs = model_features(loaded, batches, device, amp=amp, channels_last=channels_last)
    except EvalDataError:
        if skipped is not None and len(skipped) - first_skip == len(paths):
            raise EvalInputError(
                f"none of the {len(paths)} images of {where} could be read (e.g. {skipped[first_skip].path}: "
                f"{skipped[first_skip].reason})"
            ) from None
        raise
    check_features(fs.features, f"model {loaded.source} on {where}", paths=fs.paths, identical_ok=identical_ok)
    return fs


def decode_image_bytes(data: bytes, what: str = "image") -> np.ndarray:
    """An encoded image (JPEG/PNG/BMP/... bytes) as an RGB uint8 ``[H, W, 3]`` array, decoded as files are.

    The same decoder and flags as :func:`fedreid.data.images.read_image`
    (OpenCV, colour, EXIF orientation applied, grey becomes RGB, alpha
    dropped), so the bytes of a gallery file give the very pixels its path
    gives. Empty or undecodable bytes (OpenCV's own refusals included, such as
    more pixels than ``CV_IO_MAX_IMAGE_PIXELS``) raise :class:`EvalInputError`
    naming ``what``.
    """
    import cv2

    from fedreid.data.images import opencv_refusal

    buffer = np.frombuffer(memoryview(data), dtype=np.uint8)
    if buffer.size == 0:
        raise EvalInputError(f"{what} is empty (0 bytes): expected an encoded image (JPEG, PNG, BMP)")
    try:
        image = cv2.imdecode(buffer, cv2.IMREAD_COLOR)
    except cv2.error as exc:
        raise EvalInputError(f"{what} cannot be decoded: {opencv_refusal(exc)}") from None
    if image is None:
        raise EvalInputError(f"{what} cannot be decoded: expected an encoded image (JPEG, PNG, BMP), not {buffer.size} "
                             "bytes of something else or a damaged file")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _rgb_array(image: Any, i: int) -> np.ndarray:
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
            raise EvalInputError(f"image {i}: expected an RGB uint8 array [H, W, 3], got {image.dtype} {image.shape}")
        return image
    from PIL import Image, ImageOps

    if isinstance(image, Image.Image):
        image = ImageOps.exif_transpose(image)  # OpenCV turns a file by its EXIF orientation too
        if image.mode.startswith("I;16") or image.mode == "I":
            # 16-bit grey: OpenCV keeps the high byte; PIL's convert("RGB") would clip at 255
            grey = (np.asarray(image).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
            return np.repeat(grey[..., None], 3, axis=2)
        return np.asarray(image.convert("RGB"))
    raise EvalInputError(f"image {i}: expected an RGB uint8 array [H, W, 3] or a PIL image, got {type(image).__name__}")


def array_features(
    loaded: LoadedModel,
    images: Sequence[Any],
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
) -> np.ndarray:
    """Features [N, d] float32 of in-memory images: RGB uint8 ``[H, W, 3]`` arrays or PIL images.

    The preprocessing and model call of :func:`image_features` (the test
    transform: resize to the model's height x width, ImageNet mean/std; then
    :func:`~fedreid.inference.model_io.model_features`: flip-averaged,
    L2-normalised, or the exported file's own feature), so an image gives
    the same feature from memory as from a file. PIL images are turned by
    their EXIF orientation and converted to RGB (16-bit grey by its high
    byte), as OpenCV reads files; decode bytes with :func:`decode_image_bytes`
    to match files exactly (PIL's JPEG decoder may differ from OpenCV's by a
    few levels).
    Safe to call from several threads at once (each call builds its own transform).
    """
    if int(batch_size) < 1:
        raise EvalInputError(f"batch_size must be >= 1, got {batch_size}")
    if len(images) == 0:
        raise EvalInputError("no images to compute features of")
    arrays = [_rgb_array(image, i) for i, image in enumerate(images)]
    transform, collate = _preprocessing(loaded)

    def batches() -> Iterator[dict[str, Any]]:
        for start in range(0, len(arrays), int(batch_size)):
            part = arrays[start : start + int(batch_size)]
            yield collate([(transform(a), -1, -1, f"<image {start + j}>") for j, a in enumerate(part)])

    return model_features(loaded, batches(), device).features


def write_skipped_csv(path: str | Path, skipped: Sequence[SkippedImage]) -> Path:
    """``path`` (atomically): a ``path,reason`` header and one row per skipped image, in order."""
    from fedreid.utils.io import write_text_atomic

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "reason"])
    writer.writerows([s.path, s.reason] for s in skipped)
    write_text_atomic(path, buffer.getvalue())
    return Path(path)
